"""The memory layers (rlseq.policies.memory): interface, acting/training consistency, exact resets, diagnostics.

Consistency is the property PPO relies on: the outputs computed one ``step`` at a time while acting must equal
those the training path (``forward`` over the whole sequence from the stored state) recomputes, to 1e-5 in
fp32, over sequences with episode resets. Checked for every memory with the torch backend, and for the
delta-rule memories with the Triton kernels under ``TRITON_INTERPRET=1`` (set below before triton is imported,
as in tests/test_triton.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton kernel module is imported

import copy  # noqa: E402
import math  # noqa: E402
import importlib  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from rlseq.kernels.naive import naive_step  # noqa: E402
from rlseq.kernels.rnn import triton_scan_available  # noqa: E402
from rlseq.policies import (  # noqa: E402
    MEMORIES,
    DeltaNetMemory,
    EFLAMemory,
    LSTMMemory,
    Memory,
    MemoryStateError,
    NoMemory,
    make_memory,
)
from rlseq.policies.memory import JOINS, ActorCriticMemory, GRUMemory  # noqa: E402
from rlseq.policies.short_conv import ShortConv  # noqa: E402
from tests.helpers import read_norm_off_by_default  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-5
F_IN = 12

SMALL = {
    "efla": dict(n_heads=2, head_dim=16, value_dim=16, d_model=24),  # K = V here, K ≠ V in DeltaNet's
    "deltanet": dict(n_heads=2, head_dim=16, value_dim=8, d_model=20),
    "gru": dict(hidden_size=12, num_layers=2, d_model=16),
    "lstm": dict(hidden_size=20, num_layers=2, d_model=16),
    "none": dict(d_model=16),
}


def _triton_ready() -> bool:
    """Import the kernels interpreted (reloading them if something imported them compiled first)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    names = ("rlseq.kernels.triton_core", "rlseq.kernels.triton_chunk", "rlseq.kernels.triton_step", "rlseq.kernels.triton_ops")
    core = sys.modules.get(names[0])
    if core is not None and hasattr(core, "tril_inverse") and not type(core.tril_inverse).__name__.startswith("Interpreted"):
        for n in names:
            if n in sys.modules:
                importlib.reload(sys.modules[n])
    for n in names:
        importlib.import_module(n)
    return True


# (memory, backend): every memory on the torch backend; the delta-rule memories also through the Triton kernels
# (the LSTM and the identity call no kernel, so the backend does not apply to them).
CONSISTENCY_CASES = [pytest.param(name, "torch", {}, id=f"{name}-torch") for name in MEMORIES] + [
    pytest.param(name, "triton", {}, id=f"{name}-triton-interpret") for name in ("efla", "deltanet")
] + [  # the front end without a window (the controls) and a wider one
    pytest.param(name, "torch", dict(conv_size=w), id=f"{name}-torch-conv{w}") for name, w in
    (("none", 1), ("efla", 1), ("gru", 1), ("lstm", 6), ("deltanet", 2))
] + [  # every other way the read joins the block, and the RNNs' orthogonal initialisation
    pytest.param(name, "torch", dict(join=join), id=f"{name}-torch-{join}") for name in MEMORIES
    for join in JOINS if join != "residual"
] + [
    pytest.param("gru", "torch", dict(recurrent_init="orthogonal"), id="gru-torch-orthogonal"),
    pytest.param("lstm", "torch", dict(recurrent_init="orthogonal", forget_bias=1.0), id="lstm-torch-orthogonal"),
] + [  # the delta-rule cores without their read norm, on both backends
    pytest.param(name, backend, dict(output_norm=False), id=f"{name}-{backend}-no-output-norm")
    for name in ("efla", "deltanet") for backend in ("torch", "triton")
] + [  # rotary positions, on both backends
    pytest.param(name, backend, dict(rotary_base=100.0), id=f"{name}-{backend}-rotary")
    for name in ("efla", "deltanet") for backend in ("torch", "triton")
]


def _memory(name: str, backend: str = "torch", seed: int = 0, **kw) -> Memory:
    """A small memory; ``backend`` is the delta-rule kernels' (the RNNs' scan backend is ``scan_backend``)."""
    torch.manual_seed(seed)
    extra = dict(SMALL[name])
    if name in ("efla", "deltanet"):
        extra["backend"] = backend
    if "scan_backend" in kw:
        extra["backend"] = kw.pop("scan_backend")
    extra.update(kw)
    return make_memory(name, F_IN, **extra)


def _sequence(B: int, T: int, seed: int = 1, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and resets with: a reset at t = 0, two consecutive resets, a reset at the last step, a sequence
    without any reset, and random ones."""
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(B, T, F_IN, generator=g)
    resets = torch.rand(B, T, generator=g) < 0.15
    resets[-1] = False  # one sequence carries its state through
    resets[0, 0] = True
    resets[0, T // 2 : T // 2 + 2] = True
    resets[1 % B, T - 1] = True
    return x, resets


def _random_state(m: Memory, B: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, *m.initial_state(1, "cpu").shape[1:], generator=g)


def _act(m: Memory, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acting path: one ``step`` per time step, state updated in place."""
    state = state.clone()
    with torch.no_grad():
        ys = [m.step(x[:, t], state, resets[:, t]) for t in range(x.shape[1])]
    return torch.stack(ys, 1), state


# -- interface ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MEMORIES)
def test_interface_shapes(name):
    m = _memory(name)
    B, T = 3, 7
    s = m.initial_state(B, "cpu")
    assert s.dtype == torch.float32 and s.shape[0] == B and not s.any()
    window = 3 * m.d_model  # (W - 1) * d at the default width 4: every memory's front end
    # the delta-rule cores' matrices, each with its rotary position
    expected = {"efla": 2 * 16 * 16 + 1, "deltanet": 2 * 16 * 8 + 1, "gru": 1 * 2 * 12, "lstm": 2 * 2 * 20,
                "none": 0}[name]
    assert tuple(s.shape[1:]) == (expected + window,)
    core, win = m.state_parts(s)
    assert core.shape[1:] == m.core_state_shape and win.shape == (B, 3, m.d_model)
    x, r = _sequence(B, T)
    y, final = m(x, s, r)
    assert y.shape == (B, T, m.out_features) and final.shape == s.shape and final.dtype == torch.float32
    assert m.step(x[:, 0], s.clone(), r[:, 0]).shape == (B, m.out_features)
    assert m.in_features == F_IN
    assert isinstance(m, Memory)


def test_width_does_not_depend_on_the_input():
    for name in MEMORIES:
        assert make_memory(name, 2).out_features == make_memory(name, 300).out_features == 128
        assert make_memory(name, 10, d_model=32).out_features == 32
    assert isinstance(make_memory("EFLA", 4), EFLAMemory) and isinstance(make_memory("deltanet", 4), DeltaNetMemory)
    assert isinstance(make_memory("lstm", 4), LSTMMemory) and isinstance(make_memory("none", 4), NoMemory)
    assert isinstance(make_memory("gru", 4), GRUMemory)
    assert make_memory("efla", 4).head_dim == 64 and make_memory("efla", 4, d_model=256).head_dim == 128


def _core_parameters(m: Memory) -> int:
    return sum(p.numel() for n, p in m.named_parameters() if not n.startswith(SHARED))


SHARED = ("in_proj.", "conv.", "conv_norm.", "norm.")  # the block's parameters, the front end included


@pytest.mark.parametrize("d_model", [64, 128, 256])
def test_the_block_is_shared_and_the_cores_scale_with_its_width(d_model):
    """The block around the memory is identical for every memory; the default core widths scale with d_model
    (EFLA keys of d/2 and values of d/4 per head, DeltaNet both d/2, GRU and LSTM hidden 2d)."""
    shared = {name: sum(p.numel() for n, p in make_memory(name, 17, d_model=d_model).named_parameters()
                        if n.startswith(SHARED)) for name in MEMORIES}
    assert len(set(shared.values())) == 1, shared
    assert _core_parameters(make_memory("none", 17, d_model=d_model)) == 0
    for name, keys, values in (("efla", d_model // 2, d_model // 4), ("deltanet", d_model // 2, d_model // 2)):
        m = make_memory(name, 17, d_model=d_model)
        matrix, position = m.matrix_and_position(m.state_parts(m.initial_state(2))[0])
        assert (matrix.shape[1:], position.shape) == ((4, keys, values), (2,))
    # keys given alone: values keep the rule's ratio (EFLA's half, DeltaNet's whole)
    assert make_memory("efla", 17, head_dim=48).value_dim == 24 and make_memory("deltanet", 17, head_dim=48).value_dim == 48
    assert make_memory("gru", 17, d_model=d_model).core_state_shape == (1, 1, 2 * d_model)
    assert make_memory("lstm", 17, d_model=d_model).core_state_shape == (2, 1, 2 * d_model)


def test_the_docs_list_the_default_sizes():
    """docs/memory.md's table of core parameters and states is the code's (default width, F = 4)."""
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text()
    for name in MEMORIES:
        m = make_memory(name, 4)
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert int(cells[3].replace(",", "")) == _core_parameters(m), (name, cells[3])
        numbers = [int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*", cells[2])]
        assert sum(numbers) == m.state_shape[0], (name, cells[2])


def _join_definition(block: Memory, u: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The joins as documented (``rlseq.policies.memory.JOINS``), written out from the block's modules."""
    ln = (lambda z: z) if block.join == "prenorm" else (
        lambda z: F.layer_norm(z, z.shape[-1:], block.norm.weight, block.norm.bias, block.norm.eps))
    if m is None:
        return ln(u)
    return {"residual": lambda: ln(u + m),
            "gated": lambda: ln(u + torch.sigmoid(u @ block.gate.weight.T + block.gate.bias) * m),
            "prenorm": lambda: u + m,
            "read": lambda: ln(m)}[block.join]()


@pytest.mark.parametrize("join", JOINS)
@pytest.mark.parametrize("name", MEMORIES)
def test_each_join_is_its_definition(name, join):
    """``join`` changes how the read m meets the stream u and nothing else: the front end and the read are the
    default block's (same weights), the output is the join's formula, a gate exists only where there is a read
    to gate, and every parameter but the output norm's (absent under ``prenorm``) gets a gradient."""
    block, default = _memory(name, join=join), _memory(name)
    default_state = default.state_dict()
    # the same seed gives the same front end and core whatever the join (the gate draws from a stream of its own)
    assert all(torch.equal(v, default_state[k]) for k, v in block.state_dict().items() if k in default_state)
    x, r = _sequence(2, 9, scale=2.0)
    s = _random_state(block, 2)
    y = block(x, s, r)[0]
    h, u, _ = default.front(x, default.state_parts(s)[1], r)
    m = default._core(u, default.state_parts(s)[0], r, h=h)[0]
    torch.testing.assert_close(y, _join_definition(block, u, m), atol=1e-6, rtol=1e-6)
    assert hasattr(block, "gate") == (join == "gated" and name != "none")
    assert ("norm.weight" in dict(block.named_parameters())) == (join != "prenorm")
    if join != "residual" and name != "none":
        assert (y - default(x, s, r)[0]).abs().max() > 1e-3  # the join is not a no-op
    grads = torch.autograd.grad((y * torch.randn_like(y)).sum(), list(block.parameters()), allow_unused=True)
    missing = [n for (n, _), g in zip(block.named_parameters(), grads) if g is None or not g.abs().sum() > 0]
    assert missing == [], missing


def test_residual_the_former_name_of_join_still_builds_saved_models():
    """Models saved with ``memory_kwargs={"residual": False}`` load: it is ``join="read"``, with a warning."""
    with pytest.warns(DeprecationWarning, match="residual is now join"):
        assert make_memory("lstm", 4, residual=False).join == "read"
    with pytest.warns(DeprecationWarning):
        assert make_memory("efla", 4, residual=True).join == "residual"
    with pytest.raises(TypeError, match="residual and join given together"):
        make_memory("gru", 4, residual=False, join="read")


def test_an_unknown_join_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown join 'post'; valid joins: residual, gated, prenorm, read"):
        make_memory("gru", 4, join="post")


@pytest.mark.parametrize("name", ["gru", "lstm"])
def test_orthogonal_recurrent_init(name):
    """Every gate's recurrent matrix is orthogonal, biases zero but the LSTM's forget gate's, whose two biases
    sum to ``forget_bias``."""
    kw = {"forget_bias": 1.0} if name == "lstm" else {}
    m = make_memory(name, 5, d_model=32, recurrent_init="orthogonal", num_layers=2, **kw)
    H = m.hidden_size
    for layer in range(2):
        for gate in getattr(m.rnn, f"weight_hh_l{layer}").split(H):
            torch.testing.assert_close(gate @ gate.T, torch.eye(H), atol=1e-5, rtol=0)
        b = getattr(m.rnn, f"bias_ih_l{layer}") + getattr(m.rnn, f"bias_hh_l{layer}")
        if name == "lstm":
            assert torch.equal(b[H:2 * H], torch.ones(H)) and not b[:H].any() and not b[2 * H:].any()
        else:
            assert not b.any()
    default = make_memory(name, 5, d_model=32)
    assert default.rnn.bias_ih_l0.abs().max() > 0  # PyTorch's uniform init unless asked
    with pytest.raises(ValueError, match="valid: uniform, orthogonal"):
        make_memory(name, 5, recurrent_init="xavier")
    if name == "gru":
        with pytest.raises(TypeError, match="GRUMemory"):
            make_memory(name, 5, forget_bias=1.0)
    lstm = make_memory("lstm", 5, d_model=32, forget_bias=2.0)  # with the default init too
    assert torch.equal((lstm.rnn.bias_ih_l0 + lstm.rnn.bias_hh_l0)[lstm.hidden_size:2 * lstm.hidden_size],
                       torch.full((lstm.hidden_size,), 2.0))


@pytest.mark.parametrize("name", ["efla", "gru"])
def test_actor_critic_memory_is_two_memories_side_by_side(name):
    """Its output and state are the two memories' own, side by side, in training and in acting alike (with resets);
    a non-finite state is reported with the memory it is in."""
    torch.manual_seed(0)
    pair = ActorCriticMemory(name, F_IN, **SMALL[name])
    assert pair.out_features == 2 * pair.actor.out_features and pair.name == name
    B, T = 3, 11
    x, r = _sequence(B, T)
    s0 = _random_state(pair, B)
    y, final = pair(x, s0, r)
    actor_state, critic_state = pair.split(s0)
    ya, fa = pair.actor(x, actor_state, r)
    yc, fc = pair.critic(x, critic_state, r)
    torch.testing.assert_close(y, torch.cat([ya, yc], -1))
    torch.testing.assert_close(final, torch.cat([fa, fc], 1))
    assert not torch.allclose(ya, yc)  # independently initialised
    y_act, final_act = _act(pair, x, s0, r)
    torch.testing.assert_close(y_act, y, atol=TOL, rtol=TOL)
    torch.testing.assert_close(final_act, final, atol=TOL, rtol=TOL)
    bad = s0.clone()
    bad[1, -1] = float("nan")  # the critic's window
    with pytest.raises(MemoryStateError, match="the critic's memory"):
        pair.check_finite(bad, "here")
    pair.check_finite(s0, "here")


def test_make_memory_errors():
    with pytest.raises(ValueError, match="efla, deltanet, gru, lstm, none"):
        make_memory("transformer", 4)
    with pytest.raises(TypeError, match="GRUMemory"):
        make_memory("gru", 4, n_heads=2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="conv_size must be an integer >= 1"):
            make_memory("none", 4, conv_size=bad)


@pytest.mark.parametrize("name", MEMORIES)
def test_forward_leaves_state_alone_and_is_differentiable(name):
    m = _memory(name)
    x, r = _sequence(3, 9)
    s = _random_state(m, 3).requires_grad_(name != "none")
    before = s.detach().clone()
    x.requires_grad_(True)
    y, final = m(x, s, r)
    assert torch.equal(s.detach(), before)
    (y.square().mean() + final.square().mean()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for p_name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), p_name
    if name != "none":
        # sequence 0 resets at t = 0: its entering state must not matter; the last one never resets: it must
        assert s.grad[0].abs().max() == 0
        assert s.grad[-1].abs().max() > 0


# -- acting == training --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "backend", "kw"), CONSISTENCY_CASES)
def test_step_matches_forward(name, backend, kw):
    """Step-by-step acting and whole-sequence training give the same outputs and final state (fp32, 1e-5)."""
    if backend == "triton":
        assert _triton_ready(), "the Triton kernels must run here under TRITON_INTERPRET=1 (tests/conftest.py sets it)"
    m = _memory(name, backend, **kw)
    assert m.conv.kernel_size == kw.get("conv_size", 4)
    B, T = 3, 70 if backend == "torch" else 37  # crosses the chunk boundaries (torch 64, triton ≤ 64)
    x, r = _sequence(B, T, scale=3.0)
    s0 = _random_state(m, B)
    y_train, final_train = m(x, s0, r)
    y_act, final_act = _act(m, x, s0, r)
    torch.testing.assert_close(y_act, y_train.detach(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(final_act, final_train.detach(), atol=TOL, rtol=TOL)


# -- the short convolution against a float64 loop -------------------------------------------------------------


def _conv_loop(conv: ShortConv, x: torch.Tensor, window: torch.Tensor, resets: torch.Tensor):
    """float64 oracle: keep a list of the last W-1 inputs, empty it at every episode start, and evaluate the
    definition ``b + Σ_j w[:, j] x[t - (W-1) + j]`` one step at a time."""
    W = conv.kernel_size
    w, b = conv.weight.double(), conv.bias.double()
    B, T, C = x.shape
    ys, windows = [], []
    for i in range(B):
        past = [window[i, j].double() for j in range(W - 1)]
        out = []
        for t in range(T):
            if resets[i, t]:
                past = [torch.zeros(C, dtype=torch.float64) for _ in range(W - 1)]
            taps = past + [x[i, t].double()]
            pre = b + sum(w[:, j] * taps[j] for j in range(W))
            out.append(pre)
            past = taps[1:]
        ys.append(torch.stack(out))
        windows.append(torch.stack(past) if W > 1 else torch.zeros(0, C, dtype=torch.float64))
    return torch.stack(ys), torch.stack(windows)


@pytest.mark.parametrize("width", [1, 2, 4, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_short_conv_matches_loop_with_resets(width, seed):
    """Chunk form and step form of the convolution against the float64 loop: outputs, final windows and the
    gradients of a loss of both with respect to the inputs, the entering window, the weights and the bias."""
    torch.manual_seed(seed)
    conv = ShortConv(6, width)
    B, T = 4, 19
    x, _ = _sequence(B, T, seed=seed + 5)
    x = x[..., :6].clone().requires_grad_(True)
    resets = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < 0.25
    resets[0, 0] = resets[1, 3] = resets[1, 4] = True  # t = 0 and back to back
    resets[2] = False
    window = torch.randn(B, width - 1, 6).requires_grad_(True)
    y, new_window = conv(x, window, resets)
    y_ref, window_ref = _conv_loop(conv, x, window, resets)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new_window.double(), window_ref, atol=1e-6, rtol=1e-6)
    probe = torch.randn_like(y_ref)
    params = [x, window, conv.weight, conv.bias]
    grads = torch.autograd.grad((y * probe).sum() + new_window.square().sum(), params, allow_unused=True)
    grads_ref = torch.autograd.grad((y_ref * probe).sum() + window_ref.square().sum(), params, allow_unused=True)
    for p, g, g_ref in zip(params, grads, grads_ref):
        if p is window and width == 1:  # an empty window
            continue
        torch.testing.assert_close(g.double(), g_ref.double(), atol=1e-5, rtol=1e-5)
    # acting: one step at a time, the window updated in place
    w = window.detach().clone()
    with torch.no_grad():
        y_step = torch.stack([conv.step(x[:, t].detach(), w, resets[:, t]) for t in range(T)], 1)
    torch.testing.assert_close(y_step.double(), y_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w.double(), window_ref, atol=1e-6, rtol=1e-6)


# -- the delta-rule block against a float64 loop ------------------------------------------------------------


def _front_loop(m64, x: torch.Tensor, window: torch.Tensor, resets: torch.Tensor):
    """float64 oracle of the shared front end: ``u = LayerNorm(conv(LayerNorm(W_in x)))`` from the
    convolution's definition; returns ``(h, u, final window)``."""
    h = m64.in_proj(x.double())
    c, final_window = _conv_loop(m64.conv, h, window, resets)
    return h, m64.conv_norm(c), final_window


def _delta_block_loop(m64, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 oracle of the whole block (``m64``: a float64 copy of the module): the front end from its
    definition, the rule from rlseq.kernels' step-by-step reference, and an explicit zeroing of matrix and
    window at every episode start."""
    B, T, _ = x.shape
    H, K, V, W, d = m64.n_heads, m64.head_dim, m64.value_dim, m64.conv.kernel_size, m64.d_model
    # layout from the docs: the matrix [H, K, V] first, with rotary positions the next step's position, then the
    # window [W-1, d]
    flat, n_pos = state.double(), int(m64.rotary_base is not None)
    matrix = flat[:, : H * K * V].reshape(B, H, K, V).clone()
    position = flat[:, H * K * V].clone() if n_pos else None
    window = flat[:, H * K * V + n_pos :].reshape(B, W - 1, d).clone()
    h, u, final_window = _front_loop(m64, x, window, resets)
    # the heads from their definition: channels [q | k | v], head-major; unit queries; DeltaNet's unit keys;
    # β = sigmoid(w_β · h + b_β), h before the convolution; q, k, v = silu(W_qkv u)
    qkv = torch.nn.functional.silu(m64.qkv(u))
    q = qkv[..., : H * K].reshape(B, T, H, K)
    k = qkv[..., H * K : 2 * H * K].reshape(B, T, H, K)
    v = qkv[..., 2 * H * K :].reshape(B, T, H, V)
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # a norm floor of 1e-6, as the block defines it
    if m64.rule == "deltanet":
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    beta = torch.sigmoid(h @ m64.beta_proj.weight.t() + m64.beta_proj.bias)
    outs = []
    for t in range(T):
        matrix = matrix * (~resets[:, t]).double().view(B, 1, 1, 1)
        q_t, k_t = q[:, t], k[:, t]
        if position is not None:  # the step's position in its episode turns channel i with channel i + n, n = K//2
            position = torch.where(resets[:, t], 0.0, position)  # (an odd K's last channel stays as it is)
            n = K // 2
            omega = m64.rotary_max_freq * m64.rotary_base ** (-torch.arange(n, dtype=torch.float64) / max(n, 1))
            angle = (position[:, None] * omega)[:, None, :]
            c, s_ = angle.cos(), angle.sin()
            q_t, k_t = [torch.cat([z[..., :n] * c - z[..., n : 2 * n] * s_,
                                   z[..., :n] * s_ + z[..., n : 2 * n] * c, z[..., 2 * n :]], -1) for z in (q_t, k_t)]
            position = position + 1
        o, matrix = naive_step(q_t, k_t, v[:, t], beta[:, t], matrix, m64.rule)
        outs.append(o)
    o = torch.stack(outs, 1)
    if m64.out_norm is not None:  # RMS over each head's V entries (eps 1e-5), one learned scale shared by the heads
        o = o / (o.square().mean(-1, keepdim=True) + 1e-5).sqrt() * m64.out_norm.weight
    y = _join_definition(m64, u, m64.out_proj(o.flatten(-2)))
    parts = [matrix.flatten(1), *([position[:, None]] if position is not None else []), final_window.flatten(1)]
    return y, torch.cat(parts, 1)


DELTA_SHAPES = [  # (rule, n_heads, head_dim, value_dim, conv_size, T, join, output_norm, rotary_base)
    ("efla", 2, 8, 12, 4, 37, "residual", False, None),
    ("deltanet", 2, 8, 12, 4, 37, "gated", True, None),
    ("efla", 1, 16, 4, 3, 21, "prenorm", True, None),
    ("deltanet", 3, 4, 8, 1, 18, "read", True, None),
    ("efla", 2, 8, 8, 4, 19, "gated", False, None),
    ("efla", 3, 8, 12, 4, 37, "residual", True, None),
    ("deltanet", 2, 4, 8, 2, 21, "residual", True, None),
    ("efla", 2, 8, 12, 4, 37, "residual", True, 10.0),
    ("deltanet", 3, 4, 6, 2, 21, "gated", True, 10000.0),
    ("efla", 2, 5, 6, 4, 23, "residual", True, 100.0),
]


@pytest.mark.parametrize(("rule", "H", "K", "V", "W", "T", "join", "output_norm", "rotary_base"), DELTA_SHAPES)
@pytest.mark.parametrize("key_scale", [1e-4, 1.0, 1e4])
def test_delta_block_matches_float64_loop(rule, H, K, V, W, T, join, output_norm, rotary_base, key_scale):
    """The training path (chunked torch kernel, chunk 16 so T crosses chunks) against the float64 loop, with
    resets at random positions (t = 0 and back to back included), K != V, key norms from 1e-4 to 1e4 (the key
    projection scaled), every join, with and without the read norm and rotary positions (the state's position
    counter at random values), outputs, final state and gradients."""
    torch.manual_seed(3)
    m = make_memory(rule, F_IN, d_model=16, n_heads=H, head_dim=K, value_dim=V, conv_size=W, backend="torch",
                    chunk_size=16, join=join, output_norm=output_norm, rotary_base=rotary_base)
    with torch.no_grad():  # scale the key rows of the q/k/v projection: key norms follow
        m.qkv.weight[H * K : 2 * H * K] *= key_scale
        m.qkv.bias[H * K : 2 * H * K] *= key_scale
        if output_norm:  # a learned scale away from its start of ones, so that the oracle checks where it enters
            m.out_norm.weight.uniform_(0.5, 1.5)
    B = 3
    x, resets = _sequence(B, T, seed=7)
    state = _random_state(m, B)
    if rotary_base is not None:  # positions part way into an episode (integers, as the block counts them)
        state[:, H * K * V] = torch.tensor([0.0, 7.0, 1234.0])
    y, final = m(x, state, resets)
    m64 = copy.deepcopy(m).double()
    y_ref, final_ref = _delta_block_loop(m64, x, state, resets)
    # fp32 against fp64 over T steps; a key scale of 1e4 makes the projections' own fp32 rounding 1e4x larger
    tol = dict(atol=2e-5, rtol=2e-5) if key_scale <= 1 else dict(atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(y.double(), y_ref, **tol)
    HKV = H * K * V + (rotary_base is not None)
    matrix, window = final[:, :HKV], final[:, HKV:]
    matrix_ref, window_ref = final_ref[:, :HKV], final_ref[:, HKV:]
    torch.testing.assert_close(matrix.double(), matrix_ref, **tol)  # the position counter included
    # the window holds the normalised block inputs, whatever the key scale
    torch.testing.assert_close(window.double(), window_ref, atol=1e-5, rtol=1e-5)
    probe = torch.randn_like(y_ref)
    params = [p for p in m.parameters()]
    grads = torch.autograd.grad((y * probe).sum(), params)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), list(m64.parameters()), allow_unused=True)
    for (n, _), g, g_ref in zip(m.named_parameters(), grads, grads_ref):
        g_ref = torch.zeros_like(g, dtype=torch.float64) if g_ref is None else g_ref.double()
        scale = g_ref.abs().max().clamp_min(1e-3)
        assert float((g.double() - g_ref).abs().max() / scale) < 1e-3, n


def _rnn_loop(m, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor):
    """sb3-contrib's semantics in the block: a per-step loop over the RNN that zeroes its state where an episode
    starts (the block's front end from its definition, the output those of the module), in ``x``'s dtype."""
    core, window = m.state_parts(state)
    c, final_window = _conv_loop(m.conv, m.in_proj(x), window, resets)
    u, final_window = m.conv_norm(c.to(x.dtype)), final_window.to(x.dtype)
    # the documented layout: [B, P, L, hidden] with h at part 0 and (LSTM) c at part 1
    parts = [core[:, i].transpose(0, 1) for i in range(core.shape[1])]
    ys = []
    for t in range(x.shape[1]):
        keep = (~resets[:, t]).float().view(1, -1, 1)
        parts = [p * keep for p in parts]
        y, final = m.rnn(u[:, t : t + 1], tuple(parts) if len(parts) == 2 else parts[0])
        parts = list(final) if isinstance(final, tuple) else [final]
        ys.append(y)
    final_core = torch.stack(parts, 0).permute(2, 0, 1, 3)
    B = x.shape[0]
    return _join_definition(m, u, m.out_proj(torch.cat(ys, 1))), torch.cat([final_core.reshape(B, -1), final_window.reshape(B, -1)], 1)


@pytest.mark.parametrize("join", JOINS)
@pytest.mark.parametrize("name", ["gru", "lstm"])
@pytest.mark.parametrize("with_resets", [True, False])
def test_rnn_exact_resets(name, with_resets, join):
    """One packed call over episode segments equals the per-step loop, in every join: outputs, final state and
    gradients."""
    m = _memory(name, join=join)
    x, r = _sequence(4, 23)
    if not with_resets:
        r = torch.zeros_like(r)
    s0 = _random_state(m, 4).requires_grad_(True)
    y, f = m(x, s0, r)
    y_ref, f_ref = _rnn_loop(m, x, s0, r)
    torch.testing.assert_close(y, y_ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(f, f_ref, atol=TOL, rtol=TOL)
    params = [s0, *m.parameters()]
    grads = torch.autograd.grad(y.square().sum() + f.square().sum(), params)
    grads_ref = torch.autograd.grad(y_ref.square().sum() + f_ref.square().sum(), params)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)


def _scan_matches_float64_loop(m, x, s0, r, with_resets: bool = True) -> torch.Tensor:
    """``m``'s pass (``resets`` None without resets) against :func:`_rnn_loop` on a float64 copy: outputs, final
    state and the gradients of the parameters and ``s0`` of a random probe. Returns the outputs."""
    y, f = m(x, s0, r if with_resets else None)
    m64 = copy.deepcopy(m).double()
    s64 = s0.detach().double().requires_grad_(True)
    y_ref, f_ref = _rnn_loop(m64, x.double(), s64, r)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f.double(), f_ref, atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(4)
    probe_y, probe_f = torch.randn(y.shape, generator=g), torch.randn(f.shape, generator=g)
    grads = torch.autograd.grad((y * probe_y).sum() + (f * probe_f).sum(), [s0, *m.parameters()])
    grads_ref = torch.autograd.grad((y_ref * probe_y.double()).sum() + (f_ref * probe_f.double()).sum(),
                                    [s64, *m64.parameters()])
    for (n, _), gr, gr_ref in zip([("state", s0), *m.named_parameters()], grads, grads_ref):
        scale = gr_ref.abs().max().clamp_min(1e-3)
        assert float((gr.double() - gr_ref).abs().max() / scale) < 1e-5, n
    return y


@pytest.mark.parametrize("join", JOINS)
@pytest.mark.parametrize(("name", "hidden_size", "num_layers", "T", "bias"),
                         [("gru", 12, 2, 23, True), ("gru", 7, 1, 17, False), ("lstm", 20, 2, 23, True),
                          ("lstm", 9, 1, 31, False)])
@pytest.mark.parametrize("with_resets", [True, False])
def test_rnn_capturable_scan_matches_float64_loop(name, hidden_size, num_layers, T, bias, with_resets, join):
    """The capturable training pass (a masked scan, no host reads) against the per-step loop run on a float64 copy
    of the module: outputs, final state and the gradients of the parameters and the entering state, from a random
    state, with resets at random positions, at t = 0, back to back and at the last step (or none: ``resets`` None),
    with and without biases, in every join."""
    m = _memory(name, join=join, hidden_size=hidden_size, num_layers=num_layers, bias=bias)
    m.capturable_training(True)
    x, r = _sequence(4, T)
    if not with_resets:
        r = torch.zeros_like(r)
    s0 = _random_state(m, 4).requires_grad_(True)
    y = _scan_matches_float64_loop(m, x, s0, r, with_resets)
    # back on the default path: the packed cuDNN call gives the same function
    m.capturable_training(False)
    torch.testing.assert_close(m(x, s0, r)[0], y, atol=TOL, rtol=TOL)


@pytest.mark.skipif(not triton_scan_available(torch.device("cpu")), reason="the Triton scan needs triton (interpreted)")
@pytest.mark.parametrize(("name", "hidden_size", "num_layers", "bias"), [("gru", 12, 2, True), ("lstm", 9, 1, False)])
def test_rnn_triton_scan_in_the_block_matches_float64_loop(name, hidden_size, num_layers, bias):
    """The capturable pass with the Triton scan (interpreted here) against the float64 per-step loop, as the torch
    scan is above: outputs, final state and every gradient, resets at random positions."""
    m = _memory(name, hidden_size=hidden_size, num_layers=num_layers, bias=bias, scan_backend="triton")
    m.capturable_training(True)
    x, r = _sequence(4, 19)
    _scan_matches_float64_loop(m, x, _random_state(m, 4).requires_grad_(True), r)


def test_rnn_graph_auto_follows_the_scan_backend():
    """auto captures the GRU and LSTM with the Triton scan, not with the torch loop (slower captured than cuDNN),
    which is also the default where triton is missing."""
    assert _memory("gru").train_graph_auto == triton_scan_available(torch.device("cuda"))
    assert _memory("lstm", scan_backend="triton").train_graph_auto
    assert not _memory("gru", scan_backend="torch").train_graph_auto
    assert _memory("efla", backend="torch").train_graph_auto  # the delta rules' captured passes are their kernels'
    with pytest.raises(ValueError, match="valid: torch, triton"):
        _memory("lstm", scan_backend="cuda")


@pytest.mark.filterwarnings("ignore:dropout option adds dropout after all but last")  # nn.GRU's, at one layer
@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_rnn_capturable_scan_applies_dropout_between_layers_as_nn_gru(monkeypatch, num_layers):
    """nn.GRU's dropout: on the output of every layer but the last, in training mode only (the draws are not
    cuDNN's, so the check is where and when it applies, and that evaluation is the packed pass)."""
    import rlseq.policies.memory as mem

    m = _memory("gru", num_layers=num_layers, dropout=0.5)
    m.capturable_training(True)
    x, r = _sequence(3, 11)
    s0 = _random_state(m, 3)
    calls = []
    dropout = mem.F.dropout
    monkeypatch.setattr(mem.F, "dropout", lambda z, p, training: calls.append((p, training)) or dropout(z, p, training))
    y_train = m(x, s0, r)[0]
    assert calls == [(0.5, True)] * (num_layers - 1)
    m.eval()
    y_eval = m(x, s0, r)[0]
    m.capturable_training(False)
    torch.testing.assert_close(y_eval, m(x, s0, r)[0], atol=TOL, rtol=TOL)
    assert (num_layers > 1) == (not torch.allclose(y_train, y_eval, atol=TOL, rtol=TOL))


def test_rnn_capturable_scan_reaches_both_critic_memories():
    pair = ActorCriticMemory("lstm", F_IN, **SMALL["lstm"])
    pair.capturable_training(True)
    assert pair.actor._scan_resets and pair.critic._scan_resets and pair.train_graph_auto
    assert not ActorCriticMemory("lstm", F_IN, backend="torch", **SMALL["lstm"]).train_graph_auto
    assert ActorCriticMemory("efla", F_IN, **SMALL["efla"]).train_graph_auto


@pytest.mark.parametrize("name", ["gru", "lstm"])
def test_rnn_takes_non_contiguous_resets(name):
    """Resets laid out time-major (a transposed [T, B] buffer), as a caller's slice or transpose gives them."""
    m = _memory(name)
    x, r = _sequence(4, 23)
    r_t = r.t().contiguous().t()
    assert not r_t.is_contiguous() and torch.equal(r_t, r)
    s0 = _random_state(m, 4)
    with torch.no_grad():
        for got, want in zip(m(x, s0, r_t), m(x, s0, r)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["gru", "lstm"])
def test_rnn_one_call_per_forward(monkeypatch, name):
    """Resets or not, ``forward`` makes exactly one RNN call (never a loop over time steps)."""
    m = _memory(name)
    calls = []
    orig = m.rnn.forward
    monkeypatch.setattr(m.rnn, "forward", lambda *a, **k: calls.append(1) or orig(*a, **k))
    x, r = _sequence(5, 40)
    m(x, m.initial_state(5, "cpu"), r)
    m(x, m.initial_state(5, "cpu"), torch.zeros_like(r))
    assert len(calls) == 2


def test_delta_memories_one_kernel_call(monkeypatch):
    import rlseq.policies.memory as mem

    calls = []
    orig = mem.chunk_rule
    monkeypatch.setattr(mem, "chunk_rule", lambda *a, **k: calls.append(1) or orig(*a, **k))
    for name in ("efla", "deltanet"):
        m = _memory(name)
        x, r = _sequence(4, 50)
        m(x, m.initial_state(4, "cpu"), r)
    assert len(calls) == 2


def test_deltanet_negative_eigenvalues():
    m = _memory("deltanet", allow_negative_eigenvalues=True)
    x, r = _sequence(2, 10, scale=4.0)
    d = m.diagnostics(x, m.initial_state(2, "cpu"), r)
    torch.testing.assert_close(d["gate_mean"], torch.tensor(0.5), atol=0.15, rtol=0)  # starts at β = 0.5 too
    with torch.no_grad():
        m.beta_proj.bias.fill_(5.0)
    h, u, _ = m.front(x, m.state_parts(m.initial_state(2))[1], r)
    beta = m._heads(u, h)[-1]
    assert beta.max() > 1 and beta.max() < 2
    y_act, _ = _act(m, x, m.initial_state(2, "cpu"), r)
    y, _ = m(x, m.initial_state(2, "cpu"), r)
    torch.testing.assert_close(y_act, y.detach(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("input_scale", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_efla_and_deltanet_start_with_matched_gates(input_scale, seed):
    """At initialisation both memories' mean gates are near 0.5 on inputs of any scale and on one-hot inputs
    (the block normalises what the memory sees)."""
    g = torch.Generator().manual_seed(seed)
    onehot = torch.nn.functional.one_hot(torch.randint(0, F_IN, (8, 40), generator=g), F_IN).float()
    for x in (input_scale * torch.randn(8, 40, F_IN, generator=g), onehot):
        gates = {}
        for name in ("efla", "deltanet"):
            torch.manual_seed(seed)
            m = make_memory(name, F_IN)
            gates[name] = float(m.diagnostics(x, m.initial_state(8), torch.zeros(8, 40, dtype=torch.bool))["gate_mean"])
        assert abs(gates["efla"] - 0.5) < 0.1 and abs(gates["deltanet"] - 0.5) < 0.1, gates


def test_none_is_the_block_without_the_read():
    """The control is the same block with the memory read removed: same front end and output norm, and the same
    window in its state."""
    torch.manual_seed(0)
    efla = make_memory("efla", F_IN)
    none = make_memory("none", F_IN)
    none.load_state_dict({k: v for k, v in efla.state_dict().items() if k.startswith(SHARED)})
    x, r = _sequence(2, 5)
    y, final = none(x, none.initial_state(2), r)
    _, u, window = efla.front(x, efla.state_parts(efla.initial_state(2))[1], r)
    torch.testing.assert_close(y, efla.norm(u))
    torch.testing.assert_close(final, window.flatten(1))


# -- diagnostics and finiteness -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MEMORIES)
def test_diagnostics(name):
    m = _memory(name)
    x, r = _sequence(3, 8, scale=5.0)
    d = m.diagnostics(x, _random_state(m, 3), r)
    expected = {
        "efla": {"key_norm_mean", "key_norm_max", "gate_mean", "gate_saturated_frac", "state_norm_mean", "state_norm_max"},
        "lstm": {"state_norm_mean", "state_norm_max"},
        "gru": {"state_norm_mean", "state_norm_max"},
        "none": set(),
    }
    expected["deltanet"] = expected["efla"]
    assert set(d) == expected[name]
    for k, v in d.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad and torch.isfinite(v), k
    if name == "efla":
        assert 0 <= d["gate_saturated_frac"] <= 1 and 0 < d["gate_mean"] < 1
        assert d["key_norm_max"] >= d["key_norm_mean"] > 0
        # the gate is 1 - exp(-β‖k‖²) of the raw (convolved) keys: recompute it
        h, u, _ = m.front(x, m.state_parts(_random_state(m, 3))[1], r)
        _, k, _, beta = m._heads(u, h)
        torch.testing.assert_close(d["gate_mean"], (1 - torch.exp(-beta * (k * k).sum(-1))).mean())
    if name == "deltanet":  # unit keys: the eigenvalue gate is β
        h, u, _ = m.front(x, m.state_parts(_random_state(m, 3))[1], r)
        torch.testing.assert_close(d["gate_mean"], m._heads(u, h)[3].mean())


@pytest.mark.parametrize("name", MEMORIES)
def test_check_finite(name):
    m = _memory(name)
    s = _random_state(m, 4)
    m.check_finite(s, "fine")  # no error
    s.view(4, -1)[2, 5] = float("nan")
    s.view(4, -1)[3, 0] = float("inf")
    with pytest.raises(MemoryStateError, match=r"rollout 7.*batch indices \[2, 3\]") as err:
        m.check_finite(s, "rollout 7")
    assert name in str(err.value) and "max |value|" in str(err.value)
    assert isinstance(err.value, FloatingPointError)
    if name in ("efla", "deltanet"):
        assert "(2, 0)" in str(err.value)  # (batch, head)
    if name in ("gru", "lstm"):
        assert "(2, 0, 0)" in str(err.value)  # (batch, part, layer)
    s = _random_state(m, 4)
    s[1:3, -1] = float("nan")  # the convolution window's last entry: every memory has the window
    with pytest.raises(MemoryStateError, match=r"convolution window of batch \[1, 2\]"):
        m.check_finite(s, "window")
    make_memory("none", 3, conv_size=1).check_finite(torch.zeros(2, 0), "empty")


def test_efla_state_bounded_for_huge_inputs():
    """EFLA's transition is contractive for any key scale: inputs × 1e4 still give a finite, bounded state."""
    m = _memory("efla")
    x, r = _sequence(2, 40, scale=1e4)
    y, f = m(x, m.initial_state(2, "cpu"), torch.zeros_like(r))
    m.check_finite(f, "huge inputs")
    assert torch.isfinite(y).all()


def test_import_is_light():
    code = (
        "import sys, rlseq.policies; "
        "bad = [m for m in ('triton', 'stable_baselines3', 'sb3_contrib', 'procgen', 'rlseq.kernels.triton_ops') "
        "if m in sys.modules]; print(bad); assert not bad, bad"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=120)


@pytest.mark.parametrize("name", ["efla", "deltanet"])
def test_memory_layers_skip_the_beta_check_their_sigmoid_makes_redundant(name, monkeypatch):
    """β is a sigmoid (≥ 0 by construction); the kernels' check of it is a host sync on CUDA that would stall every
    eager training step, so the layers' training, acting and diagnostics calls skip it."""
    import rlseq.kernels.api as api

    monkeypatch.setattr(api, "_check_beta", lambda beta: pytest.fail("the beta check ran inside a memory layer"))
    m = _memory(name)
    x, resets = _sequence(3, 7)
    out, state = m(x, m.initial_state(3, "cpu"), resets)
    m.step(x[:, 0], state, resets[:, 0])
    m.diagnostics(x, m.initial_state(3, "cpu"), resets)
    with pytest.raises(pytest.fail.Exception, match="the beta check ran"):  # the public API still checks
        api.chunk_rule(*(torch.rand(1, 2, 1, 4) for _ in range(3)), torch.rand(1, 2, 1), rule=name)


@pytest.mark.parametrize("cap", [0.5, 2.0])
def test_efla_key_norm_cap_bounds_the_keys_and_the_gate_and_acting_equals_training(cap):
    """Keys longer than the cap come out at its length, shorter ones unchanged; the gate stays at most
    1 - exp(-cap²) even with β near 1 and large inputs; the acting path (one step at a time) equals the training
    pass with resets, outputs and final state, and gradients reach every parameter."""
    m = _memory("efla", key_norm_cap=cap)
    assert f"key_norm_cap={cap}" in repr(m)
    k_raw = torch.randn(3, 5, 2, 16) * torch.logspace(-4, 4, 5).view(1, 5, 1, 1)
    k = m._keys(k_raw)
    n_raw, n = k_raw.norm(dim=-1), k.norm(dim=-1)
    torch.testing.assert_close(n, torch.minimum(n_raw, torch.full_like(n_raw, cap)), rtol=1e-5, atol=0)
    torch.testing.assert_close(k[n_raw <= cap], k_raw[n_raw <= cap])
    torch.testing.assert_close(torch.nn.functional.normalize(k, dim=-1), torch.nn.functional.normalize(k_raw, dim=-1))
    with torch.no_grad():
        m.beta_proj.bias.fill_(8.0)  # β ≈ 1
    x, r = _sequence(3, 23, scale=1e3)
    d = m.diagnostics(x, m.initial_state(3), r)
    assert float(d["gate_mean"]) <= 1 - math.exp(-cap * cap) + 1e-6
    y_act, s_act = _act(m, x, m.initial_state(3), r)
    y, s = m(x, m.initial_state(3), r)
    torch.testing.assert_close(y_act, y.detach(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(s_act, s.detach(), atol=TOL, rtol=TOL)
    y.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


def test_efla_without_a_cap_keeps_raw_keys_and_a_bad_cap_is_refused():
    m = _memory("efla")
    k_raw = 1e3 * torch.randn(2, 4, 2, 16)
    assert m.key_norm_cap is None and m._keys(k_raw) is k_raw
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="key_norm_cap must be a positive finite number"):
            _memory("efla", key_norm_cap=bad)
    from rlseq.config import memory_kwargs_problems

    assert memory_kwargs_problems({"efla": {"key_norm_cap": 2}}, "f.yml") == []
    assert memory_kwargs_problems({"efla": {"key_norm_cap": 0}}, "f.yml") == [
        "memory_kwargs efla key_norm_cap 0 must be > 0 and <= 1e+12 (f.yml)"]
    assert "unknown memory_kwargs key 'key_norm_cap' of deltanet" in memory_kwargs_problems(
        {"deltanet": {"key_norm_cap": 2}}, "f.yml")[0]


def test_the_read_norm_is_the_default_can_be_turned_off_and_a_non_boolean_is_refused():
    from rlseq.config import memory_kwargs_problems

    for name in ("efla", "deltanet"):
        m = _memory(name)
        assert isinstance(m.out_norm, torch.nn.RMSNorm) and m.out_norm.normalized_shape == (m.value_dim,)
        assert "out_norm.weight" in dict(m.named_parameters())
        off = _memory(name, output_norm=False)
        assert off.out_norm is None and "out_norm.weight" not in dict(off.named_parameters())
        with pytest.raises(TypeError, match="output_norm must be True or False, got 'false'"):
            _memory(name, output_norm="false")
        assert memory_kwargs_problems({name: {"output_norm": True}}, "f.yml") == []
        assert memory_kwargs_problems({name: {"output_norm": "maybe"}}, "f.yml") == [
            f"memory_kwargs {name} output_norm 'maybe' must be true or false (f.yml)"]
    assert "unknown memory_kwargs key 'output_norm' of gru" in memory_kwargs_problems(
        {"gru": {"output_norm": True}}, "f.yml")[0]


@pytest.mark.parametrize(("memory", "critic_memory"), [("efla", False), ("deltanet", True)])
def test_a_model_saved_before_the_read_norm_default_loads_as_it_was_trained(memory, critic_memory, tmp_path,
                                                                            monkeypatch):
    """A MemoryPPO saved when ``output_norm`` defaulted to False (no keyword saved, no norm weight) loads without
    the norm, with a warning, with its outputs and its optimizer state as saved; it trains on, and saves and
    loads again as it is."""
    import gymnasium as gym

    from rlseq.algos import MemoryPPO

    env = gym.make("CartPole-v1")
    kwargs = dict(memory=memory, critic_memory=critic_memory, memory_kwargs=dict(n_heads=2, head_dim=8, d_model=16))
    with monkeypatch.context() as m:
        read_norm_off_by_default(m)
        old = MemoryPPO("MlpPolicy", env, n_steps=32, n_epochs=1, seed=0, policy_kwargs=kwargs, device="cpu")
        old.learn(64)
        assert "output_norm" not in old.policy_kwargs["memory_kwargs"]
        old.save(tmp_path / "old.zip")
    assert make_memory(memory, 4).out_norm is not None  # the default is the norm again

    with pytest.warns(UserWarning, match="no read norm .* loaded without it, as it was trained"):
        loaded = MemoryPPO.load(tmp_path / "old.zip", env=env, device="cpu")
    norms = [sub.out_norm for sub in loaded.policy.modules() if hasattr(sub, "out_norm")]
    assert len(norms) == (2 if critic_memory else 1) and all(n is None for n in norms)
    assert loaded.policy.memory_kwargs["output_norm"] is False
    obs = torch.randn(5, 4)
    state, starts = old.policy.initial_state(5), torch.ones(5, dtype=torch.bool)
    torch.testing.assert_close(loaded.policy.predict_values(obs, state, starts),
                               old.policy.predict_values(obs, state, starts), rtol=0, atol=0)
    saved_adam, loaded_adam = old.policy.optimizer.state_dict(), loaded.policy.optimizer.state_dict()
    assert len(loaded_adam["state"]) == len(saved_adam["state"]) > 0
    for i, st in saved_adam["state"].items():
        torch.testing.assert_close(loaded_adam["state"][i]["exp_avg"], st["exp_avg"], rtol=0, atol=0)
    assert {id(p) for g in loaded.policy.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in loaded.policy.parameters()}
    loaded.learn(32)

    loaded.save(tmp_path / "again.zip")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*read norm.*")
        again = MemoryPPO.load(tmp_path / "again.zip", env=env, device="cpu")
    assert again.policy.memory_kwargs["output_norm"] is False
    assert all(sub.out_norm is None for sub in again.policy.modules() if hasattr(sub, "out_norm"))


def _small_efla_ppo(**policy_kwargs):
    import gymnasium as gym

    from rlseq.algos import MemoryPPO

    kwargs = {"memory": "efla", "memory_kwargs": dict(n_heads=2, head_dim=8, d_model=16), **policy_kwargs}
    return MemoryPPO("MlpPolicy", gym.make("CartPole-v1"), n_steps=32, seed=0, device="cpu", policy_kwargs=kwargs)


def test_the_read_norm_is_removed_only_from_a_whole_state_saved_without_it():
    """A missing key besides the norm's, a partial load, a state with the norm for one memory and not another, and
    an explicit output_norm=True: each leaves the policy (norms, optimizer, memory_kwargs) as it was."""
    policy = _small_efla_ppo(critic_memory=True).policy
    optimizer, full = policy.optimizer, policy.state_dict()
    old = {k: v for k, v in full.items() if not k.endswith("out_norm.weight")}

    def unchanged() -> bool:
        return (policy.optimizer is optimizer and "output_norm" not in policy.memory_kwargs
                and policy.memory.actor.out_norm is not None and policy.memory.critic.out_norm is not None)

    with pytest.raises(RuntimeError, match="memory.actor.out_proj.weight"):  # the load fails after the removal
        policy.load_state_dict({k: v for k, v in old.items() if k != "memory.actor.out_proj.weight"})
    assert unchanged()
    policy.load_state_dict({k: v for k, v in old.items() if k.startswith("value_net")}, strict=False)
    assert unchanged()
    with pytest.raises(ValueError, match="read norm .* for memory.actor and none for memory.critic"):
        policy.load_state_dict({k: v for k, v in full.items() if k != "memory.critic.out_norm.weight"})
    assert unchanged()
    explicit = _small_efla_ppo(memory_kwargs=dict(n_heads=2, head_dim=8, d_model=16, output_norm=True)).policy
    with pytest.raises(RuntimeError, match="memory.out_norm.weight"):
        explicit.load_state_dict({k: v for k, v in explicit.state_dict().items() if "out_norm" not in k})
    assert explicit.memory.out_norm is not None
    with pytest.warns(UserWarning, match="no read norm for memory.actor, memory.critic"):
        policy.load_state_dict(old)  # the whole state of an old save
    assert policy.memory.actor.out_norm is None and policy.memory.critic.out_norm is None
    assert policy.optimizer is not optimizer and policy.memory_kwargs["output_norm"] is False


def test_set_parameters_on_a_live_model_remakes_its_acting_step(tmp_path, monkeypatch):
    """An in-place load that removes the read norm drops the acting step (and its CUDA graph) captured over the
    old parameters, and records output_norm=False for the next save."""
    with monkeypatch.context() as m:
        read_norm_off_by_default(m)
        _small_efla_ppo().save(tmp_path / "old.zip")
    model = _small_efla_ppo()
    model.learn(32)
    assert model._acting is not None
    with pytest.warns(UserWarning, match="no read norm for memory"):
        model.set_parameters(str(tmp_path / "old.zip"))
    assert model._acting is None and model.policy.memory.out_norm is None
    assert model.policy_kwargs["memory_kwargs"]["output_norm"] is False
    model.learn(32)  # acts and trains on the parameters it has now


def test_every_ablation_config_is_valid():
    """The files that `python -m rlseq.bench memory --config` takes: each names only keys, values, memory keywords
    and policy keywords that a run of every memory accepts (the checks `python -m rlseq.train` makes)."""
    from rlseq.config import check_values, kwargs_problems, load_config, unknown_keys

    env = "popgym-RepeatFirstMedium-v0"
    files = sorted((pathlib.Path(__file__).resolve().parents[1] / "configs" / "ablations").glob("*.yml"))
    assert len(files) >= 9
    for path in files:
        entry = load_config(path, env, "popgym")
        assert unknown_keys(entry, str(path)) == [] and check_values(entry, {}) == [], path
        for memory in MEMORIES:
            assert kwargs_problems(entry, {}, "rlseq", memory, env, "popgym") == [], (path, memory)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_a_state_saved_with_other_head_sizes_is_refused_with_the_settings_to_load_it_by(rule):
    """Another head size fails on tensor shapes that do not say which settings made them: the load names the
    saved sizes (and, compared at those sizes, the saved rotary positions) as memory_kwargs that load it."""
    from rlseq.policies.memory import memory_kwargs_to_load, settings_refusal

    def memory(**kw):
        torch.manual_seed(0)
        return make_memory(rule, F_IN, d_model=16, **kw)

    default = memory()
    saved = memory(head_dim=6, value_dim=10).state_dict()
    with pytest.raises(RuntimeError) as e:
        default.load_state_dict(saved)
    said = settings_refusal(e.value)
    assert said.startswith(f"qkv.weight: the state was saved with other head sizes (head_dim=6, value_dim=10) than "
                           f"this memory's (head_dim={default.head_dim}, value_dim={default.value_dim}); load it with "
                           "memory_kwargs head_dim=6, value_dim=10"), said
    memory(**memory_kwargs_to_load(said)).load_state_dict(saved)  # what it names loads
    # other sizes and other rotary positions: one line names both
    saved = memory(head_dim=6, value_dim=10, rotary_max_freq=1.0).state_dict()
    with pytest.raises(RuntimeError) as e:
        default.load_state_dict(saved)
    said = settings_refusal(e.value)
    assert memory_kwargs_to_load(said) == dict(head_dim=6, value_dim=10, rotary_base=10000, rotary_max_freq=1), said
    memory(**memory_kwargs_to_load(said)).load_state_dict(saved)
    saved = memory(head_dim=6, value_dim=10, rotary_base=None).state_dict()
    with pytest.raises(RuntimeError) as e:
        default.load_state_dict(saved)
    said = settings_refusal(e.value)
    assert memory_kwargs_to_load(said) == dict(head_dim=6, value_dim=10, rotary_base=None), said
    memory(**memory_kwargs_to_load(said)).load_state_dict(saved)
    # another head count: torch's size checks speak, not a guess at the sizes (2 heads of 6 read at 3 heads would
    # look like heads of 4)
    for saved_heads in (dict(n_heads=2, head_dim=5, value_dim=5), dict(n_heads=2, head_dim=6, value_dim=6)):
        with pytest.raises(RuntimeError, match="size mismatch") as e:
            memory(n_heads=3).load_state_dict(memory(**saved_heads).state_dict())
        assert settings_refusal(e.value) is None, settings_refusal(e.value)
    with pytest.raises(ValueError, match="not a settings refusal"):
        memory_kwargs_to_load("size mismatch for qkv.weight")


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_a_state_saved_with_other_rotary_positions_is_refused_with_the_setting_to_load_it_by(rule):
    """Rotary positions add no weights: without the saved frequencies, a state saved with them would load into
    a memory without them (or with another base or fastest turn) silently, and read its memory differently."""
    from rlseq.policies.memory import rotary_settings

    def memory(base, max_freq=math.pi):
        torch.manual_seed(0)
        return make_memory(rule, F_IN, d_model=16, rotary_base=base, rotary_max_freq=max_freq)

    with_100, plain = memory(100.0), memory(None)
    memory(100.0).load_state_dict(with_100.state_dict())  # the same setting loads
    with pytest.raises(RuntimeError, match=r"saved without rotary positions .* rotary_base=100; load it with "
                                           r"memory_kwargs rotary_base=None"):
        memory(100.0).load_state_dict(plain.state_dict())
    pi = re.escape(repr(math.pi))
    with pytest.raises(RuntimeError, match=rf"saved with other rotary positions \(rotary_base=100, "
                                           rf"rotary_max_freq={pi}\) and this memory has none; load it with "
                                           rf"memory_kwargs rotary_base=100, rotary_max_freq={pi}$"):
        memory(None).load_state_dict(with_100.state_dict())
    with pytest.raises(RuntimeError, match=rf"saved with other rotary positions \(rotary_base=100, rotary_max_freq="
                                           rf"{pi}\) than this memory's \(rotary_base=10000, rotary_max_freq={pi}\); "
                                           rf"load it with memory_kwargs rotary_base=100, rotary_max_freq={pi}$"):
        memory(10000.0).load_state_dict(with_100.state_dict())
    with pytest.raises(RuntimeError, match=rf"\(rotary_base=100, rotary_max_freq=1\) than this memory's "
                                           rf"\(rotary_base=100, rotary_max_freq={pi}\); load it with memory_kwargs "
                                           rf"rotary_base=100, rotary_max_freq=1$"):
        memory(100.0).load_state_dict(memory(100.0, 1.0).state_dict())
    outer = torch.nn.Sequential(memory(10000.0))  # a memory inside a model: the names say where
    with pytest.raises(RuntimeError, match=r"0\.rotary_freqs: the state was saved with other rotary positions "
                                           r"\(rotary_base=100,"):
        outer.load_state_dict(torch.nn.Sequential(with_100).state_dict())
    # a state that does not hold the memory's weights (a partial load of other modules) is not checked
    memory(10000.0).load_state_dict({}, strict=False)
    # float32 rounding of the saved frequencies is the same base, and names settings a memory can be built with
    as_float32 = {k: v.float() for k, v in with_100.state_dict().items()}
    memory(100.0).load_state_dict(as_float32)
    assert rotary_settings(as_float32["rotary_freqs"]) == {"rotary_base": 100.0, "rotary_max_freq": math.pi}
    assert rotary_settings(memory(100.0, 1.0).rotary_freqs) == {"rotary_base": 100.0, "rotary_max_freq": 1.0}


@pytest.mark.parametrize("head_dim", [2, 3, 32, 128, 512])
@pytest.mark.parametrize("base", [2.0, 100.0, 12345.678, 1e6])
@pytest.mark.parametrize("max_freq", [0.5, 1.0, math.pi])
def test_rotary_settings_rebuild_saved_frequencies_that_load(head_dim, base, max_freq):
    """The settings a refusal names, read from saved frequencies (float64 or float32-rounded), rebuild them
    within the load's tolerance, for wide heads and bases of many digits too (one pair: its turn alone)."""
    from rlseq.policies.memory import rotary_frequencies, rotary_settings

    freqs = rotary_frequencies(head_dim, base, max_freq)
    for saved in (freqs, freqs.float()):
        settings = rotary_settings(saved)
        rebuilt = rotary_frequencies(head_dim, settings.get("rotary_base", base), settings["rotary_max_freq"])
        torch.testing.assert_close(rebuilt, saved.double(), rtol=1e-6, atol=0)
        assert ("rotary_base" in settings) == (head_dim >= 4)


@pytest.mark.parametrize("rule", ["efla", "deltanet"])
def test_a_state_of_the_rotary_option_loads_where_its_settings_name_the_base(rule):
    """Before rotary positions were the default they were an option whose frequencies were not saved (and whose
    fastest pair turned 1 rad a step): a state without them loads where the saved settings name ``rotary_base``
    (it was trained with it), with the frequencies it was trained with, and is refused where they do not (it was
    trained without)."""
    from rlseq.policies.memory import with_rotary_freqs_of_option_saves

    torch.manual_seed(0)
    trained = make_memory(rule, F_IN, d_model=16, rotary_base=100.0, rotary_max_freq=1.0)
    option_save = {k: v for k, v in trained.state_dict().items() if k != "rotary_freqs"}
    today = make_memory(rule, F_IN, d_model=16, rotary_base=100.0)  # the fastest pair at π: not as trained
    with pytest.raises(RuntimeError, match=r"rotary_max_freq=1\) than this memory's"):
        today.load_state_dict(with_rotary_freqs_of_option_saves(today, option_save, {"rotary_base": 100.0}))
    fresh = make_memory(rule, F_IN, d_model=16, rotary_base=100.0, rotary_max_freq=1.0)
    fresh.load_state_dict(with_rotary_freqs_of_option_saves(fresh, option_save, {"rotary_base": 100.0}))
    x = torch.randn(2, 9, F_IN)
    torch.testing.assert_close(fresh(x, fresh.initial_state(2), None), trained(x, trained.initial_state(2), None))
    unnamed = with_rotary_freqs_of_option_saves(fresh, option_save, {"n_heads": 4})
    assert unnamed is option_save
    with pytest.raises(RuntimeError, match="saved without rotary positions"):
        fresh.load_state_dict(unnamed)


def test_rotary_positions_add_one_counter_to_the_state_and_bad_settings_are_refused():
    plain, turned = make_memory("efla", F_IN, rotary_base=None), make_memory("efla", F_IN, rotary_base=100.0)
    assert make_memory("efla", F_IN).rotary_base == make_memory("deltanet", F_IN).rotary_base == 10000.0
    assert make_memory("efla", F_IN).rotary_max_freq == make_memory("deltanet", F_IN).rotary_max_freq == math.pi
    # the ladder from the fastest turn down: π·b^(-i/n), n = K/2 (32 at EFLA's default keys of 64)
    torch.testing.assert_close(turned.rotary_freqs, math.pi * 100.0 ** (-torch.arange(32, dtype=torch.float64) / 32),
                               rtol=1e-15, atol=0)
    assert turned.state_shape[0] == plain.state_shape[0] + 1 and plain.core_state_shape == (4, 64, 32)
    state = turned.initial_state(2)
    x = torch.randn(2, 5, F_IN)
    _, final = turned(x, state, None)
    assert turned.matrix_and_position(turned.state_parts(final)[0])[1].tolist() == [5.0, 5.0]
    for bad in (1.0, 0.5, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="rotary_base must be a finite number > 1"):
            make_memory("deltanet", F_IN, rotary_base=bad)
    for bad in (0.0, -1.0, 3.2, float("nan"), True):
        with pytest.raises(ValueError, match=r"rotary_max_freq must be in \(0, π\]"):
            make_memory("efla", F_IN, rotary_max_freq=bad)
    from rlseq.config import memory_kwargs_problems

    assert memory_kwargs_problems({"deltanet": {"rotary_base": "1e4"}, "efla": {"rotary_base": None}}, "f.yml") == []
    assert memory_kwargs_problems({"efla": {"rotary_base": 1}}, "f.yml") == [
        "memory_kwargs efla rotary_base 1 must be > 1 and <= 1e+12 (f.yml)"]
    assert memory_kwargs_problems({"efla": {"rotary_max_freq": 4}}, "f.yml") == [
        "memory_kwargs efla rotary_max_freq 4 must be > 0 and <= π (3.141592653589793) (f.yml)"]
    # π rounded up reads as π in the message, which says why it is refused
    assert memory_kwargs_problems({"efla": {"rotary_max_freq": 3.1416}}, "f.yml") == [
        "memory_kwargs efla rotary_max_freq 3.1416 must be > 0 and <= π (3.141592653589793) (f.yml)"]
    assert "unknown memory_kwargs key 'rotary_base' of gru" in memory_kwargs_problems(
        {"gru": {"rotary_base": 100}}, "f.yml")[0]
