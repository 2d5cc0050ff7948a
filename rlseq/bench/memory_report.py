"""Statistics and the markdown report of ``python -m rlseq.bench memory``, from its per-run result files alone.

Layout of an output folder OUT (written by :mod:`rlseq.bench.memory`; small enough to commit)::

    OUT/benchmark.json                                 every invocation: command, grid, jobs, machine, wall time
    OUT/results/<task>/random.json                     uniformly random actions: the chance level of the task
    OUT/results/<task>/<variant>/seed<S>.json          a finished run: final evaluation (sampled and greedy
                                                       actions), speed, config, versions, CPU
    OUT/results/<task>/<variant>/seed<S>.csv           its training curve: step, ep_rew_mean
    OUT/results/<task>/<variant>/seed<S>.failed.json   a run that failed, with the end of its log
    OUT/curves.png                                     the learning curves, written with the report
    OUT/notes.md                                       optional, hand-written reading of the table, appended
    OUT.md                                             the report (docs/memory_benchmark -> docs/memory_benchmark.md)

Statistics: per task and variant the IQM of the seeds' final evaluation returns with a 95% percentile
stratified-bootstrap CI (rliable, through :func:`rlseq.compare.summarize`), with sampled actions (the headline, as
the policy trains) and, where the results have them, greedy actions; env-steps/s as the median over runs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

MANIFEST = "benchmark.json"
RESULTS = "results"
CURVES_PNG = "curves.png"
HORIZON_PNG = "horizon.png"
REFERENCE = "efla"  # the memory the probability-of-improvement table compares with every other variant
FLAT_GAIN = 0.05  # a curve whose last 20% gains less than this has flattened (the budget check)
NOTES = "notes.md"  # optional, hand-written: appended to the report as it is
MEMORYLESS = "none"
# the fair block's checks (fair_block_checks): rlseq's recurrent baselines must be at or above sb3-contrib's LSTM
# anchors, and the reference memory at or above every one of these baselines and the anchors, on every task
RNN_BASELINES = ("gru", "lstm")
BASELINES = ("deltanet", *RNN_BASELINES)
REPS = 2000  # bootstrap resamples of each CI


def report_path(out: str | Path) -> Path:
    """The markdown report of ``out``: its sibling ``<out>.md``, so ``docs/memory_benchmark`` gives
    ``docs/memory_benchmark.md`` and the folder keeps only the data it is made from."""
    out = Path(out)
    return out.with_name(out.name + ".md")


def run_paths(out: str | Path, task: str, variant: str, seed: int) -> dict[str, Path]:
    """``{"result", "curve", "failed"}`` files of one run under ``out``."""
    base = Path(out) / RESULTS / task / variant / f"seed{seed}"
    return {"result": base.with_suffix(".json"), "curve": base.with_suffix(".csv"),
            "failed": base.with_name(base.name + ".failed.json")}


def random_path(out: str | Path, task: str) -> Path:
    return Path(out) / RESULTS / task / "random.json"


def short_task(task: str) -> str:
    """``popgym-RepeatPreviousEasy-v0`` -> ``RepeatPreviousEasy``, ``rlseq/RepeatPreviousLag8-v0`` ->
    ``RepeatPreviousLag8`` (table rows and panel titles)."""
    name = task.removeprefix("popgym-").removeprefix("rlseq/")
    head, sep, version = name.rpartition("-v")
    return head if sep and version.isdigit() else name


def read_json(path: Path, what: str, stopped: str) -> Any:
    """``path``'s JSON; an unreadable file stops the program with an error that names it as ``what`` and ends
    with ``stopped`` (what did not happen)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path} is not a readable {what} ({e}); {stopped}") from None


def read_manifest(out: str | Path) -> dict[str, Any]:
    path = Path(out) / MANIFEST
    return read_json(path, "benchmark manifest", "nothing was changed") if path.exists() else {"invocations": []}


def grid_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """The union of the invocations' grids: ``{"tasks": [...], "variants": [...], "steps": {task: steps}, "cells":
    {(task, variant, seed)}}``, tasks and variants in first-seen order (a later invocation's budget for a task
    wins)."""
    tasks: dict[str, None] = {}
    variants: dict[str, None] = {}
    steps: dict[str, int] = {}
    cells: set[tuple[str, str, int]] = set()
    for inv in manifest.get("invocations", []):
        g = inv["grid"]
        tasks.update(dict.fromkeys(g["tasks"]))
        variants.update(dict.fromkeys(g["variants"]))
        steps.update(g["steps"])
        cells.update((t, v, int(s)) for t in g["tasks"] for v in g["variants"] for s in g["seeds"])
    return {"tasks": list(tasks), "variants": list(variants), "steps": steps, "cells": cells}


@dataclass
class Results:
    """Everything the report is made from.

    ``runs``: one row per finished run (columns task, variant, seed, steps, eval_mean, eval_std, episodes,
    eval_greedy_mean: the same with greedy actions, env_steps_per_s, train_wall_s, eval_wall_s, cpu: the machine;
    NaN where not recorded). ``curves``: columns task, variant, seed, step, value (``rollout/ep_rew_mean``).
    ``failures``: the failure records of runs without a result. ``random``: task -> mean return of random
    actions. ``missing``: names of grid runs with neither a result nor a failure. ``records``: the result JSONs
    themselves (configs and versions). ``grid``: :func:`grid_of` the manifest.
    """

    runs: pd.DataFrame
    curves: pd.DataFrame
    failures: list[dict[str, Any]] = field(default_factory=list)
    random: dict[str, dict[str, Any]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, Any] = field(default_factory=dict)


RUN_COLUMNS = ["task", "variant", "seed", "steps", "eval_mean", "eval_std", "episodes", "eval_greedy_mean",
               "env_steps_per_s", "train_wall_s", "eval_wall_s", "cpu"]


def load_results(out: str | Path) -> Results:
    """Read every result, curve, failure and chance level under ``out/results``."""
    out = Path(out)
    manifest = read_manifest(out)
    records, failures, random, curves = [], [], {}, []
    root = out / RESULTS
    for path in sorted(root.rglob("*.json")) if root.is_dir() else []:
        what = "chance-level file" if path.name == "random.json" else "result file"
        doc = read_json(path, what, "no report was written")
        if path.name == "random.json":
            random[doc["task"]] = doc
        elif path.name.endswith(".failed.json"):
            if not run_paths(out, doc["task"], doc["variant"], doc["seed"])["result"].exists():
                failures.append(doc)
        else:
            records.append(doc)
            curve = path.with_suffix(".csv")
            if curve.exists():
                c = pd.read_csv(curve)
                if not c.empty:
                    curves.append(pd.DataFrame({"task": doc["task"], "variant": doc["variant"],
                                                "seed": int(doc["seed"]), "step": c["step"].astype("int64"),
                                                "value": c["ep_rew_mean"]}))
    runs = pd.DataFrame([{k: r.get(k, math.nan) for k in RUN_COLUMNS} for r in records], columns=RUN_COLUMNS)
    runs["seed"] = runs["seed"].astype("int64")
    grid = grid_of(manifest)
    have = {(r["task"], r["variant"], int(r["seed"])) for r in records + failures}
    missing = [f"{t}/{v}/seed{s}" for t, v, s in sorted(grid["cells"] - have)]
    curves_df = (pd.concat(curves, ignore_index=True) if curves
                 else pd.DataFrame(columns=["task", "variant", "seed", "step", "value"]))
    return Results(runs, curves_df, failures, random, missing, records, manifest, grid)


# ------------------------------------------------------------------------------------------------ statistics
def summarize(runs: pd.DataFrame, *, reps: int = REPS, seed: int = 0) -> pd.DataFrame:
    """One row per (task, variant): ``n`` seeds, ``iqm`` of their final evaluation returns with its 95% CI
    (``ci_low`` / ``ci_high``, NaN with one seed) and ``mean``: :func:`rlseq.compare.summarize` of one point per
    seed, the run's evaluation return."""
    from rlseq.compare import summarize as compare_summary

    columns = ["task", "variant", "n", "iqm", "ci_low", "ci_high", "mean"]
    if runs.empty:
        return pd.DataFrame(columns=columns)
    points = pd.DataFrame({"env": runs["task"], "variant": runs["variant"], "seed": runs["seed"],
                           "step": 0, "tag": "eval", "value": runs["eval_mean"].astype(np.float64)})
    s = compare_summary(points, metric="eval", reps=reps, seed=seed)
    s = s.rename(columns={"env": "task", "n_seeds": "n", "iqm_ci_low": "ci_low", "iqm_ci_high": "ci_high",
                          "final_mean": "mean"})
    # by name, so that an exact tie of IQMs in verdicts() does not go to the memory the project lists first
    return s[columns].sort_values(["task", "variant"], ignore_index=True)


def _interval(row: Any) -> tuple[float, float]:
    """A row's CI, or its IQM as a point when it has one seed."""
    if np.isfinite(row.ci_low) and np.isfinite(row.ci_high):
        return float(row.ci_low), float(row.ci_high)
    return float(row.iqm), float(row.iqm)


def verdicts(summary: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per task: ``best`` (highest IQM), ``overlap`` (the others whose CI overlaps the best's), ``none_iqm``
    and ``at_or_below_none`` (the others whose IQM is at or below the memoryless ``none``; empty without it)."""
    out: dict[str, dict[str, Any]] = {}
    for task, s in summary.groupby("task", sort=False):
        best = s.loc[s["iqm"].idxmax()]
        b_lo, b_hi = _interval(best)
        overlap = [r.variant for r in s.itertuples() if r.variant != best.variant
                   and _interval(r)[0] <= b_hi and b_lo <= _interval(r)[1]]
        none = s[s["variant"] == MEMORYLESS]
        none_iqm = float(none["iqm"].iloc[0]) if len(none) else math.nan
        below = [r.variant for r in s.itertuples() if r.variant != MEMORYLESS and r.iqm <= none_iqm]
        out[task] = {"best": best.variant, "best_iqm": float(best.iqm), "overlap": overlap,
                     "none_iqm": none_iqm, "at_or_below_none": below}
    return out


def not_below(subject: Any, other: Any) -> bool:
    """Is ``subject`` at or above ``other`` within their CIs (summary rows)? True unless the subject's CI lies
    wholly under the other's: its top below the other's bottom (a row of one seed is a point)."""
    return _interval(subject)[1] >= _interval(other)[0]


def fair_block_checks(summary: pd.DataFrame) -> pd.DataFrame:
    """The fair block's two comparisons, per task where both sides have results: each of rlseq's recurrent
    baselines (:data:`RNN_BASELINES`) against each sb3-contrib anchor (check ``anchor``), and the reference memory
    against every baseline (:data:`BASELINES` and the anchors; check ``reference``), through the one it is
    likeliest to fall short of: the highest CI bottom (by name on a tie), so that the reference holds against all
    of them exactly when it holds against that one. Columns task, check, subject,
    against, subject_iqm, against_iqm, n_subject, n_against, holds (:func:`not_below`) and gap (the other's CI
    bottom minus the subject's CI top: positive by as much as the subject is below)."""
    from rlseq.bench.memory import ANCHORS

    columns = ["task", "check", "subject", "against", "subject_iqm", "against_iqm", "n_subject", "n_against", "holds",
               "gap"]
    rows = []

    def add(check: str, a: Any, b: Any) -> None:
        rows.append({"task": a.task, "check": check, "subject": a.variant, "against": b.variant,
                     "subject_iqm": float(a.iqm), "against_iqm": float(b.iqm), "n_subject": int(a.n),
                     "n_against": int(b.n), "holds": not_below(a, b), "gap": _interval(b)[0] - _interval(a)[1]})

    for _, s in summary.groupby("task", sort=False):
        by = {r.variant: r for r in s.itertuples()}
        for rnn in RNN_BASELINES:
            for anchor in ANCHORS:
                if rnn in by and anchor in by:
                    add("anchor", by[rnn], by[anchor])
        rivals = [by[v] for v in (*BASELINES, *ANCHORS) if v in by]
        if REFERENCE in by and rivals:
            add("reference", by[REFERENCE], min(rivals, key=lambda r: (-_interval(r)[0], r.variant)))
    return pd.DataFrame(rows, columns=columns)


def speeds(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
    """Median env-steps/s over seeds per (task, variant) as a task x variant table, and over all runs per variant."""
    d = runs[np.isfinite(runs["env_steps_per_s"].astype(float))]
    per_task = d.groupby(["task", "variant"], sort=False)["env_steps_per_s"].median().unstack("variant")
    return per_task, d.groupby("variant", sort=False)["env_steps_per_s"].median()


def probability_of_improvement(runs: pd.DataFrame, reference: str = REFERENCE, *, reps: int = REPS,
                               seed: int = 0) -> pd.DataFrame:
    """Per task and variant X other than ``reference``: P(reference > X), the probability that a run of the
    reference scores above a run of X (rliable's Mann-Whitney form, ties counting half), with its 95% stratified
    bootstrap CI (seeds resampled independently per variant). Columns task, variant, n_ref, n, poi, ci_low,
    ci_high. Above 0.5 with a CI above 0.5: the reference is better on that task."""
    from rlseq.compare.stats import _rliable, _seeded_global_rng

    library, metrics = _rliable()
    rows = []
    for task, d in runs.groupby("task", sort=False):
        ref = d.loc[d["variant"] == reference, "eval_mean"].to_numpy(np.float64)
        if len(ref) == 0:
            continue
        for variant, o in d[d["variant"] != reference].groupby("variant", sort=False):
            other = o["eval_mean"].to_numpy(np.float64)
            poi = float(metrics.probability_of_improvement(ref[:, None], other[:, None]))
            lo = hi = math.nan
            if min(len(ref), len(other)) > 1:
                with _seeded_global_rng(seed):
                    _, ci = library.get_interval_estimates(
                        {"pair": (ref[:, None], other[:, None])},
                        lambda x, y: np.array([metrics.probability_of_improvement(x, y)]),
                        reps=reps, random_state=np.random.RandomState(seed))
                lo, hi = float(ci["pair"][0][0]), float(ci["pair"][1][0])
            rows.append({"task": task, "variant": variant, "n_ref": len(ref), "n": len(other), "poi": poi,
                         "ci_low": lo, "ci_high": hi})
    return pd.DataFrame(rows, columns=["task", "variant", "n_ref", "n", "poi", "ci_low", "ci_high"])


def budget_check(curves: pd.DataFrame, summary: pd.DataFrame, *, tail: float = 0.2, top: int = 2) -> pd.DataFrame:
    """Has the budget let the curves flatten? Per task, for its ``top`` variants by IQM: the gain of the
    seed-mean ``rollout/ep_rew_mean`` curve over the last ``tail`` of the budget (its value at the end minus at
    ``1 - tail`` of the last step, each the mean of the points logged within 2% of the budget there). Columns
    task, variant, gain, flat (gain < :data:`FLAT_GAIN`)."""
    rows = []
    for task, s in summary.groupby("task", sort=False):
        for variant in s.sort_values("iqm", ascending=False)["variant"].head(top):
            c = curves[(curves["task"] == task) & (curves["variant"] == variant)]
            if c.empty:
                continue
            mean = c.groupby("step")["value"].mean().sort_index()
            end = float(mean.index.max())
            band = 0.02 * end

            def near(x: float) -> float:
                window = mean[(mean.index >= x - band) & (mean.index <= x + band)]
                return float(window.mean()) if len(window) else float(mean.iloc[(abs(mean.index - x)).argmin()])

            gain = near(end) - near((1 - tail) * end)
            rows.append({"task": task, "variant": variant, "gain": gain, "flat": gain < FLAT_GAIN})
    return pd.DataFrame(rows, columns=["task", "variant", "gain", "flat"])


def horizon_rows(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary rows of the horizon tasks with their lag (``rlseq.tasks.horizon_lag``), sorted by lag."""
    from rlseq.tasks import horizon_lag

    lags = summary["task"].map(horizon_lag)
    return summary.assign(lag=lags)[lags.notna()].astype({"lag": "int64"}).sort_values(["lag", "variant"])


# ------------------------------------------------------------------------------------------------- figures
def plot_horizon(summary: pd.DataFrame, path: str | Path, variants: list[str],
                 random: dict[str, dict[str, Any]] | None = None) -> Path | None:
    """Final return against lag (log2 axis) per variant, IQM with its 95% CI as error bars; None without
    horizon results."""
    h = horizon_rows(summary)
    if h.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlseq.compare.plots import REFERENCE_COLOR, variant_styles

    shown = [v for v in variants if v in set(h["variant"])]
    # The learning curves' styles: matplotlib's own cycle repeats past ten rows, and a row with one lag is a
    # lone point, told apart by colour and marker.
    styles = variant_styles(shown)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, v in enumerate(shown):
        d = h[h["variant"] == v]
        lo = (d["iqm"] - d["ci_low"]).clip(lower=0).fillna(0)
        hi = (d["ci_high"] - d["iqm"]).clip(lower=0).fillna(0)
        nudge = 1 + 0.03 * (i - (len(shown) - 1) / 2)  # side by side, centred on the lag
        ax.errorbar(d["lag"].to_numpy() * nudge, d["iqm"].to_numpy(),
                    yerr=[lo.to_numpy(), hi.to_numpy()], label=v, capsize=3, **styles[v])
    chance = [r["mean"] for t, r in (random or {}).items() if t in set(h["task"])]
    if chance:
        ax.axhline(float(np.mean(chance)), color=REFERENCE_COLOR, linestyle=":", label="random actions")
    ax.axvspan(0.7, 3.5, color="tab:blue", alpha=0.08, label="inside the width-4 window")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("lag L: the card to name was seen L steps ago")
    ax.set_ylabel("final evaluation return (IQM, 95% CI)")
    ax.set_title("How far back each memory remembers (RepeatPreviousLag)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path



def plot(curves: pd.DataFrame, path: str | Path, random: dict[str, dict[str, Any]] | None = None) -> Path | None:
    """Training curves of ``rollout/ep_rew_mean``: one panel per task, mean over seeds with a ±std band per
    variant (:func:`rlseq.compare.plot_curves`), and the return of random actions where ``random`` (task ->
    random.json) has it. None when there is no curve."""
    if curves.empty:
        return None
    from rlseq.compare import DEFAULT_METRIC, plot_curves

    df = curves.assign(env=curves["task"].map(short_task), tag=DEFAULT_METRIC)
    chance = {short_task(t): float(r["mean"]) for t, r in (random or {}).items() if "mean" in r}
    return plot_curves(df[["env", "variant", "seed", "step", "tag", "value"]], path, aggregate="mean-std",
                       references=chance)


# ------------------------------------------------------------------------------------------------- markdown
def _num(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.2f}"


def _cell(row: Any) -> str:
    if np.isfinite(row.ci_low):
        return f"{_num(row.iqm)} [{_num(row.ci_low)}, {_num(row.ci_high)}]"
    return f"{_num(row.iqm)} (n=1)" if row.n == 1 else _num(row.iqm)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.2f} h"


def _ordered(names: list[str], preferred: list[str]) -> list[str]:
    """The distinct ``names`` in the order of ``preferred``, then the others sorted."""
    return [v for v in dict.fromkeys(preferred) if v in names] + sorted(set(names) - set(preferred))


def render(res: Results, out: str | Path, *, png: Path | None, reps: int = REPS,
           horizon_png: Path | None = None, layout: tuple[pd.DataFrame, list[str], list[str]] | None = None) -> str:
    """The report's markdown (links relative to the report's folder); ``layout``: :func:`_layout`'s result when
    the caller has it already (its bootstrap CIs are the slow part)."""
    out = Path(out)
    summary, tasks, variants = layout or _layout(res, reps)
    regenerate = f"python -m rlseq.bench memory --report-only --out {out.as_posix()}"
    lines = ["# Memory benchmark", "",
             "Does each memory remember, and how far back? Every variant trains with PPO on the same recall tasks "
             "(a memory-horizon sweep and POPGym tasks), seeds and env-step budget, then plays new episodes with its "
             "final weights. Written by "
             f"`{regenerate}` from the per-run results in `{out.as_posix()}/{RESULTS}/`; do not edit by hand.", ""]
    lines += _provenance(res)
    lines += _budget(res, tasks)
    lines += _horizon_section(res, summary, variants, out, horizon_png)
    lines += _returns_table(res, summary, tasks, variants, reps)
    lines += _greedy_section(res, tasks, variants, reps)
    lines += _poi_section(res.runs, tasks, variants, reps)
    lines += _spread_section(res.runs, tasks, variants)
    lines += _budget_check_section(res.curves, summary, tasks)
    lines += _verdict_lines(summary, tasks, variants)
    lines += _fair_block_section(summary, tasks)
    lines += _speed_table(res.runs, tasks, variants, res.manifest)
    if png is not None:
        rel = Path(os.path.relpath(png, report_path(out).parent)).as_posix()
        lines += ["## Learning curves", "",
                  "`rollout/ep_rew_mean` while training (sampled actions, the last 100 episodes), mean over seeds with "
                  "a ±std band.", "", f"![learning curves]({rel})", ""]
    lines += _problems(res)
    notes = out / NOTES
    if notes.is_file():  # the hand-written reading of the table, kept across regenerations
        lines += [notes.read_text().rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def _layout(res: Results, reps: int) -> tuple[pd.DataFrame, list[str], list[str]]:
    """The per-(task, variant) summary, and the tasks and variants in report order (the benchmark's, then others)."""
    from rlseq.bench.memory import TASKS, variants as known_variants

    summary = summarize(res.runs, reps=reps)
    tasks = _ordered(list(summary["task"].unique()) + [f["task"] for f in res.failures], [*TASKS, *res.grid["tasks"]])
    variants = _ordered(list(summary["variant"].unique()) + [f["variant"] for f in res.failures],
                        [*known_variants(), *res.grid["variants"]])
    return summary, tasks, variants


def returns_table(out: str | Path, *, reps: int = REPS) -> str:
    """The report's final-return table (markdown) for the terminal."""
    res = load_results(Path(out))
    summary, tasks, variants = _layout(res, reps)
    return "\n".join(_returns_rows(res, summary, tasks, variants))


def _provenance(res: Results) -> list[str]:
    invocations = res.manifest.get("invocations", [])
    lines = ["## How it was made", ""]
    if invocations:
        lines += ["| started | command | jobs | wall time | machine |", "|---|---|---:|---:|---|"]
        for inv in invocations:
            wall = _minutes(inv["wall_s"]) if inv.get("wall_s") is not None else "interrupted"
            lines.append(f"| {inv['started']} | `{inv['command']}` | {inv['jobs']} | {wall} "
                         f"| {inv['cpu']}, {inv['cores']} cores |")
        total = sum(inv.get("wall_s") or 0.0 for inv in invocations)
        lines += ["", f"Total wall time: {_minutes(total)} over {len(invocations)} invocation(s).", ""]
    versions = sorted({json.dumps(r.get("versions", {})) for r in res.records})
    for v in versions:
        lines.append("Versions: " + ", ".join(f"{k} {x}" for k, x in json.loads(v).items()) + ".")
    if len(versions) > 1:
        lines.append("(the runs were made with several versions)")
    commits = sorted({r.get("versions", {}).get("rlseq", "") for r in res.records} - {""})
    for commit, changed in changed_since(commits).items():
        lines += ["", f"**The code behind these results has changed since {commit}**: "
                      f"{', '.join(f'`{c}`' for c in changed[:8])}{' ...' if len(changed) > 8 else ''} differ in "
                      "this checkout. The tables show what that commit's network and defaults did, which may not be "
                      "today's: rerun the grid to measure the current code."]
    lines.append("")
    return lines


# what a result depends on: the network, the PPO, the tasks and the benchmark's settings
RESULT_CODE = ("rlseq/policies", "rlseq/algos", "rlseq/kernels", "rlseq/tasks.py", "rlseq/envs", "configs/popgym.yml")


def changed_since(commits: list[str], repo: Path | None = None) -> dict[str, list[str]]:
    """For each rlseq commit a result names, the files of :data:`RESULT_CODE` that differ between it and the
    working tree of ``repo`` (default: this checkout). Commits that git cannot resolve (a copy without history,
    ``unknown``) and checkouts without git are left out: nothing to compare with."""
    import subprocess

    repo = repo or Path(__file__).resolve().parents[2]
    changed = {}
    for commit in commits:
        base = commit.split("+")[0]
        try:
            diff = subprocess.run(["git", "diff", "--name-only", base, "--", *RESULT_CODE], cwd=repo,
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        files = diff.stdout.split()
        if diff.returncode == 0 and files:
            changed[commit] = files
    return changed


def _budget(res: Results, tasks: list[str]) -> list[str]:
    steps = dict(res.grid["steps"])
    for r in res.records:
        steps.setdefault(r["task"], int(r["steps"]))
    configs: dict[str, set[str]] = {}  # PPO settings -> the variants trained with them
    for r in res.records:
        configs.setdefault(json.dumps(r.get("config", {})), set()).add(r["variant"])
    episodes = sorted({int(r["episodes"]) for r in res.records})
    seeds = sorted({int(r["seed"]) for r in res.records})
    lines = ["## Budget", "",
             "Env steps per run, the same for every variant of a task:", "",
             "| task | env steps |", "|---|---:|"]
    lines += [f"| {short_task(t)} | {steps[t]:,} |" for t in tasks if t in steps]
    lines.append("")
    for c in sorted(configs):
        whose = "" if len(configs) == 1 else f" ({', '.join(sorted(configs[c]))})"
        lines.append(f"PPO{whose}: " + ", ".join(f"{k} {v}" for k, v in json.loads(c).items()) + ".")
    greedy = "; the same again with greedy actions" if res.runs["eval_greedy_mean"].notna().any() else ""
    lines += ["", f"Seeds {', '.join(map(str, seeds)) or 'none'}; each finished run is evaluated on "
              f"{' / '.join(map(str, episodes)) or 'n/a'} new episodes (sampled actions, env seeds unlike "
              f"training{greedy}).", ""]
    return lines


def _returns_table(res: Results, summary: pd.DataFrame, tasks: list[str], variants: list[str], reps: int) -> list[str]:
    return ["## Final evaluation return", "",
            f"IQM over seeds of each run's mean evaluation return, with its 95% percentile stratified-bootstrap CI "
            f"(rliable, {reps} resamples; the IQM is the mean below 4 seeds). `random`: the mean return of "
            "uniformly random actions (chance); `none`: the same network without memory (the memoryless "
            "reference)." + (" Returns lie in [-1, 1]." if all(t.startswith(("popgym-", "rlseq/RepeatPrevious")) for t in tasks)
               else ""),
            "", *_returns_rows(res, summary, tasks, variants), ""]


def _greedy_section(res: Results, tasks: list[str], variants: list[str], reps: int) -> list[str]:
    greedy = res.runs[np.isfinite(res.runs["eval_greedy_mean"].astype(float))]
    if greedy.empty:
        return []
    summary = summarize(greedy.assign(eval_mean=greedy["eval_greedy_mean"]), reps=reps)
    return ["## Final evaluation return, greedy actions", "",
            "The same final models from the same env seeds, each step taking the policy's most likely action "
            "(SB3's `evaluate_policy` default) instead of sampling it. Where a task's sampled returns fall below "
            "these, the table above measures how peaked each policy has become as well as what its memory holds. "
            f"{len(greedy)} of {len(res.runs)} results have it (those made before it was recorded do not).", "",
            *_returns_rows(res, summary, [t for t in tasks if t in set(greedy["task"])], variants), ""]


def _returns_rows(res: Results, summary: pd.DataFrame, tasks: list[str], variants: list[str]) -> list[str]:
    """The final-return table alone: header, rule and one row per task."""
    cells = {(r.task, r.variant): r for r in summary.itertuples()}
    lines = ["| task | random | " + " | ".join(variants) + " |", "|---|---:|" + "---:|" * len(variants)]
    for t in tasks:
        rnd = res.random.get(t)
        row = [short_task(t), _num(rnd["mean"]) if rnd else "n/a"]
        row += [_cell(cells[t, v]) if (t, v) in cells else "–" for v in variants]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _horizon_section(res: Results, summary: pd.DataFrame, variants: list[str], out: Path,
                     png: Path | None) -> list[str]:
    h = horizon_rows(summary)
    if h.empty:
        return []
    lags = sorted(h["lag"].unique())
    cells = {(r.variant, r.lag): r for r in h.itertuples()}
    chance = {int(lag): res.random.get(t, {}).get("mean") for t, lag in zip(h["task"], h["lag"])}
    lines = ["## Memory horizon", "",
             "RepeatPreviousLag L: name the suit of the card seen L steps ago (POPGym's RepeatPrevious, two decks, 103 "
             "steps an episode). Final evaluation return, IQM over seeds [95% CI]; 1 is perfect recall, -0.5 is "
             "chance. The block's front end (a width-4 convolution, every memory's, `none` included) sees lags up "
             "to 3 without any memory; `-conv1` variants have no window.", "",
             "| variant | " + " | ".join(f"L={lag}" for lag in lags) + " |", "|---|" + "---:|" * len(lags)]
    lines.append("| random | " + " | ".join(_num(chance.get(int(lag))) if chance.get(int(lag)) is not None
                                             else "n/a" for lag in lags) + " |")
    for v in [v for v in variants if any((v, lag) in cells for lag in lags)]:
        lines.append(f"| {v} | " + " | ".join(_cell(cells[v, lag]) if (v, lag) in cells else "–" for lag in lags)
                     + " |")
    lines.append("")
    if png is not None:
        rel = Path(os.path.relpath(png, report_path(out).parent)).as_posix()
        lines += [f"![memory horizon]({rel})", ""]
    return lines


def _poi_section(runs: pd.DataFrame, tasks: list[str], variants: list[str], reps: int) -> list[str]:
    poi = probability_of_improvement(runs, reps=reps)
    if poi.empty:
        return []
    others = [v for v in variants if v in set(poi["variant"])]
    cells = {(r.task, r.variant): r for r in poi.itertuples()}

    def cell(r: Any) -> str:
        return f"{r.poi:.2f} [{_num(r.ci_low)}, {_num(r.ci_high)}]" if np.isfinite(r.ci_low) else f"{r.poi:.2f}"

    lines = [f"## Probability of improvement of {REFERENCE}", "",
             f"P({REFERENCE} > X): the probability that a seed of {REFERENCE} ends above a seed of X on the task (ties "
             f"count half), with its 95% stratified-bootstrap CI (rliable, {reps} resamples). Above 0.5 with the CI "
             f"above 0.5: {REFERENCE} is better; below 0.5 with the CI below: X is better.", "",
             "| task | " + " | ".join(others) + " |", "|---|" + "---:|" * len(others)]
    for t in tasks:
        if any((t, v) in cells for v in others):
            lines.append(f"| {short_task(t)} | " + " | ".join(cell(cells[t, v]) if (t, v) in cells else "–"
                                                             for v in others) + " |")
    return lines + [""]


def _spread_section(runs: pd.DataFrame, tasks: list[str], variants: list[str]) -> list[str]:
    if runs.empty or runs.groupby(["task", "variant"]).size().max() < 2:
        return []
    std = runs.groupby(["task", "variant"])["eval_mean"].std(ddof=1).unstack("variant")
    cols = [v for v in variants if v in std.columns]
    lines = ["## Spread across seeds", "",
             "Standard deviation over seeds of the final evaluation return (the same runs as the table above).", "",
             "| task | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for t in tasks:
        if t in std.index:
            lines.append(f"| {short_task(t)} | " + " | ".join(_num(std.loc[t, v]) for v in cols) + " |")
    median = std[cols].median()
    lines.append("| **median over tasks** | " + " | ".join(f"**{_num(median[v])}**" for v in cols) + " |")
    return lines + [""]


def _budget_check_section(curves: pd.DataFrame, summary: pd.DataFrame, tasks: list[str]) -> list[str]:
    check = budget_check(curves, summary)
    if check.empty:
        return []
    lines = ["## Budget check", "",
             f"Has each task's budget let the curves flatten? For the two best variants of each task: the gain of "
             f"the seed-mean training curve over the last 20% of the budget; below {FLAT_GAIN} counts as flat. A "
             "task marked *rising* may separate the variants further with more env steps.", "",
             "| task | variant | gain over the last 20% | verdict |", "|---|---|---:|---|"]
    for t in tasks:
        for r in check[check["task"] == t].itertuples():
            lines.append(f"| {short_task(t)} | {r.variant} | {r.gain:+.3f} | {'flat' if r.flat else '*rising*'} |")
    return lines + [""]


def _verdict_lines(summary: pd.DataFrame, tasks: list[str], variants: list[str]) -> list[str]:
    verdict = verdicts(summary)
    lines = ["## Per task", "",
             "Read off the table: the variant with the highest IQM, the others whose CI overlaps its CI, and those "
             "whose IQM is at or below the memoryless `none`.", ""]
    for t in tasks:
        if t not in verdict:
            continue
        v = verdict[t]
        overlap = ", ".join(_ordered(v["overlap"], variants)) or "no other"
        text = f"- **{short_task(t)}**: best {v['best']} ({_num(v['best_iqm'])}); CI overlaps the best: {overlap}"
        if np.isfinite(v["none_iqm"]):
            below = ", ".join(_ordered(v["at_or_below_none"], variants)) or "no variant"
            text += f"; at or below none ({_num(v['none_iqm'])}): {below}"
        lines.append(text + ".")
    return lines + [""]


def _fair_block_section(summary: pd.DataFrame, tasks: list[str]) -> list[str]:
    checks = fair_block_checks(summary)
    checks = checks[checks["task"].isin(tasks)]
    if checks.empty:
        return []
    order = {t: i for i, t in enumerate(tasks)}
    at = {(r.task, r.check, r.subject, r.against): r
          for r in sorted(checks.itertuples(), key=lambda r: order[r.task])}

    def cell(r: Any) -> str:
        word = "at or above" if r.holds else f"**below** by {r.gap:.2g}"
        return f"{word} ({_num(r.subject_iqm)} vs {_num(r.against_iqm)}; seeds {r.n_subject} / {r.n_against})"

    def failing(check: str) -> str:
        names = [f"{short_task(t)} ({a} vs {b})" for (t, c, a, b), r in at.items() if c == check and not r.holds]
        return ", ".join(names) or "none"

    lines = ["## The fair block's checks", "",
             "A pair holds when the first variant's CI reaches the second's (its top at or above the other's bottom; "
             "a variant with one seed is a point); one that does not says by how much its CI falls short. Tasks "
             "where a side has no result yet are left out.", ""]
    anchors = checks[checks["check"] == "anchor"]
    if len(anchors):
        pairs = list(dict.fromkeys(zip(anchors["subject"], anchors["against"])))
        rnns = " and ".join(RNN_BASELINES)
        lines += [f"rlseq's {rnns} against sb3-contrib's own LSTM (the anchors): IQM vs IQM.", "",
                  "| task | " + " | ".join(f"{a} vs {b}" for a, b in pairs) + " |", "|---|" + "---|" * len(pairs)]
        for t in tasks:
            if any((t, "anchor", a, b) in at for a, b in pairs):
                lines.append(f"| {short_task(t)} | " + " | ".join(
                    cell(at[t, "anchor", a, b]) if (t, "anchor", a, b) in at else "–" for a, b in pairs) + " |")
        lines += ["", f"Below an anchor: {failing('anchor')}.", ""]
    reference = checks[checks["check"] == "reference"]
    if len(reference):
        lines += [f"{REFERENCE} against every one of {', '.join(BASELINES)} and the anchors on each task, through "
                  "the strongest: the one whose CI bottom is highest (it holds against all exactly when it holds "
                  "against that one).", "",
                  f"| task | strongest baseline | {REFERENCE} vs it |", "|---|---|---|"]
        by_task = {r.task: r for r in reference.itertuples()}
        lines += [f"| {short_task(t)} | {by_task[t].against} | {cell(by_task[t])} |" for t in tasks if t in by_task]
        lines += ["", f"{REFERENCE} below a baseline: {failing('reference')}.", ""]
    return lines


def _speed_table(runs: pd.DataFrame, tasks: list[str], variants: list[str],
                 manifest: dict[str, Any] | None = None) -> list[str]:
    """Median env-steps/s per task and variant: one table per machine when the results name several (their
    ``cpu``), else one table, with a warning when the invocations name several machines that the results do not
    tell apart (results written before they recorded their CPU)."""
    if speeds(runs)[1].empty:
        return []
    lines = ["## Training speed", "",
             "Env-steps/s of training (env steps between the first and last logged rollout over the wall time between "
             "them), median over runs; measured while the benchmark's other jobs ran beside it.", ""]
    named = runs["cpu"].dropna().astype(str)
    machines, unrecorded = sorted(set(named)), len(named) < len(runs)
    if len(machines) > 1 or (machines and unrecorded):
        for cpu in [*machines, *([None] if unrecorded else [])]:
            part = runs[runs["cpu"].isna()] if cpu is None else runs[runs["cpu"].astype(str) == cpu]
            lines += [f"### {cpu if cpu is not None else 'Machine not recorded'}", "",
                      *_speed_rows(part, tasks, variants)]
        return lines
    cpus = {inv.get("cpu") for inv in (manifest or {}).get("invocations", []) if inv.get("cpu")}
    if not machines and len(cpus) > 1:
        lines += [f"The invocations ran on {len(cpus)} machines ({', '.join(sorted(cpus))}) and these results do not "
                  "record which made them: a cell may mix machines, so compare variants within a task with care.", ""]
    return lines + _speed_rows(runs, tasks, variants)


def _speed_rows(runs: pd.DataFrame, tasks: list[str], variants: list[str]) -> list[str]:
    per_task, overall = speeds(runs)
    cols = [v for v in variants if v in overall.index]
    lines = ["| task | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for t in tasks:
        if t in per_task.index:
            vals = per_task.loc[t]
            lines.append(f"| {short_task(t)} | " + " | ".join(
                f"{vals[v]:,.0f}" if v in vals and np.isfinite(vals[v]) else "–" for v in cols) + " |")
    lines.append("| **all tasks** | " + " | ".join(f"**{overall[v]:,.0f}**" for v in cols) + " |")
    return lines + [""]


def _problems(res: Results) -> list[str]:
    lines = []
    if res.failures:
        lines += ["## Failed runs", ""]
        for f in sorted(res.failures, key=lambda f: f["name"]):
            last = next((ln for ln in reversed(f.get("log_tail", [])) if ln.strip()), "")
            lines.append(f"- {f['name']}: {f.get('reason', 'failed')}" + (f" — `{last.strip()}`" if last else ""))
        lines.append("")
    if res.missing:
        lines += ["## Not run yet", "", "Runs of the grid without a result or a failure:", "",
                  *_missing_lines(res.missing), ""]
    return lines


def _missing_lines(missing: list[str]) -> list[str]:
    """One line per task: ``- **Task**: efla seeds 3, 4; gru seed 4``, or ``- **Task**: efla, gru: seeds 0, 1``
    when all its variants miss the same seeds."""
    by_task: dict[str, dict[str, list[int]]] = {}
    for name in missing:
        head, _, seed = name.rpartition("/seed")
        task, _, variant = head.rpartition("/")
        by_task.setdefault(task, {}).setdefault(variant, []).append(int(seed))

    def seeds(ss: list[int]) -> str:
        return ("seed " if len(ss) == 1 else "seeds ") + ", ".join(map(str, sorted(ss)))

    lines = []
    for task, per_variant in sorted(by_task.items()):
        groups = {tuple(sorted(ss)) for ss in per_variant.values()}
        if len(per_variant) > 1 and len(groups) == 1:
            text = f"{', '.join(per_variant)}: {seeds(list(groups.pop()))}"
        else:
            text = "; ".join(f"{v} {seeds(ss)}" for v, ss in per_variant.items())
        lines.append(f"- **{short_task(task)}**: {text}")
    return lines


def write_report(out: str | Path, *, reps: int = REPS) -> Path:
    """Read ``out``'s results, write ``out/curves.png`` and the report ``<out>.md``; returns the report's path."""
    from rlseq.checkpoint import write_text_atomic

    out = Path(out)
    res = load_results(out)
    if res.runs.empty and not res.failures:
        raise FileNotFoundError(f"no result under {out / RESULTS}: run the benchmark first "
                                "(python -m rlseq.bench memory --out ...)")
    png = plot(res.curves, out / CURVES_PNG, res.random)
    layout = _layout(res, reps)
    summary, _, variants = layout
    horizon_png = plot_horizon(summary, out / HORIZON_PNG, variants, res.random)
    path = report_path(out)
    write_text_atomic(path, render(res, out, png=png, reps=reps, horizon_png=horizon_png, layout=layout))
    return path
