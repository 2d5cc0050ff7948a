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
"""

from __future__ import annotations

import argparse
import time

import torch

from rlseq.bench import kernels as bench
from rlseq.bench.kernels import FIELDS, random_inputs, rel_err
from rlseq.kernels import chunk_rule, step_rule

TIME_SHAPES = ["8,256,4,64", "64,256,4,64", "8,256,4,32", "64,256,4,16", "16,1024,4,64"]
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


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
    if args.breakdown:
        breakdown(device, args.shapes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m rlseq.bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    main(parser.parse_args())
