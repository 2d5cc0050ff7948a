"""Memory layers for recurrent RL: EFLA, DeltaNet, LSTM and a no-memory control, behind one interface.

Every memory maps a feature sequence to an output sequence while carrying ONE float32 state tensor whose
batch is on dim 0, so algorithms can index, clone and store states uniformly (``state[env_idx]``) and never
care which memory they hold:

===============  ==========================  ============================================================
memory           state shape                 what it is
===============  ==========================  ============================================================
``"efla"``       ``[B, H, K, V]``            multi-head EFLA mixer (raw keys: the key norm is the gate)
``"deltanet"``   ``[B, H, K, V]``            the same block with L2-normalised keys (standard DeltaNet)
``"lstm"``       ``[B, 2, L, hidden]``       ``nn.LSTM``; h at ``[:, 0]``, c at ``[:, 1]``
``"none"``       ``[B, 0]``                  identity (the memoryless control, same network otherwise)
===============  ==========================  ============================================================

The interface (:class:`Memory`):

- ``initial_state(batch_size, device) -> state`` (zeros);
- ``forward(x [B, T, F], state, resets [B, T]) -> (y [B, T, out_features], final_state)`` for training; does
  not modify ``state``; differentiable with respect to the parameters, ``x`` and ``state``;
- ``step(x [B, F], state, resets [B]) -> y [B, out_features]`` for acting; updates ``state`` in place;
- ``diagnostics(x, state, resets) -> dict[str, 0-dim tensor]`` (no grad, no host sync);
- ``check_finite(state, where)`` raises :class:`MemoryStateError` naming the bad batch entries.

``resets[b, t] = True`` means an episode starts at step t of sequence b: the state before that step is zero
(at ``t = 0`` the given ``state`` is ignored for that sequence). ``forward`` over a sequence and ``step``
applied once per time step compute the same function (to float32 rounding); the tests check it.

All delta-rule math goes through :func:`rlseq.kernels.chunk_rule` / :func:`rlseq.kernels.step_rule`; this
module never re-implements the recurrence.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlseq.kernels import chunk_rule, step_rule
from rlseq.kernels.rules import unit_key_scales

MEMORIES = ("efla", "deltanet", "lstm", "none")

__all__ = [
    "MEMORIES",
    "DeltaNetMemory",
    "EFLAMemory",
    "LSTMMemory",
    "Memory",
    "MemoryStateError",
    "NoMemory",
    "make_memory",
]


class MemoryStateError(FloatingPointError):
    """A memory state holds NaN or inf. Raised by :meth:`Memory.check_finite`; the message names where it was
    checked, the memory type, the bad batch indices (and heads / layers) and the max |value| of the finite part."""


class Memory(nn.Module, metaclass=abc.ABCMeta):
    """Base class of all memories (abstract: subclasses implement ``state_shape``, ``forward`` and ``step``). See the module docstring for the contract.

    Attributes:
        name: registry name (``"efla"``, ``"deltanet"``, ``"lstm"``, ``"none"``).
        in_features: F, the feature size of ``x``.
        out_features: size of ``y``.
        train_graph_obstacle: why the training pass cannot be captured in a CUDA graph (a host read), or None.
    """

    name: str = "abstract"
    train_graph_obstacle: str | None = None
    in_features: int
    out_features: int

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Zero state for ``batch_size`` sequences: one float32 tensor with the batch on dim 0."""
        return torch.zeros(batch_size, *self.state_shape, dtype=torch.float32, device=device)

    @property
    @abc.abstractmethod
    def state_shape(self) -> tuple[int, ...]:
        """Per-sequence state shape (the state is ``[B, *state_shape]``)."""

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, F]``, ``state [B, ...]``, ``resets [B, T]`` bool → ``(y [B, T, out_features], final_state)``.
        Must not modify ``state``; differentiable with respect to the parameters, ``x`` and ``state``."""

    @abc.abstractmethod
    def step(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
        """One acting step: ``x [B, F]``, ``resets [B]`` bool → ``y [B, out_features]``; ``state`` updated in place."""

    @torch.no_grad()
    def diagnostics(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Health statistics as 0-dim tensors (no grad, no host sync). Empty for memories without any."""
        return {}

    def check_finite(self, state: torch.Tensor, where: str) -> None:
        """Raise :class:`MemoryStateError` if ``state`` holds NaN/inf. One host sync when the state is finite."""
        bad = ~torch.isfinite(state)
        if not bool(bad.any()):
            return
        per_batch = bad.flatten(1).any(1) if state.dim() > 1 else bad
        batch_idx = per_batch.nonzero().flatten().tolist()
        finite = state[~bad]
        max_abs = finite.abs().max().item() if finite.numel() else float("nan")
        detail = self._describe_bad(bad)
        raise MemoryStateError(
            f"non-finite {self.name} memory state at {where}: batch indices {_short(batch_idx)}"
            f"{detail}; {int(bad.sum())} of {state.numel()} values non-finite; max |value| of the finite part "
            f"{max_abs:.4g} (state shape {list(state.shape)})"
        )

    def _describe_bad(self, bad: torch.Tensor) -> str:  # memory-specific detail for check_finite
        return ""

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _short(xs: list[Any], n: int = 16) -> str:
    return str(xs) if len(xs) <= n else f"{xs[:n]}... ({len(xs)} in all)"


def _check_resets(resets: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    if resets is None:
        return None
    if resets.dtype != torch.bool:
        resets = resets.bool()  # SB3 hands episode starts over as floats
    if tuple(resets.shape) != shape:
        raise ValueError(f"resets must have shape {list(shape)}, got {list(resets.shape)}")
    return resets.to(device)


class NoMemory(Memory):
    """The identity: ``y = x`` and an empty state ``[B, 0]``. Runs the same network as the other memories without
    any memory, which makes it the memoryless control."""

    name = "none"

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.in_features = self.out_features = int(in_features)

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (0,)

    def forward(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, state

    def step(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
        return x


class _DeltaRuleMemory(Memory):
    """Shared block of :class:`EFLAMemory` and :class:`DeltaNetMemory` (they differ in the rule, the key
    normalisation and the range of β). See :class:`EFLAMemory` for the architecture and its reasons."""

    rule: str

    def __init__(
        self,
        in_features: int,
        *,
        n_heads: int = 4,
        head_dim: int = 32,
        value_dim: int | None = None,
        d_model: int | None = None,
        query_norm: bool = True,
        beta_bias_init: float = 0.0,
        layer_norm: bool = True,
        backend: str | None = None,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if n_heads < 1 or head_dim < 1:
            raise ValueError(f"n_heads and head_dim must be >= 1, got {n_heads}, {head_dim}")
        self.in_features = int(in_features)
        self.d_model = int(d_model) if d_model is not None else self.in_features
        self.out_features = self.d_model
        self.n_heads, self.head_dim = int(n_heads), int(head_dim)
        self.value_dim = int(value_dim) if value_dim is not None else self.head_dim
        self.query_norm = bool(query_norm)
        self.backend = backend
        self.chunk_size = chunk_size
        H, K, V = self.n_heads, self.head_dim, self.value_dim
        # Optional width change, so a memory over a 4-dim observation can still have a useful width.
        self.in_proj = nn.Linear(self.in_features, self.d_model) if self.d_model != self.in_features else nn.Identity()
        # q, k, v and β from one fused projection (one GEMM while acting).
        self.qkvb = nn.Linear(self.d_model, H * (2 * K + V) + H)
        self._split = (H * K, H * K, H * V, H)
        with torch.no_grad():
            self.qkvb.bias[-H:].fill_(beta_bias_init)
        self.out_proj = nn.Linear(H * V, self.d_model)
        self.norm = nn.LayerNorm(self.d_model) if layer_norm else nn.Identity()

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.n_heads, self.head_dim, self.value_dim)

    # -- the parts that differ between EFLA and DeltaNet -------------------------------------------------
    def _keys(self, k_raw: torch.Tensor) -> torch.Tensor:
        return k_raw

    def _beta(self, logit: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logit)

    # -- shared ------------------------------------------------------------------------------------------
    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., in]`` → ``h [..., d]``, ``q, k_raw [..., H, K]``, ``v [..., H, V]``, ``β [..., H]``."""
        h = self.in_proj(x)
        q, k, v, b = self.qkvb(h).split(self._split, dim=-1)
        lead = h.shape[:-1]
        H = self.n_heads
        q = q.reshape(*lead, H, self.head_dim)
        k = k.reshape(*lead, H, self.head_dim)
        v = v.reshape(*lead, H, self.value_dim)
        if self.query_norm:
            q = F.normalize(q, dim=-1, eps=1e-6)
        return h, q, k, v, self._beta(b)

    def _output(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.out_proj(o.flatten(-2)))

    def forward(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = x.shape[:2]
        resets = _check_resets(resets, (B, T), x.device)
        h, q, k_raw, v, beta = self._project(x)
        o, final = chunk_rule(
            q, self._keys(k_raw), v, beta, rule=self.rule, initial_state=state, resets=resets, backend=self.backend,
            chunk_size=self.chunk_size,
        )
        return self._output(h, o.to(h.dtype)), final

    def step(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
        resets = _check_resets(resets, (x.shape[0],), x.device)
        h, q, k_raw, v, beta = self._project(x)
        o = step_rule(q, self._keys(k_raw), v, beta, state, rule=self.rule, resets=resets, backend=self.backend)
        return self._output(h, o.to(h.dtype))

    @torch.no_grad()
    def diagnostics(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``key_norm_mean/max``: raw key norms (before any normalisation) over all (b, t, head);
        ``gate_mean`` / ``gate_saturated_frac``: the gate ``1 - eigenvalue`` of each step's transition and the
        fraction above 0.99; ``state_norm_mean/max``: Frobenius norm per (batch, head) of the FINAL state reached
        after the sequence (per-step states would cost a K-fold larger computation)."""
        B, T = x.shape[:2]
        resets = _check_resets(resets, (B, T), x.device)
        _, q, k_raw, v, beta = self._project(x)
        knorm = k_raw.float().norm(dim=-1)
        # 1 − (the transition's non-unit eigenvalue), from the rule's single definition in rlseq.kernels
        _, gate, _ = unit_key_scales(self._keys(k_raw).float(), beta.float(), self.rule)
        _, final = chunk_rule(
            q, self._keys(k_raw), v, beta, rule=self.rule, initial_state=state, resets=resets, backend=self.backend,
            chunk_size=self.chunk_size,
        )
        snorm = final.flatten(2).norm(dim=-1)
        return {
            "key_norm_mean": knorm.mean(),
            "key_norm_max": knorm.max(),
            "gate_mean": gate.mean(),
            "gate_saturated_frac": (gate > 0.99).float().mean(),
            "state_norm_mean": snorm.mean(),
            "state_norm_max": snorm.max(),
        }

    def _describe_bad(self, bad: torch.Tensor) -> str:
        pairs = bad.flatten(2).any(-1).nonzero().tolist()  # (batch, head)
        return f", (batch, head) pairs {_short([tuple(p) for p in pairs])}"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, n_heads={self.n_heads}, "
            f"head_dim={self.head_dim}, value_dim={self.value_dim}, query_norm={self.query_norm}, backend={self.backend}, "
            f"chunk_size={self.chunk_size}"
        )


class EFLAMemory(_DeltaRuleMemory):
    """Multi-head EFLA (Error-Free Linear Attention) memory block.

    Per step t, with ``h = in_proj(x)`` (the identity unless ``d_model`` differs from ``in_features``)::

        q, k, v = W_q h, W_k h, W_v h            (per head: q, k ∈ R^K, v ∈ R^V; one fused projection)
        β       = sigmoid(w_β · h + b_β)         (per head, ∈ (0, 1))
        S_t     = EFLA(S_{t-1}; k, v, β)          (exact rank-1 ODE step, docs/efla.md §2)
        o       = S_tᵀ q̂                         (q̂ = q/‖q‖ when query_norm, else q)
        y       = LayerNorm(h + W_o [o_1 … o_H])

    Choices and why:

    - **Raw keys.** EFLA's key norm ``λ = ‖k‖²`` is its data-dependent gate: the transition's eigenvalue is
      ``exp(-βλ) ∈ (0, 1]`` for ANY key scale, so the state cannot blow up, and huge inputs saturate the write
      (``α‖k‖ ≤ 0.64√β``) instead of exploding. Normalising the keys would remove exactly that property.
    - **β = sigmoid(linear(h))**, bias init ``beta_bias_init`` (0 → β = 0.5): EFLA integrates the ODE over a
      step of length β; (0, 1) is the usual DeltaNet range, which keeps the two memories comparable.
    - **Query normalisation (default on)**: L2 per head, no extra ``1/√K`` scale (a unit query needs none;
      the output projection learns the scale). A unit-query read along ``k̂`` returns ``α‖k‖·v``, the bounded
      write strength of efla.md, so reads stay bounded whatever the input scale. ``query_norm=False`` reads
      with raw queries.
    - **Projections take the input as is** (post-norm block, no LayerNorm before q/k): the key norm then
      follows the input scale, which is the regime EFLA is designed for. The LayerNorm sits after the
      residual so the policy heads see normalised features.
    - **Residual**: the current input reaches the output directly; the memory only has to add what the
      present observation lacks.
    - **No short convolution, no activation on q/k/v** (unlike some DeltaNet layers): the matrix state is then the
      ONLY recurrent state, which keeps acting, storage and resets simple.
    - **State** ``[B, H, K, V]`` float32 (``K = head_dim``, ``V = value_dim`` defaulting to ``head_dim``), whatever
      the activation dtype; zeros at episode starts.
    - Defaults ``n_heads=4, head_dim=32``: 4·32·32 = 4096 floats of state per sequence (16 KiB).
    - **One fused projection** for q, k, v and the β logits (one GEMM per acting step), PyTorch's default
      ``nn.Linear`` initialisation. With unit-scale features ``‖k‖² ≈ K/3`` at init, so for K = 32 and β = 0.5 the
      gate ``c = 1 - e^{-βλ}`` starts near saturation (fast overwriting along k̂); it is learned from there
      (``diagnostics()['gate_mean']`` tracks it; a negative ``beta_bias_init`` starts it lower).
    - **Width**: ``out_features = d_model``, by default the input width; with ``d_model`` set, a linear
      ``in_proj`` maps the input to it first (useful over narrow vector observations) and the residual runs
      in the ``d_model`` space. The projections stay linear in x, so the key norm still follows the input scale.

    Args:
        in_features: F, size of ``x``.
        n_heads, head_dim, value_dim: H, K, V.
        d_model: block width; an input projection ``F → d_model`` is added when it differs from F.
            ``out_features = d_model`` (default ``in_features``).
        query_norm: L2-normalise queries per head.
        beta_bias_init: initial bias of the β logit.
        layer_norm: final LayerNorm (on by default).
        backend: kernel backend passed to ``chunk_rule``/``step_rule`` (None: Triton on CUDA, torch on the CPU).
        chunk_size: chunk length of the torch backend's ``chunk_rule`` (None: the kernel's default).
    """

    name = "efla"
    rule = "efla"


class DeltaNetMemory(_DeltaRuleMemory):
    """DeltaNet memory: the :class:`EFLAMemory` block with the Euler (delta-rule) update and L2-normalised keys::

        k̂ = k/‖k‖,  S_t = (I - β k̂ k̂ᵀ) S_{t-1} + β k̂ vᵀ

    The standard DeltaNet: with unit keys the transition's eigenvalue ``1 - β`` lies in (0, 1) for
    ``β = sigmoid(·)``. ``allow_negative_eigenvalues=True`` uses ``β = 2·sigmoid(·) ∈ (0, 2)``, eigenvalues in
    (-1, 1), which helps state tracking (in low precision a β close to 2 can still push it past -1).
    Every other choice (and argument) is as in :class:`EFLAMemory`; the diagnostics' ``gate`` is
    ``β‖k̂‖² = β``.
    """

    name = "deltanet"
    rule = "deltanet"

    def __init__(self, in_features: int, *, allow_negative_eigenvalues: bool = False, **kwargs: Any) -> None:
        super().__init__(in_features, **kwargs)
        self.allow_negative_eigenvalues = bool(allow_negative_eigenvalues)

    def _keys(self, k_raw: torch.Tensor) -> torch.Tensor:
        return F.normalize(k_raw, dim=-1, eps=1e-6)

    def _beta(self, logit: torch.Tensor) -> torch.Tensor:
        b = torch.sigmoid(logit)
        return 2 * b if self.allow_negative_eigenvalues else b

    def extra_repr(self) -> str:
        return super().extra_repr() + f", allow_negative_eigenvalues={self.allow_negative_eigenvalues}"


class LSTMMemory(Memory):
    """``nn.LSTM`` baseline behind the :class:`Memory` interface.

    State ``[B, 2, num_layers, hidden_size]`` float32: h at ``[:, 0]``, c at ``[:, 1]``. ``out_features =
    hidden_size`` (the top layer's h), as in sb3-contrib's LSTM policies.

    Resets are exact and ``forward`` makes ONE ``nn.LSTM`` call (cuDNN on the GPU) whatever the resets: without
    resets the whole batch goes through at once; otherwise every sequence is cut into its episode segments,
    the segments are packed (``pack_padded_sequence``) and run together, the first segment of each sequence
    from the carried state and every later one from zeros. No Python loop over time steps, unlike
    sb3-contrib's ``_process_sequence``.
    """

    name = "lstm"
    train_graph_obstacle = "its training pass reads the episode starts on the host (nonzero, pack_padded_sequence)"

    def __init__(self, in_features: int, *, hidden_size: int = 256, num_layers: int = 1, **lstm_kwargs: Any) -> None:
        super().__init__()
        if lstm_kwargs.pop("batch_first", True) is not True or lstm_kwargs.get("bidirectional"):
            raise ValueError("LSTMMemory is always batch_first and unidirectional")
        self.in_features = int(in_features)
        self.hidden_size, self.num_layers = int(hidden_size), int(num_layers)
        self.out_features = self.hidden_size
        self.lstm = nn.LSTM(self.in_features, self.hidden_size, num_layers=self.num_layers, batch_first=True, **lstm_kwargs)

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (2, self.num_layers, self.hidden_size)

    @staticmethod
    def _unpack(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, 2, L, H] -> ([L, B, H], [L, B, H])
        return state[:, 0].transpose(0, 1).contiguous(), state[:, 1].transpose(0, 1).contiguous()

    def forward(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = x.shape[:2]
        resets = _check_resets(resets, (B, T), x.device)
        state = state.to(x.dtype)
        if resets is None or not bool(resets[:, 1:].any()):
            # Fast path: no episode starts after t = 0, one call over the whole batch.
            if resets is not None:
                state = state * (~resets[:, 0]).to(state.dtype).view(B, 1, 1, 1)
            y, (h, c) = self.lstm(x, self._unpack(state))
            return y, torch.stack([h, c], 0).permute(2, 0, 1, 3)

        # Segment starts (b, t): every reset and every t = 0. Sorted by b then t, so in flat index b*T + t the
        # segments tile [0, B*T) in order and each one's length is the gap to the next start.
        seg = resets.clone()
        seg[:, 0] = True
        starts = seg.view(-1).nonzero().flatten()  # flat start indices, ascending
        lengths = torch.diff(starts, append=starts.new_tensor([B * T]))
        seg_b = starts // T
        lmax = int(lengths.max())
        steps = torch.arange(lmax, device=x.device)
        gather = (starts.unsqueeze(1) + steps).clamp_max(B * T - 1)  # [P, lmax]
        padded = x.reshape(B * T, -1)[gather]  # [P, lmax, F]
        # First segment of a sequence starts from the carried state unless it resets at t = 0; the rest from 0.
        keep = ((starts % T) == 0) & ~resets.view(-1)[starts]
        h0, c0 = self._unpack(state[seg_b] * keep.to(state.dtype).view(-1, 1, 1, 1))
        packed = nn.utils.rnn.pack_padded_sequence(padded, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, (h, c) = self.lstm(packed, (h0, c0))
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=lmax)
        valid = steps.unsqueeze(0) < lengths.unsqueeze(1)
        y = out[valid].view(B, T, self.hidden_size)  # row-major over (segment, step) == flat (b, t) order
        # The last segment of each sequence holds its final state.
        last = torch.diff(seg_b, append=seg_b.new_tensor([B])).nonzero().flatten()
        final = torch.stack([h[:, last], c[:, last]], 0).permute(2, 0, 1, 3)
        return y, final

    def step(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
        resets = _check_resets(resets, (x.shape[0],), x.device)
        if resets is not None:
            state.masked_fill_(resets.view(-1, 1, 1, 1), 0.0)
        y, (h, c) = self.lstm(x.unsqueeze(1), self._unpack(state.to(x.dtype)))
        state[:, 0].copy_(h.transpose(0, 1))
        state[:, 1].copy_(c.transpose(0, 1))
        return y.squeeze(1)

    @torch.no_grad()
    def diagnostics(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``state_norm_mean/max``: L2 norm of (h, c) over all layers, per sequence, of the FINAL state reached
        after the sequence, as for the delta-rule memories (one ``forward`` call, no loop over time)."""
        _, final = self.forward(x, state, resets)
        n = final.flatten(1).norm(dim=-1)
        return {"state_norm_mean": n.mean(), "state_norm_max": n.max()}

    def _describe_bad(self, bad: torch.Tensor) -> str:
        if bad.dim() != 4:
            return ""
        trip = bad.any(-1).nonzero().tolist()  # (batch, h/c, layer)
        return f", (batch, h=0/c=1, layer) {_short([tuple(t) for t in trip])}"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, hidden_size={self.hidden_size}, num_layers={self.num_layers}"


_REGISTRY: dict[str, type[Memory]] = {
    "efla": EFLAMemory,
    "deltanet": DeltaNetMemory,
    "lstm": LSTMMemory,
    "none": NoMemory,
}


def memory_class(name: str) -> type[Memory]:
    """The class registered as ``name`` (one of :data:`MEMORIES`)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in _REGISTRY:
        raise ValueError(f"unknown memory {name!r}; valid memories: {', '.join(MEMORIES)}")
    return _REGISTRY[key]


def make_memory(name: str, in_features: int, **memory_kwargs: Any) -> Memory:
    """Build a memory by name (one of :data:`MEMORIES`) over ``in_features`` inputs.

    ``memory_kwargs`` go to the class: :class:`EFLAMemory` / :class:`DeltaNetMemory` (``n_heads``, ``head_dim``,
    ``value_dim``, ``d_model``, ``query_norm``, ``backend``, ...), :class:`LSTMMemory` (``hidden_size``,
    ``num_layers``), :class:`NoMemory` (none).
    """
    return memory_class(name)(in_features, **memory_kwargs)
