"""The Triton kernels under the interpreter (TRITON_INTERPRET=1) on CPU tensors, against the float64 oracle.

The variable is set here and in tests/conftest.py, before triton is imported (``@triton.jit``, triton's
own ``tl.sum`` included, decides at decoration time whether a function is interpreted); if our kernel
modules were imported first without it, they are reloaded. Shapes are tiny: the interpreter is slow. The same checks run on the GPU through
``python -m rlseq.bench.gpu_check``, which also varies num_warps/num_stages to catch miscompiles.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")


def _load_kernels():
    if not type(triton.language.sum).__name__.startswith("Interpreted"):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on the CPU in this "
            "process; tests/conftest.py sets it first, keep it (or run this file alone)")
    names = ("rlseq.kernels.triton_core", "rlseq.kernels.triton_chunk", "rlseq.kernels.triton_step", "rlseq.kernels.triton_ops")
    core = sys.modules.get(names[0])
    if core is not None and not type(core.tril_inverse).__name__.startswith("Interpreted"):
        for n in names:  # imported earlier without the interpreter: rebuild the kernels interpreted
            if n in sys.modules:
                importlib.reload(sys.modules[n])
    for n in names:
        importlib.import_module(n)
    return sys.modules[names[-1]]


triton_ops = _load_kernels()

from rlseq.kernels import chunk_rule, step_rule  # noqa: E402
from tests.helpers import random_inputs, rel_err  # noqa: E402

FIELDS = ("q", "k", "v", "beta", "initial_state")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(B, T, H, K, V, rule, seed, *, zero_keys=True):
    inp = random_inputs(B, T, H, K, V, rule=rule, generator=_gen(seed))
    if zero_keys:  # exactly-zero keys and β = 0 at a few places
        inp["k"][0, 1, 0] = 0.0
        inp["k"][-1, T - 1, -1] = 0.0
        inp["beta"][0, 2, -1] = 0.0
    return inp


def _run(inp, rule, backend, dtype, *, grads, with_h0=True, with_resets=True, config=None):
    """Forward (and backward with fixed random cotangents) of one backend; returns (o, s, grads)."""
    x = {n: inp[n].to(dtype) for n in ("q", "k", "v", "beta")}
    x["initial_state"] = inp["initial_state"].to(torch.float64 if dtype == torch.float64 else torch.float32)
    if grads:
        x = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    kw = dict(rule=rule, initial_state=x["initial_state"] if with_h0 else None,
              resets=inp["resets"] if with_resets else None)
    if backend == "triton":
        o, s = triton_ops.chunk_triton(x["q"], x["k"], x["v"], x["beta"], config=config, **kw)
    else:
        o, s = chunk_rule(x["q"], x["k"], x["v"], x["beta"], backend=backend, **kw)
    if not grads:
        return o, s, None
    g = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64)
    ds = torch.randn(s.shape, generator=g, dtype=torch.float64)
    ((o.double() * do).sum() + (s.double() * ds).sum()).backward()
    used = FIELDS if with_h0 else FIELDS[:4]
    return o, s, {n: x[n].grad for n in used}


def _check(inp, rule, dtype, *, grads=True, **kw):
    # oracle: the float64 step loop on the inputs as the kernel sees them (rounded to dtype)
    rounded = {n: (t.to(dtype).double() if t.is_floating_point() and n != "initial_state" else t) for n, t in inp.items()}
    o_r, s_r, g_r = _run(rounded, rule, "reference", torch.float64, grads=grads, **{k: v for k, v in kw.items() if k != "config"})
    o, s, g = _run(inp, rule, "triton", dtype, grads=grads, **kw)
    assert o.dtype == dtype and s.dtype == torch.float32
    tol = TOL[dtype]
    errs = {"o": rel_err(o, o_r), "state": rel_err(s, s_r)}
    if grads:
        for n in g_r:
            assert g[n].dtype == (torch.float32 if n == "initial_state" else dtype), n
            errs["d" + n] = rel_err(g[n], g_r[n])
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{rule} {dtype}: {bad} (tol {tol}; all {errs})"


# --- chunk kernel: forward and backward ---------------------------------------------------------------

SHAPES = [  # (B, T, H, K, V): K ≠ V, T not a multiple of the chunk size, head dims 16/32/64
    (2, 37, 1, 16, 32),
    (1, 40, 2, 32, 16),
]


# the default (prep kernel, split backward) and the fused kernel of one launch per direction (v5's default below D64)
PATHS = {"default": None, "fused-inline": dict(bwd="fused", mode="inline", chunk_size=32, num_stages=1)}


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("path", PATHS)
def test_chunk_fp32_forward_backward(rule, shape, path):
    _check(_inputs(*shape, rule, seed=hash(shape) % 1000), rule, torch.float32, config=PATHS[path])


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_head_dim_64_chunk_16_and_prep_mode(rule):
    inp = _inputs(1, 35, 1, 64, 64, rule, seed=7)
    _check(inp, rule, torch.float32, config=dict(chunk_size=16, mode="prep"))


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_bf16(rule):
    _check(_inputs(2, 24, 1, 16, 16, rule, seed=11), rule, torch.bfloat16)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_without_initial_state_or_resets(rule):
    inp = _inputs(1, 21, 2, 16, 32, rule, seed=5)
    _check(inp, rule, torch.float32, with_h0=False, with_resets=False)


def test_chunk_extreme_key_norms_every_row():
    """EFLA raw keys at 1e-4 and 1e4 on alternate steps (plus zeros), β up to 2: finite and accurate."""
    inp = _inputs(1, 33, 1, 16, 16, "efla", seed=3)
    scale = torch.tensor([1e-4, 1e4], dtype=torch.float64).repeat(17)[:33].view(1, 33, 1, 1)
    inp["k"] = torch.nn.functional.normalize(inp["k"], dim=-1) * scale
    inp["k"][0, 5] = 0.0
    _check(inp, "efla", torch.float32)


def test_chunk_repeated_keys_are_stable():
    """Identical unit keys with gates near 1 make the Neumann/product inverse cancel catastrophically;
    forward substitution must not."""
    inp = _inputs(1, 32, 1, 16, 16, "efla", seed=9, zero_keys=False)
    inp["k"] = (inp["k"][:, :1] / inp["k"][:, :1].norm(dim=-1, keepdim=True) * 30.0).expand_as(inp["k"]).clone()
    inp["resets"][:] = False
    _check(inp, "efla", torch.float32)


# --- V split into blocks (config["block_v"]): per-block forward, partial dq/dk/dβ summed over blocks ------


# both backwards: the fused one sums per-block partials of dq, dk, dβ; the split one's V side blocks its walk
BWDS = ["split", "fused"]


@pytest.mark.parametrize("bwd", BWDS)
@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_v_blocks_partial_last_block(rule, bwd):
    """K ≠ V, neither a power of two: V=48 in blocks of 16 → 4 blocks over a padded 64, the last one empty;
    resets, zero keys, initial state, T not a multiple of the chunk; gradients against the float64 oracle."""
    _check(_inputs(2, 37, 1, 24, 48, rule, seed=31), rule, torch.float32,
           config=dict(chunk_size=16, block_v=16, bwd=bwd))


@pytest.mark.parametrize("bwd", BWDS)
@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_two_v_blocks_match_one_block(rule, bwd):
    """V=32 with block_v=16 (2 blocks) equals the single-block kernel to fp32 rounding, and both the oracle."""
    inp = _inputs(1, 33, 2, 16, 32, rule, seed=41)
    _check(inp, rule, torch.float32, config=dict(block_v=16, bwd=bwd))
    one = _run(inp, rule, "triton", torch.float32, grads=True, config=dict(block_v=None, bwd=bwd))
    two = _run(inp, rule, "triton", torch.float32, grads=True, config=dict(block_v=16, bwd=bwd))
    assert rel_err(two[0], one[0]) < 1e-6 and rel_err(two[1], one[1]) < 1e-6
    for n in one[2]:
        assert rel_err(two[2][n], one[2][n]) < 1e-6, n


@pytest.mark.parametrize("bwd", BWDS)
def test_chunk_v_blocks_bf16_and_no_state(bwd):
    """The reduction path with bf16 inputs (partials in fp32, one cast) and without h0/resets."""
    inp = _inputs(1, 20, 1, 16, 32, "efla", seed=43)
    _check(inp, "efla", torch.bfloat16, config=dict(block_v=16, bwd=bwd))
    _check(inp, "efla", torch.float32, with_h0=False, with_resets=False,
           config=dict(block_v=16, chunk_size=32, bwd=bwd))


def test_chunk_block_v_validation():
    from rlseq.kernels.triton_chunk import _block_v

    assert _block_v(dict(block_v=None), 48) == 64 and _block_v(dict(block_v=128), 64) == 64
    assert _block_v(dict(block_v=16), 64) == 16
    with pytest.raises(ValueError):
        _block_v(dict(block_v=24), 64)


# --- split backward (config["bwd"] = "split") and the dot precision knob (config["prec"]) ----------------------
# The interpreter computes every tl.dot in fp32 whatever input_precision says: these tests check the plumbing and
# the split backward's math; the precision itself is checked on the GPU (python -m rlseq.bench.gpu_check --candidates).

SPLIT = dict(bwd="split", mode="prep", block_v=16, kside_block_v=16)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_split_backward_v_blocks(rule):
    """V side in 3 blocks of 16 over V=48 (their partials of D dSᵀ summed on the K side), K side in 3 tiles of 16;
    K ≠ V, resets, zero keys, key norms 1e-4..1e4, T not a multiple of the chunk; every gradient against the
    float64 oracle."""
    _check(_inputs(2, 37, 1, 24, 48, rule, seed=31), rule, torch.float32, config=SPLIT)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_split_matches_fused(rule):
    """Split and fused backward agree to fp32 rounding; forward and backward V blocks chosen independently
    (forward one block of 32, V side blocks of 16, K side one tile) and prep mode with chunks of 32."""
    inp = _inputs(1, 45, 2, 16, 32, rule, seed=47)
    cfg = dict(bwd="split", block_v=None, block_v_bwd=16, kside_block_v=None, mode="prep", chunk_size=32,
               num_warps_bwd=2, kside_warps=2)
    _check(inp, rule, torch.float32, config=cfg)
    split = _run(inp, rule, "triton", torch.float32, grads=True, config=cfg)
    fused = _run(inp, rule, "triton", torch.float32, grads=True, config=dict(chunk_size=32, bwd="fused"))
    assert rel_err(split[0], fused[0]) < 1e-6 and rel_err(split[1], fused[1]) < 1e-6
    for n in fused[2]:
        assert rel_err(split[2][n], fused[2][n]) < 1e-6, n


@pytest.mark.parametrize("prec", ["tf32x3", "tf32"])
@pytest.mark.parametrize("bwd", ["fused", "split"])
def test_chunk_dot_precision_knob(prec, bwd):
    """Every precision reaches every kernel (prep, forward, both backwards; the K side's own ``kside_prec``) and
    gives a working kernel."""
    rule = "efla" if prec == "tf32x3" else "deltanet"
    _check(_inputs(1, 20, 1, 16, 32, rule, seed=53), rule, torch.float32,
           config=dict(bwd=bwd, prec=prec, block_v=16, mode="prep", kside_prec="tf32" if prec == "tf32x3" else "ieee"))


def test_chunk_split_head_dim_64_extreme_norms():
    """D64 in the split backward with the default V blocks; EFLA key norms alternating 1e-4 / 1e4 every row."""
    inp = _inputs(1, 35, 1, 64, 64, "efla", seed=59)
    scale = torch.tensor([1e-4, 1e4], dtype=torch.float64).repeat(18)[:35].view(1, 35, 1, 1)
    inp["k"] = torch.nn.functional.normalize(inp["k"], dim=-1) * scale
    _check(inp, "efla", torch.float32, config=dict(bwd="split", prec="tf32x3"))


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_chunk_d64_large_batch_config(rule):
    """The config the default picks for D64 at B64 H4 (one V block of 64 in both walks, the K side in one tile of
    64), run at a small batch (same compiled kernels: B is not a constexpr)."""
    from rlseq.kernels.triton_chunk import _block_v, default_config

    cfg = default_config(256, 64, 64, 64, 4)
    assert (_block_v(cfg, 64), _block_v(cfg, 64, "kside_block_v"), cfg["bwd"]) == (64, 64, "split")
    assert _block_v(default_config(256, 64, 64, 8, 4), 64) == 32  # small batches: two V blocks, more programs
    _check(_inputs(2, 35, 1, 64, 64, rule, seed=67), rule, torch.float32, config=cfg)


def test_chunk_split_bf16_and_no_state():
    """bf16 inputs (the kernels write dq, dk, dv, dβ in bf16 directly) and the path without h0 and resets."""
    _check(_inputs(1, 20, 1, 16, 32, "efla", seed=61), "efla", torch.bfloat16, config=SPLIT)
    _check(_inputs(1, 20, 1, 16, 32, "deltanet", seed=61), "deltanet", torch.float32, with_h0=False,
           with_resets=False, config=SPLIT)


def test_chunk_config_validation():
    from rlseq.kernels.triton_chunk import check_config, default_config

    base = default_config(64, 16, 16)
    for bad in (dict(prec="tf32x2"), dict(kside_prec="bf16"), dict(bwd="splt"), dict(mode="x"), dict(chunk_size=8), dict(kside_block_v=24),
                dict(block_v_bwd=8), dict(warps=4), dict(bwd="split", mode="inline"), dict(fwd_maxnreg=300),
                dict(kside_maxnreg=64.0)):
        with pytest.raises(ValueError):
            check_config(dict(base, **bad))
    assert check_config(dict(base, bwd="split", mode="prep", kside_maxnreg=168))["kside_maxnreg"] == 168
    x = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError):
        triton_ops.chunk_triton(x, x, x, x[..., 0], rule="efla", config=dict(prec="fp32"))


def test_default_dot_precision_follows_the_input_dtype():
    """fp32 inputs keep fp32-accurate dots (3xTF32 or FMA); bf16/fp16 inputs get one TF32 pass from D64 (the
    interpreter ignores input_precision: the GPU checks its accuracy, docs/benchmarks.md v4)."""
    from rlseq.kernels.triton_chunk import default_config

    for K, V in ((64, 64), (128, 128), (64, 128)):
        assert default_config(256, K, V, 8, 4)["prec"] == "tf32x3"
        for dt in (torch.bfloat16, torch.float16):
            assert default_config(256, K, V, 8, 4, dt)["prec"] == "tf32"
    assert default_config(256, 32, 32, 8, 4, torch.bfloat16)["prec"] == "tf32x3"
    assert default_config(256, 16, 16, 8, 4, torch.bfloat16)["prec"] == "ieee"  # D16: FMA dots, the faster


def test_chunk_api_dispatch_and_no_grad_path():
    inp = _inputs(1, 18, 1, 16, 16, "efla", seed=4)
    x = {n: inp[n].float() for n in FIELDS}
    with torch.no_grad():
        o, s = chunk_rule(x["q"], x["k"], x["v"], x["beta"], rule="efla", initial_state=x["initial_state"],
                          resets=inp["resets"], backend="triton")
    o_r, s_r = chunk_rule(inp["q"], inp["k"], inp["v"], inp["beta"], rule="efla", initial_state=inp["initial_state"],
                          resets=inp["resets"], backend="reference")
    assert rel_err(o, o_r) < 1e-5 and rel_err(s, s_r) < 1e-5


# --- step kernel ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
@pytest.mark.parametrize("KV", [(16, 32), (64, 16)], ids=lambda s: "K{}V{}".format(*s))
def test_step_matches_oracle_over_several_steps(rule, KV):
    K, V = KV
    B, T, H = 3, 6, 2
    inp = _inputs(B, T, H, K, V, rule, seed=K + V)
    resets = torch.rand(B, T, generator=_gen(1)) < 0.3
    resets[0, 0] = resets[1, 2] = resets[1, 3] = True
    s_ref = inp["initial_state"].clone()
    s_tri = inp["initial_state"].float().clone()
    out = torch.empty(B, H, V)
    for t in range(T):
        args = [inp[n][:, t] for n in ("q", "k", "v", "beta")]
        o_ref = step_rule(*args, s_ref, rule=rule, resets=resets[:, t], backend="reference")
        if t % 2:
            o = step_rule(*(a.float() for a in args), s_tri, rule=rule, resets=resets[:, t], backend="triton")
        else:  # the graph-friendly form: caller-owned output buffer
            o = triton_ops.step_triton(*(a.float() for a in args), s_tri, rule=rule, resets=resets[:, t], out=out)
            assert o is out
        assert o.dtype == torch.float32
        assert rel_err(o, o_ref) < 1e-5, (t, rel_err(o, o_ref))
        assert rel_err(s_tri, s_ref) < 1e-5, (t, rel_err(s_tri, s_ref))


def test_step_agrees_with_chunk_kernel():
    inp = _inputs(2, 5, 1, 32, 32, "efla", seed=21)
    x = {n: inp[n].float() for n in FIELDS}
    with torch.no_grad():
        o_c, s_c = triton_ops.chunk_triton(x["q"], x["k"], x["v"], x["beta"], rule="efla",
                                           initial_state=x["initial_state"], resets=inp["resets"])
    s = x["initial_state"].clone()
    for t in range(5):
        o = triton_ops.step_triton(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["beta"][:, t], s, rule="efla",
                                   resets=inp["resets"][:, t])
        assert rel_err(o, o_c[:, t]) < 1e-5
    assert rel_err(s, s_c) < 1e-5
