"""GPU correctness sweep and timing of the Triton kernels: ``python -m rlseq.bench.gpu_check``.

1. Correctness: ``chunk_triton`` forward and backward (q, k, v, β, initial state) and ``step_triton`` on CUDA
   tensors against the float64 step-by-step oracle (run on the GPU in float64), over several chunk sizes,
   num_warps, num_stages and both forward modes: the Hopper compiler has miscompiled delta-rule backward
   kernels before for some warp counts (fla #984), which the CPU interpreter cannot catch.
2. ``--time``: fwd+bwd time of each config at the RL shapes, to choose the defaults, with each compiled
   kernel's registers per thread, spills and shared memory (the compiler's resource report).
3. ``--warm I N``: compile (by running once at B=2) share I of N of the kernels that ``--time`` and
   ``python -m rlseq.bench kernels`` (the documented shapes, fla rows included) will use, so several processes can fill
   triton's on-disk cache in parallel before anything is timed.

Prints a compact table last; ``--log`` writes every row to a file.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

from rlseq.kernels.naive import naive_rule, naive_step
from rlseq.kernels.triton_ops import chunk_triton, step_triton

FIELDS = ("q", "k", "v", "beta", "initial_state")


def rel(x, ref):
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def inputs(B, T, H, K, V, rule, seed, device, reset_prob=0.05, norms=(1e-4, 1e4)):
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(dtype=torch.float64, device=device, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, **kw), dim=-1)
    if rule == "efla":
        lo, hi = torch.log10(torch.tensor(norms, dtype=torch.float64)).tolist()
        k = k * 10 ** (lo + (hi - lo) * torch.rand(B, T, H, 1, **kw))
        k[0, min(3, T - 1), 0] = 0.0
    resets = torch.rand(B, T, device=device, generator=g) < reset_prob
    resets[0, 0] = True
    if T > 40:
        resets[-1, 31:33] = True
        resets[0, 32] = True
    return dict(q=torch.randn(B, T, H, K, **kw), k=k, v=torch.randn(B, T, H, V, **kw),
                beta=2 * torch.rand(B, T, H, **kw), initial_state=torch.randn(B, H, K, V, **kw), resets=resets)


def oracle(inp, rule, dtype, do, ds):
    x = {n: (inp[n].to(dtype).double() if n != "initial_state" else inp[n]).clone().requires_grad_() for n in FIELDS}
    o, s = naive_rule(x["q"], x["k"], x["v"], x["beta"], rule=rule, initial_state=x["initial_state"], resets=inp["resets"])
    ((o * do).sum() + (s * ds).sum()).backward()
    return o.detach(), s.detach(), {n: x[n].grad for n in FIELDS}


def resources() -> str:
    """Registers per thread / spills / shared bytes of the latest chunk launches (``triton_chunk.LAST_COMPILED``)."""
    from rlseq.kernels.triton_chunk import LAST_COMPILED

    out = []
    for name in ("fwd", "bwd"):
        k = LAST_COMPILED.get(name)
        if k is None:
            continue
        try:
            k._init_handles()
        except Exception:
            pass
        out.append(f"{name} regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} "
                   f"smem {getattr(getattr(k, 'metadata', None), 'shared', '?')}")
    return "; ".join(out)


def describe(cfg, T=256, K=64, V=64, B=None, H=None) -> str:
    from rlseq.kernels.triton_chunk import _block_v, default_config

    full = dict(default_config(T, K, V, B, H), **(cfg or {}))
    return (f"C{full['chunk_size']} BV{_block_v(full, V)} w{full['num_warps']} s{full['num_stages']} "
            f"{full['mode']} {full['prec']}" + (" (default)" if not cfg else ""))


def check_chunk(inp, rule, dtype, cfg, ref):
    x = {n: inp[n].to(dtype if n != "initial_state" else torch.float32).clone().requires_grad_() for n in FIELDS}
    o, s = chunk_triton(x["q"], x["k"], x["v"], x["beta"], rule=rule, initial_state=x["initial_state"],
                        resets=inp["resets"], config=cfg)
    do, ds = ref[3], ref[4]
    ((o.double() * do).sum() + (s.double() * ds).sum()).backward()
    errs = {"o": rel(o, ref[0]), "S": rel(s, ref[1])}
    errs.update({"d" + n: rel(x[n].grad, ref[2][n]) for n in FIELDS})
    return errs


SHAPES = [(2, 100, 3, 64, 64), (2, 77, 2, 32, 128), (3, 130, 2, 16, 16), (1, 70, 1, 128, 128), (2, 64, 2, 64, 32)]


def correctness(device, log, configs, rules=("efla", "deltanet"), shapes=SHAPES, dtypes=(torch.float32, torch.bfloat16),
                step_warps=(1, 2, 4, 8), step_dims=((64, 64), (32, 128), (16, 16))):
    rows, worst = [], {}
    t_start = time.time()
    for rule, (si, shape), dtype in itertools.product(rules, enumerate(shapes), dtypes):
        inp = inputs(*shape, rule, seed=17 * si + len(rule), device=device)
        g = torch.Generator(device=device).manual_seed(99)
        B, T, H, K, V = shape
        do = torch.randn(B, T, H, V, device=device, dtype=torch.float64, generator=g)
        ds = torch.randn(B, H, K, V, device=device, dtype=torch.float64, generator=g)
        ref = (*oracle(inp, rule, dtype, do, ds), do, ds)
        cfgs = configs if (si == 0 and dtype == torch.float32) else configs[:1]
        for cfg in cfgs:
            errs = check_chunk(inp, rule, dtype, cfg, ref)
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            if (cfg or {}).get("prec") == "tf32":
                tol = 5e-3
            m = max(errs.values())
            key = (rule, str(dtype).split(".")[-1])
            worst[key] = max(worst.get(key, 0.0), m)
            line = f"[{time.time() - t_start:5.0f}s] chunk {rule:8s} {str(dtype):15s} {str(shape):22s} {cfg} max {m:.2e} {'OK' if m <= tol else 'FAIL'} " + \
                   " ".join(f"{n}={e:.1e}" for n, e in errs.items())
            print(line, file=log, flush=True)
            rows.append((m <= tol, line))
    # step kernel: 20 steps with resets, several warp counts
    for rule, (K, V), nw in itertools.product(rules, step_dims, step_warps):
        B, H, T = 33, 4, 20
        inp = inputs(B, T, H, K, V, rule, seed=K + V + nw, device=device, reset_prob=0.2)
        s_ref = inp["initial_state"].clone()
        s = s_ref.float().clone()
        out = torch.empty(B, H, V, device=device)
        m = 0.0
        for t in range(T):
            r = inp["resets"][:, t]
            s_ref.masked_fill_(r.view(B, 1, 1, 1), 0.0)
            o_ref, s_ref = naive_step(*(inp[n][:, t] for n in ("q", "k", "v", "beta")), s_ref, rule)
            step_triton(*(inp[n][:, t].float() for n in ("q", "k", "v", "beta")), s, rule=rule, resets=r, out=out,
                        num_warps=nw)
            m = max(m, rel(out, o_ref), rel(s, s_ref))
        key = (rule, "step")
        worst[key] = max(worst.get(key, 0.0), m)
        line = f"[{time.time() - t_start:5.0f}s] step  {rule:8s} K{K} V{V} num_warps={nw} max {m:.2e} {'OK' if m <= 1e-4 else 'FAIL'}"
        print(line, file=log, flush=True)
        rows.append((m <= 1e-4, line))
    return rows, worst


def timing(device, log, configs, shapes):
    import triton.testing

    out = []
    for (B, T, H, D), cfg in itertools.product(shapes, configs):
        inp = inputs(B, T, H, D, D, "efla", seed=1, device=device, reset_prob=0.02, norms=(1e-2, 1e2))
        x = {n: inp[n].float().clone().requires_grad_() for n in FIELDS}
        do = torch.randn(B, T, H, D, device=device)

        def fb():
            o, s = chunk_triton(x["q"], x["k"], x["v"], x["beta"], rule="efla", initial_state=x["initial_state"],
                                resets=inp["resets"], config=cfg)
            torch.autograd.backward([o, s], [do, torch.ones_like(s)])

        def f():
            with torch.no_grad():
                chunk_triton(x["q"], x["k"], x["v"], x["beta"], rule="efla", initial_state=x["initial_state"],
                             resets=inp["resets"], config=cfg)
        try:
            tf = triton.testing.do_bench(f, warmup=20, rep=80, return_mode="median")
            tfb = triton.testing.do_bench(fb, warmup=20, rep=80, return_mode="median", grad_to_none=list(x.values()))
        except Exception as e:  # e.g. out of shared memory for a config
            print(f"time B{B} T{T} H{H} D{D} {cfg} ERROR {type(e).__name__}: {str(e)[:120]}", file=log, flush=True)
            continue
        res = resources()
        line = f"time B{B} T{T} H{H} D{D} {describe(cfg, T, D, D, B, H)} fwd {tf * 1e3:.0f} us fwd+bwd {tfb * 1e3:.0f} us | {res}"
        print(line, file=log, flush=True)
        out.append(((B, T, H, D), cfg, tf, tfb, res))
    return out


def time_configs() -> list:
    """Index 0 is the default (None); 1 the previous default at D64 (one V block, C16); then variants."""
    base = dict(chunk_size=16, num_warps=4, num_stages=1, mode="inline", prec="ieee")
    return [None, dict(base, block_v=None), dict(base, block_v=32), dict(base, block_v=16, num_warps=2),
            dict(base, block_v=16, chunk_size=32), dict(base, block_v=32, chunk_size=32),
            dict(base, block_v=16, num_warps=8), dict(base, block_v=16, mode="prep"),
            dict(base, block_v=None, chunk_size=32), dict(base, block_v=16, chunk_size=64, num_warps=8),
            dict(base, block_v=16, num_stages=2), dict(base, block_v=16, prec="tf32"),
            dict(base, block_v=32, num_warps=8)]


def warm(device, i, n, configs, fla=True) -> None:
    """Compile what ``--time --quick`` (the given configs) and the documented ``rlseq.bench kernels`` command use
    (share i of n). The default config depends on B, so the bench shapes run at their own B."""
    from rlseq.bench.kernels import make_inputs

    jobs = [("triton", B, T, D, dt, None) for B, T, D in ((8, 256, 64), (64, 256, 64), (8, 256, 32), (64, 256, 16),
                                                          (16, 1024, 64)) for dt in (torch.float32, torch.bfloat16)]
    jobs += [("triton", 2, 256, 64, torch.float32, c) for c in configs if c is not None]
    if fla:
        jobs += [(fl, 2, T, D, None, None) for T, D in ((256, 64), (256, 32), (256, 16), (1024, 64))
                 for fl in ("fla_chunk", "fla_recurrent")]
    for kind, B, T, D, dt, cfg in jobs[i::n]:
        t0 = time.time()
        try:
            if kind == "triton":
                inp = make_inputs(B, T, 4, D, "efla", device)
                x = {f: (inp[f].to(dt) if f != "initial_state" else inp[f]).requires_grad_() for f in FIELDS}
                with torch.no_grad():
                    chunk_triton(*(x[f] for f in FIELDS[:4]), rule="efla", initial_state=x["initial_state"],
                                 resets=inp["resets"], config=cfg)
                o, s = chunk_triton(*(x[f] for f in FIELDS[:4]), rule="efla", initial_state=x["initial_state"],
                                    resets=inp["resets"], config=cfg)
                (o.float().sum() + s.sum()).backward()
            else:
                from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

                fn, dt = (chunk_delta_rule, torch.bfloat16) if kind == "fla_chunk" else \
                    (fused_recurrent_delta_rule, torch.float32)
                inp = make_inputs(B, T, 4, D, "deltanet", device)
                x = {f: inp[f].to(dt if f != "initial_state" else torch.float32).requires_grad_() for f in FIELDS}
                with torch.no_grad():
                    fn(*(x[f] for f in FIELDS[:4]), scale=1.0, initial_state=x["initial_state"], output_final_state=True)
                o, s = fn(*(x[f] for f in FIELDS[:4]), scale=1.0, initial_state=x["initial_state"],
                          output_final_state=True)
                (o.float().sum() + s.sum()).backward()
            torch.cuda.synchronize()
            print(f"warm {kind} T{T} D{D} {dt} {cfg}: {time.time() - t0:.0f}s", flush=True)
        except Exception as e:
            print(f"warm {kind} T{T} D{D} {dt} {cfg}: ERROR {type(e).__name__}: {str(e)[:160]}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--time", action="store_true")
    p.add_argument("--log", default=None)
    p.add_argument("--quick", action="store_true",
                   help="default config only, fp32, shapes 0 and 2, both rules, step at K=V=64 with 2/4/8 warps")
    p.add_argument("--time-configs", type=int, nargs="*", default=None, help="indices of the configs to time")
    p.add_argument("--no-check", action="store_true", help="skip the correctness sweep (e.g. with --time)")
    p.add_argument("--no-fla", action="store_true", help="--warm: skip the fla kernels")
    p.add_argument("--warm", type=int, nargs=2, default=None, metavar=("I", "N"), help="compile share I of N, then exit")
    a = p.parse_args(argv)
    device = torch.device("cuda")
    import triton

    log = open(a.log, "w") if a.log else sys.stdout
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    configs = time_configs()
    if a.warm is not None:
        warm(device, *a.warm, configs if a.time_configs is None else [configs[i] for i in a.time_configs],
             fla=not a.no_fla)
        return
    t0 = time.time()
    if a.no_check:
        rows, worst = [], {}
    elif a.quick:  # the default config (None: V blocks of 16 at these small B) and V blocks of 32 (at D64)
        rows, worst = correctness(device, log, [None, configs[2]], shapes=[SHAPES[0], SHAPES[2]], dtypes=(torch.float32,),
                                  step_warps=(2, 4, 8), step_dims=((64, 64),))
    else:
        rows, worst = correctness(device, log, [None] + configs[1:])
    n_fail = sum(not ok for ok, _ in rows)
    print(f"correctness: {len(rows) - n_fail}/{len(rows)} OK in {time.time() - t0:.0f}s", flush=True)
    for ok, line in rows:
        if not ok:
            print(line)
    for key, m in sorted(worst.items()):
        print(f"  worst {key}: {m:.2e}")
    if a.time:
        tc = configs if a.time_configs is None else [configs[i] for i in a.time_configs]
        res = timing(device, log, tc, [(8, 256, 4, 64), (64, 256, 4, 64)] if a.quick else
                     [(8, 256, 4, 64), (64, 256, 4, 64), (64, 256, 4, 16)])
        print("| shape | config | fwd us | fwd+bwd us | regs/spills (fwd; bwd) |")
        for shape, cfg, tf, tfb, rs in sorted(res, key=lambda r: (r[0], r[3])):
            print(f"| {shape} | {describe(cfg, shape[1], shape[3], shape[3], shape[0], shape[2])} | {tf * 1e3:.0f} | {tfb * 1e3:.0f} | {rs} |")


if __name__ == "__main__":
    main()
