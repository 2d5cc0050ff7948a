"""The GRU and LSTM scans (:func:`rlseq.kernels.rnn.rnn_scan`) against the float64 step loop.

The Triton backend runs under ``TRITON_INTERPRET=1`` on CPU tensors (tests/conftest.py sets it before triton is
imported; with ``TRITON_INTERPRET=0`` and a GPU the same tests run the compiled kernels on CUDA tensors).
``python -m rlseq.bench gpu-check`` checks the compiled kernels at the training shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

from rlseq.kernels.rnn import CELLS, gru_cell, lstm_cell, rnn_scan, triton_scan_available

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not triton_scan_available(torch.device(DEVICE)),
                                  reason="the Triton scan needs triton and a GPU, or TRITON_INTERPRET=1")


def _inputs(cell: str, B: int, T: int, H: int, *, seed: int, bias: bool = True, scale: float = 1.0):
    """float64 inputs: pre-activations of unit scale times ``scale``, weights at PyTorch's initial scale, a random
    entering state, and resets at t = 0 of sequence 0, back to back, at the last step and at random places (the
    last sequence has none)."""
    G, P = CELLS[cell]
    g = torch.Generator().manual_seed(seed)
    gates_x = scale * torch.randn(B, T, G * H, generator=g, dtype=torch.float64)
    w = (torch.rand(G * H, H, generator=g, dtype=torch.float64) * 2 - 1) / H ** 0.5
    b = (torch.rand(G * H, generator=g, dtype=torch.float64) * 2 - 1) / H ** 0.5 if bias else None
    parts = tuple(torch.randn(B, H, generator=g, dtype=torch.float64) for _ in range(P))
    resets = torch.rand(B, T, generator=g) < 0.2
    resets[0, 0] = True
    resets[0, T // 2: T // 2 + 2] = True
    resets[min(1, B - 1), T - 1] = True
    if B > 2:
        resets[-1] = False
    return gates_x, w, b, parts, resets


def _run(cell, inputs, backend, dtype, device, *, with_resets=True):
    """Outputs and the gradients of a random linear probe of them (the probe drawn in float64, then cast)."""
    gates_x, w, b, parts, resets = inputs
    leaves = [x.to(device, dtype).requires_grad_() for x in (gates_x, w, *([b] if b is not None else []), *parts)]
    bias = leaves[2] if b is not None else None
    state = tuple(leaves[3 if b is not None else 2:])
    y, final = rnn_scan(cell, leaves[0], leaves[1], bias, state, resets.to(device) if with_resets else None,
                        backend=backend)
    g = torch.Generator().manual_seed(7)
    loss = (y * torch.randn(y.shape, generator=g, dtype=torch.float64).to(device, y.dtype)).sum()
    for f in final:
        loss = loss + (f * torch.randn(f.shape, generator=g, dtype=torch.float64).to(device, f.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return [t.detach().double().cpu() for t in (y, *final, *grads)]


def _assert_matches(got, ref, tol):
    for i, (a, r) in enumerate(zip(got, ref)):
        scale = r.abs().max().clamp_min(1e-3)
        err = float((a - r).abs().max() / scale)
        assert err < tol, f"output/gradient {i}: relative error {err:.2e}"


@needs_triton
@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize(("B", "T", "H", "bias"), [(3, 23, 7, True), (18, 5, 40, False), (2, 4, 130, True),
                                                   (1, 1, 16, True)])
@pytest.mark.parametrize("with_resets", [True, False])
def test_triton_scan_matches_float64_loop(cell, B, T, H, bias, with_resets):
    """Outputs, final state and the gradients of the pre-activations, both weights and the entering state: hidden
    sizes below, across and beyond one program's block of units and the reduction's block (130), more sequences
    than a program holds (18), a single step, resets anywhere or none."""
    inputs = _inputs(cell, B, T, H, seed=B * 100 + H, bias=bias)
    ref = _run(cell, inputs, "reference", torch.float64, "cpu", with_resets=with_resets)
    got = _run(cell, inputs, "triton", torch.float32, DEVICE, with_resets=with_resets)
    _assert_matches(got, ref, 1e-5)


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("cell", list(CELLS))
def test_a_reset_cuts_the_gradient_exactly(cell, backend):
    """No gradient reaches the entering state of a sequence that starts an episode at step 0, nor (with NaN in
    it) does its NaN reach any output: the state is replaced, not multiplied by zero. Exact zeros, on every
    backend (interpreted, the Triton programs run one after another: races show only on a GPU, in gpu-check and
    these tests run with TRITON_INTERPRET=0)."""
    gates_x, w, b, parts, resets = _inputs(cell, 3, 7, 20, seed=11)
    resets[0, 0] = True
    dtype = torch.float64 if backend == "reference" else torch.float32
    device = DEVICE if backend == "triton" else "cpu"
    poisoned = tuple(p.clone() for p in parts)
    for p in poisoned:
        p[0] = float("nan")
    leaves = [x.to(device, dtype).requires_grad_() for x in poisoned]
    y, final = rnn_scan(cell, gates_x.to(device, dtype), w.to(device, dtype), b.to(device, dtype), tuple(leaves),
                        resets.to(device), backend=backend)
    assert torch.isfinite(y).all() and all(torch.isfinite(f).all() for f in final)
    grads = torch.autograd.grad(y.sum() + sum(f.sum() for f in final), leaves)
    for g in grads:
        assert torch.equal(g[0], torch.zeros_like(g[0])) and g[1:].abs().sum() > 0


@needs_triton
@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("loss_on", ["outputs", "final state"])
def test_triton_scan_gradients_of_one_output_and_resets_at_every_step(cell, loss_on):
    """A loss on the outputs alone or the final state alone (autograd passes zeros for the other), with the state
    reset at every step of one sequence (its entering state gets no gradient at all)."""
    gates_x, w, b, parts, resets = _inputs(cell, 3, 6, 24, seed=13)
    resets[1] = True
    grads = {}
    for backend, dtype, device in (("reference", torch.float64, "cpu"), ("triton", torch.float32, DEVICE)):
        leaves = [x.to(device, dtype).requires_grad_() for x in (gates_x, w, b, *parts)]
        y, final = rnn_scan(cell, *leaves[:3], tuple(leaves[3:]), resets.to(device), backend=backend)
        loss = (y * y).sum() if loss_on == "outputs" else sum((f * f).sum() for f in final)
        grads[backend] = [g.double().cpu() for g in torch.autograd.grad(loss, leaves)]
    _assert_matches(grads["triton"], grads["reference"], 1e-5)
    for g in grads["triton"][3:]:
        assert torch.equal(g[1], torch.zeros_like(g[1]))


@pytest.mark.parametrize("cell", list(CELLS))
def test_torch_scan_matches_float64_loop(cell):
    inputs = _inputs(cell, 3, 29, 11, seed=3)
    _assert_matches(_run(cell, inputs, "torch", torch.float32, "cpu"),
                    _run(cell, inputs, "reference", torch.float64, "cpu"), 1e-5)


@needs_triton
@pytest.mark.parametrize("cell", list(CELLS))
def test_triton_scan_saturated_gates(cell):
    """Pre-activations of ±30 and more saturate every σ and tanh (the Triton ones are formed from e^{−|x|}: no
    overflow)."""
    inputs = _inputs(cell, 3, 9, 20, seed=5, scale=30.0)
    got = _run(cell, inputs, "triton", torch.float32, DEVICE)
    assert all(torch.isfinite(t).all() for t in got)
    _assert_matches(got, _run(cell, inputs, "reference", torch.float64, "cpu"), 1e-5)


def test_cells_are_nn_grus_and_lstms():
    """The step functions the loop (and so the oracle) applies are PyTorch's cells."""
    torch.manual_seed(0)
    x, H = torch.randn(5, 6, dtype=torch.float64), 4
    for cls, step in ((torch.nn.GRUCell, gru_cell), (torch.nn.LSTMCell, lstm_cell)):
        c = cls(6, H).double()
        parts = (torch.randn(5, H, dtype=torch.float64),) if cls is torch.nn.GRUCell else \
            (torch.randn(5, H, dtype=torch.float64), torch.randn(5, H, dtype=torch.float64))
        got = step(x @ c.weight_ih.t() + c.bias_ih, parts[0] @ c.weight_hh.t() + c.bias_hh, parts)
        want = c(x, parts[0] if len(parts) == 1 else parts)
        for a, b in zip(got, want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b)


def test_no_steps_pass_the_state_through():
    gates_x, w, b, parts, _ = _inputs("lstm", 2, 3, 5, seed=1)
    y, final = rnn_scan("lstm", gates_x[:, :0], w, b, parts)
    assert y.shape == (2, 0, 5) and all(torch.equal(f, p) for f, p in zip(final, parts))


def test_bad_input_names_what_is_expected():
    gates_x, w, b, parts, resets = _inputs("gru", 2, 3, 5, seed=1)
    with pytest.raises(ValueError, match="unknown cell 'rnn'; valid: gru, lstm"):
        rnn_scan("rnn", gates_x, w, b, parts)
    with pytest.raises(ValueError, match=r"needs gates_x \[B, T, 15\] and w_hh \[15, 5\]"):
        rnn_scan("gru", gates_x[..., :12], w, b, parts)
    with pytest.raises(ValueError, match=r"a lstm state is 2 tensor\(s\) of shape \[B, H\] = \[2, 5\]"):
        rnn_scan("lstm", torch.randn(2, 3, 20, dtype=torch.float64), torch.randn(20, 5, dtype=torch.float64), None,
                 parts)
    with pytest.raises(ValueError, match=r"resets must be a bool tensor of shape \[B, T\] = \[2, 3\]"):
        rnn_scan("gru", gates_x, w, b, parts, resets.float())
    for T in (3, 0):  # with no step to scan too
        with pytest.raises(ValueError, match="unknown backend 'cudnn'; valid backends: reference, torch, triton"):
            rnn_scan("gru", gates_x[:, :T], w, b, parts, resets[:, :T], backend="cudnn")
    with pytest.raises(ValueError, match="w_hh has dtype torch.float32, but gates_x has torch.float64"):
        rnn_scan("gru", gates_x, w.float(), b, parts)
    with pytest.raises(ValueError, match="parts.0. is on meta, but gates_x is on cpu"):
        rnn_scan("gru", gates_x, w, b, (parts[0].to("meta"),))
    if triton_scan_available(gates_x.device):
        with pytest.raises(ValueError, match="the triton scan computes in float32"):
            rnn_scan("gru", gates_x, w, b, parts, backend="triton")
