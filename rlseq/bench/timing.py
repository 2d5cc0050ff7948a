"""Timing helpers: warm-up, then the median of many repeats; CUDA events on the GPU."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, repeats: int = 20) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def interleaved_median_ms(
    fns: dict[str, Callable[[], object]], device: torch.device, *, warmup: dict[str, int], repeats: int
) -> dict[str, float]:
    """Median wall time in ms of each of ``fns``, timed round-robin: after ``warmup[name]`` calls each, every round
    runs each function once untimed and then once timed.

    Round-robin puts every function through the same machine state (a shared VM's speed drifts by up to 2x
    within minutes), and the untimed call re-warms a function's own allocations and worker threads after the
    others ran: a timed call never directly follows another function's call.
    """
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for name, fn in fns.items():
        for _ in range(warmup[name]):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def describe_environment(device: torch.device) -> str:
    """One line naming the device and the versions that produced a table."""
    import platform

    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        import os

        where = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    return f"device: {where}; python {platform.python_version()}; " + ", ".join(parts)


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
