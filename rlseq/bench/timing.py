"""What the speed benches share: round-robin timing, the CUDA-graph replay time, the line naming the machine and
the markdown table rows."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def round_robin(fns: Sequence[Callable[[], object]], rounds: int, *, warmup: int = 0,
                before: Sequence[Callable[[], object]] | None = None) -> list[list[float]]:
    """Seconds of every timed call of each of ``fns``: ``warmup`` untimed calls each, then ``rounds`` rounds that
    call every function once, the round's first function rotating.

    Round-robin puts every function through the same machine state (a shared VM's speed drifts by up to 2x within
    minutes). ``before[i]()`` runs untimed right before each timed call of ``fns[i]``: it re-warms that function's
    allocations and worker threads after the others ran. A function that runs on a GPU synchronises it itself.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for j in range(len(fns)):
            i = (r + j) % len(fns)
            if before is not None:
                before[i]()
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return times


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_environment(device: torch.device) -> str:
    """One line naming the device and the versions that produced a table."""
    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"CPU ({cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    return f"device: {where}; python {platform.python_version()}; " + ", ".join(parts)


def row(*cells: object) -> str:
    """One markdown table row."""
    return "| " + " | ".join(map(str, cells)) + " |"


def graph_ms(fn: Callable[[], object], leaves: list[torch.Tensor]) -> float:
    """``do_bench`` median of ``fn`` (a fwd+bwd) captured once in a CUDA graph and replayed: the device time of
    its kernels without the host's launch work, as a graph-captured training step would run them. ``leaves`` get
    ``grad = None`` before the capture (the graph then owns their gradients). NaN when the capture fails."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as err:
        print(f"graph capture failed: {err}", flush=True)
        return float("nan")
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
