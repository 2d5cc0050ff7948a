"""The oracle: the delta rules as a plain step-by-step loop over time.

Every fast path is tested against this, in float64. It uses the raw-key form of the update (not the
unit-key form the fast paths use), so the two routes to the answer are independent.
"""

from __future__ import annotations

import torch

from rlseq.kernels.rules import step_size


def naive_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rule: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step ``S' = S + a k (v - Sᵀk)ᵀ``, ``o = S'ᵀ q``.

    ``q, k: [B, H, K]``, ``v: [B, H, V]``, ``beta: [B, H]``, ``state: [B, H, K, V]`` → ``(o [B, H, V], S')``.
    """
    a = step_size(k, beta, rule)
    err = v - torch.einsum("bhkv,bhk->bhv", state, k)
    state = state + (a.unsqueeze(-1) * k).unsqueeze(-1) * err.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def naive_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    rule: str,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the rule over a sequence, one step at a time.

    ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``beta: [B, T, H]``, ``initial_state: [B, H, K, V]``,
    ``resets: [B, T]`` bool → ``(o [B, T, H, V], final_state [B, H, K, V])``. Computes in float64 for
    float64 inputs and in float32 otherwise; ``o`` is returned in the input dtype.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        if resets is not None:  # where, not a product: a NaN or inf state must not leak through a reset
            state = torch.where(resets[:, t].view(B, 1, 1, 1), 0.0, state)
        o, state = naive_step(q[:, t], k[:, t], v[:, t], beta[:, t], state, rule)
        outs.append(o)
    return torch.stack(outs, 1), state
