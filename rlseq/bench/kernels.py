"""``python -m rlseq.bench kernels``: chunk_rule forward and forward+backward time per backend at RL shapes,
with each row's error against the float64 oracle."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from rlseq.bench.timing import describe_environment, graph_ms, interleaved_median_ms, median_ms
from rlseq.kernels import chunk_rule, triton_available


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rule", choices=("efla", "deltanet"), default="efla")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64], help="B values")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[16, 32, 64], help="D = K = V values")
    parser.add_argument("--steps", type=int, default=256, help="T")
    parser.add_argument("--heads", type=int, default=4, help="H")
    parser.add_argument("--backends", nargs="+", default=None, help="default: every backend available on the device")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 20 on GPU, 5 on CPU)")
    parser.add_argument("--sequential", action="store_true",
                        help="CPU grid: time each backend alone, one after the other, instead of round-robin")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="B,T,H,D",
                        help="explicit shapes instead of the --batch x --head-dim grid, e.g. 8,256,4,64")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32"],
                        help="input dtypes (the reference and torch backends run only in float32)")
    parser.add_argument("--fla", action="store_true",
                        help="add flash-linear-attention rows when importable: chunk_delta_rule (bf16) and "
                             "fused_recurrent_delta_rule (fp32), DeltaNet on unit keys, no resets (fla has none)")
    parser.add_argument("--step", action="store_true", help="add step_rule rows (acting) at --step-batch x --step-dim")
    parser.add_argument("--step-batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--step-dim", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--skip-chunk", action="store_true", help="only the step rows")


def make_inputs(B: int, T: int, H: int, D: int, rule: str, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random RL-like inputs in float32: EFLA keys with norms spread over 1e-2..1e2, resets ~1 in 50 steps."""
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=g)
    k = F.normalize(torch.randn(B, T, H, D, **kw), dim=-1)
    if rule == "efla":
        k = k * 10 ** (4 * torch.rand(B, T, H, 1, **kw) - 2)
    return dict(
        q=torch.randn(B, T, H, D, **kw) / D**0.5,
        k=k,
        v=torch.randn(B, T, H, D, **kw),
        beta=torch.rand(B, T, H, **kw),
        initial_state=torch.randn(B, H, D, D, **kw) * 0.1,
        resets=torch.rand(B, T, **kw) < 0.02,
    )


def _time(fn, device: torch.device, warmup: int, repeats: int, grads=None) -> float:
    """Median ms: ``triton.testing.do_bench`` (CUDA events, median, after warm-up) on the GPU when triton is
    importable, else :func:`median_ms`."""
    if device.type == "cuda":
        try:
            import triton.testing
        except ImportError:
            pass
        else:
            fn()
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=grads)
    return median_ms(fn, device, warmup=warmup, repeats=repeats)


def backend_fns(inp: dict[str, torch.Tensor], rule: str, backend: str):
    """``(forward, forward_only, forward_backward, leaves)`` of chunk_rule on ``backend``: ``forward_only`` runs under
    ``no_grad``, ``forward_backward`` backpropagates fixed random output gradients (and ones for the final state)."""
    leaves = {n: inp[n].clone().requires_grad_() for n in ("q", "k", "v", "beta", "initial_state")}

    def forward():
        return chunk_rule(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], rule=rule,
                          initial_state=leaves["initial_state"], resets=inp["resets"], backend=backend)

    return (forward, *_fwd_and_fwd_bwd(forward, list(leaves.values())), list(leaves.values()))


def _fwd_and_fwd_bwd(forward, leaves: list[torch.Tensor]):
    o, _ = forward()
    grad_o = torch.randn_like(o)

    def forward_backward():
        for x in leaves:
            x.grad = None
        o, s = forward()
        torch.autograd.backward([o, s], [grad_o, torch.ones_like(s)])

    def forward_only():
        with torch.no_grad():
            return forward()

    return forward_only, forward_backward


def time_backend(inp: dict[str, torch.Tensor], rule: str, backend: str, repeats: int, graph: bool = False):
    """(forward ms, forward+backward ms, output) for one backend, timed on its own; with ``graph`` (CUDA) a
    fourth entry: the forward+backward replayed from a CUDA graph (:func:`rlseq.bench.timing.graph_ms`)."""
    device = inp["q"].device
    if backend in FLA_BACKENDS:
        leaves = {n: inp[n].clone().requires_grad_() for n in ("q", "k", "v", "beta", "initial_state")}
        return time_fla(inp, backend, leaves, graph)
    forward, _, _, leaves = backend_fns(inp, rule, backend)
    warmup = 1 if backend == "reference" else 3
    return time_forward_backward(forward, leaves, device, warmup, repeats, graph)


def time_backends_interleaved(inp: dict[str, torch.Tensor], rule: str, backends: list[str], repeats: int):
    """{backend: (forward ms, forward+backward ms, output)}, all timed round-robin
    (:func:`rlseq.bench.timing.interleaved_median_ms`): each backend sees the same machine state."""
    device = inp["q"].device
    fns, warmup, outs = {}, {}, {}
    for backend in backends:
        forward, fwd_only, fwd_bwd, _ = backend_fns(inp, rule, backend)
        fns[(backend, "fwd")], fns[(backend, "both")] = fwd_only, fwd_bwd
        warmup[(backend, "fwd")] = warmup[(backend, "both")] = 1 if backend == "reference" else 3
        with torch.no_grad():
            outs[backend] = forward()[0]
    ms = interleaved_median_ms(fns, device, warmup=warmup, repeats=repeats)
    return {b: (ms[(b, "fwd")], ms[(b, "both")], outs[b]) for b in backends}


def time_forward_backward(forward, leaves: list[torch.Tensor], device: torch.device, warmup: int, repeats: int,
                          graph: bool = False):
    """(forward ms, forward+backward ms, output) of ``forward() -> (o, final_state)`` with random output
    gradients; the forward alone runs under ``no_grad``. With ``graph``: also the forward+backward replayed from a
    CUDA graph (the kernels' device time without the host's launch work)."""
    forward_only, forward_backward = _fwd_and_fwd_bwd(forward, leaves)
    fwd = _time(forward_only, device, warmup, repeats)
    both = _time(forward_backward, device, warmup, repeats, grads=leaves)
    replay = (graph_ms(forward_backward, leaves),) if graph else ()
    with torch.no_grad():
        o, _ = forward()
    return (fwd, both, o, *replay)


def main(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    backends = args.backends or [b for b in ("reference", "torch", "triton") if b != "triton" or triton_available(device)]
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    T, H = args.steps, args.heads
    print(describe_environment(device))
    if args.shapes or args.dtypes != ["float32"] or args.fla or args.step or args.skip_chunk:
        print(f"rule {args.rule}, resets ~2% of steps; GPU: triton.testing.do_bench median after warm-up\n")
        if not args.skip_chunk:
            chunk_rows(args, device, backends, repeats)
        if args.step:
            step_rows(args, device, backends)
        return
    interleave = device.type == "cpu" and not args.sequential
    how = (f"median of {repeats} round-robin rounds over the backends after warm-up, each timed call preceded by an "
           "untimed one of the same function" if interleave else f"median of {repeats} after warm-up")
    print(f"rule {args.rule}, float32 inputs, T={T}, H={H}, resets ~2% of steps; {how}\n")
    print("| B | T | H | D | backend | fwd ms | fwd+bwd ms | bwd ms | fwd speed-up vs reference | bwd speed-up vs reference | rel. err vs fp64 oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B in args.batch:
        for D in args.head_dim:
            inp = make_inputs(B, T, H, D, args.rule, device)
            with torch.no_grad():
                o_ref, _ = chunk_rule(*(inp[n].double() for n in ("q", "k", "v", "beta")), rule=args.rule,
                                      initial_state=inp["initial_state"].double(), resets=inp["resets"], backend="reference")
            base = None
            timed = time_backends_interleaved(inp, args.rule, backends, repeats) if interleave else None
            for backend in backends:
                fwd, both, o = timed[backend] if timed else time_backend(inp, args.rule, backend, repeats)
                bwd = both - fwd
                if backend == "reference":
                    base = (fwd, bwd)
                err = ((o.double() - o_ref).norm() / o_ref.norm()).item()
                sp = f"{base[0] / fwd:.1f}x | {base[1] / bwd:.1f}x" if base else "- | -"
                print(f"| {B} | {T} | {H} | {D} | {backend} | {fwd:.3f} | {both:.3f} | {bwd:.3f} | {sp} | {err:.1e} |", flush=True)


# --- triton / fla / bf16 / step rows (issue 3) ---------------------------------------------------------

FLA_BACKENDS = ("fla_chunk", "fla_recurrent")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fla_available() -> bool:
    try:
        import fla.ops.delta_rule  # noqa: F401
    except Exception:
        return False
    return True


def time_fla(inp: dict[str, torch.Tensor], backend: str, leaves: dict[str, torch.Tensor], graph: bool = False):
    """fla's DeltaNet kernels (scale 1, initial and final state): chunk in bf16, fused_recurrent in fp32."""
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

    fn, dt = (chunk_delta_rule, torch.bfloat16) if backend == "fla_chunk" else (fused_recurrent_delta_rule, torch.float32)
    x = {n: leaves[n].detach().to(dt if n != "initial_state" else torch.float32).requires_grad_() for n in leaves}
    device = inp["q"].device

    def forward():
        return fn(x["q"], x["k"], x["v"], x["beta"], scale=1.0, initial_state=x["initial_state"], output_final_state=True)

    return time_forward_backward(forward, list(x.values()), device, 3, 20, graph)


def chunk_rows(args, device, backends, repeats) -> None:
    shapes = [tuple(int(v) for v in sh.split(",")) for sh in args.shapes] if args.shapes else \
        [(B, args.steps, args.heads, D) for B in args.batch for D in args.head_dim]
    fla = args.fla and device.type == "cuda" and fla_available()
    graph = device.type == "cuda"  # the fwd+bwd also replayed from a CUDA graph: the kernels without host work
    print("| rule | B | T | H | D | dtype | backend | fwd ms | fwd+bwd ms |" + (" fwd+bwd ms, CUDA graph |" if graph else "")
          + " rel. err of o vs fp64 oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if graph else ""))
    for B, T, H, D in shapes:
        for dname in args.dtypes:
            dt = DTYPES[dname]
            inp = make_inputs(B, T, H, D, args.rule, device)
            inp = {n: (x.to(dt) if x.is_floating_point() and n != "initial_state" else x) for n, x in inp.items()}
            with torch.no_grad():
                o_ref, _ = chunk_rule(*(inp[n].double() for n in ("q", "k", "v", "beta")), rule=args.rule,
                                      initial_state=inp["initial_state"].double(), resets=inp["resets"], backend="reference")
            rows = [b for b in backends if dt == torch.float32 or b == "triton"]
            if fla:
                rows += ["fla_chunk" if dt == torch.bfloat16 else "fla_recurrent"]
            for backend in rows:
                if backend in FLA_BACKENDS:  # DeltaNet on unit keys without resets: its own oracle
                    x = make_inputs(B, T, H, D, "deltanet", device)
                    x["resets"] = torch.zeros_like(x["resets"])
                    with torch.no_grad():
                        ref, _ = chunk_rule(*(x[n].double() for n in ("q", "k", "v", "beta")), rule="deltanet",
                                            initial_state=x["initial_state"].double(), backend="reference")
                    fwd, both, o, *replay = time_backend(x, "deltanet", backend, repeats, graph)
                    rule = "deltanet"
                else:
                    fwd, both, o, *replay = time_backend(inp, args.rule, backend, repeats, graph)
                    ref, rule = o_ref, args.rule
                err = ((o.double() - ref).norm() / ref.norm()).item()
                dlabel = {"fla_chunk": "bfloat16", "fla_recurrent": "float32"}.get(backend, dname)
                cols = "".join(f" {r:.3f} |" if r == r else " n/a |" for r in replay)
                print(f"| {rule} | {B} | {T} | {H} | {D} | {dlabel} | {backend} | {fwd:.3f} | {both:.3f} |{cols} {err:.1e} |",
                      flush=True)


def step_rows(args, device, backends) -> None:
    """One acting step (fp32 state, resets ~2%): step_rule per backend, fla fused_recurrent with T=1, and the
    triton step kernel replayed from a CUDA graph."""
    from rlseq.kernels import step_rule

    fla = args.fla and device.type == "cuda" and fla_available()
    print("\n| rule | B | H | D | what | µs per step | rel. err of o vs fp64 oracle |")
    print("|---|---|---|---|---|---|---|")
    H = args.heads
    for B in args.step_batch:
        for D in args.step_dim:
            inp = make_inputs(B, 1, H, D, args.rule, device)
            x = {n: inp[n][:, 0] for n in ("q", "k", "v", "beta")}
            r = torch.rand(B, device=device) < 0.02
            s_ref = inp["initial_state"].double().clone()
            o_ref = step_rule(*(t.double() for t in x.values()), s_ref, rule=args.rule, resets=r, backend="reference")
            cands = [b for b in backends if b != "reference"]
            for backend in cands:
                s = inp["initial_state"].clone()
                o = step_rule(*x.values(), s, rule=args.rule, resets=r, backend=backend)
                err = ((o.double() - o_ref).norm() / o_ref.norm()).item()
                s2 = inp["initial_state"].clone()
                us = _time(lambda: step_rule(*x.values(), s2, rule=args.rule, resets=r, backend=backend), device, 3, 50) * 1e3
                print(f"| {args.rule} | {B} | {H} | {D} | step_rule {backend} | {us:.1f} | {err:.1e} |", flush=True)
                if backend == "triton" and device.type == "cuda":
                    from rlseq.kernels.triton_ops import step_triton

                    out = torch.empty(B, H, D, device=device)
                    s3 = inp["initial_state"].clone()
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(3):
                            step_triton(*x.values(), s3, rule=args.rule, resets=r, out=out)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step_triton(*x.values(), s3, rule=args.rule, resets=r, out=out)
                    us = _time(graph.replay, device, 3, 50) * 1e3
                    print(f"| {args.rule} | {B} | {H} | {D} | triton step kernel, CUDA graph replay | {us:.1f} | {err:.1e} |",
                          flush=True)
            if fla:
                from fla.ops.delta_rule import fused_recurrent_delta_rule

                xd = make_inputs(B, 1, H, D, "deltanet", device)
                args1 = [xd[n] for n in ("q", "k", "v", "beta")]
                s_ref = xd["initial_state"].double().clone()
                o_ref = step_rule(*(t[:, 0].double() for t in args1), s_ref, rule="deltanet", backend="reference")
                with torch.no_grad():
                    o, _ = fused_recurrent_delta_rule(*args1, scale=1.0, initial_state=xd["initial_state"],
                                                      output_final_state=True)
                    err = ((o[:, 0].double() - o_ref).norm() / o_ref.norm()).item()
                    us = _time(lambda: fused_recurrent_delta_rule(*args1, scale=1.0, initial_state=xd["initial_state"],
                                                                  output_final_state=True), device, 3, 50) * 1e3
                print(f"| deltanet | {B} | {H} | {D} | fla fused_recurrent_delta_rule, T=1 | {us:.1f} | {err:.1e} |", flush=True)
