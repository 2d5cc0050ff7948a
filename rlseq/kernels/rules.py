"""The delta rules, defined once.

Both rules share the update ``S_t = (I - a_t k_t k_tᵀ) S_{t-1} + a_t k_t v_tᵀ`` and differ only in how
the step size ``a_t`` comes from ``β_t`` and the key (docs: ``../shared/docs/efla.md``):

- ``deltanet``: ``a = β`` (the explicit Euler step), keys used as given;
- ``efla``: ``a = (1 - exp(-β λ)) / λ`` with ``λ = ‖k‖²`` (the exact solution of the ODE).

Fast paths use the equivalent *unit-key form* ``S_t = S_{t-1} + k̂ (w - g k̂ᵀ S_{t-1})ᵀ``, in which every
rule is a gate ``g`` on a unit-scale key ``k̂`` plus a written value ``w``. :func:`unit_key_form` is the
only place where that mapping lives; Triton kernels mirror it element for element.
"""

from __future__ import annotations

import torch

RULES = ("efla", "deltanet")

# φ(x) = -expm1(-x)/x switches to its Taylor series below this x: the quotient's gradient cancels there.
PHI_TAYLOR_BELOW = 0.1
# Keys with a norm below this are treated as this norm when normalised, which keeps k̂ · w exact (= β φ k)
# and its gradient finite for exactly zero keys.
MIN_KEY_NORM = 1e-12


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; valid rules: {', '.join(RULES)}")
    return rule


def phi(x: torch.Tensor) -> torch.Tensor:
    """``φ(x) = (1 - e^{-x}) / x`` with ``φ(0) = 1``, accurate with accurate gradients for every ``x ≥ 0``."""
    small = x < PHI_TAYLOR_BELOW
    xs = torch.where(small, x, torch.zeros_like(x))
    # Σ_{n=0..10} (-x)^n / (n+1)! nested as 1 - x/2 (1 - x/3 (1 - ...)); the first dropped term is
    # x^11/12! < 3e-20 at x = 0.1, so the switch costs nothing even in float64.
    taylor = torch.ones_like(x)
    for n in range(10, 0, -1):
        taylor = 1 - xs / (n + 1) * taylor
    xl = torch.where(small, torch.ones_like(x), x)  # keep the unused branch finite so its gradient is too
    return torch.where(small, taylor, -torch.expm1(-xl) / xl)


def step_size(k: torch.Tensor, beta: torch.Tensor, rule: str) -> torch.Tensor:
    """The step size ``a`` of the raw-key update. ``k: [..., K]``, ``beta: [...]`` → ``[...]``."""
    if rule == "deltanet":
        return beta
    lam = (k * k).sum(-1)
    return beta * phi(beta * lam)


def unit_key_form(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map raw inputs to the unit-key form ``(k̂, g, w)`` used by the chunked and step kernels.

    Shapes: ``k: [..., K]``, ``v: [..., V]``, ``beta: [...]`` → ``k̂: [..., K]``, ``g: [...]``, ``w: [..., V]``.

    - ``deltanet``: ``k̂ = k``, ``g = β``, ``w = β v``.
    - ``efla``: ``k̂ = k/‖k‖``, ``g = 1 - e^{-βλ} ∈ [0, 1)``, ``w = β ‖k‖ φ(βλ) v`` (= ``g v / ‖k‖``, finite for any
      key norm). With unit keys the transition's eigenvalue ``1 - g`` stays in ``(0, 1]``, and the WY triangular
      solve stays well conditioned whatever the raw key norms are.
    """
    if rule == "deltanet":
        return k, beta, beta.unsqueeze(-1) * v
    lam = (k * k).sum(-1)
    norm = lam.clamp_min(MIN_KEY_NORM**2).sqrt()  # clamp before sqrt: its gradient at 0 is inf
    x = beta * lam
    ph = phi(x)
    return k / norm.unsqueeze(-1), x * ph, (beta * norm * ph).unsqueeze(-1) * v
