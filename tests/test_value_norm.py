"""PopArt value normalisation (rlseq.policies.actor_critic.ValueNormalizer) and its use in MemoryPPO."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from rlseq.policies.actor_critic import ValueNormalizer


def _head(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(8, 1)


@pytest.mark.parametrize("scale, shift", [(1.0, 0.0), (1e3, 0.0), (1.0, 1e4), (30.0, -500.0), (1e-3, 0.0), (1e-3, 5e-3)])
def test_update_preserves_every_output_and_tracks_the_returns(scale, shift):
    head = _head()
    norm = ValueNormalizer(head)
    latent = torch.randn(64, 8)
    g = torch.Generator().manual_seed(1)
    norm.update(shift + scale * torch.randn(4096, generator=g))  # the first: sets the statistics only
    for _ in range(5):
        before = norm.denormalize(head(latent)).detach().double()
        returns = shift + scale * torch.randn(4096, generator=g)
        norm.update(returns)
        after = norm.denormalize(head(latent)).detach().double()
        torch.testing.assert_close(after, before, atol=1e-4 * max(1.0, abs(shift), scale), rtol=1e-5)
    # debiased averages of the moments: the statistics of the returns, small ones included
    assert math.isclose(float(norm.mean), shift, abs_tol=0.1 * scale)
    assert math.isclose(float(norm.std), scale, rel_tol=0.1)


def test_the_first_update_sets_the_statistics_and_leaves_the_head_as_it_is():
    """An untrained head's outputs mean nothing: the first update takes them as normalised, so a zeroed head (as
    the policy makes it) predicts the first rollout's mean."""
    head = _head()
    norm = ValueNormalizer(head)
    w, b = head.weight.detach().clone(), head.bias.detach().clone()
    norm.update(1e4 + 30 * torch.randn(1000, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(head.weight, w) and torch.equal(head.bias, b)
    assert float(norm.mean) == pytest.approx(1e4, rel=1e-2) and float(norm.std) == pytest.approx(30, rel=0.1)
    nn.init.zeros_(head.weight), nn.init.zeros_(head.bias)
    torch.testing.assert_close(norm.denormalize(head(torch.randn(4, 8))).detach(), norm.mean.expand(4, 1))


def test_small_returns_get_normalised_targets_of_size_one():
    """Returns of size 1e-3 are normalised as returns of size 1e3 are: targets (R − μ)/σ of spread ~1 (a floor of
    σ at 1 left them at 1e-3, so the critic got almost no signal)."""
    norm = ValueNormalizer(_head())
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        returns = 2e-3 + 1e-3 * torch.randn(4096, generator=g)
        norm.update(returns)
    targets = (returns - norm.mean) / norm.std
    assert 0.8 < float(targets.std()) < 1.2


@pytest.mark.parametrize("value, bound", [(0.3, 1e-4), (-5e4, 5e-2)])
def test_a_constant_return_puts_std_at_its_floor(value, bound):
    """The floor is 1e-4, or 1e-6 of |μ| where that is larger (below it float32 values cannot resolve σ)."""
    head = _head()
    norm = ValueNormalizer(head)
    latent = torch.randn(16, 8)
    norm.update(torch.full((100,), value))  # the first update: statistics only
    assert float(norm.std) == pytest.approx(bound, rel=1e-6) and float(norm.mean) == pytest.approx(value, rel=1e-6)
    norm.std.fill_(1.0)  # as if σ had been 1: the next update takes it to the floor
    before = norm.denormalize(head(latent)).detach()
    w = head.weight.detach().clone()
    norm.update(torch.full((100,), value))
    assert float(norm.std) == pytest.approx(bound, rel=1e-6)
    torch.testing.assert_close(head.weight.detach(), w / bound, rtol=1e-6, atol=0)  # σ from 1 to the floor
    # outputs preserved up to float32's rounding of values of size |value|
    ulp = float(np.spacing(np.float32(abs(value))))
    torch.testing.assert_close(norm.denormalize(head(latent)).detach(), before, rtol=0, atol=2 * ulp + 1e-6)


def test_std_is_capped():
    norm = ValueNormalizer(_head())
    norm.update(1e9 * torch.randn(1000, generator=torch.Generator().manual_seed(3)))
    assert float(norm.std) == 1e6


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="min_std"):
        ValueNormalizer(_head(), min_std=0.0)
    with pytest.raises(ValueError, match="min_std"):
        ValueNormalizer(_head(), min_std=10.0, max_std=1.0)
    with pytest.raises(ValueError, match="rel_min_std"):
        ValueNormalizer(_head(), rel_min_std=-1.0)


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


def _adam_twins(fused: bool, amsgrad: bool):
    """Two copies of a head, each with its normaliser and Adam, trained 5 steps on the same targets."""
    heads = [_head(), _head()]
    norms = [ValueNormalizer(h) for h in heads]
    opts = [torch.optim.Adam(h.parameters(), lr=1e-2, eps=1e-12, fused=fused, amsgrad=amsgrad) for h in heads]
    g = torch.Generator().manual_seed(4)
    latent, returns = torch.randn(256, 8, generator=g), 3.0 + 2.0 * torch.randn(256, generator=g)
    for norm in norms:
        norm.update(returns)
    for _ in range(5):
        for h, norm, opt in zip(heads, norms, opts):
            _adam_step(h, norm, opt, latent, returns)
    return heads, norms, opts, latent, returns


def _outputs64(head: nn.Linear, latent: torch.Tensor) -> torch.Tensor:
    return (latent.double() @ head.weight.detach().double().T + head.bias.detach().double()).squeeze(-1)


def _adam_step(head, norm, opt, latent, returns) -> tuple[torch.Tensor, float]:
    """One Adam step of the normalised loss. Returns the change of the head's normalised outputs ``[N]`` (in
    float64, from the float32 parameters) and the most float32 rounding of the parameters can make of it."""
    before = _outputs64(head, latent)
    opt.zero_grad()
    loss = ((head(latent).squeeze(-1) - (returns - norm.mean) / norm.std) ** 2).mean()
    loss.backward()
    opt.step()
    # an ulp of each parameter, through |latent| summed over inputs
    ulp = 2.0 ** -23
    w, b = head.weight.detach(), head.bias.detach()
    rounding = ulp * (float(w.abs().max()) * float(latent.abs().sum(1).max()) + float(b.abs().max()))
    return _outputs64(head, latent) - before, rounding


@pytest.mark.parametrize("fused, amsgrad", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("factor", [1e3, 1e-3])
def test_adam_moments_follow_the_rescale(factor, fused, amsgrad):
    """After σ moves ×``factor``, Adam's next step of the head's normalised outputs is the step it would have taken
    had the statistics not moved: the rescale multiplies the head's gradients by σ_old/σ_new, and its moments are
    multiplied by that factor and its square."""
    (kept, moved), (norm_kept, norm_moved), (opt_kept, opt_moved), latent, returns = _adam_twins(fused, amsgrad)
    raw = norm_moved.denormalize(moved(latent)).detach()
    # new returns of a different spread (the same mean): σ moves, the head is rescaled, its outputs preserved
    g = torch.Generator().manual_seed(5)
    wide = 3.0 + 2.0 * factor * torch.randn(4096, generator=g)
    norm_moved.decay = 0.0  # forget the old spread at once
    norm_moved.update(wide, opt_moved)
    ratio = float(norm_moved.std) / float(norm_kept.std)
    assert ratio == pytest.approx(factor, rel=0.2)
    torch.testing.assert_close(norm_moved.denormalize(moved(latent)).detach(), raw, rtol=1e-4, atol=1e-4 * max(1, factor))
    # the same raw targets: the moved head's normalised gradient is the kept head's divided by the ratio
    m, v = (dict(opt_kept.state[kept.weight]), dict(opt_moved.state[moved.weight]))
    torch.testing.assert_close(v["exp_avg"], m["exp_avg"] * ratio ** -1, rtol=1e-5, atol=0)
    torch.testing.assert_close(v["exp_avg_sq"], m["exp_avg_sq"] * ratio ** -2, rtol=1e-5, atol=0)
    step_kept, rounding_kept = _adam_step(kept, norm_kept, opt_kept, latent, returns)
    step_moved, rounding_moved = _adam_step(moved, norm_moved, opt_moved, latent, returns)
    rounding = rounding_kept + rounding_moved
    assert float(step_kept.abs().max()) > 100 * rounding  # a step, not rounding
    torch.testing.assert_close(step_moved, step_kept, rtol=1e-5, atol=rounding)


@pytest.mark.parametrize("factor", [1e3, 1e-3])
def test_without_the_optimizer_the_adam_step_differs(factor):
    """The check above has power: with the moments left at the old scale, the step is another one."""
    (kept, moved), (norm_kept, norm_moved), (opt_kept, opt_moved), latent, returns = _adam_twins(False, False)
    wide = 3.0 + 2.0 * factor * torch.randn(4096, generator=torch.Generator().manual_seed(5))
    norm_moved.decay = 0.0
    norm_moved.update(wide)  # no optimizer: its moments keep the old scale
    step_kept, rounding_kept = _adam_step(kept, norm_kept, opt_kept, latent, returns)
    step_moved, rounding_moved = _adam_step(moved, norm_moved, opt_moved, latent, returns)
    assert not torch.allclose(step_moved, step_kept, rtol=1e-5, atol=rounding_kept + rounding_moved)
    assert float((step_moved - step_kept).abs().max()) > 0.05 * float(step_kept.abs().max())


def test_training_hands_the_optimizer_to_the_normaliser():
    """MemoryPPO's train() rescales the value head's Adam moments with its statistics."""
    import gymnasium as gym

    from rlseq.algos import MemoryPPO

    model = MemoryPPO("MlpPolicy", gym.make("CartPole-v1"), n_steps=16, n_epochs=1, seed=0,
                      policy_kwargs=dict(memory="gru"))
    norm = model.policy.value_normalizer
    calls, update = [], norm.update
    norm.update = lambda returns, optimizer=None: (calls.append(optimizer), update(returns, optimizer))[1]
    model.learn(32)
    assert len(calls) == 2 and all(opt is model.policy.optimizer for opt in calls)


def _gae64(rewards, values, starts, last_values, dones, gamma, lam):
    """GAE(λ) in float64 of float32 records ``[T, E]``: the reference."""
    r, v = rewards.double(), values.double()
    adv = torch.zeros_like(v)
    last = torch.zeros(v.shape[1], dtype=torch.float64)
    for t in reversed(range(v.shape[0])):
        if t == v.shape[0] - 1:
            nnt, nv = 1.0 - dones.double(), last_values.double()
        else:
            nnt, nv = 1.0 - starts[t + 1].double(), v[t + 1]
        last = r[t] + gamma * nv * nnt - v[t] + gamma * lam * nnt * last
        adv[t] = last
    return adv, adv + v


def test_gae_is_exact_at_a_value_shift_of_1e6():
    """Values of 1e6 + O(1) and rewards that keep them there: in float32 ``r + γV' − V`` cancels to ~0.06 per step
    and the advantages (of size ~1) are off by tenths; the buffer computes them in float64."""
    from gymnasium import spaces

    from rlseq.algos.buffer import SequenceRolloutBuffer

    T, E, gamma, lam, shift = 128, 8, 0.99, 0.95, 1e6
    g = torch.Generator().manual_seed(6)
    buf = SequenceRolloutBuffer(T, E, spaces.Box(-1, 1, (3,)), spaces.Discrete(2), "cpu", gamma=gamma, gae_lambda=lam)
    buf.reset(torch.zeros(E, 4))
    starts = torch.rand(T + 1, E, generator=g) < 0.02
    for t in range(T):
        buf.add_step(torch.zeros(E, 3), torch.zeros(E, dtype=torch.long), starts[t],
                     shift + torch.randn(E, generator=g), torch.zeros(E))
        # (1 − γ)·shift per step and the whole shift at an episode's last step keep every value at shift + O(1)
        base = torch.where(starts[t + 1], shift, (1 - gamma) * shift)
        buf.add_rewards(base + torch.randn(E, generator=g))  # reward scale 1
    last_values, dones = shift + torch.randn(E, generator=g), starts[T]
    adv_ref, ret_ref = _gae64(buf.rewards, buf.values, buf.episode_starts, last_values, dones, gamma, lam)

    # the same recursion in float32 (the computation as it was): its error at this shift
    adv32 = torch.zeros(T, E)
    last = torch.zeros(E)
    for t in reversed(range(T)):
        nnt, nv = ((1.0 - dones.float(), last_values) if t == T - 1
                   else (1.0 - buf.episode_starts[t + 1].float(), buf.values[t + 1]))
        last = buf.rewards[t] + gamma * nv * nnt - buf.values[t] + gamma * lam * nnt * last
        adv32[t] = last
    assert float((adv32.double() - adv_ref).abs().max()) > 0.1

    buf.compute_returns_and_advantage(last_values, dones)
    # advantages below 32 (a few reward scales): float32 stores them to half an ulp, < 1e-6 of the reward scale
    assert float(adv_ref.abs().max()) < 32
    torch.testing.assert_close(buf.advantages.double(), adv_ref, rtol=0, atol=1e-6)
    # returns of size 1e6 in float32: one rounding of the float64 ones (half an ulp, 0.03)
    torch.testing.assert_close(buf.returns, ret_ref.float(), rtol=0, atol=0)


@pytest.mark.parametrize("T", [1, 2, 7, 128, 300])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_gae_scan_matches_the_step_by_step_recursion(T, scale):
    """The buffer's GAE (a log-depth scan) against the float64 loop, on fresh random rewards and values of several
    scales, with episode starts at random positions, back to back and at t = 0, and some envs done at the end."""
    from gymnasium import spaces

    from rlseq.algos.buffer import SequenceRolloutBuffer

    E, gamma, lam = 6, 0.99, 0.95
    g = torch.Generator().manual_seed(T)
    buf = SequenceRolloutBuffer(T, E, spaces.Box(-1, 1, (3,)), spaces.Discrete(2), "cpu", gamma=gamma, gae_lambda=lam)
    buf.reset(torch.zeros(E, 4))
    starts = torch.rand(T + 1, E, generator=g) < 0.1
    starts[0, 0] = True
    starts[1: 3, 1] = True  # back to back (t = 1, 2 where T allows)
    for t in range(T):
        buf.add_step(torch.zeros(E, 3), torch.zeros(E, dtype=torch.long), starts[t],
                     scale * torch.randn(E, generator=g), torch.zeros(E))
        buf.add_rewards(scale * torch.randn(E, generator=g))
    last_values, dones = scale * torch.randn(E, generator=g), starts[T]
    adv_ref, ret_ref = _gae64(buf.rewards, buf.values, buf.episode_starts, last_values, dones, gamma, lam)
    buf.compute_returns_and_advantage(last_values, dones)
    # float64 sums in another order (~1e-16 apart), each rounded once to float32: at most one float32 ulp apart
    torch.testing.assert_close(buf.advantages, adv_ref.float(), rtol=2**-23, atol=0)
    torch.testing.assert_close(buf.returns, ret_ref.float(), rtol=2**-23, atol=0)


def test_rewards_of_size_1e_3_give_the_critic_targets_of_size_one():
    """CartPole with rewards ×1e-3 (returns ~0.01 ± 0.005): from the first update on, the normalised targets
    (R − μ)/σ have a spread of ~1. A head with a random start sets the first statistics with its own outputs (σ 0.5,
    spreads 1.00 / 0.29 / 0.19 / 0.14 over these 4 updates); with σ floored at 1 as well, 0.50 / 0.13 / 0.08 / 0.05,
    falling towards the returns' 0.005 as the critic learns."""
    import gymnasium as gym

    from rlseq.algos import MemoryPPO

    env = gym.wrappers.TransformReward(gym.make("CartPole-v1"), lambda r: 1e-3 * r)
    model = MemoryPPO("MlpPolicy", env, n_steps=128, n_epochs=2, seed=0, policy_kwargs=dict(memory="gru"))
    policy = model.policy
    assert not policy.value_net.weight.any() and not policy.value_net.bias.any()  # the critic starts at 0
    spreads = []
    for k in range(4):
        model.learn(128, reset_num_timesteps=k == 0)
        norm, returns = policy.value_normalizer, model.rollout_buffer.returns
        spreads.append(float(((returns - norm.mean) / norm.std).std()))
    assert float(norm.std) < 0.02
    assert all(0.5 < s < 2 for s in spreads), spreads
    env.close()
