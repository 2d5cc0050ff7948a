"""``python -m rlseq.train``: train a memory agent on a procgen game or any gymnasium env and log it for TensorBoard.

    python -m rlseq.train --env caveflyer --memory efla
    python -m rlseq.train --env popgym-RepeatPreviousEasy-v0 --memory efla     # any registered gymnasium id
    python -m rlseq.train --env MyEnv-v0 --env-package my_envs                 # ids that a module registers
    python -m rlseq.train --env caveflyer --memory deltanet --seed 1 --total-steps 5_000_000
    python -m rlseq.train --env caveflyer --memory lstm --algo sb3-recurrent-ppo
    python -m rlseq.train --env caveflyer --memory efla --fast    # GPU: bf16 CNN, fused Adam, channels-last, TF32
    python -m rlseq.train --env caveflyer --memory efla --fast --no-channels-last   # a flag given wins over --fast
    python -m rlseq.train --env caveflyer --memory efla --fused-adam --no-cuda-graph-train   # eager training

``--env`` is a procgen game (``caveflyer``, ``procgen:caveflyer``) or a registered gymnasium id, looked up after
importing the ``--env-package`` modules (``popgym-...`` ids import popgym by themselves); see
:func:`rlseq.envs.resolve_env_id`. Hyperparameters come from the env family's RL Zoo-style file, keyed by env
(a default entry for the rest): ``configs/procgen.yml`` (default ``procgen``), ``configs/popgym.yml``
(``popgym``) or ``configs/gym.yml`` (``gym``, every other gymnasium id); ``--config FILE`` replaces it.

Runs land in ``<logdir>/<env>/<variant>/seed<N>/`` (``env`` the id with ``/`` as ``_``, e.g. ``ALE_Pong-v5``;
``variant`` = memory, ``sb3-`` prefixed for the sb3-contrib algorithm, ``-<tag>`` appended), so
``tensorboard --logdir runs/caveflyer`` shows the memories side by side under identical tags. Each run folder
holds ``config.yaml`` (the resolved hyperparameters), TensorBoard event files, ``checkpoints/`` and, when
finished, ``final_model.zip``.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

ALGOS = ("rlseq", "sb3-recurrent-ppo")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "procgen.yml"
# env family -> its config file; the file's entry named like the family is the default of its envs
FAMILY_CONFIGS = {"procgen": DEFAULT_CONFIG, "popgym": CONFIG_DIR / "popgym.yml", "gym": CONFIG_DIR / "gym.yml"}
# flags (and env_kwargs keys) that only procgen takes
PROCGEN_OPTIONS = ("distribution_mode", "num_levels", "start_level", "num_threads")
# flag name -> config key, for the flags that override hyperparameters
FLAG_TO_KEY = {
    "total_steps": "n_timesteps", "n_envs": "n_envs", "n_steps": "n_steps", "n_minibatches": "n_minibatches",
    "n_epochs": "n_epochs", "learning_rate": "learning_rate", "reward_scale": "reward_scale",
    "value_shift": "value_shift", "prev_action_reward": "prev_action_reward", "checkpoint_every": "checkpoint_every",
    "normalize_reward": "normalize_reward", "amp": "amp", "fused_adam": "fused_adam", "cuda_graph": "cuda_graph",
    "cuda_graph_train": "cuda_graph_train", "channels_last": "channels_last", "tf32": "tf32",
}
AMP_CHOICES = ("bf16", "none")
# --fast: what it sets, unless the flag is given itself
FAST_PRESET = {"amp": "bf16", "fused_adam": True, "channels_last": True, "tf32": True}
# cuda_graph_train in a config file: auto (or null) uses the training graph whenever the model allows it
CUDA_GRAPH_TRAIN_VALUES = ("auto", "null", "true", "false")
# a run folder's name part given by --tag: one plain folder name
TAG_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*")


class UsageError(ValueError):
    """A bad flag or name, reported before any env or model is built (one ``error:`` line per line of the message)."""


def _whole(low: int) -> Callable[[Any], int]:
    """Checker of a count: an int, a float or a numeric string ("1e6") with an integral value >= ``low``."""

    def check(value: Any) -> int:
        number = _number(value)
        if not number.is_integer() or number < low:
            raise ValueError(f"must be a whole number >= {low}")
        return int(number)

    return check


def _real(low: float | None = None, high: float | None = None, *, above: bool = False) -> Callable[[Any], float]:
    """Checker of a finite float in ``[low, high]`` (``(low, high]`` with ``above``); numeric strings such as
    "5e-4", which YAML 1.1 reads as strings, are converted."""

    def check(value: Any) -> float:
        number = _number(value)
        if (low is not None and (number < low or (above and number == low))) or (high is not None and number > high):
            raise ValueError(f"must be {'>' if above else '>='} {low}" + (f" and <= {high}" if high is not None else ""))
        return number

    return check


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("must be a number (YAML reads yes/no/on/off as booleans)" if isinstance(value, bool)
                         else "must be a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError("must be a number") from None
    if not math.isfinite(number):
        raise ValueError("must be finite")
    return number


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _mapping(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("must be a mapping (key: value entries)")
    return value


def _cuda_graph_train(value: Any) -> str | bool:
    try:
        return parse_cuda_graph_train(value)
    except UsageError as e:
        raise ValueError("is not valid; " + str(e).split(" is not valid; ", 1)[1]) from None


def _amp(value: Any) -> str | None:
    if value not in (None, False, "none", "bf16"):
        raise ValueError(f"is not supported; valid: {', '.join(AMP_CHOICES)}")
    return value


# every key a config entry may hold -> its checker (returns the value converted)
CONFIG_KEYS: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(("n_timesteps", "n_envs", "n_steps", "n_minibatches", "n_epochs", "checkpoint_every",
                     "env_groups"), _whole(1)),
    "learning_rate": _real(0, above=True), "gamma": _real(0, 1, above=True), "gae_lambda": _real(0, 1),
    "ent_coef": _real(0), "vf_coef": _real(0), "clip_range": _real(0, above=True), "max_grad_norm": _real(0, above=True),
    "reward_scale": _real(0, above=True), "value_shift": _real(),
    **dict.fromkeys(("normalize_reward", "prev_action_reward", "fused_adam", "channels_last", "tf32", "cuda_graph"),
                    _boolean),
    "amp": _amp, "cuda_graph_train": _cuda_graph_train,
    **dict.fromkeys(("env_kwargs", "policy_kwargs", "memory_kwargs"), _mapping),
}


def unknown_keys(entry: dict[str, Any], where: str) -> list[str]:
    """One message per key of a config ``entry`` that :data:`CONFIG_KEYS` does not know, with close matches."""
    messages = []
    for key in entry:
        if key not in CONFIG_KEYS:
            close = difflib.get_close_matches(str(key), CONFIG_KEYS, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            messages.append(f"unknown key {key!r} in {where}; {hint}valid keys: {', '.join(CONFIG_KEYS)}")
    return messages


def check_values(cfg: dict[str, Any], origin: dict[str, str]) -> list[str]:
    """Convert every key of ``cfg`` in place with its checker; one message per bad value, naming where it came
    from (``origin``: key -> flag or file)."""
    messages = []
    for key, checker in CONFIG_KEYS.items():
        if key not in cfg:
            continue
        try:
            cfg[key] = checker(cfg[key])
        except ValueError as e:
            messages.append(f"{key} {cfg[key]!r} {e} ({origin.get(key, 'config')})")
    return messages


# what ppo_kwargs() and make_env() read without a default
REQUIRED_KEYS = ("n_timesteps", "n_envs", "n_steps", "n_minibatches", "n_epochs", "checkpoint_every", "learning_rate",
                 "gamma", "gae_lambda", "ent_coef", "vf_coef", "clip_range", "max_grad_norm")


def check_flags(args: argparse.Namespace) -> list[str]:
    """One message per bad flag that names no config key: --seed, --tag, --device."""
    problems = []
    if not 0 <= args.seed < 2**31:
        problems.append(f"--seed {args.seed} must be >= 0 and < 2**31 (procgen's level seeds are C ints)")
    if args.tag is not None and not TAG_PATTERN.fullmatch(args.tag):
        problems.append(f"--tag {args.tag!r} must be one plain folder name (letters, digits, . _ + = -, not starting "
                        "with . or -)")
    return problems + device_problems(getattr(args, "device", "auto"))


def device_problems(name: str) -> list[str]:
    """``[]`` for auto, cpu and a CUDA device this host has; else why not."""
    import torch

    if name == "auto":
        return []
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        return [f"--device {name!r} is not a device; valid: auto, cpu, cuda, cuda:N"]
    if device.type == "cuda" and not torch.cuda.is_available():
        return [f"--device {name}: this host has no CUDA device (torch.cuda.is_available() is False); "
                "use --device cpu or auto"]
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        return [f"--device {name}: this host has {torch.cuda.device_count()} CUDA device(s)"]
    return []


def memories() -> tuple[str, ...]:
    """The memory names ``--memory`` takes (:data:`rlseq.policies.memory.MEMORIES`; imports torch)."""
    from rlseq.policies.memory import MEMORIES

    return tuple(MEMORIES)


class _MemoryNames:
    """Formats as the names of :func:`memories`, so that the import happens only when ``--help`` prints."""

    def __str__(self) -> str:
        return ", ".join(memories())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlseq.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="caveflyer",
                   help="procgen game (caveflyer, procgen:caveflyer) or registered gymnasium id "
                        "(popgym-RepeatPreviousEasy-v0, CartPole-v1, PACKAGE:ID)")
    p.add_argument("--env-package", action="append", default=None, metavar="PACKAGE",
                   help="import PACKAGE before looking --env up, for the ids it registers (repeatable; popgym-... "
                        "ids import popgym by themselves)")
    memory = p.add_argument("--memory", default="efla", help="one of %(memories)s")
    memory.memories = _MemoryNames()  # what %(memories)s prints: looked up only when --help formats it
    p.add_argument("--algo", default="rlseq", help=f"one of {', '.join(ALGOS)} (rlseq: whole-rollout training, the fast path)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-steps", type=float, default=None, help="env steps to train for (config: n_timesteps)")
    p.add_argument("--n-envs", type=int, default=None)
    p.add_argument("--n-steps", type=int, default=None, help="steps per env per rollout")
    p.add_argument("--n-minibatches", type=int, default=None)
    p.add_argument("--n-epochs", type=int, default=None)
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--distribution-mode", default=None,
                   help="procgen only: easy, hard, memory, ... (valid modes depend on the game)")
    p.add_argument("--num-levels", type=int, default=None, help="procgen only")
    p.add_argument("--start-level", type=int, default=None, help="procgen only")
    p.add_argument("--num-threads", type=int, default=None, help="procgen only: worker threads")
    p.add_argument("--reward-scale", type=float, default=None, help="multiply rewards (ScaleReward)")
    p.add_argument("--value-shift", "--value-scale", dest="value_shift", type=float, default=None,
                   help="shift value targets by this much without changing the task (PotentialValueShift)")
    p.add_argument("--prev-action-reward", action=argparse.BooleanOptionalAction, default=None,
                   help="feed the previous action and raw reward to the policy (PrevActionReward)")
    p.add_argument("--normalize-reward", action=argparse.BooleanOptionalAction, default=None,
                   help="VecNormalize the PPO reward")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--fast", action="store_true",
                   help="the fast GPU setting: shorthand for --amp bf16 --fused-adam --channels-last --tf32, and with "
                        "fused Adam the training CUDA graph comes on by itself (--cuda-graph-train's auto). It changes "
                        "rounding (bf16 CNN, TF32, fused Adam); each of those flags given explicitly wins (--fast "
                        "--amp none). On --resume it must agree with the checkpoint's amp, fused Adam and "
                        "channels-last, as those flags must. On the CPU the bf16 CNN, "
                        "channels-last and fused Adam apply too (TF32 and the CUDA graphs are GPU-only): faster on a "
                        "CPU with native bf16, possibly slower without")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="allow TF32 convolutions and matmuls on the GPU (faster; acting and training then differ by "
                        "~1e-3, so PPO's first ratio is no longer exactly 1; config: tf32; default off)")
    p.add_argument("--amp", default=None, choices=AMP_CHOICES,
                   help="bf16: run the CNN in bf16 autocast while acting and training (memory, heads, losses and "
                        "optimizer stay fp32); none: all fp32 (config: amp; default none)")
    p.add_argument("--fused-adam", action=argparse.BooleanOptionalAction, default=None,
                   help="fused Adam (one kernel for all parameters; config: fused_adam; default off)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the acting step from a CUDA graph (same computation and random draws, ~100x fewer "
                        "launches; config: cuda_graph; default on, ignored on the CPU)")
    p.add_argument("--cuda-graph-train", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each PPO minibatch update (forward, loss, backward, clipping, Adam step) from a CUDA "
                        "graph: same computation, one launch per minibatch instead of hundreds; needs --fused-adam, "
                        "not for --memory gru or lstm (config: cuda_graph_train; default auto: on wherever it can be used, "
                        "i.e. on a GPU with fused Adam, eager otherwise; --no-cuda-graph-train: always eager)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory layout for the CNN (cuDNN's tensor-core layout, mostly with --amp bf16; "
                        "config: channels_last; default off)")
    p.add_argument("--logdir", default="runs")
    p.add_argument("--tag", default=None, help="suffix of the run's variant folder, e.g. reward1e3")
    p.add_argument("--config", default=None,
                   help="RL Zoo-style YAML file keyed by env, with a default entry named procgen, popgym or gym "
                        "(default: configs/procgen.yml, configs/popgym.yml or configs/gym.yml of the repo, by --env)")
    p.add_argument("--checkpoint-every", type=float, default=None, help="env steps between atomic checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="continue the run folder from its newest intact checkpoint (other hyperparameters are refused; "
                        "--total-steps and --checkpoint-every may change). SIGINT and SIGTERM save a checkpoint at "
                        "the next rollout start and print this command")
    p.add_argument("--no-progress-bar", action="store_true",
                   help="no progress lines (the speed after 10 s and the estimate after the first update are "
                        "printed still; otherwise then a line every second on a terminal, every 30 s in a log file)")
    p.add_argument("--verbose", type=int, default=0)
    return p


def load_config(path: Path, env: str, family: str = "procgen") -> dict[str, Any]:
    """The hyperparameters of ``env`` from an RL Zoo-style file (its own key, else the default entry named like
    its ``family``: ``procgen``, ``popgym`` or ``gym``)."""
    if not path.exists():
        raise UsageError(f"config file {path} does not exist")
    with open(path) as f:
        table = yaml.safe_load(f) or {}
    if env in table:
        return copy.deepcopy(table[env])
    if family in table:
        return copy.deepcopy(table[family])
    raise UsageError(f"{path} has no entry for {env!r} and no {family!r} default; "
                     f"entries: {', '.join(map(str, table))}")


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Validate names and merge config file + flags into one resolved config. Builds nothing."""
    from rlseq.envs import PROCGEN_DISTRIBUTION_MODES, resolve_env_id

    if args.memory not in memories():
        raise UsageError(f"unknown memory {args.memory!r}; valid memories: {', '.join(memories())}")
    if args.algo not in ALGOS:
        raise UsageError(f"unknown algo {args.algo!r}; valid algos: {', '.join(ALGOS)}")
    if args.algo == "sb3-recurrent-ppo" and args.memory == "none":
        raise UsageError("--algo sb3-recurrent-ppo needs a recurrent memory "
                         f"({', '.join(m for m in memories() if m != 'none')}); "
                         "use --algo rlseq --memory none for the memoryless control")
    try:
        env_id = resolve_env_id(args.env, getattr(args, "env_package", None) or ())
    except ValueError as e:
        raise UsageError(str(e)) from None
    env, family = env_id.id, env_id.family
    procgen_flags = ["--" + key.replace("_", "-") for key in PROCGEN_OPTIONS if getattr(args, key, None) is not None]
    if family != "procgen" and procgen_flags:
        raise UsageError(f"{', '.join(procgen_flags)}: procgen options, and {env} is a gymnasium env (its own "
                         "options go to gymnasium.make as env_kwargs in a --config file)")
    if getattr(args, "fast", False) and args.algo != "rlseq":
        raise UsageError("--fast needs --algo rlseq (its bf16 CNN and channels-last are MemoryPPO's; sb3-contrib's "
                         "RecurrentPPO has no autocast): give --fused-adam --tf32 instead")
    path = Path(args.config) if args.config else FAMILY_CONFIGS[family]
    cfg = load_config(path, env, family)
    problems = unknown_keys(cfg, f"{path} (entry of {env})") + check_flags(args)
    origin = dict.fromkeys(cfg, str(path))
    for flag, key in FLAG_TO_KEY.items():
        value, option = asked(args, flag)
        if value is not None:
            cfg[key], origin[key] = value, option
    problems += check_values(cfg, origin)
    problems += [f"{key} is missing from {path} (entry of {env})" for key in REQUIRED_KEYS if key not in cfg]
    if problems:
        raise UsageError("\n".join(problems))
    env_kwargs = cfg["env_kwargs"] = dict(cfg.get("env_kwargs") or {})
    if family == "procgen":
        for key in PROCGEN_OPTIONS:
            if getattr(args, key) is not None:
                env_kwargs[key] = getattr(args, key)
        mode = env_kwargs.get("distribution_mode", "easy")
        if mode not in PROCGEN_DISTRIBUTION_MODES[env]:
            raise UsageError(f"distribution mode {mode!r} is not valid for {env}; valid: {', '.join(PROCGEN_DISTRIBUTION_MODES[env])}")
    elif set(PROCGEN_OPTIONS) & set(env_kwargs):
        raise UsageError(f"env_kwargs {', '.join(sorted(set(PROCGEN_OPTIONS) & set(env_kwargs)))} of the config are "
                         f"procgen options; {env} is a gymnasium env and gets env_kwargs through gymnasium.make")
    if cfg["n_envs"] % cfg["n_minibatches"]:
        raise UsageError(f"--n-minibatches {cfg['n_minibatches']} must divide --n-envs {cfg['n_envs']}")
    if int(cfg.pop("env_groups", 1)) != 1:  # all envs step at once: there is nothing to split
        raise UsageError("env_groups is not an option of rlseq.train: remove it from the config (all envs step at once)")
    if cfg.get("value_shift") and not cfg.get("gamma"):
        raise UsageError("value_shift needs gamma in the config")
    cfg["amp"] = None if cfg.get("amp") in (None, "none", False) else cfg["amp"]
    if cfg["amp"] not in (None, "bf16"):
        raise UsageError(f"amp {cfg['amp']!r} is not supported; valid: bf16, none")
    if cfg["amp"] and args.algo != "rlseq":
        raise UsageError("--amp needs --algo rlseq (sb3-contrib's RecurrentPPO has no autocast)")
    cfg["fused_adam"] = bool(cfg.get("fused_adam", False))
    cfg["tf32"] = bool(cfg.get("tf32", False))
    cfg["cuda_graph"] = bool(cfg.get("cuda_graph", True)) and args.algo == "rlseq"
    # "auto", True or False; train() records what runs once the model is known
    cfg["cuda_graph_train"] = parse_cuda_graph_train(cfg.get("cuda_graph_train", "auto")) if args.algo == "rlseq" else False
    cfg["channels_last"] = bool(cfg.get("channels_last", False))
    if cfg["channels_last"] and args.algo != "rlseq":
        raise UsageError("--channels-last needs --algo rlseq")
    if args.cuda_graph and args.algo != "rlseq":
        raise UsageError("--cuda-graph needs --algo rlseq (sb3-contrib's RecurrentPPO acts eagerly)")
    if args.cuda_graph and args.device == "cpu":
        raise UsageError("--cuda-graph needs a GPU; drop it with --device cpu")
    if args.cuda_graph_train and args.algo != "rlseq":
        raise UsageError("--cuda-graph-train needs --algo rlseq")
    if args.cuda_graph_train and args.device == "cpu":
        raise UsageError("--cuda-graph-train needs a GPU; drop it with --device cpu")
    if args.cuda_graph_train and args.algo == "rlseq":
        from rlseq.policies.memory import memory_class

        why = memory_class(args.memory).train_graph_obstacle
        if why is not None:
            raise UsageError(f"--cuda-graph-train cannot capture the {args.memory} memory ({why})")
    if not args.resume:  # on --resume the checkpoint's fused_adam holds: checked once it is known
        _check_cuda_graph_train(args, cfg)
    memory_kwargs = cfg.pop("memory_kwargs", {}) or {}
    cfg.update(env=env, env_family=family, env_packages=list(env_id.packages), memory=args.memory, algo=args.algo,
               seed=args.seed, tag=args.tag, memory_kwargs=dict(memory_kwargs.get(args.memory, {}) or {}))
    return cfg


def asked(args: argparse.Namespace, flag: str) -> tuple[Any, str | None]:
    """The value of ``flag`` (a :data:`FLAG_TO_KEY` name) from the command line and the option that set it: the flag
    itself when given, else ``--fast``'s preset value, else ``(None, None)`` (the config decides)."""
    value = getattr(args, flag, None)
    if value is not None:
        return value, "--" + flag.replace("_", "-")
    if getattr(args, "fast", False) and flag in FAST_PRESET:
        return FAST_PRESET[flag], "--fast"
    return None, None


def parse_cuda_graph_train(value: Any) -> str | bool:
    """A config's ``cuda_graph_train``: ``"auto"`` (also null), True or False."""
    if value is None or isinstance(value, bool):
        return "auto" if value is None else value
    text = str(value).strip().lower()
    if text in CUDA_GRAPH_TRAIN_VALUES:
        return {"auto": "auto", "null": "auto", "true": True, "false": False}[text]
    raise UsageError(f"cuda_graph_train {value!r} is not valid; valid: {', '.join(CUDA_GRAPH_TRAIN_VALUES)} "
                     "(auto and null: the training graph wherever it can be used)")


def cuda_graph_train_arg(value: str | bool) -> bool | None:
    """``MemoryPPO``'s ``cuda_graph_train`` for a resolved config's value (``"auto"`` -> None)."""
    return None if value == "auto" else bool(value)


def _check_cuda_graph_train(args: argparse.Namespace, cfg: dict[str, Any]) -> None:
    """``--cuda-graph-train`` asked for on the command line with unfused Adam would only warn and train eagerly:
    refuse it instead (a config file's ``cuda_graph_train`` falls back with the model's warning)."""
    if args.cuda_graph_train and not cfg["fused_adam"]:
        raise UsageError("--cuda-graph-train needs --fused-adam (fused Adam skips the update of a non-finite loss "
                         "inside the graph)")


def env_folder(env: str) -> str:
    """The env id as one folder name: ``ALE/Pong-v5`` -> ``ALE_Pong-v5``."""
    return env.replace("/", "_").replace("\\", "_")


def run_dir(logdir: str | Path, cfg: dict[str, Any]) -> Path:
    variant = cfg["memory"] if cfg["algo"] == "rlseq" else f"sb3-{cfg['memory']}"
    if cfg.get("tag"):
        variant += f"-{cfg['tag']}"
    return Path(logdir) / env_folder(cfg["env"]) / variant / f"seed{cfg['seed']}"


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
    return dict(learning_rate=cfg["learning_rate"], n_steps=cfg["n_steps"], n_epochs=cfg["n_epochs"], gamma=cfg["gamma"],
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


def train(args: argparse.Namespace) -> Path:
    """Resolve, build and train; returns the run folder. The run folder is locked while it trains."""
    import torch

    from rlseq.checkpoint import RunFolderBusy, run_folder_lock

    cfg = resolve(args)
    cfg["verbose"] = args.verbose
    # exact by default: with TF32, acting (batch n_envs) and training (batch B*T) pick different conv kernels
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = cfg["tf32"]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cfg["cuda_graph"] = cfg["cuda_graph"] and torch.device(device).type == "cuda"  # recorded as it runs
    if torch.device(device).type != "cuda" and cfg["cuda_graph_train"] is True:
        cfg["cuda_graph_train"] = False  # a config's true on the CPU: nothing to capture (auto stays auto for a GPU)
    folder = run_dir(args.logdir, cfg)
    if args.resume and not folder.is_dir():
        raise UsageError(f"--resume: there is no run folder {folder} (it follows from --logdir, --env, --memory, "
                         "--algo, --tag and --seed); check those, or drop --resume to start the run")
    try:
        with run_folder_lock(folder):
            return _train_locked(args, cfg, folder, device)
    except RunFolderBusy as e:
        raise UsageError(str(e)) from None


def _train_locked(args: argparse.Namespace, cfg: dict[str, Any], folder: Path, device: str) -> Path:
    """:func:`train` once it holds the run folder's lock."""
    from stable_baselines3.common.callbacks import CallbackList

    from rlseq.callbacks import Progress, tensorboard_logger
    from rlseq.checkpoint import LOCK_NAME, CheckpointCallback, save_checkpoint, stop_on_signals
    from rlseq.envs import ScaledReturnLogger

    ckpt_root = folder / "checkpoints"
    if (folder / "final_model.zip").exists():  # checked under the lock: no other process can be finishing it
        print(f"{folder} is finished already (final_model.zip exists); nothing to do")
        return folder
    if any(p.name != LOCK_NAME for p in folder.iterdir()) and not args.resume:
        raise UsageError(f"run folder {folder} exists; pass --resume to continue it, or another --seed/--tag/--logdir")
    latest = _resume_point(folder) if args.resume else None
    if latest is None:
        _check_cuda_graph_train(args, cfg)  # on --resume resolve() left it to the checkpoint, and there is none
        env = make_env(cfg, seed=cfg["seed"])
        model = build_model(cfg, env, device)
    else:
        refuse_changed_settings(cfg, folder)
        model, env = _load_checkpoint(latest, cfg, args, device)
        print(f"resuming {folder} from {latest.name} ({model.num_timesteps:,} env steps done)", flush=True)
    if cfg["algo"] == "rlseq":  # what runs, not "auto" (a True that cannot be used warns and trains eagerly)
        cfg["cuda_graph_train"] = model.trains_from_graph()
    # written once the model is known, so that a resumed run records the precision it really trains with
    with open(folder / "config.yaml", "w") as f:
        yaml.safe_dump({**cfg, "device": device}, f, sort_keys=True)
    # a resumed run's curves go on from its checkpoint: TensorBoard drops what the killed process logged after it
    # (all of it when the killed process left no checkpoint)
    purge_step = model.num_timesteps + 1 if latest is not None else (0 if args.resume else None)
    model.set_logger(tensorboard_logger(folder, stdout=bool(args.verbose), purge_step=purge_step))
    checkpoints = CheckpointCallback(ckpt_root, cfg["checkpoint_every"])
    callbacks = [ScaledReturnLogger(), checkpoints]
    smaller = (f"python -m rlseq.train --env popgym-RepeatPreviousEasy-v0 --memory {cfg['memory']} (about a "
               "minute), or this command with --total-steps 2048 --n-envs 8 --n-steps 64 --tag smoke")
    callbacks.append(Progress(cfg["n_timesteps"], on_cpu=device == "cpu", smaller=smaller,
                              lines=not args.no_progress_bar))
    remaining = cfg["n_timesteps"] - model.num_timesteps
    if remaining > 0:
        with stop_on_signals(checkpoints):
            model.learn(remaining, callback=CallbackList(callbacks), reset_num_timesteps=latest is None)
    if checkpoints.stopped_by is not None:
        env.close()
        _stop_with_resume_hint(args, checkpoints)
    save_checkpoint(model, ckpt_root)
    model.save(folder / ".final_model.tmp.zip")
    (folder / ".final_model.tmp.zip").replace(folder / "final_model.zip")
    env.close()
    print(f"done: {model.num_timesteps:,} env steps in {folder}", flush=True)
    return folder


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run: the one given, with ``--resume``."""
    argv = list(getattr(args, "command_line", None) or [])
    return shlex.join(["python", "-m", "rlseq.train", *argv, *([] if "--resume" in argv else ["--resume"])])


def _stop_with_resume_hint(args: argparse.Namespace, checkpoints) -> None:
    """After SIGINT or SIGTERM: one line with the checkpoint and the command to resume; exit 128 + signal."""
    import signal

    name = signal.Signals(checkpoints.stopped_by).name
    print(f"stopped by {name}: checkpoint step{checkpoints.stop_step} saved; resume with: {resume_command(args)}",
          file=sys.stderr, flush=True)
    raise SystemExit(128 + checkpoints.stopped_by)


def _resume_point(folder: Path) -> Path | None:
    """The checkpoint ``--resume`` continues from (None: a fresh start), after removing the temporary folders of
    killed saves; says which checkpoints it skips and why, and refuses when none of them is intact."""
    from rlseq.checkpoint import checkpoint_folders, remove_stale_temporaries, resumable_checkpoint

    root = folder / "checkpoints"
    for path in remove_stale_temporaries(root) if root.is_dir() else []:
        print(f"removed {path}, left by a checkpoint save that did not finish", flush=True)
    latest, warnings = resumable_checkpoint(root)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if latest is None and checkpoint_folders(root):
        raise UsageError(f"no checkpoint in {root} is intact (see the warnings above); nothing was deleted. "
                         f"Move {root} away to start the run again from step 0")
    if latest is None and any(folder.glob("events.out.tfevents.*")):
        print(f"{folder} has no checkpoint yet: starting it again from step 0", flush=True)
    return latest


# keys a resumed run may change: the budget, the checkpoint interval, how much it prints, where it runs and how
# acting and training are launched (the same computation); amp, fused_adam and channels_last are the checkpoint's
# (see _adopt_saved_speed_settings); a change of TF32 (rounding on a GPU) is stated
RESUME_FREE_KEYS = frozenset({"n_timesteps", "checkpoint_every", "verbose", "device", "cuda_graph",
                              "cuda_graph_train", "amp", "fused_adam", "channels_last", "tf32"})
RESUME_STATED_KEYS = ("tf32",)


def refuse_changed_settings(cfg: dict[str, Any], folder: Path) -> None:
    """On ``--resume``: refuse a setting that differs from the run's ``config.yaml``, listing every difference
    (a key the older file lacks is not compared)."""
    path = folder / "config.yaml"
    if not path.exists():
        print(f"warning: {path} is missing: the settings of the resumed run cannot be checked", file=sys.stderr)
        return
    saved = yaml.safe_load(path.read_text()) or {}
    changed = [f"  {key}: {saved[key]!r} in the run, {cfg[key]!r} now" for key in sorted(set(cfg) & set(saved))
               if key not in RESUME_FREE_KEYS and _comparable(key, cfg[key]) != _comparable(key, saved[key])]
    for key in RESUME_STATED_KEYS:
        if key in saved and cfg.get(key) != saved[key]:
            print(f"note: {key} was {saved[key]!r} in the run and is {cfg.get(key)!r} from now on", file=sys.stderr)
    if changed:
        raise UsageError("\n".join([f"--resume with other settings than the run's ({path}); resume with the same "
                                     "ones (only --total-steps and --checkpoint-every may change), or start a new "
                                     "run with another --tag:", *changed]))


def _comparable(key: str, value: Any) -> Any:
    """``value`` without what a resumed run may change inside it: procgen's worker-thread count."""
    if key == "env_kwargs" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "num_threads"}
    return value


def resumed_env_seed(seed: int, step: int) -> int:
    """The env seed of a run resumed at env step ``step`` (``seed`` itself at step 0): a resumed run plays new
    levels / episodes instead of replaying those of its first start. Below 2**30, so that env ``i`` seeded
    ``+ i`` stays a procgen C int and below the evaluation seeds of :mod:`rlseq.evaluate`."""
    import numpy as np

    if step == 0:
        return seed
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0]) % 2**30


def _load_checkpoint(latest: Path, cfg: dict[str, Any], args: argparse.Namespace, device: str):
    """``(model, env)`` restored from the checkpoint folder ``latest``: weights, optimizer, reward statistics and
    RNG states; the env is seeded with :func:`resumed_env_seed` and starts fresh episodes."""
    import torch

    from rlseq.checkpoint import set_rng_state

    step = int(latest.name[len("step"):])
    env = make_env({**cfg, "normalize_reward": False}, seed=resumed_env_seed(cfg["seed"], step))
    env = _load_reward_statistics(latest, env)
    model = _algo_class(cfg).load(latest / "model.zip", env=env, device=device)
    try:
        _adopt_saved_speed_settings(cfg, model, args)
        _check_cuda_graph_train(args, cfg)
    except UsageError:
        env.close()
        raise
    if cfg["algo"] == "rlseq":
        # how acting and training are launched, not what they compute: the flags decide
        model.cuda_graph, model.cuda_graph_train = cfg["cuda_graph"], cuda_graph_train_arg(cfg["cuda_graph_train"])
        model.tf32 = cfg["tf32"]
    set_rng_state(torch.load(latest / "rng.pt", weights_only=False))
    env.seed(resumed_env_seed(cfg["seed"], model.num_timesteps))  # SB3's load seeded it with the run's seed
    model._last_obs = None  # the env's episodes start afresh: learn() resets it, and the memory starts empty
    return model, env


def _load_reward_statistics(checkpoint: Path, env):
    """``env`` with the VecNormalize statistics saved in ``checkpoint`` (if any)."""
    from rlseq.checkpoint import load_vecnormalize

    return load_vecnormalize(checkpoint, env)


def saved_speed_settings(model) -> dict[str, Any]:
    """``{"amp": "bf16" | None, "fused_adam": bool, "channels_last": bool}`` of a built or loaded model (what its
    policy really uses)."""
    import torch

    amp = getattr(model.policy, "amp_dtype", None)
    fused = bool(getattr(model.policy, "optimizer_kwargs", None) and model.policy.optimizer_kwargs.get("fused"))
    return {"amp": {None: None, torch.bfloat16: "bf16"}[amp], "fused_adam": fused,
            "channels_last": bool(getattr(model.policy, "channels_last", False))}


def _adopt_saved_speed_settings(cfg: dict[str, Any], model, args: argparse.Namespace) -> None:
    """On ``--resume`` the checkpoint's amp / fused-Adam / channels-last settings hold (saved in its ``policy_kwargs``);
    a flag (or ``--fast``) that asks for something else is refused rather than silently ignored."""
    saved = saved_speed_settings(model)
    for key in ("amp", "fused_adam", "channels_last"):
        value, option = asked(args, key)
        if value is not None and (None if value == "none" else value) != saved[key]:
            if option == "--fast":
                keep = f"--amp {saved[key] or 'none'}" if key == "amp" else \
                    f"--{'' if saved[key] else 'no-'}{key.replace('_', '-')}"
                raise UsageError(f"the run was trained with {key}={saved[key]}, and --fast asks for {key}={value}; "
                                 f"resume it without --fast, or add {keep} to keep the checkpoint's setting")
            raise UsageError(f"the run was trained with {key}={saved[key]}; resume it without {option} "
                             "or with the same setting")
    cfg.update(saved)


def _algo_class(cfg: dict[str, Any]):
    if cfg["algo"] == "rlseq":
        from rlseq.algos import MemoryPPO

        return MemoryPPO
    from sb3_contrib import RecurrentPPO

    return RecurrentPPO


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = argv
    try:
        train(args)
    except UsageError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # before training started, or a second Ctrl-C: the newest checkpoint is what remains
        print(f"interrupted; continue from the newest checkpoint with: {resume_command(args)}", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
