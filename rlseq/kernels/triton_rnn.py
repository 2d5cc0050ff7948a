"""The GRU and LSTM scans in Triton: one launch per step forward and one per step backward, each doing the step's
recurrent matmul and its cell together (the torch loop takes a matmul and 5-7 element-wise kernels per step
forward, and autograd about twice that backward: in a replayed CUDA graph the launch count is what a scan costs).

Forward, step t: every program owns ``BJ`` hidden units of ``BB`` sequences, accumulates their gate
pre-activations ``h_{t−1} W_hhᵀ`` over the hidden size in blocks of ``BK``, adds the input's pre-activations and
applies the cell (the state read as zero where an episode starts); it stores ``h_t`` (and the LSTM's ``c_t``) and
the gate values backward needs. Backward, step t (from the last): every program owns ``BK`` units of
``∂L/∂h_{t−1}``; it forms the gate gradients of all ``H`` units block by block, multiplies them by ``W_hh`` and adds
the cell's direct path, zero where step t reset the state. The weight gradients are one matmul after the loop,
over all steps at once. float32 throughout, matmuls in IEEE float32 (no TF32), so the result is the torch loop's
to rounding (tests/test_memory.py and tests/test_rnn_scan.py hold both to the float64 loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BB = 16  # sequences per program (tl.dot's smallest tile)
BJ = 32  # hidden units per program
BK = 32  # the reduction's block


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # from e^{−2|x|} ≤ 1: no overflow at any x
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _rows_dot(a, w, s_w, row0, rr, mr, rc, mc):
    """``a [BB, len(rr)] @ W[row0 + rr, rc]``: ``a`` against a block of ``W``'s rows (``W`` row-major, row stride
    ``s_w``)."""
    wb = tl.load(w + (row0 + rr)[:, None] * s_w + rc[None, :], mask=mr[:, None] & mc[None, :], other=0.0)
    return tl.dot(a, wb, input_precision="ieee")


@triton.jit
def _cols_dot(a, w, s_w, row0, rj, mj, rk, mk):
    """``a [BB, len(rk)] @ W[row0 + rj, rk]ᵀ``: the forward's ``h W_gᵀ`` for gate rows ``row0 + rj``."""
    wb = tl.load(w + (row0 + rj)[None, :] * s_w + rk[:, None], mask=mk[:, None] & mj[None, :], other=0.0)
    return tl.dot(a, wb, input_precision="ieee")


@triton.jit
def _load_state(ptr, s_b, rb, mb, rc, mc, keep, HAS_RESETS: tl.constexpr):
    x = tl.load(ptr + rb[:, None] * s_b + rc[None, :], mask=mb[:, None] & mc[None, :], other=0.0)
    if HAS_RESETS:
        x = tl.where(keep[:, None], x, 0.0)
    return x


@triton.jit
def gru_fwd_kernel(gx, s_gx, w, s_w, bias, h_in, s_h, resets, s_r, y, s_y, saved, s_s, B,
                   H: tl.constexpr, BB: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr,
                   HAS_RESETS: tl.constexpr, HAS_BIAS: tl.constexpr):
    rj = tl.program_id(0) * BJ + tl.arange(0, BJ)
    rb = tl.program_id(1) * BB + tl.arange(0, BB)
    mj, mb = rj < H, rb < B
    keep = rb >= 0
    if HAS_RESETS:
        keep = tl.load(resets + rb * s_r, mask=mb, other=1) == 0
    acc_r = tl.zeros([BB, BJ], dtype=tl.float32)
    acc_z = tl.zeros([BB, BJ], dtype=tl.float32)
    acc_n = tl.zeros([BB, BJ], dtype=tl.float32)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < H
        hk = _load_state(h_in, s_h, rb, mb, rk, mk, keep, HAS_RESETS)
        acc_r += _cols_dot(hk, w, s_w, 0, rj, mj, rk, mk)
        acc_z += _cols_dot(hk, w, s_w, H, rj, mj, rk, mk)
        acc_n += _cols_dot(hk, w, s_w, 2 * H, rj, mj, rk, mk)
    if HAS_BIAS:
        acc_r += tl.load(bias + rj, mask=mj, other=0.0)[None, :]
        acc_z += tl.load(bias + H + rj, mask=mj, other=0.0)[None, :]
        acc_n += tl.load(bias + 2 * H + rj, mask=mj, other=0.0)[None, :]
    m = mb[:, None] & mj[None, :]
    g = gx + rb[:, None] * s_gx + rj[None, :]
    r = _sigmoid(tl.load(g, mask=m, other=0.0) + acc_r)
    z = _sigmoid(tl.load(g + H, mask=m, other=0.0) + acc_z)
    n = _tanh(tl.load(g + 2 * H, mask=m, other=0.0) + r * acc_n)
    h = _load_state(h_in, s_h, rb, mb, rj, mj, keep, HAS_RESETS)
    tl.store(y + rb[:, None] * s_y + rj[None, :], n + z * (h - n), mask=m)
    s = saved + rb[:, None] * s_s + rj[None, :]
    tl.store(s, r, mask=m)
    tl.store(s + H, z, mask=m)
    tl.store(s + 2 * H, n, mask=m)
    tl.store(s + 3 * H, acc_n, mask=m)


@triton.jit
def _gru_grads(dy, s_dy, carry, s_c, saved, s_s, h_in, s_h, rb, mb, rj, mj, keep, H: tl.constexpr,
               HAS_RESETS: tl.constexpr):
    """Step t's gradients at units ``rj``: ``(∂h_t, z, ∂a_r, ∂a_z, ∂a_n, ∂(W_hn h + b_hn))`` with ``a`` the gate
    pre-activations."""
    m = mb[:, None] & mj[None, :]
    dh = (tl.load(dy + rb[:, None] * s_dy + rj[None, :], mask=m, other=0.0)
          + tl.load(carry + rb[:, None] * s_c + rj[None, :], mask=m, other=0.0))
    s = saved + rb[:, None] * s_s + rj[None, :]
    r = tl.load(s, mask=m, other=0.0)
    z = tl.load(s + H, mask=m, other=0.0)
    n = tl.load(s + 2 * H, mask=m, other=0.0)
    ghn = tl.load(s + 3 * H, mask=m, other=0.0)
    h = _load_state(h_in, s_h, rb, mb, rj, mj, keep, HAS_RESETS)
    da_n = dh * (1.0 - z) * (1.0 - n * n)
    da_r = da_n * ghn * r * (1.0 - r)
    da_z = dh * (h - n) * z * (1.0 - z)
    return dh, z, da_r, da_z, da_n, da_n * r


@triton.jit
def gru_bwd_kernel(dy, s_dy, carry_in, s_ci, saved, s_s, h_in, s_h, resets, s_r, w, s_w, carry_out, s_co,
                   dgx, s_dgx, dgh, s_dgh, B, H: tl.constexpr, BB: tl.constexpr, BJ: tl.constexpr,
                   BK: tl.constexpr, HAS_RESETS: tl.constexpr):
    rk = tl.program_id(0) * BK + tl.arange(0, BK)
    rb = tl.program_id(1) * BB + tl.arange(0, BB)
    mk, mb = rk < H, rb < B
    keep = rb >= 0
    if HAS_RESETS:
        keep = tl.load(resets + rb * s_r, mask=mb, other=1) == 0
    acc = tl.zeros([BB, BK], dtype=tl.float32)
    for j0 in range(0, H, BJ):
        rj = j0 + tl.arange(0, BJ)
        mj = rj < H
        _, _, da_r, da_z, _, dgh_n = _gru_grads(dy, s_dy, carry_in, s_ci, saved, s_s, h_in, s_h, rb, mb, rj, mj,
                                                keep, H, HAS_RESETS)
        acc += _rows_dot(da_r, w, s_w, 0, rj, mj, rk, mk)
        acc += _rows_dot(da_z, w, s_w, H, rj, mj, rk, mk)
        acc += _rows_dot(dgh_n, w, s_w, 2 * H, rj, mj, rk, mk)
    dh, z, da_r, da_z, da_n, dgh_n = _gru_grads(dy, s_dy, carry_in, s_ci, saved, s_s, h_in, s_h, rb, mb, rk, mk,
                                                keep, H, HAS_RESETS)
    acc += dh * z
    if HAS_RESETS:
        acc = tl.where(keep[:, None], acc, 0.0)
    m = mb[:, None] & mk[None, :]
    tl.store(carry_out + rb[:, None] * s_co + rk[None, :], acc, mask=m)
    x = dgx + rb[:, None] * s_dgx + rk[None, :]
    tl.store(x, da_r, mask=m)
    tl.store(x + H, da_z, mask=m)
    tl.store(x + 2 * H, da_n, mask=m)
    hh = dgh + rb[:, None] * s_dgh + rk[None, :]
    tl.store(hh, da_r, mask=m)
    tl.store(hh + H, da_z, mask=m)
    tl.store(hh + 2 * H, dgh_n, mask=m)


@triton.jit
def lstm_fwd_kernel(gx, s_gx, w, s_w, bias, h_in, s_h, c_in, s_cin, resets, s_r, y, s_y, c_out, s_cout, saved,
                    s_s, B, H: tl.constexpr, BB: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr,
                    HAS_RESETS: tl.constexpr, HAS_BIAS: tl.constexpr):
    rj = tl.program_id(0) * BJ + tl.arange(0, BJ)
    rb = tl.program_id(1) * BB + tl.arange(0, BB)
    mj, mb = rj < H, rb < B
    keep = rb >= 0
    if HAS_RESETS:
        keep = tl.load(resets + rb * s_r, mask=mb, other=1) == 0
    acc_i = tl.zeros([BB, BJ], dtype=tl.float32)
    acc_f = tl.zeros([BB, BJ], dtype=tl.float32)
    acc_g = tl.zeros([BB, BJ], dtype=tl.float32)
    acc_o = tl.zeros([BB, BJ], dtype=tl.float32)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < H
        hk = _load_state(h_in, s_h, rb, mb, rk, mk, keep, HAS_RESETS)
        acc_i += _cols_dot(hk, w, s_w, 0, rj, mj, rk, mk)
        acc_f += _cols_dot(hk, w, s_w, H, rj, mj, rk, mk)
        acc_g += _cols_dot(hk, w, s_w, 2 * H, rj, mj, rk, mk)
        acc_o += _cols_dot(hk, w, s_w, 3 * H, rj, mj, rk, mk)
    if HAS_BIAS:
        acc_i += tl.load(bias + rj, mask=mj, other=0.0)[None, :]
        acc_f += tl.load(bias + H + rj, mask=mj, other=0.0)[None, :]
        acc_g += tl.load(bias + 2 * H + rj, mask=mj, other=0.0)[None, :]
        acc_o += tl.load(bias + 3 * H + rj, mask=mj, other=0.0)[None, :]
    m = mb[:, None] & mj[None, :]
    g_ptr = gx + rb[:, None] * s_gx + rj[None, :]
    i = _sigmoid(tl.load(g_ptr, mask=m, other=0.0) + acc_i)
    f = _sigmoid(tl.load(g_ptr + H, mask=m, other=0.0) + acc_f)
    g = _tanh(tl.load(g_ptr + 2 * H, mask=m, other=0.0) + acc_g)
    o = _sigmoid(tl.load(g_ptr + 3 * H, mask=m, other=0.0) + acc_o)
    c = f * _load_state(c_in, s_cin, rb, mb, rj, mj, keep, HAS_RESETS) + i * g
    tl.store(y + rb[:, None] * s_y + rj[None, :], o * _tanh(c), mask=m)
    tl.store(c_out + rb[:, None] * s_cout + rj[None, :], c, mask=m)
    s = saved + rb[:, None] * s_s + rj[None, :]
    tl.store(s, i, mask=m)
    tl.store(s + H, f, mask=m)
    tl.store(s + 2 * H, g, mask=m)
    tl.store(s + 3 * H, o, mask=m)


@triton.jit
def _lstm_grads(dy, s_dy, dh_in, s_dhi, dc_in, s_dci, saved, s_s, c_t, s_ct, c_prev, s_cp, rb, mb, rj, mj, keep,
                H: tl.constexpr, HAS_RESETS: tl.constexpr):
    """Step t's gradients at units ``rj``: ``(∂c_t in total, f, ∂a_i, ∂a_f, ∂a_g, ∂a_o)``."""
    m = mb[:, None] & mj[None, :]
    dh = (tl.load(dy + rb[:, None] * s_dy + rj[None, :], mask=m, other=0.0)
          + tl.load(dh_in + rb[:, None] * s_dhi + rj[None, :], mask=m, other=0.0))
    s = saved + rb[:, None] * s_s + rj[None, :]
    i = tl.load(s, mask=m, other=0.0)
    f = tl.load(s + H, mask=m, other=0.0)
    g = tl.load(s + 2 * H, mask=m, other=0.0)
    o = tl.load(s + 3 * H, mask=m, other=0.0)
    tc = _tanh(tl.load(c_t + rb[:, None] * s_ct + rj[None, :], mask=m, other=0.0))
    cp = _load_state(c_prev, s_cp, rb, mb, rj, mj, keep, HAS_RESETS)
    dc = tl.load(dc_in + rb[:, None] * s_dci + rj[None, :], mask=m, other=0.0) + dh * o * (1.0 - tc * tc)
    return dc, f, dc * g * i * (1.0 - i), dc * cp * f * (1.0 - f), dc * i * (1.0 - g * g), dh * tc * o * (1.0 - o)


@triton.jit
def lstm_bwd_kernel(dy, s_dy, dh_in, s_dhi, dc_in, s_dci, saved, s_s, c_t, s_ct, c_prev, s_cp, resets, s_r, w, s_w,
                    dh_out, s_dho, dc_out, s_dco, dpre, s_dp, B, H: tl.constexpr, BB: tl.constexpr,
                    BJ: tl.constexpr, BK: tl.constexpr, HAS_RESETS: tl.constexpr):
    rk = tl.program_id(0) * BK + tl.arange(0, BK)
    rb = tl.program_id(1) * BB + tl.arange(0, BB)
    mk, mb = rk < H, rb < B
    keep = rb >= 0
    if HAS_RESETS:
        keep = tl.load(resets + rb * s_r, mask=mb, other=1) == 0
    acc = tl.zeros([BB, BK], dtype=tl.float32)
    for j0 in range(0, H, BJ):
        rj = j0 + tl.arange(0, BJ)
        mj = rj < H
        _, _, d_i, d_f, d_g, d_o = _lstm_grads(dy, s_dy, dh_in, s_dhi, dc_in, s_dci, saved, s_s, c_t, s_ct, c_prev,
                                               s_cp, rb, mb, rj, mj, keep, H, HAS_RESETS)
        acc += _rows_dot(d_i, w, s_w, 0, rj, mj, rk, mk)
        acc += _rows_dot(d_f, w, s_w, H, rj, mj, rk, mk)
        acc += _rows_dot(d_g, w, s_w, 2 * H, rj, mj, rk, mk)
        acc += _rows_dot(d_o, w, s_w, 3 * H, rj, mj, rk, mk)
    dc, f, d_i, d_f, d_g, d_o = _lstm_grads(dy, s_dy, dh_in, s_dhi, dc_in, s_dci, saved, s_s, c_t, s_ct, c_prev,
                                            s_cp, rb, mb, rk, mk, keep, H, HAS_RESETS)
    dc = dc * f
    if HAS_RESETS:
        acc = tl.where(keep[:, None], acc, 0.0)
        dc = tl.where(keep[:, None], dc, 0.0)
    m = mb[:, None] & mk[None, :]
    tl.store(dh_out + rb[:, None] * s_dho + rk[None, :], acc, mask=m)
    tl.store(dc_out + rb[:, None] * s_dco + rk[None, :], dc, mask=m)
    p = dpre + rb[:, None] * s_dp + rk[None, :]
    tl.store(p, d_i, mask=m)
    tl.store(p + H, d_f, mask=m)
    tl.store(p + 2 * H, d_g, mask=m)
    tl.store(p + 3 * H, d_o, mask=m)


def _grid(B: int, H: int, block: int) -> tuple[int, int]:
    return triton.cdiv(H, block), triton.cdiv(B, BB)


class _Scan(torch.autograd.Function):
    """``(y, h_T[, c_T]) = scan(gates_x, w_hh, b_hh, h_0[, c_0])``; see :func:`scan_triton`."""

    @staticmethod
    def forward(ctx, cell, gates_x, w_hh, b_hh, resets, h0, c0):
        B, T, _ = gates_x.shape
        H = w_hh.shape[1]
        lstm = cell == "lstm"
        y = gates_x.new_empty(B, T, H)
        cs = gates_x.new_empty(B, T, H) if lstm else None
        saved = gates_x.new_empty(B, T, 4 * H)
        r8 = resets.view(torch.uint8) if resets is not None else None
        flags = dict(H=H, BB=BB, BJ=BJ, BK=BK, HAS_RESETS=resets is not None, HAS_BIAS=b_hh is not None)
        bias = b_hh if b_hh is not None else w_hh
        for t in range(T):
            h_in = h0 if t == 0 else y[:, t - 1]
            rt = r8[:, t] if r8 is not None else gates_x
            s_r = r8.stride(0) if r8 is not None else 0
            if lstm:
                c_in = c0 if t == 0 else cs[:, t - 1]
                lstm_fwd_kernel[_grid(B, H, BJ)](
                    gates_x[:, t], gates_x.stride(0), w_hh, w_hh.stride(0), bias, h_in, h_in.stride(0), c_in,
                    c_in.stride(0), rt, s_r, y[:, t], y.stride(0), cs[:, t], cs.stride(0), saved[:, t],
                    saved.stride(0), B, **flags)
            else:
                gru_fwd_kernel[_grid(B, H, BJ)](
                    gates_x[:, t], gates_x.stride(0), w_hh, w_hh.stride(0), bias, h_in, h_in.stride(0), rt, s_r,
                    y[:, t], y.stride(0), saved[:, t], saved.stride(0), B, **flags)
        ctx.cell, ctx.has_bias, ctx.has_resets = cell, b_hh is not None, resets is not None
        ctx.save_for_backward(w_hh, resets if resets is not None else w_hh, h0, c0 if lstm else h0, y,
                              cs if lstm else y, saved)
        h_T = y[:, T - 1].clone() if T else h0.clone()
        if lstm:
            return y, h_T, (cs[:, T - 1].clone() if T else c0.clone())
        return y, h_T

    @staticmethod
    def backward(ctx, dy, dh_T, dc_T=None):
        w_hh, resets, h0, c0, y, cs, saved = ctx.saved_tensors
        resets = resets if ctx.has_resets else None
        lstm = ctx.cell == "lstm"
        B, T, H = y.shape
        G = 4 if lstm else 3
        dy = torch.zeros_like(y) if dy is None else dy.contiguous()
        dh = torch.zeros_like(h0) if dh_T is None else dh_T.contiguous().clone()
        dh_next = torch.empty_like(dh)
        if lstm:
            dc = torch.zeros_like(h0) if dc_T is None else dc_T.contiguous().clone()
            dc_next = torch.empty_like(dc)
        dgx = y.new_empty(B, T, G * H)
        dgh = dgx if lstm else y.new_empty(B, T, G * H)  # the LSTM's two are one: a = W_ih x + W_hh h + biases
        r8 = resets.view(torch.uint8) if resets is not None else None
        flags = dict(H=H, BB=BB, BJ=BJ, BK=BK, HAS_RESETS=resets is not None)
        for t in range(T - 1, -1, -1):
            h_in = h0 if t == 0 else y[:, t - 1]
            rt = r8[:, t] if r8 is not None else y
            s_r = r8.stride(0) if r8 is not None else 0
            if lstm:
                c_prev = c0 if t == 0 else cs[:, t - 1]
                lstm_bwd_kernel[_grid(B, H, BK)](
                    dy[:, t], dy.stride(0), dh, dh.stride(0), dc, dc.stride(0), saved[:, t], saved.stride(0),
                    cs[:, t], cs.stride(0), c_prev, c_prev.stride(0), rt, s_r, w_hh, w_hh.stride(0), dh_next,
                    dh_next.stride(0), dc_next, dc_next.stride(0), dgx[:, t], dgx.stride(0), B, **flags)
                dc, dc_next = dc_next, dc
            else:
                gru_bwd_kernel[_grid(B, H, BK)](
                    dy[:, t], dy.stride(0), dh, dh.stride(0), saved[:, t], saved.stride(0), h_in, h_in.stride(0),
                    rt, s_r, w_hh, w_hh.stride(0), dh_next, dh_next.stride(0), dgx[:, t], dgx.stride(0),
                    dgh[:, t], dgh.stride(0), B, **flags)
            dh, dh_next = dh_next, dh
        # the states each step read: h_{t−1}, zero where step t reset it
        h_prev = torch.cat([h0.unsqueeze(1), y[:, :-1]], 1)
        if resets is not None:
            h_prev = h_prev.masked_fill(resets.unsqueeze(-1), 0.0)
        flat = dgh.reshape(B * T, G * H)
        dw = flat.t() @ h_prev.reshape(B * T, H)
        db = flat.sum(0) if ctx.has_bias else None
        return None, dgx, dw, db, None, dh, (dc if lstm else None)


def scan_triton(cell: str, gates_x: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor | None,
                parts: tuple[torch.Tensor, ...], resets: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`rlseq.kernels.rnn.rnn_scan` after validation (float32 tensors): ``(y [B, T, H], final parts)``. No
    host sync and no allocation outside torch's allocator: a CUDA graph can capture it, forward and backward."""
    c = lambda x: x if x.is_contiguous() else x.contiguous()  # noqa: E731
    gates_x, w_hh = c(gates_x), c(w_hh)
    b_hh = c(b_hh) if b_hh is not None else None
    resets = c(resets) if resets is not None else None
    h0 = c(parts[0].float())
    c0 = c(parts[1].float()) if cell == "lstm" else None
    out = _Scan.apply(cell, gates_x, w_hh, b_hh, resets, h0, c0)
    return out[0], tuple(out[1:])
