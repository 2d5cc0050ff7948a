"""MemoryPPO's rollout loop at the env boundary: the bootstrap of time-limit truncations, a callback that stops
the training, non-finite values from the env, and the TF32 setting of ``learn``."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import configure
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnvWrapper, VecNormalize, VecTransposeImage

from rlseq.algos import MemoryPPO
from rlseq.algos.acting import ActingStep

EFLA = dict(memory="efla", memory_kwargs=dict(n_heads=2, head_dim=8, d_model=16))


def _model(env, n_steps: int = 16, **kwargs) -> MemoryPPO:
    policy = "CnnPolicy" if len(env.observation_space.shape or ()) == 3 else "MlpPolicy"
    model = MemoryPPO(policy, env, n_steps=n_steps, n_minibatches=1, n_epochs=1, seed=0, device="cpu",
                      policy_kwargs=kwargs.pop("policy_kwargs", EFLA), **kwargs)
    model.set_logger(configure(None, []))
    return model


class _NoOp(BaseCallback):
    def _on_step(self) -> bool:
        return True


def _collect(model: MemoryPPO) -> bool:
    model._setup_learn(10**6)
    callback = _NoOp()
    callback.init_callback(model)
    return model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)


# --- time-limit truncation ---------------------------------------------------------------------------------


class _LastSeen(DummyVecEnv):
    """Procgen's convention on a small vector task: ``terminal_observation`` is a copy of the observation the agent
    acted on last, not the one the episode ended in (``terminal_observation_is_last_seen``)."""

    terminal_observation_is_last_seen = True

    def reset(self):
        self.last = super().reset()
        return self.last

    def step_wait(self):
        obs, rewards, dones, infos = super().step_wait()
        for i in np.flatnonzero(dones):
            infos[i]["terminal_observation"] = self.last[i].copy()
        self.last = obs
        return obs, rewards, dones, infos


def test_procgen_is_recognised_as_a_last_seen_terminal_observation_under_its_wrappers():
    from rlseq.algos.ppo import terminal_observation_is_last_seen
    from rlseq.envs import make_procgen

    frames = make_procgen("maze", 2, seed=0, num_threads=0)
    assert terminal_observation_is_last_seen(VecTransposeImage(VecNormalize(frames, norm_obs=False)))
    assert not terminal_observation_is_last_seen(make_vec_env("CartPole-v1", n_envs=2))
    frames.close()


def test_a_last_seen_terminal_observation_is_bootstrapped_from_the_value_already_computed():
    def limited():
        return gym.wrappers.TimeLimit(gym.make("CartPole-v1").unwrapped, max_episode_steps=5)

    env = _LastSeen([limited, limited])
    model = _model(env, n_steps=12, gamma=0.9)
    with torch.no_grad():  # a critic that reads the memory (a fresh one is zero), so that reading twice shows
        torch.nn.init.orthogonal_(model.policy.value_net.weight)
    assert _collect(model)
    buf = model.rollout_buffer
    ends = [(t, i) for t in range(11) for i in range(2) if buf.episode_starts[t + 1, i]]
    assert ends, "a 5-step limit must cut episodes within 12 steps"
    for t, i in ends:
        # CartPole pays 1; γ V(s) of the observation the acting step read last, as it computed it
        assert buf.rewards[t, i].item() == pytest.approx(1 + 0.9 * buf.values[t, i].item(), rel=1e-6)
    # the memory reading that observation a second time would have given other values: the check bites
    t, i = ends[-1]
    replay = model.policy.initial_state(1)
    with torch.no_grad():
        for s in range(t + 1):
            obs = buf.observations[s, i : i + 1]
            value = model.policy.predict_values(obs, replay, buf.episode_starts[s, i : i + 1])
            model.policy.memory.step(model.policy.features(obs), replay, buf.episode_starts[s, i : i + 1])
        assert value.item() == pytest.approx(buf.values[t, i].item(), rel=1e-5)  # the replay is faithful
        twice = model.policy.predict_values(buf.observations[t, i : i + 1], replay, torch.zeros(1, dtype=torch.bool))
    assert abs(twice.item() - buf.values[t, i].item()) > 1e-4
    env.close()


def test_a_real_terminal_observation_of_an_image_env_is_read_in_the_policys_layout():
    class Frames(gym.Env):
        """8x8x3 uint8 frames whose pixels encode the step; a time limit of 3 steps."""

        observation_space = gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            self.t = 0
            return self._frame(), {}

        def _frame(self):
            frame = np.zeros((8, 8, 3), np.uint8)
            frame[..., self.t % 3] = 40 * (self.t + 1)
            frame[self.t % 8] = 7
            return frame

        def step(self, action):
            self.t += 1
            return self._frame(), 0.0, False, self.t >= 3, {}

    env = make_vec_env(Frames, n_envs=2, seed=0)
    model = _model(env, n_steps=4, gamma=0.5, policy_kwargs=dict(EFLA, features_extractor_kwargs=dict(channels=(4,), features_dim=8)))
    assert isinstance(model.env, VecTransposeImage)
    seen = []
    real = model._bootstrap_truncated

    def spy(rewards, dones, infos):
        seen.extend(infos[i]["terminal_observation"].shape for i in range(len(dones)) if dones[i])
        return real(rewards, dones, infos)

    model._bootstrap_truncated = spy
    assert _collect(model)
    assert seen == [(3, 8, 8)] * 2  # channel-first, as the policy reads images
    env.close()


# --- a callback that stops the training --------------------------------------------------------------------


class _Emitted(VecEnvWrapper):
    """Records every observation the env returns, in order (reset, then each step)."""

    def __init__(self, venv):
        super().__init__(venv)
        self.emitted: list[np.ndarray] = []

    def reset(self):
        obs = self.venv.reset()
        self.emitted.append(obs.copy())
        return obs

    def step_wait(self):
        obs, rewards, dones, infos = self.venv.step_wait()
        self.emitted.append(obs.copy())
        return obs, rewards, dones, infos


class _StopAt(BaseCallback):
    def __init__(self, stop_at: int):
        super().__init__()
        self.stop_at, self.calls = stop_at, 0

    def _on_step(self) -> bool:
        self.calls += 1
        return self.calls != self.stop_at


def test_after_a_callback_stops_learn_the_memory_reads_each_observation_once(monkeypatch):
    acted: list[np.ndarray] = []
    real_step = ActingStep.step

    def recording_step(self, obs, *args, **kwargs):
        acted.append(np.array(obs, copy=True))
        return real_step(self, obs, *args, **kwargs)

    monkeypatch.setattr(ActingStep, "step", recording_step)
    env = _Emitted(make_vec_env("CartPole-v1", n_envs=2, seed=0))
    model = _model(env, n_steps=8)
    model.learn(64, callback=_StopAt(3))  # stops at the third env step of the first rollout
    assert model.num_timesteps == 6 and len(acted) == 3
    np.testing.assert_array_equal(model._last_obs, env.emitted[-1])
    model.learn(16, reset_num_timesteps=False)
    # every observation the env returned was acted on exactly once, in order (the last one is still to come)
    assert len(acted) == 3 + 8
    for t, obs in enumerate(acted):
        np.testing.assert_array_equal(obs, env.emitted[t], err_msg=f"acting step {t}")
    env.close()


# --- non-finite values from the env ------------------------------------------------------------------------


class _Faulty(gym.Env):
    """Observation ``[env_id, t]``; at step ``bad_step`` env ``bad_env`` returns ``nan`` in ``field``."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, env_id: int, bad_env: int, bad_step: int, field: str):
        self.env_id, self.bad_env, self.bad_step, self.field = env_id, bad_env, bad_step, field

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.array([self.env_id, 0], np.float32), {}

    def step(self, action):
        self.t += 1
        bad = self.env_id == self.bad_env and self.t == self.bad_step
        obs = np.array([self.env_id, np.nan if bad and self.field == "observation" else self.t], np.float32)
        reward = np.nan if bad and self.field == "reward" else 1.0
        return obs, reward, False, False, {}


@pytest.mark.parametrize("field", ["reward", "observation"])
def test_a_nan_from_the_env_is_named_at_its_step_before_vecnormalize_sees_it(field):
    env = VecNormalize(DummyVecEnv([lambda i=i: _Faulty(i, bad_env=1, bad_step=5, field=field) for i in range(3)]),
                       gamma=0.9)
    model = _model(env, n_steps=16)
    with pytest.raises(FloatingPointError, match=rf"non-finite {field} \(nan\) from env 1 at step 5 "):
        model.learn(48)
    assert type(env.venv).__name__ == "VecCheckFinite"
    for stat in (env.ret_rms, env.obs_rms):  # the running statistics never saw the NaN
        assert np.isfinite(stat.mean).all() and np.isfinite(stat.var).all()
    env.close()


def test_the_check_names_dict_keys_and_terminal_observations():
    from rlseq.envs import VecCheckFinite

    class Scripted(DummyVecEnv):
        def __init__(self, obs, infos):
            super().__init__([lambda: _Faulty(0, -1, -1, "")] * 2)
            self.scripted = obs, infos

        def step_wait(self):
            obs, infos = self.scripted
            return obs, np.zeros(2, np.float32), np.array([False, True]), infos

    good = {"image": np.full((2, 4, 4, 3), 255, np.uint8), "pos": np.zeros((2, 3), np.float32)}
    bad = {**good, "pos": np.array([[0, 0, 0], [0, np.inf, 0]], np.float32)}
    check = VecCheckFinite(Scripted(bad, [{}, {}]))
    check.step_async(np.zeros(2))
    with pytest.raises(FloatingPointError, match=r"non-finite observation\['pos'\] \(inf\) from env 1 at step 1 "):
        check.step_wait()
    terminal = {"terminal_observation": {"image": good["image"][1], "pos": np.array([np.nan, 0, 0], np.float32)}}
    check = VecCheckFinite(Scripted(good, [{}, terminal]))
    check.step_async(np.zeros(2))
    with pytest.raises(FloatingPointError, match=r"non-finite terminal_observation\['pos'\] \(nan\) from env 1"):
        check.step_wait()


def test_the_check_sits_below_vecnormalize_and_vectransposeimage_once():
    from rlseq.envs import VecCheckFinite
    from rlseq.envs.wrappers import with_finite_check

    base = make_vec_env("CartPole-v1", n_envs=2)
    top = with_finite_check(base)
    assert isinstance(top, VecCheckFinite) and top.venv is base
    assert with_finite_check(top) is top
    normalized = VecNormalize(make_vec_env("CartPole-v1", n_envs=2))
    inner = normalized.venv
    assert with_finite_check(normalized) is normalized and normalized.venv.venv is inner
    assert isinstance(normalized.venv, VecCheckFinite)
    assert with_finite_check(normalized).venv.venv is inner  # not twice
    from rlseq.envs import make_procgen

    frames = make_procgen("maze", 2, seed=0, num_threads=0)
    stack = VecTransposeImage(VecNormalize(frames, norm_obs=False))
    with_finite_check(stack)
    assert isinstance(stack.venv.venv, VecCheckFinite) and stack.venv.venv.venv is frames
    stack.close()


# --- TF32 -------------------------------------------------------------------------------------------------


class _Flags(BaseCallback):
    def _on_step(self) -> bool:
        self.seen = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        return True


@pytest.mark.parametrize("tf32", [None, False, True])
def test_learn_runs_with_tf32_off_unless_asked_and_restores_the_switches(tf32, restore_tf32):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # e.g. PyTorch's cuDNN default
    kwargs = {} if tf32 is None else dict(tf32=tf32)
    model = _model(make_vec_env("CartPole-v1", n_envs=2), n_steps=8, **kwargs)
    flags = _Flags()
    model.learn(16, callback=flags)
    assert flags.seen == (bool(tf32),) * 2
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)


def test_the_cli_config_sets_tf32():
    from rlseq.train import build_model, build_parser, make_env, resolve

    for argv, expected in (([], False), (["--tf32"], True)):
        cfg = resolve(build_parser().parse_args(["--env", "CartPole-v1", "--n-envs", "2", "--n-minibatches", "1", "--n-steps", "8", *argv]))
        env = make_env(cfg, seed=0)
        assert build_model(cfg, env, "cpu").tf32 is expected
        env.close()
    procgen = resolve(build_parser().parse_args(["--env", "caveflyer"]))
    assert procgen["tf32"] is False  # configs/procgen.yml: exact unless --tf32 or --fast


def test_a_config_that_asks_for_env_groups_is_refused_by_name(monkeypatch):
    import rlseq.config as C
    import rlseq.train as T

    real = C.load_config
    for groups, refused in ((1, False), (2, True)):
        monkeypatch.setattr(C, "load_config", lambda *a, g=groups: {**real(*a), "env_groups": g})
        args = T.build_parser().parse_args(["--env", "CartPole-v1", "--n-envs", "2", "--n-minibatches", "1"])
        if refused:
            with pytest.raises(T.UsageError, match="env_groups is not an option"):
                T.resolve(args)
        else:
            assert "env_groups" not in T.resolve(args)


# --- SB3's conventions around the loop ------------------------------------------------------------------------


class _LocalsSeen(BaseCallback):
    """Records which of SB3's PPO locals each hook sees."""

    SB3_STEP = ("actions", "clipped_actions", "values", "log_probs", "obs_tensor", "new_obs", "rewards", "dones",
                "infos")

    def __init__(self):
        super().__init__()
        self.step_missing: set[str] = set()
        self.end_values = None

    def _on_step(self) -> bool:
        self.step_missing |= {k for k in self.SB3_STEP if k not in self.locals}
        assert self.locals["clipped_actions"].shape == (self.model.n_envs,)
        assert self.locals["values"].shape == (self.model.n_envs,)
        return True

    def _on_rollout_end(self) -> None:
        self.end_values = self.locals.get("values")


def test_callbacks_see_sb3s_locals():
    model = _model(make_vec_env("CartPole-v1", n_envs=2, seed=0), n_steps=8)
    seen = _LocalsSeen()
    model.learn(16, callback=seen)
    assert seen.step_missing == set()
    assert seen.end_values is not None and seen.end_values.shape == (2,)


def test_sb3s_checks_speak_of_the_real_batch_size(recwarn):
    model = _model(make_vec_env("CartPole-v1", n_envs=1, seed=0), n_steps=7)
    assert model.batch_size == 7
    assert not [w for w in recwarn if "mini-batch" in str(w.message)]
    with pytest.raises(ValueError, match=r"a minibatch of 1 sample \(n_envs=4 × n_steps=1 / n_minibatches=4\) cannot "
                                         "normalise advantages"):
        MemoryPPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=4, seed=0), n_steps=1, n_minibatches=4,
                  device="cpu", policy_kwargs=EFLA)


def test_a_model_loads_with_another_env_count(tmp_path):
    """SB3's load takes an env of another size; the automatic n_minibatches is chosen again for it, a chosen one
    must divide it."""
    auto = MemoryPPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=4, seed=0), n_steps=8, device="cpu",
                     policy_kwargs=EFLA)
    assert auto.n_minibatches == 4
    auto.save(tmp_path / "auto.zip")
    loaded = MemoryPPO.load(tmp_path / "auto.zip", env=make_vec_env("CartPole-v1", n_envs=6, seed=0), device="cpu")
    assert (loaded.n_envs, loaded.n_minibatches, loaded.batch_size) == (6, 3, 16)
    loaded.learn(48)
    fixed = MemoryPPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=4, seed=0), n_steps=8, n_minibatches=4,
                      device="cpu", policy_kwargs=EFLA)
    fixed.save(tmp_path / "fixed.zip")
    with pytest.raises(ValueError, match=r"n_minibatches=4 must divide n_envs=6.*load\(\.\.\., n_minibatches=N\)"):
        MemoryPPO.load(tmp_path / "fixed.zip", env=make_vec_env("CartPole-v1", n_envs=6, seed=0), device="cpu")
    again = MemoryPPO.load(tmp_path / "fixed.zip", env=make_vec_env("CartPole-v1", n_envs=6, seed=0), device="cpu",
                           n_minibatches=2)
    assert again.n_minibatches == 2


def test_train_records_the_action_std_of_a_box_policy_and_the_minibatch_a_kl_stop_ends_on():
    model = _model(make_vec_env("Pendulum-v1", n_envs=2, seed=0), n_steps=8)
    model.learn(16)
    assert model.logger.name_to_value["train/std"] == pytest.approx(torch.exp(model.policy.log_std).mean().item())
    stopped = _model(make_vec_env("CartPole-v1", n_envs=2, seed=0), n_steps=8, target_kl=-1.0)  # stops at once
    stopped.learn(16)
    assert "train/value_loss" in stopped.logger.name_to_value and "train/grad_norm" not in stopped.logger.name_to_value
