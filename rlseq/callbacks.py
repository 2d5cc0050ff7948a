"""Training callbacks of the ``rlseq.train`` CLI."""

from __future__ import annotations

import time

from stable_baselines3.common.callbacks import BaseCallback


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
