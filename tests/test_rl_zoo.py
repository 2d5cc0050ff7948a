"""rlseq's policies from an RL Zoo hyperparameter file: configs/rl_zoo/ppo_lstm.yml trains RecurrentPPO with
EflaMlpPolicy on POPGym, and ``-optimize`` runs Optuna trials into a journal file with rlseq.zoo's sampler.

The two end-to-end tests start ``python -m rl_zoo3.train`` (about a minute each on a small CPU): marked ``slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

rl_zoo3 = pytest.importorskip("rl_zoo3", reason="pip install -e '.[zoo]'")
optuna = pytest.importorskip("optuna")

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "rl_zoo" / "ppo_lstm.yml"
ENV = "popgym-RepeatPreviousEasy-v0"
SAMPLED = {"one_minus_gamma", "one_minus_gae_lambda", "learning_rate", "ent_coef", "clip_range", "n_epochs",
           "max_grad_norm"}


def _zoo(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "rl_zoo3.train", "--algo", "ppo_lstm", "--env", ENV, "-conf",
                           str(CONFIG), "-n", "512", "--gym-packages", "rlseq.zoo", "-f", str(tmp_path / "logs"),
                           "--device", "cpu", "--seed", "0", *extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_every_entry_of_the_shipped_file_names_a_registered_env_and_an_importable_policy():
    import gymnasium as gym
    from rl_zoo3.utils import get_class_by_name

    import rlseq.zoo  # noqa: F401  (what --gym-packages rlseq.zoo imports)
    from rlseq.policies import EflaMlpPolicy

    entries = yaml.safe_load(CONFIG.read_text())  # RL Zoo reads it with safe_load too
    assert {ENV, "popgym-PositionOnlyCartPoleEasy-v0"} <= set(entries)
    for env_id, params in entries.items():
        assert env_id in gym.registry, env_id
        assert get_class_by_name(params["policy"]) is EflaMlpPolicy
        assert eval(params["policy_kwargs"]) == {"memory_kwargs": {"n_heads": 4, "head_dim": 16, "value_dim": 16}}  # as RL Zoo does


def test_the_sampler_keeps_the_memory_and_the_sequence_length_of_the_file():
    from rl_zoo3.hyperparams_opt import HYPERPARAMS_CONVERTER, HYPERPARAMS_SAMPLER

    import rlseq.zoo

    assert HYPERPARAMS_SAMPLER["ppo_lstm"] is rlseq.zoo.sample_params
    assert HYPERPARAMS_CONVERTER["ppo_lstm"] is rlseq.zoo.convert_params
    trial = optuna.trial.FixedTrial({"one_minus_gamma": 0.01, "one_minus_gae_lambda": 0.05, "learning_rate": 3e-4,
                                     "ent_coef": 1e-3, "clip_range": 0.2, "n_epochs": 4, "max_grad_norm": 0.5})
    params = rlseq.zoo.sample_params(trial, 4, 8, {})
    # RL Zoo applies these with dict.update over the file's values: what is absent here stays as the file says
    assert not {"policy_kwargs", "n_steps", "batch_size", "policy"} & set(params)
    assert params == {"gamma": pytest.approx(0.99), "gae_lambda": pytest.approx(0.95), "learning_rate": 3e-4,
                      "ent_coef": 1e-3, "clip_range": 0.2, "n_epochs": 4, "max_grad_norm": 0.5}


@pytest.mark.slow
def test_rl_zoo_trains_recurrent_ppo_with_the_efla_policy_from_the_file(tmp_path):
    proc = _zoo(tmp_path, "--eval-freq", "-1", "-params", "n_epochs:1")  # one epoch: the rollout's size is checked
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from sb3_contrib import RecurrentPPO

    from rlseq.policies import EflaMlpPolicy

    model = RecurrentPPO.load(tmp_path / "logs" / "ppo_lstm" / f"{ENV}_1" / f"{ENV}.zip", device="cpu")
    assert type(model.policy) is EflaMlpPolicy
    assert model.policy.memory_name == "efla" and model.policy.memory_kwargs["n_heads"] == 4
    assert model.policy.memory_kwargs["head_dim"] == 16
    assert model.num_timesteps == 8 * 128  # -n 512 still collects one whole rollout of the file's 8 envs x 128 steps


@pytest.mark.slow
def test_two_optuna_trials_complete_into_a_journal_file(tmp_path):
    journal = tmp_path / "study.log"  # on shared storage, several machines tune one study with this file
    # each trial: one rollout of 2 envs x 32 steps in one minibatch (the sampler leaves these three as given)
    proc = _zoo(tmp_path, "-optimize", "--n-trials", "2", "--n-jobs", "1", "--sampler", "random", "--pruner", "none",
                "--n-evaluations", "1", "--eval-episodes", "2", "--storage", str(journal), "--study-name", "rs",
                "-n", "64", "-params", "n_envs:2", "n_steps:32", "batch_size:64")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    trials = optuna.load_study(study_name="rs", storage=storage).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert all(set(t.params) == SAMPLED for t in trials)  # rlseq.zoo's sampler, not RL Zoo's (net_arch, n_steps, ...)
