"""Ends what a process started when it dies without cleaning up (SIGKILL, the OOM killer).

The sweep starts Ray inside itself. Killed outright, it takes Ray's GCS and raylet with it (Ray ties them to their
parent), but the raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) are orphaned and live on for
minutes, one of them listening on 127.0.0.1. A reaper is a small process beside the sweep that keeps a list of
the sweep's descendants (Linux ``/proc``) and, when the sweep's end of a pipe closes without a word, stops those
still running: SIGTERM, then SIGKILL after a few seconds (an agent that lost its raylet takes minutes over
SIGTERM). Trainers (``python -m rlseq.train``) and what they started are left alone: they get SIGTERM from their
own parent-death signal, and a second one would abort their stop checkpoint. A sweep that ends normally says ``done`` first and the reaper exits without touching anything.

    python -m rlseq.reaper PID [--grace S]     # stdin: the pipe from PID (or python path/to/reaper.py ...)
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc")
POLL_S = 0.5  # how often the list of descendants is refreshed: an agent started in the last POLL_S may be missed
DONE = b"done\n"
GRACE_S = 5.0
WATCHING = "watching\n"  # the reaper's one line, once it has made its first list
START_TIMEOUT_S = 30.0
TRAINER = [b"-m", b"rlseq.train"]  # argv[1:3] of a training process


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of a live process, None if it is gone (or a zombie:
    ended, waiting for a parent that may never reap it)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the name in parentheses may hold spaces
    if len(fields) < 20 or fields[0] == "Z":  # an empty read of a process that just ended, or a zombie
        return None
    return int(fields[1]), int(fields[19])


def _is_trainer(pid: int) -> bool:
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[1:3] == TRAINER


def descendants(pid: int, *, trainers: bool = False) -> dict[int, int]:
    """Every live descendant of ``pid`` (children, their children, ...) -> its start time, the identity that
    survives PID reuse; trainers and what they started only with ``trainers``. Empty without ``/proc``."""
    children: dict[int, list[tuple[int, int]]] = {}
    if not PROC.is_dir():
        return {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                children.setdefault(st[0], []).append((int(entry.name), st[1]))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in out and (trainers or not _is_trainer(child)):
                out[child] = start
                todo.append(child)
    return out


def _same(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start


def reap(known: dict[int, int], grace_s: float) -> list[int]:
    """SIGTERM each process of ``known`` that is still the same process, SIGKILL those left after ``grace_s``;
    returns the pids signalled. A trainer is skipped here too: one seen between its fork and its exec was listed
    under its parent's name."""
    hit = [pid for pid, start in known.items() if _same(pid, start) and not _is_trainer(pid)]
    for pid in hit:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_same(p, known[p]) for p in hit):
        time.sleep(0.1)
    for pid in hit:
        if _same(pid, known[pid]):
            _signal(pid, signal.SIGKILL)
    return hit


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def watch(pid: int, pipe: int, grace_s: float, on_first_list: Callable[[], None] | None = None) -> int:
    """Track ``pid``'s descendants until ``pipe`` gives ``done`` (exit 0, nothing done) or closes without it
    (``pid`` died: reap what it left). ``on_first_list`` is called once the first list is made. Returns the number
    of processes reaped."""
    me = os.getpid()
    known: dict[int, int] = {}
    said = b""
    while True:
        current = descendants(pid)
        current.pop(me, None)
        known = {p: s for p, s in known.items() if _same(p, s)}  # ended ones go before their pids are reused
        known.update(current)
        if on_first_list is not None:
            on_first_list()
            on_first_list = None
        ready, _, _ = select.select([pipe], [], [], POLL_S)
        if ready:
            chunk = os.read(pipe, 64)
            said += chunk
            if said.endswith(DONE):
                return 0
            if not chunk:  # EOF: the watched process is gone and said nothing
                return len(reap(known, grace_s))


def start(grace_s: float = GRACE_S, timeout_s: float = START_TIMEOUT_S) -> subprocess.Popen | None:
    """Start a reaper for this process (Linux only; None elsewhere) and return once it has listed what this process
    has started so far (or after ``timeout_s``, on a machine too busy to start a Python sooner). Give it to
    :func:`stop` on a normal end."""
    if not PROC.joinpath(str(os.getpid()), "stat").exists():
        return None
    # run as a file (it needs only the standard library), so that it starts whatever the working directory and
    # path; in its own session, so that a Ctrl-C to the terminal's process group does not end it first
    # (-I: isolated, so that rlseq/, the script's folder, cannot shadow a standard module)
    reaper = subprocess.Popen([sys.executable, "-I", __file__, str(os.getpid()), "--grace", str(grace_s)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              start_new_session=True, close_fds=True)
    # its first line says it is watching (EOF: it failed to start); the pipe is closed here after it
    if select.select([reaper.stdout], [], [], timeout_s)[0]:
        reaper.stdout.readline()
    reaper.stdout.close()
    return reaper


def stop(reaper: subprocess.Popen | None, *, reap: bool = False) -> None:
    """A normal end: the reaper exits without touching anything; with ``reap`` (a start that failed midway) it
    first ends what was started, as if this process had died."""
    if reaper is None:
        return
    try:
        if not reap:
            reaper.stdin.write(DONE)
        reaper.stdin.close()
    except OSError:  # it is gone already
        pass
    try:
        reaper.wait(timeout=10 + (GRACE_S if reap else 0))
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlseq.reaper", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pid", type=int, help="the process whose descendants to end if it dies")
    p.add_argument("--grace", type=float, default=GRACE_S,
                   help=f"seconds between SIGTERM and SIGKILL (default {GRACE_S:g})")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watching() -> None:  # what start() waits for; the pipe may be closed after it
        try:
            sys.stdout.write(WATCHING)
            sys.stdout.close()
        except OSError:
            pass

    watch(args.pid, sys.stdin.fileno(), args.grace, watching)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
