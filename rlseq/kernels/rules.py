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

import math

import torch

RULES = ("efla", "deltanet")

# φ'(x) switches to its Taylor series below this |x|: the closed form (e^{-x} - φ)/x cancels there.
PHI_TAYLOR_BELOW = 0.1
# Keys with a norm below this are treated as this norm when normalised, which keeps k̂ · w exact (= β φ k)
# and its gradient finite for exactly zero keys.
MIN_KEY_NORM = 1e-12


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; valid rules: {', '.join(RULES)}")
    return rule


class _Phi(torch.autograd.Function):
    """φ with a hand-written derivative: the quotient's own derivative cancels for small x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        nz = x != 0
        ph = torch.where(nz, -torch.expm1(-x) / torch.where(nz, x, 1.0), 1.0)  # expm1 keeps it exact to rounding
        ctx.save_for_backward(x, ph)
        return ph

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, ph = ctx.saved_tensors
        return grad * phi_grad(x, ph)


def phi(x: torch.Tensor) -> torch.Tensor:
    """``φ(x) = (1 - e^{-x}) / x`` with ``φ(0) = 1``, exact to rounding, with an accurate gradient (:func:`phi_grad`)."""
    return _Phi.apply(x)


def step_size(k: torch.Tensor, beta: torch.Tensor, rule: str) -> torch.Tensor:
    """The step size ``a`` of the raw-key update. ``k: [..., K]``, ``beta: [...]`` → ``[...]``."""
    if rule == "deltanet":
        return beta
    lam = (k * k).sum(-1)
    return beta * phi(beta * lam)


def unit_key_scales(
    k: torch.Tensor, beta: torch.Tensor, rule: str
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The rule-specific part of the unit-key form: ``(c, g, s)`` with ``k̂ = c k`` and the written value ``w = s v``.

    Shapes: ``k: [..., K]``, ``beta: [...]`` → ``c: [...]`` (None: 1), ``g: [...]``, ``s: [...]``.

    - ``deltanet``: ``c = 1``, ``g = β``, ``s = β``.
    - ``efla``: ``c = 1/‖k‖``, ``g = 1 - e^{-βλ} ∈ [0, 1)``, ``s = β ‖k‖ φ(βλ)`` (so ``w = g v / ‖k‖``, finite for
      any key norm). With unit keys the transition's eigenvalue ``1 - g`` stays in ``(0, 1]``, and the WY
      triangular solve stays well conditioned whatever the raw key norms are.
    """
    if rule == "deltanet":
        return None, beta, beta
    _, norm, x, ph = _efla_terms(k, beta)
    if _needs_grad(k, beta):
        return 1 / norm, x * ph, beta * norm * ph
    return norm.reciprocal(), x.mul_(ph), (beta * norm).mul_(ph)  # kernels call this under no_grad: in place


def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _efla_terms(k: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``λ = ‖k‖²``, the clamped norm ``n``, ``x = βλ`` and ``φ(x)``: what EFLA's gate and its gradient share.

    Without autograd (the kernels' forward and backward) the same values to rounding in fewer, in-place passes,
    which matter at RL shapes: ``n`` in one pass over ``k`` and ``φ`` without :class:`_Phi`."""
    if _needs_grad(k, beta):
        lam = (k * k).sum(-1)
        norm = lam.clamp_min(MIN_KEY_NORM**2).sqrt()  # clamp before sqrt: its gradient at 0 is inf
        x = beta * lam
        return lam, norm, x, phi(x)
    # φ = −expm1(−x)/x, with φ(0) = 1 (0/0 there); NaN inputs stay NaN, as in _Phi
    norm = torch.linalg.vector_norm(k, dim=-1)
    lam = norm * norm
    x = beta * lam
    ph = torch.neg(x).expm1_().div_(x).neg_().masked_fill_(x == 0, 1.0)
    return lam, norm.clamp_min_(MIN_KEY_NORM), x, ph


def unit_key_form(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map raw inputs to the unit-key form ``(k̂, g, w)`` used by the chunked and step kernels.

    Shapes: ``k: [..., K]``, ``v: [..., V]``, ``beta: [...]`` → ``k̂: [..., K]``, ``g: [...]``, ``w: [..., V]``.
    See :func:`unit_key_scales`: ``k̂ = c k``, ``w = s v``.
    """
    c, g, s = unit_key_scales(k, beta, rule)
    return (k if c is None else c.unsqueeze(-1) * k), g, s.unsqueeze(-1) * v


def phi_grad(x: torch.Tensor, ph: torch.Tensor) -> torch.Tensor:
    """``φ'(x)`` for ``x ≥ 0`` given ``ph = φ(x)``: ``(e^{-x} - φ)/x``, and below ``PHI_TAYLOR_BELOW`` (where
    that cancels) its Taylor series ``Σ_{n≥1} (-1)ⁿ n xⁿ⁻¹/(n+1)!``."""
    small = x.abs() < PHI_TAYLOR_BELOW
    xs = torch.where(small, x, 0.0)
    terms = 12 if x.dtype == torch.float64 else 7  # first dropped term < 1e-18 (float64) / 1e-9 (float32) at 0.1
    coef = [(-1) ** n * n / math.factorial(n + 1) for n in range(1, terms + 1)]
    taylor = torch.full_like(x, coef[-1])
    for c in reversed(coef[:-1]):
        taylor = taylor * xs + c
    xl = torch.where(small, 1.0, x)
    return torch.where(small, taylor, (torch.exp(-xl) - ph) / xl)


def unit_key_gate_backward(
    k: torch.Tensor, beta: torch.Tensor, rule: str, d_kh: torch.Tensor, d_g: torch.Tensor, d_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain rule of :func:`unit_key_scales` (``k̂ = c k``, ``g``, ``s``) by hand, for kernels with their own
    backward.

    Given ``∂L/∂k̂ [..., K]``, ``∂L/∂g [...]`` and ``∂L/∂s [...]``, returns ``(∂L/∂k, ∂L/∂β)``. Matches autograd of
    :func:`unit_key_form` (tested), including exactly zero keys, whose gradient comes from the clamped norm.
    """
    if rule == "deltanet":
        return d_kh, d_g + d_s
    lam, norm, x, ph = _efla_terms(k, beta)
    kh_dot = (k * d_kh).sum(-1) / norm  # k̂ · ∂L/∂k̂
    d_norm = d_s * beta * ph - kh_dot / norm  # k̂ = k/n and s = β n φ
    d_x = d_g * torch.exp(-x) + d_s * beta * norm * phi_grad(x, ph)  # g = 1 − e^{−x}
    d_beta = d_s * norm * ph + d_x * lam
    d_lam = d_x * beta + torch.where(lam > MIN_KEY_NORM**2, d_norm / (2 * norm), 0.0)
    return d_kh / norm.unsqueeze(-1) + (2 * d_lam).unsqueeze(-1) * k, d_beta
