"""The torch backend and the API against the float64 step-by-step oracle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlseq.kernels import chunk_rule, naive_rule, phi, step_rule, unit_key_form
from rlseq.bench.kernels import random_inputs, rel_err
from tests.helpers import check_non_finite_stays_in_its_episode

RULES = ("efla", "deltanet")
FIELDS = ("q", "k", "v", "beta", "initial_state")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _call(inp, rule, backend, **kw):
    return chunk_rule(
        inp["q"], inp["k"], inp["v"], inp["beta"], rule=rule,
        initial_state=inp["initial_state"], resets=inp["resets"], backend=backend, **kw,
    )


# --- the rules themselves -----------------------------------------------------------------------------


def test_phi_matches_high_precision_series_and_has_exact_gradient():
    x = torch.cat([torch.zeros(1), torch.logspace(-8, 3, 400)]).double()
    # the alternating series converges fast and cancels little for x < 2; expm1 is exact to rounding above
    def series(xi: float) -> float:
        total, term = 0.0, 1.0
        for n in range(60):
            total, term = total + term, -term * xi / (n + 2)
        return total

    ref = torch.tensor([series(xi) if xi < 2 else -math.expm1(-xi) / xi for xi in x.tolist()], dtype=torch.float64)
    assert torch.allclose(phi(x), ref, rtol=1e-14, atol=0)
    assert phi(torch.zeros(1, dtype=torch.float64)).item() == 1.0
    xg = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(phi(xg).sum(), xg)
    # φ'(x) = (e^{-x}(1+x) - 1)/x², -1/2 at 0; evaluate it where the closed form is well conditioned
    big = x > 1.0
    closed = (torch.exp(-x) * (1 + x) - 1) / x**2
    assert torch.allclose(grad[big], closed[big], rtol=1e-12)
    assert abs(grad[0].item() + 0.5) < 1e-15
    assert torch.isfinite(grad).all()
    # float32: the gradient stays accurate through the switch (no cancellation near x = 0.1)
    xf = torch.linspace(0.05, 0.2, 31, requires_grad=True)
    (gf,) = torch.autograd.grad(phi(xf).sum(), xf)
    xd = xf.detach().double().requires_grad_()
    (gd,) = torch.autograd.grad(phi(xd).sum(), xd)
    assert torch.allclose(gf.double(), gd, rtol=2e-6)


@pytest.mark.parametrize("norm", [0.0, 1e-4, 1.0, 1e4, 1e6])
def test_unit_key_form_reproduces_the_raw_efla_step(norm):
    g = _gen(1)
    k = F.normalize(torch.randn(5, 16, generator=g, dtype=torch.float64), dim=-1) * norm
    v = torch.randn(5, 8, generator=g, dtype=torch.float64)
    beta = 3 * torch.rand(5, generator=g, dtype=torch.float64)
    S = torch.randn(5, 16, 8, generator=g, dtype=torch.float64)
    lam = (k * k).sum(-1)
    alpha = torch.where(lam > 0, -torch.expm1(-beta * lam) / lam.clamp_min(1e-300), beta)
    raw = S + alpha[:, None, None] * k[:, :, None] * (v - torch.einsum("bkv,bk->bv", S, k))[:, None, :]
    kh, gate, w = unit_key_form(k, v, beta, "efla")
    unit = S + kh[:, :, None] * (w - gate[:, None] * torch.einsum("bkv,bk->bv", S, kh))[:, None, :]
    assert torch.allclose(unit, raw, rtol=1e-12, atol=1e-12 * S.abs().max().item())
    assert ((gate >= 0) & (gate <= 1)).all()  # < 1 in exact arithmetic; rounds to 1 for huge βλ


# --- the oracle -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES)
def test_reference_gradcheck(rule):
    inp = random_inputs(2, 6, 2, 3, 4, rule=rule, key_norms=(0.1, 3.0), generator=_gen(2))
    inp["resets"][1, 3] = True
    args = [inp[n].clone().requires_grad_() for n in FIELDS]

    def f(q, k, v, beta, s0):
        return naive_rule(q, k, v, beta, rule=rule, initial_state=s0, resets=inp["resets"])

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("rule", RULES)
def test_reference_resets_equal_separate_episodes(rule):
    """A reset at t must give the same outputs as starting a fresh sequence at t from zeros."""
    inp = random_inputs(1, 12, 2, 4, 3, rule=rule, generator=_gen(3))
    resets = torch.zeros(1, 12, dtype=torch.bool)
    resets[0, 5] = True
    o, s = naive_rule(inp["q"], inp["k"], inp["v"], inp["beta"], rule=rule, initial_state=inp["initial_state"], resets=resets)
    o1, _ = naive_rule(*(inp[n][:, :5] for n in ("q", "k", "v", "beta")), rule=rule, initial_state=inp["initial_state"])
    o2, s2 = naive_rule(*(inp[n][:, 5:] for n in ("q", "k", "v", "beta")), rule=rule)
    assert torch.allclose(o, torch.cat([o1, o2], 1), atol=1e-12)
    assert torch.allclose(s, s2, atol=1e-12)


# --- the torch backend against the oracle --------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("K,V", [(16, 16), (32, 8), (64, 48)])
@pytest.mark.parametrize("T,chunk", [(37, 16), (64, 16), (100, 64), (5, 64)])
def test_torch_matches_reference_float64(rule, K, V, T, chunk):
    inp = random_inputs(3, T, 2, K, V, rule=rule, generator=_gen(hash((rule, K, V, T)) % 2**31))
    o_ref, s_ref = _call(inp, rule, "reference")
    o, s = _call(inp, rule, "torch", chunk_size=chunk)
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(s, s_ref) < 1e-10
    assert s.dtype == torch.float64


@pytest.mark.parametrize("rule", RULES)
def test_torch_float32_and_bf16_against_float64_oracle(rule):
    inp = random_inputs(4, 70, 4, 32, 32, rule=rule, generator=_gen(5))
    o_ref, s_ref = _call(inp, rule, "reference")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        low = {n: (x.to(dtype) if x.is_floating_point() and n != "initial_state" else x) for n, x in inp.items()}
        low["initial_state"] = inp["initial_state"].float()
        o, s = _call(low, rule, "torch", chunk_size=32)
        assert o.dtype == dtype and s.dtype == torch.float32
        # bf16 rounding of the inputs alone moves the answer; compare against the oracle on those rounded inputs
        ref_in = {n: (x.double() if x.is_floating_point() else x) for n, x in low.items()}
        o_ref_low, s_ref_low = _call(ref_in, rule, "reference")
        assert rel_err(o, o_ref_low) < tol
        assert rel_err(s, s_ref_low) < tol
    assert rel_err(_call({**inp}, rule, "torch")[0], o_ref) < 1e-10


def test_zero_keys_and_zero_beta_leave_the_state_alone():
    for rule in RULES:
        inp = random_inputs(2, 20, 2, 16, 8, rule=rule, generator=_gen(6))
        inp["k"][:, 3:9] = 0.0
        inp["beta"][:, 12:15] = 0.0
        inp["resets"][:] = False
        o_ref, s_ref = _call(inp, rule, "reference")
        o, s = _call(inp, rule, "torch", chunk_size=8)
        assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10
        # with no keys and no steps at all the state passes through unchanged
        inp["beta"][:] = 0.0
        _, s0 = _call(inp, rule, "torch", chunk_size=8)
        assert torch.equal(s0, inp["initial_state"])


def test_deltanet_with_beta_beyond_2_and_repeated_keys():
    """β > 2 (eigenvalues below -1) with repeated unit keys: |A_ij| = 4.5, where product-form inverses break down."""
    inp = random_inputs(2, 12, 2, 16, 8, rule="deltanet", beta_max=5.0, generator=_gen(18))
    inp["beta"][:, :, 0] = 4.5
    inp["k"][:, :, 0] = inp["k"][:, :1, 0]
    o_ref, s_ref = _call(inp, "deltanet", "reference")
    o, s = _call(inp, "deltanet", "torch", chunk_size=16)
    assert rel_err(o, o_ref) < 1e-9 and rel_err(s, s_ref) < 1e-9


@pytest.mark.parametrize("rule", RULES)
def test_large_beta(rule):
    inp = random_inputs(2, 33, 2, 16, 16, rule=rule, beta_max=50.0 if rule == "efla" else 1.9, generator=_gen(7))
    o_ref, s_ref = _call(inp, rule, "reference")
    o, s = _call(inp, rule, "torch", chunk_size=16)
    assert rel_err(o, o_ref) < 1e-9 and rel_err(s, s_ref) < 1e-9


@pytest.mark.parametrize("rule", RULES)
def test_torch_gradients_match_reference(rule):
    inp = random_inputs(2, 29, 2, 16, 12, rule=rule, generator=_gen(8))
    grads = {}
    for backend in ("reference", "torch"):
        leaves = {n: inp[n].clone().requires_grad_() for n in FIELDS}
        o, s = chunk_rule(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], rule=rule,
                          initial_state=leaves["initial_state"], resets=inp["resets"], backend=backend, chunk_size=8)
        go = torch.randn_like(o, generator=_gen(9)) if False else torch.randn(o.shape, generator=_gen(9), dtype=o.dtype)
        gs = torch.randn(s.shape, generator=_gen(10), dtype=s.dtype)
        grads[backend] = torch.autograd.grad((o * go).sum() + (s * gs).sum(), [leaves[n] for n in FIELDS])
    for name, g_ref, g in zip(FIELDS, grads["reference"], grads["torch"]):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, g_ref) < 1e-9, name


def test_efla_gradients_at_exactly_zero_keys_are_finite_and_right():
    inp = random_inputs(1, 10, 1, 8, 4, rule="efla", generator=_gen(11))
    inp["k"][:, 2] = 0.0
    grads = {}
    for backend in ("reference", "torch"):
        k = inp["k"].clone().requires_grad_()
        o, _ = chunk_rule(inp["q"], k, inp["v"], inp["beta"], rule="efla", initial_state=inp["initial_state"],
                          resets=inp["resets"], backend=backend, chunk_size=4)
        (grads[backend],) = torch.autograd.grad(o.sum(), k)
    assert grads["reference"][:, 2].abs().max() > 1e-3  # a zero key still has a gradient: β v enters linearly
    assert rel_err(grads["torch"], grads["reference"]) < 1e-9


# --- step_rule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_step_rule_T_times_equals_chunk_rule(rule, backend):
    inp = random_inputs(3, 21, 2, 16, 8, rule=rule, generator=_gen(12))
    o_ref, s_ref = _call(inp, rule, "reference")
    state = inp["initial_state"].clone()
    outs = []
    for t in range(21):
        outs.append(step_rule(inp["q"][:, t], inp["k"][:, t], inp["v"][:, t], inp["beta"][:, t], state,
                              rule=rule, resets=inp["resets"][:, t], backend=backend))
    assert rel_err(torch.stack(outs, 1), o_ref) < 1e-10
    assert rel_err(state, s_ref) < 1e-10


def test_step_rule_float32_state_with_bf16_inputs():
    inp = random_inputs(2, 6, 2, 16, 16, rule="efla", generator=_gen(13))
    state = inp["initial_state"].float()
    o = step_rule(*(inp[n][:, 0].bfloat16() for n in ("q", "k", "v", "beta")), state, rule="efla")
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32 and torch.isfinite(o).all()


# --- stability under extreme key scales -----------------------------------------------------------------


def test_efla_stays_bounded_where_deltanet_with_raw_keys_diverges():
    g = _gen(14)
    B, T, H, K, V = 1, 4096, 2, 16, 16
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = 1e6 * torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    norms = k.norm(dim=-1)
    # docs/rules.md §2: per step ‖S_t‖_F ≤ ‖S_{t-1}‖_F + c_t ‖v_t‖/‖k_t‖, and c/‖k‖ ≤ 0.6382 √β for every key norm
    gate = -torch.expm1(-beta * norms**2)
    tight = (gate * v.norm(dim=-1) / norms).cumsum(1)  # [B, T, H]
    loose = (0.6382 * beta.sqrt() * v.norm(dim=-1)).cumsum(1)
    for backend, dtype in (("reference", torch.float64), ("torch", torch.float64), ("torch", torch.float32)):
        o, s = chunk_rule(q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype), rule="efla", backend=backend)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        s_norm = s.double().flatten(2).norm(dim=-1)  # [B, H]
        assert (s_norm <= tight[:, -1] * (1 + 1e-4)).all()
        assert (s_norm <= loose[:, -1]).all()
        # and the bound holds along the way, not only at the end (read the state after 1000 steps too)
        _, s_mid = chunk_rule(q[:, :1000].to(dtype), k[:, :1000].to(dtype), v[:, :1000].to(dtype),
                              beta[:, :1000].to(dtype), rule="efla", backend=backend)
        assert (s_mid.double().flatten(2).norm(dim=-1) <= tight[:, 999] * (1 + 1e-4)).all()
    # the same inputs blow DeltaNet's Euler step up: the stress is real
    for backend in ("reference", "torch"):
        o, s = chunk_rule(q, k, v, beta, rule="deltanet", backend=backend)
        assert not torch.isfinite(s).all() or s.abs().max() > 1e30


# --- errors ---------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    inp = random_inputs(2, 8, 2, 16, 8, rule="efla", dtype=torch.float32, generator=_gen(15))
    q, k, v, beta = (inp[n] for n in ("q", "k", "v", "beta"))
    with pytest.raises(ValueError, match="valid rules: efla, deltanet"):
        chunk_rule(q, k, v, beta, rule="mamba")
    with pytest.raises(ValueError, match="valid backends: reference, torch, triton"):
        chunk_rule(q, k, v, beta, rule="efla", backend="cuda")
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\] = \[2, 8, 2\]"):
        chunk_rule(q, k, v, beta[..., :1], rule="efla")
    with pytest.raises(ValueError, match=r"v must have shape \[B, T, H, V\]"):
        chunk_rule(q, k, v[:, :4], beta, rule="efla")
    with pytest.raises(ValueError, match=r"q and k must both have shape"):
        chunk_rule(q, k[..., :8], v, beta, rule="efla")
    with pytest.raises(ValueError, match="share a dtype"):
        chunk_rule(q, k.double(), v, beta, rule="efla")
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B, H, K, V\] = \[2, 2, 16, 8\]"):
        chunk_rule(q, k, v, beta, rule="efla", initial_state=torch.randn(2, 2, 8, 16))
    with pytest.raises(ValueError, match=r"resets must be a bool tensor of shape \[2, 8\]"):
        chunk_rule(q, k, v, beta, rule="efla", resets=torch.ones(2, 8))
    with pytest.raises(ValueError, match="floating"):
        chunk_rule(*(x.long() for x in (q, k, v, beta)), rule="efla")
    state = torch.randn(2, 2, 16, 8)
    with pytest.raises(ValueError, match=r"state must have shape \[B, H, K, V\] = \[2, 2, 16, 8\]"):
        step_rule(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], state[:1], rule="efla")
    with pytest.raises(ValueError, match=r"resets must be a bool tensor of shape \[2\]"):
        step_rule(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], state, rule="efla", resets=torch.ones(2, dtype=torch.bool)[:1])


def test_triton_backend_is_recognised_with_a_clear_error_when_unavailable(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    inp = random_inputs(1, 4, 1, 16, 16, rule="efla", dtype=torch.float32, generator=_gen(16))
    with pytest.raises(RuntimeError, match="backend 'triton' is not available"):
        chunk_rule(inp["q"], inp["k"], inp["v"], inp["beta"], rule="efla", backend="triton")
    # None picks the torch backend on the CPU
    o, _ = chunk_rule(inp["q"], inp["k"], inp["v"], inp["beta"], rule="efla")
    assert torch.isfinite(o).all() and not math.isnan(o.sum().item())


@pytest.mark.parametrize("rule", RULES)
def test_torch_stays_accurate_when_unit_keys_repeat_with_saturated_gates(rule):
    """A = g·(all-ones strictly lower): its powers hold binomials up to C(63, 31) ≈ 1e18, so any inverse
    built from powers of A cancels catastrophically. The blocked substitution must stay at fp32 rounding."""
    g = _gen(17)
    B, T, H, K, V = 2, 128, 2, 16, 16
    key = F.normalize(torch.randn(1, 1, H, K, generator=g, dtype=torch.float64), dim=-1)
    k = key.expand(B, T, H, K).clone() * (1e3 if rule == "efla" else 1.0)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = torch.full((B, T, H), 0.999 if rule == "deltanet" else 5.0, dtype=torch.float64)
    o_ref, s_ref = chunk_rule(q, k, v, beta, rule=rule, backend="reference")
    for chunk in (16, 64):
        o, s = chunk_rule(q.float(), k.float(), v.float(), beta.float(), rule=rule, backend="torch", chunk_size=chunk)
        assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


# --- the torch backend's hand-written backward (chunk._ChunkFunction) -----------------------------------


def _grads_torch_vs_reference(inp, rule, chunk, dtype=torch.float64, with_h0=True):
    """Gradients of a random loss on (o, S_T) w.r.t. q, k, v, β, h0: torch backend in ``dtype`` and the float64
    oracle (autograd through the step loop) on the same (rounded) inputs."""
    names = FIELDS if with_h0 else FIELDS[:4]
    out = {}
    for backend, dt in (("reference", torch.float64), ("torch", dtype)):
        leaves = {n: (inp[n].to(dt) if n != "initial_state" else inp[n].to(torch.float64 if dt == torch.float64 else torch.float32))
                  for n in names}
        leaves = {n: x.detach().double().requires_grad_() if backend == "reference" else x.detach().requires_grad_()
                  for n, x in leaves.items()}
        o, s = chunk_rule(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], rule=rule,
                          initial_state=leaves.get("initial_state"), resets=inp["resets"], backend=backend, chunk_size=chunk)
        go = torch.randn(o.shape, generator=_gen(21), dtype=torch.float64).to(o.dtype)
        gs = torch.randn(s.shape, generator=_gen(22), dtype=torch.float64).to(s.dtype)
        out[backend] = dict(zip(names, torch.autograd.grad((o * go).sum() + (s * gs).sum(), [leaves[n] for n in names])))
    return out["reference"], out["torch"]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T,chunk,K,V", [(64, 16, 16, 8), (45, 32, 16, 24), (100, 32, 8, 16), (37, 64, 24, 16), (7, 16, 16, 16)])
def test_torch_backward_matches_reference_float64(rule, T, chunk, K, V):
    """Resets inside chunks and at a chunk boundary (t = 16), T not a multiple of the chunk, K ≠ V."""
    inp = random_inputs(2, T, 3, K, V, rule=rule, reset_prob=0.08, generator=_gen(hash((rule, T, chunk)) % 2**31))
    if T > 2 * chunk:
        inp["resets"][1, chunk] = True  # a reset exactly at a chunk boundary in the second sequence too
    ref, got = _grads_torch_vs_reference(inp, rule, chunk)
    for name in ref:
        assert got[name].dtype == torch.float64
        assert torch.isfinite(got[name]).all(), name
        assert rel_err(got[name], ref[name]) < 1e-10, (name, rel_err(got[name], ref[name]))


@pytest.mark.parametrize("rule", RULES)
def test_torch_backward_without_resets_or_initial_state(rule):
    inp = random_inputs(2, 50, 2, 16, 16, rule=rule, generator=_gen(23))
    inp["resets"] = None
    ref, got = _grads_torch_vs_reference(inp, rule, 16, with_h0=False)
    for name in ref:
        assert rel_err(got[name], ref[name]) < 1e-10, name


@pytest.mark.parametrize("rule", RULES)
def test_torch_backward_with_zero_keys_zero_beta_and_resets_everywhere(rule):
    inp = random_inputs(2, 40, 2, 16, 8, rule=rule, generator=_gen(24))
    inp["k"][:, 5:12] = 0.0
    inp["k"][1, 30] = 0.0
    inp["beta"][:, 20:23] = 0.0
    inp["resets"][0, 16:20] = True  # consecutive resets starting at a chunk boundary
    inp["resets"][1, ::5] = True
    ref, got = _grads_torch_vs_reference(inp, rule, 16)
    for name in ref:
        assert torch.isfinite(got[name]).all(), name
        assert rel_err(got[name], ref[name]) < 1e-9, name
    if rule == "efla":  # zero keys still carry a gradient (β v enters linearly)
        assert got["k"][:, 5:12].abs().max() > 1e-3


@pytest.mark.parametrize("rule", RULES)
def test_torch_backward_float32_against_float64_oracle(rule):
    inp = random_inputs(3, 90, 4, 32, 32, rule=rule, generator=_gen(25))
    for chunk in (16, 32):
        ref, got = _grads_torch_vs_reference(inp, rule, chunk, dtype=torch.float32)
        for name in ref:
            assert got[name].dtype == torch.float32
            assert rel_err(got[name], ref[name]) < 1e-4, (chunk, name, rel_err(got[name], ref[name]))


def test_torch_backward_efla_gate_at_tiny_and_huge_step_lengths():
    """βλ on both sides of φ's Taylor switch (0.1) and saturated gates: the hand-chained gate gradient."""
    g = _gen(26)
    B, T, H, K, V = 2, 40, 2, 8, 8
    inp = random_inputs(B, T, H, K, V, rule="efla", key_norms=(1e-3, 30.0), beta_max=4.0, generator=g)
    inp["beta"][:, :10] = 1e-7
    inp["beta"][:, 10:20] = 0.099 / (inp["k"][:, 10:20] ** 2).sum(-1)  # βλ just below the switch
    inp["beta"][:, 20:25] = 0.101 / (inp["k"][:, 20:25] ** 2).sum(-1)  # and just above
    ref, got = _grads_torch_vs_reference(inp, "efla", 16)
    for name in ref:
        assert rel_err(got[name], ref[name]) < 1e-9, name


def test_torch_backward_gradcheck_small():
    inp = random_inputs(1, 11, 1, 4, 3, rule="efla", key_norms=(0.3, 3.0), generator=_gen(27))
    inp["resets"][0, 6] = True
    args = [inp[n].clone().requires_grad_() for n in FIELDS]

    def f(q, k, v, beta, s0):
        return chunk_rule(q, k, v, beta, rule="efla", initial_state=s0, resets=inp["resets"], backend="torch", chunk_size=4)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_torch_backward_accepts_non_contiguous_inputs_and_unused_outputs():
    inp = random_inputs(2, 20, 2, 8, 8, rule="efla", generator=_gen(28))
    big = torch.randn(2, 20, 2, 24, dtype=torch.float64, generator=_gen(29))
    q, k, v = (big[..., i * 8 : (i + 1) * 8].clone().requires_grad_() for i in range(3))
    q_nc, k_nc, v_nc = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    assert not q_nc.is_contiguous()
    o, s = chunk_rule(q_nc, k_nc, v_nc, inp["beta"], rule="efla", resets=inp["resets"], backend="torch", chunk_size=8)
    o_ref, _ = chunk_rule(q, k, v, inp["beta"], rule="efla", resets=inp["resets"], backend="reference")
    assert rel_err(o, o_ref) < 1e-10
    (gq,) = torch.autograd.grad(o.sum(), [q])  # the final state unused: its gradient is zero
    (gq_ref,) = torch.autograd.grad(o_ref.sum(), [q])
    assert rel_err(gq, gq_ref) < 1e-10


def test_torch_no_grad_forward_is_repeatable_and_never_overwrites_earlier_outputs():
    """Without a backward the forward updates its intermediates in place: repeated calls (with and without resets,
    other shapes in between) must give the same results, and returned tensors must not be overwritten."""
    inps = [random_inputs(2, 40, 2, 16, 8, rule="efla", reset_prob=0.1, generator=_gen(31 + i)) for i in range(2)]
    other = random_inputs(3, 20, 2, 8, 8, rule="efla", generator=_gen(33))
    with torch.no_grad():
        first = [_call(x, "efla", "torch") for x in inps]
        keep = [(o.clone(), s.clone()) for o, s in first]
        _call(other, "efla", "torch")
        _call({**inps[0], "resets": None}, "efla", "torch")
        again = [_call(x, "efla", "torch") for x in inps]
    for (o, s), (o0, s0), (o1, s1) in zip(first, keep, again):
        assert torch.equal(o, o0) and torch.equal(s, s0)  # outputs of earlier calls untouched
        assert torch.equal(o1, o0) and torch.equal(s1, s0)
    o_ref, s_ref = _call(inps[1], "efla", "reference")
    assert rel_err(again[1][0], o_ref) < 1e-10 and rel_err(again[1][1], s_ref) < 1e-10


# --- bad values: huge keys, negative β, empty inputs, a NaN initial state behind a reset ------------------------


def test_efla_key_norms_up_to_1e30_in_float32():
    """‖k‖² overflows float32 above ~1.8e19 (the gate once became inf·0 = NaN there): outputs, state and every
    gradient finite and equal to the float64 oracle for key norms over 1e-4..1e30, in the torch backend and in the
    torch acting step."""
    inp = random_inputs(2, 37, 2, 16, 8, rule="efla", key_norms=(1e-4, 1e30), generator=_gen(40))
    inp["k"][0, 5, 1] *= 1e30 / inp["k"][0, 5, 1].norm()
    low = {n: (x.float() if x.is_floating_point() else x) for n, x in inp.items()}
    ref, got = _grads_torch_vs_reference(low, "efla", 16, dtype=torch.float32)
    o_ref, s_ref = _call({n: (x.double() if x.is_floating_point() else x) for n, x in low.items()}, "efla", "reference")
    o, s = _call(low, "efla", "torch")
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    for name in ref:
        assert rel_err(got[name], ref[name]) < 1e-4, (name, rel_err(got[name], ref[name]))
    state, s_step = low["initial_state"].clone(), inp["initial_state"].clone()
    for t in range(6):
        x = [low[n][:, t] for n in ("q", "k", "v", "beta")]
        o_t = step_rule(*x, state, rule="efla", resets=low["resets"][:, t], backend="torch")
        o_r = step_rule(*(a.double() for a in x), s_step, rule="efla", resets=low["resets"][:, t], backend="reference")
        assert rel_err(o_t, o_r) < 1e-5 and rel_err(state, s_step) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("rule", RULES)
def test_negative_beta_is_refused(rule, backend):
    inp = random_inputs(2, 5, 1, 16, 8, rule=rule, dtype=torch.float32, generator=_gen(41))
    inp["beta"][1, 3, 0] = -0.2
    with pytest.raises(ValueError, match=r"beta must be >= 0 \(got a minimum of -0.2\)"):
        _call(inp, rule, backend)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        step_rule(*(inp[n][:, 3] for n in ("q", "k", "v", "beta")), inp["initial_state"].float(), rule=rule,
                  backend=backend)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("shape", [(0, 5, 2, 16, 8), (2, 5, 0, 16, 8), (2, 5, 2, 0, 8), (2, 5, 2, 16, 0)],
                         ids=["B0", "H0", "K0", "V0"])
def test_empty_inputs_give_empty_results(shape, backend):
    B, T, H, K, V = shape
    x = [torch.randn(B, T, H, K, requires_grad=True), torch.randn(B, T, H, K), torch.randn(B, T, H, V),
         torch.rand(B, T, H)]
    h0 = torch.randn(B, H, K, V, requires_grad=True)
    o, s = chunk_rule(*x, rule="efla", initial_state=h0, resets=torch.zeros(B, T, dtype=torch.bool), backend=backend)
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V) and o.dtype == torch.float32
    assert not o.abs().sum() and not s.abs().sum()
    (o.sum() + s.sum()).backward()
    state = torch.zeros(B, H, K, V)
    assert step_rule(*(t[:, 0] for t in x), state, rule="efla", backend=backend).shape == (B, H, V)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("rule", RULES)
def test_nan_initial_state_does_not_leak_through_a_reset_at_t0(rule, backend):
    """A sequence that starts an episode at t = 0 ignores its initial state, NaN or inf included (as step_rule)."""
    inp = random_inputs(2, 20, 2, 8, 4, rule=rule, generator=_gen(42))
    inp["resets"][:, 0] = torch.tensor([True, False])
    clean = _call(inp, rule, backend)
    h0 = inp["initial_state"].clone().requires_grad_()
    h0.data[0, 0, 0, 0], h0.data[0, 1] = float("nan"), float("inf")
    o, s = chunk_rule(inp["q"], inp["k"], inp["v"], inp["beta"], rule=rule, initial_state=h0, resets=inp["resets"],
                      backend=backend)
    assert torch.equal(o, clean[0]) and torch.equal(s, clean[1])
    (o.sum() + s.sum()).backward()
    assert torch.isfinite(h0.grad).all() and not h0.grad[0].any()
    state = h0.detach().clone()
    step_rule(*(inp[n][:, 0] for n in ("q", "k", "v", "beta")), state, rule=rule, resets=inp["resets"][:, 0],
              backend=backend)
    assert torch.isfinite(state).all()


@pytest.mark.parametrize("rule", RULES)
def test_non_finite_inputs_stay_in_their_episode(rule):
    """A NaN or inf in any input reaches neither the next episode (through a reset inside a chunk) nor the earlier
    steps of its own chunk, forward and backward: as in the step loop."""
    check_non_finite_stays_in_its_episode(rule, "torch", torch.float64, "cpu", 1e-10)


@pytest.mark.parametrize("chunk_size", [0, True, 2.5, "16"])
def test_a_chunk_size_that_is_not_a_whole_number_of_steps_is_refused(chunk_size):
    inp = random_inputs(1, 5, 1, 4, 4, rule="efla", generator=_gen(43))
    with pytest.raises(ValueError, match=r"chunk_size must be an integer >= 1 \(or None\), got " + repr(chunk_size)):
        _call(inp, "efla", "torch", chunk_size=chunk_size)
