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

4. ``--candidates [NAME ...]`` (issue 3): compile every named config of ``CANDIDATES`` (all by default) in
   ``--jobs`` parallel processes, check each against the float64 oracle (D64 and D32, both rules, fp32 and bf16,
   resets, zero keys, key norms 1e-4..1e4; max relative error per tensor, OK/FAIL), then time fwd+bwd at
   ``TIME_SHAPES`` with each kernel's registers/spills, plus fla's kernels when importable. One command, ~3-4 min.
5. ``--ptxas`` (no GPU needed): compile the candidates' kernels for sm_90 on the CPU and print ptxas's registers and
   spill bytes per kernel, to screen configs before a GPU call.

Prints a compact table last; ``--log`` writes every row to a file.
"""

from __future__ import annotations

import argparse
import importlib.util
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
    for name in ("prep", "fwd", "bwd", "bwd_v", "bwd_k"):
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
    text = (f"C{full['chunk_size']} BV{_block_v(full, V)} w{full['num_warps']} s{full['num_stages']} "
            f"{full['mode']} {full['prec']} {full['bwd']}")
    for key, tag in (("fwd_maxnreg", "fwd regs<="), ("bwd_maxnreg", "bwd regs<="), ("kside_maxnreg", "K side regs<=")):
        if full.get(key):
            text += f" {tag}{full[key]}"
    if full["mode"] == "prep" and (full["prep_warps"] or full["prep_stages"]):
        text += f" (prep w{full['prep_warps'] or full['num_warps']} s{full['prep_stages'] or full['num_stages']})"
    if full["bwd"] == "split":
        sv = full["num_stages_bwd"] or full["num_stages"]
        text += (f" (V side BV{_block_v(full, V, 'block_v_bwd')} w{full['num_warps_bwd'] or full['num_warps']} s{sv}, "
                 f"K side BV{_block_v(full, V, 'kside_block_v')} w{full['kside_warps']} s{full['kside_stages'] or sv} "
                 f"{full['kside_prec'] or full['prec']})")
    elif full["num_warps_bwd"] or full["block_v_bwd"]:
        text += f" (bwd BV{_block_v(full, V, 'block_v_bwd')} w{full['num_warps_bwd'] or full['num_warps']})"
    return text + (" (default)" if not cfg else "")


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


def timed_problem(B, T, H, D, device):
    """EFLA fp32 leaves at one shape (resets ~2%, key norms 1e-2..1e2; ``inputs``), an output gradient, and a
    factory ``fns(cfg) -> (fwd_bwd, fwd_only)`` of ``chunk_triton`` calls on them with the config ``cfg``."""
    inp = inputs(B, T, H, D, D, "efla", seed=1, device=device, reset_prob=0.02, norms=(1e-2, 1e2))
    x = {n: inp[n].float().clone().requires_grad_() for n in FIELDS}
    do = torch.randn(B, T, H, D, device=device)

    def fns(cfg):
        def fwd():
            return chunk_triton(x["q"], x["k"], x["v"], x["beta"], rule="efla", initial_state=x["initial_state"],
                                resets=inp["resets"], config=cfg)

        def fwd_bwd():
            for t in x.values():  # no accumulation into old gradients (training sets them to None too)
                t.grad = None
            o, s = fwd()
            torch.autograd.backward([o, s], [do, torch.ones_like(s)])

        def fwd_only():
            with torch.no_grad():
                fwd()
        return fwd_bwd, fwd_only
    return x, fns


def timing(device, log, configs, shapes):
    import triton.testing

    out = []
    for (B, T, H, D), cfg in itertools.product(shapes, configs):
        _, fns = timed_problem(B, T, H, D, device)
        fb, f = fns(cfg)
        try:
            tf = triton.testing.do_bench(f, warmup=20, rep=80, return_mode="median")
            tfb = triton.testing.do_bench(fb, warmup=20, rep=80, return_mode="median")
        except Exception as e:  # e.g. out of shared memory for a config
            print(f"time B{B} T{T} H{H} D{D} {cfg} ERROR {type(e).__name__}: {str(e)[:120]}", file=log, flush=True)
            continue
        res = resources()
        line = f"time B{B} T{T} H{H} D{D} {describe(cfg, T, D, D, B, H)} fwd {tf * 1e3:.0f} us fwd+bwd {tfb * 1e3:.0f} us | {res}"
        print(line, file=log, flush=True)
        out.append(((B, T, H, D), cfg, tf, tfb, res))
    return out


def time_configs() -> list:
    """Index 0 is the default (None); then the v2-era inline forward with the fused backward (P computed inside the
    walks; split needs the prep kernel): 1 one V block at C16, then variants, one with the prep kernel."""
    base = dict(chunk_size=16, num_warps=4, num_stages=1, mode="inline", prec="ieee", bwd="fused")
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


# --- issue 3 candidates: named configs, checked and timed in one call (--candidates) -------------------------

# overrides of triton_chunk.default_config; "default" is today's default (v6, every head dim: prep kernel, split
# backward, C16; 3xTF32 dots, FMA at D16)
CANDIDATES = {
    "default": {},
    # the fused backward (one kernel per (sequence·head, V block)): at D64 before v3, below D64 before v6
    "fused-ieee": dict(bwd="fused", prec="ieee", kside_warps=4),
    "fused-tf32x3": dict(bwd="fused", prec="tf32x3"),
    "fused-inline": dict(bwd="fused", mode="inline", num_stages=1),
    # the split backward needs the prep kernel (v5): FMA dots, or one TF32 pass (over the fp32 budget: a speed bound)
    "split-ieee": dict(bwd="split", mode="prep", prec="ieee", num_warps=8),
    "split-tf32": dict(bwd="split", mode="prep", prec="tf32"),
    # around the D64 default (prep, 2 stages, BV32, K side BV32 w4): V blocks, warps and stages per kernel
    "p2k4-fbv16": dict(block_v=16, block_v_bwd=32),
    "p2k4-vbv16": dict(block_v=32, block_v_bwd=16),
    "p2k4-vw8": dict(num_warps_bwd=8),
    "p2k4-fw8": dict(num_warps=8, num_warps_bwd=4),
    "p2k4-kw8": dict(kside_warps=8),
    "p2k4-ks64": dict(kside_block_v=64),
    "p2k4-ks16": dict(kside_block_v=16),
    "p2k4-ks1": dict(kside_stages=1),
    "p2k4-ks3": dict(kside_stages=3),
    "p2k4-s1": dict(num_stages=1),
    "p2k4-s3": dict(num_stages=3, num_stages_bwd=2, kside_stages=2),
    "p2k4-ksieee": dict(kside_prec="ieee"),
    # the prep kernel (P, A2, M, Qe, Kp of every chunk; 16x16 tiles): fewer warps per program, more programs per SM
    # (v5 H100 B64, prep ms: 4 warps 0.103, 2 warps 0.066, 1 warp 0.058, 1 warp 1 stage 0.057: the default)
    "pw2": dict(prep_warps=2),
    "pw1s2": dict(prep_stages=2),
    # 2 warps per walk or K-side program: fewer registers per program, more programs per SM
    "fw2": dict(num_warps=2, num_warps_bwd=4),
    "fvw2": dict(num_warps=2),
    "vw2": dict(num_warps_bwd=2),
    "kw2": dict(kside_warps=2),
    "allw2": dict(num_warps=2, kside_warps=2),
    # register caps: <= 168 regs fit 3 programs of 4 warps per SM, <= 128 fit 4 (the walks and the K side at ~255: 2).
    # v5 H100, B64 device ms: fwd 0.123 -> 0.113 (r128, 34 bytes of spills; B8 0.036 -> 0.048), V side 0.136 -> 0.156
    # (128) / 0.187 (168), K side 0.194 -> 0.214 (168) / 0.268 (128)
    "fr128": dict(fwd_maxnreg=128),
    "vr128": dict(bwd_maxnreg=128),
    "kr168": dict(kside_maxnreg=168),
    "kr128": dict(kside_maxnreg=128),
    # one V block of 64 in the walks (half the programs: B64 H4 fits one wave at 2 programs per SM)
    "bv64": dict(block_v=64),
    "fbv64": dict(block_v=64, block_v_bwd=32),
    "vbv64": dict(block_v_bwd=64),
    "bv64-ks64": dict(block_v=64, kside_block_v=64),
    "fbv64-ks64": dict(block_v=64, block_v_bwd=32, kside_block_v=64),
    # (v5, tried: the K side as a pipelined loop over 1, 2 or 4 chunks per program with its V loop unrolled: 108
    # bytes of spills, 0.210-0.220 ms against 0.194 at B64)
    # chunks of 32 (v4 kernels, H100: spills in every kernel, 1.3-1.8x slower at D64)
    "c32": dict(chunk_size=32),
    # D16/D32 (v6 H100, replayed ms): v5's default there (fused, C32, FMA, V blocks of 16) against the v6 default;
    # the dot precision either way (D32 B8 0.107 FMA vs 0.097 3xTF32; D16 B8 0.068 FMA vs 0.083 3xTF32)
    "v5-small": dict(chunk_size=32, mode="inline", num_stages=1, bwd="fused", prec="ieee", block_v=16),
    "ieee": dict(prec="ieee"),
    "tf32x3": dict(prec="tf32x3"),
}
TIME_SHAPES = [(8, 256, 4, 64), (64, 256, 4, 64), (8, 256, 4, 32), (64, 256, 4, 16), (16, 1024, 4, 64)]
CHECK_DIMS = (64, 32)
CHECK_B, CHECK_T, CHECK_H = 2, 100, 4  # H as timed: H is a constexpr, so checks and timing share compiled kernels
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve(name, B, T, H, K, V, dtype=torch.float32) -> dict:
    """The full config a candidate runs with at one shape and input dtype (the defaults depend on both)."""
    from rlseq.kernels.triton_chunk import check_config, default_config

    return check_config(dict(default_config(T, K, V, B, H, dtype), **CANDIDATES[name]))


def fp32_tol(cfg) -> float:
    """Budget vs float64: 1e-4 relative, 5e-4 where plain tf32 products are used (documented)."""
    return 5e-4 if "tf32" in (cfg["prec"], cfg["kside_prec"]) else 1e-4


def check_jobs(names, dims=CHECK_DIMS) -> list:
    """(name, rule, dtype name, D, full config): every candidate at D64 and D32, both rules, fp32 and bf16, with
    the config it gets at B8 and, in fp32, also at B64 when that differs (the default V block depends on B)."""
    jobs = []
    for name, D, rule, dt in itertools.product(names, dims, ("efla", "deltanet"), DTYPES):
        seen = []
        for B in (8, 64) if dt == "float32" else (8,):
            cfg = resolve(name, B, 256, CHECK_H, D, D, DTYPES[dt])
            if cfg not in seen:
                seen.append(cfg)
                jobs.append((name, rule, dt, D, cfg))
    return jobs


def warm_candidates(device, i, n, names, fla, dims=CHECK_DIMS) -> None:
    """Compile share i of n of what ``--candidates`` runs (tiny B, same constexprs), to fill triton's cache in
    parallel processes before anything is timed."""
    jobs = [("efla", "float32", D, resolve(nm, B, T, H, D, D)) for (B, T, H, D), nm in itertools.product(TIME_SHAPES, names)]
    jobs += [(rule, dt, D, cfg) for _, rule, dt, D, cfg in check_jobs(names, dims)]
    if fla:
        jobs += [("fla", dt, D, None) for (_, _, _, D), dt in itertools.product(TIME_SHAPES, ("float32", "bfloat16"))]
    uniq = []  # T is not specialized on (do_not_specialize): one short T compiles what every T runs
    for j in jobs:
        if j not in uniq:
            uniq.append(j)
    for rule, dt, D, cfg in uniq[i::n]:
        t0 = time.time()
        try:
            inp = inputs(1, 40, CHECK_H, D, D, "deltanet" if rule == "fla" else rule, seed=0, device=device)
            if rule == "fla":
                fla_fwd_bwd(inp, DTYPES[dt])[0]()
            else:
                x = {f: inp[f].to(DTYPES[dt] if f != "initial_state" else torch.float32).requires_grad_() for f in FIELDS}
                o, s = chunk_triton(*(x[f] for f in FIELDS[:4]), rule=rule, initial_state=x["initial_state"],
                                    resets=inp["resets"], config=cfg)
                (o.float().sum() + s.sum()).backward()
            torch.cuda.synchronize()
            print(f"warm {rule} {dt} D{D}: {time.time() - t0:.1f}s", flush=True)
        except Exception as e:
            print(f"warm {rule} {dt} D{D} {cfg}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


def fla_fwd_bwd(inp, dtype):
    """fwd+bwd of flash-linear-attention's DeltaNet on unit keys (fp32: fused_recurrent; bf16: chunk), no resets."""
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

    fn = fused_recurrent_delta_rule if dtype == torch.float32 else chunk_delta_rule
    x = {f: inp[f].to(dtype if f != "initial_state" else torch.float32).clone().requires_grad_() for f in FIELDS}
    do = torch.randn_like(x["v"])

    def run():
        o, s = fn(*(x[f] for f in FIELDS[:4]), scale=1.0, initial_state=x["initial_state"], output_final_state=True)
        torch.autograd.backward([o, s], [do, torch.ones_like(s)])
    return run, list(x.values())


def check_candidates(device, names, log, dims=CHECK_DIMS) -> list:
    """Every candidate against the float64 oracle (resets, zero keys, key norms 1e-4..1e4, T not a multiple of the
    chunk); one line per check with the max relative error per tensor and OK/FAIL."""
    rows, refs = [], {}
    t0 = time.time()
    for name, rule, dt, D, cfg in check_jobs(names, dims):
        dtype = DTYPES[dt]
        key = (rule, dt, D)
        if key not in refs:
            inp = inputs(CHECK_B, CHECK_T, CHECK_H, D, D, rule, seed=D + len(rule), device=device)
            g = torch.Generator(device=device).manual_seed(99)
            do = torch.randn(CHECK_B, CHECK_T, CHECK_H, D, device=device, dtype=torch.float64, generator=g)
            ds = torch.randn(CHECK_B, CHECK_H, D, D, device=device, dtype=torch.float64, generator=g)
            refs[key] = inp, (*oracle(inp, rule, dtype, do, ds), do, ds)
        inp, ref = refs[key]
        try:
            errs = check_chunk(inp, rule, dtype, cfg, ref)
        except Exception as e:
            errs = {"error": float("inf")}
            print(f"{name} {rule} {dt} D{D}: {type(e).__name__}: {str(e)[:300]}", file=log, flush=True)
        tol = fp32_tol(cfg) if dtype == torch.float32 else 1e-2
        m = max(errs.values())
        ok = m <= tol
        line = (f"[{time.time() - t0:4.0f}s] {name:18s} {rule:8s} {dt:8s} D{D} BV{cfg['block_v']}/{cfg['block_v_bwd']} "
                f"max {m:.1e} (tol {tol:.0e}) {'OK' if ok else 'FAIL'}  " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
        print(line, file=log, flush=True)
        rows.append((ok, line))
    return rows


def time_candidates(device, names, shapes, log, fla) -> list:
    """fwd and fwd+bwd (EFLA fp32, resets ~2%, key norms 1e-2..1e2; ``do_bench``: CUDA events, median after
    warm-up) of every candidate at every shape, with the compiled kernels' registers and spills; fla rows
    (DeltaNet, unit keys, no resets: fused_recurrent fp32 and chunk bf16) when importable."""
    import triton.testing

    from rlseq.kernels.triton_chunk import LAST_COMPILED

    rows = []
    for B, T, H, D in shapes:
        _, fns = timed_problem(B, T, H, D, device)
        for name in names:
            fb, f = fns(CANDIDATES[name])
            try:
                LAST_COMPILED.clear()
                tfb = triton.testing.do_bench(fb, warmup=25, rep=100, return_mode="median")
                res = resources()
                tf = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
            except Exception as e:
                print(f"time {name} B{B} T{T} H{H} D{D}: ERROR {type(e).__name__}: {str(e)[:300]}", file=log, flush=True)
                continue
            rows.append(((B, T, H, D), name, tf, tfb, res, describe(resolve(name, B, T, H, D, D), T, D, D, B, H)))
            print(f"time B{B} T{T} H{H} D{D} {name}: fwd {tf:.3f} ms, fwd+bwd {tfb:.3f} ms | {res}", file=log, flush=True)
        if fla:
            for dt in (torch.float32, torch.bfloat16):
                try:
                    xin = inputs(B, T, H, D, D, "deltanet", seed=1, device=device, reset_prob=0.0)
                    run, leaves = fla_fwd_bwd(xin, dt)
                    tfb = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median", grad_to_none=leaves)
                except Exception as e:
                    print(f"time fla {dt} B{B} D{D}: ERROR {type(e).__name__}: {str(e)[:200]}", file=log, flush=True)
                    continue
                what = "fla fused_recurrent fp32" if dt == torch.float32 else "fla chunk bf16"
                rows.append(((B, T, H, D), what, float("nan"), tfb, "", "DeltaNet, no resets"))
    return rows


def kernel_breakdown(device, names, shapes, iters: int = 20) -> None:
    """``--breakdown``: device time of every kernel one fwd+bwd launches (EFLA fp32, resets ~2%), from
    ``torch.profiler`` over ``iters`` calls after warm-up, per candidate and shape, with the wall fwd+bwd
    (``do_bench`` median) beside it: where the time goes, and how much of it is host or launch gaps."""
    import triton.testing
    from torch.profiler import ProfilerActivity, profile

    from rlseq.bench.timing import graph_ms
    from rlseq.kernels.triton_chunk import LAST_COMPILED

    print("| shape (B,T,H,D) | candidate | fwd+bwd ms (wall) | kernel | device ms per call |")
    print("|---|---|---|---|---|")
    for (B, T, H, D), name in itertools.product(shapes, names):
        x, fns = timed_problem(B, T, H, D, device)
        fb, _ = fns(CANDIDATES[name])
        LAST_COMPILED.clear()
        wall = triton.testing.do_bench(fb, warmup=25, rep=100, return_mode="median")
        print(f"| {(B, T, H, D)} | {name} | {wall:.3f} | resources | {resources()} |", flush=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fb()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"| {(B, T, H, D)} | {name} | {wall:.3f} | host enqueue per call / wall per call, no sync between calls "
              f"| {(t1 - t0) / iters * 1e3:.3f} / {(t2 - t0) / iters * 1e3:.3f} |", flush=True)
        print(f"| {(B, T, H, D)} | {name} | {wall:.3f} | fwd+bwd replayed from a CUDA graph | {graph_ms(fb, list(x.values())):.3f} |",
              flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fb()
            torch.cuda.synchronize()
        per = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name] = per.get(ev.name, 0.0) + ev.device_time_total / 1e3 / iters
        if not per:  # a profiler without per-kernel device events: print its own table
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
            continue
        total = sum(per.values())
        for kname, ms in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"| {(B, T, H, D)} | {name} | {wall:.3f} | {kname[:60]} | {ms:.3f} |", flush=True)
        print(f"| {(B, T, H, D)} | {name} | {wall:.3f} | **all kernels** | {total:.3f} |", flush=True)


def run_candidates(device, names, log, jobs, fla, dims=CHECK_DIMS) -> None:
    """``--candidates``: compile in ``jobs`` parallel processes, then check every candidate, then time them."""
    import subprocess

    t0 = time.time()
    if jobs > 0:
        cmd = [sys.executable, "-m", "rlseq.bench.gpu_check", "--candidates", *names, "--check-dims", *map(str, dims),
               "--warm-candidates"]
        procs = [subprocess.Popen(cmd + [str(i), str(jobs)] + ([] if fla else ["--no-fla"]), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for i in range(jobs)]
        for p in procs:
            out, _ = p.communicate()
            for line in out.splitlines():
                if "ERROR" in line:
                    print(line, flush=True)
        print(f"compiled in {jobs} processes: {time.time() - t0:.0f}s", flush=True)
    rows = check_candidates(device, names, log, dims)
    n_fail = sum(not ok for ok, _ in rows)
    print(f"correctness: {len(rows) - n_fail}/{len(rows)} OK ({time.time() - t0:.0f}s so far)", flush=True)
    for ok, line in rows:
        if not ok:
            print(line, flush=True)
    res = time_candidates(device, names, TIME_SHAPES, log, fla)
    print(f"timing done ({time.time() - t0:.0f}s)\n")
    print("| shape (B,T,H,D) | candidate | fwd ms | fwd+bwd ms | config | regs/spills |")
    print("|---|---|---|---|---|---|")
    for shape, name, tf, tfb, rs, desc in sorted(res, key=lambda r: (TIME_SHAPES.index(r[0]), r[3])):
        print(f"| {shape} | {name} | {tf:.3f} | {tfb:.3f} | {desc} | {rs} |")


def ptxas_report(names, shapes, arch=90) -> None:
    """``--ptxas``, no GPU needed: compile every kernel each candidate launches at each shape (EFLA fp32) for
    sm_{arch} and print ptxas's registers per thread and spill bytes. The launches are recorded from the real
    wrappers (chunk_fwd/chunk_bwd on tiny CPU tensors with the kernels swapped for recorders), so the signatures
    and constexprs are exactly those of a GPU run. Run it without TRITON_INTERPRET."""
    import re
    import subprocess
    import tempfile

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from rlseq.kernels import triton_chunk as tc

    kernels = ("chunk_prep_kernel", "chunk_fwd_kernel", "chunk_bwd_kernel", "chunk_bwd_v_kernel", "chunk_bwd_k_kernel")
    ptr = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8"}

    class Recorder:
        def __init__(self, fn, calls):
            self.fn, self.calls = fn, calls

        def __getitem__(self, grid):
            return lambda *args, **kw: self.calls.append((self.fn, args, kw))

    print(f"| shape (B,T,H,D) | candidate | kernel | regs | spill stores/loads (bytes) | compile s |")
    print("|---|---|---|---|---|---|")
    for (B, T, H, D), name in itertools.product(shapes, names):
        cfg = resolve(name, B, T, H, D, D)
        calls = []
        saved = {n: getattr(tc, n) for n in kernels}
        try:
            for n in kernels:
                setattr(tc, n, Recorder(saved[n], calls))
            inp = {n: t.float() for n, t in inputs(1, 2 * cfg["chunk_size"], H, D, D, "efla", 0, "cpu").items()
                   if n != "resets"}
            resets = torch.zeros(1, 2 * cfg["chunk_size"], dtype=torch.bool)
            _, ht, saved_fwd = tc.chunk_fwd(inp["q"], inp["k"], inp["v"], inp["beta"], resets, inp["initial_state"],
                                            efla=True, save=True, cfg=cfg)
            tc.chunk_bwd(inp["q"], inp["k"], inp["v"], inp["beta"], resets, saved_fwd, torch.zeros_like(inp["v"]),
                         ht, efla=True, cfg=cfg)
        finally:
            for n in kernels:
                setattr(tc, n, saved[n])
        for fn, args, kw in calls:
            sig, consts, attrs = {}, {}, {}
            for i, (arg, param) in enumerate(zip(fn.arg_names, fn.params)):
                val = args[i] if i < len(args) else kw[arg]
                if isinstance(val, torch.Tensor):
                    sig[arg], attrs[(i,)] = ptr[val.dtype], [["tt.divisibility", 16]]
                elif param.is_constexpr:
                    sig[arg], consts[(i,)] = "constexpr", val
                else:
                    sig[arg] = "i32"
            t0 = time.time()
            k = triton_compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                               options=dict(num_warps=kw["num_warps"], num_stages=kw["num_stages"],
                                            **tc._maxnreg(kw.get("maxnreg"))))
            ct = time.time() - t0
            with tempfile.TemporaryDirectory() as tmp:
                src = f"{tmp}/k.ptx"
                with open(src, "w") as fh:
                    fh.write(k.asm["ptx"])
                log = subprocess.run([knobs.nvidia.ptxas.path, "-v", f"--gpu-name=sm_{arch}a", src, "-o", f"{tmp}/k.o"],
                                     capture_output=True, text=True).stderr
            regs = re.search(r"Used (\d+) registers", log)
            if regs is None:  # e.g. a Triton whose PTX is newer than its bundled ptxas
                print(f"ptxas gave no register count for {fn.__name__}: {log.strip()[:200]}", file=sys.stderr)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            print(f"| {(B, T, H, D)} | {name} | {fn.__name__} w{kw['num_warps']} | {regs.group(1) if regs else '?'} | "
                  f"{'/'.join(spill.groups()) if spill else '?'} | {ct:.1f} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--time", action="store_true")
    p.add_argument("--log", default=None)
    p.add_argument("--quick", action="store_true",
                   help="default config only, fp32, shapes 0 and 2, both rules, step at K=V=64 with 2/4/8 warps")
    p.add_argument("--time-configs", type=int, nargs="*", default=None, help="indices of the configs to time")
    p.add_argument("--no-check", action="store_true", help="skip the correctness sweep (e.g. with --time)")
    p.add_argument("--no-fla", action="store_true", help="--warm, --candidates: skip the fla kernels")
    p.add_argument("--warm", type=int, nargs=2, default=None, metavar=("I", "N"), help="compile share I of N, then exit")
    p.add_argument("--candidates", nargs="*", default=None, metavar="NAME",
                   help=f"check and time the named configs (none named: all of {', '.join(CANDIDATES)}) and the fla "
                        "kernels, after compiling in --jobs parallel processes")
    p.add_argument("--jobs", type=int, default=12, help="--candidates: parallel compile processes (0: none)")
    p.add_argument("--warm-candidates", type=int, nargs=2, default=None, metavar=("I", "N"), help=argparse.SUPPRESS)
    p.add_argument("--check-dims", type=int, nargs="+", default=list(CHECK_DIMS),
                   help="--candidates: head dims (K = V) of the correctness checks")
    p.add_argument("--breakdown", action="store_true",
                   help="with --candidates: device time per kernel of fwd+bwd (torch.profiler), no checks")
    p.add_argument("--shapes", nargs="*", default=None, metavar="B,T,H,D", help="--breakdown: shapes (default: the timed ones)")
    p.add_argument("--ptxas", action="store_true",
                   help="no GPU: registers and spills of every kernel of the candidates at the timed shapes (sm_90)")
    a = p.parse_args(argv)
    import triton

    if a.candidates is not None or a.ptxas:
        names = a.candidates or list(CANDIDATES)
        unknown = [n for n in names if n not in CANDIDATES]
        if unknown:
            raise SystemExit(f"unknown candidates {unknown}; valid: {', '.join(CANDIDATES)}")
        if a.ptxas:
            return ptxas_report(names, TIME_SHAPES[:4])
    device = torch.device("cuda")
    fla = not a.no_fla and importlib.util.find_spec("fla") is not None
    if a.warm_candidates is not None:
        return warm_candidates(device, *a.warm_candidates, names, fla, a.check_dims)
    log = open(a.log, "w") if a.log else sys.stdout
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if a.breakdown:
        shapes = [tuple(int(v) for v in sh.split(",")) for sh in a.shapes] if a.shapes else TIME_SHAPES
        return kernel_breakdown(device, names, shapes)
    if a.candidates is not None:
        return run_candidates(device, names, log, a.jobs, fla, a.check_dims)
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
