"""RL Zoo glue, loaded with ``--gym-packages rlseq.zoo``::

    python -m rl_zoo3.train --algo ppo_lstm --env popgym-RepeatPreviousEasy-v0 \\
        -conf configs/rl_zoo/ppo_lstm.yml --gym-packages rlseq.zoo

The hyperparameter file names the policy by its import path (``policy: rlseq.policies.EflaMlpPolicy``), which
RL Zoo imports itself. Importing this module (what ``--gym-packages`` does) registers POPGym's env ids and
swaps RL Zoo's ``ppo_lstm`` Optuna sampler for :func:`sample_params`: RL Zoo's own replaces the file's
``policy_kwargs`` (the memory and its sizes would silently fall back to the defaults) and draws ``n_steps``
(the sequence length the memory trains on) and ``batch_size``; this one leaves those three as the file sets
them and samples the optimisation settings only.
"""

from __future__ import annotations

from typing import Any

import popgym  # noqa: F401  (registers the popgym-... gymnasium ids)


def convert_params(sampled: dict[str, Any]) -> dict[str, Any]:
    """Optuna's values -> RecurrentPPO keyword arguments (also how RL Zoo reloads a trial with --trial-id)."""
    params = dict(sampled)
    params["gamma"] = 1 - params.pop("one_minus_gamma")
    params["gae_lambda"] = 1 - params.pop("one_minus_gae_lambda")
    return params


def sample_params(trial: Any, n_actions: int, n_envs: int, additional_args: dict) -> dict[str, Any]:
    """RL Zoo's PPO ranges without ``n_steps``, ``batch_size``, ``net_arch`` and ``activation_fn``."""
    return convert_params({
        "one_minus_gamma": trial.suggest_float("one_minus_gamma", 1e-4, 0.03, log=True),
        "one_minus_gae_lambda": trial.suggest_float("one_minus_gae_lambda", 1e-4, 0.1, log=True),
        "learning_rate": trial.suggest_float("learning_rate", 1e-5, 2e-3, log=True),
        "ent_coef": trial.suggest_float("ent_coef", 1e-8, 0.1, log=True),
        "clip_range": trial.suggest_categorical("clip_range", [0.1, 0.2, 0.3, 0.4]),
        "n_epochs": trial.suggest_categorical("n_epochs", [1, 4, 10]),
        "max_grad_norm": trial.suggest_float("max_grad_norm", 0.3, 2.0),
    })


def register() -> None:
    """Make :func:`sample_params` RL Zoo's ``ppo_lstm`` sampler (its tables are shared dicts)."""
    from rl_zoo3 import hyperparams_opt

    hyperparams_opt.HYPERPARAMS_SAMPLER["ppo_lstm"] = sample_params
    hyperparams_opt.HYPERPARAMS_CONVERTER["ppo_lstm"] = convert_params


register()
