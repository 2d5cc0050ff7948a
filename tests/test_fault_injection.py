"""Fault injection: a tiny run killed with SIGKILL at random points (inside saves too), resumed each time, ends
at its budget with the expected checkpoints and one TensorBoard point per rollout, none twice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlseq.train import main as train_main

REPO = Path(__file__).resolve().parents[1]
ENV = "popgym-RepeatPreviousEasy-v0"
ROLLOUT, TOTAL, KILLS = 8, 160, 3  # 2 envs x 4 steps, a checkpoint at every rollout

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open") or not hasattr(os, "fork"),
                                reason="kills through a pidfd (Linux), in forked processes")


# forks a training process per command line it reads (JSON argv), each one ``python -m rlseq.train``'s main with the
# imports done once, in the server (seconds each, on a loaded 2-core machine most of this test's time); it prints
# the child's pid first and ``exit <status>`` (negative: the signal) on a line of its own once it has reaped it
_FORK_SERVER = """
import json, os, sys
import torch._dynamo  # imported by the first optimizer a run builds
import rlseq.algos, rlseq.envs, rlseq.train

while line := sys.stdin.readline():
    pid = os.fork()
    if pid == 0:
        print(f"pid {os.getpid()}", flush=True)
        rlseq.train.main(json.loads(line))
        sys.exit(0)
    print(f"\\nexit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)
"""


def _read_until(server: subprocess.Popen, lines: list[str], *starts: str) -> str:
    """Append ``server``'s output lines to ``lines`` up to one that starts with one of ``starts``; returns it."""
    while True:
        line = server.stdout.readline()
        assert line, "the fork server ended:\n" + "".join(lines)
        lines.append(line)
        if line.startswith(starts):
            return line


def _train_until_killed(server: subprocess.Popen, argv: list[str], delay: float) -> bool:
    """Train ``argv`` in a process forked by ``server``; once it trains (its third rollout has started), wait
    ``delay`` s and SIGKILL it. Returns whether it was killed (it may have finished first)."""
    server.stdin.write(json.dumps(argv) + "\n")
    server.stdin.flush()
    lines: list[str] = []
    pid = int(_read_until(server, lines, "pid ").split()[1])
    pidfd = os.pidfd_open(pid)  # signals through it reach that process only, never a later one with its pid
    try:
        if _read_until(server, lines, "measured", "exit ").startswith("measured"):  # the progress estimate's line
            time.sleep(delay)
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:  # it finished first
                pass
            _read_until(server, lines, "exit ")
    finally:
        os.close(pidfd)
    code = int(lines[-1].split()[1])
    assert code in (0, -signal.SIGKILL), "".join(lines)
    return code == -signal.SIGKILL


def _curve(folder: Path, tag: str = "time/fps") -> list[int]:
    """The steps of ``tag`` as TensorBoard shows them (all event files, purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_kill_9_at_random_points_then_resume_loses_no_checkpoint_and_logs_each_step_once(tmp_path):
    rng = random.Random(1)  # fixed: a failure names kill points that reproduce
    argv = ["--env", ENV, "--memory", "none", "--n-envs", "2", "--n-steps", "4", "--n-minibatches", "1",
            "--n-epochs", "1", "--checkpoint-every", str(ROLLOUT), "--total-steps", str(TOTAL), "--logdir",
            str(tmp_path), "--no-progress-bar"]
    folder = tmp_path / ENV / "none" / "seed0"
    delays = [rng.uniform(0.0, 1.5) for _ in range(KILLS)]
    killed = 0
    server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
    try:
        for delay in delays:
            killed += _train_until_killed(server, argv + (["--resume"] if folder.exists() else []), delay)
            if (folder / "final_model.zip").exists():
                break
    finally:
        server.stdin.close()  # it ends
        server.wait(timeout=60)
    assert killed >= 1, "every process finished before its kill: the run is too short to test anything"
    train_main(argv + ["--resume"])

    from rlseq.algos import MemoryPPO

    assert MemoryPPO.load(folder / "final_model.zip", device="cpu").num_timesteps == TOTAL, delays
    ckpt = folder / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", f"step{TOTAL - ROLLOUT}", f"step{TOTAL}"], delays
    assert (ckpt / "latest").read_text().strip() == f"step{TOTAL}"
    steps = [s for s in _curve(folder) if s > 0]
    assert steps == list(range(ROLLOUT, TOTAL + 1, ROLLOUT)), (delays, steps)


# saves step8 twice (a "first", then a "second" copy), SIGKILLed inside the second save at the rename that argv[2]
# names: the new copy's (the old one is then out of the way) or the latest pointer's (the new one is in place)
_RESAVE_KILLED = """
import os, signal, sys, zipfile
from pathlib import Path
import rlseq.checkpoint as C

class Stub:
    num_timesteps = 8
    def __init__(self, tag):
        self.tag = tag
    def save(self, path):
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("data", self.tag)
            z.writestr("policy.pth", b"")
    def get_vec_normalize_env(self):
        return None

root = Path(sys.argv[1])
C.save_checkpoint(Stub("first"), root)
replace = os.replace
def killing_replace(src, dst):
    if Path(src).name.startswith(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst)
os.replace = killing_replace
C.save_checkpoint(Stub("second"), root)
"""


@pytest.mark.parametrize("killed_at,kept", [(".step8.tmp", "first"), (".latest.tmp", "second")])
def test_a_save_of_the_same_step_killed_midway_keeps_an_intact_copy(tmp_path, killed_at, kept):
    import zipfile

    from rlseq.checkpoint import checkpoint_problem, remove_stale_temporaries, resumable_checkpoint

    root = tmp_path / "checkpoints"
    proc = subprocess.run([sys.executable, "-c", _RESAVE_KILLED, str(root), killed_at], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    remove_stale_temporaries(root)
    assert resumable_checkpoint(root) == (root / "step8", [])
    assert checkpoint_problem(root / "step8") is None
    assert zipfile.ZipFile(root / "step8" / "model.zip").read("data").decode() == kept
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step8"]
