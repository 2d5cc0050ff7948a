"""Compare training runs of different memories from their TensorBoard event files.

Usage::

    python -m rlseq.compare runs/caveflyer            # one env: one panel
    python -m rlseq.compare runs                      # several envs: one panel / table section per env
    python -m rlseq.compare runs/caveflyer --aggregate iqm --reps 2000 --out /tmp/cmp
    python -m rlseq.compare part1_scalars.csv.gz /tmp/part2/runs/caveflyer --out docs/results   # merge parts

Layout (written by the training CLI): ``runs/<env>/<memory>[-<tag>]/seed<N>/events.out.tfevents.*``; see
:mod:`rlseq.compare.load` for how files map to (env, variant, seed) and what is warned about.

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
  (:func:`relative_to_baseline`; variants with no such run are named in a warning and under the table),
  and when diagnostics were logged a third one summarises them (:func:`diagnostics_summary`).
* ``--save-scalars FILE.csv.gz`` writes the loaded scalars (columns ``env, variant, seed, step, tag,
  value``; written atomically, so it may overwrite one of the input CSVs), and RUNS_DIR may be such a
  file: a committed summary then reproduces every figure and table without the raw event files.
* ``--panels condition`` draws one panel per (env, tag) with one line per memory, instead of one panel
  per env.

Modules: :mod:`~rlseq.compare.load` (event files and CSVs in), :mod:`~rlseq.compare.records` (what a damaged
event file loses), :mod:`~rlseq.compare.stats`, :mod:`~rlseq.compare.plots`, :mod:`~rlseq.compare.report`
(markdown), :mod:`~rlseq.compare.cli`. The names below are the public API; ``_read_event_file`` and
``_merge_resumed`` are re-exported for :mod:`rlseq.bench`, ``_rliable`` for the tests.
"""

from rlseq.compare.cli import main
from rlseq.compare.common import (COLUMNS, DEFAULT_METRIC, DIAGNOSTIC_TAGS, LAYOUT_HELP, LOG_SCALE_TAGS,
                                  MEMORY_ORDER, SAVED_TRAIN_TAGS, THROUGHPUT_TAGS, CompareError, variant_order)
from rlseq.compare.load import _merge_resumed, _read_event_file, load_inputs, load_runs, load_scalars, save_scalars
from rlseq.compare.plots import MEMORY_COLORS, plot_curves, plot_diagnostics, variant_styles
from rlseq.compare.records import EventFileScan, scan_event_file
from rlseq.compare.report import baseline_markdown, diagnostics_markdown, to_markdown
from rlseq.compare.stats import (_rliable, diagnostics_summary, final_returns, relative_to_baseline, summarize,
                                 without_baseline)

__all__ = [
    "COLUMNS", "DEFAULT_METRIC", "DIAGNOSTIC_TAGS", "LAYOUT_HELP", "LOG_SCALE_TAGS", "MEMORY_COLORS", "MEMORY_ORDER",
    "SAVED_TRAIN_TAGS", "THROUGHPUT_TAGS", "CompareError", "EventFileScan", "baseline_markdown",
    "diagnostics_markdown", "diagnostics_summary", "final_returns", "load_inputs", "load_runs", "load_scalars",
    "main", "plot_curves", "plot_diagnostics", "relative_to_baseline", "save_scalars", "scan_event_file",
    "summarize", "to_markdown", "variant_order", "variant_styles", "without_baseline",
    # used by rlseq.bench (memory benchmark): one event reader for the whole project; rliable for the tests
    "_merge_resumed", "_read_event_file", "_rliable",
]
