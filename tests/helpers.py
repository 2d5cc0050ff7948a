"""Test helpers: the comparison of eager and CUDA-graph rollouts, a tiny `bench train` call and torch's thread
setting recorded instead of made (the kernel inputs and their error measure live in rlseq.bench.kernels, shared
with the benchmarks)."""

from __future__ import annotations

import torch


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


def record_torch_threads(monkeypatch) -> list[int]:
    """torch.set_num_threads's calls, recorded instead of made (the test process keeps its threads), with torch
    reporting its one-per-core default of 2 and no OMP_NUM_THREADS set."""
    calls: list[int] = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls
