"""``python -m rlseq.evaluate RUN_DIR --episodes N``: mean and std of the unscaled game return.

Procgen levels: a level is a seed in ``[0, 2**31 - 1)``. A run that trained on ``num_levels = n > 0`` levels from
``start_level = s`` met only the seeds ``[s, s + n)``; evaluation plays the held-out seeds ``[s + n, 2**31 - 1)``
(or from ``--start-level``, which must not reach into the training range). A run on the full distribution
(``num_levels = 0``, the default) draws its levels from all seeds (procgen then ignores ``start_level``), so it
has no held-out set: evaluation draws fresh levels from that same distribution, and says so (``held_out`` False).
The result lists the level seed of every episode.

Gymnasium envs: evaluation env ``i`` is seeded ``2**31 + seed + i`` (``seed`` is ``--seed``), while the training
envs are seeded below 2**31 (``s + i`` for a run with seed ``s``, a seed below 2**30 after a resume): disjoint
seeds, hence new episode draws. ``--start-level`` is procgen's only.

The model played is ``final_model.zip``, else the newest intact checkpoint's; each newer file passed over (an
unreadable ``final_model.zip``, a torn checkpoint) is a ``warning:`` line, and the result line names the model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: Offset of the evaluation seeds of gymnasium envs from ``--seed`` (training seeds lie below it).
EVAL_SEED_OFFSET = 2**31
#: One past procgen's largest level seed (a C int; ``start_level + num_levels`` may not exceed it).
LEVEL_SEED_END = 2**31 - 1


def evaluation_levels(env_kwargs: dict, start_level: int | None) -> dict:
    """``{"start_level", "num_levels", "held_out"}`` of the evaluation env for a procgen run trained with
    ``env_kwargs``: the seeds above the training range when it is finite, the training distribution otherwise."""
    n_train, s_train = int(env_kwargs.get("num_levels", 0)), int(env_kwargs.get("start_level", 0))
    if n_train == 0:
        if start_level is None:
            return {"start_level": 0, "num_levels": 0, "held_out": False}
        return {"start_level": start_level, "num_levels": LEVEL_SEED_END - start_level, "held_out": False}
    first = s_train + n_train if start_level is None else start_level
    if first < s_train + n_train:
        raise ValueError(f"--start-level {first} reaches into the training levels [{s_train}, {s_train + n_train}); "
                         f"held-out levels start at {s_train + n_train}")
    if first >= LEVEL_SEED_END:
        raise ValueError(f"no level seeds are left above {first} (procgen's seeds end at {LEVEL_SEED_END})")
    return {"start_level": first, "num_levels": LEVEL_SEED_END - first, "held_out": True}


def load_as_trained(cls: type, path: Path, device: str, notes: list[str]) -> Any:
    """``cls.load(path)``, or, for a model whose delta-rule memory was saved with other settings than today's
    defaults give it (head sizes, or rotary positions: saved before they became the default or before their
    fastest pair turned π a step), which a plain load refuses naming the ``memory_kwargs`` to load it by, the same
    with those settings, and a line in ``notes`` saying so. Only for playing a model: a resumed run is refused
    instead (:mod:`rlseq.resume`), since it would go on training with other settings than its config's."""
    from stable_baselines3.common.save_util import load_from_zip_file

    from rlseq.algos import MemoryPPO
    from rlseq.policies.memory import format_memory_kwargs, memory_kwargs_to_load, settings_refusal

    # playing gains nothing from a compiled CNN (a --fast run's) and would compile it first, on any device
    play = {"compile_extractor": False} if issubclass(cls, MemoryPPO) else {}
    try:
        return cls.load(path, device=device, **play)
    except RuntimeError as e:
        refusal = settings_refusal(e)
        if refusal is None:
            raise
    trained = memory_kwargs_to_load(refusal)
    kwargs = load_from_zip_file(path, device=device, load_data=True)[0]["policy_kwargs"]
    memory_kwargs = {**(kwargs.get("memory_kwargs") or {}), **trained}
    notes.append(f"{path.name} was saved with other memory settings than today's defaults: played with "
                 f"memory_kwargs {format_memory_kwargs(trained)}, as it was trained")
    return cls.load(path, device=device, custom_objects={"policy_kwargs": {**kwargs, "memory_kwargs": memory_kwargs}},
                    **play)


def find_model(run_dir: Path, notes: list[str] | None = None) -> Path:
    """``final_model.zip``, else the model of the newest intact checkpoint. Why a newer file was passed over (an
    unreadable ``final_model.zip``, a torn checkpoint) is appended to ``notes``, so that the caller can say which
    model it played and why that one."""
    from rlseq.checkpoint import _check_zip, resumable_checkpoint

    notes = [] if notes is None else notes
    final = run_dir / "final_model.zip"
    if final.exists():
        try:
            _check_zip(final)
            return final
        except Exception as e:  # noqa: BLE001  (a directory, a torn zip, another file: any is no model)
            notes.append(f"{final} is not a readable model ({e.__class__.__name__}: {e})")
    latest, skipped = resumable_checkpoint(run_dir / "checkpoints")
    notes += skipped
    if latest is None:
        raise FileNotFoundError(f"{run_dir} has neither a readable final_model.zip nor an intact checkpoint"
                                + "".join(f"; {note}" for note in notes))
    return latest / "model.zip"


# what make_env and the model's class read from a run's config.yaml without a default
SAVED_KEYS = ("env", "algo")


def read_run_config(run_dir: Path) -> dict:
    """A run folder's ``config.yaml``, checked for what evaluation reads (a hand-edited or torn file is one
    error line, not a traceback from deep inside the env)."""
    from rlseq.config import read_yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: RUN_DIR must be a run folder written by rlseq.train")
    cfg = read_yaml(path, "run config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds no mapping of settings but {type(cfg).__name__} {str(cfg)[:40]!r}; it is not "
                         "a config.yaml written by rlseq.train")
    missing = [key for key in SAVED_KEYS if not isinstance(cfg.get(key), str)]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)} (or they are not names); it is not a config.yaml "
                         "written by rlseq.train")
    if not isinstance(cfg.get("env_kwargs") or {}, dict):
        raise ValueError(f"env_kwargs of {path} must be a mapping, not {cfg['env_kwargs']!r}")
    return cfg


def evaluate(run_dir: Path, episodes: int, *, n_envs: int = 16, deterministic: bool = False, seed: int = 12345,
             start_level: int | None = None, device: str = "auto", progress: bool = True) -> dict[str, float]:
    """Play ``episodes`` episodes on held-out levels (procgen, see :func:`evaluation_levels`) or new env seeds
    (gymnasium envs, from ``EVAL_SEED_OFFSET + seed``); returns mean/std/min/max of the unscaled return, and
    ``start_level``, ``num_levels``, ``held_out`` and ``level_seeds`` (procgen) or ``first_seed`` (gymnasium), and
    ``model``, the file played (relative to ``run_dir``: ``final_model.zip`` or a checkpoint's model),
    ``skipped``, why newer models were passed over, and ``notes``, how the model was loaded where that differs from
    today's defaults (:func:`load_as_trained`)."""
    from tqdm.auto import tqdm

    from rlseq.config import device_problems
    from rlseq.train import _algo_class, _family, make_env

    if episodes < 1:
        raise ValueError(f"--episodes must be >= 1, got {episodes}")
    if n_envs < 1:
        raise ValueError(f"--n-envs must be >= 1, got {n_envs}")
    problems = device_problems(device)  # what rlseq.train refuses: SB3 would fall back to the CPU without a word
    if problems:
        raise ValueError(problems[0])
    cfg = read_run_config(run_dir)
    skipped: list[str] = []
    model_path = find_model(run_dir, skipped)  # before the env is built: a run without a model needs none
    env_kwargs = dict(cfg.get("env_kwargs") or {})
    if _family(cfg) == "procgen":
        where = evaluation_levels(env_kwargs, start_level)
        env_kwargs.update(start_level=where["start_level"], num_levels=where["num_levels"])
    elif start_level is not None:
        raise ValueError(f"--start-level is a procgen option; {cfg['env']} is evaluated on new env seeds (--seed)")
    else:
        seed += EVAL_SEED_OFFSET
        where = {"first_seed": seed}
    venv = make_env({**cfg, "env_kwargs": env_kwargs, "n_envs": n_envs}, seed=seed, training=False)
    notes: list[str] = []
    model = load_as_trained(_algo_class(cfg), model_path, device, notes)
    obs = venv.reset()
    state, starts = None, np.ones(n_envs, dtype=bool)
    returns: list[float] = []
    levels: list[int] = []
    # a fixed quota per env: taking the first N episodes to finish would favour short episodes
    quota = np.full(n_envs, episodes // n_envs) + (np.arange(n_envs) < episodes % n_envs)
    with tqdm(total=episodes, desc="episodes", disable=not progress) as bar:
        while len(returns) < episodes:
            actions, state = model.predict(obs, state=state, episode_start=starts, deterministic=deterministic)
            obs, _, dones, infos = venv.step(actions)
            starts = dones
            for i, info in enumerate(infos):
                if "episode" in info and quota[i] > 0:
                    quota[i] -= 1
                    returns.append(float(info["episode"]["r"]))
                    if "level_seed" in info:
                        levels.append(int(info["level_seed"]))
                    bar.update(1)
    venv.close()
    r = np.asarray(returns)
    return {"episodes": len(r), "mean": float(r.mean()), "std": float(r.std(ddof=1)) if len(r) > 1 else float("nan"),
            "min": float(r.min()), "max": float(r.max()), "model": str(model_path.relative_to(run_dir)), "skipped": skipped,
            "notes": notes, **where,
            **({"level_seeds": levels} if levels else {})}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rlseq.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--n-envs", type=int, default=16)
    p.add_argument("--deterministic", action="store_true", help="greedy actions (default: sample, as in training)")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--start-level", type=int, default=None, help="procgen runs: first level seed")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    try:
        res = evaluate(args.run_dir, args.episodes, n_envs=args.n_envs, deterministic=args.deterministic,
                       seed=args.seed, start_level=args.start_level, device=args.device)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    spread = (f" ± {res['std']:.3f} (std over {res['episodes']} episodes; min {res['min']:.3f}, max {res['max']:.3f}; "
              if res["episodes"] > 1 else " (1 episode; ")
    for note in res["skipped"]:
        print(f"warning: {note}", file=sys.stderr)
    for note in res["notes"]:
        print(f"note: {note}", file=sys.stderr)
    why = "the newer models are unusable (see the warnings)" if res["skipped"] else "the run has no final_model.zip"
    model = "" if res["model"] == "final_model.zip" else \
        f"; model {res['model']}: {why}, this is its newest intact checkpoint"
    print(f"{args.run_dir}: return {res['mean']:.3f}{spread}{_where(res)}{model})")


def _where(res: dict) -> str:
    if "first_seed" in res:
        return f"env seeds from {res['first_seed']}"
    if not res["held_out"]:
        return "levels of the training distribution: not held out, the run trained with num_levels=0"
    return f"held-out levels [{res['start_level']}, {res['start_level'] + res['num_levels']})"


if __name__ == "__main__":
    main()
