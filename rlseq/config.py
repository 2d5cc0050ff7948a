"""The hyperparameters of a training run: the config files, the keys they may hold and their checks, and how
:func:`resolve` merges a file with the command-line flags into one checked config (building nothing).

:class:`UsageError` lives here, below every other training module, so that each of them can raise it.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import math
import os
import re
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
    "compile_extractor": "compile_extractor",
}
AMP_CHOICES = ("bf16", "none")
# --fast: what it sets, unless the flag is given itself
FAST_PRESET = {"amp": "bf16", "fused_adam": True, "channels_last": True, "tf32": True, "compile_extractor": True}
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
            raise ValueError(f"must be {'>' if above else '>='} {_bound(low)}" +
                             (f" and <= {_bound(high)}" if high is not None else ""))
        return number

    return check


LINEAR_PREFIX = "lin_"  # RL Zoo's spelling of a learning rate annealed linearly to 0 over the run: lin_5e-4


def _learning_rate(value: Any) -> float | str:
    """Checker of a learning rate: a number > 0, or ``lin_<number > 0>``, annealed linearly from that number to 0
    over ``n_timesteps`` (RL Zoo's convention; CleanRL's PPO anneals so by default). The schedule is returned as
    ``lin_<number>`` with the number written back in its shortest form: what :func:`learning_rate_schedule` reads."""
    if isinstance(value, str) and value.strip().startswith(LINEAR_PREFIX):
        try:
            start = _real(0, above=True)(value.strip()[len(LINEAR_PREFIX):])
        except ValueError as e:
            raise ValueError(f"{e} after {LINEAR_PREFIX!r} (a linear schedule from that rate to 0, e.g. "
                             f"{LINEAR_PREFIX}5e-4)") from None
        return f"{LINEAR_PREFIX}{start!r}"
    try:
        return _real(0, above=True)(value)
    except ValueError as e:
        raise ValueError(f"{e}, or {LINEAR_PREFIX}<rate> for a linear schedule to 0 (e.g. {LINEAR_PREFIX}5e-4)") \
            from None


def learning_rate_schedule(value: float | str) -> float | Callable[[float], float]:
    """What SB3-style algorithms take as ``learning_rate``: the constant, or for ``lin_<rate>`` SB3's
    ``LinearSchedule`` from the rate (progress remaining 1) to 0 (progress remaining 0). It stays at 0 past the
    budget, where the last rollout overshoots ``n_timesteps``, instead of turning negative."""
    from stable_baselines3.common.utils import LinearSchedule

    checked = _learning_rate(value)
    if isinstance(checked, str):
        return LinearSchedule(float(checked[len(LINEAR_PREFIX):]), 0.0, 1.0)
    return checked


def _bound(x: float) -> str:
    """``x`` in the fewest digits that give it back (π named): "<= 3.14159" would refuse 3.1416 as above a bound
    that reads as below it."""
    text = f"{x:g}" if float(f"{x:g}") == x else repr(x)
    return f"π ({text})" if x == math.pi else text


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


MAX_SCALE = 1e12  # the largest reward scale and value shift (float32's largest number is 3.4e38)

# every key a config entry may hold -> its checker (returns the value converted)
CONFIG_KEYS: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(("n_timesteps", "n_envs", "n_steps", "n_minibatches", "n_epochs", "checkpoint_every",
                     "env_groups"), _whole(1)),
    "learning_rate": _learning_rate, "gamma": _real(0, 1, above=True), "gae_lambda": _real(0, 1),
    "ent_coef": _real(0), "vf_coef": _real(0), "clip_range": _real(0, above=True), "max_grad_norm": _real(0, above=True),
    # returns of ~100 such rewards (or values of such a shift) and their squares stay well inside float32
    "reward_scale": _real(0, MAX_SCALE, above=True), "value_shift": _real(-MAX_SCALE, MAX_SCALE),
    **dict.fromkeys(("normalize_reward", "prev_action_reward", "fused_adam", "channels_last", "tf32", "cuda_graph",
                     "compile_extractor"), _boolean),
    "amp": _amp, "cuda_graph_train": _cuda_graph_train,
    **dict.fromkeys(("env_kwargs", "policy_kwargs", "memory_kwargs", "memory_learning_rate"), _mapping),
}


def auto_procgen_threads() -> int:
    """procgen's worker threads for ``num_threads: auto``: the cores this process may use (a sweep's share,
    ``RLSEQ_CPUS``, when it sets one), within [8, 16]. On a 16-core H100 host 16 threads stepped 64 caveflyer games
    in 0.35-0.43 ms against 0.48-0.50 ms with 8, and 24 or 32 were slower again (``docs/benchmarks.md``); below 8 (the
    earlier fixed default) nothing was measured faster."""
    share = os.environ.get("RLSEQ_CPUS", "")
    if share.isdigit() and int(share) > 0:
        cores = int(share)
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(16, max(8, cores))


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


def _did_you_mean(key: Any, valid: Any) -> str:
    close = difflib.get_close_matches(str(key), list(valid), n=3)
    return f"did you mean {' or '.join(close)}? " if close else ""


_POSITIVE = _whole(1)
# memory keyword -> its checker; the None default of a keyword that has one stays allowed
MEMORY_VALUES: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(("d_model", "conv_size", "n_heads", "head_dim", "value_dim", "hidden_size", "num_layers",
                     "chunk_size"), _POSITIVE),
    **dict.fromkeys(("query_norm", "output_norm", "allow_negative_eigenvalues", "bias"), _boolean),
    "beta_bias_init": _real(-MAX_SCALE), "forget_bias": _real(-MAX_SCALE), "dropout": _real(0, 1),
    "key_norm_cap": _real(0, MAX_SCALE, above=True), "rotary_base": _real(1, MAX_SCALE, above=True),
    "rotary_max_freq": _real(0, math.pi, above=True),
}
# memory keywords whose null turns a part off although their default is a value
NULLABLE_MEMORY_KEYWORDS = frozenset({"rotary_base"})


def memory_kwargs_problems(memory_kwargs: dict, where: str) -> list[str]:
    """One message per entry of a config's ``memory_kwargs`` (memory name -> its keywords) that building the
    memory would refuse: an unknown memory or keyword, or a value out of range. Checked against the constructors'
    signatures (:func:`memory_keywords`), so nothing is built."""
    from rlseq.kernels.api import BACKENDS
    from rlseq.policies.memory import JOINS, MEMORIES, RECURRENT_INITS

    problems = []
    for name, kwargs in memory_kwargs.items():
        if name not in MEMORIES:
            problems.append(f"memory_kwargs key {name!r} in {where} is not a memory; {_did_you_mean(name, MEMORIES)}"
                            f"memory_kwargs maps a memory ({', '.join(MEMORIES)}) to its keywords, e.g. "
                            "{efla: {n_heads: 4}}")
            continue
        if kwargs is None:
            continue
        if not isinstance(kwargs, dict):
            problems.append(f"memory_kwargs {name} in {where} must be a mapping of keywords, not {_short(kwargs)}")
            continue
        valid = memory_keywords(name)
        for key, value in kwargs.items():
            if key == "residual" and "join" in valid:
                problems.append(f"memory_kwargs {name} residual in {where} is now join: residual: false is "
                                "join: read (valid joins: " + ", ".join(JOINS) + ")")
                continue
            if key not in valid:
                problems.append(f"unknown memory_kwargs key {key!r} of {name} in {where}; "
                                f"{_did_you_mean(key, valid)}valid keys of {name}: {', '.join(valid)}")
                continue
            if value is None and (valid[key] is None or key in NULLABLE_MEMORY_KEYWORDS):
                continue
            try:
                if key in MEMORY_VALUES:
                    kwargs[key] = MEMORY_VALUES[key](value)
                elif key == "recurrent_init" and value not in RECURRENT_INITS:
                    raise ValueError(f"is not valid; valid: {', '.join(RECURRENT_INITS)}")
                elif key == "join" and value not in JOINS:
                    raise ValueError(f"is not valid; valid: {', '.join(JOINS)}")
                elif key == "backend" and value not in BACKENDS:
                    raise ValueError(f"is not valid; valid: {', '.join(BACKENDS)} or null (the best available)")
            except ValueError as e:
                problems.append(f"memory_kwargs {name} {key} {value!r} {e} ({where})")
    return problems


def _keywords(cls: type) -> dict[str, Any]:
    """The keyword arguments ``cls(...)`` takes, with their defaults: its constructor's, and its parents' while
    ``**kwargs`` passes them on. The parents' come first (the keywords every subclass shares lead a listing), a
    subclass's default wins."""
    import inspect

    levels: list[dict[str, Any]] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        levels.append({p.name: p.default for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)})
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    found: dict[str, Any] = {}
    for level in reversed(levels):
        found.update(level)
    found.pop("self", None)
    return found


def memory_keywords(name: str) -> dict[str, Any]:
    """The keywords ``memory_kwargs`` may hold for the memory ``name``, with their defaults: its constructors',
    and for the GRU and the LSTM the ``nn.GRU`` / ``nn.LSTM`` keywords they pass on."""
    from rlseq.policies.memory import memory_class

    cls = memory_class(name)
    found = {k: v for k, v in _keywords(cls).items() if k != "in_features"}
    rnn_class = getattr(cls, "rnn_class", None)
    if rnn_class is not None:
        found.update({k: v for k, v in _keywords(rnn_class).items()
                      if k not in cls.fixed_rnn_keywords and k not in found})
    return found


# policy keywords that other config keys set: key -> what sets it
POLICY_SET_ELSEWHERE = {"memory": "--memory", "memory_kwargs": "the config's memory_kwargs", "amp_dtype": "amp",
                        "channels_last": "channels_last"}


def policy_keywords(algo: str, memory: str) -> set[str]:
    """What ``policy_kwargs`` may hold for this algorithm and memory: the keywords of every policy class
    :func:`rlseq.build.build_model` may pick (one per observation kind), less those other config keys set."""
    if algo == "rlseq":
        from rlseq.algos import MemoryPPO

        classes = set(MemoryPPO.policy_aliases.values())
    elif memory == "lstm":
        from sb3_contrib import RecurrentPPO

        classes = set(RecurrentPPO.policy_aliases.values())
    else:
        import rlseq.policies as P

        named = {"efla": "Efla", "deltanet": "DeltaNet"}.get(memory, "Memory")
        classes = {getattr(P, f"{named}{suffix}Policy") for suffix in ("Mlp", "Cnn", "MultiInput")}
    constructor = {"observation_space", "action_space", "lr_schedule"}
    return set().union(*(_keywords(c).keys() for c in classes)) - constructor - set(POLICY_SET_ELSEWHERE)


def env_keywords(env: str, family: str) -> set[str] | None:
    """What ``env_kwargs`` may hold for ``env``: procgen's options, or the keywords of the gymnasium env's
    constructor and ``gymnasium.make``'s own; None when the constructor takes any keyword (or cannot be read)."""
    import inspect

    if family == "procgen":
        from rlseq.envs.procgen import _PASSTHROUGH_OPTIONS

        return set(PROCGEN_OPTIONS) | set(_PASSTHROUGH_OPTIONS)
    import gymnasium

    try:
        spec = gymnasium.spec(env)
        creator = spec.entry_point
        if isinstance(creator, str):
            from gymnasium.envs.registration import load_env_creator

            creator = load_env_creator(creator)
        params = inspect.signature(creator).parameters.values()
    except Exception:  # noqa: BLE001  (an entry point that cannot be inspected is checked when it is built)
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return ({p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} | set(spec.kwargs)
            | {"max_episode_steps", "disable_env_checker"})


def kwargs_problems(cfg: dict[str, Any], origin: dict[str, str], algo: str, memory: str, env: str,
                    family: str) -> list[str]:
    """One message per key of ``memory_kwargs``, ``policy_kwargs`` and ``env_kwargs`` that the memory, the policy
    or the env would refuse once built, i.e. after the run folder exists."""
    problems = []
    if isinstance(cfg.get("memory_kwargs"), dict):
        problems += memory_kwargs_problems(cfg["memory_kwargs"], origin.get("memory_kwargs", "config"))
    kinds = [("policy_kwargs", lambda: policy_keywords(algo, memory), f"the policy of --algo {algo}"),
             ("env_kwargs", lambda: env_keywords(env, family), env)]
    for key, keywords, whose in kinds:
        given = cfg.get(key)
        if not isinstance(given, dict) or not given:
            continue
        where = origin.get(key, "config")
        valid = keywords()
        for name in given:
            if key == "policy_kwargs" and name in POLICY_SET_ELSEWHERE:
                problems.append(f"policy_kwargs key {name!r} in {where} is set by {POLICY_SET_ELSEWHERE[name]}; "
                                "remove it from policy_kwargs")
            elif valid is not None and name not in valid and not (key == "env_kwargs" and name in PROCGEN_OPTIONS):
                # procgen options of a gymnasium env get their own message below
                problems.append(f"unknown {key} key {name!r} in {where}; {_did_you_mean(name, valid)}"
                                f"valid keys of {whose}: {', '.join(sorted(valid))}")
    return problems


# what ppo_kwargs() and make_env() read without a default
REQUIRED_KEYS = ("n_timesteps", "n_envs", "n_steps", "n_minibatches", "n_epochs", "checkpoint_every", "learning_rate",
                 "gamma", "gae_lambda", "ent_coef", "vf_coef", "clip_range", "max_grad_norm")


def check_flags(args: argparse.Namespace) -> list[str]:
    """One message per bad flag that names no config key: --seed, --torch-threads, --tag, --device."""
    problems = []
    if not 0 <= args.seed < 2**31:
        problems.append(f"--seed {args.seed} must be >= 0 and < 2**31 (procgen's level seeds are C ints)")
    if getattr(args, "torch_threads", None) is not None and args.torch_threads < 1:
        problems.append(f"--torch-threads {args.torch_threads} must be >= 1")
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


def read_yaml(path: Path, what: str = "config file") -> Any:
    """The contents of a YAML file; a missing file or a syntax error is one :class:`UsageError` line naming the
    place."""
    if not path.exists():
        raise UsageError(f"{what} {path} does not exist")
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory; give the YAML file in it")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "tag:yaml.org,2002:python/" in problem:  # safe_load builds no Python objects, whatever the tag asks
            problem += " (!!python tags are not read: write plain values)"
        raise UsageError(f"{what} {path} is not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {path} is not a UTF-8 text file (byte {e.start}: {e.reason}); give a YAML file") \
            from None
    except OSError as e:
        raise UsageError(f"{what} {path} cannot be read ({e.strerror or e})") from None


def load_config(path: Path, env: str, family: str = "procgen") -> dict[str, Any]:
    """The hyperparameters of ``env`` from an RL Zoo-style file (its own key, else the default entry named like
    its ``family``: ``procgen``, ``popgym`` or ``gym``)."""
    table = read_yaml(path)
    table = {} if table is None else table
    if not isinstance(table, dict):
        raise UsageError(f"{path} holds the {type(table).__name__} {_short(table)}; it must map env ids (or the "
                         f"default entry {family!r}) to hyperparameters, e.g. {family}: {{n_envs: 8}}")
    key = env if env in table else family if family in table else None
    if key is None:
        flat = [str(k) for k in table if k in CONFIG_KEYS]
        hint = (f"; {', '.join(flat)} {'are hyperparameters' if len(flat) > 1 else 'is a hyperparameter'}: put "
                f"{'them' if len(flat) > 1 else 'it'} under {env}: (this env) or {family}: (every {family} env)"
                if flat else "")
        raise UsageError(f"{path} has no entry for {env!r} and no {family!r} default; "
                         f"entries: {', '.join(map(str, table)) or 'none'}{hint}")
    entry = table[key]
    if entry is None:
        flat = [str(k) for k in table if k in CONFIG_KEYS]
        hint = f" ({', '.join(flat)} {'are' if len(flat) > 1 else 'is'} outside it: indent under {key}:)" if flat else ""
        raise UsageError(f"the entry {key!r} of {path} is empty (null){hint}; give it hyperparameters (key: value) "
                         "or remove it")
    if not isinstance(entry, dict):
        raise UsageError(f"the entry {key!r} of {path} must be a mapping of hyperparameters (key: value), "
                         f"not a {type(entry).__name__}")
    return copy.deepcopy(entry)


def apply_memory_learning_rate(entry: dict[str, Any], where: str, memory: str, own_block: bool) -> list[str]:
    """Resolve one config entry's ``memory_learning_rate`` (memory name -> learning rate) in place: it is
    removed, and for ``memory`` (when the run uses rlseq's block, ``own_block``) it replaces the entry's
    ``learning_rate``. Per entry, before entries are layered: a later file's ``learning_rate`` (an ablation's
    sweep) replaces the memory's rate of an earlier one, and a flag replaces both. One message per bad entry."""
    from rlseq.policies.memory import MEMORIES

    table = entry.pop("memory_learning_rate", None)
    if table is None:
        return []
    if not isinstance(table, dict):
        return [f"memory_learning_rate in {where} must map a memory ({', '.join(MEMORIES)}) to its learning rate, "
                f"e.g. {{lstm: 1.0e-3}}, not {_short(table)}"]
    problems = []
    for name, rate in table.items():
        if name not in MEMORIES:
            problems.append(f"memory_learning_rate key {name!r} in {where} is not a memory; "
                            f"{_did_you_mean(name, MEMORIES)}valid memories: {', '.join(MEMORIES)}")
            continue
        try:
            table[name] = CONFIG_KEYS["learning_rate"](rate)
        except ValueError as e:
            problems.append(f"memory_learning_rate {name} {rate!r} {e} ({where})")
    if not problems and own_block and memory in table:
        try:  # a bad learning_rate stays, for check_values to report: replaced or not, it is an error
            CONFIG_KEYS["learning_rate"](entry.get("learning_rate", 1.0))
        except ValueError:
            return []
        entry["learning_rate"] = table[memory]
    return problems


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
    base = FAMILY_CONFIGS[family]
    cfg = load_config(base, env, family)
    problems = unknown_keys(cfg, f"{base} (entry of {env})")
    origin = dict.fromkeys(cfg, str(base))
    # sb3-contrib's own LSTM is another design than rlseq's block: no conv_size, no memory_learning_rate
    stock_lstm = args.algo != "rlseq" and args.memory == "lstm"
    problems += apply_memory_learning_rate(cfg, str(base), args.memory, not stock_lstm)
    if args.config:  # RL Zoo-style: the file's entry overrides the family's defaults key by key
        path = Path(args.config)
        override = load_config(path, env, family)
        problems += unknown_keys(override, f"{path} (entry of {env})")
        problems += apply_memory_learning_rate(override, str(path), args.memory, not stock_lstm)
        cfg.update(override)
        origin.update(dict.fromkeys(override, str(path)))
    problems += check_flags(args)
    for flag, key in FLAG_TO_KEY.items():
        value, option = asked(args, flag)
        if value is not None:
            cfg[key], origin[key] = value, option
    problems += check_values(cfg, origin)
    problems += kwargs_problems(cfg, origin, args.algo, args.memory, env, family)
    problems += [f"{key} is missing from {base} (entry of {env})" for key in REQUIRED_KEYS if key not in cfg]
    if problems:
        raise UsageError("\n".join(problems))
    env_kwargs = cfg["env_kwargs"] = dict(cfg.get("env_kwargs") or {})
    if family == "procgen":
        for key in PROCGEN_OPTIONS:
            if getattr(args, key) is not None:
                env_kwargs[key] = getattr(args, key)
        if str(env_kwargs.get("num_threads")).strip().lower() == "auto":
            env_kwargs["num_threads"] = auto_procgen_threads()
        for key in ("num_levels", "start_level", "num_threads"):  # procgen checks them only once the folder exists
            if key in env_kwargs:
                where = "--" + key.replace("_", "-") if getattr(args, key) is not None else origin.get("env_kwargs")
                try:
                    env_kwargs[key] = _whole(0)(env_kwargs[key])
                except ValueError as e:
                    raise UsageError(f"{key} {env_kwargs[key]!r} {e} ({where})") from None
        if env_kwargs.get("num_levels", 0) + env_kwargs.get("start_level", 0) > 2**31 - 1:
            raise UsageError("start_level + num_levels must be <= 2**31 - 1 (procgen's level seeds are C ints)")
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
    cfg["compile_extractor"] = bool(cfg.get("compile_extractor", False))
    if cfg["compile_extractor"] and args.algo != "rlseq":
        raise UsageError("--compile-extractor needs --algo rlseq")
    if args.cuda_graph and args.algo != "rlseq":
        raise UsageError("--cuda-graph needs --algo rlseq (sb3-contrib's RecurrentPPO acts eagerly)")
    if args.cuda_graph and args.device == "cpu":
        raise UsageError("--cuda-graph needs a GPU; drop it with --device cpu")
    if args.cuda_graph_train and args.algo != "rlseq":
        raise UsageError("--cuda-graph-train needs --algo rlseq")
    if args.cuda_graph_train and args.device == "cpu":
        raise UsageError("--cuda-graph-train needs a GPU; drop it with --device cpu")
    if not args.resume:  # on --resume the checkpoint's fused_adam holds: checked once it is known
        _check_cuda_graph_train(args, cfg)
    memory_kwargs = cfg.pop("memory_kwargs", {}) or {}
    cfg.update(env=env, env_family=family, env_packages=list(env_id.packages), memory=args.memory, algo=args.algo,
               seed=args.seed, tag=args.tag, memory_kwargs=dict(memory_kwargs.get(args.memory, {}) or {}))
    conv_size = getattr(args, "conv_size", None)
    if conv_size is not None:
        if conv_size < 1:
            raise UsageError(f"--conv-size must be >= 1, got {conv_size}")
        if stock_lstm:
            raise UsageError("--conv-size sets rlseq's block; sb3-contrib's own LSTM (--algo sb3-recurrent-ppo "
                             "--memory lstm) has none")
        cfg["memory_kwargs"]["conv_size"] = conv_size
    if getattr(args, "shared_lstm", False):
        if not stock_lstm:
            raise UsageError("--shared-lstm is an option of sb3-contrib's own LSTM: give --algo sb3-recurrent-ppo "
                             "--memory lstm")
        cfg["policy_kwargs"] = {**(cfg.get("policy_kwargs") or {}), "shared_lstm": True, "enable_critic_lstm": False}
    return cfg


def config_file_value(args: argparse.Namespace, cfg: dict[str, Any], key: str) -> Any:
    """``key`` as the ``--config`` file's entry for the resolved run ``cfg`` sets it (None without a file or key)."""
    if not getattr(args, "config", None):
        return None
    return load_config(Path(args.config), cfg["env"], cfg["env_family"]).get(key)


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
