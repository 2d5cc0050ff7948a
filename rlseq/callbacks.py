"""Training callbacks and the TensorBoard logger of the ``rlseq.train`` CLI."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import Logger, TensorBoardOutputFormat, make_output_format


class _PurgingTensorBoard(TensorBoardOutputFormat):
    """SB3's TensorBoard output whose writer starts with ``purge_step``: TensorBoard then drops every event of the
    folder's earlier files at that step or later (what a killed run logged after its last checkpoint)."""

    def __init__(self, folder: str, purge_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=folder, purge_step=purge_step)
        self._is_closed = False


def tensorboard_logger(folder: Path, *, stdout: bool = False, purge_step: int | None = None) -> Logger:
    """SB3's logger writing TensorBoard events into ``folder`` (and the stdout table with ``stdout``); a resumed
    run passes ``purge_step`` = its checkpoint's step + 1."""
    tensorboard = (make_output_format("tensorboard", str(folder)) if purge_step is None
                   else _PurgingTensorBoard(str(folder), purge_step))
    formats = [tensorboard] + ([make_output_format("stdout", str(folder))] if stdout else [])
    return Logger(folder=str(folder), output_formats=formats)


class Progress(BaseCallback):
    """Progress of a training run from its first seconds, in place of SB3's progress bar.

    After ``first_s`` seconds it prints the acting rate and, where the run would take more than an hour at that
    rate on a CPU, that the config is sized for a GPU, with ``smaller`` (a command to use instead). After the first
    update it prints the measured rate of acting and training together and the time the run will take. Then one
    line every ``every_s`` seconds (on a terminal: the same line rewritten every second) with the env steps, the
    rate since the start and the time left at that rate, the same measure as the estimate (``lines=False``: the
    first two messages only).
    """

    def __init__(self, total: int, *, on_cpu: bool, smaller: str | None = None, first_s: float = 10.0,
                 every_s: float | None = None, lines: bool = True):
        super().__init__()
        self.total, self.on_cpu, self.smaller, self.first_s, self.lines = total, on_cpu, smaller, first_s, lines
        self.tty = sys.stdout.isatty()
        self.every_s = every_s if every_s is not None else (1.0 if self.tty else 30.0)
        self.first_printed = self.estimate_printed = False

    def _on_training_start(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.n0 = self.model.num_timesteps

    @property
    def _newline(self) -> str:
        """Ends a terminal's rewritten progress line before a message."""
        return "\n" if self.tty else ""

    def _rate(self, now: float) -> float:
        return (self.model.num_timesteps - self.n0) / max(now - self.t0, 1e-9)

    def _on_step(self) -> bool:
        now = time.perf_counter()
        if not (self.first_printed or self.estimate_printed) and now - self.t0 >= self.first_s:
            self.first_printed = True
            rate = self._rate(now)
            left = max(0, self.total - self.model.num_timesteps)
            print(f"{self._newline}first {now - self.t0:.0f} s: acting at {rate:,.0f} env-steps/s, so "
                  f"the remaining {left:,} steps take at least {_duration(left / rate)} (training comes on top; "
                  "the estimate follows the first update)", flush=True)
            if self.on_cpu and left / rate > 3600:
                print("this config is sized for a GPU" + (f"; a CPU-sized run: {self.smaller}" if self.smaller else ""),
                      flush=True)
        if self.lines and now - self.last >= self.every_s:
            self.last = now
            self._line(now)
        return True

    def _on_rollout_start(self) -> None:
        now = time.perf_counter()
        if not self.estimate_printed and self.model.num_timesteps > self.n0:
            self.estimate_printed = True
            rate, left = self._rate(now), max(0, self.total - self.model.num_timesteps)
            print(f"{self._newline}measured {rate:,.0f} env-steps/s over the first rollout and its "
                  f"update: about {_duration(left / rate)} for the remaining {left:,} steps", flush=True)

    def _on_training_end(self) -> None:
        if self.lines and self.tty:
            self._line(time.perf_counter())
            print(flush=True)

    def _line(self, now: float) -> None:
        done = self.model.num_timesteps
        rate = self._rate(now)
        text = (f"{done:,}/{self.total:,} env steps ({100 * done / max(self.total, 1):.0f}%), {rate:,.0f} env-steps/s, "
                f"{_duration(max(0, self.total - done) / rate) if rate > 0 else '?'} left")
        print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
