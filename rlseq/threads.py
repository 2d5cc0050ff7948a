"""How many intra-op threads torch uses in a trainer or a speed benchmark: one, unless asked.

torch's own default is one thread per core. A training step of a memory agent is many small operations (a rollout
step is ``n_envs`` rows), where a second thread adds synchronisation rather than speed, and where torch's spinning
workers collapse once another process holds a core: on a 2-core VM with one other busy process, CartPole-v1 with
``--memory efla`` trained at 942 env-steps/s with torch's default and at 3,271 with one thread (docs/benchmarks.md).
One thread per process also lets side-by-side runs (``sweep``, ``bench memory --jobs``) share the cores without
oversubscribing them. A CNN run on a CPU that nothing else uses gains from more (procgen's IMPALA CNN: about 2x
with two threads on the idle VM, 0.6x beside one busy process): ask for them with ``--torch-threads N`` or
``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

DEFAULT_TORCH_THREADS = 1


def torch_threads(asked: int | None, environ: Mapping[str, str] | None = None) -> int:
    """``asked`` (the flag) if given, else a valid ``OMP_NUM_THREADS`` (a sweep sets it per run), else
    :data:`DEFAULT_TORCH_THREADS`."""
    if asked is not None:
        return asked
    text = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 else DEFAULT_TORCH_THREADS


def set_torch_threads(asked: int | None) -> int:
    """Apply :func:`torch_threads` to this process; returns the count (a bad ``asked`` ends it with one line)."""
    import torch

    if asked is not None and asked < 1:
        raise SystemExit(f"error: --torch-threads {asked} must be >= 1")
    threads = torch_threads(asked)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def add_torch_threads_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--torch-threads`` flag, with the same default rule wherever it appears."""
    parser.add_argument("--torch-threads", type=int, default=None, metavar="N",
                        help="torch intra-op threads (default: OMP_NUM_THREADS if set, else "
                             f"{DEFAULT_TORCH_THREADS}: small per-step tensors gain nothing from more, and torch's "
                             "one-per-core default collapses when another process holds a core)")
