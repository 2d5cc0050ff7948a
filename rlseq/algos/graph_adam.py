"""torch's fused Adam stepped inside a CUDA graph: the one place where rlseq touches an optimizer's internals.

A captured Adam step (:class:`~rlseq.algos.training.TrainStep`) needs three things from ``torch.optim.Adam``:

- **A tensor learning rate** (public API: ``torch.optim.Adam`` documents ``lr`` as a float or a Tensor, a Tensor
  being supported with ``fused=True``): a replay reads the rate in place, so each ``train()`` call's rate reaches the
  graph. SB3's schedule writes floats into ``param_groups`` before each call; :meth:`GraphAdam.attach` copies them
  into float32 device tensors and puts those in the groups, :meth:`GraphAdam.detach` gives the floats back, so the
  eager loop and checkpoints only ever see floats.
- **A skip flag** (not public: the ``found_inf`` attribute through which ``torch.amp.GradScaler`` hands its flag to
  an optimizer whose ``_step_supports_amp_scaling`` is True, as fused Adam's is; ``Adam.step`` passes it to the
  fused kernel, which leaves the parameters and the moments unchanged while it is 1 and takes back its step-count
  increment). :func:`fused_adam` checks for that marker; without it the graph is not used.
- **Permission to capture** (public API: the ``capturable`` flag of each param group; torch refuses to capture
  ``step()`` unless every group has it). The fused kernel computes the same either way (its ``capturable``
  argument is unused), so :meth:`GraphAdam.capturing` sets the flags only while capturing and restores them: the
  optimizer keeps the settings its user gave it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is torch's Adam or AdamW (a subclass of Adam) with ``fused=True`` in every group, whose
    step takes GradScaler's ``found_inf`` flag (what :class:`GraphAdam` needs)."""
    return (isinstance(optimizer, torch.optim.Adam) and all(g.get("fused") for g in optimizer.param_groups)
            and bool(getattr(optimizer, "_step_supports_amp_scaling", False)))


class GraphAdam:
    """The learning-rate tensors and the skip flag of a fused Adam whose step a CUDA graph replays.

    Per ``train()`` call: :meth:`attach` (before the first update), :meth:`detach` (after the last, also after an
    error); :meth:`capturing` around the capture of a step.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.lr: list[torch.Tensor] = []  # one 0-dim float32 tensor per param group: what a captured step reads
        self._floats: list[Any] = []  # the groups' own learning rates while attached
        self._optimizer: torch.optim.Optimizer | None = None
        self._found_inf: torch.Tensor | None = None

    def attach(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> bool:
        """Put each group's learning rate (the float SB3's schedule set) into :attr:`lr` and those tensors into the
        groups, and make ``found_inf`` (0-dim float32 on the device: 1.0 skips every step) the step's skip flag.
        Returns True when the :attr:`lr` tensors were made anew (a graph that read the old ones is stale)."""
        if not fused_adam(optimizer):
            raise ValueError("GraphAdam needs torch.optim.Adam or AdamW with fused=True, whose step takes a found_inf "
                             f"flag (got {type(optimizer).__name__})")
        groups = optimizer.param_groups
        renewed = len(self.lr) != len(groups)
        if renewed:
            self.lr = [torch.zeros((), dtype=torch.float32, device=self.device) for _ in groups]
        self._floats = [group["lr"] for group in groups]
        for group, lr in zip(groups, self.lr):
            lr.fill_(float(group["lr"]))
            group["lr"] = lr
        optimizer.found_inf = found_inf
        self._optimizer, self._found_inf = optimizer, found_inf
        return renewed

    def detach(self) -> None:
        """Give the groups back their float learning rates and remove the skip flag. Safe to call more than once."""
        optimizer = self._optimizer
        if optimizer is None:
            return
        for group, lr in zip(optimizer.param_groups, self._floats):
            group["lr"] = lr
        if getattr(optimizer, "found_inf", None) is self._found_inf:
            del optimizer.found_inf
        self._floats, self._optimizer = [], None

    @staticmethod
    @contextmanager
    def capturing(optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Every group ``capturable`` inside the block (torch's condition for capturing ``step()``), as before after."""
        before = [group["capturable"] for group in optimizer.param_groups]
        try:
            for group in optimizer.param_groups:
                group["capturable"] = True
            yield
        finally:
            for group, flag in zip(optimizer.param_groups, before):
                group["capturable"] = flag
