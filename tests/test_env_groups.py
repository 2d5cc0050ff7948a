"""Env groups: the VecEnvGroups container, the pipelined rollout of MemoryPPO, the shared reward statistic, the CLI."""

from __future__ import annotations

import os
import pickle
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import configure
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.running_mean_std import RunningMeanStd
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnvWrapper, VecNormalize

from rlseq.algos import MemoryPPO
from rlseq.algos.buffer import SequenceRolloutBuffer
from rlseq.envs import VecEnvGroups
from rlseq.envs.groups import envs_per_group
from rlseq.train import main as train_main
from tests.helpers import assert_same_rollouts, tiny_bench_train
from tests.helpers import collect_rollout as _collect

MEMORY_KWARGS = {"efla": {"n_heads": 2, "head_dim": 16}, "lstm": {"hidden_size": 32}}


class Tagged(gym.Env):
    """Observation ``[env_id, t]``, reward ``(env_id + 1) * sin(1.3 env_id + 0.7 t)`` and an episode end every
    ``5 + env_id`` steps: every env's stream differs, so a misplaced slice shows. ``info["env_id"]`` names it."""

    metadata = {"render_modes": []}
    render_mode = None

    def __init__(self, env_id: int):
        self.env_id, self.t = env_id, 0
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([self.env_id, 0], np.float32), {"env_id": self.env_id}

    def step(self, action):
        self.t += 1
        reward = (self.env_id + 1) * np.sin(1.3 * self.env_id + 0.7 * self.t)
        done = self.t % (5 + self.env_id) == 0
        return np.array([self.env_id, self.t], np.float32), float(reward), done, False, {"env_id": self.env_id}

    def whoami(self, prefix: str = "") -> str:
        return f"{prefix}{self.env_id}"


def _tagged(ids: range) -> DummyVecEnv:
    return DummyVecEnv([lambda i=i: Tagged(i) for i in ids])


def _tagged_groups(n_envs: int = 4, n_groups: int = 2, normalize: bool = False) -> VecEnvGroups:
    def make(m: int, first: int | None) -> DummyVecEnv | VecNormalize:
        env = _tagged(range(first, first + m))
        return VecNormalize(env, norm_obs=False, gamma=0.9) if normalize else env

    return VecEnvGroups.build(make, n_envs, n_groups, seed=0)  # seed 0: group g's envs are g*m .. g*m + m - 1


class Recorder(BaseCallback):
    """Records what ``on_step`` sees; stops the training at step ``stop_at`` (None: never)."""

    def __init__(self, stop_at: int | None = None):
        super().__init__()
        self.stop_at, self.seen = stop_at, []

    def _on_step(self) -> bool:
        loc = self.locals
        self.seen.append(dict(num_timesteps=self.model.num_timesteps, rewards=np.array(loc["rewards"]),
                              dones=np.array(loc["dones"]), infos=loc["infos"], new_obs=np.array(loc["new_obs"])))
        return self.stop_at is None or len(self.seen) <= self.stop_at


def _model(env, memory: str = "efla", n_steps: int = 32, **kwargs) -> MemoryPPO:
    policy = "CnnPolicy" if len(env.observation_space.shape) == 3 else "MlpPolicy"
    model = MemoryPPO(policy, env, n_steps=n_steps, n_minibatches=2, n_epochs=1, seed=0, device="cpu",
                      policy_kwargs=dict(memory=memory, memory_kwargs=MEMORY_KWARGS[memory]), **kwargs)
    model.set_logger(configure(None, []))
    return model


def _cartpole_groups(n_envs: int = 4, n_groups: int = 2, **kwargs) -> VecEnvGroups:
    return VecEnvGroups.build(lambda m, _: make_vec_env("CartPole-v1", n_envs=m, **kwargs), n_envs, n_groups)


# --- the container --------------------------------------------------------------------------------------


def test_container_concatenates_in_group_order_and_steps_each_group_alone():
    env = _tagged_groups(6, 3)
    assert env.num_envs == 6 and env.n_groups == 3 and env.envs_per_group == 2
    assert [env.group_slice(g) for g in range(3)] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    obs = env.reset()
    assert obs[:, 0].tolist() == [0, 1, 2, 3, 4, 5] and len(env.reset_infos) == 6
    obs, rewards, dones, infos = env.step(np.zeros(6, int))
    assert obs[:, 0].tolist() == [0, 1, 2, 3, 4, 5] and [i["env_id"] for i in infos] == [0, 1, 2, 3, 4, 5]
    assert np.allclose(rewards, [(i + 1) * np.sin(1.3 * i + 0.7) for i in range(6)])
    # one group at a time, several in flight at once, waited in any order
    env.step_group_async(2, np.zeros(2, int))
    env.step_group_async(0, np.zeros(2, int))
    assert env.in_flight(0) and not env.in_flight(1) and env.in_flight(2)
    obs2, _, _, infos2 = env.step_group_wait(2)
    obs0, _, _, _ = env.step_group_wait(0)
    assert obs2.tolist() == [[4, 2], [5, 2]] and [i["env_id"] for i in infos2] == [4, 5] and obs0[:, 1].tolist() == [2, 2]
    with pytest.raises(RuntimeError, match="without a preceding step_group_async"):
        env.step_group_wait(1)
    env.step_group_async(1, np.zeros(2, int))
    with pytest.raises(RuntimeError, match="env group 1 has a step in flight"):
        env.step_group_async(1, np.zeros(2, int))
    with pytest.raises(ValueError, match="env group 0 takes 2 actions, got 3"):
        env.step_group_async(0, np.zeros(3, int))
    with pytest.raises(IndexError, match="env group 3 out of range"):
        env.group_slice(3)
    assert env.reset()[:, 1].tolist() == [0] * 6 and not env.in_flight(1)  # the step in flight is finished first
    env.close()


def test_container_routes_env_indices_to_their_groups():
    env = _tagged_groups(6, 3)
    assert env.get_attr("env_id") == [0, 1, 2, 3, 4, 5]
    assert env.get_attr("env_id", [5, 0, 3, 2]) == [5, 0, 3, 2] and env.get_attr("env_id", -1) == [5]
    assert env.env_method("whoami", "env", indices=[4, 1]) == ["env4", "env1"]
    assert env.env_method("whoami", prefix="#", indices=3) == ["#3"]
    env.set_attr("label", "x", indices=[1, 4])
    env.set_attr("label", "y", indices=[0, 2, 3, 5])
    assert env.get_attr("label") == ["y", "x", "y", "y", "x", "y"]
    assert env.env_is_wrapped(Monitor) == [False] * 6
    with pytest.raises(IndexError, match="env index 6 out of range for 6 envs"):
        env.get_attr("env_id", [6])
    # seeds: env i gets seed + i, as SB3 seeds one VecEnv; the groups get theirs at the next reset
    assert list(env.seed(10)) == [10, 11, 12, 13, 14, 15]
    assert [group._seeds for group in env.groups] == [[10, 11], [12, 13], [14, 15]]
    env.set_options([{"k": i} for i in range(6)])
    assert env.groups[2]._options == [{"k": 4}, {"k": 5}]


def test_groups_must_divide_the_envs_and_match():
    with pytest.raises(ValueError, match="4 env groups must divide n_envs=6"):
        _tagged_groups(6, 4)
    with pytest.raises(ValueError, match="must be >= 1"):
        envs_per_group(4, 0)
    with pytest.raises(ValueError, match="same number of envs: group 0 has 2, group 1 has 3"):
        VecEnvGroups([_tagged(range(2)), _tagged(range(2, 5))])
    with pytest.raises(ValueError, match="either every env group or none must have a VecNormalize: groups \\[1\\]"):
        VecEnvGroups([VecNormalize(_tagged(range(2)), norm_obs=False), _tagged(range(2, 4))])
    with pytest.raises(ValueError, match="differs from group 0's in gamma"):
        VecEnvGroups([VecNormalize(_tagged(range(2)), norm_obs=False, gamma=0.9),
                      VecNormalize(_tagged(range(2, 4)), norm_obs=False, gamma=0.99)])


def test_procgen_groups_get_distinct_seeds_and_play_different_levels():
    from rlseq.envs import make_procgen
    from rlseq.train import build_parser, make_env, resolve

    cfg = resolve(build_parser().parse_args(["--n-envs", "4", "--n-minibatches", "2", "--env-groups", "2", "--num-threads", "0"]))
    env = make_env(cfg, seed=7)
    assert isinstance(env, VecEnvGroups) and [g.venv.seed_value for g in env.groups] == [7, 9]
    obs = env.reset()
    assert obs.shape == (4, 64, 64, 3)
    assert not np.array_equal(obs[:2], obs[2:]), "both groups show the same levels"
    for g, seed in enumerate((7, 9)):  # each group is the stack one would build alone with its seed
        alone = make_procgen("caveflyer", 2, seed=seed, num_threads=0)
        assert np.array_equal(obs[env.group_slice(g)], alone.reset())
        alone.close()
    # an algorithm's seed() reaches every group, offset by the envs before it
    env.seed(100)
    env.reset()
    assert [g.venv.seed_value for g in env.groups] == [100, 102]
    env.close()
    # evaluation (training=False) steps one stack without VecNormalize
    single = make_env(cfg, seed=7, training=False)
    assert single.num_envs == 4 and not isinstance(single, VecEnvGroups) and not isinstance(single, VecNormalize)
    single.close()


# --- shared reward normalisation ---------------------------------------------------------------------------


def test_running_mean_std_of_two_halves_in_sequence_equals_all_at_once():
    rng = np.random.default_rng(0)
    whole, halves = RunningMeanStd(shape=()), RunningMeanStd(shape=())
    for _ in range(200):
        x = rng.normal(3.0, 5.0, 64) * rng.uniform(0.1, 10)
        whole.update(x)
        halves.update(x[:32])
        halves.update(x[32:])
    assert halves.count == pytest.approx(whole.count, rel=1e-15)
    assert halves.mean == pytest.approx(whole.mean, rel=1e-12) and halves.var == pytest.approx(whole.var, rel=1e-12)


@pytest.mark.parametrize("pipelined", [False, True])
def test_groups_share_one_return_statistic_equal_to_a_single_stack(pipelined):
    groups = _tagged_groups(4, 2, normalize=True)
    single = VecNormalize(_tagged(range(4)), norm_obs=False, gamma=0.9)
    norms = groups.vec_normalizes
    assert len(norms) == 2 and norms[0].ret_rms is norms[1].ret_rms and groups.vec_normalize is norms[0]
    groups.reset(), single.reset()
    actions = np.zeros(4, int)
    for t in range(50):
        _, expected, _, _ = single.step(actions)
        if pipelined:  # as the pipelined rollout steps them: group 0 is started again before group 1 is waited for
            for g in range(2):
                groups.step_group_async(g, actions[groups.group_slice(g)])
            rewards = [groups.step_group_wait(g)[1] for g in range(2)]
        else:
            rewards = np.split(groups.step(actions)[1], 2)
        # the last group scales by the statistic of the whole step, as the single stack does for every env
        np.testing.assert_allclose(rewards[1], expected[2:], rtol=1e-6)
        if t >= 10:  # the first group lags by half a step of returns; that matters less as the statistic grows
            np.testing.assert_allclose(rewards[0], expected[:2], rtol=0.06)
        shared, ref = norms[0].ret_rms, single.ret_rms
        assert shared.count == pytest.approx(ref.count, rel=1e-14)
        assert shared.mean == pytest.approx(ref.mean, rel=1e-10, abs=1e-12)
        assert shared.var == pytest.approx(ref.var, rel=1e-10)
    assert single.ret_rms.count == pytest.approx(200, abs=1e-3)


def test_shared_statistic_survives_save_and_load(tmp_path):
    from rlseq.train import _load_reward_statistics

    groups = _tagged_groups(4, 2, normalize=True)
    groups.reset()
    for _ in range(20):
        groups.step(np.zeros(4, int))
    groups.vec_normalize.save(str(tmp_path / "vecnormalize.pkl"))
    saved = groups.vec_normalize.ret_rms
    fresh = _tagged_groups(4, 2)  # as a resumed run builds it: without VecNormalize, then the saved one on top
    loaded = _load_reward_statistics(tmp_path, fresh)
    norms = loaded.vec_normalizes
    assert loaded is fresh and len(norms) == 2 and norms[0].ret_rms is norms[1].ret_rms is not saved
    assert (norms[0].ret_rms.count, norms[0].ret_rms.mean, norms[0].ret_rms.var) == (saved.count, saved.mean, saved.var)
    assert [n.returns.shape for n in norms] == [(2,), (2,)]



def test_the_statistic_a_checkpoint_saves_is_the_outer_vecnormalize_or_group_0s():
    inner = _model(_tagged_groups(4, 2, normalize=True))
    assert inner.get_vec_normalize_env() is inner.env.vec_normalize is not None
    outer_env = VecNormalize(_cartpole_groups(), norm_obs=False)  # groups without their own: the outer one counts
    outer = _model(outer_env, n_steps=8)
    assert outer.get_vec_normalize_env() is outer_env
    for model in (inner, outer):
        model.env.close()

# --- the pipelined rollout -------------------------------------------------------------------------------


@pytest.mark.parametrize("memory", ["efla", "lstm"])
def test_pipelined_buffer_reproduces_its_values_and_log_probs(memory):
    """Re-evaluating the stored sequences from the stored initial state and episode starts gives the stored values
    and log-probabilities: the group slices of the memory state, the resets and the buffer line up."""
    model = _model(_cartpole_groups(), memory)
    for rollout in range(2):  # the second starts from the memory carried over, with trained weights
        assert _collect(model, setup=rollout == 0)
        buf = model.rollout_buffer
        assert buf.full and buf.episode_starts[1:].any()
        if rollout:
            assert buf.initial_state.abs().amax(dim=tuple(range(1, buf.initial_state.dim()))).min() > 0
        batch = buf.batch(torch.arange(model.n_envs))
        with torch.no_grad():
            values, log_probs, _ = model.policy.evaluate_sequences(batch.observations, batch.actions,
                                                                   batch.initial_state, batch.episode_starts)
        torch.testing.assert_close(values, batch.old_values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(log_probs, batch.old_log_prob, rtol=1e-5, atol=1e-5)
        model.train()
    model.env.close()


def test_pipelined_procgen_rollout_under_vectransposeimage_reproduces_its_values():
    from rlseq.train import build_parser, make_env, resolve

    cfg = resolve(build_parser().parse_args(["--n-envs", "4", "--n-minibatches", "2", "--env-groups", "2", "--num-threads", "0"]))
    model = _model(make_env(cfg, seed=0), "efla", n_steps=8)
    assert type(model.env).__name__ == "VecTransposeImage" and model._pipelined_groups(model.env) is model.env.venv
    for rollout in range(2):
        assert _collect(model, setup=rollout == 0)
        batch = model.rollout_buffer.batch(torch.arange(4))
        assert batch.observations.shape == (4, 8, 3, 64, 64)
        with torch.no_grad():
            values, log_probs, _ = model.policy.evaluate_sequences(batch.observations, batch.actions,
                                                                   batch.initial_state, batch.episode_starts)
        torch.testing.assert_close(values, batch.old_values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(log_probs, batch.old_log_prob, rtol=1e-5, atol=1e-5)
        assert model._last_obs.shape == (4, 3, 64, 64)  # SB3's layout between rollouts
        model.train()
    model.env.close()


def test_pipelined_rollout_matches_a_step_by_step_replay_of_its_actions():
    """Replaying the stored actions on one plain VecEnv of the same seeds gives the stored observations, rewards and
    episode starts per env, and the callbacks saw each full step once, in env order."""
    model = _model(_cartpole_groups(), n_steps=40)
    recorder = Recorder()
    assert _collect(model, recorder)
    buf, n = model.rollout_buffer, model.n_envs
    replay = make_vec_env("CartPole-v1", n_envs=n)
    replay.seed(0)  # MemoryPPO(seed=0) seeded group g with 0 + 2g: env i got seed i
    obs, starts = replay.reset(), np.ones(n, bool)
    episodes = 0
    for t in range(model.n_steps):
        assert np.array_equal(buf.observations[t].numpy(), obs), f"step {t}: observations"
        assert np.array_equal(buf.episode_starts[t].numpy(), starts), f"step {t}: episode starts"
        obs, rewards, dones, infos = replay.step(buf.actions[t].numpy())
        assert np.array_equal(buf.rewards[t].numpy(), rewards), f"step {t}: rewards"
        seen = recorder.seen[t]
        assert seen["num_timesteps"] == (t + 1) * n
        assert np.array_equal(seen["rewards"], rewards) and np.array_equal(seen["dones"], dones)
        assert np.array_equal(seen["new_obs"], obs)
        assert [("episode" in i) for i in seen["infos"]] == dones.tolist()
        assert [i["episode"]["l"] for i in seen["infos"] if "episode" in i] == [i["episode"]["l"] for i in infos if "episode" in i]
        starts, episodes = dones, episodes + int(dones.sum())
    assert len(recorder.seen) == model.n_steps and episodes > 0
    assert np.array_equal(model._last_obs, obs) and np.array_equal(model._last_episode_starts, starts)
    assert len(model.ep_info_buffer) == episodes
    assert not any(model.env.in_flight(g) for g in range(2))
    model.env.close()


def test_truncated_episodes_of_every_group_are_bootstrapped_with_their_own_memory():
    def make(m: int, first: int | None) -> DummyVecEnv:
        class EnvId(gym.Wrapper):
            def step(self, action):
                out = self.env.step(action)
                out[-1]["env_id"] = self.env_id
                return out

        def one(i: int):
            env = EnvId(gym.wrappers.TimeLimit(gym.make("CartPole-v1").unwrapped, max_episode_steps=5))
            env.env_id = i
            return env

        return DummyVecEnv([lambda i=i: one(i) for i in range(first, first + m)])

    env = VecEnvGroups.build(make, 4, 2, seed=0)
    model = _model(env, n_steps=12, gamma=0.9)
    real, seen = model._bootstrap_truncated, []

    def spy(rewards, dones, infos, envs=slice(None)):
        truncated = [i for i, d in enumerate(dones) if d and infos[i].get("TimeLimit.truncated", False)]
        expected = rewards.copy()
        for i in truncated:  # γ V(terminal obs) with the memory of the env the info came from, by its own id
            obs = model.policy.obs_to_tensor(infos[i]["terminal_observation"])[0]
            state = model._memory_state[infos[i]["env_id"]][None].clone()
            with torch.no_grad():
                expected[i] += 0.9 * model.policy.predict_values(obs, state, torch.zeros(1, dtype=torch.bool))[0].item()
        out = real(rewards, dones, infos, envs)
        seen.append(([infos[i]["env_id"] for i in truncated], out, expected))
        return out

    model._bootstrap_truncated = spy
    assert _collect(model)
    truncated = [s for s in seen if s[0]]
    assert {i for ids, _, _ in truncated for i in ids} >= {2, 3}, "the second group must truncate too"
    for ids, out, expected in truncated:
        np.testing.assert_allclose(out, expected, rtol=1e-6)
    env.close()


@pytest.mark.parametrize("n_groups", [1, 2])
def test_a_callback_stops_the_pipelined_rollout_as_the_sequential_one(n_groups):
    model = _model(_cartpole_groups(4, n_groups), n_steps=16)
    recorder = Recorder(stop_at=3)
    assert not _collect(model, recorder)
    assert len(recorder.seen) == 4 and model.num_timesteps == 16
    assert not model.rollout_buffer.full
    assert model._last_obs.shape == (4, 4) and model._last_episode_starts.shape == (4,)
    assert not any(model.env.in_flight(g) for g in range(n_groups))
    # training can go on from there
    assert _collect(model, setup=False) and model.rollout_buffer.full and model.num_timesteps == 16 + 64
    model.env.close()


def test_groups_under_another_wrapper_are_stepped_all_at_once_with_a_warning():
    class Identity(VecEnvWrapper):
        def reset(self):
            return self.venv.reset()

        def step_wait(self):
            return self.venv.step_wait()

    model = _model(Identity(_cartpole_groups()), n_steps=8)
    with pytest.warns(RuntimeWarning, match="stepped all at once"):
        assert _collect(model)
    assert model.rollout_buffer.full
    model.env.close()


def test_buffer_slices_store_per_group_and_complete_a_step_only_with_every_env():
    space = gym.spaces.Box(-1, 1, (3,), np.float32)
    buf = SequenceRolloutBuffer(2, 4, space, gym.spaces.Discrete(2), torch.device("cpu"))
    buf.reset(torch.zeros(4, 1))

    def records(first: int, n: int, t: int) -> tuple:
        ids = torch.arange(first, first + n, dtype=torch.float32)
        return (ids[:, None].expand(n, 3) + 10 * t, ids.long() % 2, ids > 1, ids + t, -ids - t)

    for t in range(2):
        buf.add_step(*records(0, 2, t), envs=slice(0, 2))
        buf.add_rewards(torch.full((2,), float(t)), envs=slice(0, 2))
        assert buf.pos == buf.rewards_pos == t and not buf.full
        if t == 0:
            with pytest.raises(RuntimeError, match="must follow add_step"):
                buf.add_rewards(torch.zeros(2), envs=slice(2, 4))
        buf.add_step(*records(2, 2, t), envs=slice(2, 4))
        assert buf.pos == t + 1 and buf.rewards_pos == t
        if t == 0:
            with pytest.raises(RuntimeError, match="step 0 of envs 2..3 has no reward yet"):
                buf.add_step(*records(2, 2, 1), envs=slice(2, 4))
            with pytest.raises(RuntimeError, match="envs 1..2 are at different steps"):
                buf.add_step(*records(1, 2, 1), envs=slice(1, 3))
        buf.add_rewards(torch.full((2,), float(t)), envs=slice(2, 4))
    assert buf.full and buf.pos == buf.rewards_pos == 2
    assert buf.observations[:, :, 0].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert buf.values.tolist() == [[0, 1, 2, 3], [1, 2, 3, 4]] and buf.rewards.tolist() == [[0] * 4, [1] * 4]
    with pytest.raises(ValueError, match="non-empty contiguous slice"):
        buf.add_step(*records(0, 2, 0), envs=slice(0, 4, 2))


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="CUDA graphs need a GPU and compiled Triton kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("memory", ["efla", "lstm"])
def test_pipelined_graph_acting_reproduces_pipelined_eager_acting(memory):
    """One CUDA graph per group, each on its view of the memory state: the same rollouts as eager acting (GPU)."""
    from rlseq.envs import make_procgen

    runs = []
    for cuda_graph in (False, True):
        env = VecEnvGroups.build(lambda m, seed: make_procgen("caveflyer", m, seed=seed, num_threads=0), 16, 2, seed=0)
        model = MemoryPPO("CnnPolicy", env, n_steps=32, n_minibatches=2, n_epochs=1, seed=0, device="cuda",
                          cuda_graph=cuda_graph, policy_kwargs=dict(memory=memory, memory_kwargs=MEMORY_KWARGS[memory]))
        model.set_logger(configure(None, []))
        rollouts = []
        for rollout in range(2):  # the second acts with the updated weights through the same graphs
            assert _collect(model, setup=rollout == 0)
            b = model.rollout_buffer
            rollouts.append([x.clone() for x in (b.actions, b.values, b.log_probs, b.episode_starts, model._memory_state)])
            model.train()
        assert len(model._group_acting) == 2 and all((a._graph is not None) == cuda_graph for a in model._group_acting)
        runs.append(rollouts)
        env.close()
    assert_same_rollouts(*runs)


# --- the CLI and the benchmark -------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--n-envs", "4", "--n-minibatches", "2", "--env-groups", "3"], "--env-groups 3 must be >= 1 and divide --n-envs 4"),
    (["--n-envs", "4", "--n-minibatches", "2", "--env-groups", "0"], "must be >= 1"),
    (["--algo", "sb3-recurrent-ppo", "--env-groups", "2"], "--env-groups needs --algo rlseq"),
])
def test_bad_env_groups_fail_fast(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(argv + ["--logdir", str(tmp_path)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def _vecnormalize_count(checkpoint) -> float:
    with open(checkpoint / "vecnormalize.pkl", "rb") as f:
        state: Any = pickle.load(f)
    return state.ret_rms.count


def test_cli_env_groups_trains_checkpoints_and_resumes_the_shared_statistic(tmp_path, capsys):
    import yaml

    argv = ["--env", "caveflyer", "--memory", "efla", "--logdir", str(tmp_path), "--n-envs", "4", "--n-steps", "16",
            "--n-minibatches", "2", "--n-epochs", "1", "--num-threads", "0", "--env-groups", "2",
            "--checkpoint-every", "64", "--no-progress-bar"]
    run = tmp_path / "caveflyer" / "efla" / "seed0"
    train_main(argv + ["--total-steps", "128"])
    assert yaml.safe_load((run / "config.yaml").read_text())["env_groups"] == 2
    # every env step adds one return to the one statistic of all envs (count starts at 1e-4)
    assert _vecnormalize_count(run / "checkpoints" / "step128") == pytest.approx(128, abs=1e-3)
    (run / "final_model.zip").unlink()  # an interrupted run: its checkpoint at step 128 is there
    train_main(argv + ["--total-steps", "320", "--resume"])
    assert "resuming" in capsys.readouterr().out
    assert MemoryPPO.load(run / "final_model.zip", device="cpu").num_timesteps == 320
    # restored, shared by both groups again, and carried on: all 320 steps are in it
    assert _vecnormalize_count(run / "checkpoints" / "step320") == pytest.approx(320, abs=1e-3)


def test_bench_train_times_env_groups_as_a_variant_option(capsys):
    from rlseq.bench.__main__ import main as bench_main

    tiny_bench_train(["rlseq-none", "rlseq-none+groups2"], n_envs=4)
    out = capsys.readouterr().out
    assert "rlseq-none+groups2 (TF32 off, CNN fp32, Adam unfused, acting eager, CNN layout NCHW, 2 env groups)" in out
    assert "| rlseq-none+groups2 |" in out
    for bad in ("sb3-ppo+groups2", "rlseq-none+groups0", "rlseq-none+groupsx"):
        with pytest.raises(SystemExit):
            bench_main(["train", "--variants", bad])
