"""``python -m rlseq.bench kernels``: chunk_rule forward and forward+backward time per backend at RL shapes,
with each row's error against the float64 oracle."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from rlseq.bench.timing import describe_environment, median_ms
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


def time_backend(inp: dict[str, torch.Tensor], rule: str, backend: str, repeats: int) -> tuple[float, float, torch.Tensor]:
    """(forward ms, forward+backward ms, output) for one backend."""
    device = inp["q"].device
    leaves = {n: inp[n].clone().requires_grad_() for n in ("q", "k", "v", "beta", "initial_state")}

    def forward():
        return chunk_rule(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], rule=rule,
                          initial_state=leaves["initial_state"], resets=inp["resets"], backend=backend)

    grad_o = torch.randn_like(inp["v"])

    def forward_backward():
        o, s = forward()
        torch.autograd.backward([o, s], [grad_o, torch.ones_like(s)])

    def forward_only():
        with torch.no_grad():
            return forward()

    warmup = 1 if backend == "reference" else 3
    fwd = median_ms(forward_only, device, warmup=warmup, repeats=repeats)
    both = median_ms(forward_backward, device, warmup=warmup, repeats=repeats)
    with torch.no_grad():
        o, _ = forward()
    return fwd, both, o


def main(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    backends = args.backends or [b for b in ("reference", "torch", "triton") if b != "triton" or triton_available(device)]
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    T, H = args.steps, args.heads
    print(describe_environment(device))
    print(f"rule {args.rule}, float32 inputs, T={T}, H={H}, resets ~2% of steps; median of {repeats} after warm-up\n")
    print("| B | T | H | D | backend | fwd ms | fwd+bwd ms | bwd ms | fwd speed-up vs reference | bwd speed-up vs reference | rel. err vs fp64 oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B in args.batch:
        for D in args.head_dim:
            inp = make_inputs(B, T, H, D, args.rule, device)
            with torch.no_grad():
                o_ref, _ = chunk_rule(*(inp[n].double() for n in ("q", "k", "v", "beta")), rule=args.rule,
                                      initial_state=inp["initial_state"].double(), resets=inp["resets"], backend="reference")
            base = None
            for backend in backends:
                fwd, both, o = time_backend(inp, args.rule, backend, repeats)
                bwd = both - fwd
                if backend == "reference":
                    base = (fwd, bwd)
                err = ((o.double() - o_ref).norm() / o_ref.norm()).item()
                sp = f"{base[0] / fwd:.1f}x | {base[1] / bwd:.1f}x" if base else "- | -"
                print(f"| {B} | {T} | {H} | {D} | {backend} | {fwd:.3f} | {both:.3f} | {bwd:.3f} | {sp} | {err:.1e} |", flush=True)
