"""The delta rules, defined once (the math: docs/rules.md).

Both rules share the update ``S_t = (I - a_t k_t k_tᵀ) S_{t-1} + a_t k_t v_tᵀ`` and differ only in how the step size
``a_t`` comes from ``β_t ≥ 0`` and the key:

- ``deltanet``: ``a = β`` (the explicit Euler step), keys used as given;
- ``efla``: ``a = (1 - exp(-β λ)) / λ`` with ``λ = ‖k‖²`` (the exact solution of the ODE).

The oracle (:mod:`rlseq.kernels.naive`) uses that raw-key form through :func:`step_size`. The fast paths use the
equivalent *unit-key form* ``S_t = S_{t-1} + k̂ (w - g k̂ᵀ S_{t-1})ᵀ`` of :func:`unit_key_scales`, the only place
where that mapping lives; ``triton_core.gate_fwd`` is its in-kernel twin (tests/test_triton.py holds them together).
"""

from __future__ import annotations

import math

import torch

RULES = ("efla", "deltanet")

# φ and φ' switch to their Taylor series below this x, where the closed forms cancel (the oracle and the Triton gate)
PHI_TAYLOR_BELOW = 0.1
# Key norms below this are treated as this norm, which keeps k̂ = k/n finite for zero keys (their update is zero).
MIN_KEY_NORM = 1e-12


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; valid rules: {', '.join(RULES)}")
    return rule


class _Phi(torch.autograd.Function):
    """φ with a hand-written derivative: autograd of the quotient cancels for small x."""

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


def step_size(k: torch.Tensor, beta: torch.Tensor, rule: str) -> torch.Tensor:
    """The step size ``a`` of the raw-key update (the oracle's form). ``k: [..., K]``, ``beta: [...]`` → ``[...]``."""
    if rule == "deltanet":
        return beta
    return beta * phi(beta * (k * k).sum(-1))


def key_norm(k: torch.Tensor) -> torch.Tensor:
    """``‖k‖`` over the last dim without overflow (``‖k‖²`` overflows float32 above ~1.8e19): the squares are summed
    in float64, where no float32 (or bf16/fp16) value overflows or underflows; float64 keys are exact below 1e154.
    One reduction (the acting step runs this per env step; a max-scaled norm cost ~10x more at acting sizes)."""
    if k.dtype == torch.float64:
        return torch.linalg.vector_norm(k, dim=-1)
    return torch.linalg.vector_norm(k, dim=-1, dtype=torch.float64).to(k.dtype)


def unit_key_scales(
    k: torch.Tensor, beta: torch.Tensor, rule: str
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The rule-specific part of the unit-key form: ``(c, g, s)`` with ``k̂ = c k`` and the written value ``w = s v``.

    Shapes: ``k: [..., K]``, ``beta: [...]`` → ``c: [...]`` (None: 1), ``g: [...]``, ``s: [...]``.

    - ``deltanet``: ``c = 1``, ``g = β``, ``s = β``.
    - ``efla``: with ``n = max(‖k‖, MIN_KEY_NORM)`` and ``x = βn²``: ``c = 1/n``, ``g = 1 - e^{-x} ∈ [0, 1]`` and
      ``s = g/n`` (``= β n φ(x)``). ``x`` is formed as ``(βn)·n`` and ``g`` by ``expm1``, so an overflowing ``x``
      gives ``g = 1``, ``s = 1/n`` and finite gradients, for any key norm up to the dtype's largest number. With
      unit keys the transition's eigenvalue ``1 - g`` stays in ``[0, 1]`` and the WY triangular solve stays well
      conditioned whatever the raw key norms are. Derivatives by autograd.
    """
    if rule == "deltanet":
        return None, beta, beta
    n = key_norm(k).clamp_min(MIN_KEY_NORM)
    g = -torch.expm1(-(beta * n) * n)
    return 1 / n, g, g / n


def unit_key_form(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map raw inputs to the unit-key form ``(k̂, g, w)`` used by the chunked and step kernels.

    Shapes: ``k: [..., K]``, ``v: [..., V]``, ``beta: [...]`` → ``k̂: [..., K]``, ``g: [...]``, ``w: [..., V]``.
    See :func:`unit_key_scales`: ``k̂ = c k``, ``w = s v``.
    """
    c, g, s = unit_key_scales(k, beta, rule)
    return (k if c is None else c.unsqueeze(-1) * k), g, s.unsqueeze(-1) * v
