"""Figures: learning curves per env (or per env and tag) and the memory-diagnostic panels, as PNG files."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlseq.compare.common import (DEFAULT_METRIC, DIAGNOSTIC_LABELS, DIAGNOSTIC_TAGS, LOG_SCALE_TAGS, MEMORY_ORDER,
                                  CompareError, _base_memory, _tag, variant_order)
from rlseq.compare.stats import _aggregate, _seed_curves

# Fixed colours per memory so every figure of the project reads the same way.
MEMORY_COLORS = dict(zip(MEMORY_ORDER, ("#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f")))
_EXTRA_COLORS = ("#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
_LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 3)))
_MARKERS = ("o", "s", "^", "D", "v", "P")  # for a lone point, whose line style does not show
# reference levels (chance): black, since `none` is grey and every other colour may be a memory's
REFERENCE_COLOR = "black"


def variant_styles(variants: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Colour by memory (fixed for efla/deltanet/lstm/none), line style and marker by tag within a memory."""
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
        styles[v] = {"color": colors[b], "linestyle": _LINESTYLES[k % len(_LINESTYLES)],
                     "marker": _MARKERS[k % len(_MARKERS)]}
    return styles


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
    references: dict[str, float] | None = None,
    reference_label: str = "random actions",
) -> Path:
    """Learning curves of ``metric``: one panel per env, one line per variant, one PNG at ``path``.

    ``panels="condition"``: one panel per (env, tag), e.g. ``caveflyer: reward1e3``, whose lines are the
    memories trained under that tag.

    ``aggregate="mean-std"``: mean ± std (ddof=1) across seeds. ``aggregate="iqm"``: IQM across seeds
    with a 95% stratified-bootstrap band (rliable, ``reps`` resamples, one bootstrap over all grid points
    at once so it stays cheap). Seeds are interpolated on ``n_points`` grid points, see
    :func:`_seed_curves`. Legend labels give the number of seeds; with one seed everywhere the title says so
    (no band). ``references``: panel name -> a level drawn as a dotted line (``reference_label``), e.g. the
    return of random actions.
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
        styles = {v: {"color": MEMORY_COLORS.get(_base_memory(v), _EXTRA_COLORS[0]), "linestyle": "-", "marker": "o"}
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
            marker = st["marker"] if len(grid) == 1 else None
            (line,) = ax.plot(grid, centre, color=st["color"], linestyle=st["linestyle"], lw=1.8,
                              marker=marker, label=label)
            if np.isfinite(lo).any():
                ax.fill_between(grid, lo, hi, color=st["color"], alpha=0.18, lw=0)
            handles[label] = line
        if references and env in references:
            handles[reference_label] = ax.axhline(references[env], color=REFERENCE_COLOR, linestyle=":", lw=1.2,
                                                  label=reference_label)
        ax.set_title(env)
        ax.set_ylabel("return" if metric == DEFAULT_METRIC else metric)
        _style_steps_axis(ax)
    for ax in list(axes.flat)[len(envs):]:
        ax.set_visible(False)
    if int(n_seeds["max"].max()) == 1:
        title = f"{metric} — one seed"
    else:
        band = "mean ± std" if aggregate == "mean-std" else "IQM, 95% bootstrap CI"
        title = f"{metric} — {band} across seeds"
    fig.suptitle(title, fontsize=11)
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
                                  marker=st["marker"] if len(grid) == 1 else None)
                if vals.shape[0] > 1:
                    ax.fill_between(grid, lo, hi, color=st["color"], alpha=0.15, lw=0)
                handles[variant] = line
            if tag in LOG_SCALE_TAGS and (d_tag["value"] > 0).any():
                ax.set_yscale("log")
            ax.set_title(f"{env}: {tag.split('/', 1)[-1]}" if len(envs) > 1 else tag.split("/", 1)[-1],
                         fontsize=10)
            ax.set_ylabel(DIAGNOSTIC_LABELS[tag])
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
