"""Atomic checkpoints of a training run, and resuming from them.

A checkpoint is a folder ``checkpoints/step<N>/`` with the model (weights and optimizer), the VecNormalize
statistics, the RNG states and a small ``meta.json``. It is written under a temporary name and renamed into
place, and ``checkpoints/latest`` (a one-line file, also replaced atomically) names the newest complete one.
A crash at any moment leaves either the previous or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecNormalize


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync it, and rename it onto ``path``: readers see the old or the
    new file, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


LOCK_NAME = ".lock"


class RunFolderBusy(RuntimeError):
    """Another live process trains into the same run folder."""


@contextlib.contextmanager
def run_folder_lock(folder: Path):
    """Hold an exclusive lock on ``folder`` (a run folder) while the block runs.

    Two processes training into one folder would interleave their checkpoints and event files, so the second
    one fails at once with the first one's pid. The lock is ``flock`` on ``folder/.lock``: the kernel drops it
    when the holder exits, however it exits (SIGKILL included), so a dead run never blocks its own resume.
    On systems without ``fcntl`` (Windows) no lock is taken.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise RunFolderBusy(f"run folder {folder} is in use by another training process (pid {holder}); "
                                "wait for it to end or stop it, then --resume") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(model: BaseAlgorithm, root: Path, keep: int = 2) -> Path:
    """Write ``root/step<N>`` atomically and point ``root/latest`` at it; keep the newest ``keep``."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step{model.num_timesteps}"
    tmp = root / f".step{model.num_timesteps}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save(tmp / "model.zip")
    venv = model.get_vec_normalize_env()
    if venv is not None:
        venv.save(str(tmp / "vecnormalize.pkl"))
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "meta.json").write_text(json.dumps({"num_timesteps": model.num_timesteps, "time": time.time()}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_text_atomic(root / "latest", final.name + "\n")
    steps = sorted((p for p in root.glob("step*") if p.is_dir()), key=lambda p: int(p.name[4:]))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder under ``root``, or None."""
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "model.zip").exists() else None


def load_vecnormalize(checkpoint: Path, venv):
    """Wrap ``venv`` with the VecNormalize statistics saved in ``checkpoint`` (if any)."""
    path = checkpoint / "vecnormalize.pkl"
    return VecNormalize.load(str(path), venv) if path.exists() else venv


class CheckpointCallback(BaseCallback):
    """Save an atomic checkpoint every ``every`` env steps.

    Checked when a rollout starts, i.e. after the previous rollout's update: a checkpoint holds a whole
    number of rollouts *and* their updates, so resuming repeats no update and skips none.
    """

    def __init__(self, root: Path, every: int, keep: int = 2, verbose: int = 0):
        super().__init__(verbose)
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 env step, got {every}")
        self.root, self.every, self.keep = Path(root), int(every), keep
        self._last = 0

    def _on_training_start(self) -> None:
        self._last = self.model.num_timesteps

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        if self.model.num_timesteps - self._last >= self.every:
            path = save_checkpoint(self.model, self.root, self.keep)
            self._last = self.model.num_timesteps
            if self.verbose:
                print(f"checkpoint: {path}")
