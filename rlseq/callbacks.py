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

    After ``first_s`` seconds it prints the acting rate (timed from the end of the first env step, which compiles)
    and, where the run would take more than an hour at that rate on a CPU, that the config is sized for a GPU,
    with ``smaller`` (a command to use instead); a first rollout that ends sooner gives the same warning from its
    measured rate. The estimate of the time the run
    takes follows the second rollout and its update, timed without the first (which compiles and warms up, and
    on a GPU takes many times longer than the next). Then one line every ``every_s`` seconds (on a terminal: the
    same line rewritten every second) with the env steps, the rate, the time left at that rate (the estimate's
    measure once it is printed) and the recent mean episode return (``lines=False``: the messages only).
    """

    def __init__(self, total: int, *, on_cpu: bool, smaller: str | None = None, first_s: float = 10.0,
                 every_s: float | None = None, lines: bool = True):
        super().__init__()
        self.total, self.on_cpu, self.smaller, self.first_s, self.lines = total, on_cpu, smaller, first_s, lines
        self.tty = sys.stdout.isatty()
        self.every_s = every_s if every_s is not None else (1.0 if self.tty else 30.0)
        self.first_printed = self.estimate_printed = self.sized_for_gpu_said = False
        self.t1: float | None = None  # when the first rollout's update ended, and the env steps then
        self.n1 = 0
        self.t_step: float | None = None  # when the first env step ended (acting's compilation and capture done)
        self.n_step = 0

    def _on_training_start(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.n0 = self.model.num_timesteps

    @property
    def _newline(self) -> str:
        """Ends a terminal's rewritten progress line before a message."""
        return "\n" if self.tty else ""

    def _rate(self, now: float) -> float:
        """env-steps/s since the end of the first update once the estimate has been made from it, else since
        the start."""
        t, n = (self.t1, self.n1) if self.estimate_printed else (self.t0, self.n0)
        return (self.model.num_timesteps - n) / max(now - t, 1e-9)

    def _left(self) -> int:
        return max(0, self.total - self.model.num_timesteps)

    def _say_sized_for_gpu(self, seconds_left: float) -> None:
        if self.on_cpu and seconds_left > 3600 and not self.sized_for_gpu_said:
            self.sized_for_gpu_said = True
            print("this config is sized for a GPU" + (f"; a CPU-sized run: {self.smaller}" if self.smaller else ""),
                  flush=True)

    def _on_step(self) -> bool:
        now = time.perf_counter()
        if self.t_step is None:
            self.t_step, self.n_step = now, self.model.num_timesteps
        elif not (self.first_printed or self.t1 is not None) and now - self.t0 >= self.first_s:
            self.first_printed = True
            rate, left = (self.model.num_timesteps - self.n_step) / max(now - self.t_step, 1e-9), self._left()
            print(f"{self._newline}first {now - self.t0:.0f} s: acting at {rate:,.0f} env-steps/s, so "
                  f"the remaining {left:,} steps take at least {_duration(left / rate)} (training comes on top; "
                  "the estimate follows the second rollout)", flush=True)
            self._say_sized_for_gpu(left / rate)
        if self.lines and now - self.last >= self.every_s:
            self.last = now
            self._line(now)
        return True

    def _on_rollout_start(self) -> None:
        now = time.perf_counter()
        steps = self.model.num_timesteps
        if self.t1 is None and steps > self.n0:  # the first rollout and its update are done
            self.t1, self.n1 = now, steps
            rate = (steps - self.n0) / max(now - self.t0, 1e-9)
            if self.on_cpu and not self.sized_for_gpu_said and self._left() / rate > 3600:
                print(f"{self._newline}measured {rate:,.0f} env-steps/s over the first rollout and its update: "
                      f"about {_duration(self._left() / rate)} for the remaining {self._left():,} steps", flush=True)
                self._say_sized_for_gpu(self._left() / rate)
        elif self.t1 is not None and not self.estimate_printed and steps > self.n1:
            self.estimate_printed = True
            rate = self._rate(now)
            print(f"{self._newline}measured {rate:,.0f} env-steps/s over the second rollout and its update (the "
                  f"first, which compiles and warms up, left out): about {_duration(self._left() / rate)} for the "
                  f"remaining {self._left():,} steps", flush=True)

    def _on_training_end(self) -> None:
        if self.lines and self.tty:
            self._line(time.perf_counter())
            print(flush=True)

    def _line(self, now: float) -> None:
        done = self.model.num_timesteps
        rate = self._rate(now)
        text = (f"{done:,}/{self.total:,} env steps ({100 * done / max(self.total, 1):.0f}%), {rate:,.0f} env-steps/s, "
                f"{_duration(self._left() / rate) if rate > 0 else '?'} left, "
                f"{recent_return(getattr(self.model, 'ep_info_buffer', None))}")
        print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", flush=True)


def recent_return(episodes) -> str:
    """``return R`` (the mean over SB3's ``ep_info_buffer``, the game's own reward) and, where a scale wrapper
    changed what PPO sees, ``(scaled S)``; says so when no episode has ended yet."""
    episodes = list(episodes or [])
    if not episodes:
        return "no episode ended yet"
    text = f"return {sum(ep['r'] for ep in episodes) / len(episodes):.4g}"
    scaled = [ep["r_scaled"] for ep in episodes if "r_scaled" in ep]
    if scaled:
        text += f" (scaled {sum(scaled) / len(scaled):.4g})"
    return text


def closing_summary(model, folder: Path, logdir: Path, env_folder: str) -> str:
    """What a finished run prints: its steps, folder and recent return, then the commands that look at it."""
    import shlex

    episodes = list(getattr(model, "ep_info_buffer", None) or [])
    returns = (f"{recent_return(episodes)}, the mean of the last {len(episodes)} episode"
               f"{'' if len(episodes) == 1 else 's'}" if episodes else "no episode ended during training")
    env_runs = shlex.quote(str(Path(logdir) / env_folder))
    return "\n".join([
        f"done: {model.num_timesteps:,} env steps in {folder}; {returns}",
        "next:",
        f"  python -m rlseq.evaluate {shlex.quote(str(folder))} --episodes 100   # new episodes, unscaled return",
        f"  python -m rlseq.compare {env_runs}   # against the other memories' runs of this env "
        "(--memory gru, none, ...)",
        f"  tensorboard --logdir {env_runs}",
    ])


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
