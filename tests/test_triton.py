"""The Triton kernels against the float64 oracle.

Under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it unless the variable is set outside) the kernels run in
the interpreter on CPU tensors, at tiny shapes. With ``TRITON_INTERPRET=0`` and a GPU the same tests run the
compiled kernels on CUDA tensors; without a GPU they skip. This file never changes the variable nor reloads a
module: ``@triton.jit`` decides at import whether a kernel is interpreted, for every test file of the process.
``python -m rlseq.bench.gpu_check`` runs the same checks at RL shapes on a GPU.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from rlseq.bench.kernels import random_inputs, rel_err  # noqa: E402
from rlseq.kernels import chunk_rule, step_rule  # noqa: E402
from rlseq.kernels import triton_chunk, triton_ops  # noqa: E402
from rlseq.kernels.rules import unit_key_scales  # noqa: E402
from rlseq.kernels.triton_core import gate_bwd, gate_fwd, key_norm  # noqa: E402
from tests.helpers import check_non_finite_stays_in_its_episode  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET and not type(triton_chunk.chunk_fwd_kernel).__name__.startswith("Interpreted"):
    pytest.skip("TRITON_INTERPRET=1 was set after triton compiled our kernels in this process; run this file in a "
                "process where the variable is set before anything imports triton", allow_module_level=True)
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is not 1 and there is no GPU: the kernels cannot run here", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

FIELDS = ("q", "k", "v", "beta", "initial_state")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(B, T, H, K, V, rule, seed, *, zero_keys=True, **kw):
    inp = random_inputs(B, T, H, K, V, rule=rule, generator=_gen(seed), **kw)
    if zero_keys:  # exactly-zero keys and β = 0 at a few places
        inp["k"][0, 1, 0] = 0.0
        inp["k"][-1, T - 1, -1] = 0.0
        inp["beta"][0, 2, -1] = 0.0
    return inp


def _run(inp, rule, backend, dtype, *, grads, with_h0=True, with_resets=True, config=None):
    """Forward (and backward with fixed random cotangents) of one backend; returns (o, s, grads) on the CPU."""
    dev = DEVICE if backend == "triton" else "cpu"
    x = {n: inp[n].to(dev, dtype) for n in ("q", "k", "v", "beta")}
    x["initial_state"] = inp["initial_state"].to(dev, torch.float64 if dtype == torch.float64 else torch.float32)
    if grads:
        x = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    kw = dict(rule=rule, initial_state=x["initial_state"] if with_h0 else None,
              resets=inp["resets"].to(dev) if with_resets else None)
    if backend == "triton":
        o, s = triton_ops.chunk_triton(x["q"], x["k"], x["v"], x["beta"], config=config, **kw)
    else:
        o, s = chunk_rule(x["q"], x["k"], x["v"], x["beta"], backend=backend, **kw)
    if not grads:
        return o.cpu(), s.cpu(), None
    g = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64).to(dev)
    ds = torch.randn(s.shape, generator=g, dtype=torch.float64).to(dev)
    ((o.double() * do).sum() + (s.double() * ds).sum()).backward()
    used = FIELDS if with_h0 else FIELDS[:4]
    return o.cpu(), s.cpu(), {n: x[n].grad.cpu() for n in used}


def _check(inp, rule, dtype, *, grads=True, tol=None, **kw):
    # oracle: the float64 step loop on the inputs as the kernel sees them (rounded to dtype)
    rounded = {n: (t.to(dtype).double() if t.is_floating_point() and n != "initial_state" else t) for n, t in inp.items()}
    o_r, s_r, g_r = _run(rounded, rule, "reference", torch.float64, grads=grads,
                         **{k: v for k, v in kw.items() if k != "config"})
    o, s, g = _run(inp, rule, "triton", dtype, grads=grads, **kw)
    assert o.dtype == dtype and s.dtype == torch.float32
    errs = {"o": rel_err(o, o_r), "state": rel_err(s, s_r)}
    if grads:
        for n in g_r:
            assert g[n].dtype == (torch.float32 if n == "initial_state" else dtype), n
            errs["d" + n] = rel_err(g[n], g_r[n])
    tol = TOL[dtype] if tol is None else tol
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{rule} {dtype}: {bad} (tol {tol}; all {errs})"


# --- the gate: the in-kernel twin of rules.unit_key_scales ------------------------------------------------------


@triton.jit
def _gate_kernel(k, beta, dkh, dg, dsv, g_out, s_out, n_out, dk_out, db_out, K: tl.constexpr, C: tl.constexpr):
    rc = tl.arange(0, C)
    off = rc[:, None] * K + tl.arange(0, K)[None, :]
    k_c = tl.load(k + off)
    b_c = tl.load(beta + rc)
    n0 = key_norm(k_c, 1)
    g, s, n = gate_fwd(n0, b_c, True)
    dk, db = gate_bwd(k_c / n[:, None], b_c, n0, tl.load(dkh + off), tl.load(dg + rc), tl.load(dsv + rc), True)
    tl.store(g_out + rc, g)
    tl.store(s_out + rc, s)
    tl.store(n_out + rc, n)
    tl.store(dk_out + off, dk)
    tl.store(db_out + rc, db)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter: x = βn² = inf, on purpose
def test_triton_gate_matches_the_torch_gate_and_its_autograd():
    """gate_fwd/gate_bwd against unit_key_scales (float64, autograd) over key norms 0 and 1e-14..1e30 (‖k‖² overflows
    fp32 from ~1.8e19), β from 0 to 2 and βλ on both sides of φ's Taylor switch."""
    C, K = 64, 16
    g = _gen(0)
    norms = torch.cat([torch.zeros(1), torch.logspace(-14, 30, C - 9, dtype=torch.float64),
                       torch.tensor([0.3, 0.31, 0.32, 0.5, 1, 2, 3, 1e19])]).double()
    k = torch.nn.functional.normalize(torch.randn(C, K, generator=g, dtype=torch.float64), dim=-1) * norms[:C, None]
    beta = 2 * torch.rand(C, generator=g, dtype=torch.float64)
    beta[0], beta[-8:-4] = 0.0, 0.099 / norms[-8:-4] ** 2 * torch.tensor([1.0, 0.98, 1.04, 1.1], dtype=torch.float64)
    dkh, dg, dsv = torch.randn(C, K, generator=g), torch.randn(C, generator=g), torch.randn(C, generator=g)
    k32, b32 = k.float(), beta.float()  # the kernel sees fp32: compare on those values
    kd, bd = k32.double().requires_grad_(), b32.double().requires_grad_()
    c, g_ref, s_ref = unit_key_scales(kd, bd, "efla")
    ((c.unsqueeze(-1) * kd * dkh.double()).sum() + (g_ref * dg.double()).sum() + (s_ref * dsv.double()).sum()).backward()
    outs = [torch.empty(C, device=DEVICE) for _ in range(3)] + [torch.empty(C, K, device=DEVICE), torch.empty(C, device=DEVICE)]
    _gate_kernel[(1,)](*(x.to(DEVICE) for x in (k32, b32, dkh, dg, dsv)), *outs, K=K, C=C)
    g_t, s_t, n_t, dk_t, db_t = (x.cpu().double() for x in outs)
    for name, got, ref in (("g", g_t, g_ref), ("s", s_t, s_ref), ("n", n_t, 1 / c), ("dk", dk_t, kd.grad),
                           ("dbeta", db_t, bd.grad)):
        assert torch.isfinite(got).all(), name
        scale = ref.detach().abs() if got.dim() == 1 else ref.detach().norm(dim=-1, keepdim=True)
        err = ((got - ref.detach()).abs() / scale.clamp_min(1e-300)).max().item()
        assert err < 2e-5, (name, err)


# --- chunk kernel: forward and backward ---------------------------------------------------------------------


SHAPES = [  # (B, T, H, K, V): K ≠ V, T not a multiple of the chunk size, head dims 16/32
    (2, 37, 1, 16, 32),
    (1, 40, 2, 32, 16),
]


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
def test_chunk_fp32_forward_backward(rule, shape):
    _check(_inputs(*shape, rule, seed=sum(shape)), rule, torch.float32)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_head_dim_64(rule):
    _check(_inputs(1, 35, 1, 64, 64, rule, seed=7), rule, torch.float32)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_bf16(rule):
    _check(_inputs(2, 24, 1, 16, 16, rule, seed=11), rule, torch.bfloat16)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_without_initial_state_or_resets(rule):
    _check(_inputs(1, 21, 2, 16, 32, rule, seed=5), rule, torch.float32, with_h0=False, with_resets=False)


def test_chunk_extreme_key_norms_every_row():
    """EFLA raw keys at 1e-4 and 1e4 on alternate steps (plus zeros), β up to 2: finite and accurate."""
    inp = _inputs(1, 33, 1, 16, 16, "efla", seed=3)
    scale = torch.tensor([1e-4, 1e4], dtype=torch.float64).repeat(17)[:33].view(1, 33, 1, 1)
    inp["k"] = torch.nn.functional.normalize(inp["k"], dim=-1) * scale
    inp["k"][0, 5] = 0.0
    _check(inp, "efla", torch.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter: x = βn² = inf, on purpose
def test_chunk_and_step_key_norms_up_to_1e30():
    """‖k‖² overflows fp32 above ~1.8e19; the gate must not: outputs, state and gradients finite and equal to the
    float64 oracle for key norms spread over 1e-4..1e30."""
    inp = _inputs(2, 37, 1, 16, 16, "efla", seed=13, key_norms=(1e-4, 1e30))
    inp["k"][0, 7] *= 1e30 / inp["k"][0, 7].norm()
    _check(inp, "efla", torch.float32)
    state = inp["initial_state"].float().to(DEVICE)
    s_ref = inp["initial_state"].clone()
    for t in range(4):
        x = [inp[n][:, t] for n in ("q", "k", "v", "beta")]
        o_ref = step_rule(*x, s_ref, rule="efla", resets=inp["resets"][:, t], backend="reference")
        o = step_rule(*(a.float().to(DEVICE) for a in x), state, rule="efla", resets=inp["resets"][:, t].to(DEVICE),
                      backend="triton")
        assert rel_err(o.cpu(), o_ref) < 1e-5 and rel_err(state.cpu(), s_ref) < 1e-5


def test_chunk_repeated_keys_are_stable():
    """Identical unit keys with gates near 1 make the Neumann/product inverse cancel catastrophically;
    forward substitution must not."""
    inp = _inputs(1, 32, 1, 16, 16, "efla", seed=9, zero_keys=False)
    inp["k"] = (inp["k"][:, :1] / inp["k"][:, :1].norm(dim=-1, keepdim=True) * 30.0).expand_as(inp["k"]).clone()
    inp["resets"][:] = False
    _check(inp, "efla", torch.float32)


# --- the launch table's V blocks (block_v for both walks, kside_block_v for the K side) -------------------------

SMALL_TILES = dict(block_v=16, kside_block_v=16)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_v_blocks_and_k_side_tiles(rule):
    """V=48 in blocks of 16 (the V side's partials of D dSᵀ summed on the K side, which takes V in 3 tiles), K=24:
    neither a power of two, resets, zero keys, T not a multiple of the chunk; gradients against the oracle."""
    _check(_inputs(2, 37, 1, 24, 48, rule, seed=31), rule, torch.float32, config=SMALL_TILES)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_one_v_block_equals_two(rule):
    """The large-batch layout (one V block, B·H ≥ 256) and the small-batch one (two) agree to fp32 rounding."""
    inp = _inputs(1, 33, 2, 16, 32, rule, seed=41)
    one = _run(inp, rule, "triton", torch.float32, grads=True, config=dict(block_v=32, kside_block_v=64))
    two = _run(inp, rule, "triton", torch.float32, grads=True, config=SMALL_TILES)
    assert rel_err(two[0], one[0]) < 1e-6 and rel_err(two[1], one[1]) < 1e-6
    for n in one[2]:
        assert rel_err(two[2][n], one[2][n]) < 1e-6, n


def test_chunk_v_blocks_bf16_and_no_state():
    _check(_inputs(1, 20, 1, 16, 32, "efla", seed=43), "efla", torch.bfloat16, config=SMALL_TILES)
    _check(_inputs(1, 20, 1, 16, 32, "deltanet", seed=61), "deltanet", torch.float32, with_h0=False,
           with_resets=False, config=SMALL_TILES)


@pytest.mark.parametrize("prec", ["tf32x3", "tf32"])
def test_chunk_dot_precision_reaches_every_kernel(prec):
    """The interpreter computes every tl.dot in fp32 whatever input_precision says: there this checks the plumbing.
    On a GPU single-pass TF32 dots (10-bit mantissas) are held to the bf16 tolerance; ``python -m rlseq.bench
    gpu-check`` checks the precision of the shipped launch table."""
    tol = TOL[torch.bfloat16] if prec == "tf32" and not INTERPRET else None
    _check(_inputs(1, 20, 1, 16, 32, "efla", seed=53), "efla", torch.float32, tol=tol,
           config=dict(prec=prec, block_v=16))


def test_launch_table():
    """Dot precision by head dim and input dtype; V blocks by batch; the K side's tile by head dim."""
    lc = triton_chunk.launch_config
    for K, V in ((64, 64), (128, 128), (64, 128)):
        assert lc(K, V, 8, 4)["prec"] == "tf32x3"
        for dt in (torch.bfloat16, torch.float16):
            assert lc(K, V, 8, 4, dt)["prec"] == "tf32"
    assert lc(32, 32, 8, 4, torch.bfloat16)["prec"] == "tf32x3"
    assert lc(16, 16, 8, 4, torch.bfloat16)["prec"] == "ieee"
    assert (lc(64, 64, 8, 4)["block_v"], lc(64, 64, 64, 4)["block_v"], lc(128, 128, 64, 4)["block_v"]) == (32, 64, 32)
    assert (lc(64, 64, 8, 4)["kside_block_v"], lc(128, 128, 8, 4)["kside_block_v"]) == (64, 32)


def test_chunk_config_validation():
    x = torch.zeros(1, 4, 1, 16, device=DEVICE)
    for bad in (dict(prec="fp32"), dict(block_v=24), dict(kside_block_v=8), dict(chunk_size=32), dict(num_warps=4)):
        with pytest.raises(ValueError):
            triton_ops.chunk_triton(x, x, x, x[..., 0], rule="efla", config=bad)


def test_chunk_rule_refuses_a_chunk_size_the_kernels_do_not_run():
    inp = _inputs(1, 18, 1, 16, 16, "efla", seed=4)
    x = [inp[n].float().to(DEVICE) for n in ("q", "k", "v", "beta")]
    with pytest.raises(ValueError, match="the triton backend runs chunks of 16 only, got chunk_size=32"):
        chunk_rule(*x, rule="efla", backend="triton", chunk_size=32)
    o16, _ = chunk_rule(*x, rule="efla", backend="triton", chunk_size=16)
    o, _ = chunk_rule(*x, rule="efla", backend="triton")
    assert torch.equal(o16, o)


def test_chunk_api_dispatch_and_no_grad_path():
    inp = _inputs(1, 18, 1, 16, 16, "efla", seed=4)
    x = {n: inp[n].float().to(DEVICE) for n in FIELDS}
    with torch.no_grad():
        o, s = chunk_rule(x["q"], x["k"], x["v"], x["beta"], rule="efla", initial_state=x["initial_state"],
                          resets=inp["resets"].to(DEVICE), backend="triton")
    o_r, s_r = chunk_rule(inp["q"], inp["k"], inp["v"], inp["beta"], rule="efla", initial_state=inp["initial_state"],
                          resets=inp["resets"], backend="reference")
    assert rel_err(o.cpu(), o_r) < 1e-5 and rel_err(s.cpu(), s_r) < 1e-5


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_negative_beta_is_refused(rule):
    inp = _inputs(2, 5, 1, 16, 16, rule, seed=2)
    x = [inp[n].float().to(DEVICE) for n in ("q", "k", "v", "beta")]
    x[3][1, 2, 0] = -0.5
    with pytest.raises(ValueError, match="beta must be >= 0"):
        chunk_rule(*x, rule=rule, backend="triton")
    state = torch.zeros(2, 1, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        step_rule(*(t[:, 2] for t in x), state, rule=rule, backend="triton")


@pytest.mark.parametrize("shape", [(0, 5, 2, 16, 8), (2, 5, 0, 16, 8), (2, 5, 2, 0, 8), (2, 5, 2, 16, 0)],
                         ids=["B0", "H0", "K0", "V0"])
def test_empty_inputs_give_empty_results(shape):
    B, T, H, K, V = shape
    x = [torch.randn(B, T, H, K, device=DEVICE), torch.randn(B, T, H, K, device=DEVICE),
         torch.randn(B, T, H, V, device=DEVICE), torch.rand(B, T, H, device=DEVICE)]
    o, s = chunk_rule(*x, rule="efla", backend="triton")
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V) and not o.abs().sum() and not s.abs().sum()
    state = torch.zeros(B, H, K, V, device=DEVICE)
    assert step_rule(*(t[:, 0] for t in x), state, rule="efla", backend="triton").shape == (B, H, V)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_nan_initial_state_does_not_leak_through_a_reset_at_t0(rule):
    inp = _inputs(2, 20, 1, 16, 16, rule, seed=6)
    inp["resets"][:, 0] = torch.tensor([True, False])
    x = {n: inp[n].float().to(DEVICE) for n in FIELDS}
    r = inp["resets"].to(DEVICE)
    clean = chunk_rule(x["q"], x["k"], x["v"], x["beta"], rule=rule, initial_state=x["initial_state"], resets=r,
                       backend="triton")
    x["initial_state"][0] = float("nan")
    o, s = chunk_rule(x["q"], x["k"], x["v"], x["beta"], rule=rule, initial_state=x["initial_state"], resets=r,
                      backend="triton")
    assert torch.equal(o, clean[0]) and torch.equal(s, clean[1])


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_non_finite_inputs_stay_in_their_episode(rule):
    """NaN and inf in every input, before resets inside a chunk and across a chunk boundary: the kernels' outputs,
    final state and gradients as the float64 step loop's (tests/helpers.py)."""
    check_non_finite_stays_in_its_episode(rule, "triton", torch.float32, DEVICE, TOL[torch.float32])


# --- step kernel ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
@pytest.mark.parametrize("KV", [(16, 32), (64, 16)], ids=lambda s: "K{}V{}".format(*s))
def test_step_matches_oracle_over_several_steps(rule, KV):
    K, V = KV
    B, T, H = 3, 6, 2
    inp = _inputs(B, T, H, K, V, rule, seed=K + V)
    resets = torch.rand(B, T, generator=_gen(1)) < 0.3
    resets[0, 0] = resets[1, 2] = resets[1, 3] = True
    s_ref = inp["initial_state"].clone()
    s_tri = inp["initial_state"].float().to(DEVICE)
    out = torch.empty(B, H, V, device=DEVICE)
    for t in range(T):
        args = [inp[n][:, t] for n in ("q", "k", "v", "beta")]
        o_ref = step_rule(*args, s_ref, rule=rule, resets=resets[:, t], backend="reference")
        a32 = [a.float().to(DEVICE) for a in args]
        if t % 2:
            o = step_rule(*a32, s_tri, rule=rule, resets=resets[:, t].to(DEVICE), backend="triton")
        else:  # the graph-friendly form: caller-owned output buffer
            o = triton_ops.step_triton(*a32, s_tri, rule=rule, resets=resets[:, t].to(DEVICE), out=out)
            assert o is out
        assert o.dtype == torch.float32
        assert rel_err(o.cpu(), o_ref) < 1e-5, (t, rel_err(o.cpu(), o_ref))
        assert rel_err(s_tri.cpu(), s_ref) < 1e-5, (t, rel_err(s_tri.cpu(), s_ref))


def test_step_agrees_with_chunk_kernel():
    inp = _inputs(2, 5, 1, 32, 32, "efla", seed=21)
    x = {n: inp[n].float().to(DEVICE) for n in FIELDS}
    r = inp["resets"].to(DEVICE)
    with torch.no_grad():
        o_c, s_c = triton_ops.chunk_triton(x["q"], x["k"], x["v"], x["beta"], rule="efla",
                                           initial_state=x["initial_state"], resets=r)
    s = x["initial_state"].clone()
    for t in range(5):
        o = triton_ops.step_triton(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["beta"][:, t], s, rule="efla",
                                   resets=r[:, t])
        assert rel_err(o.cpu(), o_c[:, t].cpu()) < 1e-5
    assert rel_err(s.cpu(), s_c.cpu()) < 1e-5


def test_gpu_check_runs_its_checks():
    """``python -m rlseq.bench gpu-check``'s checks, on this device at a tiny shape: they run and pass."""
    from rlseq.bench.gpu_check import check_chunk, check_step

    errs = check_chunk(2, 20, 1, 16, "efla", torch.float32, DEVICE)
    assert set(errs) == {"o", "S", "dq", "dk", "dv", "dbeta", "dinitial_state"} and max(errs.values()) < 1e-4, errs
    errs = check_chunk(2, 20, 1, 16, "efla", torch.float32, DEVICE, V=8)  # K ≠ V, as EFLA's default 64 × 32
    assert max(errs.values()) < 1e-4, errs
    assert check_step("deltanet", 16, 16, DEVICE, B=3, H=1, T=4) < 1e-4
    from rlseq.bench.gpu_check import check_scan, head_sizes

    errs = check_scan("lstm", 3, 6, 20, DEVICE)
    assert set(errs) == {"y", "final0", "final1", "dgates_x", "dw_hh", "db_hh", "dpart0", "dpart1"}, errs
    assert max(errs.values()) < 1e-4, errs

    assert head_sizes("64") == (64, 64) and head_sizes("64x32") == (64, 32)
    with pytest.raises(argparse.ArgumentTypeError, match="a head size is K or KxV"):
        head_sizes("64y32")


def test_this_file_leaves_triton_interpret_and_the_kernels_alone():
    """Collected in a process run with TRITON_INTERPRET=0, this file must neither change the variable nor turn the
    compiled kernels other test files use into interpreted ones (it once did both, and CUDA graph capture in
    tests/test_acting.py then failed on a GPU host)."""
    import subprocess
    import sys

    code = ("import os, pytest; rc = pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', "
            "'tests/test_triton.py']); import rlseq.kernels.triton_chunk as tc; "
            "assert os.environ['TRITON_INTERPRET'] == '0', os.environ['TRITON_INTERPRET']; "
            "assert not type(tc.chunk_fwd_kernel).__name__.startswith('Interpreted')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
