"""Gymnasium envs in the training CLI: env-id resolution, observation adaptation, POPGym through the whole
wrapper chain, tiny training runs (Discrete, MultiDiscrete and Box actions; MemoryPPO and sb3-contrib's stock
LSTM), evaluation on new seeds, compare and sweep over the run folders."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import yaml
from gymnasium import spaces

from rlseq.envs import SB3Observation, adapt_observation, make_gym, resolve_env_id
from rlseq.train import build_parser, main as train_main, resolve, run_dir

TINY = ["--n-envs", "4", "--n-steps", "32", "--n-minibatches", "2", "--n-epochs", "1", "--no-progress-bar"]


@pytest.fixture(autouse=True)
def _quiet_env_checker():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium's passive env checker on POPGym's info dicts
        yield


def _resolved(*argv: str) -> dict:
    return resolve(build_parser().parse_args(list(argv)))


def _fail(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def env_package(tmp_path, monkeypatch):
    """A module that registers ``rlseqtest/<name>-v0`` (the memory task of rlseq.tasks) when imported."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, body: str | None = None) -> str:
        module = f"rlseqtest_{name.lower()}"
        (tmp_path / f"{module}.py").write_text(body or textwrap.dedent(f"""
            import gymnasium as gym
            if "rlseqtest/{name}-v0" not in gym.registry:
                gym.register("rlseqtest/{name}-v0", entry_point="rlseq.tasks:CueRecallEnv")
        """))
        return module

    return write


# --- env ids ------------------------------------------------------------------------------------------


def test_procgen_names_gym_ids_and_popgym_ids_resolve_to_their_family():
    assert resolve_env_id("caveflyer")[:2] == resolve_env_id("procgen:caveflyer")[:2] == ("procgen", "caveflyer")
    assert resolve_env_id("CartPole-v1")[:2] == ("gym", "CartPole-v1")
    assert resolve_env_id("popgym-RepeatPreviousEasy-v0")[:2] == ("popgym", "popgym-RepeatPreviousEasy-v0")
    assert resolve_env_id("rlseq/CueRecall-v0")[:2] == ("gym", "rlseq/CueRecall-v0")  # rlseq.tasks imported by prefix


def test_popgym_ids_import_popgym_by_themselves():
    code = ("import sys; from rlseq.envs import resolve_env_id; assert 'popgym' not in sys.modules; "
            "print(resolve_env_id('popgym-AutoencodeEasy-v0').family, 'popgym' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["popgym", "True"]


def test_env_package_registers_ids_before_lookup(env_package, capsys):
    module = env_package("Pkg")
    with pytest.raises(ValueError, match="unknown env 'rlseqtest/Pkg-v0'"):
        resolve_env_id("rlseqtest/Pkg-v0")
    assert resolve_env_id("rlseqtest/Pkg-v0", [module]) == ("gym", "rlseqtest/Pkg-v0", (module,))
    assert resolve_env_id(f"{module}:rlseqtest/Pkg-v0") == ("gym", "rlseqtest/Pkg-v0", (module,))
    cfg = _resolved("--env", "rlseqtest/Pkg-v0", "--env-package", module, "--env-package", "popgym")
    assert cfg["env"] == "rlseqtest/Pkg-v0" and cfg["env_family"] == "gym" and cfg["env_packages"] == [module, "popgym"]
    assert cfg["gamma"] == 0.99 and cfg["normalize_reward"] is True  # configs/gym.yml's default entry
    assert run_dir("runs", cfg) == Path("runs/rlseqtest_Pkg-v0/efla/seed0")


def test_an_unknown_id_names_the_closest_registered_ids(capsys):
    err = _fail(["--env", "popgym-VelocityOnlyCartPoleEasy-v0"], capsys)
    assert "unknown env 'popgym-VelocityOnlyCartPoleEasy-v0'" in err
    assert "closest: popgym-VelocityOnlyCartpoleEasy-v0" in err
    assert "closest: CartPole-v1" in _fail(["--env", "cartpole-v1"], capsys)


def test_a_package_that_fails_to_import_is_named(env_package, capsys):
    assert "env package 'rlseqtest_nope' failed to import (ModuleNotFoundError" in \
        _fail(["--env", "CartPole-v1", "--env-package", "rlseqtest_nope"], capsys)
    broken = env_package("Broken", "raise RuntimeError('no licence')\n")
    assert f"env package '{broken}' failed to import (RuntimeError: no licence)" in \
        _fail(["--env", "CartPole-v1", "--env-package", broken], capsys)


@pytest.mark.parametrize("argv,message", [
    (["--num-levels", "10"], "--num-levels: procgen options"),
    (["--distribution-mode", "hard", "--num-threads", "2"], "--distribution-mode, --num-threads: procgen options"),
])
def test_procgen_options_are_refused_for_gymnasium_envs(argv, message, capsys):
    assert message in _fail(["--env", "CartPole-v1", *argv], capsys)


def test_a_config_entry_per_env_id_and_procgen_env_kwargs_refused(tmp_path):
    config = tmp_path / "c.yml"
    config.write_text(textwrap.dedent("""
        popgym: &popgym {n_timesteps: 100, n_envs: 2, n_steps: 8, n_minibatches: 1, n_epochs: 1, learning_rate: 1.0e-3,
                         gamma: 0.9, gae_lambda: 0.9, ent_coef: 0.0, vf_coef: 0.5, clip_range: 0.2, max_grad_norm: 0.5,
                         checkpoint_every: 100, memory_kwargs: {lstm: {hidden_size: 16}}}
        popgym-RepeatFirstEasy-v0: {<<: *popgym, gamma: 0.5, env_kwargs: {num_levels: 3}}
    """))
    assert _resolved("--env", "popgym-RepeatPreviousEasy-v0", "--config", str(config))["gamma"] == 0.9
    cfg = _resolved("--env", "popgym-RepeatPreviousEasy-v0", "--config", str(config), "--memory", "lstm")
    assert cfg["memory_kwargs"] == {"hidden_size": 16}
    with pytest.raises(ValueError, match="env_kwargs num_levels of the config are procgen options"):
        _resolved("--env", "popgym-RepeatFirstEasy-v0", "--config", str(config))
    with pytest.raises(ValueError, match="no 'gym' default"):
        _resolved("--env", "CartPole-v1", "--config", str(config))
    popgym = _resolved("--env", "popgym-MineSweeperEasy-v0", "--memory", "gru")  # configs/popgym.yml's default entry
    assert (popgym["n_envs"], popgym["n_steps"], popgym["n_minibatches"], popgym["n_epochs"]) == (8, 128, 4, 4)
    assert popgym["learning_rate"] == 5e-4 and popgym["normalize_reward"] is False and popgym["memory_kwargs"] == {}
    # its memory_learning_rate: EFLA and the LSTM have rates of their own
    assert [_resolved("--env", "popgym-MineSweeperEasy-v0", "--memory", m)["learning_rate"] for m in ("efla", "lstm")] \
        == [2.5e-4, 1e-3]


# --- observation spaces and the wrapper chain -----------------------------------------------------------


def test_tuple_observations_become_multidiscrete_or_one_box():
    space, fn = adapt_observation(spaces.Tuple((spaces.Discrete(2), spaces.Discrete(4, start=1))))
    assert space == spaces.MultiDiscrete([2, 4])
    assert np.array_equal(fn((1, 4)), [1, 3])
    space, fn = adapt_observation(spaces.Tuple((spaces.Box(-1, 1, (2,)), spaces.Box(0, 5, (1, 2), dtype=np.float64))))
    assert space.shape == (4,) and space.dtype == np.float64
    assert np.array_equal(space.low, [-1, -1, 0, 0])
    assert np.array_equal(fn((np.ones(2), np.full((1, 2), 3.0))), [1, 1, 3, 3])
    space, fn = adapt_observation(spaces.Tuple((spaces.Discrete(3), spaces.Box(0, 1, (2,)))))
    assert space.shape == (5,) and np.array_equal(fn((2, np.zeros(2))), [0, 0, 1, 0, 0])  # one-hot + box
    space, _ = adapt_observation(spaces.Dict(a=spaces.Tuple((spaces.Discrete(2),)), b=spaces.Box(0, 1, (3,))))
    assert space["a"] == spaces.MultiDiscrete([2]) and space["b"] == spaces.Box(0, 1, (3,))
    assert adapt_observation(spaces.Discrete(4)) is None and adapt_observation(spaces.Box(0, 1, (2,))) is None

    venv = make_gym("popgym-AutoencodeEasy-v0", 2, seed=0)
    assert venv.observation_space == spaces.MultiDiscrete([2, 4])
    assert isinstance(venv.envs[0], SB3Observation)
    obs = venv.reset()
    assert obs.shape == (2, 2) and all(venv.observation_space.contains(o) for o in obs)


def test_gym_envs_are_seeded_seed_plus_i():
    a, b = (make_gym("CartPole-v1", 3, seed=7).reset() for _ in range(2))
    assert np.array_equal(a, b)
    for i in range(3):
        assert np.allclose(a[i], gym.make("CartPole-v1").reset(seed=7 + i)[0])


def test_every_popgym_easy_env_builds_and_steps_through_the_whole_wrapper_chain():
    from stable_baselines3.common.vec_env import VecNormalize

    from rlseq.envs import PotentialValueShift, PrevActionReward, ScaleReward
    from rlseq.train import make_env

    import popgym  # noqa: F401

    ids = sorted(k for k in gym.registry if k.startswith("popgym-") and k.endswith("Easy-v0"))
    assert len(ids) == 14 and "popgym-AutoencodeEasy-v0" in ids
    kinds = set()
    for env_id in ids:
        base = _resolved("--env", env_id, "--reward-scale", "10", "--value-shift", "3", "--normalize-reward")
        discrete = not env_id.startswith(("popgym-Battleship", "popgym-MineSweeper", "popgym-PositionOnlyPend",
                                          "popgym-NoisyPositionOnlyPend"))
        venv = make_env({**base, "prev_action_reward": discrete}, seed=0, n_envs=2)
        chain, inner = [], venv
        while hasattr(inner, "venv"):
            chain.append(type(inner))
            inner = inner.venv
        assert chain == [VecNormalize, *([PrevActionReward] if discrete else []), PotentialValueShift, ScaleReward], env_id
        kinds.add(type(venv.action_space).__name__)
        obs, episodes = venv.reset(), []
        for _ in range(210):  # the Pendulums and the bandit end after 200 steps
            obs, rewards, dones, infos = venv.step(np.stack([venv.action_space.sample() for _ in range(2)]))
            episodes += [info["episode"] for info in infos if "episode" in info]
            assert np.all(np.isfinite(rewards))
        space = venv.observation_space
        assert all(space.contains({k: v[i] for k, v in obs.items()} if discrete else obs[i]) for i in range(2)), env_id
        assert episodes and all({"r", "l", "r_scaled"} <= set(ep) for ep in episodes), env_id
        assert all(-1.0 - 1e-6 <= ep["r"] <= 1.0 + 1e-6 for ep in episodes), env_id  # the unscaled POPGym return
        venv.close()
    assert kinds == {"Discrete", "MultiDiscrete", "Box"}


def test_prev_action_reward_needs_discrete_actions(tmp_path, capsys):
    err = _fail(["--env", "popgym-BattleshipEasy-v0", "--prev-action-reward", "--logdir", str(tmp_path), *TINY], capsys)
    assert "--prev-action-reward needs a Discrete action space; popgym-BattleshipEasy-v0 has MultiDiscrete" in err


# --- training, evaluation, compare, sweep -----------------------------------------------------------------


def _scalar_tags(run: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for f in run.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


@pytest.fixture(scope="module")
def popgym_run(tmp_path_factory) -> Path:
    logdir = tmp_path_factory.mktemp("runs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_main(["--env", "popgym-RepeatPreviousEasy-v0", "--memory", "efla", "--total-steps", "512", "--seed", "2",
                    "--logdir", str(logdir), *TINY])
    return logdir


def test_a_popgym_run_writes_its_run_folder_like_a_procgen_run(popgym_run):
    run = popgym_run / "popgym-RepeatPreviousEasy-v0" / "efla" / "seed2"
    assert (run / "final_model.zip").exists() and (run / "checkpoints" / "latest").exists()
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["env"] == "popgym-RepeatPreviousEasy-v0" and cfg["env_family"] == "popgym" and cfg["env_packages"] == []
    assert cfg["n_timesteps"] == 512 and cfg["gamma"] == 0.99 and cfg["normalize_reward"] is False
    assert "distribution_mode" not in cfg["env_kwargs"]
    tags = _scalar_tags(run)
    assert {"rollout/ep_rew_mean", "time/fps", "train/grad_norm", "memory/state_norm_max"} <= tags


def test_evaluate_a_gym_run_on_new_seeds(popgym_run, capsys):
    from rlseq.evaluate import EVAL_SEED_OFFSET, evaluate, main as evaluate_main

    run = popgym_run / "popgym-RepeatPreviousEasy-v0" / "efla" / "seed2"
    res = evaluate(run, 4, n_envs=2, seed=5, progress=False, device="cpu")
    assert res["episodes"] == 4 and res["first_seed"] == EVAL_SEED_OFFSET + 5 and "start_level" not in res
    assert -1.0 <= res["min"] <= res["mean"] <= res["max"] <= 1.0
    with pytest.raises(SystemExit):
        evaluate_main([str(run), "--episodes", "1", "--start-level", "3"])
    assert "--start-level is a procgen option" in capsys.readouterr().err


def test_compare_reads_gym_runs(popgym_run):
    from rlseq.compare import load_runs

    df = load_runs(popgym_run)
    assert set(df["env"]) == {"popgym-RepeatPreviousEasy-v0"} and set(df["variant"]) == {"efla"}
    assert (df["tag"] == "rollout/ep_rew_mean").any()


@pytest.mark.parametrize("env_id,extra,action_space", [
    ("popgym-BattleshipEasy-v0", [], spaces.MultiDiscrete),
    ("Pendulum-v1", ["--memory", "none"], spaces.Box),
    ("popgym-AutoencodeEasy-v0", ["--memory", "none"], spaces.Discrete),
])
def test_memoryppo_trains_on_multidiscrete_box_and_tuple_spaces(env_id, extra, action_space, tmp_path):
    from rlseq.algos import MemoryPPO

    train_main(["--env", env_id, "--total-steps", "128", "--logdir", str(tmp_path), *TINY, *extra])
    run = next(tmp_path.glob("*/*/seed0"))
    model = MemoryPPO.load(run / "final_model.zip", device="cpu")
    assert model.num_timesteps == 128 and isinstance(model.action_space, action_space)
    assert all(np.isfinite(p.detach().numpy()).all() for p in model.policy.parameters())


def test_sb3_recurrent_ppo_lstm_is_the_stock_mlp_lstm_policy(tmp_path):
    from sb3_contrib import RecurrentPPO
    from sb3_contrib.ppo_recurrent.policies import MlpLstmPolicy
    from stable_baselines3.common.torch_layers import FlattenExtractor

    train_main(["--env", "popgym-RepeatPreviousEasy-v0", "--algo", "sb3-recurrent-ppo", "--memory", "lstm",
                "--total-steps", "128", "--logdir", str(tmp_path), *TINY])
    model = RecurrentPPO.load(tmp_path / "popgym-RepeatPreviousEasy-v0" / "sb3-lstm" / "seed0" / "final_model.zip",
                              device="cpu")
    assert type(model.policy) is MlpLstmPolicy and type(model.policy.features_extractor) is FlattenExtractor
    assert model.policy.lstm_actor.hidden_size == 256  # sb3-contrib's default: memory_kwargs sets none
    assert model.num_timesteps == 128


def test_sb3_recurrent_ppo_policies_for_vector_observations():
    from sb3_contrib.ppo_recurrent.policies import MlpLstmPolicy

    from rlseq.policies import DeltaNetMlpPolicy, EflaMlpPolicy
    from rlseq.train import build_model, make_env

    for memory, cls in (("lstm", MlpLstmPolicy), ("efla", EflaMlpPolicy), ("deltanet", DeltaNetMlpPolicy)):
        cfg = _resolved("--env", "popgym-AutoencodeEasy-v0", "--algo", "sb3-recurrent-ppo", "--memory", memory,
                        "--n-envs", "2", "--n-minibatches", "1")
        if memory == "lstm":
            cfg["memory_kwargs"] = {"hidden_size": 24}
        env = make_env(cfg, seed=0)
        model = build_model(cfg, env, "cpu")
        assert type(model.policy) is cls, memory
        if memory == "lstm":  # MultiDiscrete observations: SB3's flatten extractor, with an int width for nn.LSTM
            assert model.policy.lstm_actor.hidden_size == 24 and model.policy.lstm_actor.input_size == 6
        env.close()


def test_sweep_runs_gym_ids_with_env_packages(env_package, tmp_path):
    from rlseq.sweep import expand

    module = env_package("Sweep")
    spec = {"envs": ["rlseqtest/Sweep-v0", "popgym-RepeatPreviousEasy-v0"], "memories": ["efla"], "seeds": [0],
            "conditions": {"base": {}}, "flags": {"env_package": [module, "popgym"], "total_steps": 64},
            "logdir": str(tmp_path)}
    runs = expand(spec)
    assert [r.folder for r in runs] == [tmp_path / "rlseqtest_Sweep-v0" / "efla-base" / "seed0",
                                        tmp_path / "popgym-RepeatPreviousEasy-v0" / "efla-base" / "seed0"]
    assert runs[0].argv[-6:] == ["--env-package", module, "--env-package", "popgym", "--total-steps", "64"]


@pytest.mark.parametrize(("n_envs", "minibatches"), [(1, 1), (3, 3), (6, 3), (8, 4), (7, 1)])
def test_memoryppo_default_minibatching_works_for_any_env_count(n_envs, minibatches):
    """No n_minibatches given: the largest divisor of n_envs up to 4, so a user's MemoryPPO("MlpPolicy", env) runs
    at any env count (one rollout and one update here)."""
    import popgym  # noqa: F401  (registers the ids)

    from rlseq.algos import MemoryPPO

    env = make_gym("popgym-RepeatPreviousEasy-v0", n_envs, seed=0)
    model = MemoryPPO("MlpPolicy", env, n_steps=8, n_epochs=1, seed=0)
    assert model.n_minibatches == minibatches
    model.learn(8 * n_envs)
    assert model.num_timesteps == 8 * n_envs
    env.close()
