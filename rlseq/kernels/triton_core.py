"""Shared ``@triton.jit`` pieces of the Triton kernels: the gate of each rule, the segment masks, and the
unit-lower-triangular inverse of the chunked (WY) form.

One core serves both rules: ``EFLA`` is a ``tl.constexpr`` flag and changes only how the gate is formed. The gate is
the in-kernel twin of :func:`rlseq.kernels.rules.unit_key_scales` (tests/test_triton.py holds the two together):

- ``deltanet``: ``k̂ = k``, ``g = β``, ``w = β v``;
- ``efla``: ``n = max(‖k‖, MIN_KEY_NORM)`` (the norm scaled by ``max|k_i|``, so ``‖k‖²`` never overflows),
  ``x = (βn)·n``, ``k̂ = k / n``, ``g = 1 - e^{-x}``, ``w = (g/n) v``; below ``PHI_TAYLOR_BELOW`` ``g = x φ(x)`` and
  ``w = βnφ(x) v`` with φ's Taylor series (``1 - e^{-x}`` cancels there). An overflowing x gives ``g = 1``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlseq.kernels.rules import MIN_KEY_NORM, PHI_TAYLOR_BELOW

# constants the JIT may read (globals must be tl.constexpr)
_MIN_KEY_NORM = tl.constexpr(float(MIN_KEY_NORM))
_PHI_TAYLOR_BELOW = tl.constexpr(float(PHI_TAYLOR_BELOW))


@triton.jit
def key_norm(k, AXIS: tl.constexpr):
    """``‖k‖`` along ``AXIS`` (fp32), as the norm of ``k / max|k_i|`` times that maximum: no overflow of ``‖k‖²``."""
    m = tl.max(tl.abs(k), AXIS)
    m = tl.where(m > 0, m, 1.0)
    if AXIS == 0:
        ks = k / m
    else:
        ks = k / m[:, None]
    return m * tl.sqrt(tl.sum(ks * ks, AXIS))


@triton.jit
def gate_terms(n0, beta):
    """From the unclamped key norm ``n0`` and ``β ≥ 0``: ``(n, x, e^{-x}, g, φ(x))`` with ``n`` clamped."""
    n = tl.maximum(n0, _MIN_KEY_NORM)
    x = beta * n * n  # evaluated left to right: (βn)·n, finite while βn is
    e = tl.exp(-x)
    small = x < _PHI_TAYLOR_BELOW
    xs = tl.where(small, x, 0.0)
    taylor = 1.0 + xs * (-1.0 / 2 + xs * (1.0 / 6 + xs * (-1.0 / 24 + xs * (1.0 / 120 + xs * (-1.0 / 720 + xs / 5040.0)))))
    g = tl.where(small, x * taylor, 1.0 - e)
    ph = tl.where(small, taylor, g / tl.where(small, 1.0, x))  # x = inf: φ = 0
    return n, x, e, g, ph


@triton.jit
def gate_fwd(n0, beta, EFLA: tl.constexpr):
    """Per row: ``(g, s, n)`` with ``k̂ = k / n`` and ``w = s v``. ``n0 = ‖k‖`` (:func:`key_norm`; unused for DeltaNet)."""
    if EFLA:
        n, x, e, g, ph = gate_terms(n0, beta)
        s = tl.where(x < _PHI_TAYLOR_BELOW, beta * n * ph, g / n)
    else:
        n = tl.full(beta.shape, 1.0, tl.float32)
        g = beta
        s = beta
    return g, s, n


@triton.jit
def gate_bwd(kh, beta, n0, dkh, dg, dsv, EFLA: tl.constexpr):
    """Chain ``(dk̂ [C,K], dg [C], dsv [C])`` back to ``(dk [C,K], dβ [C])`` of the raw inputs (fp32 tiles), where
    ``dsv = Σ_v dw·v`` is the gradient of the value scale ``s`` in ``w = s v`` (the caller forms ``dv = s dw``).
    Linear in ``(dk̂, dg, dsv)``: partial sums over V blocks may be chained separately and added."""
    if EFLA:
        n, x, e, g, ph = gate_terms(n0, beta)
        # ∂g/∂β = n² e^{-x}, ∂s/∂β = n e^{-x}; n·e first: bounded for β > 0 whatever n is
        ne = n * e
        dbeta = (dg * n + dsv) * ne
        # where the norm is not clamped: k̂ = k/n (projected gradient), ∂g/∂n = 2βn e^{-x}, ∂s/∂n = β(2e^{-x} − φ);
        # where it is, n is a constant and only k̂ = k/n depends on k
        unc = n0 >= _MIN_KEY_NORM
        proj = tl.where(unc, tl.sum(kh * dkh, 1), 0.0)
        dn = tl.where(unc, 2.0 * beta * ne * dg + beta * (2.0 * e - ph) * dsv, 0.0)
        dk = (dkh - proj[:, None] * kh) / n[:, None] + dn[:, None] * kh
    else:
        dbeta = dg + dsv
        dk = dkh
    return dk, dbeta


@triton.jit
def segments(r):
    """Segment masks (docs/rules.md §4) from one chunk's resets ``r [C]`` (int32, 0 on padded rows).

    Returns ``(seg [C], sees [C] fp32, last [C] fp32, carry scalar fp32)``."""
    seg = tl.cumsum(r, 0)
    seg_last = tl.sum(r, 0)
    sees = (seg == 0).to(tl.float32)
    last = (seg == seg_last).to(tl.float32)
    carry = (seg_last == 0).to(tl.float32)
    return seg, sees, last, carry


@triton.jit
def tril_inverse(kk, g, seg, BT: tl.constexpr):
    """``P = (I + A)^{-1}`` for ``A = StrictLower(diag(g) K̂K̂ᵀ) ⊙ same`` by forward substitution, row by row
    (stable for any A, unlike the product/Neumann form whose powers cancel catastrophically when keys repeat).

    ``kk = K̂K̂ᵀ [C, C]`` (symmetric), ``g [C]``, ``seg [C]`` the segment ids.
    """
    rows = tl.arange(0, BT)
    # Aᵀ[j, i] = A[i, j] = g_i (k̂_i·k̂_j) for i > j in one segment; column i of Aᵀ is row i of A, laid along rows
    at = tl.where((rows[None, :] > rows[:, None]) & (seg[:, None] == seg[None, :]), g[None, :] * kk, 0.0)
    p = tl.zeros([BT, BT], dtype=tl.float32)
    for i in range(BT):
        a_i = tl.sum(tl.where(rows[None, :] == i, at, 0.0), 1)  # a_i[j] = A[i, j]
        p_i = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * p, 0)  # e_i - Σ_j A[i, j] P[j, :]
        p = tl.where(rows[:, None] == i, p_i[None, :], p)
    return p
