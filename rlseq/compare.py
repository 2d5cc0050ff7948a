"""Compare training runs of different memories from their TensorBoard event files.

Usage::

    python -m rlseq.compare runs/caveflyer            # one env: one panel
    python -m rlseq.compare runs                      # several envs: one panel / table section per env
    python -m rlseq.compare runs/caveflyer --aggregate iqm --reps 2000 --out /tmp/cmp
    python -m rlseq.compare part1_scalars.csv.gz /tmp/part2/runs/caveflyer --out docs/results   # merge parts

Layout (written by the training CLI)::

    runs/<env>/<memory>[-<tag>]/seed<N>/events.out.tfevents.*   (+ config.yaml)

Every event file under RUNS_DIR is attributed to its nearest ancestor folder named ``seed<N>``; that
folder's parent names the *variant* (``efla``, ``efla-reward1e3``, ...) and its grandparent the *env*.
So RUNS_DIR may be ``runs/`` (all envs), ``runs/<env>`` (the usual case), ``runs/<env>/<variant>`` or a
single seed folder; event files in sub-folders of a seed folder (e.g. SB3's ``PPO_1/``) still count.
Event files that sit under no ``seed<N>`` folder are skipped with a warning.

Several inputs (runs trees and ``--save-scalars`` CSVs, in any mix) are merged into one dataset before
anything is computed or written, so an experiment run in parts (part 1 kept only as its saved CSV, part 2
as a fresh runs tree) gives the report of all parts; see :func:`load_inputs`. A run (env, variant, seed)
found in two inputs is an error, and ``--out`` is then required. A CSV input carries only the tags that
``--save-scalars`` keeps.

Outputs (in ``--out``, default RUNS_DIR, or the CSV's folder when RUNS_DIR is a CSV):

* ``compare.png``: learning curves of ``--metric`` (default ``rollout/ep_rew_mean``) against env steps,
  one panel per env, one line per variant: mean ± std across seeds (``--aggregate mean-std``) or IQM with
  a 95% stratified-bootstrap CI from rliable (``--aggregate iqm``). Each seed is interpolated onto a common
  grid that ends at the *smallest* last step across the variant's seeds, so the aggregate never mixes
  "all seeds" with "the seeds that got further".
* ``compare_diagnostics.png`` (only when memory diagnostics were logged): gate saturation fraction,
  key-norm max, state-norm max (log y) and non-finite events; mean across seeds with a min–max band
  (the extremes are what matter for blow-ups).
* ``compare.md`` (also printed): one table per env, see :func:`summarize` for the definitions; with
  ``--baseline MEMORY`` a second table compares every variant with that memory under the same tag
  (:func:`relative_to_baseline`), and when diagnostics were logged a third one summarises them
  (:func:`diagnostics_summary`).
* ``--save-scalars FILE.csv.gz`` writes the loaded scalars (columns ``env, variant, seed, step, tag,
  value``; written atomically, so it may overwrite one of the input CSVs), and RUNS_DIR may be such a
  file: a committed summary then reproduces every figure and table without the raw event files.
* ``--panels condition`` draws one panel per (env, tag) with one line per memory, instead of one panel
  per env.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

DEFAULT_METRIC = "rollout/ep_rew_mean"
THROUGHPUT_TAGS = ("time/env_steps_per_s", "time/fps")  # first one present wins
DIAGNOSTIC_TAGS = (
    "memory/gate_saturated_frac",
    "memory/key_norm_max",
    "memory/state_norm_max",
    "memory/nonfinite_events",
)
# what --save-scalars keeps besides every rollout/, memory/ and time/ tag: enough to redo every figure and table
SAVED_TRAIN_TAGS = ("train/value_target_abs_mean", "train/value_target_abs_max", "train/explained_variance",
                    "train/entropy_loss", "train/value_loss", "train/approx_kl", "train/clip_fraction",
                    "train/grad_norm")
LOG_SCALE_TAGS = frozenset({"memory/key_norm_max", "memory/state_norm_max"})
COLUMNS = ["env", "variant", "seed", "step", "tag", "value"]

# Fixed colours per memory so every figure of the project reads the same way.
MEMORY_COLORS = {"efla": "#1f77b4", "deltanet": "#ff7f0e", "lstm": "#2ca02c", "none": "#7f7f7f"}
MEMORY_ORDER = tuple(MEMORY_COLORS)
_EXTRA_COLORS = ("#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
_LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 3)))

_SEED_RE = re.compile(r"^seed(\d+)$")
_EVENT_GLOB = "events.out.tfevents.*"
LAYOUT_HELP = (
    "expected layout: RUNS_DIR/<env>/<memory>[-<tag>]/seed<N>/events.out.tfevents.* "
    "(RUNS_DIR may also be runs/, runs/<env>/<variant> or one seed folder)"
)


class CompareError(RuntimeError):
    """A user-facing problem with the input (missing folder, no runs, unknown metric)."""


# --------------------------------------------------------------------------------------------- loading
def _find_run_files(root: Path) -> tuple[dict[tuple[str, str, int], list[Path]], list[Path]]:
    """Event files grouped by (env, variant, seed), plus the files that fit no ``seed<N>`` folder."""
    runs: dict[tuple[str, str, int], list[Path]] = {}
    orphans: list[Path] = []
    for f in sorted(root.rglob(_EVENT_GLOB)):
        if not f.is_file():
            continue
        seed_dir = next((p for p in f.parents if _SEED_RE.match(p.name)), None)
        # Only folders at or below root count, so a parent of root named seed3 is never picked up.
        if seed_dir is None or not (seed_dir == root or root in seed_dir.parents):
            orphans.append(f)
            continue
        seed = int(_SEED_RE.match(seed_dir.name).group(1))  # type: ignore[union-attr]
        variant_dir = seed_dir.parent
        runs.setdefault((variant_dir.parent.name, variant_dir.name, seed), []).append(f)
    return runs, orphans


def _read_event_file(path: Path) -> pd.DataFrame:
    """Scalars of one event file (step, tag, value, wall_time) via tbparse."""
    from tbparse import SummaryReader  # imported here: only loading needs it

    df = SummaryReader(str(path), pivot=False, extra_columns={"wall_time"}).scalars
    if df.empty:
        return pd.DataFrame({"step": [], "tag": [], "value": [], "wall_time": []})
    return df[["step", "tag", "value", "wall_time"]].astype(
        {"step": "int64", "tag": object, "value": "float64", "wall_time": "float64"}
    )


def _merge_resumed(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Merge the event files of one run folder into one step axis.

    After a resume the new file re-logs steps the old one already had (the checkpoint is older than the
    crash). Files are taken in order of their first wall time; for each tag, a later file discards the
    earlier rows at steps >= its first step (what TensorBoard's orphan purge does), so the newest value
    wins on duplicated steps and no stale point survives between re-logged ones. Within one file a
    duplicated step keeps its last write.
    """
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame({"step": [], "tag": [], "value": []})
    frames = sorted(frames, key=lambda f: float(f["wall_time"].min()))
    merged = frames[0]
    for nxt in frames[1:]:
        first_step = nxt.groupby("tag")["step"].min()
        cut = merged["tag"].map(first_step)  # NaN for tags the new file does not log: keep them
        merged = pd.concat([merged[~(merged["step"] >= cut)], nxt], ignore_index=True)
    merged = merged.sort_values(["tag", "step", "wall_time"], kind="stable")
    merged = merged.drop_duplicates(["tag", "step"], keep="last")
    return merged[["step", "tag", "value"]]


def load_scalars(path: str | Path) -> pd.DataFrame:
    """Read scalars saved with ``--save-scalars`` (a CSV, optionally gzipped) into :func:`load_runs`' form."""
    path = Path(path)
    if not path.is_file():
        raise CompareError(f"scalars file not found: {path}")
    # env and variant as text: a numeric name ("2048") must stay equal to the same name read from a runs tree
    df = pd.read_csv(path, dtype={"env": str, "variant": str})
    missing = set(COLUMNS) - set(df.columns)
    if missing:
        raise CompareError(f"{path} lacks the columns {', '.join(sorted(missing))}; expected {', '.join(COLUMNS)}")
    df = df[COLUMNS].astype({"env": object, "variant": object, "seed": "int64", "step": "int64", "tag": object,
                             "value": "float64"})
    return df.sort_values(["env", "variant", "seed", "tag", "step"], kind="stable").reset_index(drop=True)


def load_runs(root: str | Path) -> pd.DataFrame:
    """Read every run under ``root`` into a long DataFrame.

    Returns columns ``env, variant, seed, step, tag, value`` (one row per logged scalar; ``step`` is the
    env step), sorted by env, variant, seed, tag, step. Several event files in one seed folder (resume)
    are merged, see :func:`_merge_resumed`. Raises :class:`CompareError` if ``root`` is missing or holds
    no event file in the expected layout.
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise CompareError(f"runs directory not found: {root}")
    runs, orphans = _find_run_files(root)
    if orphans:
        shown = ", ".join(str(p.relative_to(root)) for p in orphans[:3])
        more = f" (+{len(orphans) - 3} more)" if len(orphans) > 3 else ""
        warnings.warn(f"skipped {len(orphans)} event file(s) outside any seed<N> folder: {shown}{more}",
                      stacklevel=2)
    if not runs:
        raise CompareError(f"no TensorBoard event files found under {root}; {LAYOUT_HELP}")
    parts = []
    for (env, variant, seed), files in sorted(runs.items()):
        run = _merge_resumed([_read_event_file(f) for f in files])
        if run.empty:
            continue
        parts.append(run.assign(env=env, variant=variant, seed=seed))
    if not parts:
        raise CompareError(f"event files under {root} hold no scalars; {LAYOUT_HELP}")
    df = pd.concat(parts, ignore_index=True)[COLUMNS]
    df = df.astype({"env": object, "variant": object, "seed": "int64", "step": "int64", "tag": object,
                    "value": "float64"})
    return df.sort_values(["env", "variant", "seed", "tag", "step"], kind="stable").reset_index(drop=True)


def load_inputs(paths: Sequence[str | Path]) -> pd.DataFrame:
    """Read runs trees (:func:`load_runs`) and ``--save-scalars`` CSVs (:func:`load_scalars`) into one
    DataFrame of :func:`load_runs`' form, every input read in full before this returns.

    Raises :class:`CompareError` if an input is missing or a run (env, variant, seed) appears in two inputs:
    merging it would double-count its seed, and picking one copy would hide which data the report used.
    """
    paths = [Path(p) for p in paths]
    frames: list[pd.DataFrame] = []
    owner: dict[tuple[str, str, int], int] = {}  # run -> index of its input (an input given twice clashes too)
    for i, path in enumerate(paths):
        df = load_scalars(path) if path.is_file() else load_runs(path)
        for env, variant, seed in df[["env", "variant", "seed"]].drop_duplicates().itertuples(index=False):
            first = owner.setdefault((env, variant, int(seed)), i)
            if first != i:
                raise CompareError(f"run {env}/{variant}/seed{seed} is in both {paths[first]} and {path}; "
                                   "each run must come from exactly one input")
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)[COLUMNS]
    return df.sort_values(["env", "variant", "seed", "tag", "step"], kind="stable").reset_index(drop=True)


def _write_csv_atomic(df: pd.DataFrame, path: Path) -> None:
    """``df.to_csv(path)`` through a temporary sibling folder and a rename, so ``path`` (possibly one of the
    inputs) is never left half-written. The temporary file already has the final name, which gzip records
    in its header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        df.to_csv(tmp_dir / path.name, index=False)
        os.replace(tmp_dir / path.name, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------- rliable
def _rliable() -> tuple[Any, Any]:
    """rliable's ``library`` and ``metrics`` modules (imported lazily: they pull scipy, arch and seaborn).

    rliable pins ``arch<8``, whose import fails under pandas 3; pyproject.toml pins ``pandas<3`` for that.
    """
    from rliable import library, metrics

    return library, metrics


def _bootstrap_ci(
    scores: np.ndarray, func: Callable[[np.ndarray], np.ndarray], *, reps: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """95% percentile stratified-bootstrap CI of ``func(scores)`` via rliable (runs on axis 0)."""
    library, _ = _rliable()
    # rliable's StratifiedBootstrap draws its indices from the *global* np.random (random_state only
    # reaches arch), so seed the global generator for reproducible CIs and restore it afterwards.
    saved = np.random.get_state()
    try:
        np.random.seed(seed)
        with warnings.catch_warnings():
            # arch warns that random_state is deprecated; rliable only passes it on.
            warnings.simplefilter("ignore", FutureWarning)
            _, ci = library.get_interval_estimates(
                {"x": scores}, func, reps=reps, random_state=np.random.RandomState(seed)
            )
    finally:
        np.random.set_state(saved)
    return ci["x"][0], ci["x"][1]


def _iqm_over_runs(scores: np.ndarray) -> np.ndarray:
    """IQM across runs (axis 0) at every trailing position of a (runs, 1, points) array.

    Vectorised form of ``rliable.metrics.aggregate_iqm`` applied to ``scores[:, :, j]`` for each j
    (both are scipy's 25% ``trim_mean``); the loop version costs reps × points calls.
    """
    from scipy.stats import trim_mean

    return np.atleast_1d(trim_mean(scores.reshape(scores.shape[0], -1), 0.25, axis=0))


# --------------------------------------------------------------------------------------------- summary
def _throughput(df: pd.DataFrame) -> pd.Series:
    """Env steps/s per (env, variant): per seed the median of its first present tag in THROUGHPUT_TAGS
    (chosen per seed, so an older run that only logged time/fps still counts), then the mean over seeds."""
    d = df[df["tag"].isin(THROUGHPUT_TAGS) & np.isfinite(df["value"])]
    if d.empty:
        return pd.Series(dtype=np.float64)
    per_tag = d.groupby(["env", "variant", "seed", "tag"])["value"].median().unstack("tag")
    per_seed = per_tag[[t for t in THROUGHPUT_TAGS if t in per_tag]].bfill(axis=1).iloc[:, 0]
    return per_seed.groupby(["env", "variant"]).mean()


def final_returns(df: pd.DataFrame, *, final_fraction: float = 0.1,
                  metric: str = DEFAULT_METRIC) -> pd.DataFrame:
    """Per-seed final value of ``metric``: columns env, variant, seed, final, last_step.

    The final value of a seed is the mean of its (finite) ``metric`` points with
    ``step >= (1 - final_fraction) * last_step``, i.e. over the last ``final_fraction`` of the env steps
    that seed trained for (steps count from 0). The last point is always included, so a short run still
    gets a value. ``rollout/ep_rew_mean`` is itself a mean over the last 100 episodes; averaging a few
    logged points on top smooths the last-iteration noise.
    """
    if not 0.0 < final_fraction <= 1.0:
        raise ValueError(f"final_fraction must be in (0, 1], got {final_fraction}")
    d = df[(df["tag"] == metric) & np.isfinite(df["value"])]
    if d.empty:
        available = ", ".join(sorted(df["tag"].unique())) or "none"
        raise CompareError(f"metric {metric!r} not found in the event files; tags present: {available}")
    return _tail_means(d, final_fraction)


def _tail_means(d: pd.DataFrame, final_fraction: float) -> pd.DataFrame:
    """Per (env, variant, seed) of ``d`` (one tag, finite values): the mean over the last ``final_fraction`` of
    that seed's steps, the rule of :func:`final_returns`. Columns env, variant, seed, final, last_step."""
    rows = []
    for (env, variant, seed), g in d.groupby(["env", "variant", "seed"], sort=True):
        last = int(g["step"].max())
        tail = g[g["step"] >= (1.0 - final_fraction) * last]
        rows.append((env, variant, int(seed), float(tail["value"].mean()), last))
    return pd.DataFrame(rows, columns=["env", "variant", "seed", "final", "last_step"])


def summarize(
    df: pd.DataFrame,
    *,
    final_fraction: float = 0.1,
    metric: str = DEFAULT_METRIC,
    reps: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per (env, variant) with the final-return statistics across seeds.

    Columns:

    * ``n_seeds``; ``steps_min`` / ``steps_max``: smallest / largest last env step across seeds.
    * ``final_mean``, ``final_std``: mean and sample std (``ddof=1``) across seeds of each seed's final
      value (see :func:`final_returns`). NaN with one seed.
    * ``iqm``: ``rliable.metrics.aggregate_iqm`` of the seeds' final values (25% trimmed mean; with fewer
      than 4 seeds nothing is trimmed, so it equals the mean). ``iqm_ci_low`` / ``iqm_ci_high``: 95%
      percentile stratified-bootstrap CI from ``rliable.library.get_interval_estimates`` (``reps``
      resamples, seeded with ``seed`` so reruns give the same CI); NaN with one seed.
    * ``median`` of the final values.
    * ``env_steps_per_s``: per seed the median of ``time/env_steps_per_s`` (else ``time/fps``) over its
      logged points (robust to the slow first iterations), then the mean across seeds; NaN if absent.

    Rows follow the memory order efla, deltanet, lstm, none, then other variants alphabetically.
    """
    finals = final_returns(df, final_fraction=final_fraction, metric=metric)
    _, metrics = _rliable()
    tput = _throughput(df)
    rows = []
    for (env, variant), g in finals.groupby(["env", "variant"], sort=True):
        x = g.sort_values("seed")["final"].to_numpy(dtype=np.float64)
        n = len(x)
        scores = x.reshape(n, 1)  # rliable's (runs, tasks) layout, one task
        iqm = float(metrics.aggregate_iqm(scores))
        lo = hi = math.nan
        if n > 1:
            lo_a, hi_a = _bootstrap_ci(scores, lambda s: np.array([metrics.aggregate_iqm(s)]),
                                       reps=reps, seed=seed)
            lo, hi = float(lo_a[0]), float(hi_a[0])
        rows.append({
            "env": env,
            "variant": variant,
            "n_seeds": n,
            "steps_min": int(g["last_step"].min()),
            "steps_max": int(g["last_step"].max()),
            "final_mean": float(x.mean()),
            "final_std": float(x.std(ddof=1)) if n > 1 else math.nan,
            "iqm": iqm,
            "iqm_ci_low": lo,
            "iqm_ci_high": hi,
            "median": float(np.median(x)),
            "env_steps_per_s": float(tput.get((env, variant), math.nan)),
        })
    out = pd.DataFrame(rows)
    order = {v: i for i, v in enumerate(variant_order(out["variant"]))}
    out = out.sort_values(["env", "variant"], key=lambda c: c.map(order) if c.name == "variant" else c)
    return out.reset_index(drop=True)


def _tag(variant: str) -> str:
    return variant.split("-", 1)[1] if "-" in variant else ""


def relative_to_baseline(finals: pd.DataFrame, baseline: str, *, reps: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Every variant against ``baseline`` trained under the same tag (``efla-reward1e3`` vs
    ``deltanet-reward1e3``), from the per-seed final values of :func:`final_returns`.

    Columns: env, variant, baseline (the variant compared with), n / n_base (seeds), ``mean_ratio`` (final
    mean / baseline final mean) with a 95% percentile bootstrap CI (``ratio_ci_low/high``: seeds resampled
    with replacement within each group, ``reps`` times), ``std_ratio`` (sample stds, ddof=1) with its
    95% CI from the F distribution of the variance ratio (assumes normal final values; a
    bootstrap of a std from 3 seeds is degenerate), and ``p_improve``: rliable's probability of improvement P(variant > baseline) with its
    stratified-bootstrap CI (``p_ci_low/high``). Ratios are NaN where the baseline's mean or std is 0;
    CIs are NaN with fewer than 2 seeds on either side.
    """
    from scipy.stats import f as f_dist

    library, metrics = _rliable()
    rows = []
    for (env, variant), g in finals.groupby(["env", "variant"], sort=True):
        base = f"{baseline}-{_tag(variant)}" if _tag(variant) else baseline
        if _base_memory(variant) == baseline:
            continue
        b = finals[(finals["env"] == env) & (finals["variant"] == base)]
        if b.empty:
            continue
        x, y = g["final"].to_numpy(np.float64), b["final"].to_numpy(np.float64)
        row = {"env": env, "variant": variant, "baseline": base, "n": len(x), "n_base": len(y),
               "mean_ratio": _safe_div(x.mean(), y.mean()), "ratio_ci_low": math.nan, "ratio_ci_high": math.nan,
               "std_ratio": math.nan, "std_ci_low": math.nan, "std_ci_high": math.nan,
               "p_improve": float(metrics.probability_of_improvement(x[:, None], y[:, None])),
               "p_ci_low": math.nan, "p_ci_high": math.nan}
        if len(x) > 1 and len(y) > 1:
            row["std_ratio"] = r = _safe_div(x.std(ddof=1), y.std(ddof=1))
            dfs = (len(x) - 1, len(y) - 1)
            row["std_ci_low"] = r / math.sqrt(f_dist.ppf(0.975, *dfs))
            row["std_ci_high"] = r / math.sqrt(f_dist.ppf(0.025, *dfs))
            rng = np.random.default_rng(seed)  # per pair: a row does not depend on which other runs are loaded
            bx = x[rng.integers(0, len(x), (reps, len(x)))]
            by = y[rng.integers(0, len(y), (reps, len(y)))]
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = bx.mean(1) / by.mean(1)
            row["ratio_ci_low"], row["ratio_ci_high"] = _finite_percentiles(ratios)
            saved = np.random.get_state()  # rliable draws from the global generator, see _bootstrap_ci
            try:
                np.random.seed(seed)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    _, ci = library.get_interval_estimates(
                        {"x": (x[:, None], y[:, None])},
                        lambda a, c: np.array([metrics.probability_of_improvement(a, c)]), reps=reps)
            finally:
                np.random.set_state(saved)
            row["p_ci_low"], row["p_ci_high"] = float(ci["x"][0][0]), float(ci["x"][1][0])
        rows.append(row)
    return pd.DataFrame(rows)


def _safe_div(a: float, b: float) -> float:
    return float(a / b) if b != 0 else math.nan


def _finite_percentiles(x: np.ndarray) -> tuple[float, float]:
    """2.5 and 97.5 percentiles of the finite resamples (a resample whose denominator is 0 has none)."""
    x = x[np.isfinite(x)]
    return (float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))) if x.size else (math.nan, math.nan)


def diagnostics_summary(df: pd.DataFrame, *, final_fraction: float = 0.1) -> pd.DataFrame:
    """One row per (env, variant) that logged memory diagnostics.

    Columns: ``saturated_final`` (mean across seeds of each seed's mean ``memory/gate_saturated_frac`` over
    its last ``final_fraction`` of steps), ``key_norm_peak`` / ``state_norm_peak`` (per seed the largest
    logged ``memory/key_norm_max`` / ``memory/state_norm_max``; the median and the max across seeds),
    ``nonfinite_events`` (sum over seeds of the largest logged ``memory/nonfinite_events``, a running
    count), ``nonfinite_seeds`` (seeds with at least one), and ``value_target_final`` (mean across seeds of
    the final ``train/value_target_abs_mean``: the scale the critic has to fit).
    """
    def tail(tag: str) -> pd.Series:
        d = df[(df["tag"] == tag) & np.isfinite(df["value"])]
        return _tail_means(d, final_fraction).set_index(["env", "variant", "seed"])["final"]

    def peak(tag: str) -> pd.Series:
        return df[df["tag"] == tag].groupby(["env", "variant", "seed"])["value"].max()

    seeds = df[["env", "variant", "seed"]].drop_duplicates().set_index(["env", "variant", "seed"]).index
    columns = (tail("memory/gate_saturated_frac"), peak("memory/key_norm_max"), peak("memory/state_norm_max"),
               peak("memory/nonfinite_events"), tail("train/value_target_abs_mean"))
    per_seed_all = pd.concat([c.reindex(seeds) for c in columns], axis=1)
    rows = []
    for (env, variant), g in df.groupby(["env", "variant"], sort=True):
        if not g["tag"].isin(DIAGNOSTIC_TAGS).any():
            continue
        a = per_seed_all.loc[(env, variant)].to_numpy(np.float64)  # [seeds, 5]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns stay NaN
            rows.append({
                "env": env, "variant": variant, "n_seeds": len(a),
                "saturated_final": float(np.nanmean(a[:, 0])),
                "key_norm_peak_median": float(np.nanmedian(a[:, 1])), "key_norm_peak_max": float(np.nanmax(a[:, 1])),
                "state_norm_peak_median": float(np.nanmedian(a[:, 2])),
                "state_norm_peak_max": float(np.nanmax(a[:, 2])),
                "nonfinite_events": float(np.nansum(a[:, 3])), "nonfinite_seeds": int(np.sum(a[:, 3] > 0)),
                "value_target_final": float(np.nanmean(a[:, 4])),
            })
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    order = {v: i for i, v in enumerate(variant_order(out["variant"]))}
    return out.sort_values(["env", "variant"], key=lambda c: c.map(order) if c.name == "variant" else c
                           ).reset_index(drop=True)


# ---------------------------------------------------------------------------------- colours and order
def _base_memory(variant: str) -> str:
    return variant.split("-", 1)[0]


def variant_order(variants: Iterable[str]) -> list[str]:
    """efla, deltanet, lstm, none first (each followed by its tagged variants), then the rest sorted."""
    def key(v: str) -> tuple[int, str, int, str]:
        base = _base_memory(v)
        rank = MEMORY_ORDER.index(base) if base in MEMORY_ORDER else len(MEMORY_ORDER)
        return rank, base, int(v != base), v

    return sorted(set(variants), key=key)


def variant_styles(variants: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Colour by memory (fixed for efla/deltanet/lstm/none), line style by tag within a memory."""
    ordered = variant_order(variants)
    extra_bases = [b for b in dict.fromkeys(_base_memory(v) for v in ordered) if b not in MEMORY_COLORS]
    colors = dict(MEMORY_COLORS)
    colors.update({b: _EXTRA_COLORS[i % len(_EXTRA_COLORS)] for i, b in enumerate(extra_bases)})
    styles: dict[str, dict[str, Any]] = {}
    used: dict[str, int] = {}
    for v in ordered:
        b = _base_memory(v)
        k = used.get(b, 0)
        used[b] = k + 1
        styles[v] = {"color": colors[b], "linestyle": _LINESTYLES[k % len(_LINESTYLES)]}
    return styles


# -------------------------------------------------------------------------------------------- plotting
def _seed_curves(d: pd.DataFrame, n_points: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Interpolate every seed of ``d`` (one env, variant and tag) onto a common grid.

    The grid spans [latest first step, earliest last step] across seeds so no seed is extrapolated and
    every grid point averages all seeds. Returns (grid, values[seed, point]) or None if nothing is left.
    """
    d = d[np.isfinite(d["value"])]
    seeds = [g.sort_values("step") for _, g in d.groupby("seed")]
    if not seeds:
        return None
    start = max(float(g["step"].iloc[0]) for g in seeds)
    end = min(float(g["step"].iloc[-1]) for g in seeds)
    if end < start:  # seeds do not overlap at all
        return None
    grid = np.linspace(start, end, n_points) if end > start else np.array([start])
    vals = np.stack([np.interp(grid, g["step"].to_numpy(float), g["value"].to_numpy(float)) for g in seeds])
    return grid, vals


def _aggregate(vals: np.ndarray, how: str, reps: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(centre, low, high) across seeds at each grid point; low/high are NaN with a single seed."""
    n = vals.shape[0]
    nan = np.full(vals.shape[1], np.nan)
    if how == "mean-std":
        mean = vals.mean(axis=0)
        if n < 2:
            return mean, nan, nan
        std = vals.std(axis=0, ddof=1)
        return mean, mean - std, mean + std
    if how == "iqm":
        scores = vals[:, None, :]  # (runs, tasks=1, points)
        centre = _iqm_over_runs(scores)
        if n < 2:
            return centre, nan, nan
        lo, hi = _bootstrap_ci(scores, _iqm_over_runs, reps=reps, seed=seed)
        return centre, lo, hi
    if how == "mean-minmax":
        return vals.mean(axis=0), vals.min(axis=0), vals.max(axis=0)
    raise ValueError(f"unknown aggregate {how!r}")


def _grid_shape(n: int, max_cols: int = 4) -> tuple[int, int]:
    cols = min(n, max_cols)
    return math.ceil(n / cols), cols


def _style_steps_axis(ax: Any) -> None:
    from matplotlib.ticker import EngFormatter

    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 25M rather than 2.5e7
    ax.set_xlabel("env steps")
    ax.grid(alpha=0.3)


def plot_curves(
    df: pd.DataFrame,
    path: str | Path,
    *,
    metric: str = DEFAULT_METRIC,
    aggregate: str = "mean-std",
    n_points: int = 100,
    reps: int = 1000,
    seed: int = 0,
    panels: str = "env",
) -> Path:
    """Learning curves of ``metric``: one panel per env, one line per variant, one PNG at ``path``.

    ``panels="condition"``: one panel per (env, tag), e.g. ``caveflyer: reward1e3``, whose lines are the
    memories trained under that tag.

    ``aggregate="mean-std"``: mean ± std (ddof=1) across seeds. ``aggregate="iqm"``: IQM across seeds
    with a 95% stratified-bootstrap band (rliable, ``reps`` resamples, one bootstrap over all grid points
    at once so it stays cheap). Seeds are interpolated on ``n_points`` grid points, see
    :func:`_seed_curves`. Legend labels give the number of seeds.
    """
    if aggregate not in ("mean-std", "iqm"):
        raise ValueError(f"aggregate must be 'mean-std' or 'iqm', got {aggregate!r}")
    d_all = df[df["tag"] == metric]
    if d_all.empty:
        raise CompareError(f"metric {metric!r} not found in the event files")
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    if panels not in ("env", "condition"):
        raise ValueError(f"panels must be 'env' or 'condition', got {panels!r}")
    if panels == "condition":
        d_all = d_all.assign(env=d_all["env"] + d_all["variant"].map(lambda v: f": {_tag(v)}" if _tag(v) else ""))
        styles = {v: {"color": MEMORY_COLORS.get(_base_memory(v), _EXTRA_COLORS[0]), "linestyle": "-"}
                  for v in d_all["variant"].unique()}
    else:
        styles = variant_styles(d_all["variant"].unique())
    envs = sorted(d_all["env"].unique())
    rows, cols = _grid_shape(len(envs))
    width = 6.4 if cols == 1 else 5.2 * cols  # a lone panel gets room for a 3-column legend
    fig, axes = plt.subplots(rows, cols, figsize=(width, 3.6 * rows + 0.6), squeeze=False,
                             layout="constrained")
    # Seed counts per variant across envs, for the legend ("efla (n=3)" or "efla (n=2–3)").
    n_seeds = d_all.groupby(["variant", "env"])["seed"].nunique().groupby("variant").agg(["min", "max"])
    handles: dict[str, Any] = {}
    for ax, env in zip(axes.flat, envs):
        d_env = d_all[d_all["env"] == env]
        for variant in variant_order(d_env["variant"].unique()):
            d = d_env[d_env["variant"] == variant]
            curves = _seed_curves(d, n_points)
            if curves is None:
                continue
            grid, vals = curves
            centre, lo, hi = _aggregate(vals, aggregate, reps, seed)
            st = styles[variant]
            lo_n, hi_n = n_seeds.loc[variant]
            name = _base_memory(variant) if panels == "condition" else variant
            label = f"{name} (n={lo_n})" if lo_n == hi_n else f"{name} (n={lo_n}–{hi_n})"
            marker = "o" if len(grid) == 1 else None
            (line,) = ax.plot(grid, centre, color=st["color"], linestyle=st["linestyle"], lw=1.8,
                              marker=marker, label=label)
            if np.isfinite(lo).any():
                ax.fill_between(grid, lo, hi, color=st["color"], alpha=0.18, lw=0)
            handles[label] = line
        ax.set_title(env)
        ax.set_ylabel("return" if metric == DEFAULT_METRIC else metric)
        _style_steps_axis(ax)
    for ax in list(axes.flat)[len(envs):]:
        ax.set_visible(False)
    band = "mean ± std" if aggregate == "mean-std" else "IQM, 95% bootstrap CI"
    fig.suptitle(f"{metric} — {band} across seeds", fontsize=11)
    _finish(fig, handles, path)
    return Path(path)


def plot_diagnostics(df: pd.DataFrame, path: str | Path, *, n_points: int = 100) -> Path | None:
    """Memory diagnostics (tags in :data:`DIAGNOSTIC_TAGS` that exist): one row per env, one column per
    tag; mean across seeds with a min–max band, log y for the norms. Returns None (and writes nothing)
    when no diagnostic tag was logged."""
    tags = [t for t in DIAGNOSTIC_TAGS if t in set(df["tag"].unique())]
    if not tags:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d_all = df[df["tag"].isin(tags)]
    envs = sorted(d_all["env"].unique())
    styles = variant_styles(df["variant"].unique())
    fig, axes = plt.subplots(len(envs), len(tags), figsize=(4.4 * len(tags), 3.1 * len(envs) + 0.6),
                             squeeze=False, layout="constrained")
    handles: dict[str, Any] = {}
    for i, env in enumerate(envs):
        for j, tag in enumerate(tags):
            ax = axes[i, j]
            d_tag = d_all[(d_all["env"] == env) & (d_all["tag"] == tag)]
            for variant in variant_order(d_tag["variant"].unique()):
                curves = _seed_curves(d_tag[d_tag["variant"] == variant], n_points)
                if curves is None:
                    continue
                grid, vals = curves
                centre, lo, hi = _aggregate(vals, "mean-minmax", 0, 0)
                st = styles[variant]
                (line,) = ax.plot(grid, centre, color=st["color"], linestyle=st["linestyle"], lw=1.5,
                                  marker="o" if len(grid) == 1 else None)
                if vals.shape[0] > 1:
                    ax.fill_between(grid, lo, hi, color=st["color"], alpha=0.15, lw=0)
                handles[variant] = line
            if tag in LOG_SCALE_TAGS and (d_tag["value"] > 0).any():
                ax.set_yscale("log")
            ax.set_title(f"{env}: {tag.split('/', 1)[-1]}" if len(envs) > 1 else tag.split("/", 1)[-1],
                         fontsize=10)
            _style_steps_axis(ax)
    fig.suptitle("memory diagnostics — mean across seeds, band = min–max", fontsize=11)
    _finish(fig, handles, path)
    return Path(path)


def _finish(fig: Any, handles: dict[str, Any], path: str | Path) -> None:
    """One shared legend under the panels (constrained layout keeps it clear of the axes), save, close."""
    import matplotlib.pyplot as plt

    if handles:
        # About 2 inches per legend entry so long labels ("efla-reward1e3 (n=5)") are never clipped.
        ncol = max(1, min(len(handles), int(fig.get_figwidth() // 2.0)))
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=ncol,
                   frameon=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- markdown
def _num(x: float) -> str:
    if x is None or not np.isfinite(x):
        return "n/a"
    return f"{x:.2f}" if abs(x) >= 1 or x == 0 else f"{x:.3g}"


def _steps(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{int(x)}"


def to_markdown(summary: pd.DataFrame, *, metric: str = DEFAULT_METRIC, final_fraction: float = 0.1,
                reps: int = 2000, title: str | None = None) -> str:
    """Markdown report: one ``## <env>`` section with one table per env (columns see :func:`summarize`)."""
    lines = [f"# {title}" if title else "# rlseq comparison", ""]
    lines.append(
        f"Metric `{metric}`. Final = mean of each seed's points over the last {final_fraction:.0%} of its "
        f"env steps; mean and std (ddof=1) across seeds; IQM (25% trimmed mean, equals the mean below 4 "
        f"seeds) with 95% percentile stratified-bootstrap CI (rliable, {reps} reps); env-steps/s = mean "
        f"across seeds of each seed's median logged throughput. n/a: one seed, or not logged."
    )
    for env, s in summary.groupby("env", sort=True):
        lines += ["", f"## {env}", "",
                  "| variant | seeds | env steps | final mean | std | IQM | IQM 95% CI | median | env-steps/s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in s.itertuples(index=False):
            steps = _steps(r.steps_min) if r.steps_min == r.steps_max else \
                f"{_steps(r.steps_min)}–{_steps(r.steps_max)}"
            ci = "n/a" if not np.isfinite(r.iqm_ci_low) else f"[{_num(r.iqm_ci_low)}, {_num(r.iqm_ci_high)}]"
            tput = "n/a" if not np.isfinite(r.env_steps_per_s) else f"{r.env_steps_per_s:,.0f}"
            lines.append(f"| {r.variant} | {r.n_seeds} | {steps} | {_num(r.final_mean)} | {_num(r.final_std)} "
                         f"| {_num(r.iqm)} | {ci} | {_num(r.median)} | {tput} |")
    return "\n".join(lines) + "\n"


def _ci(lo: float, hi: float) -> str:
    return "n/a" if not (np.isfinite(lo) and np.isfinite(hi)) else f"[{_num(lo)}, {_num(hi)}]"


def baseline_markdown(rel: pd.DataFrame, baseline: str, *, reps: int = 2000) -> str:
    """Markdown table of :func:`relative_to_baseline`."""
    lines = [f"## Against {baseline} (same tag)", "",
             f"Ratios of the seeds' final values to {baseline}'s under the same tag. Mean ratio: 95% percentile "
             f"bootstrap CI ({reps} reps, seeds resampled within each group). Std ratio (ddof=1): 95% CI from the "
             f"F distribution of the variance ratio (normal final values assumed). P(improve) = rliable's probability that a run "
             f"of the variant ends above a run of {baseline}, with its stratified-bootstrap CI.", "",
             "| env | variant | vs | seeds | mean ratio | 95% CI | std ratio | 95% CI | P(improve) | 95% CI |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rel.itertuples(index=False):
        lines.append(f"| {r.env} | {r.variant} | {r.baseline} | {r.n} vs {r.n_base} | {_num(r.mean_ratio)} "
                     f"| {_ci(r.ratio_ci_low, r.ratio_ci_high)} | {_num(r.std_ratio)} "
                     f"| {_ci(r.std_ci_low, r.std_ci_high)} | {_num(r.p_improve)} | {_ci(r.p_ci_low, r.p_ci_high)} |")
    return "\n".join(lines) + "\n"


def diagnostics_markdown(diag: pd.DataFrame, *, final_fraction: float = 0.1) -> str:
    """Markdown table of :func:`diagnostics_summary`."""
    lines = ["## Memory diagnostics", "",
             f"saturated = fraction of gates saturated, mean over the last {final_fraction:.0%} of steps; peaks = "
             "largest logged per-batch maximum over the whole run (median [max] across seeds); non-finite = "
             "NaN/inf events in the memory state (runs with any / total events); |value target| = final mean "
             "absolute PPO return target.", "",
             "| env | variant | seeds | saturated | key norm peak | state norm peak | non-finite | |value target| |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in diag.itertuples(index=False):
        lines.append(f"| {r.env} | {r.variant} | {r.n_seeds} | {_num(r.saturated_final)} "
                     f"| {_sci(r.key_norm_peak_median)} [{_sci(r.key_norm_peak_max)}] "
                     f"| {_sci(r.state_norm_peak_median)} [{_sci(r.state_norm_peak_max)}] "
                     f"| {r.nonfinite_seeds} / {_num(r.nonfinite_events)} | {_sci(r.value_target_final)} |")
    return "\n".join(lines) + "\n"


def _sci(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.3g}"


# ------------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rlseq.compare",
        description="Compare rlseq runs (learning curves + final-return table) from TensorBoard event files. "
        + LAYOUT_HELP + ". Several inputs (runs trees and --save-scalars CSVs) are merged into one dataset; "
        "a run found in two of them is an error.",
    )
    p.add_argument("runs_dir", type=Path, nargs="+", metavar="RUNS_DIR",
                   help="runs/<env> (one env), runs/ (one panel/section per env) or a --save-scalars CSV; "
                        "several of them, in any mix, are merged (e.g. a saved part-1 CSV and a part-2 runs tree)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: RUNS_DIR, or its folder for a CSV; required with several inputs)")
    p.add_argument("--metric", default=DEFAULT_METRIC, help=f"scalar tag to compare (default {DEFAULT_METRIC})")
    p.add_argument("--final-fraction", type=float, default=0.1,
                   help="final return = mean over this last fraction of each seed's env steps (default 0.1)")
    p.add_argument("--aggregate", choices=("mean-std", "iqm"), default="mean-std",
                   help="curve aggregate across seeds (default mean-std)")
    p.add_argument("--reps", type=int, default=2000, help="bootstrap resamples for IQM CIs (default 2000)")
    p.add_argument("--points", type=int, default=100, help="grid points per learning curve (default 100)")
    p.add_argument("--baseline", default=None, metavar="MEMORY",
                   help="add a table of every variant against this memory under the same tag, e.g. deltanet")
    p.add_argument("--panels", choices=("env", "condition"), default="env",
                   help="one curve panel per env (default) or per env and tag (condition)")
    p.add_argument("--save-scalars", type=Path, default=None, metavar="FILE.csv.gz",
                   help="also write the rollout/, memory/, time/ and main train/ scalars of all inputs to this "
                        "CSV (RUNS_DIR may be such a file, even this one: it is replaced atomically)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; writes compare.png, compare_diagnostics.png (if any) and compare.md into --out."""
    args = _parser().parse_args(argv)
    inputs: list[Path] = args.runs_dir
    try:
        if args.out is not None:
            out: Path = args.out
        elif len(inputs) > 1:
            raise CompareError("--out is required with several inputs")
        else:
            out = inputs[0].parent if inputs[0].is_file() else inputs[0]
        missing = next((p for p in inputs if not p.is_file() and not p.is_dir()), None)
        if missing is not None:
            raise CompareError(f"runs directory not found: {missing}")
        if args.reps < 1 or args.points < 1:
            raise CompareError("--reps and --points must be >= 1")
        if args.baseline is not None and not re.fullmatch(r"[\w.]+", args.baseline):
            raise CompareError(f"--baseline takes a memory name such as deltanet, got {args.baseline!r}")
        df = load_inputs(inputs)  # every input is read before anything is written (--save-scalars may be one)
        summary = summarize(df, final_fraction=args.final_fraction, metric=args.metric, reps=args.reps)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        if args.save_scalars is not None:
            keep = df["tag"].str.match(r"(rollout|memory|time)/") | df["tag"].isin(SAVED_TRAIN_TAGS)
            _write_csv_atomic(df[keep], args.save_scalars)
            written.append(args.save_scalars)
        written.append(plot_curves(df, out / "compare.png", metric=args.metric, aggregate=args.aggregate,
                                   n_points=args.points, reps=args.reps, panels=args.panels))
        diag = plot_diagnostics(df, out / "compare_diagnostics.png", n_points=args.points)
        if diag is not None:
            written.append(diag)
        md = to_markdown(summary, metric=args.metric, final_fraction=args.final_fraction, reps=args.reps,
                         title="rlseq comparison: " + " + ".join(str(p) for p in inputs))
        if args.baseline is not None:
            finals = final_returns(df, final_fraction=args.final_fraction, metric=args.metric)
            rel = relative_to_baseline(finals, args.baseline, reps=args.reps)
            if rel.empty:
                raise CompareError(f"no variant has a {args.baseline} run under the same tag to compare with; "
                                   f"variants: {', '.join(variant_order(finals['variant']))}")
            md += "\n" + baseline_markdown(rel, args.baseline, reps=args.reps)
        dsum = diagnostics_summary(df, final_fraction=args.final_fraction)
        if not dsum.empty:
            md += "\n" + diagnostics_markdown(dsum, final_fraction=args.final_fraction)
        (out / "compare.md").write_text(md)
        written.append(out / "compare.md")
    except (CompareError, ValueError) as e:
        sys.exit(f"rlseq.compare: error: {e}")
    print(md, end="")
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    main()
