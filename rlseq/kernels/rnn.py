"""The GRU and LSTM cells over whole sequences with episode resets, for training passes that never read the device
from the host (what a CUDA graph can capture).

- :func:`rnn_scan`: one layer over ``T`` steps from the input's gate pre-activations, backends ``"reference"``
  (the step loop in float64, the oracle), ``"torch"`` (the same loop in the input's dtype) and ``"triton"`` (one
  fused launch per step and direction: the recurrent matmul and the cell together, :mod:`rlseq.kernels.triton_rnn`).
- :func:`gru_cell`, :func:`lstm_cell`: one step, PyTorch's ``nn.GRU`` / ``nn.LSTM`` definitions (gate order and
  biases as theirs), which the loop applies and the Triton kernels restate.

Packing episode segments for cuDNN (``rlseq.policies.memory``) reads the segment lengths on the host; a scan with
the state zeroed where an episode starts does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlseq.kernels.api import triton_available

CELLS = {"gru": (3, 1), "lstm": (4, 2)}  # cell -> (gates, state parts)
BACKENDS = ("reference", "torch", "triton")


def gru_cell(gates_x: torch.Tensor, gates_h: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    """``nn.GRU``'s step from ``gates_x = W_i x + b_i`` and ``gates_h = W_h h + b_h`` (``[B, 3H]``, gates r, z, n)
    and ``parts = (h,)``: ``r, z = σ(·)``, ``n = tanh(x_n + r ⊙ (W_hn h + b_hn))``, ``h' = (1 − z) ⊙ n + z ⊙ h``."""
    H = gates_h.shape[-1] // 3
    r, z = torch.sigmoid(gates_x[:, :2 * H] + gates_h[:, :2 * H]).chunk(2, -1)
    n = torch.tanh(torch.addcmul(gates_x[:, 2 * H:], r, gates_h[:, 2 * H:]))
    return (torch.lerp(n, parts[0], z),)


def lstm_cell(gates_x: torch.Tensor, gates_h: torch.Tensor,
              parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``nn.LSTM``'s step from the gate pre-activations (``[B, 4H]``, gates i, f, g, o) and ``parts = (h, c)``:
    ``c' = σ(f) ⊙ c + σ(i) ⊙ tanh(g)``, ``h' = σ(o) ⊙ tanh(c')``."""
    pre = gates_x + gates_h
    H = pre.shape[-1] // 4
    i, f, _, o = torch.sigmoid(pre).chunk(4, -1)  # one σ over all four gates (g's share unused): fewer kernels
    c = torch.addcmul(f * parts[1], i, torch.tanh(pre[:, 2 * H:3 * H]))
    return o * torch.tanh(c), c


_CELL_FUNCTIONS = {"gru": gru_cell, "lstm": lstm_cell}


def triton_scan_available(device: torch.device) -> bool:
    """Whether the Triton scan can run on ``device``: CUDA with triton installed, or any device under
    ``TRITON_INTERPRET=1``."""
    return triton_available(device, "rlseq.kernels.triton_rnn")


def rnn_scan(cell: str, gates_x: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor | None,
             parts: tuple[torch.Tensor, ...], resets: torch.Tensor | None = None, *,
             backend: str | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One recurrent layer over whole sequences.

    Args:
        cell: ``"gru"`` or ``"lstm"``.
        gates_x: ``[B, T, G·H]``, the input's gate pre-activations ``W_ih x + b_ih`` (G = 3 for the GRU, 4 for the
            LSTM, in PyTorch's gate order).
        w_hh: ``[G·H, H]``; b_hh: ``[G·H]`` or None.
        parts: the state entering step 0, ``(h,)`` or ``(h, c)``, each ``[B, H]``.
        resets: ``[B, T]`` bool or None: where True the state is zeroed (every part) before that step reads it.
        backend: ``"reference"``, ``"torch"`` or ``"triton"``; None picks Triton for float32 CUDA tensors and the
            torch loop otherwise.

    Returns ``(y [B, T, H], final parts)``, ``y[:, t]`` the h after step t; differentiable with respect to
    ``gates_x``, ``w_hh``, ``b_hh`` and ``parts``. The reference returns float64, the others the input's dtype.
    """
    if cell not in CELLS:
        raise ValueError(f"unknown cell {cell!r}; valid: {', '.join(CELLS)}")
    G, P = CELLS[cell]
    if gates_x.dim() != 3:
        raise ValueError(f"gates_x must have shape [B, T, {G}·H], got {list(gates_x.shape)}")
    B, T, GH = gates_x.shape
    H = w_hh.shape[-1]
    if GH != G * H or tuple(w_hh.shape) != (G * H, H):
        raise ValueError(f"a {cell} of hidden size {H} needs gates_x [B, T, {G * H}] and w_hh [{G * H}, {H}], got "
                         f"{list(gates_x.shape)} and {list(w_hh.shape)}")
    if b_hh is not None and tuple(b_hh.shape) != (G * H,):
        raise ValueError(f"b_hh must have shape [{G * H}], got {list(b_hh.shape)}")
    if len(parts) != P or any(tuple(p.shape) != (B, H) for p in parts):
        raise ValueError(f"a {cell} state is {P} tensor(s) of shape [B, H] = {[B, H]}, got "
                         f"{[list(p.shape) for p in parts]}")
    if resets is not None and (tuple(resets.shape) != (B, T) or resets.dtype != torch.bool):
        raise ValueError(f"resets must be a bool tensor of shape [B, T] = {[B, T]}, got {resets.dtype} "
                         f"{list(resets.shape)}")
    named = {"gates_x": gates_x, "w_hh": w_hh, "b_hh": b_hh, "resets": resets,
             **{f"parts[{i}]": p for i, p in enumerate(parts)}}
    for name, x in named.items():
        if x is not None and x.device != gates_x.device:
            raise ValueError(f"{name} is on {x.device}, but gates_x is on {gates_x.device}: all inputs must share a "
                             "device")
        if x is not None and name != "resets" and x.dtype != gates_x.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}, but gates_x has {gates_x.dtype}: the floating inputs "
                             "must share a dtype")
    if backend is None:
        backend = ("triton" if gates_x.is_cuda and gates_x.dtype == torch.float32
                   and triton_scan_available(gates_x.device) else "torch")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)} (or None)")
    if backend == "triton":
        if not triton_scan_available(gates_x.device):
            raise RuntimeError("backend 'triton' needs the `triton` package and CUDA tensors, or TRITON_INTERPRET=1 "
                               f"set before triton is imported (got device {gates_x.device}); use backend='torch'")
        if gates_x.dtype != torch.float32:
            raise ValueError(f"the triton scan computes in float32, got {gates_x.dtype}; use backend='torch' (or "
                             "'reference' for float64)")
    if backend == "reference":
        gates_x, w_hh = gates_x.double(), w_hh.double()
        b_hh = None if b_hh is None else b_hh.double()
        parts = tuple(p.double() for p in parts)
    if T == 0:  # nothing to scan: the state passes through
        return gates_x.new_zeros(B, 0, H), tuple(parts)
    if backend == "triton":
        from rlseq.kernels.triton_rnn import scan_triton

        return scan_triton(cell, gates_x, w_hh, b_hh, parts, resets)
    return _scan_loop(_CELL_FUNCTIONS[cell], gates_x, w_hh, b_hh, parts, resets)


def _scan_loop(step, gates_x, w_hh, b_hh, parts, resets):
    """The step loop: the state zeroed where ``resets`` starts an episode (exact zeros, as a fresh segment starts:
    a multiplication by 0 would keep a NaN or turn an inf into one), then one cell step."""
    zero = gates_x.new_zeros(())
    ys = []
    for t in range(gates_x.shape[1]):
        if resets is not None:
            parts = tuple(torch.where(resets[:, t, None], zero, p) for p in parts)
        parts = step(gates_x[:, t], F.linear(parts[0], w_hh, b_hh), parts)
        ys.append(parts[0])
    return torch.stack(ys, 1), parts
