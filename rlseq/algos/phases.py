"""Per-phase wall-clock accounting for the training loop, off unless asked for (it synchronises the GPU)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


class PhaseTimer:
    """``with timer("env"): ...`` adds the block's wall time to ``totals["env"]``.

    Disabled (the default) it costs one branch per block. Enabled, it synchronises the device at each
    boundary so that asynchronous GPU work is charged to the phase that launched it; that slows the run,
    so measure throughput with it off and the breakdown with it on.
    """

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = False):
        self.device = torch.device(device)
        self.enabled = enabled
        self.totals: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - t0

    def reset(self) -> None:
        self.totals.clear()
