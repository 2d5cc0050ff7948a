"""The GRU and LSTM scans in Triton: one launch per step forward and one per step backward (and one more for the
entering state's gradient), each doing a step's recurrent matmul and its cell together (the torch loop takes a matmul and 5-7 element-wise kernels per step
forward, and autograd about twice that backward: in a replayed CUDA graph the launch count is what a scan costs).

Every program owns ``BU`` hidden units of ``BB`` sequences, and reads whole rows of the other step's state, so the
only exchange between programs is through memory between launches.

- Forward, step t: the gate pre-activations ``h_{t−1} W_hhᵀ`` of the program's units (the state read as zero
  where step t starts an episode), plus the input's, then the cell; stores ``h_t`` (and the LSTM's ``c_t``) and the
  gate values backward needs.
- Backward, launch t (from ``T − 1`` down to ``−1``): ``∂L/∂h_t`` at the program's units, from step t+1's gate
  gradients times ``W_hh`` plus the cell's direct path (zero where step t+1 reset the state; at ``T − 1`` the
  final state's gradient), then step t's gate gradients at those units, which launch t−1 reads. Launch −1 gives
  the entering state's gradient. The weight gradients are one matmul after the loop, over all steps at once.

float32 state and accumulation. The matmuls follow torch's TF32 switch for matmuls
(``torch.backends.cuda.matmul.allow_tf32``, which ``MemoryPPO(tf32=True)`` sets while it learns): with it off
they keep float32's accuracy (:func:`matmul_precision`), so that the scan is the torch loop's to rounding
(tests/test_rnn_scan.py and gpu-check hold both to the float64 loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

BB = 16  # sequences per program (tl.dot's smallest tile)
BU = 16  # hidden units per program: at hidden 256, 16 programs per launch
BK_MAX = 128  # the reduction's largest block
NUM_WARPS = 4


def matmul_precision(device: torch.device) -> str:
    """``tl.dot``'s input precision: TF32 where torch's matmul switch allows it (a GRU scan of 256 steps at hidden 256,
    fwd+bwd, 3.2 ms on an H100 against 7.0-7.3 ms in float32), IEEE float32 otherwise (three TF32 products,
    ``tf32x3``, measured no faster: 7.0 ms)."""
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _block_k(H: int) -> int:
    """The reduction's block: the whole hidden size in one load up to ``BK_MAX``, so a program's loads go out at
    once."""
    return min(BK_MAX, max(16, triton.next_power_of_2(H)))


@triton.jit
def _sigmoid(x):
    # from e^{−|x|} ≤ 1, as _tanh: no overflow at any x
    e = tl.exp(-tl.abs(x))
    return tl.where(x < 0, e, 1.0) / (1.0 + e)


@triton.jit
def _tanh(x):
    # from e^{−2|x|} ≤ 1: no overflow at any x
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _tile(ptr, s_b, rb, mb, rc, mc):
    return tl.load(ptr + rb[:, None] * s_b + rc[None, :], mask=mb[:, None] & mc[None, :], other=0.0)


@triton.jit
def _bias(bias, gate, ru, mu, H: tl.constexpr):
    """Gate ``gate``'s recurrent bias at units ``ru``, as a row ``[1, BU]``."""
    return tl.load(bias + gate * H + ru, mask=mu, other=0.0)[None, :]


@triton.jit
def _keep(resets, s_r, rb, mb, HAS_RESETS: tl.constexpr):
    """Per sequence: True where the step does not start an episode."""
    keep = rb >= 0
    if HAS_RESETS:
        keep = tl.load(resets + rb * s_r, mask=mb, other=1) == 0
    return keep


@triton.jit
def _gate_preacts(h_in, s_h, keep, w, s_w, gate, rb, mb, ru, mu, H: tl.constexpr, BB: tl.constexpr,
                  BU: tl.constexpr, BK: tl.constexpr, HAS_RESETS: tl.constexpr, PREC: tl.constexpr):
    """``h W_gᵀ`` at units ``ru`` of gate ``gate``: ``[BB, BU]``, ``h`` zero where ``keep`` is False."""
    acc = tl.zeros([BB, BU], dtype=tl.float32)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < H
        hk = _tile(h_in, s_h, rb, mb, rk, mk)
        if HAS_RESETS:
            hk = tl.where(keep[:, None], hk, 0.0)
        wt = tl.load(w + (gate * H + ru)[None, :] * s_w + rk[:, None], mask=mk[:, None] & mu[None, :], other=0.0)
        acc += tl.dot(hk, wt, input_precision=PREC)
    return acc


@triton.jit
def _through_weights(dnext, s_dn, w, s_w, G: tl.constexpr, rb, mb, ru, mu, H: tl.constexpr, BB: tl.constexpr,
                     BU: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """``Σ_g ∂a_g W_g[:, ru]``: the gate gradients ``dnext [B, G·H]`` of a step carried back to its input state at
    units ``ru``."""
    acc = tl.zeros([BB, BU], dtype=tl.float32)
    for g in tl.static_range(G):
        for k0 in range(0, H, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < H
            d = _tile(dnext + g * H, s_dn, rb, mb, rk, mk)
            wt = tl.load(w + (g * H + rk)[:, None] * s_w + ru[None, :], mask=mk[:, None] & mu[None, :], other=0.0)
            acc += tl.dot(d, wt, input_precision=PREC)
    return acc


@triton.jit
def gru_fwd_kernel(gx, s_gx, w, s_w, bias, h_in, s_h, resets, s_r, y, s_y, saved, s_s, B,
                   H: tl.constexpr, BB: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr,
                   HAS_RESETS: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    ru = tl.program_id(0) * BU + tl.arange(0, BU)
    rb = (tl.program_id(1) * BB + tl.arange(0, BB)).to(tl.int64)  # row offsets of tensors past 2^31 elements
    mu, mb = ru < H, rb < B
    keep = _keep(resets, s_r, rb, mb, HAS_RESETS)
    a_r = _gate_preacts(h_in, s_h, keep, w, s_w, 0, rb, mb, ru, mu, H, BB, BU, BK, HAS_RESETS, PREC)
    a_z = _gate_preacts(h_in, s_h, keep, w, s_w, 1, rb, mb, ru, mu, H, BB, BU, BK, HAS_RESETS, PREC)
    a_n = _gate_preacts(h_in, s_h, keep, w, s_w, 2, rb, mb, ru, mu, H, BB, BU, BK, HAS_RESETS, PREC)
    if HAS_BIAS:
        a_r += _bias(bias, 0, ru, mu, H)
        a_z += _bias(bias, 1, ru, mu, H)
        a_n += _bias(bias, 2, ru, mu, H)
    r = _sigmoid(_tile(gx, s_gx, rb, mb, ru, mu) + a_r)
    z = _sigmoid(_tile(gx + H, s_gx, rb, mb, ru, mu) + a_z)
    n = _tanh(_tile(gx + 2 * H, s_gx, rb, mb, ru, mu) + r * a_n)
    h = _tile(h_in, s_h, rb, mb, ru, mu)
    if HAS_RESETS:
        h = tl.where(keep[:, None], h, 0.0)
    m = mb[:, None] & mu[None, :]
    tl.store(y + rb[:, None] * s_y + ru[None, :], n + z * (h - n), mask=m)
    s = saved + rb[:, None] * s_s + ru[None, :]
    tl.store(s, r, mask=m)
    tl.store(s + H, z, mask=m)
    tl.store(s + 2 * H, n, mask=m)
    tl.store(s + 3 * H, a_n, mask=m)


@triton.jit
def gru_bwd_kernel(dgh_next, s_dgn, saved_next, s_sn, resets_next, s_rn, dh_buf, s_dhb, dy, s_dy, saved, s_s,
                   h_in, s_h, resets, s_r, w, s_w, dgx, s_dgx, dgh, s_dgh, dh_out, s_dho, B,
                   H: tl.constexpr, BB: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, HAS_NEXT: tl.constexpr,
                   HAS_STEP: tl.constexpr, HAS_RESETS: tl.constexpr, PREC: tl.constexpr):
    ru = tl.program_id(0) * BU + tl.arange(0, BU)
    rb = (tl.program_id(1) * BB + tl.arange(0, BB)).to(tl.int64)  # row offsets of tensors past 2^31 elements
    mu, mb = ru < H, rb < B
    m = mb[:, None] & mu[None, :]
    # ∂L/∂h_t from step t+1 (dh_buf holds ∂L/∂h_{t+1} at these units), or the final state's gradient
    carry = _tile(dh_buf, s_dhb, rb, mb, ru, mu)
    if HAS_NEXT:
        z_next = _tile(saved_next + H, s_sn, rb, mb, ru, mu)
        carry = _through_weights(dgh_next, s_dgn, w, s_w, 3, rb, mb, ru, mu, H, BB, BU, BK, PREC) + carry * z_next
        if HAS_RESETS:
            carry = tl.where(_keep(resets_next, s_rn, rb, mb, HAS_RESETS)[:, None], carry, 0.0)
    if HAS_STEP:
        dh = carry + _tile(dy, s_dy, rb, mb, ru, mu)
        r = _tile(saved, s_s, rb, mb, ru, mu)
        z = _tile(saved + H, s_s, rb, mb, ru, mu)
        n = _tile(saved + 2 * H, s_s, rb, mb, ru, mu)
        ghn = _tile(saved + 3 * H, s_s, rb, mb, ru, mu)
        h = _tile(h_in, s_h, rb, mb, ru, mu)
        if HAS_RESETS:
            h = tl.where(_keep(resets, s_r, rb, mb, HAS_RESETS)[:, None], h, 0.0)
        da_n = dh * (1.0 - z) * (1.0 - n * n)
        da_r = da_n * ghn * r * (1.0 - r)
        da_z = dh * (h - n) * z * (1.0 - z)
        x = dgx + rb[:, None] * s_dgx + ru[None, :]
        tl.store(x, da_r, mask=m)
        tl.store(x + H, da_z, mask=m)
        tl.store(x + 2 * H, da_n, mask=m)
        hh = dgh + rb[:, None] * s_dgh + ru[None, :]
        tl.store(hh, da_r, mask=m)
        tl.store(hh + H, da_z, mask=m)
        tl.store(hh + 2 * H, da_n * r, mask=m)
        tl.store(dh_buf + rb[:, None] * s_dhb + ru[None, :], dh, mask=m)
    else:
        tl.store(dh_out + rb[:, None] * s_dho + ru[None, :], carry, mask=m)


@triton.jit
def lstm_fwd_kernel(gx, s_gx, w, s_w, bias, h_in, s_h, c_in, s_cin, resets, s_r, y, s_y, c_out, s_cout, saved,
                    s_s, B, H: tl.constexpr, BB: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr,
                    HAS_RESETS: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    ru = tl.program_id(0) * BU + tl.arange(0, BU)
    rb = (tl.program_id(1) * BB + tl.arange(0, BB)).to(tl.int64)  # row offsets of tensors past 2^31 elements
    mu, mb = ru < H, rb < B
    keep = _keep(resets, s_r, rb, mb, HAS_RESETS)
    a_i = _gate_preacts(h_in, s_h, keep, w, s_w, 0, rb, mb, ru, mu, H, BB, BU, BK, HAS_RESETS, PREC)
    a_f = _gate_preacts(h_in, s_h, keep, w, s_w, 1, rb, mb, ru, mu, H, BB, BU, BK, HAS_RESETS, PREC)
    a_g = _gate_preacts(h_in, s_h, keep, w, s_w, 2, rb, mb, ru, mu, H, BB, BU, BK, HAS_RESETS, PREC)
    a_o = _gate_preacts(h_in, s_h, keep, w, s_w, 3, rb, mb, ru, mu, H, BB, BU, BK, HAS_RESETS, PREC)
    if HAS_BIAS:
        a_i += _bias(bias, 0, ru, mu, H)
        a_f += _bias(bias, 1, ru, mu, H)
        a_g += _bias(bias, 2, ru, mu, H)
        a_o += _bias(bias, 3, ru, mu, H)
    i = _sigmoid(_tile(gx, s_gx, rb, mb, ru, mu) + a_i)
    f = _sigmoid(_tile(gx + H, s_gx, rb, mb, ru, mu) + a_f)
    g = _tanh(_tile(gx + 2 * H, s_gx, rb, mb, ru, mu) + a_g)
    o = _sigmoid(_tile(gx + 3 * H, s_gx, rb, mb, ru, mu) + a_o)
    c_prev = _tile(c_in, s_cin, rb, mb, ru, mu)
    if HAS_RESETS:
        c_prev = tl.where(keep[:, None], c_prev, 0.0)
    c = f * c_prev + i * g
    m = mb[:, None] & mu[None, :]
    tl.store(y + rb[:, None] * s_y + ru[None, :], o * _tanh(c), mask=m)
    tl.store(c_out + rb[:, None] * s_cout + ru[None, :], c, mask=m)
    s = saved + rb[:, None] * s_s + ru[None, :]
    tl.store(s, i, mask=m)
    tl.store(s + H, f, mask=m)
    tl.store(s + 2 * H, g, mask=m)
    tl.store(s + 3 * H, o, mask=m)


@triton.jit
def lstm_bwd_kernel(dpre_next, s_dpn, saved_next, s_sn, resets_next, s_rn, dh_buf, s_dhb, dc_buf, s_dcb, dy, s_dy,
                    saved, s_s, c_t, s_ct, c_prev, s_cp, resets, s_r, w, s_w, dpre, s_dp, dh_out, s_dho, dc_out,
                    s_dco, B, H: tl.constexpr, BB: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr,
                    HAS_NEXT: tl.constexpr, HAS_STEP: tl.constexpr, HAS_RESETS: tl.constexpr, PREC: tl.constexpr):
    ru = tl.program_id(0) * BU + tl.arange(0, BU)
    rb = (tl.program_id(1) * BB + tl.arange(0, BB)).to(tl.int64)  # row offsets of tensors past 2^31 elements
    mu, mb = ru < H, rb < B
    m = mb[:, None] & mu[None, :]
    # ∂L/∂h_t and ∂L/∂c_t from step t+1 (dh_buf, dc_buf hold ∂L/∂h_{t+1} and ∂L/∂c_{t+1} in total at these
    # units), or the final state's gradients
    carry_h = _tile(dh_buf, s_dhb, rb, mb, ru, mu)
    carry_c = _tile(dc_buf, s_dcb, rb, mb, ru, mu)
    if HAS_NEXT:
        f_next = _tile(saved_next + H, s_sn, rb, mb, ru, mu)
        carry_h = _through_weights(dpre_next, s_dpn, w, s_w, 4, rb, mb, ru, mu, H, BB, BU, BK, PREC)
        carry_c = carry_c * f_next
        if HAS_RESETS:
            keep_next = _keep(resets_next, s_rn, rb, mb, HAS_RESETS)
            carry_h = tl.where(keep_next[:, None], carry_h, 0.0)
            carry_c = tl.where(keep_next[:, None], carry_c, 0.0)
    if HAS_STEP:
        dh = carry_h + _tile(dy, s_dy, rb, mb, ru, mu)
        i = _tile(saved, s_s, rb, mb, ru, mu)
        f = _tile(saved + H, s_s, rb, mb, ru, mu)
        g = _tile(saved + 2 * H, s_s, rb, mb, ru, mu)
        o = _tile(saved + 3 * H, s_s, rb, mb, ru, mu)
        tc = _tanh(_tile(c_t, s_ct, rb, mb, ru, mu))
        cp = _tile(c_prev, s_cp, rb, mb, ru, mu)
        if HAS_RESETS:
            cp = tl.where(_keep(resets, s_r, rb, mb, HAS_RESETS)[:, None], cp, 0.0)
        dc = carry_c + dh * o * (1.0 - tc * tc)
        p = dpre + rb[:, None] * s_dp + ru[None, :]
        tl.store(p, dc * g * i * (1.0 - i), mask=m)
        tl.store(p + H, dc * cp * f * (1.0 - f), mask=m)
        tl.store(p + 2 * H, dc * i * (1.0 - g * g), mask=m)
        tl.store(p + 3 * H, dh * tc * o * (1.0 - o), mask=m)
        tl.store(dh_buf + rb[:, None] * s_dhb + ru[None, :], dh, mask=m)
        tl.store(dc_buf + rb[:, None] * s_dcb + ru[None, :], dc, mask=m)
    else:
        tl.store(dh_out + rb[:, None] * s_dho + ru[None, :], carry_h, mask=m)
        tl.store(dc_out + rb[:, None] * s_dco + ru[None, :], carry_c, mask=m)


class _Scan(torch.autograd.Function):
    """``(y, h_T[, c_T]) = scan(cell, gates_x, w_hh, b_hh, resets, h_0, c_0)`` (``c_0`` None for the GRU); see
    :func:`scan_triton`. Once differentiable: its backward is made of kernels autograd cannot see."""

    @staticmethod
    def forward(ctx, cell, gates_x, w_hh, b_hh, resets, h0, c0):
        B, T, _ = gates_x.shape
        H = w_hh.shape[1]
        lstm = cell == "lstm"
        y = gates_x.new_empty(B, T, H)
        cs = gates_x.new_empty(B, T, H) if lstm else y
        saved = gates_x.new_empty(B, T, 4 * H)
        r8 = resets.view(torch.uint8) if resets is not None else gates_x.new_empty(B, T, dtype=torch.uint8)
        prec = matmul_precision(gates_x.device)
        flags = dict(H=H, BB=BB, BU=BU, BK=_block_k(H), HAS_RESETS=resets is not None, HAS_BIAS=b_hh is not None,
                     PREC=prec, num_warps=NUM_WARPS)
        grid = (triton.cdiv(H, BU), triton.cdiv(B, BB))
        bias = b_hh if b_hh is not None else w_hh
        for t in range(T):
            h_in = h0 if t == 0 else y[:, t - 1]
            if lstm:
                c_in = c0 if t == 0 else cs[:, t - 1]
                lstm_fwd_kernel[grid](
                    gates_x[:, t], gates_x.stride(0), w_hh, w_hh.stride(0), bias, h_in, h_in.stride(0), c_in,
                    c_in.stride(0), r8[:, t], r8.stride(0), y[:, t], y.stride(0), cs[:, t], cs.stride(0),
                    saved[:, t], saved.stride(0), B, **flags)
            else:
                gru_fwd_kernel[grid](
                    gates_x[:, t], gates_x.stride(0), w_hh, w_hh.stride(0), bias, h_in, h_in.stride(0), r8[:, t],
                    r8.stride(0), y[:, t], y.stride(0), saved[:, t], saved.stride(0), B, **flags)
        ctx.cell, ctx.has_bias, ctx.has_resets, ctx.prec = cell, b_hh is not None, resets is not None, prec
        ctx.save_for_backward(w_hh, r8, h0, c0 if lstm else h0, y, cs, saved)
        h_T = y[:, T - 1].clone()
        return (y, h_T, cs[:, T - 1].clone()) if lstm else (y, h_T)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dh_T, dc_T=None):
        w_hh, r8, h0, c0, y, cs, saved = ctx.saved_tensors
        lstm = ctx.cell == "lstm"
        B, T, H = y.shape
        G = 4 if lstm else 3
        dy = torch.zeros_like(y) if dy is None else dy.contiguous()
        dh_buf = torch.zeros_like(h0) if dh_T is None else dh_T.contiguous().clone()
        dh0 = torch.empty_like(h0)
        dgx = y.new_empty(B, T, G * H)
        dgh = dgx if lstm else y.new_empty(B, T, G * H)  # the LSTM's two are one: a = W_ih x + W_hh h + biases
        if lstm:
            dc_buf = torch.zeros_like(h0) if dc_T is None else dc_T.contiguous().clone()
            dc0 = torch.empty_like(h0)
        flags = dict(H=H, BB=BB, BU=BU, BK=_block_k(H), HAS_RESETS=ctx.has_resets, PREC=ctx.prec,
                     num_warps=NUM_WARPS)
        grid = (triton.cdiv(H, BU), triton.cdiv(B, BB))
        for t in range(T - 1, -2, -1):
            nxt, cur = min(t + 1, T - 1), max(t, 0)  # stand-ins where a launch has no next step or no step
            h_in = h0 if t <= 0 else y[:, t - 1]
            step = dict(HAS_NEXT=t < T - 1, HAS_STEP=t >= 0, **flags)
            if lstm:
                c_prev = c0 if t <= 0 else cs[:, t - 1]
                lstm_bwd_kernel[grid](
                    dgx[:, nxt], dgx.stride(0), saved[:, nxt], saved.stride(0), r8[:, nxt], r8.stride(0), dh_buf,
                    dh_buf.stride(0), dc_buf, dc_buf.stride(0), dy[:, cur], dy.stride(0), saved[:, cur],
                    saved.stride(0), cs[:, cur], cs.stride(0), c_prev, c_prev.stride(0), r8[:, cur], r8.stride(0),
                    w_hh, w_hh.stride(0), dgx[:, cur], dgx.stride(0), dh0, dh0.stride(0), dc0, dc0.stride(0), B,
                    **step)
            else:
                gru_bwd_kernel[grid](
                    dgh[:, nxt], dgh.stride(0), saved[:, nxt], saved.stride(0), r8[:, nxt], r8.stride(0), dh_buf,
                    dh_buf.stride(0), dy[:, cur], dy.stride(0), saved[:, cur], saved.stride(0), h_in,
                    h_in.stride(0), r8[:, cur], r8.stride(0), w_hh, w_hh.stride(0), dgx[:, cur], dgx.stride(0),
                    dgh[:, cur], dgh.stride(0), dh0, dh0.stride(0), B, **step)
        # the states each step read: h_{t−1}, zero where step t reset it
        h_prev = torch.cat([h0.unsqueeze(1), y[:, :-1]], 1)
        if ctx.has_resets:
            h_prev = h_prev.masked_fill(r8.bool().unsqueeze(-1), 0.0)
        flat = dgh.reshape(B * T, G * H)
        dw = flat.t() @ h_prev.reshape(B * T, H)
        db = flat.sum(0) if ctx.has_bias else None
        return None, dgx, dw, db, None, dh0, (dc0 if lstm else None)


def scan_triton(cell: str, gates_x: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor | None,
                parts: tuple[torch.Tensor, ...], resets: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`rlseq.kernels.rnn.rnn_scan` after validation (float32 tensors, ``T ≥ 1``): ``(y [B, T, H], final
    parts)``. No host sync and no allocation outside torch's allocator: a CUDA graph can capture it, forward and
    backward."""
    c = lambda x: x if x.is_contiguous() else x.contiguous()  # noqa: E731
    gates_x, w_hh = c(gates_x), c(w_hh)
    b_hh = c(b_hh) if b_hh is not None else None
    resets = c(resets) if resets is not None else None
    h0 = c(parts[0].float())
    c0 = c(parts[1].float()) if cell == "lstm" else None
    out = _Scan.apply(cell, gates_x, w_hh, b_hh, resets, h0, c0)
    return out[0], tuple(out[1:])
