"""Drop-in policies for the unmodified sb3_contrib.RecurrentPPO, the IMPALA CNN, and the memory task.

- Consistency through RecurrentPPO's own rollout buffer: the log-probs and values computed while acting equal
  those ``evaluate_actions`` recomputes from the stored states, to 1e-5 (fp32), for every memory and sharing
  mode, on the torch backend and with the Triton kernels under ``TRITON_INTERPRET=1``.
- Training makes one kernel call per minibatch per memory (no loop over time steps).
- learn / save / load / predict / evaluate_policy; identical actions after a save → load round-trip.
- CueRecall: EFLA, DeltaNet and the LSTM learn it; the memoryless controls stay at chance.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton kernel module is imported

import pathlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from gymnasium import spaces  # noqa: E402
from sb3_contrib import RecurrentPPO  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.evaluation import evaluate_policy  # noqa: E402

from rlseq.policies import (  # noqa: E402
    MEMORIES,
    DeltaNetCnnPolicy,
    DeltaNetMlpPolicy,
    DeltaNetMultiInputPolicy,
    EFLAMemory,
    EflaCnnPolicy,
    EflaMlpPolicy,
    EflaMultiInputPolicy,
    ImpalaCNN,
    ImpalaCombinedExtractor,
    MemoryMlpPolicy,
)
from rlseq.policies.sb3_contrib import PackedMemory  # noqa: E402
from rlseq.tasks import CueRecallEnv, chance_return  # noqa: E402
from tests.test_memory import _triton_ready  # noqa: E402

TOL = 1e-5
SMALL = {
    "efla": dict(n_heads=2, head_dim=8, value_dim=8, d_model=16),
    "deltanet": dict(n_heads=2, head_dim=8, d_model=16),
    "gru": dict(hidden_size=16),
    "lstm": dict(hidden_size=16),
    "none": {},
}


def _cue_env(n_envs: int = 3, delay: int = 3, seed: int = 0):
    return make_vec_env(CueRecallEnv, n_envs=n_envs, seed=seed, env_kwargs=dict(delay=delay))


def _perturb(policy, seed: int = 0, scale: float = 0.3) -> None:
    """Move all weights away from their init so that states, log-probs and values are far from trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


# -- extractors ---------------------------------------------------------------------------------------------


def test_impala_cnn_shapes_and_scaling():
    first = spaces.Box(0, 255, (3, 64, 64), np.uint8)
    last = spaces.Box(0, 255, (64, 64, 3), np.uint8)
    torch.manual_seed(0)
    cnn = ImpalaCNN(first)
    assert cnn.features_dim == 256 and cnn.channels == (16, 32, 32)
    assert cnn.linear.in_features == 32 * 8 * 8
    # 3 stages x (conv + 2 residual blocks of 2 convs) = 15 convolutions
    assert sum(isinstance(m, torch.nn.Conv2d) for m in cnn.modules()) == 15
    img = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    out_u8 = cnn(img)
    out_f = cnn(img.float() / 255.0)  # what SB3's preprocess_obs hands over: not divided a second time
    assert out_u8.shape == (2, 256) and (out_u8 >= 0).all()
    torch.testing.assert_close(out_u8, out_f)
    cnn_last = ImpalaCNN(last)
    cnn_last.load_state_dict(cnn.state_dict())
    torch.testing.assert_close(cnn_last(img.permute(0, 2, 3, 1)), out_u8)


def test_impala_combined_extractor():
    space = spaces.Dict(
        {
            "image": spaces.Box(0, 255, (64, 64, 3), np.uint8),
            "prev_action": spaces.Box(0.0, 1.0, (15,), np.float32),
            "prev_reward": spaces.Box(-np.inf, np.inf, (1,), np.float32),
        }
    )
    ext = ImpalaCombinedExtractor(space)
    assert ext.features_dim == 256 + 15 + 1
    obs = {
        "image": torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8),
        "prev_action": torch.eye(15)[:2],
        "prev_reward": torch.tensor([[0.5], [-1.0]]),
    }
    out = ext(obs)
    assert out.shape == (2, 272)
    torch.testing.assert_close(out[:, 256:], torch.cat([obs["prev_action"], obs["prev_reward"]], 1))


@pytest.mark.parametrize("policy_class", [EflaMultiInputPolicy, DeltaNetMultiInputPolicy])
def test_multi_input_policy_on_a_vector_only_dict_builds_the_default_width_memory(policy_class):
    # a Dict of vectors only: 4 + 1 features; the memory block projects them to its own width (d_model 128), so the
    # default memory is 4 heads with keys of d_model/2 and values of d_model/4 (EFLA) or both d_model/2 (DeltaNet),
    # not a block as narrow as the features
    space = spaces.Dict({"pos": spaces.Box(-1.0, 1.0, (4,), np.float32), "flag": spaces.Box(0.0, 1.0, (1,), np.float32)})
    policy = policy_class(space, spaces.Discrete(3), lambda _: 1e-3)
    assert policy.features_dim == 5
    heads = (4, 64, 32) if policy_class is EflaMultiInputPolicy else (4, 64, 64)
    for memory in (policy.memory_actor, policy.memory_critic):
        assert memory.in_features == 5 and memory.d_model == 128 and memory.out_features == 128
        assert (memory.n_heads, memory.head_dim, memory.value_dim) == heads
    assert policy.lstm_output_dim == 128
    from rlseq.policies.actor_critic import MemoryPPOPolicy

    ours = MemoryPPOPolicy(space, spaces.Discrete(3), lambda _: 1e-3, memory=policy_class.default_memory)
    assert ours.memory.d_model == 128 and (ours.memory.n_heads, ours.memory.head_dim, ours.memory.value_dim) == heads


# -- state packing and buffer sizing ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "kw"), [("efla", dict(n_heads=3, head_dim=5, value_dim=3)), ("lstm", {}), ("none", {})])
def test_packed_state_round_trip(name, kw):
    from rlseq.policies import make_memory

    packed = PackedMemory(make_memory(name, 6, **kw))
    n = packed.state_numel
    assert packed.num_layers == 1 and packed.hidden_size == max(1, -(-n // 2))  # both slots used (n = 45: 23 + 22)
    state = torch.randn(4, *packed.memory.state_shape)
    h, c = packed.pack(state)
    assert h.shape == c.shape == (1, 4, packed.hidden_size)
    torch.testing.assert_close(packed.unpack((h, c)), state)


def test_recurrent_ppo_sizes_buffers_from_the_packed_state():
    model = RecurrentPPO(EflaMlpPolicy, _cue_env(2), n_steps=8, batch_size=8, policy_kwargs=dict(memory_kwargs=SMALL["efla"]))
    assert isinstance(model.policy.memory_actor, EFLAMemory) and isinstance(model.policy.memory_critic, EFLAMemory)
    # the 2 x 8 x 8 matrix, its rotary position and the front end's window [3, d_model]: odd, one float of padding
    (n,) = model.policy.memory_actor.state_shape
    assert n == 2 * 8 * 8 + 1 + 3 * 16
    assert model.rollout_buffer.hidden_state_shape == (8, 1, 2, (n + 1) // 2)
    assert model._last_lstm_states.pi[0].shape == (1, 2, (n + 1) // 2)
    # no LSTM anywhere in the policy: the matrix memory replaces it
    assert not any(isinstance(m, torch.nn.LSTM) for m in model.policy.modules())


# -- acting == training, through RecurrentPPO's buffer -------------------------------------------------------


def _collect_and_compare(model: RecurrentPPO, batch_size: int) -> float:
    _, callback = model._setup_learn(model.n_steps * model.n_envs, None)
    model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=model.n_steps)
    model.policy.set_training_mode(True)
    worst = 0.0
    n_starts = 0
    for data in model.rollout_buffer.get(batch_size):
        actions = data.actions.long().flatten()
        values, log_prob, _ = model.policy.evaluate_actions(data.observations, actions, data.lstm_states, data.episode_starts)
        mask = data.mask > 0.5
        n_starts += int(data.episode_starts.sum())
        torch.testing.assert_close(log_prob[mask], data.old_log_prob[mask], atol=TOL, rtol=TOL)
        torch.testing.assert_close(values.flatten()[mask], data.old_values[mask], atol=TOL, rtol=TOL)
        worst = max(worst, (log_prob - data.old_log_prob)[mask].abs().max().item())
    assert n_starts > 0  # the trajectory held episode resets
    return worst


SHARING = {
    "separate": {},
    "shared": dict(shared_memory=True, enable_critic_memory=False),
    "ff-critic": dict(enable_critic_memory=False),
}
RPPO_CASES = (
    [pytest.param(name, "torch", "separate", id=f"{name}-torch-separate") for name in MEMORIES]
    + [pytest.param(name, "torch", sh, id=f"{name}-torch-{sh}") for name in ("efla", "lstm") for sh in ("shared", "ff-critic")]
    + [pytest.param(name, "triton", "separate", id=f"{name}-triton-interpret") for name in ("efla", "deltanet")]
)


@pytest.mark.parametrize(("name", "backend", "sharing"), RPPO_CASES)
def test_acting_matches_training_in_recurrent_ppo(name, backend, sharing):
    """PPO's ratio is 1 at the first minibatch: acting and the training path agree through the real buffer.
    Minibatches of 16 cut episodes (length 5) mid-way, so stored non-zero states are exercised too."""
    if backend == "triton":
        assert _triton_ready(), "the Triton kernels must run here under TRITON_INTERPRET=1 (tests/conftest.py sets it)"
    kw = dict(SMALL[name])
    if name in ("efla", "deltanet"):
        kw["backend"] = backend
    model = RecurrentPPO(
        MemoryMlpPolicy, _cue_env(3), n_steps=20, batch_size=16, seed=0,
        policy_kwargs=dict(memory=name, memory_kwargs=kw, **SHARING[sharing]),
    )
    _perturb(model.policy)
    _collect_and_compare(model, batch_size=16)


def test_training_is_one_kernel_call_per_minibatch(monkeypatch):
    """RecurrentPPO.train runs each memory once per minibatch (one chunk_rule call), never a loop over time."""
    import rlseq.policies.memory as mem

    calls = []
    orig = mem.chunk_rule
    monkeypatch.setattr(mem, "chunk_rule", lambda *a, **k: calls.append(a[0].shape) or orig(*a, **k))
    model = RecurrentPPO(EflaMlpPolicy, _cue_env(4), n_steps=16, batch_size=16, n_epochs=2, seed=0,
                         policy_kwargs=dict(memory_kwargs=SMALL["efla"]))
    model.learn(64)
    n_minibatches = 2 * (16 * 4) // 16
    assert len(calls) == 2 * n_minibatches  # actor + critic memory, once each per minibatch
    assert all(shape[1] > 1 for shape in calls)  # whole sequences, not single steps


# -- the drop-in contract -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [EflaMlpPolicy, DeltaNetMlpPolicy])
def test_learn_save_load_predict_round_trip(policy, tmp_path: pathlib.Path):
    env = _cue_env(2)
    model = RecurrentPPO(policy, env, n_steps=16, batch_size=16, n_epochs=1, seed=1,
                         policy_kwargs=dict(memory_kwargs=dict(n_heads=2, head_dim=8, value_dim=8)))
    model.learn(64)
    _perturb(model.policy, seed=3, scale=0.5)  # make deterministic actions depend on the state
    path = tmp_path / "model.zip"
    model.save(path)
    loaded = RecurrentPPO.load(path, env=env)
    assert type(loaded.policy) is policy
    assert loaded.policy.memory_actor.n_heads == 2

    obs_env = _cue_env(2, seed=7)
    obs = obs_env.reset()
    states = (None, None)
    starts = np.ones(2, dtype=bool)
    for _ in range(12):
        a0, states0 = model.predict(obs, state=states[0], episode_start=starts, deterministic=True)
        a1, states1 = loaded.predict(obs, state=states[1], episode_start=starts, deterministic=True)
        np.testing.assert_array_equal(a0, a1)
        np.testing.assert_array_equal(states0[0], states1[0])
        np.testing.assert_array_equal(states0[1], states1[1])
        states = (states0, states1)
        obs, _, starts, _ = obs_env.step(a0)
    mean, _ = evaluate_policy(loaded, _cue_env(1, seed=5), n_eval_episodes=4)
    assert -1.0 <= mean <= 1.0


def test_a_drop_in_model_saved_before_the_read_norm_default_loads_as_it_was_trained(tmp_path, monkeypatch):
    """RecurrentPPO(EflaMlpPolicy) saved when ``output_norm`` defaulted to False loads without the norm (actor and
    critic memory), with a warning, with its outputs and optimizer state as saved; once its policy_kwargs record
    the setting, it saves and loads again without the warning."""
    import warnings

    from rlseq.policies.actor_critic import record_adopted_read_norms
    from tests.helpers import read_norm_off_by_default

    env = _cue_env(2)
    with monkeypatch.context() as m:
        read_norm_off_by_default(m)
        model = RecurrentPPO(EflaMlpPolicy, env, n_steps=16, batch_size=16, n_epochs=1, seed=1, device="cpu",
                             policy_kwargs=dict(memory_kwargs=dict(n_heads=2, head_dim=8, value_dim=8)))
        model.learn(32)
        _perturb(model.policy, seed=3, scale=0.5)
        model.save(tmp_path / "model.zip")
    with pytest.warns(UserWarning, match="no read norm for lstm_actor.memory, lstm_critic.memory"):
        loaded = RecurrentPPO.load(tmp_path / "model.zip", env=env, device="cpu")
    assert loaded.policy.memory_actor.out_norm is None and loaded.policy.lstm_critic.memory.out_norm is None
    obs_env = _cue_env(2, seed=7)
    obs = obs_env.reset()
    starts = np.ones(2, dtype=bool)
    states = (None, None)
    for _ in range(6):  # the same steps through both: actions, then logits and values from the states reached
        a0, s0 = model.predict(obs, state=states[0], episode_start=starts, deterministic=True)
        a1, s1 = loaded.predict(obs, state=states[1], episode_start=starts, deterministic=True)
        np.testing.assert_array_equal(a0, a1)
        states = (s0, s1)
        obs, _, starts, _ = obs_env.step(a0)

    def logits_and_values(policy, state):
        h, c = (torch.as_tensor(x) for x in state)
        o, e = torch.as_tensor(obs), torch.as_tensor(starts, dtype=torch.float32)
        policy.set_training_mode(False)
        with torch.no_grad():
            return policy.get_distribution(o, (h, c), e)[0].distribution.logits, policy.predict_values(o, (h, c), e)

    for got, want in zip(logits_and_values(loaded.policy, states[1]), logits_and_values(model.policy, states[0])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    saved_adam, loaded_adam = model.policy.optimizer.state_dict()["state"], loaded.policy.optimizer.state_dict()["state"]
    assert len(saved_adam) == len(loaded_adam) > 0
    for i, st in saved_adam.items():
        torch.testing.assert_close(loaded_adam[i]["exp_avg"], st["exp_avg"], rtol=0, atol=0)
    loaded.learn(16)
    record_adopted_read_norms(loaded)
    loaded.save(tmp_path / "again.zip")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*read norm.*")
        again = RecurrentPPO.load(tmp_path / "again.zip", env=env, device="cpu")
    assert again.policy.memory_actor.out_norm is None


def test_lstm_policy_kwargs_still_work():
    """policy_kwargs written for MlpLstmPolicy keep working after swapping the policy class."""
    env = _cue_env(2)
    model = RecurrentPPO(EflaMlpPolicy, env, n_steps=8, batch_size=8,
                         policy_kwargs=dict(lstm_hidden_size=24, shared_lstm=True, enable_critic_lstm=False))
    assert model.policy.memory_actor.out_features == 24 and model.policy.lstm_critic is None
    assert model.policy.shared_lstm
    lstm = RecurrentPPO(MemoryMlpPolicy, env, n_steps=8, batch_size=8,
                        policy_kwargs=dict(memory="lstm", lstm_hidden_size=12, n_lstm_layers=2))
    assert lstm.policy.memory_actor.hidden_size == 12 and lstm.policy.memory_actor.num_layers == 2
    with pytest.raises(ValueError, match="contradicts"):
        RecurrentPPO(EflaMlpPolicy, env, policy_kwargs=dict(shared_memory=True, shared_lstm=False))


# -- procgen smoke tests ------------------------------------------------------------------------------------


def _procgen(n_envs: int = 2):
    from rlseq.envs import make_procgen

    return make_procgen("caveflyer", n_envs, seed=0, num_threads=0)


@pytest.mark.parametrize("policy", [EflaCnnPolicy, DeltaNetCnnPolicy])
def test_cnn_policies_on_procgen(policy):
    env = _procgen()
    model = RecurrentPPO(policy, env, n_steps=8, batch_size=8, n_epochs=1, seed=0,
                         policy_kwargs=dict(memory_kwargs=dict(n_heads=2, head_dim=16, value_dim=16)))
    assert isinstance(model.policy.features_extractor, ImpalaCNN)
    model.learn(16)
    obs = env.reset()
    actions, state = model.predict(obs, deterministic=True)
    d = model.policy.memory_actor.d_model
    # the matrix, its rotary position and the window, in h and c (one float of padding: the sum is odd)
    assert actions.shape == (2,) and state[0].shape == (1, 2, (2 * 16 * 16 + 1 + 3 * d + 1) // 2)
    env.close()


def test_multi_input_policy_on_procgen_with_prev_action_reward():
    from rlseq.envs import PrevActionReward

    env = PrevActionReward(_procgen())
    model = RecurrentPPO(EflaMultiInputPolicy, env, n_steps=8, batch_size=8, n_epochs=1, seed=0,
                         policy_kwargs=dict(memory_kwargs=dict(n_heads=2, head_dim=16, value_dim=16)))
    assert isinstance(model.policy.features_extractor, ImpalaCombinedExtractor)
    assert model.policy.features_dim == 256 + 15 + 1
    model.learn(16)
    env.close()


# -- the memory task ----------------------------------------------------------------------------------------

TASK = dict(delay=8)  # cue at t = 0, query 9 steps later
THRESHOLD = 0.8  # mean return over 100 deterministic episodes; memoryless: 0 ± 0.1 (std of the mean)
PPO_ARGS = dict(n_steps=32, batch_size=64, n_epochs=4, learning_rate=3e-3, gamma=0.9, ent_coef=0.01, seed=0)
TIMESTEPS = 8192


@pytest.fixture
def one_thread():
    """Tiny networks: one intra-op thread is faster (no sync overhead), and results do not depend on the core count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _train_and_evaluate(kind: str) -> float:
    torch.manual_seed(0)
    env = make_vec_env(CueRecallEnv, n_envs=8, seed=0, env_kwargs=TASK)
    # each rule's default key/value ratio (EFLA 16 × 8, DeltaNet 16 × 16). EFLA at 16 × 16 solved seeds 1-3 and
    # not seed 0 on an AMD EPYC (it passed on another CPU); at 16 × 8 it solved seeds 0-11 there
    mem = dict(d_model=32, n_heads=2, head_dim=16)
    if kind == "efla":
        model = RecurrentPPO(EflaMlpPolicy, env, policy_kwargs=dict(net_arch=[32], memory_kwargs=mem), **PPO_ARGS)
    elif kind == "deltanet":
        model = RecurrentPPO(DeltaNetMlpPolicy, env, policy_kwargs=dict(net_arch=[32], memory_kwargs=mem), **PPO_ARGS)
    elif kind == "lstm":  # the stock sb3-contrib LSTM policy
        model = RecurrentPPO("MlpLstmPolicy", env, policy_kwargs=dict(net_arch=[32], lstm_hidden_size=32), **PPO_ARGS)
    elif kind == "none":  # the same RecurrentPPO and network without memory
        model = RecurrentPPO(MemoryMlpPolicy, env, policy_kwargs=dict(net_arch=[32], memory="none"), **PPO_ARGS)
    elif kind == "mlp":  # plain feed-forward PPO
        model = PPO("MlpPolicy", env, policy_kwargs=dict(net_arch=[32]), **PPO_ARGS)
    else:
        raise ValueError(kind)
    model.learn(TIMESTEPS)
    eval_env = make_vec_env(CueRecallEnv, n_envs=1, seed=123, env_kwargs=TASK)
    mean, _ = evaluate_policy(model, eval_env, n_eval_episodes=100, deterministic=True)
    print(f"CueRecall delay={TASK['delay']} {kind}: mean return {mean:.3f} (threshold {THRESHOLD})")
    return mean


def test_cue_recall_env_is_memoryless_at_chance():
    env = CueRecallEnv(delay=3)
    assert chance_return(2) == 0.0
    query_obs, cues = set(), []
    for seed in range(40):
        obs, info = env.reset(seed=seed)
        cues.append(info["cue"])
        for _ in range(3):
            obs, r, term, trunc, _ = env.step(0)
            assert r == 0 and not term
        obs, r, term, trunc, _ = env.step(0)  # blank → query observation
        query_obs.add(obs.tobytes())
        _, r, term, _, info = env.step(info["cue"])
        assert term and r == 1.0 and info["correct"]
    assert len(query_obs) == 1  # the query step looks the same whatever the cue
    assert set(cues) == {0, 1}


@pytest.mark.parametrize("kind", ["efla", "deltanet", "lstm"])
def test_memory_task_learned(kind, one_thread):
    assert _train_and_evaluate(kind) >= THRESHOLD


@pytest.mark.parametrize("kind", ["none", "mlp"])
def test_memory_task_memoryless_control_at_chance(kind, one_thread):
    assert _train_and_evaluate(kind) < THRESHOLD - 0.3
