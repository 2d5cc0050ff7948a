"""Statistics: per-seed final values, IQM with rliable's stratified-bootstrap CIs, comparisons with a
baseline memory, memory-diagnostic summaries, and the per-seed curves the figures aggregate."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pandas as pd

from rlseq.compare.common import (DEFAULT_METRIC, DIAGNOSTIC_TAGS, THROUGHPUT_TAGS, CompareError, _base_memory,
                                  _tag, variant_order)


def _rliable() -> tuple[Any, Any]:
    """rliable's ``library`` and ``metrics`` modules (imported lazily: they pull scipy, arch and seaborn).

    rliable pins ``arch<8``, whose import fails under pandas 3; pyproject.toml pins ``pandas<3`` for that.
    """
    from rliable import library, metrics

    return library, metrics


@contextmanager
def _seeded_global_rng(seed: int) -> Iterator[None]:
    """Seed the global ``np.random`` for the block and restore its state afterwards.

    rliable's StratifiedBootstrap draws its indices from the *global* generator (``random_state`` only
    reaches arch), so this is what makes its CIs reproducible without disturbing the caller's draws.
    """
    saved = np.random.get_state()
    try:
        np.random.seed(seed)
        with warnings.catch_warnings():
            # arch warns that random_state is deprecated; rliable only passes it on.
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        np.random.set_state(saved)


def _bootstrap_ci(
    scores: np.ndarray, func: Callable[[np.ndarray], np.ndarray], *, reps: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """95% percentile stratified-bootstrap CI of ``func(scores)`` via rliable (runs on axis 0)."""
    library, _ = _rliable()
    with _seeded_global_rng(seed):
        _, ci = library.get_interval_estimates(
            {"x": scores}, func, reps=reps, random_state=np.random.RandomState(seed)
        )
    return ci["x"][0], ci["x"][1]


def _iqm_over_runs(scores: np.ndarray) -> np.ndarray:
    """IQM across runs (axis 0) at every trailing position of a (runs, 1, points) array.

    Vectorised form of ``rliable.metrics.aggregate_iqm`` applied to ``scores[:, :, j]`` for each j
    (both are scipy's 25% ``trim_mean``); the loop version costs reps × points calls.
    """
    from scipy.stats import trim_mean

    return np.atleast_1d(trim_mean(scores.reshape(scores.shape[0], -1), 0.25, axis=0))


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
    for env, variant, base in _baseline_pairs(finals, baseline):
        g = finals[(finals["env"] == env) & (finals["variant"] == variant)]
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
            with _seeded_global_rng(seed):
                _, ci = library.get_interval_estimates(
                    {"x": (x[:, None], y[:, None])},
                    lambda a, c: np.array([metrics.probability_of_improvement(a, c)]), reps=reps)
            row["p_ci_low"], row["p_ci_high"] = float(ci["x"][0][0]), float(ci["x"][1][0])
        rows.append(row)
    return pd.DataFrame(rows)


def _baseline_pairs(finals: pd.DataFrame, baseline: str) -> list[tuple[str, str, str]]:
    """(env, variant, the baseline variant under its tag) for every variant of another memory than ``baseline``."""
    pairs = finals[["env", "variant"]].drop_duplicates().sort_values(["env", "variant"])
    return [(env, v, f"{baseline}-{_tag(v)}" if _tag(v) else baseline)
            for env, v in pairs.itertuples(index=False) if _base_memory(v) != baseline]


def without_baseline(finals: pd.DataFrame, baseline: str) -> list[str]:
    """``env/variant`` of every variant that :func:`relative_to_baseline` leaves out: no ``baseline`` run under
    its tag in its env (e.g. ``efla-value1e4`` when only ``deltanet`` and ``deltanet-reward1e3`` ran)."""
    have = set(finals[["env", "variant"]].itertuples(index=False, name=None))
    return [f"{env}/{v}" for env, v, base in _baseline_pairs(finals, baseline) if (env, base) not in have]


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
