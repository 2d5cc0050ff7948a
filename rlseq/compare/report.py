"""Markdown: the per-env final-return tables, the table against a baseline memory and the diagnostics table."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from rlseq.compare.common import DEFAULT_METRIC


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


def baseline_markdown(rel: pd.DataFrame, baseline: str, *, reps: int = 2000, missing: Sequence[str] = ()) -> str:
    """Markdown table of :func:`relative_to_baseline`; ``missing`` (``env/variant`` names, see
    :func:`without_baseline`) are listed under it as left out."""
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
    if missing:
        lines += ["", f"Left out (no {baseline} run under the same tag in the same env): {', '.join(missing)}."]
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
