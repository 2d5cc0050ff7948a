"""The Triton backend: :func:`chunk_triton` (training, differentiable) and :func:`step_triton` (acting).

Called by :mod:`rlseq.kernels.api` after validation. Kernels live in ``triton_core`` (shared gate, masks and
triangular inverse), ``triton_chunk`` and ``triton_step``. Inputs may be fp32, bf16 or fp16 (upcast on load;
state and accumulation fp32); float64 inputs fall back to the PyTorch chunked path, which computes in float64.
Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (the tests do this).
"""

from __future__ import annotations

import torch
import triton  # noqa: F401  (fail the import here, not at first use, when triton is missing)

from rlseq.kernels.chunk import chunk_torch, step_torch
from rlseq.kernels.rules import check_rule
from rlseq.kernels.triton_chunk import ChunkFunction, check_config, chunk_fwd, launch_config
from rlseq.kernels.triton_step import step_launch

MAX_HEAD_DIM = 256


def _contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def chunk_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    rule: str,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked delta rule; same contract as :func:`rlseq.kernels.chunk_rule`. Returns ``o`` in the input dtype
    and the final state in float32. Differentiable with respect to q, k, v, beta and initial_state.

    ``config`` overrides keys of :func:`rlseq.kernels.triton_chunk.launch_config` (``prec``, ``block_v``,
    ``kside_block_v``), so that tests reach every V-block layout at small shapes.
    """
    check_rule(rule)
    if q.dtype == torch.float64:
        return chunk_torch(q, k, v, beta, rule=rule, initial_state=initial_state, resets=resets)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if max(K, V) > MAX_HEAD_DIM:
        raise ValueError(f"the triton backend supports head dims up to {MAX_HEAD_DIM}, got K={K}, V={V}")
    cfg = dict(launch_config(K, V, B, H, q.dtype), **check_config(config or {}))
    q, k, v, beta = (_contig(x) for x in (q, k, v, beta))
    resets = _contig(resets) if resets is not None else None
    h0 = _contig(initial_state.float()) if initial_state is not None else None  # the cast stays in the graph
    efla = rule == "efla"
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, initial_state)):
        return ChunkFunction.apply(q, k, v, beta, h0, resets, efla, cfg)
    o, ht, _ = chunk_fwd(q, k, v, beta, resets, h0, efla=efla, save=False, cfg=cfg)
    return o, ht


def step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    rule: str,
    resets: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """One acting step, one launch; updates the float32 ``state [B, H, K, V]`` in place and returns
    ``o [B, H, V]`` in q's dtype (written into ``out`` when given). No host sync, no allocation with ``out``:
    safe to capture in a CUDA graph. A float64 state falls back to the PyTorch step."""
    check_rule(rule)
    if state.dtype != torch.float32 or q.dtype == torch.float64:
        o = step_torch(q, k, v, beta, state, rule=rule, resets=resets)
        if out is not None:
            out.copy_(o)
            return out
        return o
    B, H, K = q.shape
    V = v.shape[-1]
    if max(K, V) > MAX_HEAD_DIM:
        raise ValueError(f"the triton backend supports head dims up to {MAX_HEAD_DIM}, got K={K}, V={V}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (_contig(x) for x in (q, k, v))
    if out is None:
        out = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (B, H, V) or out.stride(-1) != 1:
        raise ValueError(f"out must have shape [B, H, V] = {[B, H, V]} with a unit last stride")
    return step_launch(q, k, v, beta, state, resets, out, efla=rule == "efla", num_warps=num_warps)
