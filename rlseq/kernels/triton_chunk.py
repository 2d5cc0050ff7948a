"""Chunked (WY) delta rules in Triton: forward and backward, one program per (sequence, head, block of V columns).

Each program walks the chunks of its sequence in order with a ``[K, BV]`` block of columns of the fp32 state
on chip (forward), or in reverse with that block of the state's gradient (backward). The value dimension V is
split into ``V / BV`` blocks (``config["block_v"]``): the state's columns, ``D = P R``'s columns and O's columns
are independent in V, so every block only recomputes the shared key side (gate, masks, ``K̂K̂ᵀ``, P). Per chunk it forms the gate from
the raw inputs (``triton_core.gate_fwd``), the segment masks from the resets, and

    P = (I + A)^{-1},  A = StrictLower(diag(g) K̂K̂ᵀ) ⊙ same
    R = W − diag(g ⊙ sees) K̂ S₀,   D = P R
    O = diag(sees) Q S₀ + (Lower(Q K̂ᵀ) ⊙ same) D
    S₁ = carry · S₀ + K̂ᵀ diag(last) D

which is ``rlseq.kernels.chunk.chunk_torch`` rewritten with ``D = U − diag(sees) W S₀ = P R``.

Launches: forward 1 (``mode="inline"``: P by forward substitution inside the walk) or 2 (``mode="prep"``:
a first kernel computes every chunk's P in parallel over (sequence, head, chunk)). Backward, ``bwd="fused"``: one
kernel per (sequence·head, V block) reloads P and the chunk-entry states saved by the forward, walks back with dS,
and chains the gate's gradient to k, v and β in-kernel. dv and dS₀ are exact per block, while dq, dk and dβ are
sums over the blocks: every block chains its own partial through the gate (the gate's backward is linear in
(dk̂, dg, Σ_v dw·v)) into one fp32 buffer ``[n_vblocks, 2·N·K + N]``, and one ``torch.sum`` reduces it
(deterministic, no atomics): 1 launch with one V block, else 2 (+ 3 casts for bf16/fp16 inputs).
``bwd="split"`` moves the cross-V work out of the recurrence to cut live tiles: a V-side kernel (reverse walk per
(sequence·head, V block): dS, dR = Pᵀ dD, dv, dS₀) saves dR and each chunk's exit dS, and a K-side kernel per
(sequence·head, chunk), all chunks in parallel, forms dq, dk̂, dg from them, S₀ and the D saved by the forward,
and chains the gate: 2 launches, no reduction, no casts. Dot precision: ``config["prec"]`` (``default_config``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlseq.kernels.triton_core import gate_bwd, gate_fwd, segments, tril_inverse


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

    Returns ``q, k, k̂ [BT, BK]``, ``β, λ, g, s [BT]`` (``w = s v``), ``seg, sees, last [BT]``, ``carry``, ``row [BT]``
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
    lam = tl.sum(k_c * k_c, 1)
    g, s, n = gate_fwd(lam, b_c, EFLA)
    if EFLA:
        kh = k_c / n[:, None]
    else:
        kh = k_c
    seg, sees, last, carry = segments(r)
    return q_c, k_c, kh, b_c, lam, g, s, seg, sees, last, carry, row, mqk, mt


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
    """This program's (sequence·head ``bh``, V block ``vb``), its ``b, h``, the ranges ``rt, rk, rv``, the mask and
    offsets of its ``[BK, BV]`` state tile, and the causal mask ``[BT, BT]``."""
    bh = tl.program_id(0)
    vb = tl.program_id(1)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    m_s = (rk < K)[:, None] & (rv < V)[None, :]
    off_s = rk[:, None] * V + rv[None, :]
    return bh, vb, bh // H, bh % H, rt, rk, rv, m_s, off_s, rt[:, None] >= rt[None, :]


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
                     K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, EFLA: tl.constexpr,
                     HAS_RESETS: tl.constexpr, HAS_H0: tl.constexpr, SAVE_STATES: tl.constexpr,
                     LOAD_P: tl.constexpr, SAVE_P: tl.constexpr, SAVE_D: tl.constexpr, PREC: tl.constexpr):
    """One program per (sequence·head, V block). Saves, when asked, the chunk-entry states ``hs [B·H, NT, K, V]``,
    P ``[B·H, NT, BT, BT]`` and D ``dbuf [B·H, NT·BT, V]`` (for the split backward)."""
    bh, vb, b, h, rt, rk, rv, m_s, off_s, lower = _vblock(H, K, V, BT, BK, BV)
    state = _state_tile(h0, bh, off_s, m_s, HAS_H0, K, V, BK, BV)
    for n in range(NT):
        c = bh.to(tl.int64) * NT + n
        q_c, _, kh, _, _, g, s, seg, sees, last, carry, row, _, mt = _load_keys(
            q, k, beta, resets, b, h, n * BT, T, H, K, BT, BK, EFLA, HAS_RESETS)
        v_c = _load_cols(v, row, mt, vb * BV, V, BV)
        if SAVE_STATES:
            tl.store(hs + c * K * V + off_s, state, mask=m_s)
        off_p = (c * BT + rt[:, None]) * BT + rt[None, :]
        if LOAD_P:  # the prep kernel's key side: two products on the state, one of them on the critical path
            off_k = (c * BT + rt[:, None]) * K + rk[None, :]
            m_k = (rk < K)[None, :]
            p = tl.load(ps + off_p)
            sv = s[:, None] * v_c
            d = tl.dot(p, sv, input_precision=PREC) - tl.dot(tl.load(ms + off_k, mask=m_k, other=0.0), state,
                                                              input_precision=PREC)
            o_c = tl.dot(tl.load(qes + off_k, mask=m_k, other=0.0), state, input_precision=PREC) \
                + tl.dot(tl.load(a2s + off_p), sv, input_precision=PREC)
        else:
            kk = tl.dot(kh, tl.trans(kh), input_precision=PREC)
            p = tril_inverse(kk, g, seg, BT)
            if SAVE_P:  # every V block computes the same P; the first one saves it
                tl.store(ps + off_p, p, mask=((rt[:, None] + rt[None, :]) * 0 + vb) == 0)
            ks = tl.dot(kh, state, input_precision=PREC)
            d = tl.dot(p, s[:, None] * v_c - (g * sees)[:, None] * ks, input_precision=PREC)
            qk = tl.where(lower & (seg[:, None] == seg[None, :]), tl.dot(q_c, tl.trans(kh), input_precision=PREC), 0.0)
            o_c = sees[:, None] * tl.dot(q_c, state, input_precision=PREC) + tl.dot(qk, d, input_precision=PREC)
        if SAVE_D:
            tl.store(dbuf + (c * BT + rt[:, None]) * V + rv[None, :], d, mask=(rv < V)[None, :])
        _store_cols(o, row, mt, rv, V, o_c)
        state = carry * state + tl.dot(tl.trans(kh), last[:, None] * d, input_precision=PREC)
    tl.store(ht + bh.to(tl.int64) * K * V + off_s, state, mask=m_s)


@triton.jit(do_not_specialize=["T", "NT", "PS"])
def chunk_bwd_kernel(q, k, v, beta, resets, hs, ps, do, dht, dq, dk, dv, dbeta, dh0, T, NT, PS, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     EFLA: tl.constexpr, HAS_RESETS: tl.constexpr, HAS_DHT: tl.constexpr, PREC: tl.constexpr):
    """The fused backward: one program per (sequence·head, V block). dq, dk, dβ are this block's partials (the
    final gradients when there is one block), written at ``dq + vb·PS`` etc.; dv and dS₀ are exact per block."""
    bh, vb, b, h, rt, rk, rv, m_s, off_s, lower = _vblock(H, K, V, BT, BK, BV)
    po = vb.to(tl.int64) * PS
    strict = rt[:, None] > rt[None, :]
    ds = _state_tile(dht, bh, off_s, m_s, HAS_DHT, K, V, BK, BV)
    for i in range(NT):
        n = NT - 1 - i
        c = bh.to(tl.int64) * NT + n
        q_c, k_c, kh, b_c, lam, g, s, seg, sees, last, carry, row, mqk, mt = _load_keys(
            q, k, beta, resets, b, h, n * BT, T, H, K, BT, BK, EFLA, HAS_RESETS)
        v_c = _load_cols(v, row, mt, vb * BV, V, BV)
        do_c = _load_cols(do, row, mt, vb * BV, V, BV)
        s0 = tl.load(hs + c * K * V + off_s, mask=m_s, other=0.0)
        p = tl.load(ps + (c * BT + rt[:, None]) * BT + rt[None, :])
        same = seg[:, None] == seg[None, :]
        gs = g * sees
        # recompute the forward's intermediates
        kk = tl.dot(kh, tl.trans(kh), input_precision=PREC)
        ks = tl.dot(kh, s0, input_precision=PREC)
        d = tl.dot(p, s[:, None] * v_c - gs[:, None] * ks, input_precision=PREC)
        qk = tl.where(lower & same, tl.dot(q_c, tl.trans(kh), input_precision=PREC), 0.0)
        # through O and S₁
        dd = tl.dot(tl.trans(qk), do_c, input_precision=PREC) + last[:, None] * tl.dot(kh, ds, input_precision=PREC)
        dqk = tl.where(lower & same, tl.dot(do_c, tl.trans(d), input_precision=PREC), 0.0)
        dq_c = tl.dot(dqk, kh, input_precision=PREC) + sees[:, None] * tl.dot(do_c, tl.trans(s0), input_precision=PREC)
        dkh = tl.dot(tl.trans(dqk), q_c, input_precision=PREC) + last[:, None] * tl.dot(d, tl.trans(ds), input_precision=PREC)
        # through D = P R
        dr = tl.dot(tl.trans(p), dd, input_precision=PREC)
        da = tl.where(strict & same, -tl.dot(dr, tl.trans(d), input_precision=PREC), 0.0)
        dg = tl.sum(da * kk, 1) - sees * tl.sum(dr * ks, 1)
        ga = g[:, None] * da
        dkh += tl.dot(ga + tl.trans(ga), kh, input_precision=PREC)
        dkh -= gs[:, None] * tl.dot(dr, tl.trans(s0), input_precision=PREC)
        ds = _dstate_back(ds, q_c, kh, do_c, dr, g, sees, carry, PREC)
        # the gate, back to the raw inputs (linear in dkh, dg and Σ_v dr·v: per-block partials add up)
        dk_c, db_c = gate_bwd(k_c, kh, b_c, lam, dkh, dg, tl.sum(dr * v_c, 1), EFLA)
        tl.store(dq + po + row[:, None] * K + rk[None, :], dq_c.to(dq.dtype.element_ty), mask=mqk)
        tl.store(dk + po + row[:, None] * K + rk[None, :], dk_c.to(dk.dtype.element_ty), mask=mqk)
        _store_cols(dv, row, mt, rv, V, s[:, None] * dr)
        tl.store(dbeta + po + row, db_c.to(dbeta.dtype.element_ty), mask=mt)
    tl.store(dh0 + bh.to(tl.int64) * K * V + off_s, ds, mask=m_s)


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
    bh, vb, b, h, rt, rk, rv, m_s, off_s, lower = _vblock(H, K, V, BT, BK, BV)
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
    the loop (inner dim BT, and K̂K̂ᵀ) stay fp32 FMA: with tensor cores there, ptxas spilled 600-900 bytes at w4/w8
    (sm_90, tf32x3), with FMA 0-60."""
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
    q_c, k_c, kh, b_c, lam, g, s, seg, sees, last, carry, _, mqk, _ = _load_keys(
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
    dk_c, db_c = gate_bwd(k_c, kh, b_c, lam, dkh, dg, dsv, EFLA)
    tl.store(dq + row[:, None] * K + rk[None, :], dq_c.to(dq.dtype.element_ty), mask=mqk)
    tl.store(dk + row[:, None] * K + rk[None, :], dk_c.to(dk.dtype.element_ty), mask=mqk)
    tl.store(dbeta + row, db_c.to(dbeta.dtype.element_ty), mask=mt)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(x))


# compiled kernels of the latest launches, by role ("prep", "fwd", "bwd" (fused), "bwd_v", "bwd_k"), for resource
# reports (``.n_regs``, ``.n_spills``, ``.metadata.shared``)
LAST_COMPILED: dict = {}

PRECISIONS = ("ieee", "tf32x3", "tf32")


def default_config(T: int, K: int, V: int, B: int | None = None, H: int | None = None,
                   dtype: torch.dtype = torch.float32) -> dict:
    """The launch config; every key can be overridden through ``chunk_triton(config=...)``:

    - ``chunk_size`` ∈ {16, 32, 64}; ``mode`` ∈ {"inline", "prep"} (forward: P inside the walk, or by a first kernel);
    - ``prec``: ``input_precision`` of every ``tl.dot``: "ieee" (fp32 FMA), "tf32x3" (3 TF32 tensor-core products,
      ~fp32 accurate) or "tf32" (one, ~1e-3 relative error), the default from D64 for bf16/fp16 inputs
      (``dtype``), whose own rounding is of that order;
    - ``block_v``: V block of the forward (a power of two ≥ 16; None or ≥ V: one block); ``block_v_bwd``: of the
      backward (fused or V side), None = ``block_v``;
    - ``num_warps`` (forward), ``num_warps_bwd`` (fused backward or V side) and ``prep_warps`` (prep kernel), None =
      ``num_warps``; ``num_stages`` (software pipelining of the loops: forward), ``num_stages_bwd`` (fused backward
      or V side), ``kside_stages`` (K side) and ``prep_stages``, None = ``num_stages``; ``fwd_maxnreg``,
      ``bwd_maxnreg`` (fused backward or V side) and ``kside_maxnreg``: a cap on registers per thread (more programs
      per SM, at the risk of spills; None: the compiler's choice);
    - ``bwd`` ∈ {"fused", "split"}: one kernel per (sequence·head, V block) doing everything, or a V-side kernel
      (reverse walk: dS, dR, dv, dS₀) then a K-side kernel per (sequence·head, chunk) (dq, dk, dβ), whose V tile is
      ``kside_block_v``, warps ``kside_warps`` and dot precision ``kside_prec`` (None = ``prec``).
    """
    bk, bv = _pow2(K), _pow2(V)
    big = bk * bv >= 64 * 64
    # v6, every head dim: the prep kernel (key side of all chunks in parallel), walks pipelined over 2 stages, the
    # split backward, chunks of 16, 1 warp per prep program. Device time of fwd+bwd replayed from a CUDA graph on an
    # H100 against v5's fused kernel (chunks of 32) below D64: D32 B8 0.252 -> 0.097 ms, B64 0.803 -> 0.255; D16 B8
    # 0.177 -> 0.068, B64 0.247 -> 0.146 (docs/triton_notes.md, v6).
    cfg = dict(chunk_size=16, num_warps=4, num_stages=2, mode="prep", prec="tf32x3", block_v=None, bwd="split",
               block_v_bwd=None, num_warps_bwd=None, kside_block_v=64, kside_warps=4, kside_prec=None,
               num_stages_bwd=None, kside_stages=None, prep_warps=1, prep_stages=1, fwd_maxnreg=None,
               bwd_maxnreg=None, kside_maxnreg=None)
    if bk * bv <= 16 * 16:
        cfg["prec"] = "ieee"  # D16: FMA dots beat 3xTF32 (B8 0.068 vs 0.083 ms, B64 0.146 vs 0.166)
    # V blocks: two per (sequence, head) for more programs at small batches; one once B·H >= 256 (~2 walks per SM on
    # 132 SMs), where splitting V only recomputes the key side: D64 B64 fwd 0.123 -> 0.089 ms, V side 0.136 -> 0.122,
    # D32 B64 0.311 -> 0.255 ms; at B·H = 128 (D64 B32) one block is slower, 0.262 -> 0.287. D128: blocks of 32.
    if bv >= 128:
        cfg["block_v"] = 32
    elif B is None or H is None or B * H < 256:
        cfg["block_v"] = max(16, bv // 2)
    if bk >= 128 or bv >= 128:
        # the K side in one tile of 64 spills at D128 (no gain); at D64 it takes B64 0.176 -> 0.158 ms
        cfg["kside_block_v"] = 32
    if big and dtype in (torch.bfloat16, torch.float16):
        # bf16 inputs carry ~2e-3 relative rounding already: one TF32 pass (~1e-3) keeps them within the 1e-2
        # budget at a third of the tensor-core work
        cfg["prec"] = "tf32"
    return cfg


def check_config(cfg: dict) -> dict:
    """Reject unknown keys and values (a typo would otherwise silently time the default)."""
    known = default_config(16, 16, 16)
    bad = sorted(set(cfg) - set(known))
    if bad:
        raise ValueError(f"unknown config keys {bad}; valid: {sorted(known)}")
    for key, valid in (("chunk_size", (16, 32, 64)), ("mode", ("inline", "prep")), ("prec", PRECISIONS),
                       ("kside_prec", (None,) + PRECISIONS), ("bwd", ("fused", "split"))):
        if cfg[key] not in valid:
            raise ValueError(f"config {key}={cfg[key]!r}; valid: {valid}")
    for key in ("block_v", "block_v_bwd", "kside_block_v"):
        _block_v(cfg, 256, key)
    for key in ("fwd_maxnreg", "bwd_maxnreg", "kside_maxnreg"):
        if cfg[key] is not None and not (isinstance(cfg[key], int) and 16 <= cfg[key] <= 255):
            raise ValueError(f"config {key}={cfg[key]!r}; valid: None or an int in [16, 255]")
    if cfg["bwd"] == "split" and cfg["mode"] != "prep":
        raise ValueError("bwd='split' needs mode='prep': its V side reads the prep kernel's A2 = Lq P and "
                         "Kp = Pᵀ diag(last) K̂")
    return cfg


def _maxnreg(n: int | None) -> dict:
    """The launch option capping registers per thread, not passed when None (the compiler's choice)."""
    return {} if n is None else {"maxnreg": n}


def _block_v(cfg: dict, V: int, key: str = "block_v") -> int:
    """The V block named by ``key`` (a power of two ≥ 16; None or ≥ V: the whole V, one block).
    ``block_v_bwd=None`` falls back to ``block_v``."""
    bv = _pow2(V)
    blk = cfg.get(key)
    if key == "block_v_bwd" and blk is None:
        blk = cfg.get("block_v")
    if blk is None or blk >= bv:
        return bv
    if blk < 16 or blk & (blk - 1):
        raise ValueError(f"{key} must be a power of two >= 16, got {blk}")
    return blk


def chunk_fwd(q, k, v, beta, resets, h0, *, efla: bool, save: bool, cfg: dict):
    """Returns ``(o, final state, saved)``; with ``save``, ``saved = (hs, ps, dbuf, a2s, kps)`` holds what the
    backward reads, None elsewhere: the chunk-entry states ``hs [B·H, NT, K, V]``; for ``bwd="fused"`` P
    ``ps [B·H, NT, BT, BT]``; for ``bwd="split"`` D ``dbuf [B·H, NT·BT, V]`` and the prep kernel's
    ``a2s [B·H, NT, BT, BT]`` and ``kps [B·H, NT, BT, K]``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BV = cfg["chunk_size"], _pow2(K), _block_v(cfg, V)
    NT, NV = triton.cdiv(T, BT), triton.cdiv(V, BV)
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=dev)
    ht = torch.empty(B, H, K, V, **f32)
    hs = torch.empty(B * H, NT, K, V, **f32) if save else ht
    prep = cfg["mode"] == "prep"
    split = save and cfg["bwd"] == "split"
    ps = torch.empty(B * H, NT, BT, BT, **f32) if (save or prep) else ht
    a2s = torch.empty(B * H, NT, BT, BT, **f32) if prep else ht
    ms, qes = (torch.empty(B * H, NT, BT, K, **f32) for _ in range(2)) if prep else (ht, ht)
    kps = torch.empty(B * H, NT, BT, K, **f32) if split else ht
    dbuf = torch.empty(B * H, NT * BT, V, **f32) if split else None
    r = resets.view(torch.uint8) if resets is not None else q
    common = dict(H=H, K=K, BT=BT, BK=BK, EFLA=efla, HAS_RESETS=resets is not None, PREC=cfg["prec"])
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_maxnreg(cfg["fwd_maxnreg"]))
    if prep:
        LAST_COMPILED["prep"] = chunk_prep_kernel[(B * H, NT)](
            q, k, beta, r, ps, a2s, ms, qes, kps, T, NT, **common, SAVE_KP=split,
            num_warps=cfg["prep_warps"] or cfg["num_warps"], num_stages=cfg["prep_stages"] or cfg["num_stages"])
    LAST_COMPILED["fwd"] = chunk_fwd_kernel[(B * H, NV)](
        q, k, v, beta, r, h0 if h0 is not None else ht, o, ht, hs, ps, a2s, ms, qes, dbuf if split else ht, T, NT,
        **common, V=V, BV=BV, HAS_H0=h0 is not None, SAVE_STATES=save, LOAD_P=prep, SAVE_P=save and not prep,
        SAVE_D=split, **launch)
    # only what the backward reads stays alive until it runs
    return o, ht, ((hs, None, dbuf, a2s, kps) if split else (hs, ps, None, None, None))


def chunk_bwd(q, k, v, beta, resets, saved, do, dht, *, efla: bool, cfg: dict):
    """Gradients ``(dq, dk, dv, dβ, dS₀ fp32)`` from the forward's ``saved`` tensors (:func:`chunk_fwd`)."""
    hs, ps, dbuf, a2s, kps = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BV = cfg["chunk_size"], _pow2(K), _block_v(cfg, V, "block_v_bwd")
    NT, NV = triton.cdiv(T, BT), triton.cdiv(V, BV)
    dev = q.device
    dv = torch.empty_like(v)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=dev)
    r = resets.view(torch.uint8) if resets is not None else q
    do = do.contiguous()
    if dht is not None:
        dht = dht.float().contiguous()
    common = dict(H=H, K=K, V=V, BT=BT, BK=BK, EFLA=efla, HAS_RESETS=resets is not None, PREC=cfg["prec"])
    stages = cfg["num_stages_bwd"] or cfg["num_stages"]
    launch = dict(num_warps=cfg["num_warps_bwd"] or cfg["num_warps"], num_stages=stages,
                  **_maxnreg(cfg["bwd_maxnreg"]))
    if cfg["bwd"] == "split":
        dq, dk, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(beta)
        drbuf = torch.empty(B * H, NT * BT, V, dtype=torch.float32, device=dev)
        ddsbuf = torch.empty(NV, B * H, NT * BT, K, dtype=torch.float32, device=dev)
        LAST_COMPILED["bwd_v"] = chunk_bwd_v_kernel[(B * H, NV)](
            q, k, beta, r, a2s, kps, dbuf, do, dht if dht is not None else dh0, dv, drbuf, ddsbuf, dh0, T, NT,
            **common, BV=BV, HAS_DHT=dht is not None, **launch)
        LAST_COMPILED["bwd_k"] = chunk_bwd_k_kernel[(B * H, NT)](
            q, k, v, beta, r, hs, dbuf, drbuf, ddsbuf, do, dq, dk, dbeta, T, NT,
            BV=_block_v(cfg, V, "kside_block_v"), NVV=NV, **dict(common, PREC=cfg["kside_prec"] or cfg["prec"]),
            num_warps=cfg["kside_warps"], num_stages=cfg["kside_stages"] or stages, **_maxnreg(cfg["kside_maxnreg"]))
        return dq, dk, dv, dbeta, dh0
    N = B * T * H
    if NV == 1:  # the kernel writes the final gradients
        dq, dk, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(beta)
        dq_p, dk_p, db_p, PS = dq, dk, dbeta, 0
    else:  # per-block fp32 partials of dq, dk, dβ in one buffer, summed over the blocks below
        part = torch.empty(NV, 2 * N * K + N, dtype=torch.float32, device=dev)
        dq_p, dk_p, db_p, PS = part, part[0, N * K:], part[0, 2 * N * K:], part.stride(0)
    LAST_COMPILED["bwd"] = chunk_bwd_kernel[(B * H, NV)](
        q, k, v, beta, r, hs, ps, do, dht if dht is not None else dh0, dq_p, dk_p, dv, db_p, dh0, T, NT, PS,
        **common, BV=BV, HAS_DHT=dht is not None, **launch)
    if NV > 1:
        red = part.sum(0)
        dq = red[: N * K].view(q.shape).to(q.dtype)
        dk = red[N * K: 2 * N * K].view(k.shape).to(k.dtype)
        dbeta = red[2 * N * K:].view(beta.shape).to(beta.dtype)
    return dq, dk, dv, dbeta, dh0


class ChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, h0, resets, efla, cfg):
        o, ht, saved = chunk_fwd(q, k, v, beta, resets, h0, efla=efla, save=True, cfg=cfg)
        ctx.save_for_backward(q, k, v, beta, resets, *saved)
        ctx.efla, ctx.cfg, ctx.h0_dtype = efla, cfg, (h0.dtype if h0 is not None else None)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, resets, *saved = ctx.saved_tensors
        dq, dk, dv, dbeta, dh0 = chunk_bwd(q, k, v, beta, resets, saved, do, dht, efla=ctx.efla, cfg=ctx.cfg)
        return dq, dk, dv, dbeta, (dh0.to(ctx.h0_dtype) if ctx.h0_dtype is not None else None), None, None, None
