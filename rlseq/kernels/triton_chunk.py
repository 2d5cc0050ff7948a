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
a first kernel computes every chunk's P in parallel over (sequence, head, chunk)); backward 1 (it reloads
P and the chunk-entry states saved by the forward, and chains the gate's gradient back to k, v and β
in-kernel) when there is one V block. With several V blocks, dv and dS₀ are still exact per block, while dq,
dk and dβ are sums over the blocks: every block chains its own partial through the gate (the gate's backward
is linear in (dk̂, dg, dw·v)) and writes it to one fp32 buffer ``[n_vblocks, 2·N·K + N]``; one ``torch.sum``
over the blocks reduces it (deterministic, no atomics): backward = 2 launches (+ 3 casts for bf16/fp16 inputs). Dots run in fp32 (``input_precision="ieee"``) unless ``prec="tf32"``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlseq.kernels.triton_core import gate_bwd, gate_fwd, segments, tril_inverse


@triton.jit
def _load_chunk(q, k, v, beta, resets, b, h, t0, v0, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, EFLA: tl.constexpr, HAS_RESETS: tl.constexpr):
    """Load one chunk (fp32, zeros past T; v columns ``v0 .. v0+BV``) and form the unit-key gate and masks."""
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = v0 + tl.arange(0, BV)
    t = t0 + rt
    mt = t < T
    row = (b * T + t).to(tl.int64) * H + h
    mqk = mt[:, None] & (rk < K)[None, :]
    mv = mt[:, None] & (rv < V)[None, :]
    q_c = tl.load(q + row[:, None] * K + rk[None, :], mask=mqk, other=0.0).to(tl.float32)
    k_c = tl.load(k + row[:, None] * K + rk[None, :], mask=mqk, other=0.0).to(tl.float32)
    v_c = tl.load(v + row[:, None] * V + rv[None, :], mask=mv, other=0.0).to(tl.float32)
    b_c = tl.load(beta + row, mask=mt, other=0.0).to(tl.float32)
    if HAS_RESETS:
        r = tl.load(resets + b.to(tl.int64) * T + t, mask=mt, other=0).to(tl.int32)
    else:
        r = tl.zeros([BT], dtype=tl.int32)
    lam = tl.sum(k_c * k_c, 1)
    g, s, n = gate_fwd(lam, b_c, EFLA)
    if EFLA:
        kh = k_c / n[:, None]
    else:
        kh = k_c
    w = s[:, None] * v_c
    seg, sees, last, carry = segments(r)
    return q_c, k_c, v_c, b_c, lam, kh, g, w, seg, sees, last, carry, row, mqk, mv


@triton.jit
def chunk_prep_kernel(k, v, beta, resets, ps, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, EFLA: tl.constexpr,
                      HAS_RESETS: tl.constexpr, PREC: tl.constexpr):
    """``P = (I + A)^{-1}`` of every chunk, one program per (sequence·head, chunk)."""
    bh = tl.program_id(0)
    n = tl.program_id(1)
    b = bh // H
    h = bh % H
    _, _, _, _, _, kh, g, _, seg, _, _, _, _, _, _ = _load_chunk(
        k, k, v, beta, resets, b, h, n * BT, 0, T, H, K, V, BT, BK, BV, EFLA, HAS_RESETS)
    kk = tl.dot(kh, tl.trans(kh), input_precision=PREC)
    p = tril_inverse(kk, g, seg, BT)
    rt = tl.arange(0, BT)
    tl.store(ps + ((bh.to(tl.int64) * NT + n) * BT + rt[:, None]) * BT + rt[None, :], p)


@triton.jit
def chunk_fwd_kernel(q, k, v, beta, resets, h0, o, ht, hs, ps, T, NT, H: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, EFLA: tl.constexpr,
                     HAS_RESETS: tl.constexpr, HAS_H0: tl.constexpr, SAVE_STATES: tl.constexpr,
                     LOAD_P: tl.constexpr, SAVE_P: tl.constexpr, PREC: tl.constexpr):
    bh = tl.program_id(0)
    vb = tl.program_id(1)
    b = bh // H
    h = bh % H
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    m_s = (rk < K)[:, None] & (rv < V)[None, :]
    off_s = rk[:, None] * V + rv[None, :]
    lower = rt[:, None] >= rt[None, :]
    if HAS_H0:
        state = tl.load(h0 + bh.to(tl.int64) * K * V + off_s, mask=m_s, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(NT):
        q_c, k_c, v_c, b_c, lam, kh, g, w, seg, sees, last, carry, row, mqk, mv = _load_chunk(
            q, k, v, beta, resets, b, h, n * BT, vb * BV, T, H, K, V, BT, BK, BV, EFLA, HAS_RESETS)
        if SAVE_STATES:
            tl.store(hs + (bh.to(tl.int64) * NT + n) * K * V + off_s, state, mask=m_s)
        off_p = ((bh.to(tl.int64) * NT + n) * BT + rt[:, None]) * BT + rt[None, :]
        if LOAD_P:
            p = tl.load(ps + off_p)
        else:
            kk = tl.dot(kh, tl.trans(kh), input_precision=PREC)
            p = tril_inverse(kk, g, seg, BT)
            if SAVE_P:  # every V block computes the same P; the first one saves it
                tl.store(ps + off_p, p, mask=((rt[:, None] + rt[None, :]) * 0 + vb) == 0)
        ks = tl.dot(kh, state, input_precision=PREC)
        r_c = w - (g * sees)[:, None] * ks
        d = tl.dot(p, r_c, input_precision=PREC)
        same = seg[:, None] == seg[None, :]
        qk = tl.where(lower & same, tl.dot(q_c, tl.trans(kh), input_precision=PREC), 0.0)
        o_c = sees[:, None] * tl.dot(q_c, state, input_precision=PREC) + tl.dot(qk, d, input_precision=PREC)
        tl.store(o + row[:, None] * V + rv[None, :], o_c.to(o.dtype.element_ty), mask=mv)
        state = carry * state + tl.dot(tl.trans(kh), last[:, None] * d, input_precision=PREC)
    tl.store(ht + bh.to(tl.int64) * K * V + off_s, state, mask=m_s)


@triton.jit
def chunk_bwd_kernel(q, k, v, beta, resets, hs, ps, do, dht, dq, dk, dv, dbeta, dh0, T, NT, PS, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     EFLA: tl.constexpr, HAS_RESETS: tl.constexpr, HAS_DHT: tl.constexpr, PREC: tl.constexpr):
    """One program per (sequence·head, V block). dq, dk, dβ are this block's partials (the final gradients when
    there is one block), written at ``dq + vb·PS`` etc.; dv and dS₀ are exact per block."""
    bh = tl.program_id(0)
    vb = tl.program_id(1)
    b = bh // H
    h = bh % H
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    po = vb.to(tl.int64) * PS
    m_s = (rk < K)[:, None] & (rv < V)[None, :]
    off_s = rk[:, None] * V + rv[None, :]
    lower = rt[:, None] >= rt[None, :]
    strict = rt[:, None] > rt[None, :]
    if HAS_DHT:
        ds = tl.load(dht + bh.to(tl.int64) * K * V + off_s, mask=m_s, other=0.0).to(tl.float32)
    else:
        ds = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(NT):
        n = NT - 1 - i
        q_c, k_c, v_c, b_c, lam, kh, g, w, seg, sees, last, carry, row, mqk, mv = _load_chunk(
            q, k, v, beta, resets, b, h, n * BT, vb * BV, T, H, K, V, BT, BK, BV, EFLA, HAS_RESETS)
        s0 = tl.load(hs + (bh.to(tl.int64) * NT + n) * K * V + off_s, mask=m_s, other=0.0)
        p = tl.load(ps + ((bh.to(tl.int64) * NT + n) * BT + rt[:, None]) * BT + rt[None, :])
        do_c = tl.load(do + row[:, None] * V + rv[None, :], mask=mv, other=0.0).to(tl.float32)
        same = seg[:, None] == seg[None, :]
        gs = g * sees
        # recompute the forward's intermediates
        kk = tl.dot(kh, tl.trans(kh), input_precision=PREC)
        ks = tl.dot(kh, s0, input_precision=PREC)
        d = tl.dot(p, w - gs[:, None] * ks, input_precision=PREC)
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
        ds = carry * ds + tl.dot(tl.trans(q_c), sees[:, None] * do_c, input_precision=PREC) \
            - tl.dot(tl.trans(kh), gs[:, None] * dr, input_precision=PREC)
        # the gate, back to the raw inputs (linear in dkh, dg and Σ_v dr·v: per-block partials add up)
        dk_c, dv_c, db_c = gate_bwd(k_c, kh, v_c, b_c, lam, dkh, dg, dr, EFLA)
        tl.store(dq + po + row[:, None] * K + rk[None, :], dq_c.to(dq.dtype.element_ty), mask=mqk)
        tl.store(dk + po + row[:, None] * K + rk[None, :], dk_c.to(dk.dtype.element_ty), mask=mqk)
        tl.store(dv + row[:, None] * V + rv[None, :], dv_c.to(dv.dtype.element_ty), mask=mv)
        tl.store(dbeta + po + row, db_c.to(dbeta.dtype.element_ty), mask=(n * BT + rt) < T)
    tl.store(dh0 + bh.to(tl.int64) * K * V + off_s, ds, mask=m_s)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(x))


# compiled kernels of the latest launches (for resource reports: ``.n_regs``, ``.n_spills``, ``.metadata.shared``)
LAST_COMPILED: dict = {}


def default_config(T: int, K: int, V: int, B: int | None = None, H: int | None = None) -> dict:
    """Chunk size, warps, forward mode and V block; measured on an H200 (docs/triton_notes.md)."""
    bk, bv = _pow2(K), _pow2(V)
    # measured on an H200 at B8/B64 T256 H4 D64 (fwd+bwd, one V block): C16 3.6/7.4 ms, C32 5.1/10.0 ms,
    # C32 "prep" 4.9/9.9 ms; with V blocks (BV16/BV32) C32 stays slower than C16 (2.1 vs 0.47 ms at B8).
    bt = 16 if (bk * bv >= 64 * 64 or T <= 16) else 32
    # V blocks of 16 (B8 H4 D64: 0.47 ms vs 0.74 with 32) unless blocks of 32 still give >= 512 programs
    # (B64 H4 D64: 1.54 ms vs 1.90 with 16): fewer programs recompute the key side, but too few idle the SMs.
    block_v = min(bv, 16)
    if B is not None and H is not None and bv >= 32 and B * H * triton.cdiv(V, 32) >= 512:
        block_v = 32
    nw = 4 if bk * block_v <= 64 * 64 else 8
    return dict(chunk_size=bt, num_warps=nw, num_stages=1, mode="inline", prec="ieee", block_v=block_v)


def _block_v(cfg: dict, V: int) -> int:
    """The V block: ``cfg["block_v"]`` (a power of two ≥ 16; None or ≥ V: the whole V, one block)."""
    bv = _pow2(V)
    blk = cfg.get("block_v")
    if blk is None or blk >= bv:
        return bv
    if blk < 16 or blk & (blk - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {blk}")
    return blk


def chunk_fwd(q, k, v, beta, resets, h0, *, efla: bool, save: bool, cfg: dict):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BV = cfg["chunk_size"], _pow2(K), _block_v(cfg, V)
    NT, NV = triton.cdiv(T, BT), triton.cdiv(V, BV)
    dev = q.device
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=dev)
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=dev)
    hs = torch.empty(B * H, NT, K, V, dtype=torch.float32, device=dev) if save else ht
    prep = cfg["mode"] == "prep"
    ps = torch.empty(B * H, NT, BT, BT, dtype=torch.float32, device=dev) if (save or prep) else ht
    r = resets.view(torch.uint8) if resets is not None else q
    common = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, EFLA=efla, HAS_RESETS=resets is not None, PREC=cfg["prec"])
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if prep:
        LAST_COMPILED["prep"] = chunk_prep_kernel[(B * H, NT)](k, v, beta, r, ps, T, NT, **common, **launch)
    LAST_COMPILED["fwd"] = chunk_fwd_kernel[(B * H, NV)](
        q, k, v, beta, r, h0 if h0 is not None else ht, o, ht, hs, ps, T, NT, **common,
        HAS_H0=h0 is not None, SAVE_STATES=save, LOAD_P=prep, SAVE_P=save and not prep, **launch)
    return o, ht, hs, ps


def chunk_bwd(q, k, v, beta, resets, hs, ps, do, dht, *, efla: bool, cfg: dict):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BV = cfg["chunk_size"], _pow2(K), _block_v(cfg, V)
    NT, NV = triton.cdiv(T, BT), triton.cdiv(V, BV)
    N = B * T * H
    dev = q.device
    dv = torch.empty_like(v)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=dev)
    if NV == 1:  # the kernel writes the final gradients
        dq, dk, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(beta)
        dq_p, dk_p, db_p, PS = dq, dk, dbeta, 0
    else:  # per-block fp32 partials of dq, dk, dβ in one buffer, summed over the blocks below
        part = torch.empty(NV, 2 * N * K + N, dtype=torch.float32, device=dev)
        dq_p, dk_p, db_p, PS = part, part[0, N * K:], part[0, 2 * N * K:], part.stride(0)
    r = resets.view(torch.uint8) if resets is not None else q
    do = do.contiguous()
    if dht is not None:
        dht = dht.float().contiguous()
    LAST_COMPILED["bwd"] = chunk_bwd_kernel[(B * H, NV)](
        q, k, v, beta, r, hs, ps, do, dht if dht is not None else dh0, dq_p, dk_p, dv, db_p, dh0, T, NT, PS,
        H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, EFLA=efla, HAS_RESETS=resets is not None, HAS_DHT=dht is not None,
        PREC=cfg["prec"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if NV > 1:
        red = part.sum(0)
        dq = red[: N * K].view(q.shape).to(q.dtype)
        dk = red[N * K: 2 * N * K].view(k.shape).to(k.dtype)
        dbeta = red[2 * N * K:].view(beta.shape).to(beta.dtype)
    return dq, dk, dv, dbeta, dh0


class ChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, h0, resets, efla, cfg):
        o, ht, hs, ps = chunk_fwd(q, k, v, beta, resets, h0, efla=efla, save=True, cfg=cfg)
        ctx.save_for_backward(q, k, v, beta, resets, hs, ps)
        ctx.efla, ctx.cfg, ctx.h0_dtype = efla, cfg, (h0.dtype if h0 is not None else None)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, resets, hs, ps = ctx.saved_tensors
        dq, dk, dv, dbeta, dh0 = chunk_bwd(q, k, v, beta, resets, hs, ps, do, dht, efla=ctx.efla, cfg=ctx.cfg)
        return dq, dk, dv, dbeta, (dh0.to(ctx.h0_dtype) if ctx.h0_dtype is not None else None), None, None, None
