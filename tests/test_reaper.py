"""The reaper: what a process started is ended when it dies without cleaning up, and left alone when it ends well."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlseq import reaper

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads Linux /proc")
REPO = Path(__file__).resolve().parents[1]

# a driver: starts a shell that starts a grandchild, then its reaper (start returns once the reaper has listed
# both), prints the grandchild's pid, and ends its reaper normally when told "stop"
DRIVER = """
import subprocess, sys, time
from rlseq import reaper
child = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
grandchild = child.stdout.readline().strip()  # it runs: the shell prints its pid after starting it
r = reaper.start(grace_s=5.0, timeout_s=600)
print(grandchild, flush=True)
if sys.argv[1] == "stop":
    reaper.stop(r)
print("ready", flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    return reaper._stat(pid) is not None  # a zombie has ended


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _driver(mode: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, mode], stdout=subprocess.PIPE, text=True, env=env)
    grandchild = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "ready"
    return proc, grandchild


def test_a_process_killed_outright_has_what_it_started_ended():
    proc, grandchild = _driver("keep")
    try:
        assert _alive(grandchild)
        proc.kill()  # SIGKILL: nothing in the driver runs
        proc.wait()
        assert _gone_within(grandchild, 15), "the orphaned grandchild outlived the killed driver"
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_a_normal_end_leaves_everything_alone():
    proc, grandchild = _driver("stop")
    try:
        proc.kill()
        proc.wait()
        assert not _gone_within(grandchild, 2.0), "a reaper told `done` still ended a process"
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_trainers_and_what_they_started_are_left_to_their_own_stop(monkeypatch):
    parent = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"])
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 10
        while len(reaper.descendants(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        kids = sorted(reaper.descendants(parent.pid))
        assert len(kids) == 2
        exec_done = threading.Event()  # kids[0] becomes a trainer only after the reaper has seen it
        monkeypatch.setattr(reaper, "_is_trainer", lambda pid: pid == kids[0] and exec_done.is_set())
        read, write = os.pipe()
        result: list[int] = []
        listed = threading.Event()
        watcher = threading.Thread(target=lambda: result.append(reaper.watch(parent.pid, read, grace_s=5.0,
                                                                             on_first_list=listed.set)))
        watcher.start()
        assert listed.wait(60)  # seen while still its parent's fork
        exec_done.set()
        assert sorted(reaper.descendants(parent.pid)) == kids[1:]
        time.sleep(4 * reaper.POLL_S)
        os.close(write)  # EOF without `done`: the watched process is taken to have died
        watcher.join(30)
        os.close(read)
        assert result == [1]
        assert _gone_within(kids[1], 5) and _alive(kids[0])
    finally:
        for pid in [*kids, parent.pid]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait()
