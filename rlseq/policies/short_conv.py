"""Causal depthwise short convolution over time with exact episode resets (the "short convolution" of
delta-rule layers such as flash-linear-attention's DeltaNet).

Per channel c and step t, with width W::

    y[t, c] = bias[c] + Σ_{j=0}^{W-1} weight[c, j] · x[t - (W-1) + j, c]

where an input from before the episode that contains step t counts as zero. The last W - 1 inputs are the
recurrent state (the *window*), so a sequence can be continued one step at a time (acting) or as a whole
(training) with the same result.

Why it matters: without it, the queries, keys and values of a delta-rule memory are functions of the current
step alone, so the memory cannot form "what came k steps ago" as a key. It is linear: the memory block
(:class:`rlseq.policies.memory.Memory`) normalises its output and every core applies its own nonlinearity.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ShortConv"]


class ShortConv(nn.Module):
    """Linear depthwise causal convolution of width ``kernel_size``, with resets.

    Window state ``[B, W-1, C]`` (oldest input first); ``W = 1`` is a per-channel affine map with an empty
    window. Weights use ``nn.Conv1d``'s default initialisation (uniform in ``±1/√W``).

    Args:
        channels: C.
        kernel_size: W ≥ 1 (default 4, as in flash-linear-attention's layers).
    """

    def __init__(self, channels: int, kernel_size: int = 4) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size = int(channels), int(kernel_size)
        conv = nn.Conv1d(self.channels, self.channels, self.kernel_size, groups=self.channels)
        self.weight = nn.Parameter(conv.weight.detach().squeeze(1).clone())  # [C, W]
        self.bias = nn.Parameter(conv.bias.detach().clone())  # [C]

    @property
    def window_size(self) -> int:
        """W - 1, the number of past inputs the state holds."""
        return self.kernel_size - 1

    def forward(self, x: torch.Tensor, window: torch.Tensor, resets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, C]``, ``window [B, W-1, C]`` (inputs before step 0), ``resets [B, T]`` bool (episode starts)
        → ``(y [B, T, C], new_window [B, W-1, C])``. ``window`` is not modified.

        One pass over W shifted copies (no loop over time): tap ``j`` reads the input ``W-1-j`` steps back, kept
        only where no episode started in between.
        """
        B, T, C = x.shape
        W = self.kernel_size
        xp = torch.cat([window.to(x.dtype), x], dim=1)  # [B, T + W - 1, C]; row p holds step p - (W - 1)
        if resets is None:
            start = torch.full((B, T), -W, dtype=torch.long, device=x.device)
        else:
            # the last episode start at or before each step (-W: none inside this sequence, the window is valid)
            steps = torch.arange(T, device=x.device).expand(B, T)
            start = torch.where(resets, steps, torch.full_like(steps, -W)).cummax(dim=1).values
        t = torch.arange(T, device=x.device)
        y = x.new_zeros(B, T, C) + self.bias
        for j in range(W):
            lag = W - 1 - j
            keep = (t - lag).unsqueeze(0) >= start  # [B, T]: the input lag steps back is in step t's episode
            y = y + self.weight[:, j] * (xp[:, j : j + T] * keep.unsqueeze(-1).to(x.dtype))
        new_window = xp[:, T:]
        if W > 1:
            times = torch.arange(T - (W - 1), T, device=x.device)  # the steps the new window holds
            valid = times.unsqueeze(0) >= start[:, -1:]  # after the last episode start of the sequence
            new_window = new_window * valid.unsqueeze(-1).to(x.dtype)
        return y, new_window

    def step(self, x: torch.Tensor, window: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
        """One step: ``x [B, C]``, ``window [B, W-1, C]`` updated in place, ``resets [B]`` bool → ``y [B, C]``."""
        if resets is not None and self.window_size:
            window.masked_fill_(resets.view(-1, 1, 1), 0.0)
        full = torch.cat([window.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, W, C]
        y = (full * self.weight.t()).sum(1) + self.bias
        if self.window_size:
            window.copy_(full[:, 1:])
        return y

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}"
