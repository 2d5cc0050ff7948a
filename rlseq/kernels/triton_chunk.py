"""Chunked (WY) delta rules in Triton: the training path, chunks of 16 (docs/kernels.md).

Four launches per forward and backward, on the unit-key gate formed in-kernel from the raw inputs
(``triton_core.gate_fwd``) and the segment masks formed from the resets:

1. ``chunk_prep_kernel``, one program per (sequence·head, chunk), all chunks in parallel: the key side
   ``P = (I + A)^{-1}`` (``A = StrictLower(diag(g) K̂K̂ᵀ) ⊙ same``, by forward substitution), ``A2 = Lq P``,
   ``M = P diag(g·sees) K̂``, ``Qe = diag(sees) Q − Lq M`` and, for the backward, ``Kp = Pᵀ diag(last) K̂``.
2. ``chunk_fwd_kernel``, one program per (sequence·head, V block): the walk over the chunks with a ``[K, BV]`` block
   of the fp32 state on chip: ``D = P(sV) − M S₀``, ``O = Qe S₀ + A2(sV)``, ``S₁ = carry S₀ + K̂ᵀ diag(last) D``.
3. ``chunk_bwd_v_kernel`` (V side), one program per (sequence·head, V block): the reverse walk with dS on chip,
   ``dR = A2ᵀ dO + Kp dS``, ``dv = s dR``, ``dS₀``; saves dR and its V block's part of ``D dSᵀ``.
4. ``chunk_bwd_k_kernel`` (K side), one program per (sequence·head, chunk): dq, dk̂, dg from the saved S₀, D, dR,
   chained through the gate to dk and dβ.

The value dimension is split into blocks where that gives more programs (:func:`launch_config`): the state's
columns, D's and O's are independent in V, so every block only recomputes the shared key side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlseq.kernels.triton_core import gate_bwd, gate_fwd, key_norm, segments, tril_inverse

@triton.jit
def _chunk_rows(b, h, t0, T, H: tl.constexpr, BT: tl.constexpr):
    """``row [BT]``, the int64 row index into the ``[B·T·H, ·]`` layout of steps ``t0 .. t0+BT`` of sequence ``b``,
    head ``h``, and ``mt [BT]``, which of them are inside T."""
    t = t0 + tl.arange(0, BT)
    return (b * T + t).to(tl.int64) * H + h, t < T


@triton.jit
def _load_keys(q, k, beta, resets, b, h, t0, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
               BK: tl.constexpr, EFLA: tl.constexpr, HAS_RESETS: tl.constexpr):
    """Load the key side of one chunk (fp32, zeros past T) and form the unit-key gate and the segment masks.

    Returns ``q, k, k̂ [BT, BK]``, ``β, ‖k‖, g, s [BT]`` (``w = s v``), ``seg, sees, last [BT]``, ``carry``, ``row [BT]``
    (int64 row index into the ``[B·T·H, ·]`` layout), ``mqk [BT, BK]`` and ``mt [BT]`` (the in-range masks)."""
    rk = tl.arange(0, BK)
    row, mt = _chunk_rows(b, h, t0, T, H, BT)
    mqk = mt[:, None] & (rk < K)[None, :]
    q_c = tl.load(q + row[:, None] * K + rk[None, :], mask=mqk, other=0.0).to(tl.float32)
    k_c = tl.load(k + row[:, None] * K + rk[None, :], mask=mqk, other=0.0).to(tl.float32)
    b_c = tl.load(beta + row, mask=mt, other=0.0).to(tl.float32)
    if HAS_RESETS:
        r = tl.load(resets + b.to(tl.int64) * T + t0 + tl.arange(0, BT), mask=mt, other=0).to(tl.int32)
    else:
        r = tl.zeros([BT], dtype=tl.int32)
    n0 = key_norm(k_c, 1)
    g, s, n = gate_fwd(n0, b_c, EFLA)
    if EFLA:
        kh = k_c / n[:, None]
    else:
        kh = k_c
    seg, sees, last, carry = segments(r)
    return q_c, k_c, kh, b_c, n0, g, s, seg, sees, last, carry, row, mqk, mt


@triton.jit
def _load_cols(x, row, mt, v0, V: tl.constexpr, BV: tl.constexpr):
    """Columns ``v0 .. v0+BV`` of the rows ``row`` of a row-major ``[·, V]`` tensor as fp32 ``[BT, BV]``, zeros
    outside ``mt`` and V."""
    rv = v0 + tl.arange(0, BV)
    m = mt[:, None] & (rv < V)[None, :]
    return tl.load(x + row[:, None] * V + rv[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _store_cols(x, row, mt, rv, V: tl.constexpr, val):
    """Store ``val [BT, BV]`` (cast to x's dtype) at columns ``rv`` of the rows ``row`` of ``x [·, V]``, within
    ``mt`` and V: what :func:`_load_cols` reads."""
    tl.store(x + row[:, None] * V + rv[None, :], val.to(x.dtype.element_ty), mask=mt[:, None] & (rv < V)[None, :])


@triton.jit
def _dstate_back(ds, q_c, kh, do_c, dr, g, sees, carry, PREC: tl.constexpr):
    """The state's gradient one chunk back: ``dS₀ = carry dS₁ + Qᵀ diag(sees) dO − K̂ᵀ diag(g sees) dR``."""
    return carry * ds + tl.dot(tl.trans(q_c), sees[:, None] * do_c, input_precision=PREC) \
        - tl.dot(tl.trans(kh), (g * sees)[:, None] * dr, input_precision=PREC)


@triton.jit
def _vblock(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr):
    """This program's (sequence·head ``bh``, V block ``vb``), its ``b, h``, the ranges ``rt, rk, rv``, and the mask and
    offsets of its ``[BK, BV]`` state tile."""
    bh = tl.program_id(0)
    vb = tl.program_id(1)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    m_s = (rk < K)[:, None] & (rv < V)[None, :]
    off_s = rk[:, None] * V + rv[None, :]
    return bh, vb, bh // H, bh % H, rt, rk, rv, m_s, off_s


@triton.jit
def _state_tile(ptr, bh, off_s, m_s, HAS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    """This program's tile of a ``[B·H, K, V]`` state as fp32 ``[BK, BV]``, or zeros when there is none."""
    if HAS:
        tile = tl.load(ptr + bh.to(tl.int64) * K * V + off_s, mask=m_s, other=0.0).to(tl.float32)
    else:
        tile = tl.zeros([BK, BV], dtype=tl.float32)
    return tile


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_prep_kernel(q, k, beta, resets, ps, a2s, ms, qes, kps, T, NT, H: tl.constexpr, K: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, EFLA: tl.constexpr, HAS_RESETS: tl.constexpr,
                      SAVE_KP: tl.constexpr, PREC: tl.constexpr):
    """The key side of every chunk, one program per (sequence·head, chunk), for the walks that follow::

        P = (I + A)^{-1},  Lq = Lower(Q K̂ᵀ) ⊙ same,  A2 = Lq P,  M = P diag(g·sees) K̂,  Qe = diag(sees) Q − Lq M,
        Kp = Pᵀ diag(last) K̂   (SAVE_KP, for the split backward's V side)

    so that the forward's walk is ``D = P (sV) − M S₀``, ``O = Qe S₀ + A2 (sV)``, ``S₁ = carry S₀ + K̂ᵀ diag(last) D``
    and the V side's is ``dR = A2ᵀ dO + Kp dS``. P, A2: ``[B·H, NT, BT, BT]``; M, Qe, Kp: ``[B·H, NT, BT, K]``."""
    bh = tl.program_id(0)
    n = tl.program_id(1)
    q_c, _, kh, _, _, g, _, seg, sees, last, _, _, _, _ = _load_keys(
        q, k, beta, resets, bh // H, bh % H, n * BT, T, H, K, BT, BK, EFLA, HAS_RESETS)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    same = seg[:, None] == seg[None, :]
    kk = tl.dot(kh, tl.trans(kh), input_precision=PREC)
    p = tril_inverse(kk, g, seg, BT)
    lq = tl.where((rt[:, None] >= rt[None, :]) & same, tl.dot(q_c, tl.trans(kh), input_precision=PREC), 0.0)
    m = tl.dot(p, (g * sees)[:, None] * kh, input_precision=PREC)
    qe = sees[:, None] * q_c - tl.dot(lq, m, input_precision=PREC)
    c = bh.to(tl.int64) * NT + n
    off_p = (c * BT + rt[:, None]) * BT + rt[None, :]
    off_k = (c * BT + rt[:, None]) * K + rk[None, :]
    m_k = (rk < K)[None, :]
    tl.store(ps + off_p, p)
    tl.store(a2s + off_p, tl.dot(lq, p, input_precision=PREC))
    tl.store(ms + off_k, m, mask=m_k)
    tl.store(qes + off_k, qe, mask=m_k)
    if SAVE_KP:
        tl.store(kps + off_k, tl.dot(tl.trans(p), last[:, None] * kh, input_precision=PREC), mask=m_k)


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_fwd_kernel(q, k, v, beta, resets, h0, o, ht, hs, ps, a2s, ms, qes, dbuf, T, NT, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     EFLA: tl.constexpr, HAS_RESETS: tl.constexpr, HAS_H0: tl.constexpr, SAVE: tl.constexpr,
                     PREC: tl.constexpr):
    """One program per (sequence·head, V block) walks the chunks with its ``[K, BV]`` block of the state, on the
    prep kernel's key side: ``D = P(sV) − M S₀``, ``O = Qe S₀ + A2(sV)``, ``S₁ = carry S₀ + K̂ᵀ diag(last) D`` (two
    products on the state, one of them on the critical path). With ``SAVE`` it stores what the backward reads:
    the chunk-entry states ``hs [B·H, NT, K, V]`` and D ``dbuf [B·H, NT·BT, V]``."""
    bh, vb, b, h, rt, rk, rv, m_s, off_s = _vblock(H, K, V, BT, BK, BV)
    state = _state_tile(h0, bh, off_s, m_s, HAS_H0, K, V, BK, BV)
    for n in range(NT):
        c = bh.to(tl.int64) * NT + n
        _, _, kh, _, _, _, s, _, _, last, carry, row, _, mt = _load_keys(
            q, k, beta, resets, b, h, n * BT, T, H, K, BT, BK, EFLA, HAS_RESETS)
        v_c = _load_cols(v, row, mt, vb * BV, V, BV)
        if SAVE:
            tl.store(hs + c * K * V + off_s, state, mask=m_s)
        off_p = (c * BT + rt[:, None]) * BT + rt[None, :]
        off_k = (c * BT + rt[:, None]) * K + rk[None, :]
        m_k = (rk < K)[None, :]
        p = tl.load(ps + off_p)
        sv = s[:, None] * v_c
        d = tl.dot(p, sv, input_precision=PREC) - tl.dot(tl.load(ms + off_k, mask=m_k, other=0.0), state,
                                                          input_precision=PREC)
        o_c = tl.dot(tl.load(qes + off_k, mask=m_k, other=0.0), state, input_precision=PREC) \
            + tl.dot(tl.load(a2s + off_p), sv, input_precision=PREC)
        if SAVE:
            tl.store(dbuf + (c * BT + rt[:, None]) * V + rv[None, :], d, mask=(rv < V)[None, :])
        _store_cols(o, row, mt, rv, V, o_c)
        state = carry * state + tl.dot(tl.trans(kh), last[:, None] * d, input_precision=PREC)
    tl.store(ht + bh.to(tl.int64) * K * V + off_s, state, mask=m_s)


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_bwd_v_kernel(q, k, beta, resets, a2s, kps, dbuf, do, dht, dv, drbuf, ddsbuf, dh0, T, NT, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       EFLA: tl.constexpr, HAS_RESETS: tl.constexpr, HAS_DHT: tl.constexpr, PREC: tl.constexpr):
    """Split backward, V side: one program per (sequence·head, V block) walks the chunks in reverse with its
    columns of dS on chip. Per chunk, with the prep kernel's ``A2 = Lq P`` and ``Kp = Pᵀ diag(last) K̂``:
    ``dR = Pᵀ dD = A2ᵀ dO + Kp dS`` (``dD = Lqᵀ dO + diag(last) K̂ dS``), ``dv = s dR`` (exact); it saves
    ``dR → drbuf [B·H, NT·BT, V]`` and this block's part of ``D dSᵀ → ddsbuf [n_vblocks, B·H, NT·BT, K]`` (the exit
    dS's only use on the K side; a [BT, K] partial instead of the [K, V] dS) before
    ``dS ← carry dS + Qᵀ diag(sees) dO − K̂ᵀ diag(g sees) dR``."""
    bh, vb, b, h, rt, rk, rv, m_s, off_s = _vblock(H, K, V, BT, BK, BV)
    ds = _state_tile(dht, bh, off_s, m_s, HAS_DHT, K, V, BK, BV)
    part = vb.to(tl.int64) * tl.num_programs(0).to(tl.int64) * NT * BT * K
    for i in range(NT):
        n = NT - 1 - i
        c = bh.to(tl.int64) * NT + n
        q_c, _, kh, _, _, g, s, seg, sees, last, carry, row, _, mt = _load_keys(
            q, k, beta, resets, b, h, n * BT, T, H, K, BT, BK, EFLA, HAS_RESETS)
        do_c = _load_cols(do, row, mt, vb * BV, V, BV)
        off_k = (c * BT + rt[:, None]) * K + rk[None, :]
        m_k = (rk < K)[None, :]
        a2 = tl.load(a2s + (c * BT + rt[:, None]) * BT + rt[None, :])
        dr = tl.dot(tl.trans(a2), do_c, input_precision=PREC) \
            + tl.dot(tl.load(kps + off_k, mask=m_k, other=0.0), ds, input_precision=PREC)
        off_c = (c * BT + rt[:, None]) * V + rv[None, :]
        d = tl.load(dbuf + off_c, mask=(rv < V)[None, :], other=0.0)
        tl.store(ddsbuf + part + off_k, tl.dot(d, tl.trans(ds), input_precision=PREC), mask=m_k)
        tl.store(drbuf + off_c, dr, mask=(rv < V)[None, :])
        _store_cols(dv, row, mt, rv, V, s[:, None] * dr)
        ds = _dstate_back(ds, q_c, kh, do_c, dr, g, sees, carry, PREC)
    tl.store(dh0 + bh.to(tl.int64) * K * V + off_s, ds, mask=m_s)


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_bwd_k_kernel(q, k, v, beta, resets, hs, dbuf, drbuf, ddsbuf, do, dq, dk, dbeta, T, NT, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       NVV: tl.constexpr, EFLA: tl.constexpr, HAS_RESETS: tl.constexpr, PREC: tl.constexpr):
    """Split backward, K side: one program per (sequence·head, chunk), all chunks in parallel (no recurrence).
    From the saved S₀ (hs), D (dbuf), dR (drbuf) it sums over V in tiles of BV, and adds the V side's ``NVV``
    partials of ``D dSᵀ`` (ddsbuf, dS the chunk's exit gradient)::

        dQK = Lower(dO Dᵀ) ⊙ same,   dA = −StrictLower(dR Dᵀ) ⊙ same
        dq  = dQK K̂ + diag(sees) dO S₀ᵀ
        dk̂  = dQKᵀ Q + diag(last) D dSᵀ + (G dA + (G dA)ᵀ) K̂ − diag(g sees) dR S₀ᵀ    (G = diag(g))
        dg  = rowsum(dA ⊙ K̂K̂ᵀ) − sees ⊙ rowsum(K̂ ⊙ dR S₀ᵀ),   dsv = rowsum(dR ⊙ V)

    and chains (dk̂, dg, dsv) through the gate to dk and dβ. The products over V use ``PREC``; the small ones after
    the loop (inner dim BT, and K̂K̂ᵀ) stay fp32 FMA: with tensor cores there, ptxas spilled 600-900 bytes."""
    bh = tl.program_id(0)
    n = tl.program_id(1)
    c = bh.to(tl.int64) * NT + n
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    row, mt = _chunk_rows(bh // H, bh % H, n * BT, T, H, BT)
    dqk = tl.zeros([BT, BT], dtype=tl.float32)
    da = tl.zeros([BT, BT], dtype=tl.float32)
    dos0 = tl.zeros([BT, BK], dtype=tl.float32)
    drs0 = tl.zeros([BT, BK], dtype=tl.float32)
    dsv = tl.zeros([BT], dtype=tl.float32)
    crow = c * BT + rt
    for v0 in range(0, V, BV):
        rv = v0 + tl.arange(0, BV)
        m_s = (rk < K)[:, None] & (rv < V)[None, :]
        off_s = c * K * V + rk[:, None] * V + rv[None, :]
        do_c = _load_cols(do, row, mt, v0, V, BV)
        v_c = _load_cols(v, row, mt, v0, V, BV)
        d_c = _load_cols(dbuf, crow, mt, v0, V, BV)
        dr_c = _load_cols(drbuf, crow, mt, v0, V, BV)
        s0 = tl.load(hs + off_s, mask=m_s, other=0.0)
        dqk = tl.dot(do_c, tl.trans(d_c), dqk, input_precision=PREC)
        da = tl.dot(dr_c, tl.trans(d_c), da, input_precision=PREC)
        dos0 = tl.dot(do_c, tl.trans(s0), dos0, input_precision=PREC)
        drs0 = tl.dot(dr_c, tl.trans(s0), drs0, input_precision=PREC)
        dsv += tl.sum(dr_c * v_c, 1)
    # the key side only now: kept out of the loop's live registers
    q_c, _, kh, b_c, n0, g, s, seg, sees, last, carry, _, mqk, _ = _load_keys(
        q, k, beta, resets, bh // H, bh % H, n * BT, T, H, K, BT, BK, EFLA, HAS_RESETS)
    off_k = crow[:, None] * K + rk[None, :]
    m_k = (rk < K)[None, :]
    dds = tl.load(ddsbuf + off_k, mask=m_k, other=0.0)
    for j in range(1, NVV):
        dds += tl.load(ddsbuf + j * tl.num_programs(0).to(tl.int64) * NT * BT * K + off_k, mask=m_k, other=0.0)
    same = seg[:, None] == seg[None, :]
    dqk = tl.where((rt[:, None] >= rt[None, :]) & same, dqk, 0.0)
    da = tl.where((rt[:, None] > rt[None, :]) & same, -da, 0.0)
    gs = g * sees
    dq_c = tl.dot(dqk, kh, input_precision="ieee") + sees[:, None] * dos0
    ga = g[:, None] * da
    dkh = tl.dot(tl.trans(dqk), q_c, input_precision="ieee") + last[:, None] * dds - gs[:, None] * drs0 \
        + tl.dot(ga + tl.trans(ga), kh, input_precision="ieee")
    kk = tl.dot(kh, tl.trans(kh), input_precision="ieee")
    dg = tl.sum(da * kk, 1) - sees * tl.sum(kh * drs0, 1)
    dk_c, db_c = gate_bwd(kh, b_c, n0, dkh, dg, dsv, EFLA)
    tl.store(dq + row[:, None] * K + rk[None, :], dq_c.to(dq.dtype.element_ty), mask=mqk)
    tl.store(dk + row[:, None] * K + rk[None, :], dk_c.to(dk.dtype.element_ty), mask=mqk)
    tl.store(dbeta + row, db_c.to(dbeta.dtype.element_ty), mask=mt)


CHUNK = 16  # chunks of 32 and 64 spilled registers in every kernel and ran 1.3-1.8x slower at D64 (docs/kernels.md)
WARPS, STAGES = 4, 2  # the walks and the K side: 4 warps, loops pipelined over 2 stages
PREP_WARPS, PREP_STAGES = 1, 1  # the prep kernel's 16x16 tiles need no cross-warp reductions at 1 warp
PRECISIONS = ("ieee", "tf32x3", "tf32")


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(x))


def launch_config(K: int, V: int, B: int, H: int, dtype: torch.dtype = torch.float32) -> dict:
    """The per-shape launch choices (measured on H100/H200, docs/kernels.md):

    - ``prec``, the ``input_precision`` of the ``tl.dot`` over V: "tf32x3" (3 TF32 tensor-core products, ~fp32
      accurate); "ieee" (fp32 FMA) at D16, where it is faster; "tf32" (one pass, ~1e-3 relative) from D64 for
      bf16/fp16 inputs, whose own rounding is of that order;
    - ``block_v``, the V block of both walks: V/2 while B·H < 256 (more programs at small batches), the whole V from
      B·H = 256 (about 2 walks per SM on 132 SMs, where splitting only recomputes the key side), 32 from V = 128;
    - ``kside_block_v``, the K side's V tile: 64, or 32 from D128 (64 spills there).
    """
    bk, bv = _pow2(K), _pow2(V)
    prec = "ieee" if bk * bv <= 16 * 16 else "tf32x3"
    if bk * bv >= 64 * 64 and dtype in (torch.bfloat16, torch.float16):
        prec = "tf32"
    block_v = 32 if bv >= 128 else (max(16, bv // 2) if B * H < 256 else bv)
    return dict(prec=prec, block_v=block_v, kside_block_v=32 if max(bk, bv) >= 128 else 64)


def check_config(cfg: dict) -> dict:
    """Reject unknown keys and values of a :func:`launch_config` override (a typo would otherwise be ignored)."""
    bad = sorted(set(cfg) - {"prec", "block_v", "kside_block_v"})
    if bad:
        raise ValueError(f"unknown config keys {bad}; valid: block_v, kside_block_v, prec")
    if cfg.get("prec", "ieee") not in PRECISIONS:
        raise ValueError(f"config prec={cfg['prec']!r}; valid: {PRECISIONS}")
    for key in ("block_v", "kside_block_v"):
        blk = cfg.get(key, 16)
        if not isinstance(blk, int) or blk < 16 or blk & (blk - 1):
            raise ValueError(f"config {key}={blk!r}; valid: a power of two >= 16")
    return cfg


def chunk_fwd(q, k, v, beta, resets, h0, *, efla: bool, save: bool, cfg: dict):
    """Returns ``(o, final state, saved)``; with ``save``, ``saved = (hs, dbuf, a2s, kps)`` holds what the backward
    reads: the chunk-entry states ``hs [B·H, NT, K, V]``, D ``dbuf [B·H, NT·BT, V]`` and the prep kernel's
    ``a2s [B·H, NT, BT, BT]`` and ``kps [B·H, NT, BT, K]``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV = _pow2(K), min(cfg["block_v"], _pow2(V))
    NT = triton.cdiv(T, CHUNK)
    f32 = dict(dtype=torch.float32, device=q.device)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(B, H, K, V, **f32)
    hs = torch.empty(B * H, NT, K, V, **f32) if save else ht
    ps, a2s = (torch.empty(B * H, NT, CHUNK, CHUNK, **f32) for _ in range(2))
    ms, qes = (torch.empty(B * H, NT, CHUNK, K, **f32) for _ in range(2))
    kps = torch.empty(B * H, NT, CHUNK, K, **f32) if save else ht
    dbuf = torch.empty(B * H, NT * CHUNK, V, **f32) if save else ht
    r = resets.view(torch.uint8) if resets is not None else q
    common = dict(H=H, K=K, BT=CHUNK, BK=BK, EFLA=efla, HAS_RESETS=resets is not None, PREC=cfg["prec"])
    chunk_prep_kernel[(B * H, NT)](q, k, beta, r, ps, a2s, ms, qes, kps, T, NT, **common, SAVE_KP=save,
                                   num_warps=PREP_WARPS, num_stages=PREP_STAGES)
    chunk_fwd_kernel[(B * H, triton.cdiv(V, BV))](
        q, k, v, beta, r, h0 if h0 is not None else ht, o, ht, hs, ps, a2s, ms, qes, dbuf, T, NT, **common, V=V,
        BV=BV, HAS_H0=h0 is not None, SAVE=save, num_warps=WARPS, num_stages=STAGES)
    return o, ht, (hs, dbuf, a2s, kps)  # only what the backward reads stays alive until it runs


def chunk_bwd(q, k, v, beta, resets, saved, do, dht, *, efla: bool, cfg: dict):
    """Gradients ``(dq, dk, dv, dβ, dS₀ fp32)`` from the forward's ``saved`` tensors (:func:`chunk_fwd`)."""
    hs, dbuf, a2s, kps = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV = _pow2(K), min(cfg["block_v"], _pow2(V))
    NT, NV = triton.cdiv(T, CHUNK), triton.cdiv(V, BV)
    dev = q.device
    dq, dk, dv, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=dev)
    r = resets.view(torch.uint8) if resets is not None else q
    do = do.contiguous()
    if dht is not None:
        dht = dht.float().contiguous()
    common = dict(H=H, K=K, V=V, BT=CHUNK, BK=BK, EFLA=efla, HAS_RESETS=resets is not None, PREC=cfg["prec"],
                  num_warps=WARPS, num_stages=STAGES)
    drbuf = torch.empty(B * H, NT * CHUNK, V, dtype=torch.float32, device=dev)
    ddsbuf = torch.empty(NV, B * H, NT * CHUNK, K, dtype=torch.float32, device=dev)
    chunk_bwd_v_kernel[(B * H, NV)](
        q, k, beta, r, a2s, kps, dbuf, do, dht if dht is not None else dh0, dv, drbuf, ddsbuf, dh0, T, NT,
        **common, BV=BV, HAS_DHT=dht is not None)
    chunk_bwd_k_kernel[(B * H, NT)](
        q, k, v, beta, r, hs, dbuf, drbuf, ddsbuf, do, dq, dk, dbeta, T, NT, **common,
        BV=min(cfg["kside_block_v"], _pow2(V)), NVV=NV)
    return dq, dk, dv, dbeta, dh0


class ChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, h0, resets, efla, cfg):  # type: ignore[override]
        o, ht, saved = chunk_fwd(q, k, v, beta, resets, h0, efla=efla, save=True, cfg=cfg)
        ctx.save_for_backward(q, k, v, beta, resets, *saved)
        ctx.efla, ctx.cfg, ctx.h0_dtype = efla, cfg, (h0.dtype if h0 is not None else None)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):  # type: ignore[override]
        q, k, v, beta, resets, *saved = ctx.saved_tensors
        dq, dk, dv, dbeta, dh0 = chunk_bwd(q, k, v, beta, resets, saved, do, dht, efla=ctx.efla, cfg=ctx.cfg)
        return dq, dk, dv, dbeta, (dh0.to(ctx.h0_dtype) if ctx.h0_dtype is not None else None), None, None, None
