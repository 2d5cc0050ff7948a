"""Random inputs for kernel tests: fresh every call, never zeros, with resets and extreme key norms."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Inputs for ``chunk_rule``. EFLA keys get log-uniform norms in ``key_norms``; DeltaNet keys are unit
    (as its callers normalise). Resets hit random positions plus t = 0, two consecutive steps and, when T
    is long enough, the start of the second chunk of 16."""
    g = generator
    kw = dict(dtype=torch.float64, device=device)
    q = torch.randn(B, T, H, K, generator=g, **kw)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, **kw), dim=-1)
    if rule == "efla":
        lo, hi = torch.log10(torch.tensor(key_norms, dtype=torch.float64))
        k = k * 10 ** (lo + (hi - lo) * torch.rand(B, T, H, 1, generator=g, **kw))
    v = torch.randn(B, T, H, V, generator=g, **kw)
    beta = beta_max * torch.rand(B, T, H, generator=g, **kw)
    resets = torch.rand(B, T, generator=g, device=device) < reset_prob
    resets[0, 0] = True
    if T >= 4:
        resets[-1, T // 2 : T // 2 + 2] = True
    if T > 17:
        resets[0, 16] = True
    initial_state = torch.randn(B, H, K, V, generator=g, **kw)
    out = dict(q=q, k=k, v=v, beta=beta, resets=resets, initial_state=initial_state)
    return {n: (x.to(dtype) if x.is_floating_point() and n != "initial_state" else x) for n, x in out.items()}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖x − ref‖ / ‖ref‖`` in float64; NaN anywhere gives inf."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()
