"""How far back can each memory recall when it is taught directly? A supervised probe of the memory block.

The memory benchmark (``python -m rlseq.bench memory``) asks whether PPO learns to use a memory; this probe asks
whether the memory can hold the answer at all. Each variant is the block every policy uses
(:func:`rlseq.policies.memory.make_memory` with its defaults; ``<memory>-conv1``: without the front end's window).
It reads sequences of random symbols (one-hot, ``--symbols`` of them: RepeatPrevious's four suits by default), and
a linear head on its output is trained by cross-entropy to name the symbol seen ``L`` steps before, at every step
``t >= L`` (RepeatPreviousLag L without RL). No exploration, no credit assignment, no value gradient: what a memory
does not learn here at this budget, PPO is unlikely to get from it, and what it does learn here but not under PPO
points at the training. Every sequence starts from the zero state (a reset at t = 0), as an episode does.

Reported: accuracy on fresh sequences (chance ``1 / symbols``) per variant and lag, the mean over seeds and each
seed's. Deterministic on the CPU for a given seed, torch version and thread count (one thread per job).

    python -m rlseq.bench recall                                   # the default grid, all cores
    python -m rlseq.bench recall --variants efla gru --lags 8 16 --seeds 0 --out runs/recall.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlseq.bench.memory import NO_WINDOW

DEFAULT_VARIANTS = ("efla", "deltanet", "gru", "lstm", "none")
DEFAULT_LAGS = (2, 4, 8, 16, 32)
DEFAULT_SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class RecallSettings:
    """What every cell of a grid shares. ``length`` is the sequence length T, ``batch`` the sequences per update,
    ``steps`` the Adam updates, ``eval_sequences`` the fresh sequences scored at the end."""

    symbols: int = 4
    length: int = 64
    batch: int = 32
    steps: int = 1500
    lr: float = 1e-3
    eval_sequences: int = 256
    d_model: int | None = None  # None: the block's default width
    memory_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # per memory name, as in a config


def variants() -> list[str]:
    """rlseq's memories and their no-window controls (``<memory>-conv1``)."""
    from rlseq.policies.memory import MEMORIES

    return [*MEMORIES, *(m + NO_WINDOW for m in MEMORIES)]


def _memory(variant: str, settings: RecallSettings) -> nn.Module:
    from rlseq.policies.memory import make_memory

    name = variant[: -len(NO_WINDOW)] if variant.endswith(NO_WINDOW) else variant
    kwargs: dict[str, Any] = {} if settings.d_model is None else {"d_model": settings.d_model}
    kwargs.update(settings.memory_kwargs.get(name, {}))
    if variant.endswith(NO_WINDOW):
        kwargs["conv_size"] = 1
    return make_memory(name, settings.symbols, **kwargs)


def _sequences(n: int, s: RecallSettings, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences: one-hot inputs ``[n, T, symbols]`` and the symbols ``[n, T]``."""
    symbols = torch.randint(0, s.symbols, (n, s.length), generator=gen)
    return F.one_hot(symbols, s.symbols).float(), symbols


def recall_cell(variant: str, lag: int, seed: int, settings: RecallSettings) -> dict[str, Any]:
    """Train one variant on one lag from one seed; returns the cell's record (``accuracy`` on fresh sequences,
    ``loss`` of the last update, ``params``, ``wall_s``)."""
    if not 1 <= lag < settings.length:
        raise ValueError(f"lag {lag} must be in [1, length={settings.length})")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    memory = _memory(variant, settings)
    head = nn.Linear(memory.out_features, settings.symbols)
    params = [*memory.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=settings.lr)
    data = torch.Generator().manual_seed(seed)
    test = torch.Generator().manual_seed(2**31 - 1 - seed)  # never the training stream

    def logits_and_targets(x: torch.Tensor, symbols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = x.shape[0]
        resets = torch.zeros(B, settings.length, dtype=torch.bool)
        resets[:, 0] = True
        y, _ = memory(x, memory.initial_state(B), resets)
        return head(y)[:, lag:], symbols[:, :-lag]  # the step t answers with the symbol of t - lag

    loss = torch.tensor(float("nan"))
    for _ in range(settings.steps):
        logits, target = logits_and_targets(*_sequences(settings.batch, settings, data))
        loss = F.cross_entropy(logits.reshape(-1, settings.symbols), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"recall {variant} lag {lag} seed {seed}: the loss became {loss.item()}")
    with torch.no_grad():
        logits, target = logits_and_targets(*_sequences(settings.eval_sequences, settings, test))
        accuracy = (logits.argmax(-1) == target).float().mean().item()
    return {"variant": variant, "lag": lag, "seed": seed, "accuracy": accuracy, "loss": loss.item(),
            "params": sum(p.numel() for p in params), "wall_s": time.perf_counter() - t0, "torch": torch.__version__}


def _worker(cell: tuple[str, int, int, RecallSettings]) -> dict[str, Any]:
    """One cell on one thread (the same floating-point reductions in every job), leaving the calling process's
    thread count and random state as they were."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return recall_cell(*cell)
    finally:
        torch.set_num_threads(threads)


def run_grid(variant_names: list[str], lags: list[int], seeds: list[int], settings: RecallSettings, *,
             jobs: int = 1, on_result=None, done: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Every (variant, lag, seed) cell, ``jobs`` side by side; ``on_result(record)`` as each one ends. Cells with a
    record in ``done`` (made with the same ``settings``) are not run again; their records are returned too."""
    variant_names, lags, seeds = (list(dict.fromkeys(x)) for x in (variant_names, lags, seeds))  # no cell twice
    known = variants()
    unknown = [v for v in variant_names if v not in known]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    for v in variant_names:  # a keyword a block does not take fails here, before any cell runs
        try:
            _memory(v, settings)
        except TypeError as e:
            raise ValueError(f"{v}: {e}") from None
    bad = [lag for lag in lags if not 1 <= lag < settings.length]
    if bad:
        raise ValueError(f"lag(s) {', '.join(map(str, bad))} outside [1, length={settings.length}): a lag must "
                         "leave steps to answer at")
    wanted = [(v, lag, s) for s in seeds for lag in lags for v in variant_names]
    have = {(r["variant"], r["lag"], r["seed"]): r for r in done}
    records = [have[key] for key in wanted if key in have]
    cells = [(*key, settings) for key in wanted if key not in have]
    if jobs <= 1 or len(cells) <= 1:
        for cell in cells:
            records.append(_worker(cell))
            if on_result:
                on_result(records[-1])
        return records
    # spawned, not forked: no fork of a process that may hold torch's threads; each record as its cell ends
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(cells)), mp_context=multiprocessing.get_context("spawn"))
    try:
        for future in as_completed([pool.submit(_worker, cell) for cell in cells]):
            records.append(future.result())  # a failed cell raises here; the finished ones are already kept
            if on_result:
                on_result(records[-1])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    order = {key: i for i, key in enumerate(wanted)}
    return sorted(records, key=lambda r: order[(r["variant"], r["lag"], r["seed"])])


def table(records: list[dict[str, Any]], symbols: int) -> str:
    """Markdown: one row per variant, one column per lag; each cell the mean accuracy over seeds and the seeds'."""
    lags = sorted({r["lag"] for r in records})
    names = list(dict.fromkeys(r["variant"] for r in records))
    lines = ["| variant | params | " + " | ".join(f"L={lag}" for lag in lags) + " |",
             "|---|---:|" + "---:|" * len(lags),
             "| chance | | " + " | ".join(f"{1 / symbols:.2f}" for _ in lags) + " |"]
    for name in names:
        cells = []
        for lag in lags:
            accs = [r["accuracy"] for r in sorted(records, key=lambda r: r["seed"])
                    if r["variant"] == name and r["lag"] == lag]
            cells.append(f"{sum(accs) / len(accs):.2f} ({' / '.join(f'{a:.2f}' for a in accs)})" if accs else "–")
        params = next(r["params"] for r in records if r["variant"] == name)
        lines.append(f"| {name} | {params:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    d = RecallSettings()
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), metavar="VARIANT",
                        help=f"rlseq memories, each also as <memory>{NO_WINDOW} (no window); default: "
                             f"{' '.join(DEFAULT_VARIANTS)}")
    parser.add_argument("--lags", nargs="+", type=int, default=list(DEFAULT_LAGS),
                        help=f"default: {' '.join(map(str, DEFAULT_LAGS))}")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS),
                        help=f"default: {' '.join(map(str, DEFAULT_SEEDS))}")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"Adam updates per cell (default {d.steps})")
    parser.add_argument("--batch", type=int, default=d.batch, help=f"sequences per update (default {d.batch})")
    parser.add_argument("--length", type=int, default=d.length, help=f"sequence length (default {d.length})")
    parser.add_argument("--symbols", type=int, default=d.symbols, help=f"alphabet size (default {d.symbols})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"Adam learning rate (default {d.lr})")
    parser.add_argument("--d-model", type=int, default=None, help="block width (default: the block's)")
    parser.add_argument("--eval-sequences", type=int, default=d.eval_sequences,
                        help=f"fresh sequences scored per cell (default {d.eval_sequences})")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="a training config (e.g. configs/ablations/*.yml): its memory_kwargs (per memory name) "
                             "go to the blocks; its other entries do not apply to this probe")
    parser.add_argument("--jobs", type=int, default=None, help="cells side by side, one core each (default: the cores)")
    parser.add_argument("--out", default=None,
                        help="also write the settings and every cell's record to this JSON file, after each cell; "
                             "the same command again runs only the cells it lacks")


def _config_memory_kwargs(path: str) -> dict[str, dict[str, Any]]:
    """The ``memory_kwargs`` of a training config's ``popgym`` entry; says which other entries it leaves out."""
    from rlseq.config import UsageError, load_config

    try:
        entry = load_config(Path(path), "recall", family="popgym")
    except UsageError as e:
        raise SystemExit(f"error: {e}") from None
    kwargs = entry.pop("memory_kwargs", None) or {}
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) for v in kwargs.values()):
        raise SystemExit(f"error: {path}: memory_kwargs must map memory names to keyword mappings, e.g. "
                         "{efla: {n_heads: 8}}")
    if entry:
        print(f"{path}: not used by the recall probe: {', '.join(sorted(entry))}")
    return kwargs


def main(args: argparse.Namespace) -> None:
    settings = RecallSettings(symbols=args.symbols, length=args.length, batch=args.batch, steps=args.steps,
                              lr=args.lr, eval_sequences=args.eval_sequences, d_model=args.d_model,
                              memory_kwargs=_config_memory_kwargs(args.config) if args.config else {})
    for name in ("steps", "batch", "symbols", "eval_sequences"):
        if getattr(settings, name) < 1 or (name == "symbols" and settings.symbols < 2):
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= {2 if name == 'symbols' else 1}")
    jobs = args.jobs or os.cpu_count() or 1
    t0 = time.perf_counter()
    path = Path(args.out) if args.out else None
    saved = _saved_records(path, settings) if path else []
    if saved:
        print(f"{path}: {len(saved)} cell(s) already there, made with the same settings: those of this grid are "
              "not run again")
    records = list(saved)

    def keep(r: dict[str, Any]) -> None:
        print(f"{r['variant']:>12} L={r['lag']:<3} seed {r['seed']}: accuracy {r['accuracy']:.3f} "
              f"({r['wall_s']:.0f} s)", flush=True)
        records.append(r)
        if path:  # after every cell, atomically: a grid stopped halfway keeps what it measured
            _write(path, settings, records)

    try:
        grid = run_grid(args.variants, args.lags, args.seeds, settings, jobs=jobs, on_result=keep, done=saved)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print()
    print(table(grid, settings.symbols))
    print(f"\n{len(grid)} cells ({len(records) - len(saved)} run now), {jobs} job(s), "
          f"{(time.perf_counter() - t0) / 60:.1f} min; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}")
    if path:
        _write(path, settings, records)
        print(f"wrote {path}")


def _saved_records(path: Path, settings: RecallSettings) -> list[dict[str, Any]]:
    """The records of an earlier invocation's ``--out`` file, refused if it was made with other settings."""
    if not path.exists():
        return []
    try:
        body = json.loads(path.read_text())
        saved_settings, records = dict(body["settings"]), [dict(r) for r in body["records"]]
        for r in records:
            r["variant"], r["lag"], r["seed"], r["accuracy"]  # noqa: B018  (a record has these)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"error: {path} is not a recall probe's output ({type(e).__name__}: {e}); give another "
                         "--out") from None
    now = asdict(settings)
    if saved_settings != now:
        differ = sorted(k for k in {*now, *saved_settings} if saved_settings.get(k) != now.get(k))
        raise SystemExit(f"error: {path} holds cells made with other settings ({', '.join(differ)} differ): "
                         "results of different settings are not mixed; give another --out")
    versions = sorted({r.get("torch", body.get("torch")) for r in records} - {torch.__version__}, key=str)
    if versions:
        raise SystemExit(f"error: {path} holds cells made under torch {', '.join(map(str, versions))}, this is "
                         f"{torch.__version__}: a cell repeats only under the same version; give another --out")
    return records


def _write(path: Path, settings: RecallSettings, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"settings": asdict(settings), "records": records}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(path)
