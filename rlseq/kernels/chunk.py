"""The delta rules in chunked (WY) form, in plain PyTorch: the CPU path.

A sequence is cut into chunks of ``C`` steps. Inside a chunk everything is a matrix product or one
triangular inverse, for all chunks at once; only the state is carried from chunk to chunk in a loop of
``ceil(T / C)`` steps. Episode starts inside a chunk are handled by segment masks (efla.md §3), so one
call covers any number of episodes per sequence.

Per chunk, with the unit-key gate ``(k̂, g, w)`` of :func:`rlseq.kernels.rules.unit_key_form`,
``A = StrictLower(diag(g) K̂K̂ᵀ) ⊙ same`` and ``P = (I + A)⁻¹``:

    D  = U − M S₀,  U = P W,  M = P diag(g ⊙ sees) K̂      (U, M for all chunks at once; D in the loop over
    S₁ = carry · S₀ + K̂ᵀ diag(last) D                      chunks, batched over B·H: three small ops per chunk)
    O  = diag(sees) Q S₀ + (Lower(Q K̂ᵀ) ⊙ same) D          (all chunks at once, after the loop)

:class:`_ChunkFunction` differentiates this by hand, gate included (the Triton backward's equations,
docs/triton_notes.md): the backward walks the chunks in reverse carrying ``dS``
(``dR = Pᵀ(QKᵀ dO) + Pᵀ diag(last) K̂ dS₁``, ``dS₀ = carry dS₁ + Qᵀ diag(sees) dO − (g sees K̂)ᵀ dR``,
two small products per chunk), and batches everything else over all chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlseq.kernels.rules import check_rule, unit_key_form, unit_key_scales, unit_key_gate_backward


def segment_masks(resets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks of efla.md §3 from ``resets [..., C]`` (bool, chunked).

    Returns ``same [..., C, C]`` (rows in one episode), ``sees [..., C]`` (row sees the entering state),
    ``last [..., C]`` (row in the chunk's last episode) and ``carry [...]`` (state passes the whole chunk).
    """
    seg = resets.to(torch.int32).cumsum(-1)
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)
    return same, seg == 0, seg == seg[..., -1:], seg[..., -1] == 0


SOLVE_BLOCK = 16


_CONSTS: dict = {}


def _buffers(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> dict:
    """Uninitialised buffers of ``shapes``, allocated in one place so the forward's memory use is visible."""
    return {n: torch.empty(sh, dtype=dtype, device=device) for n, sh in shapes.items()}


def _triangles(C: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The strictly lower and the lower triangle of ones, ``[C, C]`` (cached)."""
    key = (C, dtype, device)
    if key not in _CONSTS:
        ones = torch.ones(C, C, dtype=dtype, device=device)
        _CONSTS[key] = (ones.tril(-1), ones.tril())
    return _CONSTS[key]


def _chunk_masks(resets: torch.Tensor | None, B: int, N: int, C: int, dtype: torch.dtype, device: torch.device):
    """The masks of :func:`segment_masks` as ``dtype`` factors in the chunk layout, for ``resets [B, ≤ N·C]`` (or None).

    Returns ``m_lower [N, B, 1, C, C]`` (``same`` ⊙ lower), ``sees, last [N, B, 1, C, 1]`` and ``carry [N, B, 1, 1]``;
    without resets the lower triangle ``[C, C]`` and None for the rest.
    """
    lower = _triangles(C, dtype, device)[1]
    if resets is None:
        return lower, None, None, None
    r = F.pad(resets, (0, N * C - resets.shape[1])) if resets.shape[1] != N * C else resets
    # [N, B, C]: episode index inside the chunk, in dtype (exact: at most C) so the comparisons need no casts
    seg = r.view(B, N, C).cumsum(-1, dtype=dtype).transpose(0, 1)
    m_lower = torch.empty(N, B, 1, C, C, dtype=dtype, device=device)
    flags = torch.empty(2, N, B, 1, C, 1, dtype=dtype, device=device)
    torch.eq(seg.view(N, B, 1, C, 1), seg.view(N, B, 1, 1, C), out=m_lower).mul_(lower)
    sees, last = flags.unbind(0)
    torch.eq(seg, 0, out=sees.view(N, B, C))
    torch.eq(seg, seg[..., -1:], out=last.view(N, B, C))
    carry = sees[..., -1:, 0]  # [N, B, 1, 1]: no reset in the chunk, so its last row still sees S₀
    return m_lower, sees, last, carry


def _unit_lower_inverse_rows(a: torch.Tensor) -> torch.Tensor:
    """``(I + A)⁻¹`` for strictly lower ``a [..., n, n]`` by forward substitution, one row at a time."""
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    rows = [eye[0].expand(*a.shape[:-2], n)]
    for i in range(1, n):
        rows.append(eye[i] - (a[..., i : i + 1, :i] @ torch.stack(rows, -2)).squeeze(-2))
    return torch.stack(rows, -2)


_MASKS: dict = {}


def _block_masks(n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """For ``n ≤ 16`` (cached): the identity, the mask of the strictly lower entries inside the 4×4 diagonal blocks,
    and for b = 4, 8 (while b < n) the mask of the b×b blocks just below the diagonal inside each 2b×2b diagonal
    block."""
    key = (n, dtype, device)
    if key not in _MASKS:
        i = torch.arange(n, device=device)
        r, c = i[:, None], i[None, :]
        inner = ((r // 4 == c // 4) & (r > c)).to(dtype)
        offs = [((r // (2 * b) == c // (2 * b)) & (r // b != c // b)).to(dtype) for b in (4, 8) if b < n]
        _MASKS[key] = (torch.eye(n, dtype=dtype, device=device), inner, offs)
    return _MASKS[key]


def _unit_lower_inverse_block(a: torch.Tensor) -> torch.Tensor:
    """``(I + A)⁻¹`` for diagonal blocks ``a [..., n, n]`` with ``n ≤ 16`` and every ``|A_ij| ≤ 2``, in the dtype of ``a``.
    Reads only the strictly lower part of ``a``.

    4×4 diagonal blocks by forward substitution written out along the three subdiagonals (elementwise over
    all blocks at once), which is exact substitution, so it cannot cancel badly: start from ``I − A`` on those
    blocks, whose subdiagonals ``o_d = −a_d`` vanish across block borders, so no product below crosses one; then
    ``p₂ = o₂ + o₁o₁`` and ``p₃ = o₃ + o₂o₁ + o₁p₂`` (shifted along the diagonals). Then recursive doubling,
    which is the blocked triangular inverse: with ``P_b`` the inverse of the b×b diagonal blocks and ``A_b`` the part
    of A in the b×b blocks just below them (inside each 2b block), ``P_2b = P_b − P_b A_b P_b`` (exact: ``P_b A_b``
    is nilpotent of order 2). Four batched products of n×n matrices in all, no product form over a whole chunk.
    """
    n = a.shape[-1]
    lead = a.shape[:-2]
    x = a.reshape(-1, n, n)
    eye, inner, offs = _block_masks(n, a.dtype, a.device)
    p = torch.addcmul(eye, x, inner, value=-1)
    if n > 2:
        o1, o2 = p.diagonal(-1, -2, -1), p.diagonal(-2, -2, -1)  # [batch, n − d]: entries (i, i − d)
        if n > 3:
            p3 = p.diagonal(-3, -2, -1)
            p3.addcmul_(o2[:, 1:], o1[:, :-2])  # while o₂ is still o₂
        o2.addcmul_(o1[:, 1:], o1[:, :-1])
        if n > 3:
            p3.addcmul_(o1[:, 2:], o2[:, :-1])
    if offs:
        t, u = torch.empty_like(p), torch.empty_like(p)  # reused through out=
        for off in offs:
            torch.mul(x, off, out=t)
            torch.bmm(t, p, out=u)
            p, t = torch.baddbmm(p, p, u, alpha=-1, out=t), p
    return p.view(*lead, n, n)


def unit_lower_inverse(a: torch.Tensor, *, bounded: bool = False) -> torch.Tensor:
    """``(I + A)⁻¹`` for strictly lower-triangular ``a [..., C, C]``.

    The 16×16 diagonal blocks are inverted for all blocks of all chunks at once (4×4 blocks by substitution, then recursive doubling,
    :func:`_unit_lower_inverse_block`), then the blocks below the diagonal by blocked forward substitution
    (``P_ij = −P_ii Σ_m A_im P_mj``, one block row at a time). Over a whole chunk the product form
    ``Π (I + (-A)^{2^j})`` would be unusable: its powers of A reach binomial sizes (≈1e18 for C = 64) when unit
    keys repeat with gates near 1, and cancel catastrophically. On the CPU this is also faster than a batched
    LAPACK triangular solve, which pays a call per small matrix. ``C`` must be a multiple of 16 or at most 16.
    ``bounded=True`` promises ``|A_ij| ≤ 1`` (EFLA's unit keys and gates below 1) and skips the check (a host
    sync) that sends larger entries to row-by-row substitution.
    """
    C = a.shape[-1]
    if not bounded and a.abs().amax() > 2:  # one host sync; this is the CPU path
        return _unit_lower_inverse_rows(a)
    bs = min(C, SOLVE_BLOCK)
    if C % bs:
        raise ValueError(f"chunk length {C} must be a multiple of {SOLVE_BLOCK} or at most {SOLVE_BLOCK}")
    nb = C // bs
    if nb == 1:
        return _unit_lower_inverse_block(a)
    lead = a.shape[:-2]
    blocks = a.view(*lead, nb, bs, nb, bs)
    inv_diag = _unit_lower_inverse_block(blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3))  # [..., nb, bs, bs]
    p = a.new_zeros(a.shape)
    pb = p.view(*lead, nb, bs, nb, bs)
    pb.diagonal(dim1=-4, dim2=-2).copy_(inv_diag.movedim(-3, -1))
    for i in range(1, nb):
        rows = slice(i * bs, (i + 1) * bs)
        p[..., rows, : i * bs] = -(inv_diag[..., i, :, :] @ (a[..., rows, : i * bs] @ p[..., : i * bs, : i * bs]))
    return p


def _bmm(x: torch.Tensor) -> torch.Tensor:
    """``[..., m, n]`` → ``[batch, m, n]`` (a view for the contiguous chunk tensors)."""
    return x.reshape(-1, *x.shape[-2:])


def _chunk_forward(q, k, v, beta, h0, resets, C: int, rule: str, keep: bool):
    """``(o, S_T, saved)`` from raw ``q, k [B,T,H,K]``, ``v [B,T,H,V]``, ``β [B,T,H]`` and ``h0 [B,H,K,V]`` (or None),
    all in the compute dtype, with the unit-key gate (:func:`rlseq.kernels.rules.unit_key_scales`) applied inside.
    ``saved`` holds what :class:`_ChunkFunction`'s backward reads when ``keep``, else None: without a backward to
    feed, intermediates are updated in place and dropped once spent."""
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = -(-T // C)
    pad = N * C - T
    if pad:  # padded steps have β = 0 and k = 0: gate 0, write 0, they leave the state alone
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        beta = F.pad(beta, (0, 0, 0, pad))
    dt, dev = k.dtype, k.device

    def cv(x: torch.Tensor) -> torch.Tensor:  # [B, N·C, H, D] → a strided [N, B, H, C, D] view
        return x.view(B, N, C, H, -1).permute(1, 0, 3, 2, 4)

    BH = B * H
    shapes = {"qk": (N, B, H, 2 * C, K), "wc": (N, B, H, C, V), "prod": (N, B, H, 2 * C, C),
              "states": (N + keep, BH, K, V), "d": (N, BH, C, V)}
    if keep:
        shapes.update(gc=(N, B, H, C, 1))
    else:  # M is spent inside the call
        shapes.update(m=(N, BH, C, K))
    buf = _buffers(shapes, dt, dev)

    c, g, s = unit_key_scales(k, beta, rule)
    # Q and K̂ stacked along the rows of one buffer: one product gives QK̂ᵀ and K̂K̂ᵀ
    qkb, wc = buf["qk"], buf["wc"]
    qc, kc = qkb[..., :C, :], qkb[..., C:, :]
    # each input goes into the chunk layout right before its first use there, while it is still in cache
    if c is None:
        kc.copy_(cv(k))
    else:  # k̂ = c k, written straight into the chunk layout (one pass)
        torch.mul(cv(k), cv(c.unsqueeze(-1)), out=kc)
    qc.copy_(cv(q))
    if keep:  # the backward wants g in the chunk layout
        gc = buf["gc"]
        gc.copy_(cv(g.unsqueeze(-1)))  # [N, B, H, C, 1]
    else:
        gc = cv(g.unsqueeze(-1))
    m_lower, sees, last, carry = _chunk_masks(resets, B, N, C, dt, dev)

    prod = buf["prod"]
    torch.bmm(_bmm(qkb), _bmm(kc).transpose(-1, -2), out=_bmm(prod))  # [N, B, H, 2C, C]
    qk, a = prod[..., :C, :], prod[..., C:, :]
    prod.view(N, B, H, 2, C, C).mul_(m_lower.unsqueeze(-3))  # one mask for both halves
    a.mul_(gc)  # A = diag(g) K̂K̂ᵀ: the gate scales rows of the product, half the size of K̂
    if rule != "efla":  # DeltaNet's bound check reads all of A (EFLA's inverse reads only the strict part)
        a.diagonal(0, -2, -1).zero_()
    p = unit_lower_inverse(a, bounded=rule == "efla")  # EFLA: unit keys and gates in [0, 1] bound every |A_ij| by 1

    # the state recurrence, chunk by chunk (batched over B·H): D = U − M S₀ with U = P W and M = P diag(g·sees) K̂
    # precomputed for all chunks (diag(sees) commutes with P: block-diagonal over episodes), then
    # S₁ = carry·S₀ + K̂ᵀ diag(last) D. Every op in the loop is in place or out=: no copies, no allocations.
    states, d = buf["states"], buf["d"]  # the state entering each chunk (and the final one when saved)
    final = states[N] if keep else torch.empty(BH, K, V, dtype=dt, device=dev)  # its own tensor: the caller need not hold every chunk's state
    if h0 is None:
        states[0].zero_()
    else:
        states[0].copy_(h0.reshape(BH, K, V))
    torch.mul(cv(v), cv(s.unsqueeze(-1)), out=wc)
    torch.bmm(_bmm(p), _bmm(wc), out=_bmm(d))
    gs = gc if sees is None else gc * sees  # [N, B, H, C, 1]
    if keep:  # the backward wants diag(g) K̂ and diag(g·sees) K̂
        gk = kc * gc
        gks = gk if sees is None else kc * gs
        m = _bmm(p).bmm(_bmm(gks))
        kl = kc if last is None else kc * last
    else:  # in place: P's columns scaled (U is done; P is half the size of K̂), then K̂ turns into diag(last) K̂
        m = torch.bmm(_bmm(p.mul_(gs.transpose(-1, -2))), _bmm(kc), out=_bmm(buf["m"]))
        kl = kc if last is None else kc.mul_(last)
    m = m.view(N, BH, C, K)
    # per-chunk views made once (unbind), not by indexing inside the loop
    st = states[:N].unbind(0) + (final,)
    dn, mn = d.unbind(0), m.unbind(0)
    klt = _bmm(kl).view(N, BH, C, K).transpose(-1, -2).unbind(0)
    if carry is None:
        for n in range(N):
            dn[n].baddbmm_(mn[n], st[n], alpha=-1)
            torch.baddbmm(st[n], klt[n], dn[n], out=st[n + 1])
    else:
        flat = states[:N].view(N, B, H * K * V).unbind(0) + (final.view(B, H * K * V),)
        cn = carry.view(N, B, 1).unbind(0)
        for n in range(N):
            dn[n].baddbmm_(mn[n], st[n], alpha=-1)
            torch.mul(flat[n], cn[n], out=flat[n + 1])
            st[n + 1].baddbmm_(klt[n], dn[n])
    s0 = states[:N].view(N, B, H, K, V)
    d = d.view(N, B, H, C, V)
    o = torch.bmm(_bmm(qc), _bmm(s0), out=_bmm(wc)).view(N, B, H, C, V)  # W is spent: reuse its memory
    if sees is not None:
        o.mul_(sees)
    _bmm(o).baddbmm_(_bmm(qk), _bmm(d))
    out = torch.empty(B, N * C, H, V, dtype=dt, device=dev)
    cv(out).copy_(o)
    final = final.view(B, H, K, V)
    out = out[:, :T] if pad else out
    if not keep:
        return out, final, None
    m_strict = m_lower - torch.eye(C, dtype=dt, device=dev) if sees is not None else _triangles(C, dt, dev)[0]
    return out, final, (qc, kc, gc, gk, gks, kl, p, qk, d, states, carry, m_strict, m_lower, sees, last, k, v, beta, s)


class _ChunkFunction(torch.autograd.Function):
    """:func:`_chunk_forward` with its saved tensors, and the backward by hand, which chains the gate with
    :func:`rlseq.kernels.rules.unit_key_gate_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, beta, h0, resets, C, rule):
        o, final, saved = _chunk_forward(q, k, v, beta, h0, resets, C, rule, True)
        ctx.save_for_backward(*saved)
        B, T, H, K = k.shape
        ctx.dims = (B, T, H, K, v.shape[-1], -(-T // C), C)
        ctx.rule = rule
        ctx.h0_none = h0 is None
        return o, final

    @staticmethod
    def backward(ctx, do, dsT):
        (qc, kc, gc, gk, gks, kl, p, qk, d, states, carry, m_strict, m_lower, sees, last,
         k, v, beta, s) = ctx.saved_tensors
        B, T, H, K, V, N, C = ctx.dims
        dt, dev = kc.dtype, kc.device
        Tp = N * C

        def cv(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, N, C, H, -1).permute(1, 0, 3, 2, 4)

        do = do.to(dt)
        if Tp != T:
            do = F.pad(do, (0, 0, 0, 0, 0, Tp - T))
        doc = cv(do.contiguous()).contiguous()  # [N, B, H, C, V]
        dos = doc if sees is None else doc * sees
        s0 = states[:N].view(N, B, H, K, V)
        pt = p.transpose(-1, -2)
        # dR = Pᵀ dD,  dD = (QK)ᵀ dO + diag(last) K̂ dS₁  →  dR = X + Y dS₁
        xx = pt @ (qk.transpose(-1, -2) @ doc)  # [N, B, H, C, V]
        y = pt @ kl  # [N, B, H, C, K]
        z = (qc.transpose(-1, -2) @ dos).view(N, B * H, K, V)  # Qᵀ diag(sees) dO
        # reverse walk: dR = X + Y dS₁,  dS₀ = carry dS₁ + Qᵀ diag(sees) dO − (g sees K̂)ᵀ dR
        BH = B * H
        ds = torch.empty(N + 1, BH, K, V, dtype=dt, device=dev)
        if dsT is None:
            ds[N].zero_()
        else:
            ds[N].copy_(dsT.reshape(BH, K, V))
        dr = torch.empty(N, BH, C, V, dtype=dt, device=dev)
        x3, y3, g3t = xx.view(N, BH, C, V), y.view(N, BH, C, K), gks.reshape(N, BH, C, K).transpose(-1, -2)
        acc = torch.empty(BH, K, V, dtype=dt, device=dev)
        for n in range(N - 1, -1, -1):
            torch.baddbmm(x3[n], y3[n], ds[n + 1], out=dr[n])
            if carry is None:
                torch.add(z[n], ds[n + 1], out=acc)
            else:
                torch.addcmul(z[n].view(B, -1), ds[n + 1].view(B, -1), carry[n].view(B, 1), out=acc.view(B, -1))
            torch.baddbmm(acc, g3t[n], dr[n], alpha=-1, out=ds[n])
        ds1 = ds[1:].view(N, B, H, K, V)  # the gradient of each chunk's leaving state
        dr = dr.view(N, B, H, C, V)  # = ∂L/∂W (unit-key values)
        dtr = d.transpose(-1, -2)
        dqk = (doc @ dtr).mul_(m_lower)
        dqc = dqk @ kc
        dqc.view(-1, C, K).baddbmm_(_bmm(dos), _bmm(s0).transpose(-1, -2))
        da = (dr @ dtr).mul_(m_strict)  # = −∂L/∂A
        drs = dr if sees is None else dr * sees
        ngk = da @ kc  # = −∂L/∂(g K̂)
        ngk.view(-1, C, K).baddbmm_(_bmm(drs), _bmm(s0).transpose(-1, -2))
        dl = d if last is None else d * last
        dkh = dqk.transpose(-1, -2) @ qc
        dkh3 = dkh.view(-1, C, K)
        dkh3.baddbmm_(_bmm(dl), _bmm(ds1).transpose(-1, -2))
        dkh3.baddbmm_(_bmm(da).transpose(-1, -2), _bmm(gk), alpha=-1)
        dkh.addcmul_(gc, ngk, value=-1)  # = ∂L/∂K̂
        dg = -(ngk * kc).sum(-1)  # = ∂L/∂g  [N, B, H, C]

        def to_bth(t: torch.Tensor) -> torch.Tensor:  # [N, B, H, C] → [B, N·C, H]
            return t.permute(1, 0, 3, 2).reshape(B, Tp, H)

        dq = torch.empty(B, Tp, H, K, dtype=dt, device=dev)
        cv(dq).copy_(dqc)
        dv = torch.empty(B, Tp, H, V, dtype=dt, device=dev)
        torch.mul(dr, cv(s.unsqueeze(-1)), out=cv(dv))
        dsw = to_bth((dr * cv(v)).sum(-1))  # ∂L/∂s for w = s v
        dkh_bth = torch.empty(B, Tp, H, K, dtype=dt, device=dev)
        cv(dkh_bth).copy_(dkh)
        dk, dbeta = unit_key_gate_backward(k, beta, ctx.rule, dkh_bth, to_bth(dg), dsw)
        dh0 = None if ctx.h0_none else ds[0].view(B, H, K, V)
        if Tp != T:
            dq, dk, dv, dbeta = dq[:, :T], dk[:, :T], dv[:, :T], dbeta[:, :T]
        return dq, dk, dv, dbeta, dh0, None, None, None


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
    float64 inputs) and returns ``o`` in the input dtype and the final state in the compute dtype."""
    check_rule(rule)
    T = k.shape[1]
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    # chunks longer than one solve block are whole blocks (padding rows are inert)
    C = max(1, min(chunk_size, T if T <= SOLVE_BLOCK else -(-T // SOLVE_BLOCK) * SOLVE_BLOCK))
    if C > SOLVE_BLOCK and C % SOLVE_BLOCK:
        raise ValueError(f"chunk_size must be a multiple of {SOLVE_BLOCK} (or at most {SOLVE_BLOCK}), got {chunk_size}")
    h0 = None if initial_state is None else initial_state.to(dt)
    args = (q.to(dt), k.to(dt), v.to(dt), beta.to(dt), h0, resets, C, rule)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, beta, h0)):
        return _ChunkFunction.apply(*args)
    return _chunk_forward(*args, keep=False)[:2]


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
