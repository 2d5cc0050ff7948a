"""Test helpers: random kernel inputs (fresh every call, never zeros, with resets and extreme key norms), the
comparison of eager and CUDA-graph rollouts, and a tiny `bench train` call."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    *,
    rule: str,
    dtype: torch.dtype = torch.float64,
    reset_prob: float = 0.1,
    key_norms: tuple[float, float] = (1e-4, 1e4),
    beta_max: float = 2.0,
    generator: torch.Generator | None = None,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Inputs for ``chunk_rule``. EFLA keys get log-uniform norms in ``key_norms``; DeltaNet keys are unit
    (as its callers normalise). Resets hit random positions plus t = 0, two consecutive steps and, when T
    is long enough, the start of the second chunk of 16."""
    g = generator
    kw = dict(dtype=torch.float64, device=device)
    q = torch.randn(B, T, H, K, generator=g, **kw)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, **kw), dim=-1)
    if rule == "efla":
        lo, hi = torch.log10(torch.tensor(key_norms, dtype=torch.float64))
        k = k * 10 ** (lo + (hi - lo) * torch.rand(B, T, H, 1, generator=g, **kw))
    v = torch.randn(B, T, H, V, generator=g, **kw)
    beta = beta_max * torch.rand(B, T, H, generator=g, **kw)
    resets = torch.rand(B, T, generator=g, device=device) < reset_prob
    resets[0, 0] = True
    if T >= 4:
        resets[-1, T // 2 : T // 2 + 2] = True
    if T > 17:
        resets[0, 16] = True
    initial_state = torch.randn(B, H, K, V, generator=g, **kw)
    out = dict(q=q, k=k, v=v, beta=beta, resets=resets, initial_state=initial_state)
    return {n: (x.to(dtype) if x.is_floating_point() and n != "initial_state" else x) for n, x in out.items()}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖x − ref‖ / ‖ref‖`` in float64; NaN anywhere gives inf."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


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
