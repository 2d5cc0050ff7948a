"""Tests for rlseq.envs: the procgen VecEnv and the scale wrappers.

Procgen envs are kept small (<= 4 games, a few hundred steps, num_threads=0
where threading does not matter) so the whole file runs in seconds.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("procgen")

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.vec_env import VecEnv, VecEnvWrapper, VecMonitor, VecNormalize, VecTransposeImage  # noqa: E402

from rlseq.envs import (  # noqa: E402
    PROCGEN_DISTRIBUTION_MODES,
    PROCGEN_GAMES,
    PotentialValueShift,
    PrevActionReward,
    ProcgenVecEnv,
    ScaledReturnLogger,
    ScaleReward,
    make_procgen,
)

GAMMA = 0.999


@pytest.fixture(autouse=True)
def _quiet_gym_notice():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _rand_actions(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 15, size=n)


class Recorder(VecEnvWrapper):
    """Pass-through wrapper that remembers the last rewards/dones/infos it saw."""

    def reset(self):
        return self.venv.reset()

    def step_wait(self):
        obs, rew, dones, infos = self.venv.step_wait()
        self.rewards, self.dones = np.array(rew, dtype=np.float64), np.array(dones)
        self.truncated = np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos])
        return obs, rew, dones, infos


class ScriptedVecEnv(VecEnv):
    """Deterministic VecEnv replaying given reward / done / truncated tables [T, n]."""

    def __init__(self, rewards: np.ndarray, dones: np.ndarray, truncated: np.ndarray | None = None):
        self.render_mode = None
        n = rewards.shape[1]
        super().__init__(n, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(3))
        self._rew, self._done = rewards.astype(np.float32), dones.astype(bool)
        self._trunc = np.zeros_like(self._done) if truncated is None else truncated.astype(bool)
        self._t = 0

    def reset(self):
        self._t = 0
        return np.zeros((self.num_envs, 2), np.float32)

    def step_async(self, actions):
        pass

    def step_wait(self):
        t = self._t
        self._t += 1
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        for i in np.flatnonzero(self._done[t]):
            infos[i] = {"terminal_observation": np.zeros(2, np.float32), "TimeLimit.truncated": bool(self._trunc[t, i])}
        return np.zeros((self.num_envs, 2), np.float32), self._rew[t].copy(), self._done[t].copy(), infos

    def close(self):
        pass

    def get_attr(self, attr_name, indices=None):
        return [getattr(self, attr_name) for _ in self._get_indices(indices)]

    def set_attr(self, attr_name, value, indices=None):
        setattr(self, attr_name, value)

    def env_method(self, method_name, *args, indices=None, **kwargs):
        return [getattr(self, method_name)(*args, **kwargs) for _ in self._get_indices(indices)]

    def env_is_wrapped(self, wrapper_class, indices=None):
        return [False for _ in self._get_indices(indices)]


def _episode_discounted_returns(rewards: np.ndarray, dones: np.ndarray, gamma: float):
    """Split [T, n] tables into finished episodes -> list of (env, discounted return, length)."""
    out = []
    for i in range(rewards.shape[1]):
        g, k = 0.0, 0
        for t in range(rewards.shape[0]):
            g += gamma**k * float(rewards[t, i])
            k += 1
            if dones[t, i]:
                out.append((i, g, k))
                g, k = 0.0, 0
    return out


# --------------------------------------------------------------------------------------
# games table and input validation
# --------------------------------------------------------------------------------------


def test_games_table_matches_installed_procgen():
    import procgen.env as penv

    assert list(PROCGEN_GAMES) == list(penv.ENV_NAMES)
    assert set(PROCGEN_DISTRIBUTION_MODES) == set(penv.ENV_NAMES)
    exploration = {g for g, modes in PROCGEN_DISTRIBUTION_MODES.items() if "exploration" in modes}
    assert exploration == set(penv.EXPLORATION_LEVEL_SEEDS)
    for modes in PROCGEN_DISTRIBUTION_MODES.values():
        assert modes[:2] == ("easy", "hard")
        assert set(modes) <= set(penv.DISTRIBUTION_MODE_DICT)
    assert "memory" in PROCGEN_DISTRIBUTION_MODES["caveflyer"]
    assert "memory" not in PROCGEN_DISTRIBUTION_MODES["bigfish"]


def test_every_game_and_mode_builds():
    # An unsupported (game, mode) would abort the process inside procgen, so this
    # also proves the table only lists modes the binary accepts.
    for game, modes in PROCGEN_DISTRIBUTION_MODES.items():
        for mode in modes:
            env = make_procgen(game, 1, distribution_mode=mode, seed=0, num_threads=0)
            try:
                obs = env.reset()
                assert obs.shape == (1, 64, 64, 3) and obs.dtype == np.uint8
                assert env.action_space == spaces.Discrete(15)
                assert env.timeout is not None and env.timeout >= 500, (game, mode, env.timeout)
                env.step(np.array([4]))
            finally:
                env.close()


@pytest.mark.parametrize("name", ["caveflyer", "procgen:caveflyer", "procgen-caveflyer-v0", " CaveFlyer "])
def test_env_name_forms(name):
    env = make_procgen(name, 1, seed=0, num_threads=0)
    assert env.env_name == "caveflyer"
    env.close()


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown procgen game 'pong'") as exc:
        make_procgen("pong", 2)
    for game in PROCGEN_GAMES:
        assert game in str(exc.value)
    with pytest.raises(ValueError, match="valid modes for bigfish are: easy, hard$"):
        make_procgen("bigfish", 2, distribution_mode="memory")
    with pytest.raises(ValueError, match="valid modes for caveflyer are: easy, hard, memory, exploration"):
        make_procgen("caveflyer", 2, distribution_mode="extreme")
    with pytest.raises(ValueError, match="n_envs must be in"):
        make_procgen("caveflyer", 0)
    with pytest.raises(TypeError, match="n_envs must be an int"):
        make_procgen("caveflyer", 2.5)
    with pytest.raises(ValueError, match="seed must be in"):
        make_procgen("caveflyer", 2, seed=-1)
    with pytest.raises(ValueError, match="num_levels must be in"):
        make_procgen("caveflyer", 2, num_levels=-3)
    with pytest.raises(ValueError, match="exploration"):
        make_procgen("caveflyer", 2, distribution_mode="exploration", num_levels=10)
    with pytest.raises(TypeError, match="unknown procgen option"):
        make_procgen("caveflyer", 2, not_an_option=True)

    env = make_procgen("caveflyer", 2, seed=0, num_threads=0)
    env.reset()
    with pytest.raises(ValueError, match="in \\[0, 15\\)"):
        env.step(np.array([0, 15]))
    with pytest.raises(ValueError, match="expected 2 actions"):
        env.step(np.array([0, 1, 2]))
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be"):
            ScaleReward(env, bad)
    with pytest.raises(TypeError):
        ScaleReward(env, "big")
    for bad_gamma in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="gamma must be"):
            PotentialValueShift(env, 1e4, gamma=bad_gamma)
    with pytest.raises(ValueError, match="shift must be finite"):
        PotentialValueShift(env, float("inf"), gamma=0.99)
    with pytest.raises(TypeError, match="gamma"):  # no default: it must be the agent's discount factor
        PotentialValueShift(env, 1e4)
    env.close()

    box_actions = ScriptedVecEnv(np.zeros((1, 1)), np.zeros((1, 1)))
    box_actions.action_space = spaces.Box(-1, 1, (2,))
    with pytest.raises(TypeError, match="Discrete action space"):
        PrevActionReward(box_actions)


def test_timeout_parser_rejects_unexpected_state():
    from rlseq.envs.procgen import _parse_timeout

    assert _parse_timeout(b"", "maze") is None
    assert _parse_timeout(b"\x00" * 64, "maze") is None  # wrong game name
    assert _parse_timeout(b"\x07\x00\x00\x00" + b"\x00" * 200, "maze") is None  # unknown version


def test_missing_procgen_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "procgen", None)  # makes `import procgen` fail
    with pytest.raises(ImportError, match="pip install procgen-mirror"):
        make_procgen("caveflyer", 1)


def test_import_is_light():
    import subprocess

    # Whatever `import rlseq` itself loads, `rlseq.envs` must add neither procgen nor SB3/torch.
    code = (
        "import sys, rlseq; before = set(sys.modules); import rlseq.envs; "
        "new = set(sys.modules) - before; "
        "heavy = {m for m in new if m.split('.')[0] in ('procgen', 'gym3', 'stable_baselines3', 'torch')}; "
        "assert not heavy, sorted(heavy)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------
# the procgen VecEnv
# --------------------------------------------------------------------------------------


def test_step_loop_episode_stats_match_hand_sums():
    n = 4
    env = make_procgen("bigfish", n, seed=7, num_threads=2)
    rng = np.random.default_rng(0)
    obs = env.reset()
    assert obs.shape == (n, 64, 64, 3) and obs.dtype == np.uint8
    assert env.observation_space.contains(obs[0])
    hand_r, hand_l = np.zeros(n), np.zeros(n, dtype=int)
    episodes, nonzero = 0, 0
    for step in range(400):
        if step == 250:  # a mid-run reset must restart the statistics
            obs = env.reset()
            hand_r[:], hand_l[:] = 0, 0
        prev_obs = obs
        obs, rew, dones, infos = env.step(_rand_actions(rng, n))
        assert rew.dtype == np.float32 and rew.shape == (n,)
        assert dones.dtype == bool and dones.shape == (n,)
        assert len(infos) == n
        hand_r += rew
        hand_l += 1
        for i in range(n):
            if not dones[i]:
                assert "episode" not in infos[i]
                continue
            episodes += 1
            ep = infos[i]["episode"]
            assert ep["l"] == hand_l[i]
            assert ep["r"] == pytest.approx(hand_r[i], abs=1e-6)
            nonzero += ep["r"] != 0
            assert ep["t"] >= 0
            # procgen never shows the real final frame: we report the last observed one
            np.testing.assert_array_equal(infos[i]["terminal_observation"], prev_obs[i])
            assert infos[i]["TimeLimit.truncated"] is False  # bigfish timeout is 6000 steps
            assert isinstance(infos[i]["is_success"], bool)
            hand_r[i], hand_l[i] = 0, 0
    assert episodes >= 5 and nonzero >= 1
    env.close()


def test_seeding_is_reproducible():
    rng = np.random.default_rng(1)
    actions = [_rand_actions(rng, 3) for _ in range(60)]

    def rollout(seed, num_threads):
        env = make_procgen("coinrun", 3, seed=seed, num_threads=num_threads)
        frames = [env.reset()]
        frames += [env.step(a)[0] for a in actions]
        env.close()
        return np.stack(frames)

    a, b = rollout(3, 0), rollout(3, 2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[0], rollout(4, 0)[0])

    # SB3-style seeding (model.set_random_seed -> env.seed) rebuilds at the next reset
    env = make_procgen("coinrun", 3, seed=11, num_threads=0)
    env.step(actions[0])
    env.seed(3)
    np.testing.assert_array_equal(env.reset(), a[0])
    env.close()


def test_time_limit_truncation_is_reported():
    env = make_procgen("maze", 2, seed=0, num_threads=0)  # maze: timeout 500, standing still never ends it
    assert env.timeout == 500
    env.reset()
    for t in range(500):
        _, _, dones, infos = env.step(np.array([4, 4]))
        if t < 499:
            assert not dones.any()
    assert dones.all()
    for info in infos:
        assert info["TimeLimit.truncated"] is True and info["is_success"] is False
        assert info["episode"]["l"] == 500
    env.close()


def test_close_frees_native_env():
    env = make_procgen("caveflyer", 2, seed=0, num_threads=2)
    env.reset()
    env.step(np.array([1, 2]))
    env.close()
    assert env.closed
    env.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        env.step(np.array([1, 2]))


def test_vecenv_plumbing():
    env = make_procgen("caveflyer", 3, seed=0, num_threads=0)
    assert env.get_attr("env_name") == ["caveflyer"] * 3
    assert env.get_attr("env_name", indices=[0]) == ["caveflyer"]
    from stable_baselines3.common.monitor import Monitor

    assert env.env_is_wrapped(Monitor) == [True] * 3  # it writes Monitor-style statistics
    env.reset()
    assert env.render(mode="rgb_array").shape == (128, 128, 3)  # 2x2 tiles of 64x64
    env.close()


# --------------------------------------------------------------------------------------
# reward / value wrappers
# --------------------------------------------------------------------------------------


def test_scale_reward_keeps_unscaled_episode_return():
    scale = 1e4
    base = make_procgen("bigfish", 4, seed=7, num_threads=0)
    rec = Recorder(base)
    env = ScaleReward(rec, scale)
    rng = np.random.default_rng(0)
    env.reset()
    hand_r = np.zeros(4)
    checked = 0
    for _ in range(300):
        _, rew, dones, infos = env.step(_rand_actions(rng, 4))
        assert rew.dtype == np.float32
        np.testing.assert_allclose(rew, rec.rewards * scale, rtol=1e-7)
        hand_r += rec.rewards
        for i in np.flatnonzero(dones):
            ep = infos[i]["episode"]
            assert ep["r"] == pytest.approx(hand_r[i])  # unscaled game return
            assert ep["r_scaled"] == pytest.approx(scale * hand_r[i], rel=1e-6, abs=1e-6)
            checked += ep["r"] != 0
            hand_r[i] = 0
    assert checked >= 1
    env.close()


def test_value_shift_identity_on_scripted_trajectories():
    # 3 envs, random episode lengths, rewards, and some time-limit truncations.
    rng = np.random.default_rng(0)
    T, n, shift = 400, 3, 1e4
    rewards = rng.normal(size=(T, n)) * (rng.random((T, n)) < 0.2)
    dones = rng.random((T, n)) < 0.03
    truncated = dones & (rng.random((T, n)) < 0.4)
    for bootstrap in (True, False):
        env = PotentialValueShift(ScriptedVecEnv(rewards, dones, truncated), shift, gamma=GAMMA, bootstrap_truncation=bootstrap)
        env.reset()
        shaped = np.stack([env.step(np.zeros(n, int))[1] for _ in range(T)]).astype(np.float64)
        base_eps = _episode_discounted_returns(rewards.astype(np.float32), dones, GAMMA)
        new_eps = _episode_discounted_returns(shaped, dones, GAMMA)
        ends = [(t, i) for i in range(n) for t in range(T) if dones[t, i]]
        trunc_of_episode: dict[int, list[bool]] = {}
        for i in range(n):
            for t in range(T):
                if dones[t, i]:
                    trunc_of_episode.setdefault(i, []).append(bool(truncated[t, i]))
        assert len(base_eps) == len(new_eps) == len(ends) > 20
        counters = {i: 0 for i in range(n)}
        n_trunc = 0
        for (i, g, length), (_, g2, _) in zip(base_eps, new_eps):
            was_truncated = trunc_of_episode[i][counters[i]]
            counters[i] += 1
            if bootstrap and was_truncated:
                # not terminal: the remaining shift * gamma^T comes from bootstrapping V'(s_T)
                expected = g + shift * (1 - GAMMA**length)
                n_trunc += 1
            else:
                expected = g + shift  # exactly +shift, whatever the episode length
            assert g2 == pytest.approx(expected, rel=0, abs=1e-6 * shift)
        if bootstrap:
            assert n_trunc >= 3


def test_value_shift_preserves_optimal_policy_while_naive_offset_does_not():
    # Toy episodic task, two behaviours from the same start state:
    #   "quit":  end the episode at once, reward 0                 (1 step)
    #   "work":  walk 50 steps, then collect reward 1 and end       (51 steps)
    # Discounted returns: quit 0, work gamma^50 > 0  -> "work" is optimal.
    T = 51
    rewards = np.zeros((T, 2))
    dones = np.zeros((T, 2), bool)
    dones[0, 0] = True  # env 0 quits at once, then idles in fresh episodes that never end
    rewards[50, 1], dones[50, 1] = 1.0, True  # env 1 works
    shift = -1e5  # strongly negative values: a naive per-step penalty would make quitting optimal
    env = PotentialValueShift(ScriptedVecEnv(rewards, dones), shift, gamma=GAMMA)
    env.reset()
    shaped = np.stack([env.step(np.zeros(2, int))[1] for _ in range(T)]).astype(np.float64)
    g_quit = shaped[0, 0]
    g_work = sum(GAMMA**t * shaped[t, 1] for t in range(T))
    true_quit, true_work = 0.0, GAMMA**50
    assert g_work - g_quit == pytest.approx(true_work - true_quit, abs=1e-6 * abs(shift))
    assert g_work > g_quit
    assert g_quit == pytest.approx(shift) and g_work == pytest.approx(true_work + shift, abs=1e-6 * abs(shift))
    # the naive design: the same per-step offset without the terminal correction
    naive_step = (1 - GAMMA) * shift
    naive_quit = 0.0 + naive_step
    naive_work = sum(GAMMA**t * (rewards[t, 1] + naive_step) for t in range(T))
    assert naive_quit > naive_work  # ... flips the optimal behaviour, which PotentialValueShift does not


def test_value_shift_on_procgen_trajectories_across_resets():
    shift = 1e5
    base = make_procgen("starpilot", 4, seed=1, num_threads=0)
    rec = Recorder(base)
    env = PotentialValueShift(rec, shift, gamma=GAMMA)
    rng = np.random.default_rng(2)
    env.reset()
    R, S, D = [], [], []
    for _ in range(300):
        _, rew, dones, infos = env.step(_rand_actions(rng, 4))
        R.append(rec.rewards)
        S.append(rew.astype(np.float64))
        D.append(dones)
        assert not rec.truncated.any()
        for i in np.flatnonzero(dones):
            # r_scaled is the undiscounted return of what the agent received
            assert "r_scaled" in infos[i]["episode"]
    R, S, D = np.array(R), np.array(S), np.array(D)
    base_eps = _episode_discounted_returns(R, D, GAMMA)
    new_eps = _episode_discounted_returns(S, D, GAMMA)
    assert len(base_eps) >= 10 and any(g != 0 for _, g, _ in base_eps)
    for (_, g, _), (_, g2, _) in zip(base_eps, new_eps):
        assert g2 == pytest.approx(g + shift, rel=0, abs=1e-6 * shift)
    env.close()


def test_stacked_wrappers_report_outermost_scaled_return():
    base = make_procgen("starpilot", 4, seed=3, num_threads=0)
    inner = Recorder(base)
    env = ScaleReward(PotentialValueShift(ScaleReward(inner, 10.0), 1e3, gamma=GAMMA), 0.5)
    rng = np.random.default_rng(3)
    env.reset()
    emitted, game = np.zeros(4), np.zeros(4)
    n_eps = 0
    for _ in range(200):
        _, rew, dones, infos = env.step(_rand_actions(rng, 4))
        emitted += rew
        game += inner.rewards
        for i in np.flatnonzero(dones):
            ep = infos[i]["episode"]
            assert ep["r"] == pytest.approx(game[i])
            assert ep["r_scaled"] == pytest.approx(emitted[i], rel=1e-6)
            emitted[i] = game[i] = 0
            n_eps += 1
    assert n_eps >= 5
    env.close()


def test_wrappers_compose_with_vecnormalize_and_vecmonitor():
    base = make_procgen("bossfight", 2, seed=0, num_threads=0)
    # VecMonitor below the scale wrappers: it warns that it overwrites our stats
    # (same values here), and r stays the unscaled game return.
    with pytest.warns(UserWarning, match="Monitor"):
        mon = VecMonitor(base)
    env = VecNormalize(ScaleReward(mon, 1e3), norm_obs=False, gamma=GAMMA)
    rng = np.random.default_rng(0)
    env.reset()
    game = np.zeros(2)
    n_eps = 0
    for _ in range(150):
        _, rew, dones, infos = env.step(_rand_actions(rng, 2))
        assert np.all(np.isfinite(rew))
        raw = env.get_original_reward()
        game += raw / 1e3
        for i in np.flatnonzero(dones):
            assert infos[i]["episode"]["r"] == pytest.approx(game[i], abs=1e-4)
            assert infos[i]["episode"]["r_scaled"] == pytest.approx(1e3 * game[i], abs=1e-2)
            game[i] = 0
            n_eps += 1
    assert n_eps >= 2
    env.close()


# --------------------------------------------------------------------------------------
# PrevActionReward
# --------------------------------------------------------------------------------------


def test_prev_action_reward_shifts_across_episode_boundaries():
    n = 4
    base = make_procgen("starpilot", n, seed=5, num_threads=0)
    env = PrevActionReward(ScaleReward(base, 100.0))
    space = env.observation_space
    assert isinstance(space, spaces.Dict)
    assert set(space.spaces) == {"image", "prev_action", "prev_reward"}
    assert space["image"] == base.observation_space
    assert space["prev_action"].shape == (15,) and space["prev_reward"].shape == (1,)

    obs = env.reset()
    assert not obs["prev_action"].any() and not obs["prev_reward"].any()
    rng = np.random.default_rng(4)
    boundaries = rewarded = 0
    for _ in range(200):
        actions = _rand_actions(rng, n)
        prev_obs = obs
        obs, rew, dones, infos = env.step(actions)
        assert space.contains({k: v[0] for k, v in obs.items()})
        for i in range(n):
            if dones[i]:
                boundaries += 1
                # first frame of the new episode: nothing before it
                assert not obs["prev_action"][i].any() and obs["prev_reward"][i, 0] == 0
                term = infos[i]["terminal_observation"]
                assert set(term) == {"image", "prev_action", "prev_reward"}
                assert term["image"].shape == (64, 64, 3)
                np.testing.assert_array_equal(term["image"], prev_obs["image"][i])
                assert np.argmax(term["prev_action"]) == actions[i] and term["prev_action"].sum() == 1
                assert term["prev_reward"][0] == rew[i]
            else:
                assert np.argmax(obs["prev_action"][i]) == actions[i] and obs["prev_action"][i].sum() == 1
                assert obs["prev_reward"][i, 0] == rew[i]  # the (scaled) reward of the wrapped venv
                rewarded += rew[i] != 0
    assert boundaries >= 5 and rewarded >= 1
    obs = env.reset()
    assert not obs["prev_action"].any() and not obs["prev_reward"].any()
    env.close()


def test_prev_action_reward_with_transpose_and_vecnormalize():
    base = make_procgen("bossfight", 2, seed=0, num_threads=0)
    env = VecTransposeImage(PrevActionReward(base))
    assert env.observation_space["image"].shape == (3, 64, 64)
    assert env.observation_space["prev_action"].shape == (15,)
    env = VecNormalize(env, norm_obs_keys=["prev_reward"], gamma=GAMMA)
    obs = env.reset()
    assert obs["image"].shape == (2, 3, 64, 64) and obs["image"].dtype == np.uint8
    rng = np.random.default_rng(0)
    n_done = 0
    for _ in range(120):
        obs, _, dones, infos = env.step(_rand_actions(rng, 2))
        assert obs["image"].dtype == np.uint8 and obs["prev_action"].shape == (2, 15)
        for i in np.flatnonzero(dones):
            term = infos[i]["terminal_observation"]
            assert term["image"].shape == (3, 64, 64) and term["prev_action"].shape == (15,)
            n_done += 1
    assert n_done >= 1
    env.close()


def test_ppo_smoke_with_full_stack_and_scaled_logger():
    from stable_baselines3 import PPO
    from stable_baselines3.common.logger import KVWriter, Logger

    class Capture(KVWriter):
        def __init__(self):
            self.records: list[dict[str, Any]] = []

        def write(self, key_values, key_excluded, step=0):
            self.records.append(dict(key_values))

    base = make_procgen("bossfight", 2, seed=0, num_threads=0)
    env = PrevActionReward(PotentialValueShift(ScaleReward(base, 1e2), 1e4, gamma=GAMMA))
    env = VecNormalize(env, norm_obs_keys=["prev_reward"], gamma=GAMMA)
    model = PPO(
        "MultiInputPolicy", env, n_steps=64, batch_size=64, n_epochs=1, gamma=GAMMA, seed=0, device="cpu",
        policy_kwargs=dict(net_arch=[16]),
    )
    capture = Capture()
    model.set_logger(Logger(folder=None, output_formats=[capture]))
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny batches: one thread is fastest, and robust to a busy machine
    try:
        model.learn(256, callback=ScaledReturnLogger())
    finally:
        torch.set_num_threads(threads)
    logged = [r for r in capture.records if "rollout/ep_rew_mean" in r]
    assert logged, capture.records
    last = logged[-1]
    assert "rollout/ep_rew_scaled_mean" in last
    # unscaled game return vs. scaled-and-shifted return: about 1e4 apart
    assert abs(last["rollout/ep_rew_scaled_mean"] - last["rollout/ep_rew_mean"]) > 1e3
    assert math.isfinite(last["rollout/ep_rew_mean"])
    env.close()


def test_procgen_vecenv_is_sb3_vecenv():
    env = make_procgen("caveflyer", 1, seed=0, num_threads=0)
    assert isinstance(env, VecEnv) and isinstance(env, ProcgenVecEnv)
    env.close()


def test_no_gym_deprecation_notice_on_rlseq_commands():
    """procgen's legacy gym prints a deprecation notice at import; rlseq commands do not show it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import rlseq.envs, stable_baselines3, procgen, gym"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unmaintained" not in out.stderr and "Gym has been" not in out.stderr
