"""Loading: runs trees of TensorBoard event files and saved scalar CSVs into one long DataFrame.

Layout (written by the training CLI)::

    runs/<env>/<memory>[-<tag>]/seed<N>/events.out.tfevents.*   (+ config.yaml)

Every event file under a root is attributed to its nearest ancestor folder named ``seed<N>``; that folder's
parent names the *variant* (``efla``, ``efla-reward1e3``, ...) and its grandparent the *env*. So the root may
be ``runs/`` (all envs), ``runs/<env>`` (the usual case), ``runs/<env>/<variant>`` or a single seed folder;
event files in sub-folders of a seed folder (e.g. SB3's ``PPO_1/``) still count. Nothing is dropped
silently: event files under no ``seed<N>`` folder, files the reader cannot read in full (see
:mod:`rlseq.compare.records`) and runs left with no scalars are each named in a warning.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from rlseq.compare.common import COLUMNS, LAYOUT_HELP, SAVED_TRAIN_TAGS, CompareError
from rlseq.compare.records import EventFileScan, scan_event_file

_SEED_RE = re.compile(r"^seed(\d+)$")
_EVENT_GLOB = "events.out.tfevents.*"


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
    """Scalars of one event file (step, tag, value, wall_time) via tbparse.

    Warns (naming the file) when the file cannot be read at all or when the reader returns fewer points than
    the file's intact records hold (a cut-off or damaged record stops TensorBoard's reader silently); what
    could be read is returned either way.
    """
    from tbparse import SummaryReader  # imported here: only loading needs it

    path = Path(path)
    try:
        df = SummaryReader(str(path), pivot=False, extra_columns={"wall_time"}).scalars
    except Exception as e:  # noqa: BLE001 - any reader failure means the same to the user: this file is skipped
        warnings.warn(f"{path}: could not be read ({type(e).__name__}: {e}); skipped", stacklevel=2)
        df = pd.DataFrame()
    else:
        problem = _damage_message(path, scan_event_file(path), kept=len(df))
        if problem:
            warnings.warn(problem, stacklevel=2)
    if df.empty:
        return pd.DataFrame({"step": [], "tag": [], "value": [], "wall_time": []})
    return df[["step", "tag", "value", "wall_time"]].astype(
        {"step": "int64", "tag": object, "value": "float64", "wall_time": "float64"}
    )


def _damage_message(path: Path, scan: EventFileScan, *, kept: int) -> str | None:
    """What the reader lost from ``path`` (``kept`` points read), or None when it read every point."""
    lost = scan.n_points - kept  # points in intact records that the reader did not return
    if scan.damage_at is None and lost <= 0:
        return None
    if scan.n_records == 0:
        return f"{path}: not a readable TensorBoard event file (no intact record in its {scan.size} bytes); skipped"
    if scan.damage_at is None:
        return (f"{path}: {lost} of {scan.n_points} scalar point(s) could not be read (a record fails its "
                f"checksum, and the reader stops there); {kept} kept")
    if scan.reason == "truncated record" and lost <= 0 and scan.damage_at + scan.unreadable_bytes == scan.size:
        return (f"{path}: the last record is cut off at byte {scan.damage_at} of {scan.size} (a write that did not "
                f"finish): what it held is lost; {kept} scalar point(s) kept")
    return (f"{path}: damaged at byte {scan.damage_at} of {scan.size} ({scan.reason}) and the reader stops there: "
            f"{lost} scalar point(s) in intact records after it are lost, plus what the {scan.unreadable_bytes} "
            f"unreadable byte(s) held; {kept} kept")


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
            warnings.warn(f"run {env}/{variant}/seed{seed} has no readable scalars in its {len(files)} event "
                          "file(s); left out", stacklevel=2)
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


def save_scalars(df: pd.DataFrame, path: Path) -> None:
    """Write the rollout/, memory/, time/ and :data:`SAVED_TRAIN_TAGS` rows of ``df`` to ``path`` (CSV, gzipped
    for a ``.gz`` name) for :func:`load_scalars`: enough to redo every figure and table."""
    keep = df["tag"].str.match(r"(rollout|memory|time)/") | df["tag"].isin(SAVED_TRAIN_TAGS)
    _write_csv_atomic(df[keep], path)


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
