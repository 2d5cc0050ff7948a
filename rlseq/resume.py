"""``--resume``: the checkpoint a run continues from, the settings it may not change, and the model and env
restored from that checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from rlseq.build import _algo_class, make_env, saved_speed_settings
from rlseq.config import LINEAR_PREFIX, UsageError, _check_cuda_graph_train, asked, cuda_graph_train_arg


def _resume_point(folder: Path) -> Path | None:
    """The checkpoint ``--resume`` continues from (None: a fresh start), after removing the temporary folders of
    killed saves; says which checkpoints it skips and why, and refuses when none of them is intact."""
    from rlseq.checkpoint import checkpoint_folders, remove_stale_temporaries, resumable_checkpoint

    root = folder / "checkpoints"
    for line in remove_stale_temporaries(root) if root.is_dir() else []:
        print(line, flush=True)
    latest, warnings = resumable_checkpoint(root)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    pointer = root / "latest"
    if latest is not None and pointer.exists() and not pointer.is_file():  # a save could not replace it
        aside = pointer.with_name(f"latest.not-a-file.{os.getpid()}")
        os.replace(pointer, aside)
        print(f"warning: moved {pointer} to {aside}, so that the next checkpoint can write its pointer",
              file=sys.stderr, flush=True)
    if latest is None and checkpoint_folders(root):
        raise UsageError(f"no checkpoint in {root} is intact (see the warnings above); nothing was deleted. "
                         f"Move {root} away to start the run again from step 0")
    if latest is None and any(folder.glob("events.out.tfevents.*")):
        print(f"{folder} has no checkpoint yet: starting it again from step 0", flush=True)
    return latest


# keys a resumed run may change: the budget, the checkpoint interval, how much it prints, where it runs (device,
# torch threads) and how
# acting and training are launched (the same computation; for the GRU and LSTM the training graph's scan is the same
# function with other rounding); amp, fused_adam and channels_last are the checkpoint's
# (see _adopt_saved_speed_settings); a change of TF32 or of the compiled CNN (rounding) is stated
RESUME_FREE_KEYS = frozenset({"n_timesteps", "checkpoint_every", "verbose", "device", "torch_threads", "cuda_graph",
                              "cuda_graph_train", "amp", "fused_adam", "channels_last", "tf32", "compile_extractor"})
RESUME_STATED_KEYS = ("tf32", "compile_extractor")


def _run_settings(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A ``config.yaml``'s settings, or None and why it cannot serve (missing, not YAML, not a mapping)."""
    from rlseq.checkpoint import load_settings

    if not path.is_file():
        return None, "is missing"
    try:
        return load_settings(path), None
    except ValueError as e:  # a mapping it is not
        return None, str(e)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return None, f"is unreadable ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def keep_run_budget(args: argparse.Namespace, cfg: dict[str, Any], folder: Path) -> None:
    """On ``--resume``: the run's budget and checkpoint interval stay its own unless ``--total-steps`` /
    ``--checkpoint-every`` (or the ``--config`` file) set them, instead of falling back to the family's defaults
    (a run of 8,192 steps would otherwise go on to 1,000,000 with a checkpoint every 100,000). Says what it keeps
    when that differs from the defaults."""
    from rlseq.config import config_file_value

    saved, _ = _run_settings(folder / "config.yaml")  # a bad or missing file: refuse_changed_settings says so
    if saved is None:
        return
    kept = []
    for flag, key in (("total_steps", "n_timesteps"), ("checkpoint_every", "checkpoint_every")):
        if asked(args, flag)[0] is None and config_file_value(args, cfg, key) is None and key in saved \
                and saved[key] != cfg.get(key):
            cfg[key] = saved[key]
            kept.append(f"{key} {saved[key]:,}" if isinstance(saved[key], int) else f"{key} {saved[key]!r}")
    if kept:
        print(f"note: --resume keeps the run's {' and '.join(kept)} (--total-steps and --checkpoint-every change "
              "them)", file=sys.stderr, flush=True)


def refuse_changed_settings(cfg: dict[str, Any], folder: Path, checkpoint: Path) -> None:
    """On ``--resume`` from ``checkpoint``: refuse a setting that differs from the run's ``config.yaml`` (or, when
    that is missing or unreadable, the copy saved with the checkpoint), listing every difference; refuse when there
    is neither, since nothing would stop any change. A scalar key the older file lacks is not compared (a setting
    newer than the run); a mapping or list missing on one side is compared as empty (``policy_kwargs`` given now
    and not in the run, or the other way round, is a change)."""
    path = folder / "config.yaml"
    saved, why = _run_settings(path)
    if saved is None:
        copy = checkpoint / "config.yaml"
        if not copy.is_file():
            raise UsageError(f"--resume: {path} {why} and checkpoint {checkpoint} holds no copy of the run's "
                             "settings, so changed flags could not be refused; put the run's config.yaml back, or "
                             "start a new run with another --tag")
        print(f"warning: {path} {why}: the resumed run's settings are checked against {checkpoint.name}'s copy",
              file=sys.stderr)
        path = copy
        saved = yaml.safe_load(path.read_text())  # loads: checkpoint_problem checked it with load_settings
    changed = [f"  {key}: {saved.get(key)!r} in the run, {cfg.get(key)!r} now" for key in sorted(set(cfg) | set(saved))
               if key not in RESUME_FREE_KEYS and _compared(key, cfg, saved)
               and _comparable(key, cfg.get(key)) != _comparable(key, saved.get(key))]
    for key in RESUME_STATED_KEYS:
        if key in saved and cfg.get(key) != saved[key]:
            print(f"note: {key} was {saved[key]!r} in the run and is {cfg.get(key)!r} from now on", file=sys.stderr)
    # the budget the checkpoint trained towards: config.yaml is rewritten with a resume's --total-steps before
    # its first checkpoint, so after a resume killed early it no longer says which line the rate was on
    trained = checkpoint / "config.yaml"
    budget = (yaml.safe_load(trained.read_text()) or {}).get("n_timesteps") if trained.exists() else None
    budget = saved.get("n_timesteps") if budget is None else budget
    if str(cfg.get("learning_rate")).startswith(LINEAR_PREFIX) and budget is not None \
            and cfg.get("n_timesteps") != budget:
        print(f"note: the learning rate {cfg['learning_rate']} anneals to 0 at {cfg['n_timesteps']:,} env steps from "
              f"now on, not at the {budget:,} it was annealing to: its rate jumps at the resume", file=sys.stderr)
    if changed:
        if "learning_rate" in saved and cfg.get("learning_rate") != saved["learning_rate"]:
            changed.append(f"  (a config's memory_learning_rate gives some memories a rate of their own: "
                           f"--learning-rate {saved['learning_rate']} resumes with the run's)")
        raise UsageError("\n".join([f"--resume with other settings than the run's ({path}); resume with the same "
                                     "ones (only --total-steps and --checkpoint-every may change), or start a new "
                                     "run with another --tag:", *changed]))


def _compared(key: str, cfg: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether ``key`` is compared: on both sides, or a mapping or list on the one side that has it."""
    if key in cfg and key in saved:
        return True
    return isinstance(cfg.get(key, saved.get(key)), (dict, list))


def _comparable(key: str, value: Any) -> Any:
    """``value`` without what a resumed run may change inside it (procgen's worker-thread count), a missing or empty
    mapping or list as None."""
    if key == "env_kwargs" and isinstance(value, dict):
        value = {k: v for k, v in value.items() if k != "num_threads"}
    return None if isinstance(value, (dict, list)) and not value else value


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
    from rlseq.policies.actor_critic import record_adopted_read_norms
    from rlseq.policies.memory import settings_refusal

    step = int(latest.name[len("step"):])
    env = make_env({**cfg, "normalize_reward": False}, seed=resumed_env_seed(cfg["seed"], step))
    env = _load_reward_statistics(latest, env)
    try:
        # the compiled CNN is a setting of this run, not of the checkpoint: applied as the policy is built
        rebuild = {"compile_extractor": cfg["compile_extractor"]} if cfg["algo"] == "rlseq" else {}
        model = _algo_class(cfg).load(latest / "model.zip", env=env, device=device, **rebuild)
    except RuntimeError as e:
        said = settings_refusal(e)
        if said is None:
            raise
        env.close()
        raise UsageError(f"--resume: {latest} was saved with other memory settings (head sizes or rotary "
                         "positions) than this rlseq's defaults give the run's memory; a run resumes with the settings "
                         "it was trained with, so start a new run with another --tag (`python -m rlseq.evaluate` plays "
                         f"the checkpoint as it was trained). The load said: {said}") from None
    record_adopted_read_norms(model)  # RecurrentPPO's too: its next checkpoints load without the read norm
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


def _adopt_saved_speed_settings(cfg: dict[str, Any], model, args: argparse.Namespace) -> None:
    """On ``--resume`` the checkpoint's amp / fused-Adam / channels-last settings hold (saved in its ``policy_kwargs``);
    a flag, ``--fast`` or the ``--config`` file that asks for something else is refused rather than silently ignored."""
    from rlseq.config import config_file_value

    saved = saved_speed_settings(model)
    for key in ("amp", "fused_adam", "channels_last"):
        value, option = asked(args, key)
        if value is None:
            value, option = config_file_value(args, cfg, key), f"{args.config}'s {key}"
        if value is not None and (None if value == "none" else value) != saved[key]:
            if option == "--fast":
                keep = f"--amp {saved[key] or 'none'}" if key == "amp" else \
                    f"--{'' if saved[key] else 'no-'}{key.replace('_', '-')}"
                raise UsageError(f"the run was trained with {key}={saved[key]}, and --fast asks for {key}={value}; "
                                 f"resume it without --fast, or add {keep} to keep the checkpoint's setting")
            raise UsageError(f"the run was trained with {key}={saved[key]}; resume it without {option} "
                             "or with the same setting")
    cfg.update(saved)
