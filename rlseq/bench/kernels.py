"""``python -m rlseq.bench kernels``: ``chunk_rule`` forward and forward+backward time per backend at RL shapes,
each row with its error against the float64 oracle; ``--fla`` adds flash-linear-attention's DeltaNet kernels and
``--step`` the acting step.

Also the kernel inputs and the fla runner that the tests and ``rlseq.bench.gpu_check`` share.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from rlseq.bench.timing import describe_environment, graph_ms, round_robin, row
from rlseq.kernels import chunk_rule, step_rule, triton_available
from rlseq.threads import add_torch_threads_argument, set_torch_threads

FIELDS = ("q", "k", "v", "beta", "initial_state")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STEP_BATCH, STEP_DIM = (64, 256), (32, 64)  # the acting step's rows (--step)


def random_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    *,
    rule: str,
    dtype: torch.dtype = torch.float64,
    reset_prob: float = 0.1,
    key_norms: tuple[float, float] = (1e-4, 1e4),
    beta_max: float = 2.0,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Inputs for ``chunk_rule`` (drawn on the CPU, then moved to ``device``). EFLA keys get log-uniform norms in
    ``key_norms``; DeltaNet keys are unit (as its callers normalise). Resets hit random positions plus, when
    ``reset_prob > 0``, t = 0, two consecutive steps and, when T is long enough, the start of the second chunk of
    16. The initial state is float64 (cast it as needed); the rest is in ``dtype``."""
    g = generator
    kw = dict(dtype=torch.float64)
    q = torch.randn(B, T, H, K, generator=g, **kw)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, **kw), dim=-1)
    if rule == "efla":
        lo, hi = (math.log10(x) for x in key_norms)
        k = k * 10 ** (lo + (hi - lo) * torch.rand(B, T, H, 1, generator=g, **kw))
    v = torch.randn(B, T, H, V, generator=g, **kw)
    beta = beta_max * torch.rand(B, T, H, generator=g, **kw)
    resets = torch.rand(B, T, generator=g) < reset_prob
    if reset_prob > 0 and B > 0:
        resets[0, 0] = True
        if T >= 4:
            resets[-1, T // 2 : T // 2 + 2] = True
        if T > 17:
            resets[0, 16] = True
    initial_state = torch.randn(B, H, K, V, generator=g, **kw)
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), beta=beta.to(dtype), resets=resets,
               initial_state=initial_state)
    return {n: x.to(device) for n, x in out.items()}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖x − ref‖ / ‖ref‖`` in float64; NaN or inf anywhere gives inf."""
    x, ref = x.double(), ref.double().to(x.device)
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def oracle(inp: dict[str, torch.Tensor], rule: str, resets: bool = True) -> torch.Tensor:
    """``o`` of the float64 step loop on ``inp`` (as rounded to its dtype)."""
    with torch.no_grad():
        o, _ = chunk_rule(*(inp[n].double() for n in FIELDS[:4]), rule=rule, backend="reference",
                          initial_state=inp["initial_state"].double(), resets=inp["resets"] if resets else None)
    return o


def fla_available() -> bool:
    try:
        import fla.ops.delta_rule  # noqa: F401
    except Exception:
        return False
    return True


def fla_delta_rule(inp: dict[str, torch.Tensor], dtype: torch.dtype):
    """``(forward, leaves)`` of flash-linear-attention's DeltaNet on ``inp`` (unit keys, scale 1, initial and final
    state, no resets: fla has none): ``chunk_delta_rule`` in bf16 (it refuses fp32), ``fused_recurrent_delta_rule``
    in fp32. ``forward() -> (o, final_state)``."""
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

    fn = fused_recurrent_delta_rule if dtype == torch.float32 else chunk_delta_rule
    x = {n: inp[n].detach().to(dtype if n != "initial_state" else torch.float32).clone().requires_grad_()
         for n in FIELDS}

    def forward():
        return fn(*(x[n] for n in FIELDS[:4]), scale=1.0, initial_state=x["initial_state"], output_final_state=True)

    return forward, list(x.values())


def rule_forward(inp: dict[str, torch.Tensor], rule: str, backend: str):
    """``(forward, leaves)`` of ``chunk_rule`` on ``backend`` with ``inp``'s tensors as fresh leaves (fp32 state)."""
    x = {n: inp[n].detach().to(torch.float32 if n == "initial_state" else inp[n].dtype).clone().requires_grad_()
         for n in FIELDS}

    def forward():
        return chunk_rule(*(x[n] for n in FIELDS[:4]), rule=rule, initial_state=x["initial_state"],
                          resets=inp["resets"], backend=backend)

    return forward, list(x.values())


def fwd_and_fwd_bwd(forward, leaves: list[torch.Tensor]):
    """``(forward under no_grad, forward + backward of fixed random output gradients)``."""
    o, s = forward()
    grad_o, grad_s = torch.randn_like(o), torch.randn_like(s)

    def fwd():
        with torch.no_grad():
            return forward()

    def fwd_bwd():
        for t in leaves:  # no accumulation into old gradients (training sets them to None too)
            t.grad = None
        o, s = forward()
        torch.autograd.backward([o, s], [grad_o, grad_s])

    return fwd, fwd_bwd


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median ms: ``triton.testing.do_bench`` (CUDA events after warm-up) on the GPU, else of ``repeats`` calls."""
    if device.type == "cuda":
        import triton.testing

        fn()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return 1e3 * statistics.median(round_robin([fn], repeats, warmup=2)[0])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rule", choices=("efla", "deltanet"), default="efla")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64], help="B values")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[16, 32, 64], help="D = K = V values")
    parser.add_argument("--steps", type=int, default=256, help="T")
    parser.add_argument("--heads", type=int, default=4, help="H")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="B,T,H,D",
                        help="explicit shapes instead of the --batch x --head-dim grid, e.g. 8,256,4,64")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["float32"],
                        help="input dtypes (bf16 rows: the triton backend only)")
    parser.add_argument("--backends", nargs="+", default=None, help="default: every backend available on the device")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5, help="CPU: timed round-robin rounds (default 5)")
    add_torch_threads_argument(parser)
    parser.add_argument("--fla", action="store_true",
                        help="add flash-linear-attention rows when importable (GPU): chunk_delta_rule (bf16) and "
                             "fused_recurrent_delta_rule (fp32), DeltaNet on unit keys, no resets (fla has none)")
    parser.add_argument("--step", action="store_true",
                        help=f"add step_rule rows (acting) at B in {STEP_BATCH} x D in {STEP_DIM}")


def bench_inputs(B: int, T: int, H: int, D: int, rule: str, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """RL-like inputs: EFLA key norms over 1e-2..1e2, β in [0, 1), resets on ~2% of steps, an initial state."""
    return random_inputs(B, T, H, D, D, rule=rule, dtype=dtype, reset_prob=0.02, key_norms=(1e-2, 1e2),
                         beta_max=1.0, generator=torch.Generator().manual_seed(0), device=device)


def chunk_rows(args: argparse.Namespace, device: torch.device, backends: list[str]) -> None:
    shapes = [tuple(int(v) for v in sh.split(",")) for sh in args.shapes] if args.shapes else \
        [(B, args.steps, args.heads, D) for B in args.batch for D in args.head_dim]
    fla = args.fla and device.type == "cuda" and fla_available()
    cuda = device.type == "cuda"
    print("| B | T | H | D | rule | dtype | backend | fwd ms | fwd+bwd ms | fwd+bwd ms, CUDA graph |"
          " rel. err of o vs fp64 oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B, T, H, D in shapes:
        for dname in args.dtypes:
            dt = DTYPES[dname]
            rows = {}  # label -> (rule, forward, leaves, oracle o)
            inp = bench_inputs(B, T, H, D, args.rule, dt, device)
            o_ref = oracle(inp, args.rule)
            for b in backends:
                if dt == torch.float32 or b == "triton":
                    rows[b] = (args.rule, *rule_forward(inp, args.rule, b), o_ref)
            if fla:  # fla's chunk kernel in bf16, its recurrent one in fp32
                x = bench_inputs(B, T, H, D, "deltanet", torch.float32, device)
                x = {**{n: x[n].to(dt) for n in FIELDS[:4]}, "initial_state": x["initial_state"], "resets": x["resets"]}
                name = "fla_recurrent" if dt == torch.float32 else "fla_chunk"
                rows[name] = ("deltanet", *fla_delta_rule(x, dt), oracle(x, "deltanet", resets=False))
            fns = {label: fwd_and_fwd_bwd(fwd, leaves) for label, (_, fwd, leaves, _) in rows.items()}
            if cuda:
                times = {b: (_time(f[0], device, 0), _time(f[1], device, 0), graph_ms(f[1], rows[b][2]))
                         for b, f in fns.items()}
            else:  # round-robin, each timed call after an untimed one: every backend sees the same machine state
                calls = [f[i] for f in fns.values() for i in (0, 1)]
                ms = [1e3 * statistics.median(t) for t in round_robin(calls, args.repeats, warmup=2, before=calls)]
                times = {b: (ms[2 * k], ms[2 * k + 1], math.nan) for k, b in enumerate(fns)}
            for label, (rule, fwd, _, ref) in rows.items():
                with torch.no_grad():
                    err = rel_err(fwd()[0], ref)
                tf, tfb, tg = times[label]
                graph = f"{tg:.3f}" if tg == tg else "n/a"
                print(row(B, T, H, D, rule, dname, label, f"{tf:.3f}", f"{tfb:.3f}", graph, f"{err:.1e}"), flush=True)


def step_rows(args: argparse.Namespace, device: torch.device, backends: list[str]) -> None:
    """One acting step (fp32 state, resets ~2%): step_rule per backend, the triton step kernel replayed from a
    CUDA graph, and fla's fused_recurrent kernel at T = 1."""
    fla = args.fla and device.type == "cuda" and fla_available()
    print("\n| B | H | D | rule | what | µs per step | rel. err of o vs fp64 oracle |")
    print("|---|---|---|---|---|---|---|")
    H = args.heads
    for B in STEP_BATCH:
        for D in STEP_DIM:
            inp = bench_inputs(B, 1, H, D, args.rule, torch.float32, device)
            x = [inp[n][:, 0] for n in FIELDS[:4]]
            r = inp["resets"][:, 0]
            s_ref = inp["initial_state"].clone()
            o_ref = step_rule(*(t.double() for t in x), s_ref, rule=args.rule, resets=r, backend="reference")
            for backend in [b for b in backends if b != "reference"]:
                s = inp["initial_state"].float()
                err = rel_err(step_rule(*x, s, rule=args.rule, resets=r, backend=backend), o_ref)
                us = _time(lambda: step_rule(*x, s, rule=args.rule, resets=r, backend=backend), device, 50) * 1e3
                print(row(B, H, D, args.rule, f"step_rule {backend}", f"{us:.1f}", f"{err:.1e}"), flush=True)
                if backend == "triton" and device.type == "cuda":
                    from rlseq.kernels.triton_ops import step_triton

                    out = torch.empty(B, H, D, device=device)
                    us = graph_ms(lambda: step_triton(*x, s, rule=args.rule, resets=r, out=out), []) * 1e3
                    print(row(B, H, D, args.rule, "triton step kernel, CUDA graph replay", f"{us:.1f}", f"{err:.1e}"),
                          flush=True)
            if fla:
                xd = bench_inputs(B, 1, H, D, "deltanet", torch.float32, device)
                forward, _ = fla_delta_rule(xd, torch.float32)
                with torch.no_grad():
                    err = rel_err(forward()[0], oracle(xd, "deltanet", resets=False))
                    us = _time(forward, device, 50) * 1e3
                print(row(B, H, D, "deltanet", "fla fused_recurrent_delta_rule, T=1", f"{us:.1f}", f"{err:.1e}"),
                      flush=True)


def main(args: argparse.Namespace) -> None:
    set_torch_threads(args.torch_threads)  # the trainer's rule: the CPU rows time what a training run does
    device = torch.device(args.device)
    backends = args.backends or [b for b in ("reference", "torch", "triton") if b != "triton" or triton_available(device)]
    print(describe_environment(device))
    how = ("triton.testing.do_bench medians after warm-up; the CUDA graph column replays the fwd+bwd from a graph"
           if device.type == "cuda" else
           f"median of {args.repeats} round-robin rounds over the rows, each timed call preceded by an untimed one")
    print(f"rule {args.rule}, key norms 1e-2..1e2, resets ~2% of steps; {how}\n")
    chunk_rows(args, device, backends)
    if args.step:
        step_rows(args, device, backends)
