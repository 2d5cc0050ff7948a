"""The env and the model of a training run, built from a resolved config (:func:`rlseq.config.resolve`)."""

from __future__ import annotations

from typing import Any

from rlseq.config import UsageError, cuda_graph_train_arg, learning_rate_schedule


def _family(cfg: dict[str, Any]) -> str:
    from rlseq.envs import env_family

    return cfg.get("env_family") or env_family(cfg["env"])  # configs saved before families were recorded


def make_env(cfg: dict[str, Any], *, seed: int, n_envs: int | None = None, training: bool = True):
    """procgen (or a gymnasium env: :func:`rlseq.envs.make_gym`, env ``i`` seeded ``seed + i``) → ScaleReward →
    PotentialValueShift → PrevActionReward → VecNormalize (rewards only).
    """
    from gymnasium import spaces
    from stable_baselines3.common.vec_env import VecNormalize

    from rlseq.envs import (
        PotentialValueShift,
        PrevActionReward,
        ScaleReward,
        make_gym,
        make_procgen,
        resolve_env_id,
    )

    n_envs = n_envs or cfg["n_envs"]
    procgen = _family(cfg) == "procgen"
    if procgen:
        venv = make_procgen(cfg["env"], n_envs, seed=seed, **cfg.get("env_kwargs", {}))
    else:
        resolve_env_id(cfg["env"], cfg.get("env_packages") or ())  # imports what registers the id
        venv = make_gym(cfg["env"], n_envs, seed=seed, env_kwargs=cfg.get("env_kwargs"))
    if cfg.get("reward_scale", 1.0) != 1.0:
        venv = ScaleReward(venv, cfg["reward_scale"])
    if cfg.get("value_shift", 0.0):
        venv = PotentialValueShift(venv, cfg["value_shift"], gamma=cfg["gamma"])
    if cfg.get("prev_action_reward"):
        if not isinstance(venv.action_space, spaces.Discrete):
            venv.close()
            raise UsageError(f"--prev-action-reward needs a Discrete action space; {cfg['env']} has {venv.action_space}")
        venv = PrevActionReward(venv, image_key="image" if procgen else "obs")
    if cfg.get("normalize_reward") and training:
        venv = VecNormalize(venv, norm_obs=False, norm_reward=True, gamma=cfg["gamma"])
    return venv


def ppo_kwargs(cfg: dict[str, Any], device: str) -> dict[str, Any]:
    """The PPO hyperparameters of a resolved config, as keyword arguments of SB3-style algorithms."""
    return dict(learning_rate=learning_rate_schedule(cfg["learning_rate"]), n_steps=cfg["n_steps"],
                n_epochs=cfg["n_epochs"], gamma=cfg["gamma"],
                gae_lambda=cfg["gae_lambda"], ent_coef=cfg["ent_coef"], vf_coef=cfg["vf_coef"], clip_range=cfg["clip_range"],
                max_grad_norm=cfg["max_grad_norm"], seed=cfg["seed"], device=device)


def observation_kind(space) -> tuple[str, bool]:
    """``("image" | "vector" | "dict", has_image)`` of an observation space: which policy family reads it."""
    from gymnasium import spaces
    from stable_baselines3.common.preprocessing import is_image_space

    if isinstance(space, spaces.Dict):
        return "dict", any(is_image_space(sub, check_channels=False) for sub in space.spaces.values())
    image = is_image_space(space, check_channels=False)
    return ("image" if image else "vector"), image


def _has_multidiscrete(space) -> bool:
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        return any(isinstance(sub, spaces.MultiDiscrete) for sub in space.spaces.values())
    return isinstance(space, spaces.MultiDiscrete)


def build_model(cfg: dict[str, Any], env, device: str, tensorboard_log: str | None = None):
    """The algorithm and policy named by the config, for ``env``'s observation space.

    ``--algo rlseq``: MemoryPPO with ``CnnPolicy`` / ``MlpPolicy`` / ``MultiInputPolicy`` (images, vectors, Dict).
    ``sb3-recurrent-ppo``: the LSTM is sb3-contrib's own ``CnnLstmPolicy`` / ``MultiInputLstmPolicy`` over the
    IMPALA CNN where the observation holds an image (hidden size 256 unless ``memory_kwargs`` sets
    ``hidden_size``), and the stock ``MlpLstmPolicy`` / ``MultiInputLstmPolicy`` otherwise (sb3-contrib's default
    size unless set; SB3's extractor with an int width for ``MultiDiscrete`` observations); other memories are
    the rlseq drop-in policies (``EflaMlpPolicy``, ..., ``Memory*Policy`` with ``memory=`` for the rest).
    """
    common = dict(ppo_kwargs(cfg, device), verbose=cfg.get("verbose", 0), tensorboard_log=tensorboard_log)
    policy_kwargs = dict(cfg.get("policy_kwargs") or {})
    if cfg.get("fused_adam"):
        # explicit optimizer_kwargs replace SB3's Adam default {eps: 1e-5}: keep that eps unless the config set one
        policy_kwargs["optimizer_kwargs"] = {"eps": 1e-5, **(policy_kwargs.get("optimizer_kwargs") or {}), "fused": True}
    kind, has_image = observation_kind(env.observation_space)
    if cfg["algo"] == "rlseq":
        from rlseq.algos import MemoryPPO

        policy_kwargs.update(memory=cfg["memory"], memory_kwargs=cfg["memory_kwargs"])
        if cfg.get("amp"):  # only when on, so the default policy_kwargs (and saved models) are unchanged
            policy_kwargs.update(amp_dtype=cfg["amp"])
        if cfg.get("channels_last"):
            policy_kwargs.update(channels_last=True)
        policy = {"image": "CnnPolicy", "vector": "MlpPolicy", "dict": "MultiInputPolicy"}[kind]
        return MemoryPPO(policy, env, n_minibatches=cfg["n_minibatches"], policy_kwargs=policy_kwargs,
                         cuda_graph=cfg.get("cuda_graph", True), tf32=cfg.get("tf32", False),
                         compile_extractor=cfg.get("compile_extractor", False),
                         cuda_graph_train=cuda_graph_train_arg(cfg.get("cuda_graph_train", "auto")), **common)
    from sb3_contrib import RecurrentPPO

    import rlseq.policies as P

    batch_size = cfg["n_envs"] * cfg["n_steps"] // cfg["n_minibatches"]
    suffix = {"image": "Cnn", "vector": "Mlp", "dict": "MultiInput"}[kind]
    if cfg["memory"] == "lstm":
        policy = f"{suffix}LstmPolicy"
        hidden_size = cfg["memory_kwargs"].get("hidden_size")
        if has_image:
            policy_kwargs.update(lstm_hidden_size=hidden_size or 256,
                                 features_extractor_class=P.ImpalaCombinedExtractor if kind == "dict" else P.ImpalaCNN)
        else:
            if _has_multidiscrete(env.observation_space):
                from rlseq.envs import CombinedExtractor, FlattenExtractor

                # SB3's own extractors with an int width: SB3 sizes MultiDiscrete inputs as a NumPy integer,
                # which nn.LSTM refuses
                policy_kwargs.setdefault("features_extractor_class",
                                         CombinedExtractor if kind == "dict" else FlattenExtractor)
            if hidden_size is not None:
                policy_kwargs.update(lstm_hidden_size=hidden_size)
    else:
        named = {"efla": "Efla", "deltanet": "DeltaNet"}.get(cfg["memory"])
        policy = getattr(P, f"{named or 'Memory'}{suffix}Policy")
        policy_kwargs.update(memory_kwargs=cfg["memory_kwargs"])
        if named is None:
            policy_kwargs.update(memory=cfg["memory"])
    if not policy_kwargs.get("net_arch"):
        policy_kwargs.pop("net_arch", None)  # sb3-contrib's policies keep their own default heads
    return RecurrentPPO(policy, env, batch_size=batch_size, policy_kwargs=policy_kwargs, **common)


def saved_speed_settings(model) -> dict[str, Any]:
    """``{"amp": "bf16" | None, "fused_adam": bool, "channels_last": bool}`` of a built or loaded model (what its
    policy really uses)."""
    import torch

    amp = getattr(model.policy, "amp_dtype", None)
    fused = bool(getattr(model.policy, "optimizer_kwargs", None) and model.policy.optimizer_kwargs.get("fused"))
    return {"amp": {None: None, torch.bfloat16: "bf16"}[amp], "fused_adam": fused,
            "channels_last": bool(getattr(model.policy, "channels_last", False))}


def _algo_class(cfg: dict[str, Any]):
    if cfg["algo"] == "rlseq":
        from rlseq.algos import MemoryPPO

        return MemoryPPO
    from sb3_contrib import RecurrentPPO

    return RecurrentPPO
