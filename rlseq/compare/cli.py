"""Command line: ``python -m rlseq.compare RUNS_DIR... [--out DIR] [--aggregate iqm] [--baseline MEMORY] ...``."""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from rlseq.compare.common import DEFAULT_METRIC, LAYOUT_HELP, CompareError, variant_order
from rlseq.compare.load import load_inputs, save_scalars
from rlseq.compare.plots import plot_curves, plot_diagnostics
from rlseq.compare.report import baseline_markdown, diagnostics_markdown, to_markdown
from rlseq.compare.stats import (diagnostics_summary, final_returns, relative_to_baseline, summarize,
                                 without_baseline)


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
        # every table is computed before anything is written, so a bad --metric or --baseline leaves no files
        summary = summarize(df, final_fraction=args.final_fraction, metric=args.metric, reps=args.reps)
        md = to_markdown(summary, metric=args.metric, final_fraction=args.final_fraction, reps=args.reps,
                         title="rlseq comparison: " + " + ".join(str(p) for p in inputs))
        if args.baseline is not None:
            md += "\n" + _baseline_section(df, args)
        dsum = diagnostics_summary(df, final_fraction=args.final_fraction)
        if not dsum.empty:
            md += "\n" + diagnostics_markdown(dsum, final_fraction=args.final_fraction)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        if args.save_scalars is not None:
            save_scalars(df, args.save_scalars)
            written.append(args.save_scalars)
        written.append(plot_curves(df, out / "compare.png", metric=args.metric, aggregate=args.aggregate,
                                   n_points=args.points, reps=args.reps, panels=args.panels))
        diag = plot_diagnostics(df, out / "compare_diagnostics.png", n_points=args.points)
        if diag is not None:
            written.append(diag)
        (out / "compare.md").write_text(md)
        written.append(out / "compare.md")
    except (CompareError, ValueError) as e:
        sys.exit(f"rlseq.compare: error: {e}")
    print(md, end="")
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def _baseline_section(df: pd.DataFrame, args: argparse.Namespace) -> str:
    """The --baseline table. Variants with no baseline run under their tag are named in a warning and under
    the table; none at all is an error that lists the variants."""
    finals = final_returns(df, final_fraction=args.final_fraction, metric=args.metric)
    rel = relative_to_baseline(finals, args.baseline, reps=args.reps)
    if rel.empty:
        raise CompareError(f"no variant has a {args.baseline} run under the same tag to compare with; "
                           f"variants: {', '.join(variant_order(finals['variant']))}")
    missing = without_baseline(finals, args.baseline)
    if missing:
        warnings.warn(f"--baseline {args.baseline}: no {args.baseline} run under the same tag for "
                      f"{', '.join(missing)}; left out of the baseline table", stacklevel=2)
    return baseline_markdown(rel, args.baseline, reps=args.reps, missing=missing)
