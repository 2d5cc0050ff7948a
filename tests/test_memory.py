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

import importlib  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

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

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-5
F_IN = 12

SMALL = {
    "efla": dict(n_heads=2, head_dim=16, d_model=24),
    "deltanet": dict(n_heads=2, head_dim=16, value_dim=8),
    "lstm": dict(hidden_size=20, num_layers=2),
    "none": {},
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
CONSISTENCY_CASES = [pytest.param(name, "torch", id=f"{name}-torch") for name in MEMORIES] + [
    pytest.param(name, "triton", id=f"{name}-triton-interpret") for name in ("efla", "deltanet")
]


def _memory(name: str, backend: str = "torch", seed: int = 0, **kw) -> Memory:
    torch.manual_seed(seed)
    extra = dict(SMALL[name])
    if name in ("efla", "deltanet"):
        extra["backend"] = backend
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
    expected = {"efla": (2, 16, 16), "deltanet": (2, 16, 8), "lstm": (2, 2, 20), "none": (0,)}[name]
    assert tuple(s.shape[1:]) == expected
    x, r = _sequence(B, T)
    y, final = m(x, s, r)
    assert y.shape == (B, T, m.out_features) and final.shape == s.shape and final.dtype == torch.float32
    assert m.step(x[:, 0], s.clone(), r[:, 0]).shape == (B, m.out_features)
    assert m.in_features == F_IN
    assert isinstance(m, Memory)


def test_out_features():
    assert make_memory("efla", 10).out_features == 10
    assert make_memory("efla", 10, d_model=32).out_features == 32
    assert make_memory("deltanet", 10).out_features == 10
    assert make_memory("lstm", 10, hidden_size=7).out_features == 7
    assert make_memory("none", 10).out_features == 10
    assert isinstance(make_memory("EFLA", 4), EFLAMemory) and isinstance(make_memory("deltanet", 4), DeltaNetMemory)
    assert isinstance(make_memory("lstm", 4), LSTMMemory) and isinstance(make_memory("none", 4), NoMemory)


def test_make_memory_unknown_name():
    with pytest.raises(ValueError, match="efla, deltanet, lstm, none"):
        make_memory("gru", 4)
    assert MEMORIES == ("efla", "deltanet", "lstm", "none")


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


@pytest.mark.parametrize(("name", "backend"), CONSISTENCY_CASES)
def test_step_matches_forward(name, backend):
    """Step-by-step acting and whole-sequence training give the same outputs and final state (fp32, 1e-5)."""
    if backend == "triton":
        assert _triton_ready(), "the Triton kernels must run here under TRITON_INTERPRET=1 (tests/conftest.py sets it)"
    m = _memory(name, backend)
    B, T = 3, 70 if backend == "torch" else 37  # crosses the chunk boundaries (torch 64, triton ≤ 64)
    x, r = _sequence(B, T, scale=3.0)  # larger inputs: EFLA gates near saturation, DeltaNet keys unit anyway
    s0 = _random_state(m, B)
    y_train, final_train = m(x, s0, r)
    y_act, final_act = _act(m, x, s0, r)
    torch.testing.assert_close(y_act, y_train.detach(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(final_act, final_train.detach(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("name", ["efla", "deltanet"])
def test_forward_matches_reference_kernel(name):
    """The training path on the torch backend agrees with the float64 step-loop oracle's backend."""
    m = _memory(name)
    x, r = _sequence(2, 33)
    s0 = _random_state(m, 2)
    y, f = m(x, s0, r)
    m.backend = "reference"
    y_ref, f_ref = m(x, s0, r)
    torch.testing.assert_close(y, y_ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(f, f_ref, atol=TOL, rtol=TOL)


def test_deltanet_negative_eigenvalues():
    m = _memory("deltanet", allow_negative_eigenvalues=True)
    x, r = _sequence(2, 10, scale=4.0)
    d = m.diagnostics(x, m.initial_state(2, "cpu"), r)
    assert d["gate_mean"] > 0 and float(d["key_norm_max"]) > 0
    # β ∈ (0, 2): with big inputs some gates exceed 1
    beta = m._project(x)[-1]
    assert beta.max() > 1 and beta.max() < 2
    y_act, _ = _act(m, x, m.initial_state(2, "cpu"), r)
    y, _ = m(x, m.initial_state(2, "cpu"), r)
    torch.testing.assert_close(y_act, y.detach(), atol=TOL, rtol=TOL)


# -- LSTM: exact resets in one call --------------------------------------------------------------------------


def _lstm_loop(lstm: nn.LSTM, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor):
    """sb3-contrib's semantics: a per-step loop that zeroes (h, c) where an episode starts."""
    h, c = state[:, 0].transpose(0, 1), state[:, 1].transpose(0, 1)
    ys = []
    for t in range(x.shape[1]):
        keep = (~resets[:, t]).float().view(1, -1, 1)
        y, (h, c) = lstm(x[:, t : t + 1], (h * keep, c * keep))
        ys.append(y)
    return torch.cat(ys, 1), torch.stack([h, c], 0).permute(2, 0, 1, 3)


@pytest.mark.parametrize("with_resets", [True, False])
def test_lstm_exact_resets(with_resets):
    m = _memory("lstm")
    x, r = _sequence(4, 23)
    if not with_resets:
        r = torch.zeros_like(r)
    s0 = _random_state(m, 4)
    y, f = m(x, s0, r)
    y_ref, f_ref = _lstm_loop(m.lstm, x, s0, r)
    torch.testing.assert_close(y, y_ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(f, f_ref, atol=TOL, rtol=TOL)


def test_lstm_one_call_per_forward(monkeypatch):
    """Resets or not, ``forward`` makes exactly one nn.LSTM call (never a loop over time steps)."""
    m = _memory("lstm")
    calls = []
    orig = m.lstm.forward
    monkeypatch.setattr(m.lstm, "forward", lambda *a, **k: calls.append(1) or orig(*a, **k))
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


# -- diagnostics and finiteness -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MEMORIES)
def test_diagnostics(name):
    m = _memory(name)
    x, r = _sequence(3, 8, scale=5.0)
    d = m.diagnostics(x, _random_state(m, 3), r)
    expected = {
        "efla": {"key_norm_mean", "key_norm_max", "gate_mean", "gate_saturated_frac", "state_norm_mean", "state_norm_max"},
        "lstm": {"state_norm_mean", "state_norm_max"},
        "none": set(),
    }
    expected["deltanet"] = expected["efla"]
    assert set(d) == expected[name]
    for k, v in d.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad and torch.isfinite(v), k
    if name == "efla":
        assert 0 <= d["gate_saturated_frac"] <= 1 and 0 < d["gate_mean"] < 1
        assert d["key_norm_max"] >= d["key_norm_mean"] > 0
        # the gate is 1 - exp(-β‖k‖²) of the raw keys: recompute it
        _, _, k, _, beta = m._project(x)
        torch.testing.assert_close(d["gate_mean"], (1 - torch.exp(-beta * (k * k).sum(-1))).mean())
    if name == "deltanet":  # unit keys: the eigenvalue gate is β
        torch.testing.assert_close(d["gate_mean"], m._project(x)[-1].mean())


@pytest.mark.parametrize("name", ["efla", "deltanet", "lstm"])
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
    make_memory("none", 3).check_finite(torch.zeros(2, 0), "empty")


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
