"""Test helpers: the comparison of eager and CUDA-graph rollouts, a tiny `bench train` call, the wait for a
subprocess's trainer, torch's thread setting recorded instead of made, and delta-rule memories built as before
their read norm was the default (the kernel inputs and their error measure live in rlseq.bench.kernels, shared
with the benchmarks)."""

from __future__ import annotations

import subprocess
import time
from typing import Callable

import torch

# how long a test waits for a subprocess's trainer to start or checkpoint: only a guard against a hang (starting one
# took over 180 s on a 2-core machine that was training two other runs), never a timing assumption
START_LIMIT_S = 900


def wait_for(ready: Callable[[], bool], proc: subprocess.Popen) -> None:
    """Poll until ``ready()`` holds or ``proc`` has ended (at most :data:`START_LIMIT_S`)."""
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline and proc.poll() is None and not ready():
        time.sleep(0.05)


def assert_same_rollouts(eager: list, graphed: list) -> None:
    """Per rollout ``[actions, values, log_probs, episode_starts, memory state]``: actions and episode starts
    equal, the floating tensors within 1e-5 (graph replay runs the same kernels; only reductions may reorder)."""
    assert len(eager) == len(graphed)
    for a_run, g_run in zip(eager, graphed):
        assert torch.equal(a_run[0], g_run[0]) and torch.equal(a_run[3], g_run[3])
        for a, b in zip(a_run[1:], g_run[1:]):
            if a.dtype.is_floating_point:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def tiny_bench_train(variants: list[str], n_envs: int) -> None:
    """``python -m rlseq.bench train`` on the CPU at a tiny size (8 steps, 2 minibatches, 1 epoch, 1 rollout)."""
    from rlseq.bench.__main__ import main as bench_main

    bench_main(["train", "--variants", *variants, "--n-envs", str(n_envs), "--n-steps", "8", "--n-minibatches", "2",
                "--n-epochs", "1", "--num-threads", "0", "--warmup", "1", "--rollouts", "1", "--device", "cpu"])


def collect_rollout(model, callback=None, setup: bool = True) -> bool:
    """One rollout of ``model`` into its buffer (``_setup_learn`` first unless ``setup`` is False), with ``callback``
    (default: one that never stops); returns ``collect_rollouts``' answer (False: the callback stopped it)."""
    from stable_baselines3.common.callbacks import BaseCallback

    class _NoOp(BaseCallback):
        def _on_step(self) -> bool:
            return True

    if setup:
        model._setup_learn(10_000)
    callback = callback or _NoOp()
    callback.init_callback(model)
    return model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)


def check_non_finite_stays_in_its_episode(rule: str, backend: str, dtype: torch.dtype, device: str, tol: float) -> None:
    """NaN and inf in q, k, v, β and the initial state, some just before a reset inside a chunk, one in an episode
    that crosses a chunk boundary: ``chunk_rule(backend=...)`` in ``dtype`` must give the float64 step loop's
    outputs and final state (NaN exactly where it has a NaN or inf, equal elsewhere) and, for a loss on the finite
    outputs, its gradients wherever those are finite (which includes every later episode), finite everywhere."""
    from rlseq.bench.kernels import random_inputs, rel_err
    from rlseq.kernels import chunk_rule

    B, T, H, K, V = 2, 40, 2, 8, 4
    inp = random_inputs(B, T, H, K, V, rule=rule, reset_prob=0.0, generator=torch.Generator().manual_seed(7))
    resets = torch.zeros(B, T, dtype=torch.bool)
    resets[0, [6, 24]] = True  # sequence 0: episodes [0, 6), [6, 24) across the chunk boundary at 16, [24, 40)
    resets[1, 20] = True
    nan, inf = float("nan"), float("inf")
    inp["k"][0, 3, 1, 2] = nan
    inp["v"][0, 10, 0, 1] = inf  # poisons column 1 of head 0 until the reset at 24, in the next chunk
    inp["beta"][1, 18, 0] = nan
    inp["q"][1, 2, 1, 0] = nan  # its own output row only
    inp["initial_state"][1, 0, 3, 2] = -inf  # column 2 of head 0 of sequence 1, until the reset at 20
    inp["k"][1, 30, 1, 0] = nan  # after the last reset: the final state of that head, not the steps before 30
    gen = torch.Generator().manual_seed(8)
    go = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    gs = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    names = ("q", "k", "v", "beta", "initial_state")
    runs = {}
    for name, dt, dev in (("reference", torch.float64, "cpu"), (backend, dtype, device)):
        x = {n: inp[n].to(dt).to(dev) for n in names[:4]}
        x["initial_state"] = inp["initial_state"].to(torch.float64 if dt == torch.float64 else torch.float32).to(dev)
        if name == "reference":  # the oracle sees the inputs as rounded to dtype
            x = {n: t.to(dtype).double() if n != "initial_state" else t for n, t in x.items()}
        x = {n: t.detach().requires_grad_() for n, t in x.items()}
        o, s = chunk_rule(*(x[n] for n in names[:4]), rule=rule, initial_state=x["initial_state"],
                          resets=resets.to(dev), backend=name)
        runs[name] = (o, s, x)
    o_ref, s_ref, x_ref = runs["reference"]
    o, s, x = runs[backend]
    o, s = o.double().cpu(), s.double().cpu()
    fin_o, fin_s = torch.isfinite(o_ref.detach()), torch.isfinite(s_ref.detach())
    assert not fin_o.all() and not fin_s.all()  # the case does poison something
    assert torch.equal(torch.isfinite(o.detach()), fin_o) and torch.equal(torch.isfinite(s.detach()), fin_s)
    assert torch.isnan(o[~fin_o]).all() and torch.isnan(s[~fin_s]).all()
    assert rel_err(o.detach()[fin_o], o_ref.detach()[fin_o]) < tol
    assert rel_err(s.detach()[fin_s], s_ref.detach()[fin_s]) < tol
    for oo, ss, xx in ((o_ref, s_ref, x_ref), runs[backend][:2] + (x,)):
        loss = torch.where(fin_o.to(oo.device), oo.double() * go.to(oo.device), 0.0).sum() \
            + torch.where(fin_s.to(ss.device), ss.double() * gs.to(ss.device), 0.0).sum()
        loss.backward()
    for n in names:
        ref, got = x_ref[n].grad, x[n].grad.double().cpu()
        assert torch.isfinite(got).all(), n
        if n != "initial_state":  # the episodes after the poisoned ones (head 1 of sequence 1 has its own NaN)
            assert torch.isfinite(ref[0, 24:]).all() and torch.isfinite(ref[1, 20:, 0]).all(), n
        fin = torch.isfinite(ref)
        assert rel_err(got[fin], ref[fin]) < tol, (n, rel_err(got[fin], ref[fin]))


def record_torch_threads(monkeypatch) -> list[int]:
    """torch.set_num_threads's calls, recorded instead of made (the test process keeps its threads), with torch
    reporting its one-per-core default of 2 and no OMP_NUM_THREADS set."""
    calls: list[int] = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


def read_norm_off_by_default(monkeypatch) -> None:
    """Until ``monkeypatch`` is undone, delta-rule memories are built as rlseq built them before ``output_norm=True``
    became their default: models made then are saved without the norm or the keyword, as old saves are."""
    from rlseq.policies.memory import _DeltaRuleMemory

    monkeypatch.setitem(_DeltaRuleMemory.__init__.__kwdefaults__, "output_norm", False)
