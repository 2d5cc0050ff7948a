"""Public entry points: :func:`chunk_rule` for whole sequences and :func:`step_rule` for acting."""

from __future__ import annotations

import importlib
import numbers
import os

import torch

from rlseq.kernels.chunk import chunk_torch, step_torch
from rlseq.kernels.naive import naive_rule, naive_step
from rlseq.kernels.rules import check_rule

BACKENDS = ("reference", "torch", "triton")
TRITON_CHUNK = 16  # the triton backend's one chunk length
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def triton_available(device: torch.device, module: str = "rlseq.kernels.triton_ops") -> bool:
    """Whether the Triton backend can run on ``device``: CUDA with triton installed, or any device under
    ``TRITON_INTERPRET=1`` (the interpreter runs kernels on CPU tensors). ``module``: the kernels' module, imported
    to check (the delta rules' by default)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _pick_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "triton" if device.type == "cuda" and triton_available(device) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)} (or None for the best available)")
    if backend == "triton" and not triton_available(device):
        raise RuntimeError(
            "backend 'triton' is not available here: it needs the `triton` package and CUDA tensors "
            f"(got device {device}), or TRITON_INTERPRET=1 set before triton is imported to run it on the CPU. "
            "Use backend='torch' on the CPU."
        )
    return backend


def _check_dtypes_devices(named: dict[str, torch.Tensor]) -> None:
    first_name, first = next(iter(named.items()))
    if first.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{first_name} must be a floating tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {first.dtype}")
    for name, x in named.items():
        if x.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}, but {first_name} has {first.dtype}: q, k, v and beta must share a dtype")
        if x.device != first.device:
            raise ValueError(f"{name} is on {x.device}, but {first_name} is on {first.device}: all inputs must share a device")


def _check_state(name: str, state: torch.Tensor, shape: tuple[int, ...], ref: torch.Tensor) -> None:
    if tuple(state.shape) != shape:
        raise ValueError(f"{name} must have shape [B, H, K, V] = {list(shape)}, got {list(state.shape)}")
    if state.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name} must be float32 (or float64), got {state.dtype}")
    if state.device != ref.device:
        raise ValueError(f"{name} is on {state.device}, but q is on {ref.device}")


def _check_resets(resets: torch.Tensor, shape: tuple[int, ...], ref: torch.Tensor) -> None:
    if tuple(resets.shape) != shape or resets.dtype != torch.bool:
        raise ValueError(f"resets must be a bool tensor of shape {list(shape)}, got {resets.dtype} {list(resets.shape)}")
    if resets.device != ref.device:
        raise ValueError(f"resets is on {resets.device}, but q is on {ref.device}")


def _check_beta(beta: torch.Tensor) -> None:
    """Refuse β < 0: both rules are defined for β ≥ 0 (EFLA's gate 1 − e^{−βλ} would exceed the [0, 1] its kernels
    assume). One host sync on CUDA; skipped while a CUDA graph is being captured (no sync is allowed there)."""
    if beta.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if beta.numel() and bool((beta < 0).any()):
        raise ValueError(f"beta must be >= 0 (got a minimum of {beta.min().item():.3g}); squash it with a sigmoid "
                         "or softplus")


def _episode_starts(resets: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    """``[B, T]`` int64: the step at which the episode holding step t began (0 for the first episode)."""
    steps = torch.arange(T, device=device).expand(B, T)
    if resets is None:
        return torch.zeros_like(steps)
    return torch.cummax(torch.where(resets, steps, 0), dim=1).values


def _quarantine(q, k, v, beta, initial_state, resets):
    """Split non-finite inputs off the chunked backends: returns ``(q, k, v, beta, initial_state)`` with every NaN
    or inf replaced by 0, and the masks ``o_bad [B, T, H, V]`` and ``s_bad [B, H, 1, V]`` of the outputs and final
    state entries that the step loop makes non-finite, to be set to NaN afterwards.

    A chunk mixes its steps in matrix products, where a masked-out ``0·NaN`` is still NaN: a non-finite input
    would reach earlier steps and, through a reset, the next episode. The step loop's reach is narrower and is
    reproduced here exactly: a non-finite key or β poisons every column from its step to the end of its episode;
    a non-finite value entry, or an initial-state column holding one, poisons only its column; a non-finite query
    only its own output row. Gradients with respect to the replaced entries are 0."""
    B, T = q.shape[:2]

    def clean(x):
        return torch.where(torch.isfinite(x), x, 0.0)

    bad = (~torch.isfinite(v)) | ~(torch.isfinite(k).all(-1) & torch.isfinite(beta)).unsqueeze(-1)  # [B, T, H, V]
    seen = torch.cumsum(bad, dim=1, dtype=torch.int32)  # non-finite entries up to and including t, per column
    start = _episode_starts(resets, B, T, q.device).view(B, T, 1, 1).expand_as(seen)
    before = seen.gather(1, start) - bad.gather(1, start).to(torch.int32)  # ... before the episode's first step
    poisoned = seen > before
    h0 = initial_state
    if h0 is not None:
        h0_bad = ~torch.isfinite(h0).all(-2)  # [B, H, V]: a column of S feeds only that column of o and S
        h0_bad = h0_bad.unsqueeze(1)
        if resets is not None:  # only the first episode sees the initial state
            h0_bad = h0_bad & (torch.cumsum(resets, 1) == 0).view(B, T, 1, 1)
        poisoned = poisoned | h0_bad
        h0 = clean(h0)
    o_bad = poisoned | ~torch.isfinite(q).all(-1, keepdim=True)
    return clean(q), clean(k), clean(v), clean(beta), h0, o_bad, poisoned[:, -1].unsqueeze(-2)


def chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    rule: str,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
    backend: str | None = None,
    chunk_size: int | None = None,
    check_beta: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a delta rule over whole sequences.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys. Keys are used as given (EFLA wants them raw;
            DeltaNet callers normalise them). Queries are not scaled.
        v: ``[B, T, H, V]`` values.
        beta: ``[B, T, H]``, any value ``≥ 0`` (negative values raise): DeltaNet's step size, EFLA's step length.
        rule: ``"efla"`` or ``"deltanet"``.
        initial_state: ``[B, H, K, V]`` float32/float64 state entering step 0, or None for zeros.
        resets: ``[B, T]`` bool; True at t means an episode starts at t: the state before step t is zero
            (at t = 0 ``initial_state`` is ignored for that sequence, NaN or inf included).
        backend: ``"reference"`` (the float64-capable step loop, the oracle), ``"torch"`` (chunked, the
            CPU default), ``"triton"`` (the CUDA default), or None for the best available.
        chunk_size: chunk length (default 16). The ``"torch"`` backend takes any length ≥ 1; the ``"triton"``
            backend runs chunks of 16 only and refuses any other value; ``"reference"`` has no chunks and ignores it.
        check_beta: refuse ``beta < 0``. On CUDA the check reads one flag back (a host sync, which stalls eager
            training); pass False where β is ≥ 0 by construction (a sigmoid), as rlseq's memory layers do.

    Returns:
        ``o [B, T, H, V]`` in the input dtype, with ``o_t = S_tᵀ q_t`` after the update at t, and the final
        state ``[B, H, K, V]`` in float32 (float64 for float64 inputs). Differentiable with respect to
        q, k, v, beta and initial_state on every backend. Empty inputs (B, H, K or V = 0) give empty results.

    Non-finite inputs: every backend makes the step loop's entries NaN (the reference leaves inf as inf): a NaN or
    inf key or β, the outputs from its step to its episode's end; a value entry, or an initial-state column holding
    one, that column; a query, its own output. The next episode and the earlier steps are untouched, and so are the
    gradients of a loss on the finite outputs, except within the poisoned episode: there the chunked backends give
    finite gradients (0 for the non-finite entries) where autograd through the step loop gives NaN.
    """
    check_rule(rule)
    _check_dtypes_devices({"q": q, "k": k, "v": v, "beta": beta})
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both have shape [B, T, H, K]; got q {list(q.shape)}, k {list(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {list(v.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must have shape [B, T, H] = {[B, T, H]}, got {list(beta.shape)}")
    if T == 0:
        raise ValueError("sequences must have at least one step (T >= 1)")
    V = v.shape[-1]
    if initial_state is not None:
        _check_state("initial_state", initial_state, (B, H, K, V), q)
    if resets is not None:
        _check_resets(resets, (B, T), q)
    backend = _pick_backend(backend, q.device)
    # a bool is an int to Python (True would run chunks of 1); a float would fail deep inside the chunking
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be an integer >= 1 (or None), got {chunk_size!r}")
    if backend == "triton" and chunk_size not in (None, TRITON_CHUNK):
        raise ValueError(f"the triton backend runs chunks of {TRITON_CHUNK} only, got chunk_size={chunk_size}; "
                         f"pass None (or {TRITON_CHUNK}), or use backend='torch' for other chunk lengths")
    if check_beta:
        _check_beta(beta)
    if initial_state is not None and resets is not None:
        # where, not a product: the state of a sequence that starts an episode at t = 0 is ignored, NaN or not
        initial_state = initial_state.masked_fill(resets[:, :1, None, None], 0.0)
    if q.numel() == 0 or v.numel() == 0:
        backend = "reference"  # nothing to compute: the step loop gives the empty (or zero) results and their grads

    if backend == "reference":
        o, s = naive_rule(q, k, v, beta, rule=rule, initial_state=initial_state, resets=resets)
        return o.to(q.dtype), s
    dtype = q.dtype
    q, k, v, beta, initial_state, o_bad, s_bad = _quarantine(q, k, v, beta, initial_state, resets)
    if backend == "torch":
        o, s = chunk_torch(q, k, v, beta, rule=rule, initial_state=initial_state, resets=resets, chunk_size=chunk_size or 16)
    else:
        from rlseq.kernels.triton_ops import chunk_triton

        o, s = chunk_triton(q, k, v, beta, rule=rule, initial_state=initial_state, resets=resets)
    nan = float("nan")
    return o.to(dtype).masked_fill(o_bad, nan), s.masked_fill(s_bad, nan)


def step_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    rule: str,
    resets: torch.Tensor | None = None,
    backend: str | None = None,
    check_beta: bool = True,
) -> torch.Tensor:
    """One step of a delta rule for acting; updates ``state`` in place.

    Args:
        q, k: ``[B, H, K]``; v: ``[B, H, V]``; beta: ``[B, H]``, ``≥ 0`` (negative values raise).
        state: ``[B, H, K, V]`` float32 (or float64), updated in place.
        resets: ``[B]`` bool; True zeroes that state before the step.
        check_beta: refuse ``beta < 0`` (a host sync on CUDA), as in :func:`chunk_rule`.

    Returns:
        ``o [B, H, V]`` in the dtype of q, read out after the update. Matches :func:`chunk_rule` applied
        one step at a time.
    """
    check_rule(rule)
    _check_dtypes_devices({"q": q, "k": k, "v": v, "beta": beta})
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both have shape [B, H, K]; got q {list(q.shape)}, k {list(k.shape)}")
    B, H, K = q.shape
    if v.dim() != 3 or tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"v must have shape [B, H, V] = [{B}, {H}, V], got {list(v.shape)}")
    if tuple(beta.shape) != (B, H):
        raise ValueError(f"beta must have shape [B, H] = {[B, H]}, got {list(beta.shape)}")
    _check_state("state", state, (B, H, K, v.shape[-1]), q)
    if resets is not None:
        _check_resets(resets, (B,), q)
    backend = _pick_backend(backend, q.device)
    if check_beta:
        _check_beta(beta)
    if q.numel() == 0 or v.numel() == 0:
        backend = "reference"

    if backend == "reference":
        if resets is not None:
            state.masked_fill_(resets.view(B, 1, 1, 1), 0.0)
        dt = state.dtype
        o, new = naive_step(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), state, rule)
        state.copy_(new)
        return o.to(q.dtype)
    if backend == "torch":
        return step_torch(q, k, v, beta, state, rule=rule, resets=resets)
    from rlseq.kernels.triton_ops import step_triton

    return step_triton(q, k, v, beta, state, rule=rule, resets=resets)
