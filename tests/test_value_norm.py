"""PopArt value normalisation (rlseq.policies.actor_critic.ValueNormalizer) and its use in MemoryPPO."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rlseq.policies.actor_critic import ValueNormalizer


def _head(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(8, 1)


@pytest.mark.parametrize("scale, shift", [(1.0, 0.0), (1e3, 0.0), (1.0, 1e4), (30.0, -500.0)])
def test_update_preserves_every_output_and_tracks_the_returns(scale, shift):
    head = _head()
    norm = ValueNormalizer(head)
    latent = torch.randn(64, 8)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        before = norm.denormalize(head(latent)).detach().double()
        returns = shift + scale * torch.randn(4096, generator=g)
        norm.update(returns)
        after = norm.denormalize(head(latent)).detach().double()
        torch.testing.assert_close(after, before, atol=1e-4 * max(1.0, abs(shift), scale), rtol=1e-5)
    # debiased averages of the moments: the statistics of the returns (std floored at 1)
    assert math.isclose(float(norm.mean), shift, abs_tol=0.1 * scale)
    assert math.isclose(float(norm.std), max(scale, 1.0), rel_tol=0.1)


def test_std_never_drops_below_one_and_a_constant_return_is_not_amplified():
    head = _head()
    norm = ValueNormalizer(head)
    w = head.weight.detach().clone()
    norm.update(torch.full((100,), 0.3))
    assert float(norm.std) == 1.0 and math.isclose(float(norm.mean), 0.3, rel_tol=1e-6)
    torch.testing.assert_close(head.weight.detach(), w)  # σ unchanged: the weights too


def test_non_finite_targets_are_left_out_of_the_statistics():
    norm, clean = ValueNormalizer(_head()), ValueNormalizer(_head())
    r = torch.randn(1000) * 50 + 7
    bad = r.clone()
    bad[::10] = float("nan")
    bad[5] = float("inf")
    norm.update(bad)
    keep = torch.isfinite(bad)
    clean.update(r[keep])
    torch.testing.assert_close(norm.mean, clean.mean)
    torch.testing.assert_close(norm.std, clean.std)
    assert torch.isfinite(norm.moments).all()


def test_statistics_are_saved_with_the_model_and_loaded_back(tmp_path):
    import gymnasium as gym

    from rlseq.algos import MemoryPPO

    env = gym.make("CartPole-v1")
    model = MemoryPPO("MlpPolicy", env, n_steps=32, n_epochs=1, seed=0, policy_kwargs=dict(memory="gru"))
    model.policy.value_normalizer.update(torch.randn(500) * 40 + 100)
    obs = torch.as_tensor(env.reset(seed=0)[0]).unsqueeze(0)
    state = model.policy.initial_state(1)
    starts = torch.ones(1, dtype=torch.bool)
    values = model.policy.predict_values(obs, state, starts)
    model.save(tmp_path / "m.zip")
    loaded = MemoryPPO.load(tmp_path / "m.zip")
    torch.testing.assert_close(loaded.policy.value_normalizer.std, model.policy.value_normalizer.std)
    torch.testing.assert_close(loaded.policy.predict_values(obs, state, starts), values)
    assert float(loaded.policy.value_normalizer.std) > 10


@pytest.mark.parametrize("with_clip", [False, True])
def test_the_value_loss_is_the_normalised_heads_loss(with_clip):
    """MemoryPPO's value loss equals the MSE of the normalised head against (returns - μ)/σ, and a value clip range
    is in units of σ."""
    import gymnasium as gym

    from rlseq.algos import MemoryPPO

    env = gym.make("CartPole-v1")
    model = MemoryPPO("MlpPolicy", env, n_steps=16, n_epochs=1, seed=0, clip_range_vf=0.2 if with_clip else None,
                      policy_kwargs=dict(memory="efla"))
    model.learn(16)  # fills the buffer
    policy = model.policy
    policy.value_normalizer.update(model.rollout_buffer.returns * 1e3 + 5e3)
    batch = next(iter(model.rollout_buffer.minibatches(1)))
    batch.returns.mul_(1e3).add_(5e3)
    mu, sigma = policy.value_normalizer.mean, policy.value_normalizer.std
    batch.old_values.add_(0.5 * sigma)  # half a σ away: a clip range of 0.2σ binds, one of 0.2 raw units would too
    values, _, _ = policy.evaluate_sequences(batch.observations, batch.actions, batch.initial_state, batch.episode_starts)
    losses = model.ppo_losses(batch, 0.2, 0.2 if with_clip else None)
    pred = (values.flatten() - mu) / sigma
    if with_clip:
        old = (batch.old_values.flatten() - mu) / sigma
        pred = old + torch.clamp(pred - old, -0.2, 0.2)
    expected = ((pred - (batch.returns.flatten() - mu) / sigma) ** 2).mean()
    torch.testing.assert_close(losses["value_loss"], expected, rtol=1e-4, atol=1e-6)
    assert float(sigma) > 100  # the returns were made large: the normalisation is doing something


def test_value_norm_can_be_turned_off():
    import gymnasium as gym

    from rlseq.algos import MemoryPPO

    model = MemoryPPO("MlpPolicy", gym.make("CartPole-v1"), n_steps=16, policy_kwargs=dict(value_norm=False))
    assert model.policy.value_normalizer is None
    assert model.policy.value_scale() == 1.0 and model.policy.value_std() == 1.0
    assert "value_normalizer.std" not in model.policy.state_dict()
