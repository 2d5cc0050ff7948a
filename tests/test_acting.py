"""The acting step (rlseq.algos.acting): eager on any device, CUDA graph on a GPU.

The CPU tests check the eager step against the policy's own ``forward``, the staging buffers and the error
paths. The CUDA tests (on the GPU machine: ``TRITON_INTERPRET=0 pytest tests/test_acting.py``; the Triton
interpreter that conftest.py turns on cannot run inside a CUDA graph) check that a graph replay
computes and draws exactly what the eager step does, through resets, weight updates and a new state tensor.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gymnasium import spaces

from rlseq.algos.acting import ActingStep
from rlseq.policies.actor_critic import MemoryPPOPolicy
from tests.helpers import assert_same_rollouts, collect_rollout

MEMORY_KWARGS = {"efla": {"n_heads": 2, "head_dim": 16}, "deltanet": {"n_heads": 2, "head_dim": 16},
                 "lstm": {"hidden_size": 32}, "none": {}}
IMAGE = spaces.Box(0, 255, (3, 64, 64), np.uint8)
cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                          reason="CUDA graphs need a GPU and compiled Triton kernels (TRITON_INTERPRET=0)")


def _policy(memory: str, space: spaces.Space = IMAGE, device: str = "cpu", **kwargs) -> MemoryPPOPolicy:
    torch.manual_seed(0)
    policy = MemoryPPOPolicy(space, spaces.Discrete(15), lambda _: 1e-3, memory=memory,
                             memory_kwargs=MEMORY_KWARGS[memory], **kwargs)
    return policy.to(device)


def _obs(space: spaces.Space, n: int, rng: np.random.Generator):
    if isinstance(space, spaces.Dict):
        return {k: _obs(s, n, rng) for k, s in space.spaces.items()}
    if space.dtype == np.uint8:
        return rng.integers(0, 256, (n, *space.shape), dtype=np.uint8)
    return rng.standard_normal((n, *space.shape)).astype(space.dtype)


def _starts(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.random(n) < 0.3


@pytest.mark.parametrize("memory", ["efla", "lstm", "none"])
def test_eager_step_equals_policy_forward(memory):
    policy, rng = _policy(memory), np.random.default_rng(1)
    acting = ActingStep(policy)
    state_a, state_b = policy.initial_state(4), policy.initial_state(4)
    for _ in range(5):
        obs, starts = _obs(IMAGE, 4, rng), _starts(4, rng)
        torch.manual_seed(7)
        out = acting.step(obs, starts, state_a)
        torch.manual_seed(7)
        with torch.no_grad():
            actions, values, log_probs = policy(torch.as_tensor(obs), state_b, torch.as_tensor(starts))
        assert torch.equal(out.actions, actions) and np.array_equal(out.actions_np, actions.numpy())
        assert torch.equal(out.values, values) and torch.equal(out.log_probs, log_probs)
        assert torch.equal(state_a, state_b)
        assert torch.equal(out.obs, torch.as_tensor(obs)) and torch.equal(out.episode_starts, torch.as_tensor(starts))


def test_predict_with_a_wrong_episode_start_length_names_the_expected_shape():
    policy = _policy("efla", spaces.Box(-1.0, 1.0, (4,), np.float32))
    obs = np.zeros((2, 4), np.float32)
    actions, state = policy.predict(obs, episode_start=np.ones(2, bool))
    assert actions.shape == (2,) and state.shape == (2, *policy.memory.state_shape)
    for bad in (np.ones(3, bool), np.ones((2, 2), bool), np.ones(1, bool)):
        with pytest.raises(ValueError, match=r"episode_start must have shape \[2\] .*got shape \[" + ", ".join(map(str, bad.shape))):
            policy.predict(obs, state=state, episode_start=bad)


def test_acting_leaves_the_process_wide_distribution_validation_alone(monkeypatch):
    # set, not assumed: True under python without -O, but torch.compile's first use turns it off process-wide (so
    # after a compiled test, tests/test_training_graph.py on a GPU, it is False); monkeypatch restores it
    monkeypatch.setattr(torch.distributions.Distribution, "_validate_args", True)
    seen = []
    real = torch.distributions.Categorical.sample

    def sample(self, *args, **kwargs):
        seen.append((torch.distributions.Distribution._validate_args, self._validate_args))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.distributions.Categorical, "sample", sample)
    policy = _policy("efla", spaces.Box(-1.0, 1.0, (4,), np.float32))
    with torch.no_grad():
        policy.act(torch.zeros(2, 4), policy.initial_state(2), torch.ones(2, dtype=torch.bool))
    # the global default stays as it was; only the policy's distribution skips checks
    assert seen == [(True, False)]
    assert torch.distributions.Distribution._validate_args is True


@pytest.mark.parametrize("action_space", [spaces.Discrete(5), spaces.MultiDiscrete([3, 4]), spaces.MultiBinary(3),
                                          spaces.Box(-1.0, 1.0, (2,), np.float32)])
def test_unvalidated_distributions_equal_sb3s_own(action_space):
    torch.manual_seed(0)
    policy = MemoryPPOPolicy(spaces.Box(-1.0, 1.0, (4,), np.float32), action_space, lambda _: 1e-3, memory="none")
    with torch.no_grad():
        if hasattr(policy, "log_std"):
            policy.log_std.normal_()
        params = policy.action_net(torch.randn(6, policy.action_net.in_features))
        ours = policy._distribution(params)
        actions = ours.get_actions()
        log_prob, entropy = ours.log_prob(actions), ours.entropy()
        from stable_baselines3.common.distributions import make_proba_distribution

        sb3 = make_proba_distribution(action_space)
        sb3 = sb3.proba_distribution(params, policy.log_std) if hasattr(policy, "log_std") else \
            sb3.proba_distribution(action_logits=params)
    assert torch.equal(log_prob, sb3.log_prob(actions)) and torch.equal(entropy, sb3.entropy())
    torch_dists = ours.distribution if isinstance(ours.distribution, list) else [ours.distribution]
    assert not any(d._validate_args for d in torch_dists)


def test_staging_buffers_are_reused_and_rebuilt_when_the_input_changes():
    policy, rng = _policy("efla"), np.random.default_rng(2)
    acting = ActingStep(policy)
    first = acting.step(_obs(IMAGE, 4, rng), _starts(4, rng), policy.initial_state(4)).obs
    second = acting.step(_obs(IMAGE, 4, rng), _starts(4, rng), policy.initial_state(4)).obs
    assert second.data_ptr() == first.data_ptr()
    third = acting.step(_obs(IMAGE, 6, rng), _starts(6, rng), policy.initial_state(6))
    assert third.obs.shape[0] == 6 and third.actions.shape == (6,)


def test_dict_observations():
    space = spaces.Dict({"image": IMAGE, "vector": spaces.Box(-np.inf, np.inf, (16,), np.float32)})
    policy, rng = _policy("efla", space), np.random.default_rng(3)
    acting = ActingStep(policy)
    obs, starts = _obs(space, 4, rng), _starts(4, rng)
    state_a, state_b = policy.initial_state(4), policy.initial_state(4)
    torch.manual_seed(5)
    out = acting.step(obs, starts, state_a)
    torch.manual_seed(5)
    with torch.no_grad():
        actions, values, _ = policy({k: torch.as_tensor(v) for k, v in obs.items()}, state_b, torch.as_tensor(starts))
    assert torch.equal(out.actions, actions) and torch.equal(out.values, values)
    assert torch.equal(out.obs["vector"], torch.as_tensor(obs["vector"]))


def test_non_finite_outputs_are_reported_with_where():
    policy, rng = _policy("none"), np.random.default_rng(4)
    with torch.no_grad():
        policy.value_net.bias.fill_(float("nan"))
    acting = ActingStep(policy)
    with pytest.raises(FloatingPointError, match="non-finite action parameters or values at acting at env step 640 "
                                                 "while the none memory state is finite"):
        acting.step(_obs(IMAGE, 4, rng), _starts(4, rng), policy.initial_state(4), where="acting at env step 640")


def test_non_finite_memory_state_is_blamed_on_the_memory():
    policy, rng = _policy("efla"), np.random.default_rng(5)
    state = policy.initial_state(4)
    state[2, 5] = float("inf")
    with pytest.raises(FloatingPointError, match=r"non-finite efla memory state at here: batch indices \[2\]"):
        ActingStep(policy).step(_obs(IMAGE, 4, rng), np.zeros(4, bool), state, where="here")


def test_the_graph_key_follows_the_state_and_every_parameter_that_moves():
    """What makes the graph be captured again: a new state tensor (or shape), a parameter moved (``.data``
    replaced, as ``.to()`` does); an in-place update (the optimizer's, ``load_state_dict``'s) keeps the key."""
    policy = _policy("efla")
    acting = ActingStep(policy)
    state = policy.initial_state(4)
    key = acting.graph_key(state)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    policy.load_state_dict(policy.state_dict())
    assert acting.graph_key(state) == key
    assert acting.graph_key(state.clone()) != key
    assert acting.graph_key(policy.initial_state(5)) != key
    last = list(policy.parameters())[-1]
    last.data = last.data.clone()
    assert acting.graph_key(state) != key


def test_cuda_graph_needs_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_graph acting needs the policy on a CUDA device; it is on cpu"):
        ActingStep(_policy("none"), cuda_graph=True)


# --- on the GPU ---------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("memory", ["efla", "deltanet", "lstm", "none"])
def test_graph_replay_equals_eager_steps(memory):
    policy, rng = _policy(memory, device="cuda"), np.random.default_rng(6)
    eager, graphed = ActingStep(policy), ActingStep(policy, cuda_graph=True)
    n = 64
    state_e, state_g = policy.initial_state(n), policy.initial_state(n)
    with torch.no_grad():  # a non-zero memory to start from
        state_e.normal_()
        state_g.copy_(state_e)
    for t in range(12):
        obs, starts = _obs(IMAGE, n, rng), _starts(n, rng)
        if t == 6:  # an optimizer-like in-place weight update must reach the graph
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.01 * torch.randn_like(p))
        torch.cuda.manual_seed(100 + t)
        e = eager.step(obs, starts, state_e)
        e = [x.clone() for x in (e.actions, e.values, e.log_probs)]
        torch.cuda.manual_seed(100 + t)
        g = graphed.step(obs, starts, state_g)
        assert torch.equal(g.actions, e[0]), f"step {t}: the graph drew other actions"
        torch.testing.assert_close(g.values, e[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g.log_probs, e[2], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state_g, state_e, rtol=1e-5, atol=1e-6)


@cuda
def test_graph_is_captured_again_for_a_new_state_tensor_and_does_not_touch_the_old_one():
    policy, rng = _policy("efla", device="cuda"), np.random.default_rng(7)
    acting = ActingStep(policy, cuda_graph=True)
    old = policy.initial_state(8)
    acting.step(_obs(IMAGE, 8, rng), np.ones(8, bool), old)
    first_graph = acting._graph
    kept = old.clone()
    new = policy.initial_state(8)
    acting.step(_obs(IMAGE, 8, rng), np.ones(8, bool), new)
    assert acting._graph is not first_graph
    assert torch.equal(old, kept) and new.abs().sum() > 0


@cuda
def test_graph_reports_non_finite_outputs():
    policy, rng = _policy("efla", device="cuda"), np.random.default_rng(8)
    acting = ActingStep(policy, cuda_graph=True)
    state = policy.initial_state(8)
    acting.step(_obs(IMAGE, 8, rng), np.ones(8, bool), state)
    state[3, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"non-finite efla memory state at step 2: batch indices \[3\]"):
        acting.step(_obs(IMAGE, 8, rng), np.zeros(8, bool), state, where="step 2")


@cuda
@pytest.mark.parametrize("memory", ["efla", "lstm"])
def test_training_with_graph_acting_reproduces_eager_acting(memory):
    """Two seeded runs, eager and graph acting: the same rollouts (actions, values, memory) and the same update."""
    from stable_baselines3.common.logger import configure

    from rlseq.algos import MemoryPPO
    from rlseq.envs import make_procgen

    buffers = []
    for cuda_graph in (False, True):
        env = make_procgen("caveflyer", 16, seed=0, num_threads=0)
        model = MemoryPPO("CnnPolicy", env, n_steps=32, n_minibatches=2, n_epochs=1, seed=0, device="cuda",
                          cuda_graph=cuda_graph, policy_kwargs=dict(memory=memory, memory_kwargs=MEMORY_KWARGS[memory]))
        model.set_logger(configure(None, []))
        runs = []
        for rollout in range(2):  # the second rollout acts with the updated weights through the same graph
            assert collect_rollout(model, setup=rollout == 0)
            b = model.rollout_buffer
            runs.append([x.clone() for x in (b.actions, b.values, b.log_probs, b.episode_starts, model._memory_state)])
            model.train()
        assert (model._acting._graph is not None) == cuda_graph
        buffers.append(runs)
        env.close()
    assert_same_rollouts(*buffers)
