"""``python -m rlseq.bench memory``: does each memory remember, and how far back? PPO on recall tasks, per
variant, seed and task.

    python -m rlseq.bench memory --quick         # a slice on 2 cores: runs/memory_benchmark_quick.md
    python -m rlseq.bench memory --jobs 64       # the full grid into runs/memory_benchmark/
    python -m rlseq.bench memory --report-only --out docs/memory_benchmark   # docs/memory_benchmark.md again

The tasks: the memory-horizon sweep (``rlseq/RepeatPreviousLag{L}-v0``, the card L = 1 ... 64 steps back), two
long-range POPGym tasks at Medium and POPGym's ten Easy tasks. The variants: rlseq's memories in the shared block
(``MEMORIES``, trained by MemoryPPO with ``configs/popgym.yml``), the same with ``conv_size=1``
(``<memory>-conv1``: no window, so the window's share of a result shows), and stock sb3-contrib RecurrentPPO with
its own LSTM as outside anchors (``sb3-lstm``: its defaults; ``sb3-lstm-shared``: one shared LSTM), and the
drop-in ``RecurrentPPO(EflaMlpPolicy)`` (``sb3-efla``: rlseq's block and EFLA inside sb3-contrib). Every run of a
task gets the same env-step budget. Each run is one ``python -m rlseq.train`` process with one torch thread (its
folder ``<logdir>/<task>/<variant>/seed<S>/``, log in ``train.log``), then, in the same worker, two evaluations
of its final model on new episodes from the same env seeds, with sampled actions (as in training) and greedy
ones; the worker writes the run's result JSON and its curve CSV under ``<out>/results/`` (see
:mod:`rlseq.bench.memory_report`), atomically, and ``<out>/benchmark.json`` records each invocation. ``--jobs``
workers run side by side.

Resuming: the same command again skips every run with a result, only evaluates a run whose training finished,
and continues an interrupted run from its last checkpoint (``--resume``). A run that fails is reported with the
end of its log while the others go on; it is tried again by the next invocation. Ctrl-C stops the running
trainers at once (they keep their last checkpoint). Results made with another budget or at another rlseq commit
are refused, so that no task mixes them, and so are a variant's results made with other training settings
(``--config``, ``--n-envs``, ``--n-steps``, ``--n-minibatches``; each result records a digest of its settings):
choose another ``--out`` (and ``--logdir``).

Several machines: each runs its share of the grid into an ``--out`` of its own, at the same commit; ``--merge DIR
...`` then adds their finished runs (and the invocations that made them) to one ``--out`` (not while a benchmark
writes to it). An unfinished run moves with its run folder: copied under another machine's ``--logdir`` (with its
``.rlseq-commit`` marker), it resumes there from its last checkpoint.

The report ``<out>.md`` (with ``<out>/curves.png`` and ``<out>/horizon.png``) is rewritten at the end of every
invocation, and by ``--report-only`` from the result files alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlseq.bench.memory_report import (CURVES_PNG, MANIFEST, random_path, read_json, read_manifest, returns_table,
                                       run_paths, short_task, write_report)
from rlseq.bench.timing import cpu_model
from rlseq.sweep import _stop_with_parent, _train_once, log_tail

EASY_TASKS = ("popgym-RepeatPreviousEasy-v0", "popgym-RepeatFirstEasy-v0", "popgym-CountRecallEasy-v0",
              "popgym-AutoencodeEasy-v0", "popgym-PositionOnlyCartPoleEasy-v0", "popgym-VelocityOnlyCartpoleEasy-v0",
              "popgym-NoisyPositionOnlyPendulumEasy-v0", "popgym-HigherLowerEasy-v0", "popgym-MineSweeperEasy-v0",
              "popgym-BattleshipEasy-v0")
# the memory-horizon sweep: recall of the card L steps back, L = 1 ... 64 (rlseq.tasks)
HORIZON_TASKS = tuple(f"rlseq/RepeatPreviousLag{lag}-v0" for lag in (1, 2, 4, 8, 16, 32, 64))
# long-range tasks beyond any window
LONG_TASKS = ("popgym-RepeatFirstMedium-v0", "popgym-CountRecallMedium-v0")
TASKS = (*HORIZON_TASKS, *LONG_TASKS, *EASY_TASKS)
DEFAULT_STEPS = 100_000
# the tasks that discriminate get budgets long enough for the best variants' curves to flatten (the report checks
# it); every variant of a task gets the same. Lags 1 and 2 lie inside the window and flatten within 100k steps,
# so they get 200k and the device time goes to the lags beyond it
TASK_STEPS: dict[str, int] = {**dict.fromkeys(HORIZON_TASKS[:2], 200_000),
                              **dict.fromkeys((*HORIZON_TASKS[2:], *LONG_TASKS), 500_000)}
SEEDS = (0, 1, 2, 3, 4)
EPISODES = 64
# the flags that change how every run of an invocation trains (besides --steps, its budget, and --config)
PPO_FLAGS = ("n_envs", "n_steps", "n_minibatches")
SETTINGS_FREE_KEYS = ("seed", "tag")  # a run's name, not how it trains (settings_digest)
REPEAT_S = 0.5  # the same stop signal again this soon is one stop delivered twice (StopSignals)
# the control suffix: the same memory with conv_size 1, so that the window's share of a result shows
NO_WINDOW = "-conv1"
# sb3-contrib's RecurrentPPO with its own LSTM: at its defaults (a separate critic LSTM) and with one shared LSTM
ANCHORS = {"sb3-lstm": [], "sb3-lstm-shared": ["--shared-lstm"]}
# rlseq's memories inside sb3-contrib's RecurrentPPO (the drop-in policies), variant -> memory
DROP_INS = {"sb3-efla": "efla"}
SB3_VARIANTS = (*ANCHORS, *DROP_INS)  # trained by sb3-contrib
# CPU time per env step relative to `none` (one core, hidden sizes at the defaults): orders the grid, slowest first
STEP_COST = {"none": 1.0, "efla": 2.1, "deltanet": 2.8, "gru": 5.0, "lstm": 6.2}
SB3_STEP_COST = 10.0
# the first thing a new user runs: memory against no memory inside and beyond the window, at a short budget
QUICK = {"tasks": ("rlseq/RepeatPreviousLag2-v0", "rlseq/RepeatPreviousLag8-v0", "popgym-RepeatFirstEasy-v0"),
         "variants": ("efla", "gru", "none"), "seeds": (0,), "steps": DEFAULT_STEPS}
DEFAULT_OUT = "runs/memory_benchmark"  # the published report is --out docs/memory_benchmark
QUICK_OUT = "runs/memory_benchmark_quick"
CHECKPOINTS_PER_RUN = 10  # resume granularity
EVAL_ENVS = 16


def variants() -> list[str]:
    """rlseq's memories, their no-window controls (``<memory>-conv1``), then the sb3-contrib anchors."""
    from rlseq.policies.memory import MEMORIES

    return [*MEMORIES, *(m + NO_WINDOW for m in MEMORIES), *ANCHORS, *DROP_INS]


# imported only at a run's end (its evaluation reads the learning curve from the TensorBoard events) and by the
# report; checked before anything trains, so that a grid on a host without them does not train for hours and then
# fail every run at its evaluation
EVALUATION_MODULES = ("tbparse",)
REPORT_MODULES = ("rliable", "matplotlib")
DEFAULT_VARIANTS = ("efla", "deltanet", "gru", "lstm", "none", "efla-conv1", "none-conv1", "sb3-lstm",
                    "sb3-lstm-shared", "sb3-efla")


@dataclass(frozen=True)
class BenchRun:
    """One cell of the grid."""

    task: str
    variant: str
    seed: int
    steps: int

    @property
    def cost(self) -> float:
        """Rough CPU time of the run in units of a ``none`` run's step (measured on one core at the defaults)."""
        memory, algo, _, _ = self._train_settings()
        return self.steps * (SB3_STEP_COST if algo == "sb3-recurrent-ppo" else STEP_COST.get(memory, 2.0))

    @property
    def name(self) -> str:
        return f"{self.task}/{self.variant}/seed{self.seed}"

    def folder(self, logdir: str | Path) -> Path:
        """The run folder ``python -m rlseq.train`` writes for this run."""
        from rlseq.train import run_dir

        memory, algo, _, tag = self._train_settings()
        return run_dir(logdir, {"env": self.task, "memory": memory, "algo": algo, "seed": self.seed, "tag": tag})

    def train_argv(self, logdir: str | Path, *, device: str, extra: list[str] = ()) -> list[str]:
        memory, algo, flags, tag = self._train_settings()
        return ["--env", self.task, "--memory", memory, "--algo", algo, "--seed", str(self.seed),
                "--logdir", str(logdir), "--total-steps", str(self.steps),
                "--checkpoint-every", str(max(1, self.steps // CHECKPOINTS_PER_RUN)), "--device", device,
                *flags, *(["--tag", tag] if tag else []), *extra, "--resume"]

    def _train_settings(self) -> tuple[str, str, list[str], str | None]:
        """(memory, algo, extra train flags, tag) of the variant."""
        if self.variant in ANCHORS:
            return "lstm", "sb3-recurrent-ppo", ANCHORS[self.variant], ("shared" if ANCHORS[self.variant] else None)
        if self.variant in DROP_INS:
            return DROP_INS[self.variant], "sb3-recurrent-ppo", [], None
        if self.variant.endswith(NO_WINDOW):
            return self.variant[: -len(NO_WINDOW)], "rlseq", ["--conv-size", "1"], NO_WINDOW[1:]
        return self.variant, "rlseq", [], None


def build_grid(tasks: list[str], variant_names: list[str], seeds: list[int], steps: dict[str, int]) -> list[BenchRun]:
    """Seed-major, so that a grid cut short has every task and variant at the seeds it reached."""
    return [BenchRun(t, v, int(s), int(steps[t])) for s in seeds for t in tasks for v in variant_names]


def commit_conflicts(runs: list[BenchRun], out: Path, commit: str) -> list[str]:
    """Results in ``out`` of the tasks of ``runs`` made at another rlseq commit than ``commit``: a table's rows
    must come from one commit."""
    tasks = {r.task for r in runs}
    bad = []
    root = out / "results"
    for task in sorted(tasks):
        for path in sorted((root / task).rglob("seed*.json")) if (root / task).is_dir() else []:
            if path.name.endswith(".failed.json"):
                continue
            had = (read_result(path).get("versions") or {}).get("rlseq", "unknown")
            if had != commit:
                bad.append(f"{path}: made at {had}")
    return bad


RESULT_FIELDS = ("task", "variant", "seed", "steps")  # what a result file must hold to be merged


def read_result(path: Path, stopped: str = "nothing was run") -> dict[str, Any]:
    """A result file's contents; an unreadable one, or one without :data:`RESULT_FIELDS`, stops the program with
    an error that names it and ends with ``stopped`` (what did not happen)."""
    doc = read_json(path, "result file", stopped)
    missing = [k for k in RESULT_FIELDS if k not in doc] if isinstance(doc, dict) else list(RESULT_FIELDS)
    if missing:
        raise SystemExit(f"error: {path} lacks {', '.join(missing)}: not a result file of this benchmark; {stopped}")
    return doc


def _finished_results(root: Path, stopped: str = "nothing was merged") -> list[tuple[Path, dict[str, Any]]]:
    """Every finished run's result file under ``root/results`` with its contents (failure records left out),
    read by :func:`read_result`."""
    return [(path, read_result(path, stopped)) for path in sorted((root / "results").rglob("seed*.json"))
            if not path.name.endswith(".failed.json")]


def _invocation_key(inv: dict[str, Any]) -> tuple[Any, ...]:
    """One invocation is one start on one machine."""
    return inv.get("command"), inv.get("started"), inv.get("cpu")


def merge(out: Path, sources: list[Path]) -> dict[str, Any]:
    """Add the finished runs of other results folders of the same grid (another machine's ``--out``) to ``out``:
    each run's result and curve, each task's chance level where ``out`` has none, and the invocations that made
    them (appended to ``out``'s manifest; one already there gets the fields it lacks, such as the wall time of a
    start that ended elsewhere). A run ``out`` has already keeps its result; a run in two sources must have the same
    result in both; a failure record in ``out`` of a run merged in is removed, as a finished run removes its own.

    Refused, with nothing written, when a task of the merged runs would then hold results or invocations of more
    than one env-step budget, or results of more than one rlseq commit, or a variant's results of more than one
    training setting (:func:`settings_digest`, where they record it); when a source is ``out`` itself or has no
    results folder; or when a result file is unreadable. Not while a benchmark writes to ``out``: both rewrite its
    manifest. Returns ``{"merged": [names], "kept": [names], "invocations": n, "updated": n, "no_manifest":
    [sources]}``."""
    from rlseq.checkpoint import write_text_atomic

    incoming: dict[str, tuple[Path, dict[str, Any]]] = {}
    kept: list[str] = []
    differ: list[str] = []
    for src in sources:
        if src.resolve() == out.resolve():
            raise SystemExit(f"error: --merge {src} is --out itself")
        if not (src / "results").is_dir():
            raise SystemExit(f"error: --merge {src}: no results folder there ({src / 'results'}); nothing was merged")
    source_tasks: dict[Path, set[str]] = {}
    for src in sources:
        for path, doc in _finished_results(src):
            source_tasks.setdefault(src, set()).add(doc["task"])
            name = f"{doc['task']}/{doc['variant']}/seed{doc['seed']}"
            if run_paths(out, doc["task"], doc["variant"], doc["seed"])["result"].exists():
                kept.append(name)
            elif name in incoming:
                if incoming[name][1] != doc:
                    differ.append(f"{name}: {incoming[name][0]} and {path}")
            else:
                incoming[name] = (path, doc)
    if differ:
        raise SystemExit(f"error: {len(differ)} run(s) have different results in two of the folders to merge; keep "
                         f"one of each (remove the other) and merge again; nothing was merged:\n  {listed(differ)}")
    tasks = {doc["task"] for _, doc in incoming.values()}
    manifests = {src: read_manifest(src) for src in sources}
    # task -> "commit" or "steps" -> value -> where it was seen
    seen: dict[str, dict[str, dict[Any, str]]] = {t: {"commit": {}, "steps": {}} for t in tasks}
    for path, doc in [*_finished_results(out), *incoming.values()]:
        if doc["task"] in tasks:
            by = seen[doc["task"]]
            by["commit"].setdefault((doc.get("versions") or {}).get("rlseq", "unknown"), str(path))
            by["steps"].setdefault(int(doc["steps"]), str(path))
            if "settings" in doc:  # per variant: the variants' settings differ (their learning rates, say)
                key = f"{doc['task']}/{doc['variant']}"
                seen.setdefault(key, {"settings": {}})["settings"].setdefault(doc["settings"], str(path))
    for folder, manifest in [(out, read_manifest(out)), *manifests.items()]:
        for inv in manifest["invocations"]:
            for task, steps in (inv.get("grid") or {}).get("steps", {}).items():
                if task in tasks:
                    seen[task]["steps"].setdefault(int(steps), f"{folder / MANIFEST}, started {inv.get('started')}")
    label = {"commit": "commits", "steps": "budgets", "settings": "settings"}
    mixed = [f"{task}: {label[what]} {', '.join(f'{v} ({where})' for v, where in values.items())}"
             for task, by in sorted(seen.items()) for what, values in by.items() if len(values) > 1]
    if mixed:
        raise SystemExit(f"error: merging would mix rlseq commits, env-step budgets or training settings in "
                         f"{len(mixed)} task(s) or variant(s), and a table's rows come from one commit and one budget, "
                         f"and each variant's from one setting; nothing was merged:\n  {listed(mixed)}")
    chance: dict[str, Any] = {}  # task -> the first source's chance level, read before anything is written
    for src in sources:
        for task in sorted(source_tasks.get(src, ())):
            if task not in chance and random_path(src, task).exists() and not random_path(out, task).exists():
                chance[task] = read_json(random_path(src, task), "chance-level file", "nothing was merged")
    for path, doc in incoming.values():
        paths = run_paths(out, doc["task"], doc["variant"], doc["seed"])
        curve = path.with_suffix(".csv")
        if curve.exists():
            paths["curve"].parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(paths["curve"], curve.read_text())
        _write_json(paths["result"], doc)  # last: its presence marks the run finished
        paths["failed"].unlink(missing_ok=True)
    for task, doc in chance.items():
        _write_json(random_path(out, task), doc)
    manifest = read_manifest(out)
    ours = {_invocation_key(inv): inv for inv in manifest["invocations"]}
    added = updated = 0
    for src in sources:
        for inv in manifests[src]["invocations"]:
            had = ours.get(_invocation_key(inv))
            if had is None:
                manifest["invocations"].append(inv)
                ours[_invocation_key(inv)] = inv
                added += 1
            elif any(had.get(k) is None and v is not None for k, v in inv.items()):
                had.update({k: v for k, v in inv.items() if had.get(k) is None and v is not None})
                updated += 1
    if added or updated:
        _write_json(out / MANIFEST, manifest)
    return {"merged": sorted(incoming), "kept": sorted(kept), "invocations": added, "updated": updated,
            "no_manifest": [str(src) for src in sources if not (src / MANIFEST).exists()]}


def listed(lines: list[str], most: int = 8) -> str:
    """The first ``most`` of ``lines``, each on a line of its own after two spaces, and how many more there are."""
    return "\n  ".join(lines[:most]) + (f"\n  (+{len(lines) - most} more)" if len(lines) > most else "")


def commit_marker(folder: Path) -> Path:
    """The file beside a run folder that names the rlseq commit its training started at."""
    return folder.with_name(folder.name + ".rlseq-commit")


def folder_conflicts(runs: list[BenchRun], logdir: Path, commit: str) -> list[str]:
    """Run folders of ``runs`` (started, not yet evaluated) whose training began at another rlseq commit than
    ``commit``, or at one not recorded: resuming or evaluating them would stamp ``commit`` on a model that
    other code trained."""
    bad = []
    for run in runs:
        folder = run.folder(logdir)
        if folder.exists():
            marker = commit_marker(folder)
            had = marker.read_text().strip() if marker.exists() else None
            if had != commit:
                bad.append(f"{folder}: started at {had or 'a commit not recorded'}")
    return bad


def is_done(run: BenchRun, out: Path) -> bool:
    return run_paths(out, run.task, run.variant, run.seed)["result"].exists()


# the trainer's progress line in train.log (rlseq.callbacks.Progress, every 30 s): "12,288/500,000 env steps (2%), ..."
_PROGRESS_LINE = re.compile(r"^(\d[\d,]*)/[\d,]+ env steps \(", re.MULTILINE)
_LOG_TAIL_BYTES = 65_536


def logged_steps(folder: Path, since: float) -> int:
    """The env steps of the last progress line of the trainer writing ``folder``'s train.log, if the log was
    written at or after ``since`` (a ``time.time()``); else 0. Each trainer's output starts after a ``=== `` line
    (rlseq.sweep._train_once), so the lines of a stopped trainer, whose steps past its checkpoint a restart does
    not keep, are not counted."""
    log = folder / "train.log"
    try:
        if log.stat().st_mtime < since:
            return 0
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return 0
    found = _PROGRESS_LINE.findall(text, text.rfind("\n=== ") + 1)
    return int(found[-1].replace(",", "")) if found else 0


def trained_steps(run: BenchRun, logdir: Path, *, since: float | None = None) -> int:
    """Env steps the run has behind it: its budget when finished, else its newest checkpoint's (what a resume
    keeps). With ``since``, the newer of that and of the last progress line of a trainer whose log was written at
    or after ``since`` (checkpoints come ten to a run; the lines, every 30 s, keep a grid's progress bar and rate
    current)."""
    from rlseq.checkpoint import latest_checkpoint

    folder = run.folder(logdir)
    if (folder / "final_model.zip").exists():
        return run.steps
    ckpt = latest_checkpoint(folder / "checkpoints")
    steps = int(ckpt.name[len("step"):]) if ckpt is not None else 0
    return min(run.steps, max(steps, logged_steps(folder, since)) if since is not None else steps)


def budget_conflicts(runs: list[BenchRun], out: Path, logdir: Path) -> list[str]:
    """Runs whose existing result or run folder was made with another env-step budget."""
    import yaml

    bad = []
    for r in runs:
        result = run_paths(out, r.task, r.variant, r.seed)["result"]
        if result.exists():
            had = int(read_result(result)["steps"])
            if had != r.steps:
                bad.append(f"{r.name}: result of {had:,} steps in {result}")
            continue
        cfg = r.folder(logdir) / "config.yaml"
        if cfg.exists():
            had = int((yaml.safe_load(cfg.read_text()) or {}).get("n_timesteps", r.steps))
            if had != r.steps:
                bad.append(f"{r.name}: run folder of {had:,} steps in {cfg.parent}")
    return bad


def settings_digest(cfg: dict[str, Any]) -> str:
    """How a run trains, as the first 12 hex digits of the SHA-1 of its resolved training config without what does
    not change what it learns (what ``--resume`` lets change: ``rlseq.resume.RESUME_FREE_KEYS``, budget,
    checkpoints, device, threads, speed settings, and procgen's worker threads) and without its seed and tag: the
    same for every seed of one variant in one grid, and another for an ablation (``--config``) or other PPO
    flags."""
    import hashlib

    from rlseq.resume import RESUME_FREE_KEYS, _comparable

    kept = {k: _comparable(k, v) for k, v in cfg.items() if k not in RESUME_FREE_KEYS and k not in SETTINGS_FREE_KEYS}
    return hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:12]


def planned_settings(run: BenchRun, extra: list[str]) -> str:
    """:func:`settings_digest` of the config ``run`` will train with, resolved as ``rlseq.train`` resolves it."""
    from rlseq.config import UsageError, resolve
    from rlseq.train import build_parser

    try:
        return settings_digest(resolve(build_parser().parse_args(run.train_argv("runs", device="cpu", extra=extra))))
    except UsageError as e:  # a bad --config: the same error its training would stop at
        raise SystemExit(f"error: {run.name}: {e}") from None


def settings_conflicts(runs: list[BenchRun], out: Path, extra: list[str]) -> list[str]:
    """(task, variant) pairs of ``runs`` whose results in ``out`` were made with other settings than these runs
    would train with (:func:`settings_digest`; results recorded without one are not compared)."""
    recorded: dict[tuple[str, str], dict[str, str]] = {}
    for path, doc in _finished_results(out, "nothing was run"):
        if "settings" in doc:
            recorded.setdefault((doc["task"], doc["variant"]), {}).setdefault(doc["settings"], str(path))
    bad = []
    for run in {(r.task, r.variant): r for r in runs}.values():
        had = recorded.get((run.task, run.variant))
        if had:
            ours = planned_settings(run, extra)
            if set(had) != {ours}:
                bad.append(f"{run.task}/{run.variant}: results made with settings "
                           f"{', '.join(f'{k} ({where})' for k, where in had.items())}; these runs: {ours}")
    return bad


# ------------------------------------------------------------------------------------------------ environment
def versions() -> dict[str, str]:
    """Python, the libraries a result depends on, and rlseq's git commit (``+dirty``: rlseq/ or configs/ had
    uncommitted changes; ``$RLSEQ_COMMIT`` when set, for a copy of the tree whose git folder is not its own)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("torch", "stable-baselines3", "sb3-contrib", "gymnasium", "popgym"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "absent"
    if os.environ.get("RLSEQ_COMMIT"):  # a copy of the tree whose git folder is not its own (a GPU host)
        out["rlseq"] = os.environ["RLSEQ_COMMIT"]
        return out
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "rlseq", "configs"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
        out["rlseq"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        out["rlseq"] = "unknown"
    return out


def chance_level(task: str, episodes: int, seed: int = 0) -> dict[str, Any]:
    """Mean and std of the return of uniformly random actions over ``episodes`` episodes."""
    import gymnasium as gym
    import numpy as np

    from rlseq.envs.gym import resolve_env_id

    resolve_env_id(task)  # imports what registers the id
    env = gym.make(task)
    env.action_space.seed(seed)
    returns = []
    for i in range(episodes):
        env.reset(seed=seed * 100_000 + i)
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    env.close()
    r = np.asarray(returns)
    return {"task": task, "policy": "uniformly random actions", "episodes": episodes, "seed": seed,
            "mean": float(r.mean()), "std": float(r.std(ddof=1)) if len(r) > 1 else float("nan")}


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that are not installed here (looked up without importing them)."""
    import importlib.util

    return [name for name in names if importlib.util.find_spec(name) is None]


def check_tasks(tasks: list[str]) -> None:
    """Refuse unknown ids before anything runs, with the closest registered ids (the train CLI's resolution)."""
    from rlseq.envs.gym import resolve_env_id

    for task in tasks:
        try:
            resolve_env_id(task)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    from rlseq.checkpoint import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------------- worker
_IN_RUN = False  # a worker's: whether run_one is running
_STOPPING = False  # a worker's: it was told to stop, so a run the pool had already queued for it does not start


def _on_stop(signum: int, frame: Any) -> None:
    # in a run, rlseq.sweep._train_once passes the interrupt on to the trainer; an idle worker (waiting for its
    # next run) has nothing to save and leaves quietly instead of printing a KeyboardInterrupt traceback
    global _STOPPING
    _STOPPING = True
    if _IN_RUN:
        raise KeyboardInterrupt
    raise SystemExit(0)


def _init_worker(parent: int) -> None:
    # the main process decides when to stop and sends its workers SIGTERM, which they pass on to their trainers (each
    # trainer in a session of its own, out of reach of a terminal's Ctrl-C)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_stop)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if sys.platform == "linux":
        _stop_with_parent(parent)


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train (unless finished), evaluate and write one run's result; returns ``{"name", "state", ...}`` with
    state ``done``, ``failed`` (with ``reason`` and ``log_tail``) or ``stopped``. Runs in a worker process."""
    global _IN_RUN
    if _STOPPING:
        return {"name": spec["name"], "state": "stopped"}
    _IN_RUN = True
    try:
        return _run_one(spec)
    finally:
        _IN_RUN = False


def _run_one(spec: dict[str, Any]) -> dict[str, Any]:
    folder, paths = Path(spec["folder"]), {k: Path(v) for k, v in spec["paths"].items()}
    resumed = folder.exists()
    train_wall = None
    if not resumed:
        commit_marker(folder).parent.mkdir(parents=True, exist_ok=True)
        commit_marker(folder).write_text(f"{(spec['versions'] or {}).get('rlseq', 'unknown')}\n")
    try:
        if not (folder / "final_model.zip").exists():
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            if spec["device"] == "cpu":
                env["CUDA_VISIBLE_DEVICES"] = ""
            t0 = time.time()
            rc, stopped = _train_once([sys.executable, "-m", "rlseq.train", *spec["argv"]], env, None, folder)
            train_wall = time.time() - t0
            if stopped or rc in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # the trainer's exit when stopped
                return {"name": spec["name"], "state": "stopped"}
            if rc != 0:
                return _failed(spec, paths, f"training exited with code {rc}", log_tail(folder / "train.log", 20))
        try:
            return _evaluate(spec, folder, paths, train_wall=train_wall, resumed=resumed)
        except Exception as e:  # noqa: BLE001  (any error of one run is that run's result, not the benchmark's)
            import traceback

            return _failed(spec, paths, f"evaluation failed: {type(e).__name__}: {e}",
                           traceback.format_exc().splitlines()[-20:])
    except KeyboardInterrupt:  # stopped between two steps: what is written stays, the next invocation goes on
        return {"name": spec["name"], "state": "stopped"}


def _failed(spec: dict[str, Any], paths: dict[str, Path], reason: str, tail: list[str]) -> dict[str, Any]:
    doc = {"name": spec["name"], "task": spec["task"], "variant": spec["variant"], "seed": spec["seed"],
           "steps": spec["steps"], "reason": reason, "log": str(Path(spec["folder"]) / "train.log"),
           "log_tail": tail, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write_json(paths["failed"], doc)
    return {**doc, "state": "failed"}


def _evaluate(spec: dict[str, Any], folder: Path, paths: dict[str, Path], *, train_wall: float | None,
              resumed: bool) -> dict[str, Any]:
    import torch
    import yaml

    from rlseq.checkpoint import write_text_atomic
    from rlseq.evaluate import evaluate

    torch.set_num_threads(1)
    t0 = time.time()
    ev, greedy = (evaluate(folder, spec["episodes"], n_envs=min(EVAL_ENVS, spec["episodes"]), progress=False,
                           device=spec["device"], deterministic=deterministic) for deterministic in (False, True))
    eval_wall = time.time() - t0
    curve, speed = curve_and_speed(folder)
    cfg = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    doc = {"name": spec["name"], "task": spec["task"], "variant": spec["variant"], "seed": spec["seed"],
           "steps": spec["steps"], "episodes": int(ev["episodes"]), "eval_mean": ev["mean"], "eval_std": ev["std"],
           "eval_min": ev["min"], "eval_max": ev["max"], "eval_greedy_mean": greedy["mean"],
           "eval_greedy_std": greedy["std"], "env_steps_per_s": speed, "train_wall_s": train_wall,
           "eval_wall_s": eval_wall, "resumed": resumed, "run_folder": str(folder),
           "config": {k: cfg.get(k) for k in ("algo", "n_envs", "n_steps", "n_minibatches", "n_epochs",
                                               "learning_rate", "gamma", "ent_coef")},
           "settings": settings_digest(cfg), "versions": spec["versions"], "cpu": cpu_model(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    paths["curve"].parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(paths["curve"], curve.to_csv(index=False))
    _write_json(paths["result"], doc)  # last: its presence marks the run finished
    paths["failed"].unlink(missing_ok=True)
    return {**doc, "state": "done"}


def curve_and_speed(folder: Path):
    """The run's ``rollout/ep_rew_mean`` curve (DataFrame step, ep_rew_mean) and its training env-steps/s: env
    steps between each event file's first and last logged rollout over the wall time between them, summed over
    the files of a resumed run (the same measure for every algorithm; start-up excluded)."""
    import pandas as pd

    from rlseq.compare import DEFAULT_METRIC, _merge_resumed, _read_event_file

    frames = [_read_event_file(f) for f in sorted(folder.glob("events.out.tfevents.*"))]
    steps = seconds = 0.0
    for f in frames:
        t = f.groupby("step")["wall_time"].max().sort_index()
        if len(t) > 1:
            steps, seconds = steps + float(t.index[-1] - t.index[0]), seconds + float(t.iloc[-1] - t.iloc[0])
    merged = _merge_resumed(frames)
    c = merged[merged["tag"] == DEFAULT_METRIC]
    curve = pd.DataFrame({"step": c["step"].astype("int64"), "ep_rew_mean": c["value"]}).reset_index(drop=True)
    return curve, (steps / seconds if seconds > 0 else None)


# ------------------------------------------------------------------------------------------------------- grid
def schedule(runs: list[BenchRun]) -> list[BenchRun]:
    """The order runs start in: seed-major, so that a grid cut short has whole seeds; within a seed the slowest
    first (the sb3-contrib runs, then by memory and budget), so that they do not end the grid alone."""
    return sorted(runs, key=lambda r: (r.seed, -r.cost, r.name))


class StopSignals(list):
    """The stop signals the grid's main process has received, in order; a handler for ``signal.signal``. The first
    one's repeat within :data:`REPEAT_S` is not counted: `timeout` signals its child and then the child's whole
    process group, so one stop can arrive twice within microseconds, and a second signal kills the trainers."""

    def __init__(self) -> None:
        super().__init__()
        self._first_at = 0.0

    def __call__(self, signum: int, _frame: Any = None) -> None:
        now = time.monotonic()
        if len(self) == 1 and signum == self[0] and now - self._first_at < REPEAT_S:
            return
        if not self:
            self._first_at = now
        self.append(signum)


def execute(runs: list[BenchRun], out: Path, logdir: Path, *, jobs: int, episodes: int, device: str,
            extra: list[str], poll_s: float = 2.0) -> dict[str, list[dict[str, Any]]]:
    """Run every run of ``runs`` that has no result on ``jobs`` workers, with a progress bar over the grid's env
    steps. Returns the workers' answers by state (``done``, ``failed``, ``stopped``)."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from tqdm.auto import tqdm

    todo = schedule([r for r in runs if not is_done(r, out)])
    answers: dict[str, list[dict[str, Any]]] = {"done": [], "failed": [], "stopped": []}
    if not todo:
        return answers
    ver = versions()
    specs = {r: {"name": r.name, "task": r.task, "variant": r.variant, "seed": r.seed, "steps": r.steps,
                 "folder": str(r.folder(logdir)), "argv": r.train_argv(logdir, device=device, extra=extra),
                 "paths": {k: str(v) for k, v in run_paths(out, r.task, r.variant, r.seed).items()},
                 "episodes": episodes, "device": device, "versions": ver} for r in todo}
    finished = {r for r in runs if r not in specs}
    started = time.time()  # train.logs written from here on are this grid's trainers'

    def progress() -> int:
        return sum(r.steps if r in finished else trained_steps(r, logdir, since=started) for r in runs)

    # weighted by env steps: a run's share of the ETA is its budget
    bar = tqdm(total=sum(r.steps for r in runs), initial=progress(), unit="step", unit_scale=True, smoothing=0,
               desc=f"{len(todo)} runs on {jobs} jobs", dynamic_ncols=True)
    ctx = mp.get_context("spawn")  # no fork of a process that may hold torch's threads
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=ctx, initializer=_init_worker,
                               initargs=(os.getpid(),))
    futures = {pool.submit(run_one, specs[r]): r for r in todo}
    pending = set(futures)
    # SIGINT and SIGTERM set a flag that the loop reads: an exception raised from a signal handler can land inside
    # the executor's own locking and leave it broken ("release unlocked lock") instead of stopping the grid
    stop = StopSignals()
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while pending and not stop:
            done, pending = wait(pending, timeout=poll_s, return_when=FIRST_COMPLETED)
            for fut in done:
                _collect(fut, futures[fut], answers, finished, bar)
            bar.n = progress()
            bar.set_postfix_str(f"{len(answers['done'])} done, {len(answers['failed'])} failed", refresh=False)
            bar.refresh()
        if stop:
            bar.write(f"stopping ({signal.Signals(stop[0]).name}): the running trainers keep their last checkpoint; "
                      "the same command resumes them (a second signal kills them)")
            for fut in pending:
                fut.cancel()
            for proc in ctx.active_children():
                proc.terminate()  # the worker passes it on to its trainer as SIGTERM
            pending = {f for f in pending if not f.cancelled()}
            while pending:
                done, pending = wait(pending, timeout=poll_s)
                for fut in done:
                    _collect(fut, futures[fut], answers, finished, bar, stopping=True)
                if len(stop) > 1:  # someone is done waiting for the stop checkpoints
                    _kill_tree(ctx.active_children())
                    break
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # before the handlers go back: a signal now only adds to stop
        for s, h in old.items():
            signal.signal(s, h)
        bar.close()
    return answers


def _kill_tree(workers: list[Any]) -> None:
    """SIGKILL the workers and the trainers they started (each trainer's last checkpoint is what remains)."""
    from rlseq.reaper import descendants

    for proc in workers:
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _collect(fut: Any, run: BenchRun, answers: dict[str, list[dict[str, Any]]], finished: set[BenchRun],
             bar: Any, *, stopping: bool = False) -> None:
    """Record a finished future's answer. ``stopping``: the grid is being stopped, and a worker that died meanwhile
    leaves its run to resume: an idle worker's exit on the stop breaks the whole pool, whose running futures then
    end in ``BrokenProcessPool`` while their trainers save their stop checkpoints."""
    try:
        answer = fut.result()
    except Exception as e:  # noqa: BLE001  (a worker process that died: that run failed, the others go on)
        answer = ({"name": run.name, "state": "stopped"} if stopping else
                  {"name": run.name, "state": "failed", "reason": f"worker died: {type(e).__name__}: {e}",
                   "log_tail": []})
    answers[answer["state"]].append(answer)
    if answer["state"] == "done":
        finished.add(run)
        bar.write(f"done   {run.name}: return {answer['eval_mean']:.3f} over {answer['episodes']} episodes "
                  f"(greedy actions: {answer['eval_greedy_mean']:.3f})")
    elif answer["state"] == "failed":
        tail = "\n".join(f"    | {line}" for line in answer.get("log_tail", [])[-12:])
        bar.write(f"FAILED {run.name}: {answer['reason']}" + (f"\n  end of {answer['log']}:\n{tail}"
                                                               if answer.get("log") else f"\n{tail}"))


# -------------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--tasks", nargs="+", default=None, metavar="ID",
                        help=f"gymnasium ids (default: the {len(TASKS)} tasks: "
                             f"{', '.join(short_task(t) for t in TASKS)})")
    parser.add_argument("--variants", nargs="+", default=None, metavar="VARIANT",
                        help="rlseq memories (efla, deltanet, gru, lstm, none), each also as <memory>-conv1 (the "
                             "same block without the convolution's window: the control for what the window alone "
                             f"explains), and sb3-contrib RecurrentPPO's own LSTM: {', '.join(ANCHORS)} (its "
                             f"defaults; one LSTM shared by actor and critic), and rlseq's EFLA block inside it: "
                             f"{', '.join(DROP_INS)}; default: {' '.join(DEFAULT_VARIANTS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help=f"default: {' '.join(map(str, SEEDS))}")
    parser.add_argument("--steps", type=_count, default=None,
                        help=f"env steps of every run (default: {DEFAULT_STEPS:,} per task"
                             + (", more where TASK_STEPS says" if TASK_STEPS else "") + ")")
    parser.add_argument("--episodes", type=int, default=None, help=f"evaluation episodes per run (default {EPISODES})")
    parser.add_argument("--jobs", type=int, default=None, help="runs side by side, one core each (default: the cores)")
    parser.add_argument("--out", default=None,
                        help=f"results folder; the report is <out>.md (default {DEFAULT_OUT}, with --quick "
                             f"{QUICK_OUT})")
    parser.add_argument("--logdir", default=None,
                        help="run folders (event files, checkpoints, models; not for committing); default "
                             "runs/<out's name>")
    parser.add_argument("--quick", action="store_true",
                        help=f"a slice: {', '.join(short_task(t) for t in QUICK['tasks'])}; "
                             f"{', '.join(QUICK['variants'])}; seeds {', '.join(map(str, QUICK['seeds']))}; "
                             f"{QUICK['steps']:,} steps (flags given win): memory inside and beyond the window, a few "
                             "about 3.3 minutes on 2 cores (README.md)")
    parser.add_argument("--report-only", action="store_true", help="rewrite <out>.md and <out>/curves.png from "
                                                                   "<out>/results and exit")
    parser.add_argument("--dry-run", action="store_true", help="print each run's state and training command, and exit")
    parser.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                        help="add the finished runs of other results folders of this grid (another machine's "
                             "--out) to --out, with the invocations that made them, rewrite the report and exit; a "
                             "run --out has already keeps its result; refused when a task would mix commits or "
                             "budgets, or a variant's results training settings")
    parser.add_argument("--device", default="cpu", help="device of training and evaluation (default cpu)")
    for flag in ("n-envs", "n-steps", "n-minibatches"):
        parser.add_argument(f"--{flag}", type=int, default=None,
                            help="PPO setting of every run (default: configs/popgym.yml's; for smoke tests)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="a partial training config for every run (as train --config: its entries override "
                             "configs/popgym.yml's key by key), e.g. an ablation's learning_rate or memory_kwargs; "
                             "its contents are recorded with the invocation. Give each ablation its own --out")


def _count(text: str) -> int:
    """``100000``, ``1e5`` or ``100_000``."""
    value = int(float(text.replace("_", "")))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def resolve_grid(args: argparse.Namespace) -> dict[str, Any]:
    """The grid and settings of ``args`` (``--quick`` fills what the flags leave open)."""
    quick = args.quick
    tasks = list(args.tasks or (QUICK["tasks"] if quick else TASKS))
    known = variants()
    wanted = list(args.variants or (QUICK["variants"] if quick else DEFAULT_VARIANTS))
    unknown = [v for v in wanted if v not in known]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    steps = {t: args.steps or (QUICK["steps"] if quick else TASK_STEPS.get(t, DEFAULT_STEPS)) for t in tasks}
    out = Path(args.out or (QUICK_OUT if quick else DEFAULT_OUT))
    extra = [x for flag in PPO_FLAGS if getattr(args, flag) is not None
             for x in (f"--{flag.replace('_', '-')}", str(getattr(args, flag)))]
    if getattr(args, "config", None):
        if not Path(args.config).is_file():
            raise SystemExit(f"error: --config {args.config}: no such file")
        extra += ["--config", str(Path(args.config).resolve())]
    return {"tasks": tasks, "variants": wanted, "seeds": list(args.seeds or (QUICK["seeds"] if quick else SEEDS)),
            "steps": steps, "episodes": args.episodes or EPISODES, "jobs": args.jobs or os.cpu_count() or 1,
            "out": out, "logdir": Path(args.logdir or Path("runs") / out.name), "extra": extra}


def command(args: argparse.Namespace, g: dict[str, Any]) -> str:
    """The command line of this invocation, with what it decided written out (jobs, out, logdir)."""
    parts = ["python -m rlseq.bench memory"] + (["--quick"] if args.quick else [])
    for flag in ("tasks", "variants", "seeds"):
        if getattr(args, flag):
            parts.append(f"--{flag} " + " ".join(map(str, getattr(args, flag))))
    for flag in ("steps", "episodes", "n_envs", "n_steps", "n_minibatches", "config"):
        if getattr(args, flag, None) is not None:
            parts.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}")
    parts += [f"--jobs {g['jobs']}", f"--out {g['out'].as_posix()}", f"--logdir {g['logdir'].as_posix()}"]
    if args.device != "cpu":
        parts.append(f"--device {args.device}")
    return " ".join(parts)


def _record_invocation(out: Path, entry: dict[str, Any], index: int | None = None) -> int:
    """Append ``entry`` to ``out``'s manifest, or update invocation ``index`` with it; returns its index."""
    manifest = read_manifest(out)
    invocations = manifest["invocations"]
    if index is None:
        invocations.append(entry)
    else:
        invocations[index].update(entry)
    _write_json(out / MANIFEST, manifest)
    return len(invocations) - 1 if index is None else index


def main(args: argparse.Namespace) -> None:
    g = resolve_grid(args)
    out, logdir = g["out"], g["logdir"]
    if args.merge:
        given = [f"--{k.replace('_', '-')}" for k in ("tasks", "variants", "seeds", "steps", "episodes", "jobs",
                                                      "logdir", "quick", "dry_run", "report_only", "config", *PPO_FLAGS)
                 if getattr(args, k, None)]
        if given:
            raise SystemExit(f"error: --merge takes the folders to merge and --out alone, not {', '.join(given)}")
        done = merge(out, [Path(d) for d in args.merge])
        print(f"merged {len(done['merged'])} run(s) into {out}, and {done['invocations']} invocation(s)"
              + (f" ({done['updated']} more completed)" if done["updated"] else "")
              + (f"; {len(done['kept'])} run(s) already there kept their result" if done["kept"] else ""))
        for src in done["no_manifest"]:
            print(f"note: {src} has no {MANIFEST}, so how its runs were made is not recorded in {out / MANIFEST}")
        if not (done["merged"] or done["invocations"] or done["updated"]):
            return
    if args.report_only or args.merge:
        if args.merge and missing_modules(REPORT_MODULES):
            print(f"the report needs {', '.join(missing_modules(REPORT_MODULES))}: write it with --report-only "
                  f"--out {out} where they are installed")
            return
        try:
            print(f"wrote {write_report(out)}")
        except FileNotFoundError as e:
            raise SystemExit(f"error: {e}") from None
        return
    if g["jobs"] < 1 or g["episodes"] < 1:
        raise SystemExit("--jobs and --episodes must be >= 1")
    check_tasks(g["tasks"])
    runs = build_grid(g["tasks"], g["variants"], g["seeds"], g["steps"])
    conflicts = budget_conflicts(runs, out, logdir)
    if conflicts:
        raise SystemExit(f"error: {len(conflicts)} run(s) were made with another budget; choose another --out and "
                         f"--logdir, or remove them:\n  {listed(conflicts)}")
    mixed = settings_conflicts(runs, out, g["extra"])
    if mixed:
        raise SystemExit(f"error: {out} holds results made with other training settings (another --config or "
                         f"--n-envs, --n-steps, --n-minibatches) for {len(mixed)} task and variant pair(s), and a "
                         f"table's rows are to differ in the variant alone: choose another --out and --logdir, or "
                         f"give the same settings:\n  {listed(mixed)}")
    todo = [r for r in runs if not is_done(r, out)]
    if args.dry_run:
        for r in runs:
            state = "done" if r not in todo else f"at {trained_steps(r, logdir):,} steps"
            argv = r.train_argv(logdir, device=args.device, extra=g["extra"])
            print(f"{state:>16}  python -m rlseq.train {shlex.join(argv)}")
        return
    missing = missing_modules(EVALUATION_MODULES)
    if todo and missing:
        raise SystemExit(f"error: each run's evaluation needs {', '.join(missing)} (rlseq's dependencies), which "
                         f"is not installed here: pip install {' '.join(missing)}; nothing was trained")
    no_report = missing_modules(REPORT_MODULES)
    if no_report:
        print(f"the report needs {', '.join(no_report)}, not installed here: runs still train and are evaluated, "
              f"and the report is left to --report-only --out {out} on a machine that has them", flush=True)
    commit = versions()["rlseq"]
    stale = commit_conflicts(runs, out, commit)
    if stale:
        raise SystemExit(f"error: {len(stale)} result(s) of these tasks were made at another rlseq commit than this "
                         f"one ({commit}), and a table's rows come from one commit: choose another --out and "
                         f"--logdir, or remove them (or check out their commit):\n  {listed(stale)}")
    started = folder_conflicts(todo, logdir, commit)
    if started:
        raise SystemExit(f"error: {len(started)} run folder(s) began training at another rlseq commit than this one "
                         f"({commit}), or at one not recorded, and this commit would be stamped on their results: "
                         f"remove them or choose another --logdir (or check out their commit):\n  {listed(started)}")
    print(f"memory benchmark: {len(runs)} runs ({len(g['tasks'])} tasks x {len(g['variants'])} variants x "
          f"{len(g['seeds'])} seeds), {len(runs) - len(todo)} done already, {len(todo)} to run on {g['jobs']} jobs; "
          f"results in {out / 'results'}, run folders in {logdir}", flush=True)
    for task in g["tasks"]:
        if not random_path(out, task).exists():
            _write_json(random_path(out, task), chance_level(task, g["episodes"]))
    answers: dict[str, list[dict[str, Any]]] = {"failed": [], "stopped": []}
    if todo:
        t0 = time.time()
        index = _record_invocation(out, {
            "command": command(args, g), "started": time.strftime("%Y-%m-%d %H:%M"), "jobs": g["jobs"],
            "cpu": cpu_model(), "cores": os.cpu_count(), "wall_s": None, "runs": len(todo),
            "grid": {"tasks": g["tasks"], "variants": g["variants"], "seeds": g["seeds"], "steps": g["steps"],
                     "episodes": g["episodes"]},
            **({"config": Path(args.config).read_text()} if getattr(args, "config", None) else {})})
        try:
            answers = execute(runs, out, logdir, jobs=g["jobs"], episodes=g["episodes"], device=args.device,
                              extra=g["extra"])
        finally:
            _record_invocation(out, {"wall_s": time.time() - t0}, index)
    report = None
    if not no_report:
        try:
            report = write_report(out)
        except FileNotFoundError:
            print("no run finished yet: no report", flush=True)
    if report is not None:
        print(f"\nFinal evaluation return (IQM over seeds [95% CI]; POPGym returns lie in [-1, 1]):\n\n"
              f"{returns_table(out)}\n\nreport: {report}\ncurves: {out / CURVES_PNG}\n"
              f"TensorBoard: tensorboard --logdir {logdir}", flush=True)
    if answers["failed"]:
        names = "\n  ".join(a["name"] for a in answers["failed"])
        raise SystemExit(f"{len(answers['failed'])} run(s) failed (logs named above"
                         f"{'' if no_report else '; the report lists them'}):"
                         f"\n  {names}")
    if answers["stopped"]:
        raise SystemExit(f"{len(answers['stopped'])} run(s) stopped; the same command resumes them")
