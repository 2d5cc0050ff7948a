"""Fault injection: a tiny run killed with SIGKILL at random points (inside saves too), resumed each time, ends
at its budget with the expected checkpoints and one TensorBoard point per rollout, none twice."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlseq.train import main as train_main

REPO = Path(__file__).resolve().parents[1]
ENV = "popgym-RepeatPreviousEasy-v0"
ROLLOUT, TOTAL, KILLS = 8, 160, 3  # 2 envs x 4 steps, a checkpoint at every rollout


def _train_until_killed(argv: list[str], delay: float) -> bool:
    """Start ``python -m rlseq.train argv``; once it trains (its second rollout has started), wait ``delay`` s and
    SIGKILL it. Returns whether it was killed (it may have finished first)."""
    proc = subprocess.Popen([sys.executable, "-m", "rlseq.train", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    lines = []
    for line in proc.stdout:  # ProgressEstimate's line comes at the second rollout start
        lines.append(line)
        if line.startswith("measured"):
            break
    time.sleep(delay)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGKILL), "".join(lines) + rest
    return proc.returncode == -signal.SIGKILL


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
    for delay in delays:
        killed += _train_until_killed(argv + (["--resume"] if folder.exists() else []), delay)
        if (folder / "final_model.zip").exists():
            break
    assert killed >= 1, "every process finished before its kill: the run is too short to test anything"
    train_main(argv + ["--resume"])

    from rlseq.algos import MemoryPPO

    assert MemoryPPO.load(folder / "final_model.zip", device="cpu").num_timesteps == TOTAL, delays
    ckpt = folder / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", f"step{TOTAL - ROLLOUT}", f"step{TOTAL}"], delays
    assert (ckpt / "latest").read_text().strip() == f"step{TOTAL}"
    steps = [s for s in _curve(folder) if s > 0]
    assert steps == list(range(ROLLOUT, TOTAL + 1, ROLLOUT)), (delays, steps)
