"""Shared ``@triton.jit`` pieces of the Triton kernels: the gate of each rule, the segment masks, and the
unit-lower-triangular inverse of the chunked (WY) form.

One core serves both rules: ``EFLA`` is a ``tl.constexpr`` flag and changes only how the gate is formed
(mirroring :func:`rlseq.kernels.rules.unit_key_form` element for element):

- ``deltanet``: ``k̂ = k``, ``g = β``, ``w = β v``;
- ``efla``: ``λ = ‖k‖²``, ``n = max(√λ, MIN_KEY_NORM)``, ``x = βλ``, ``k̂ = k / n``, ``g = x φ(x) = 1 - e^{-x}``,
  ``w = β n φ(x) v`` with ``φ`` switched to its Taylor series below ``PHI_TAYLOR_BELOW``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlseq.kernels.rules import MIN_KEY_NORM, PHI_TAYLOR_BELOW

# constants the JIT may read (globals must be tl.constexpr)
_MIN_KEY_NORM = tl.constexpr(float(MIN_KEY_NORM))
_PHI_TAYLOR_BELOW = tl.constexpr(float(PHI_TAYLOR_BELOW))


@triton.jit
def phi_exp(x):
    """``(φ(x), e^{-x})`` for ``x ≥ 0``; φ by its Taylor series below the switch, like ``rules.phi``."""
    e = tl.exp(-x)
    small = x < _PHI_TAYLOR_BELOW
    xs = tl.where(small, x, 0.0)
    taylor = 1.0 + xs * (-1.0 / 2 + xs * (1.0 / 6 + xs * (-1.0 / 24 + xs * (1.0 / 120 + xs * (-1.0 / 720 + xs / 5040.0)))))
    xl = tl.where(small, 1.0, x)
    return tl.where(small, taylor, (1.0 - e) / xl), e


@triton.jit
def gate_fwd(lam, beta, EFLA: tl.constexpr):
    """Per row: ``(g, s, n)`` with ``k̂ = k / n`` and ``w = s v``. ``lam = ‖k‖²`` (unused for DeltaNet)."""
    if EFLA:
        n = tl.maximum(tl.sqrt(lam), _MIN_KEY_NORM)
        x = beta * lam
        ph, e = phi_exp(x)
        g = x * ph
        s = beta * n * ph
    else:
        n = tl.full(beta.shape, 1.0, tl.float32)
        g = beta
        s = beta
    return g, s, n


@triton.jit
def gate_bwd(k, kh, beta, lam, dkh, dg, dsv, EFLA: tl.constexpr):
    """Chain ``(dk̂ [C,K], dg [C], dsv [C])`` back to ``(dk [C,K], dβ [C])`` of the raw inputs (fp32 tiles), where
    ``dsv = Σ_v dw·v`` is the gradient of the value scale ``s`` in ``w = s v`` (the caller forms ``dv = s dw``).
    Linear in ``(dk̂, dg, dsv)``: partial sums over V blocks may be chained separately and added."""
    if EFLA:
        n0 = tl.sqrt(lam)
        unc = n0 >= _MIN_KEY_NORM
        n = tl.maximum(n0, _MIN_KEY_NORM)
        x = beta * lam
        ph, e = phi_exp(x)
        # ∂g/∂β = λ e^{-x}, ∂s/∂β = n e^{-x}: both finite for every key norm
        dbeta = (dg * lam + dsv * n) * e
        # k̂ = k / n: projected gradient when √λ is the norm, plain scaling where the norm is clamped
        proj = tl.sum(kh * dkh, 1)
        dk = tl.where(unc[:, None], (dkh - kh * proj[:, None]), dkh) / n[:, None]
        # ∂g/∂k = 2β e^{-x} k;  ∂s/∂k = β (2e^{-x} - φ) k̂ (unclamped), 2β² n φ'(x) k with φ' ≈ -1/2 (clamped, x ≈ 0)
        dk += (2.0 * beta * e * dg)[:, None] * k
        cs = tl.where(unc, beta * (2.0 * e - ph), 0.0)
        cc = tl.where(unc, 0.0, -beta * beta * n)
        dk += (dsv * cs)[:, None] * kh + (dsv * cc)[:, None] * k
    else:
        dbeta = dg + dsv
        dk = dkh
    return dk, dbeta


@triton.jit
def segments(r):
    """Segment masks of efla.md §3 from one chunk's resets ``r [C]`` (int32, 0 on padded rows).

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
