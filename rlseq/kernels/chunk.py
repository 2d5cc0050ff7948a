"""The delta rules in chunked (WY) form, in plain PyTorch: the CPU path (docs/rules.md §4, docs/kernels.md).

A sequence is cut into chunks of ``C`` steps. Inside a chunk everything is a matrix product or one unit-lower
triangular solve, for all chunks at once; only the state is carried from chunk to chunk, in a loop of
``ceil(T / C)`` small products batched over B·H. Episode starts inside a chunk are handled by segment masks, so
one call covers any number of episodes per sequence. Per chunk, on the unit-key form ``(k̂, g, w)`` of
:func:`rlseq.kernels.rules.unit_key_form`, with ``A = StrictLower(diag(g) K̂K̂ᵀ) ⊙ same`` and ``P = (I + A)⁻¹``:

    D  = U − M S₀,  U = P W,  M = P diag(g ⊙ sees) K̂
    S₁ = carry · S₀ + K̂ᵀ diag(last) D
    O  = diag(sees) Q S₀ + (Lower(Q K̂ᵀ) ⊙ same) D

:class:`_ChunkFunction` differentiates this by hand (autograd through the chunk loop would store every step): the
backward walks the chunks in reverse carrying ``dS`` (``dR = Pᵀ(QKᵀ dO) + Pᵀ diag(last) K̂ dS₁``,
``dS₀ = carry dS₁ + Qᵀ diag(sees) dO − (g sees K̂)ᵀ dR``) and batches everything else over all chunks. The gate
(raw k, v, β → k̂, g, w) stays outside it, differentiated by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlseq.kernels.rules import unit_key_form


def _chunked(x: torch.Tensor, N: int, C: int) -> torch.Tensor:
    """``[B, T, H, D]`` (or ``[B, T, H]``) → contiguous ``[N, B, H, C, D]`` (``[N, B, H, C, 1]``), zero-padded to N·C."""
    x = x.unsqueeze(-1) if x.dim() == 3 else x
    B, T, H, D = x.shape
    if T != N * C:
        x = F.pad(x, (0, 0, 0, 0, 0, N * C - T))
    return x.reshape(B, N, C, H, D).permute(1, 0, 3, 2, 4).contiguous()


def _unchunked(x: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of :func:`_chunked`: ``[N, B, H, C, D]`` → ``[B, T, H, D]``."""
    N, B, H, C, D = x.shape
    return x.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, D)[:, :T]


def _masks(resets: torch.Tensor | None, N: int, C: int, dtype: torch.dtype, device: torch.device):
    """Segment masks from ``resets [B, T]`` (docs/rules.md §4) as ``dtype`` factors in the chunk layout.

    Returns ``lower [N, B, 1, C, C]`` (lower triangle ⊙ same episode), ``strict`` (the same without the diagonal),
    ``sees, last [N, B, 1, C, 1]`` (row sees the entering state; row in the chunk's last episode) and
    ``carry [N, B, 1, 1, 1]`` (the state passes the whole chunk); without resets the triangles ``[C, C]`` and None.
    """
    ones = torch.ones(C, C, dtype=dtype, device=device)
    if resets is None:
        return ones.tril(), ones.tril(-1), None, None, None
    seg = _chunked(resets.unsqueeze(-1).to(dtype), N, C).squeeze(2).cumsum(-2)  # [N, B, C, 1]: episode in the chunk
    seg = seg.unsqueeze(2)  # [N, B, 1, C, 1]
    same = (seg == seg.transpose(-1, -2)).to(dtype)
    sees = (seg == 0).to(dtype)
    last = (seg == seg[..., -1:, :]).to(dtype)
    return same * ones.tril(), same * ones.tril(-1), sees, last, sees[..., -1:, :]


def _mul(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x * mask


class _ChunkFunction(torch.autograd.Function):
    """The chunked unit-key core: ``(q, k̂ [B,T,H,K], g [B,T,H], w [B,T,H,V], h0 [B,H,K,V] | None)`` →
    ``(o [B,T,H,V], S_T [B,H,K,V])``, all in one float dtype, with the backward by hand."""

    @staticmethod
    def forward(ctx, q, kh, g, w, h0, resets, C):  # type: ignore[override]
        B, T, H, K = kh.shape
        V = w.shape[-1]
        N = -(-T // C)  # padded steps have k̂ = 0, g = 0 and w = 0: they leave the state alone
        dt, dev = kh.dtype, kh.device
        qc, kc, gc, wc = (_chunked(x, N, C) for x in (q, kh, g, w))
        lower, strict, sees, last, carry = _masks(resets, N, C, dt, dev)
        qk = (qc @ kc.transpose(-1, -2)) * lower
        # P = (I + A)⁻¹ by forward substitution (LAPACK's unit-lower solve reads only A's strict lower part);
        # stable for any A, unlike product forms whose powers cancel when unit keys repeat (docs/kernels.md)
        a = (kc @ kc.transpose(-1, -2)) * gc * (1.0 if sees is None else strict)
        eye = torch.eye(C, dtype=dt, device=dev)
        p = torch.linalg.solve_triangular(a, eye.expand_as(a), upper=False, unitriangular=True)
        u = (p @ wc).view(N, B * H, C, V)
        m = (p @ (kc * _mul(gc, sees))).view(N, B * H, C, K)
        klt = _mul(kc, last).view(N, B * H, C, K).transpose(-1, -2)
        states = torch.empty(N + 1, B * H, K, V, dtype=dt, device=dev)  # the state entering each chunk, then S_T
        states[0] = 0.0 if h0 is None else h0.reshape(B * H, K, V)
        d = torch.empty(N, B * H, C, V, dtype=dt, device=dev)
        for n in range(N):
            torch.baddbmm(u[n], m[n], states[n], alpha=-1, out=d[n])
            s_in = states[n] if carry is None else (states[n].view(B, -1) * carry[n].view(B, 1)).view(B * H, K, V)
            torch.baddbmm(s_in, klt[n], d[n], out=states[n + 1])
        s0 = states[:N].view(N, B, H, K, V)
        d = d.view(N, B, H, C, V)
        o = _mul(qc @ s0, sees) + qk @ d
        ctx.save_for_backward(qc, kc, gc, p, qk, d, states, resets)
        ctx.dims = (B, T, H, K, V, N, C)
        ctx.h0_none = h0 is None
        return _unchunked(o, T), states[N].view(B, H, K, V).clone()

    @staticmethod
    def backward(ctx, do, dsT):  # type: ignore[override]
        qc, kc, gc, p, qk, d, states, resets = ctx.saved_tensors
        B, T, H, K, V, N, C = ctx.dims
        BH, dt = B * H, kc.dtype
        lower, strict, sees, last, carry = _masks(resets, N, C, dt, kc.device)
        doc = _chunked(do.to(dt), N, C)
        dos = _mul(doc, sees)
        s0 = states[:N].view(N, B, H, K, V)
        pt = p.transpose(-1, -2)
        gk = kc * gc
        # reverse walk: dR = X + Y dS₁,  dS₀ = carry dS₁ + Qᵀ diag(sees) dO − (g sees K̂)ᵀ dR
        x = (pt @ (qk.transpose(-1, -2) @ doc)).view(N, BH, C, V)
        y = (pt @ _mul(kc, last)).view(N, BH, C, K)
        z = (qc.transpose(-1, -2) @ dos).view(N, BH, K, V)
        gkst = _mul(gk, sees).view(N, BH, C, K).transpose(-1, -2)
        ds = torch.empty(N + 1, BH, K, V, dtype=dt, device=kc.device)
        ds[N] = 0.0 if dsT is None else dsT.to(dt).reshape(BH, K, V)
        dr = torch.empty(N, BH, C, V, dtype=dt, device=kc.device)
        for n in range(N - 1, -1, -1):
            torch.baddbmm(x[n], y[n], ds[n + 1], out=dr[n])
            ds_in = ds[n + 1] if carry is None else (ds[n + 1].view(B, -1) * carry[n].view(B, 1)).view(BH, K, V)
            torch.baddbmm(z[n] + ds_in, gkst[n], dr[n], alpha=-1, out=ds[n])
        ds1 = ds[1:].view(N, B, H, K, V)  # the gradient of each chunk's leaving state
        dr = dr.view(N, B, H, C, V)  # = ∂L/∂W
        dtr = d.transpose(-1, -2)
        dqk = (doc @ dtr) * lower
        dq = dqk @ kc + dos @ s0.transpose(-1, -2)
        da = (dr @ dtr) * strict  # = −∂L/∂A
        ngk = da @ kc + _mul(dr, sees) @ s0.transpose(-1, -2)  # = −∂L/∂(g K̂)
        dkh = dqk.transpose(-1, -2) @ qc + _mul(d, last) @ ds1.transpose(-1, -2) - da.transpose(-1, -2) @ gk - gc * ngk
        dg = -(ngk * kc).sum(-1, keepdim=True)
        dh0 = None if ctx.h0_none else ds[0].view(B, H, K, V)
        return (_unchunked(dq, T), _unchunked(dkh, T), _unchunked(dg, T).squeeze(-1), _unchunked(dr, T), dh0,
                None, None)


def chunk_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    rule: str,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked delta rule. Shapes as :func:`rlseq.kernels.chunk_rule`; computes in float32 (float64 for
    float64 inputs) and returns ``o`` and the final state in the compute dtype."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    kh, g, w = unit_key_form(k.to(dt), v.to(dt), beta.to(dt), rule)
    h0 = None if initial_state is None else initial_state.to(dt)
    return _ChunkFunction.apply(q.to(dt), kh, g, w, h0, resets, max(1, min(chunk_size, k.shape[1])))


def step_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    rule: str,
    resets: torch.Tensor | None = None,
) -> torch.Tensor:
    """One acting step in the unit-key form, updating ``state [B, H, K, V]`` in place. Returns ``o [B, H, V]``."""
    dt = state.dtype
    if resets is not None:
        state.masked_fill_(resets.view(-1, 1, 1, 1), 0.0)
    kh, g, w = unit_key_form(k.to(dt), v.to(dt), beta.to(dt), rule)
    # products as broadcast sums: the state may be a strided view (a memory's state holds more than the matrix),
    # which einsum/bmm would first copy, and at acting sizes that copy costs more than the product
    err = w - g.unsqueeze(-1) * (state * kh.unsqueeze(-1)).sum(-2)
    state.add_(kh.unsqueeze(-1) * err.unsqueeze(-2))
    return (state * q.to(dt).unsqueeze(-1)).sum(-2).to(q.dtype)
