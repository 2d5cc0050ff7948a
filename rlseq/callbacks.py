"""Training callbacks and the TensorBoard logger of the ``rlseq.train`` CLI."""

from __future__ import annotations

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


class ProgressEstimate(BaseCallback):
    """Prints, after the first rollout and its update, the measured throughput and the time the run will take."""

    def __init__(self, total: int):
        super().__init__()
        self.total = total
        self.printed = False

    def _on_training_start(self) -> None:
        self.t0, self.n0 = time.perf_counter(), self.model.num_timesteps

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        steps = self.model.num_timesteps - self.n0
        if not self.printed and steps > 0:
            rate = steps / (time.perf_counter() - self.t0)
            left = max(0, self.total - self.model.num_timesteps)
            print(f"measured {rate:,.0f} env-steps/s over the first rollout: about {left / rate / 60:,.1f} min for the "
                  f"remaining {left:,} steps", flush=True)
            self.printed = True
