"""``python -m rlseq.bench gpu-check`` (also ``python -m rlseq.bench.gpu_check``): the shipped Triton path on a GPU.

1. Correctness: ``chunk_rule(backend="triton")`` forward and backward (o, final state, dq, dk, dv, dβ, dS₀) and
   ``step_rule(backend="triton")`` on CUDA tensors against the float64 step loop (run on the GPU), for both rules,
   fp32 and bf16, head sizes ``--dims`` (``K`` or ``KxV``; the default includes EFLA's shipped 64x32), at a small
   batch (two V blocks) and at B·H = 256 (one V block, the large-batch row of the launch table), with resets, a zero
   key and key norms 1e-4..1e4; EFLA also with key norms up to 1e30. The compiled kernels can fail where the
   interpreted ones of the CPU tests pass (a miscompile, the TF32 dot precision), so this runs after every kernel
   change.
2. ``--time``: the ``rlseq.bench kernels`` table at the RL shapes, fla rows included when importable.
3. ``--breakdown``: device time of every kernel of one fwd+bwd (torch.profiler) and its CUDA-graph replay.

The GRU and LSTM scans (:func:`rlseq.kernels.rnn.rnn_scan`, what the training graph replays for those memories)
get the same: forward and backward of the Triton backend against the float64 loop at the training shape
(minibatches of 8 and 2 sequences of 256 steps, hidden 256) and at a ragged one, with resets, in float32 and (at
the first shape) with TF32 matmuls; ``--time`` adds their fwd+bwd time replayed from a CUDA graph (Triton, the
torch loop) beside cuDNN's packed eager call.
"""

from __future__ import annotations

import argparse
import time

import torch

from rlseq.bench import kernels as bench
from rlseq.bench.kernels import FIELDS, random_inputs, rel_err
from rlseq.kernels import chunk_rule, step_rule
from rlseq.kernels.rnn import CELLS, rnn_scan

TIME_SHAPES = ["8,256,4,64", "64,256,4,64", "8,256,4,32", "64,256,4,16", "16,1024,4,64"]
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
SCAN_SHAPES = ((8, 256, 256), (2, 256, 256), (33, 50, 40))  # (B, T, H): the training minibatches, a ragged one
# the scans with TF32 matmuls (what --fast trains with): the torch loop with its matmul inputs rounded to TF32 on
# the CPU is 4e-5-5e-5 from the float64 loop at the first shape (outputs and final state), so 20x that
SCAN_TF32_TOL = 1e-3


def _grads(inp, rule, dtype, backend, do, ds):
    """o, final state and the gradients of ``(o·do + S·ds).sum()`` for one backend (float64 for the reference)."""
    dt = torch.float64 if backend == "reference" else dtype
    x = {n: inp[n].to(dtype).to(dt) if n != "initial_state" else inp[n].to(torch.float64 if dt == torch.float64
         else torch.float32) for n in FIELDS}
    x = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, s = chunk_rule(*(x[n] for n in FIELDS[:4]), rule=rule, initial_state=x["initial_state"],
                      resets=inp["resets"], backend=backend)
    ((o.double() * do).sum() + (s.double() * ds).sum()).backward()
    return {"o": o.detach(), "S": s.detach(), **{"d" + n: x[n].grad for n in FIELDS}}


def check_chunk(B, T, H, K, rule, dtype, device, key_norms=(1e-4, 1e4), V=None) -> dict[str, float]:
    """Relative error of every output and gradient of the Triton backend against the float64 oracle (values of
    ``V``, default ``K``)."""
    V = K if V is None else V
    inp = random_inputs(B, T, H, K, V, rule=rule, key_norms=key_norms,
                        generator=torch.Generator().manual_seed(K * 1000 + V), device=device)
    inp["k"][0, min(3, T - 1), 0] = 0.0
    g = torch.Generator().manual_seed(99)
    do = torch.randn(B, T, H, V, generator=g, dtype=torch.float64).to(device)
    ds = torch.randn(B, H, K, V, generator=g, dtype=torch.float64).to(device)
    ref = _grads(inp, rule, dtype, "reference", do, ds)
    got = _grads(inp, rule, dtype, "triton", do, ds)
    return {n: rel_err(got[n], ref[n]) for n in ref}


def check_step(rule, K, V, device, B=33, H=4, T=20) -> float:
    """Worst relative error of ``o`` and the state over ``T`` acting steps with resets (~20%)."""
    inp = random_inputs(B, T, H, K, V, rule=rule, reset_prob=0.2, generator=torch.Generator().manual_seed(K + V),
                        device=device)
    s_ref, s = inp["initial_state"].clone(), inp["initial_state"].float()
    worst = 0.0
    for t in range(T):
        x = [inp[n][:, t] for n in FIELDS[:4]]
        r = inp["resets"][:, t]
        o_ref = step_rule(*x, s_ref, rule=rule, resets=r, backend="reference")
        o = step_rule(*(a.float() for a in x), s, rule=rule, resets=r, backend="triton")
        worst = max(worst, rel_err(o, o_ref), rel_err(s, s_ref))
    return worst


def scan_inputs(cell: str, B: int, T: int, H: int, device, *, reset_prob: float = 0.02, seed: int = 0):
    """Random inputs of :func:`rlseq.kernels.rnn.rnn_scan` at PyTorch's initial scale (weights ~U(±1/√H)), float64
    on ``device``: ``(gates_x, w_hh, b_hh, parts, resets)``."""
    G, P = CELLS[cell]
    g = torch.Generator().manual_seed(seed)
    u = lambda *shape: ((torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) / H ** 0.5).to(device)  # noqa: E731
    gates_x = (torch.randn(B, T, G * H, generator=g, dtype=torch.float64)).to(device)
    parts = tuple(torch.randn(B, H, generator=g, dtype=torch.float64).to(device) for _ in range(P))
    resets = (torch.rand(B, T, generator=g) < reset_prob).to(device)
    return gates_x, u(G * H, H), u(G * H), parts, resets


def check_scan(cell: str, B: int, T: int, H: int, device) -> dict[str, float]:
    """Relative error of the Triton scan's outputs and gradients (float32) against the float64 loop."""
    inputs = scan_inputs(cell, B, T, H, device)
    g = torch.Generator()
    out = {}
    for backend in ("reference", "triton"):
        gates_x, w, b, parts, resets = inputs
        leaves = [x.detach().clone().to(torch.float64 if backend == "reference" else torch.float32).requires_grad_()
                  for x in (gates_x, w, b, *parts)]
        y, final = rnn_scan(cell, *leaves[:3], tuple(leaves[3:]), resets, backend=backend)
        g.manual_seed(1)
        loss = (y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64).to(device)).sum()
        for f in final:
            loss = loss + (f.double() * torch.randn(f.shape, generator=g, dtype=torch.float64).to(device)).sum()
        grads = torch.autograd.grad(loss, leaves)
        out[backend] = dict(zip(["y", *(f"final{i}" for i in range(len(final))), "dgates_x", "dw_hh", "db_hh",
                                 *(f"dpart{i}" for i in range(len(final)))], [y, *final, *grads]))
    return {n: rel_err(out["triton"][n], out["reference"][n]) for n in out["reference"]}


def scan_timing(device, shapes=((8, 256, 256), (2, 256, 256))) -> None:
    """fwd+bwd ms of one scan layer over sequences with an episode start every 64 steps: the Triton and torch scans
    replayed from a CUDA graph, cuDNN's packed call (the eager training path: ``nn.GRU`` / ``nn.LSTM`` over the
    episode segments, with the memory's output projection) run eagerly."""
    import triton.testing

    from rlseq.bench.timing import graph_ms
    from rlseq.policies.memory import make_memory

    print("| cell | B, T, hidden | Triton scan, graph | torch scan, graph | cuDNN packed, eager (+ the output projection) |")
    print("|---|---|---:|---:|---:|")
    for cell in CELLS:
        for B, T, H in shapes:
            gates_x, w, b, parts, _ = scan_inputs(cell, B, T, H, device)
            resets = torch.zeros(B, T, dtype=torch.bool, device=device)
            resets[:, 64::64] = True
            leaves = [x.float().requires_grad_() for x in (gates_x, w, b, *parts)]
            ms = {}
            for backend in ("triton", "torch"):
                def fb(backend=backend):
                    y, final = rnn_scan(cell, *leaves[:3], tuple(leaves[3:]), resets, backend=backend)
                    (y.sum() + sum(f.sum() for f in final)).backward()
                ms[backend] = graph_ms(fb, leaves)
            memory = make_memory(cell, H, d_model=H, hidden_size=H, conv_size=1).to(device)
            u = torch.randn(B, T, H, device=device, requires_grad=True)
            state = memory.initial_state(B, device)

            def packed():
                y, final = memory._core(u, memory.state_parts(state)[0], resets, h=u)
                (y.sum() + final.sum()).backward()
            ms["cudnn"] = triton.testing.do_bench(packed, warmup=10, rep=100, return_mode="median")
            print(f"| {cell} | {B}, {T}, {H} | {ms['triton']:.2f} | {ms['torch']:.2f} | {ms['cudnn']:.2f} |",
                  flush=True)


def correctness(device, dims) -> int:
    """Every check, one line each; returns the number of failures."""
    t0, failures = time.time(), 0
    jobs = [(rule, K, V, dt, B, T, (1e-4, 1e4)) for rule in ("efla", "deltanet") for K, V in dims
            for dt in (torch.float32, torch.bfloat16) for B, T in ((2, 100), (64, 40))]
    jobs += [("efla", K, V, torch.float32, 2, 100, (1e-4, 1e30)) for K, V in dims]
    for rule, K, V, dt, B, T, norms in jobs:
        errs = check_chunk(B, T, 4, K, rule, dt, device, norms, V=V)
        worst = max(errs.values())
        ok = worst <= TOL[dt]
        failures += not ok
        print(f"[{time.time() - t0:4.0f}s] chunk {rule:8s} {str(dt)[6:]:8s} B{B} T{T} H4 K{K} V{V} "
              f"norms<={norms[1]:.0e} "
              f"max {worst:.1e} {'OK' if ok else 'FAIL'}  " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()),
              flush=True)
    for rule in ("efla", "deltanet"):
        for K, V in dims:
            worst = check_step(rule, K, V, device)
            failures += worst > 1e-4
            print(f"[{time.time() - t0:4.0f}s] step  {rule:8s} K{K} V{V} max {worst:.1e} "
                  f"{'OK' if worst <= 1e-4 else 'FAIL'}", flush=True)
    scans = [(cell, shape, False) for cell in CELLS for shape in SCAN_SHAPES]
    scans += [(cell, SCAN_SHAPES[0], True) for cell in CELLS]
    for cell, (B, T, H), tf32 in scans:
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            errs = check_scan(cell, B, T, H, device)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
        worst, tol = max(errs.values()), SCAN_TF32_TOL if tf32 else TOL[torch.float32]
        failures += not worst <= tol
        print(f"[{time.time() - t0:4.0f}s] scan  {cell:8s} {'tf32' if tf32 else 'fp32'} B{B} T{T} hidden {H} max "
              f"{worst:.1e} {'OK' if worst <= tol else 'FAIL'}  " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()),
              flush=True)
    return failures


def breakdown(device, shapes, iters: int = 20) -> None:
    """Device time per kernel of one EFLA fp32 fwd+bwd (torch.profiler over ``iters`` calls after warm-up), with
    the wall time and the CUDA-graph replay beside it."""
    import triton.testing
    from torch.profiler import ProfilerActivity, profile

    from rlseq.bench.timing import graph_ms

    print("| shape (B,T,H,D) | kernel | device ms per fwd+bwd |")
    print("|---|---|---|")
    for shape in shapes:
        B, T, H, D = (int(v) for v in shape.split(","))
        fwd, leaves = bench.rule_forward(bench.bench_inputs(B, T, H, D, "efla", torch.float32, device), "efla", "triton")
        _, fb = bench.fwd_and_fwd_bwd(fwd, leaves)
        wall = triton.testing.do_bench(fb, warmup=25, rep=100, return_mode="median")
        print(f"| {shape} | fwd+bwd, wall (do_bench) | {wall:.3f} |")
        print(f"| {shape} | fwd+bwd, replayed from a CUDA graph | {graph_ms(fb, leaves):.3f} |")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fb()
            torch.cuda.synchronize()
        per: dict[str, float] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name] = per.get(ev.name, 0.0) + ev.device_time_total / 1e3 / iters
        for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"| {shape} | {name[:60]} | {ms:.3f} |")
        print(f"| {shape} | **all kernels** | {sum(per.values()):.3f} |", flush=True)


def head_sizes(text: str) -> tuple[int, int]:
    """``"64"`` → (64, 64), ``"64x32"`` → (64, 32): a ``--dims`` entry."""
    try:
        K, V = (int(x) for x in text.split("x")) if "x" in text else (int(text), int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a head size is K or KxV, e.g. 64 or 64x32") from None
    if K < 1 or V < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: head sizes must be >= 1")
    return K, V


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dims", type=head_sizes, nargs="+", metavar="K|KxV",
                        default=[(16, 16), (32, 32), (64, 64), (128, 128), (64, 32)],
                        help="head sizes checked: K (values as wide) or KxV (default: 16 32 64 128 64x32, the last "
                        "EFLA's shipped keys and values)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    parser.add_argument("--time", action="store_true", help="then the kernels table at the RL shapes (fla rows too)")
    parser.add_argument("--breakdown", action="store_true", help="then the device time per kernel")
    parser.add_argument("--shapes", nargs="+", default=TIME_SHAPES, metavar="B,T,H,D",
                        help="--time/--breakdown shapes")


def main(args: argparse.Namespace) -> None:
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("gpu-check needs a CUDA device (the CPU tests run the same kernels interpreted)")
    device = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if not args.no_check:
        failures = correctness(device, args.dims)
        print(f"correctness: {'all OK' if not failures else f'{failures} FAILED'}", flush=True)
    if args.time:
        kernels = argparse.ArgumentParser()
        bench.add_arguments(kernels)
        bench.main(kernels.parse_args(["--shapes", *args.shapes, "--dtypes", "float32", "bfloat16", "--backends",
                                       "triton", "--fla", "--step", "--device", "cuda"]))
        scan_timing(device)
    if args.breakdown:
        breakdown(device, args.shapes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m rlseq.bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    main(parser.parse_args())
