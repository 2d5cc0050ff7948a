"""One acting step of a delta rule in Triton: one launch updates the fp32 state of B environments × H heads
in place, applies the resets, and writes ``o``. No host syncs and no allocations beyond ``o`` (pass ``out=`` to
reuse a buffer, e.g. inside a CUDA graph)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlseq.kernels.triton_core import gate_fwd, key_norm


@triton.jit
def step_kernel(q, k, v, beta, state, resets, o,
                sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sb_b, sb_h, ss_b, ss_h, ss_k, ss_v, so_b, so_h, sr_b,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                EFLA: tl.constexpr, HAS_RESETS: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    m_s = mk[:, None] & mv[None, :]
    s_ptr = state + b * ss_b + h * ss_h + rk[:, None] * ss_k + rv[None, :] * ss_v
    s = tl.load(s_ptr, mask=m_s, other=0.0).to(tl.float32)
    q_r = tl.load(q + b * sq_b + h * sq_h + rk, mask=mk, other=0.0).to(tl.float32)
    k_r = tl.load(k + b * sk_b + h * sk_h + rk, mask=mk, other=0.0).to(tl.float32)
    v_r = tl.load(v + b * sv_b + h * sv_h + rv, mask=mv, other=0.0).to(tl.float32)
    b_r = tl.load(beta + b * sb_b + h * sb_h).to(tl.float32)
    if HAS_RESETS:
        keep = tl.load(resets + b * sr_b).to(tl.int32) == 0
        s = tl.where(keep, s, 0.0)
    g, sc, n = gate_fwd(key_norm(k_r, 0), b_r, EFLA)
    if EFLA:
        kh = k_r / n
    else:
        kh = k_r
    err = sc * v_r - g * tl.sum(kh[:, None] * s, 0)
    s += kh[:, None] * err[None, :]
    tl.store(s_ptr, s, mask=m_s)
    out = tl.sum(q_r[:, None] * s, 0)
    tl.store(o + b * so_b + h * so_h + rv, out.to(o.dtype.element_ty), mask=mv)


def step_launch(q, k, v, beta, state, resets, o, *, efla: bool, num_warps: int | None = None):
    B, H, K = q.shape
    V = v.shape[-1]
    BK, BV = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    nw = num_warps or (4 if BK * BV <= 64 * 64 else 8)
    step_kernel[(B * H,)](
        q, k, v, beta, state, resets.view(torch.uint8) if resets is not None else q, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), o.stride(0), o.stride(1),
        resets.stride(0) if resets is not None else 0,
        H=H, K=K, V=V, BK=BK, BV=BV, EFLA=efla, HAS_RESETS=resets is not None, num_warps=nw)
    return o

