"""Memory layers for recurrent RL: EFLA, DeltaNet, GRU, LSTM and a no-memory control, all in ONE block.

Every memory is the same block around a different core, so that a comparison isolates the memory::

    h = LayerNorm(W_in x)                  input projection to d_model (default 128), whatever the observation
    u = LayerNorm(conv_W(h))               the front end: a causal depthwise convolution over the last W steps
    m = core(u, state, resets)             the memory read (absent for "none")
    y = LayerNorm(u + m)                   the join: residual + LayerNorm; y is [.., d_model] (see JOINS)

The front end (``conv_size=W``, default 4, the short convolution of flash-linear-attention's delta-rule layers)
belongs to the block, not to a memory: every core, the ``none`` control included, sees the last W inputs, so a
task solved inside that window is solved by ``none`` too and a lead over ``none`` is memory. ``conv_size=1``
removes the window (a per-channel affine map) for every memory alike.

===============  ==============================================  ============================================
memory           state per sequence (flat, float32)              core
===============  ==============================================  ============================================
``"efla"``       ``H·K·V + 1 + (W-1)·d`` (matrix, position,      rotary(silu(W_qkv u)) → EFLA (raw keys) → RMSNorm
                 then the window)                                → W_o
``"deltanet"``   same                                            the same with DeltaNet (unit keys)
``"gru"``        ``L·hidden + (W-1)·d``                          ``nn.GRU`` → W_o
``"lstm"``       ``2·L·hidden + (W-1)·d`` (h, then c)             ``nn.LSTM`` → W_o
``"none"``       ``(W-1)·d`` (the window alone)                  nothing: ``y = LayerNorm(u)``
===============  ==============================================  ============================================

The delta-rule cores turn their queries and keys by each step's position in its episode (rotary positions,
``rotary_base`` and ``rotary_max_freq``), so that a query can address "L steps back" beyond the window; their
state holds that position (the next step's) after the matrix. ``rotary_base=None`` turns them off, and the
position with them.

The default widths are each memory's best of the same probe on the memory benchmark (the default and a wider
core, equal effort for every memory; ``docs/memory.md`` has the numbers): EFLA 4 heads with keys of ``d_model/2``
and values of ``d_model/4``, DeltaNet 4 heads of ``d_model/2``, GRU and LSTM hidden ``2·d_model`` (256 at the
default width, sb3-contrib's LSTM width).
Parameter counts and state sizes therefore differ; ``docs/memory.md`` lists both.

The interface (:class:`Memory`), the same for all:

- ``initial_state(batch_size, device) -> state`` (zeros): ONE float32 tensor ``[B, N]`` with the batch on dim 0,
  so algorithms index, clone and store states uniformly (``state[env_idx]``); :meth:`Memory.state_parts` gives
  the core's state ``[B, *core_state_shape]`` and the window ``[B, W-1, d]`` as views;
- ``forward(x [B, T, F], state, resets [B, T]) -> (y [B, T, d_model], final_state)`` for training; does not
  modify ``state``; differentiable with respect to the parameters, ``x`` and ``state``;
- ``step(x [B, F], state, resets [B]) -> y [B, d_model]`` for acting; updates ``state`` in place;
- ``diagnostics(x, state, resets) -> dict[str, 0-dim tensor]`` (no grad, no host sync);
- ``check_finite(state, where)`` raises :class:`MemoryStateError` naming the bad batch entries.

``resets[b, t] = True`` means an episode starts at step t of sequence b: the whole state before that step (the
core's AND the convolution window) counts as zero (at ``t = 0`` the given ``state`` is ignored for that
sequence). ``forward`` over a sequence and ``step`` applied once per time step compute the same function (to
float32 rounding); the tests check it against float64 step-by-step loops.

All delta-rule math goes through :func:`rlseq.kernels.chunk_rule` / :func:`rlseq.kernels.step_rule`; this
module never re-implements the recurrence.
"""

from __future__ import annotations

import abc
import ast
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlseq.kernels import chunk_rule, step_rule
from rlseq.kernels.rnn import rnn_scan, triton_scan_available
from rlseq.kernels.rules import unit_key_scales
from rlseq.policies.short_conv import ShortConv

MEMORIES = ("efla", "deltanet", "gru", "lstm", "none")
# initialisations of the GRU's and LSTM's weights: PyTorch's U(-1/√hidden, 1/√hidden), or orthogonal recurrent
# matrices (see _RNNMemory._orthogonal_init)
RECURRENT_INITS = ("uniform", "orthogonal")
# how the read m joins the block's stream u (``join=``), the same choice for every memory:
#   "residual" y = LayerNorm(u + m)             (the default)
#   "gated"    y = LayerNorm(u + σ(W_g u) ⊙ m)  (a learned per-channel gate on the read, GTrXL-style; starts near 1/2)
#   "prenorm"  y = u + m                         (the core reads the normalised u; the sum is not normalised again:
#                                                 a pre-norm sublayer, which for one block has no final norm)
#   "read"     y = LayerNorm(m)                  (no residual: the read alone)
JOINS = ("residual", "gated", "prenorm", "read")
DEFAULT_D_MODEL = 128
DEFAULT_CONV_SIZE = 4
# the delta-rule cores' rotary positions: RoFormer's base. Base 100 reaches further on the horizon tasks but
# spins the slow channels that content addressing needs (RepeatFirstMedium, docs/memory.md)
DEFAULT_ROTARY_BASE = 10000.0
# the fastest channel pair's turn per step: π (the Nyquist limit of integer positions), not RoFormer's 1 rad.
# At 1 rad adjacent steps keep a kernel value of cos 1 ≈ 0.54 in that pair and more in every slower one, so a
# query for "8 steps back" also reads 7 and 9 back: under PPO the answers matched lags 7 / 8 / 9 at 0.48 /
# 0.66 / 0.47 and lag 8 stalled at +0.31; at π it reaches +0.98 (docs/memory.md)
DEFAULT_ROTARY_MAX_FREQ = math.pi
# how a load refuses a state saved without rotary positions, with others or with other head sizes
# (settings_refusal finds the line for rlseq.resume and rlseq.evaluate, memory_kwargs_to_load reads its settings)
SAVED_WITHOUT_ROTARY = "the state was saved without rotary positions"
SAVED_WITH_OTHER_ROTARY = "the state was saved with other rotary positions"
SAVED_WITH_OTHER_HEADS = "the state was saved with other head sizes"
LOAD_BY = "load it with memory_kwargs "
OUTPUT_NORM_EPS = 1e-5  # the delta-rule cores' read norm (flash-linear-attention's norm_eps)

__all__ = [
    "ActorCriticMemory",
    "DEFAULT_CONV_SIZE",
    "DEFAULT_D_MODEL",
    "DEFAULT_ROTARY_BASE",
    "DEFAULT_ROTARY_MAX_FREQ",
    "MEMORIES",
    "DeltaNetMemory",
    "EFLAMemory",
    "GRUMemory",
    "JOINS",
    "LSTMMemory",
    "Memory",
    "MemoryStateError",
    "NoMemory",
    "make_memory",
    "memory_class",
    "format_memory_kwargs",
    "rotary_frequencies",
    "settings_refusal",
    "memory_kwargs_to_load",
    "rotary_settings",
    "saved_without_read_norm",
    "with_rotary_freqs_of_option_saves",
]


class MemoryStateError(FloatingPointError):
    """A memory state holds NaN or inf. Raised by :meth:`Memory.check_finite`; the message names where it was
    checked, the memory type, the bad batch indices (and the part of the state) and the max |value| of the
    finite part."""


class Memory(nn.Module, metaclass=abc.ABCMeta):
    """The block every memory shares (see the module docstring); subclasses supply the core.

    Args:
        in_features: F, the feature size of ``x``.
        d_model: the block width and ``out_features`` (default :data:`DEFAULT_D_MODEL`), independent of F.
        conv_size: W, the front end's convolution width (default :data:`DEFAULT_CONV_SIZE`; 1: no window).
        join: how the read joins the block (one of :data:`JOINS`; default ``"residual"``).

    Subclasses implement ``core_state_shape``, ``_core(u [B, T, d], core_state, resets) -> (m, final_core_state)``
    and ``_core_step(u [B, d], core_state, resets) -> m`` (``m`` None: no read, the memoryless control), where
    ``core_state`` is the ``[B, *core_state_shape]`` part of the state.

    Attributes:
        name: registry name.
        train_graph_auto: whether ``cuda_graph_train``'s auto captures the training pass (every memory's can be
            captured once :meth:`capturable_training` is on; auto leaves out those whose capturable pass is not
            known to be faster than their eager one).
    """

    name: str = "abstract"
    train_graph_auto = True
    has_read = True  # False for the memoryless control, which has no read to join (and so no gate)

    def __init__(self, in_features: int, *, d_model: int | None = None, conv_size: int = DEFAULT_CONV_SIZE,
                 join: str = "residual") -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.d_model = int(d_model) if d_model is not None else DEFAULT_D_MODEL
        if self.in_features < 1 or self.d_model < 1:
            raise ValueError(f"in_features and d_model must be >= 1, got {self.in_features}, {self.d_model}")
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 1:
            raise ValueError(f"conv_size must be an integer >= 1, got {conv_size!r}")
        if join not in JOINS:
            raise ValueError(f"unknown join {join!r}; valid joins: {', '.join(JOINS)}")
        self.out_features = self.d_model
        self.join = join
        # Normalising the projected input gives every core unit-scale inputs whatever the observation's scale and
        # width, so defaults (and EFLA's starting gate) carry over from one task to the next.
        self.in_proj = nn.Sequential(nn.Linear(self.in_features, self.d_model), nn.LayerNorm(self.d_model))
        # linear, then normalised: the cores get unit-scale inputs, as argued above, that are symmetric about zero
        # like h (a SiLU here would give every β logit an offset, and the gates a start that depends on the task)
        self.conv = ShortConv(self.d_model, conv_size)
        self.conv_norm = nn.LayerNorm(self.d_model)
        self.norm = nn.Identity() if join == "prenorm" else nn.LayerNorm(self.d_model)
        if join == "gated" and self.has_read:
            # from a stream of its own, so that the core starts from the same weights as under the other joins
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(int(torch.randint(0, 2**62, ())))
                self.gate = nn.Linear(self.d_model, self.d_model)
            with torch.no_grad():  # small weights, zero bias: the gate starts near 1/2 on every channel whatever u is
                self.gate.weight.mul_(0.1)
                self.gate.bias.zero_()

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Zero state for ``batch_size`` sequences: one float32 tensor ``[B, N]``."""
        return torch.zeros(batch_size, *self.state_shape, dtype=torch.float32, device=device)

    def capturable_training(self, on: bool = True) -> None:
        """``on``: ``forward`` runs without host reads, so that a CUDA graph can capture the training pass (the
        same function, computed in another order); off: its default path. A no-op for memories whose ``forward``
        never reads the host."""

    @property
    @abc.abstractmethod
    def core_state_shape(self) -> tuple[int, ...]:
        """Per-sequence shape of the core's part of the state."""

    @property
    def state_shape(self) -> tuple[int, ...]:
        """Per-sequence state shape ``(N,)``: the core's state flattened, then the window ``(W-1)·d``."""
        return (math.prod(self.core_state_shape) + self.conv.window_size * self.d_model,)

    def state_parts(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a state ``[B, N]``: the core's ``[B, *core_state_shape]`` and the window ``[B, W-1, d]``
        (writes through them update ``state``)."""
        B, n_core = state.shape[0], math.prod(self.core_state_shape)
        return (state[:, :n_core].view(B, *self.core_state_shape),
                state[:, n_core:].view(B, self.conv.window_size, self.d_model))

    @abc.abstractmethod
    def _core(self, u: torch.Tensor, core_state: torch.Tensor, resets: torch.Tensor | None, *, h: torch.Tensor
              ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``u [B, T, d]`` (``h``: the block input before the convolution, same shape) → ``(m [B, T, d] or None,
        final core state)``; must not modify ``core_state``."""

    @abc.abstractmethod
    def _core_step(self, u: torch.Tensor, core_state: torch.Tensor, resets: torch.Tensor | None, *, h: torch.Tensor
                   ) -> torch.Tensor | None:
        """``u [B, d]`` (and ``h [B, d]``) → ``m [B, d]`` or None; updates ``core_state`` in place."""

    def _output(self, u: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        if m is None:  # the memoryless control: the stream alone, normalised as every join normalises it
            return self.norm(u)
        m = m.to(u.dtype)
        if self.join == "gated":
            m = torch.sigmoid(self.gate(u)) * m
        return self.norm(m if self.join == "read" else u + m)

    def front(self, x: torch.Tensor, window: torch.Tensor, resets: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The front end over a sequence: ``x [B, T, F]`` → ``(h [B, T, d], u [B, T, d], new window [B, W-1, d])``."""
        h = self.in_proj(x)
        c, new_window = self.conv(h, window, resets)
        return h, self.conv_norm(c), new_window

    def forward(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, F]``, ``state [B, N]``, ``resets [B, T]`` bool → ``(y [B, T, d_model], final_state [B, N])``."""
        B, T = x.shape[:2]
        resets = _check_resets(resets, (B, T), x.device)
        core_state, window = self.state_parts(state)
        h, u, new_window = self.front(x, window, resets)
        m, final = self._core(u, core_state, resets, h=h)
        final_state = torch.cat([final.reshape(B, -1).to(torch.float32), new_window.reshape(B, -1).to(torch.float32)], 1)
        return self._output(u, m), final_state

    def step(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
        """One acting step: ``x [B, F]``, ``resets [B]`` bool → ``y [B, d_model]``; ``state`` updated in place."""
        resets = _check_resets(resets, (x.shape[0],), x.device)
        h = self.in_proj(x)
        u = self.conv_norm(self.conv.step(h, self.state_parts(state)[1], resets))
        # the core's view is taken after the window's in-place update: under autograd that update gives the state
        # a new version, which an older view may not be written through
        return self._output(u, self._core_step(u, self.state_parts(state)[0], resets, h=h))

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
        detail = ""
        if bad.dim() == 2 and bad.shape[1] == self.state_shape[0]:
            core, window = self.state_parts(bad)
            in_window = window.flatten(1).any(-1).nonzero().flatten().tolist()
            detail = self._describe_bad(core) + (f", convolution window of batch {_short(in_window)}" if in_window else "")
        raise MemoryStateError(
            f"non-finite {self.name} memory state at {where}: batch indices {_short(batch_idx)}{detail}; "
            f"{int(bad.sum())} of {state.numel()} values non-finite; max |value| of the finite part {max_abs:.4g} "
            f"(state shape {list(state.shape)})"
        )

    def _describe_bad(self, bad_core: torch.Tensor) -> str:  # memory-specific detail for check_finite
        return ""

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, d_model={self.d_model}, conv_size={self.conv.kernel_size}"
                + ("" if self.join == "residual" else f", join={self.join!r}"))


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
    """The memoryless control: the same block with the memory read removed, ``y = LayerNorm(u)`` (``u`` the front
    end's output, which still sees the last ``conv_size`` inputs), and the window as its whole state."""

    name = "none"
    has_read = False

    @property
    def core_state_shape(self) -> tuple[int, ...]:
        return (0,)

    def _core(self, u, core_state, resets, *, h):
        return None, core_state

    def _core_step(self, u, core_state, resets, *, h):
        return None


class _DeltaRuleMemory(Memory):
    """Core of :class:`EFLAMemory` and :class:`DeltaNetMemory` (they differ in the rule, the key normalisation
    and the starting β). See :class:`EFLAMemory` for the architecture and its reasons."""

    rule: str
    head_width: float  # default head_dim · n_heads / d_model (keys and queries)
    value_width: float  # default value_dim · n_heads / d_model

    def __init__(
        self,
        in_features: int,
        *,
        d_model: int | None = None,
        conv_size: int = DEFAULT_CONV_SIZE,
        join: str = "residual",
        n_heads: int = 4,
        head_dim: int | None = None,
        value_dim: int | None = None,
        query_norm: bool = True,
        beta_bias_init: float | None = None,
        output_norm: bool = True,
        backend: str | None = None,
        chunk_size: int | None = None,
        rotary_base: float | None = DEFAULT_ROTARY_BASE,
        rotary_max_freq: float = DEFAULT_ROTARY_MAX_FREQ,
    ) -> None:
        super().__init__(in_features, d_model=d_model, conv_size=conv_size, join=join)
        if n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got {n_heads}")
        if not isinstance(output_norm, bool):  # a config's string "false" would otherwise turn it on
            raise TypeError(f"output_norm must be True or False, got {output_norm!r}")
        self.n_heads = int(n_heads)
        self.head_dim = (int(head_dim) if head_dim is not None
                         else max(1, round(self.head_width * self.d_model / self.n_heads)))
        # values keep the rule's ratio to the keys (EFLA: half as wide; DeltaNet: as wide) when only keys are given
        self.value_dim = (int(value_dim) if value_dim is not None
                          else max(1, round(self.head_dim * self.value_width / self.head_width)))
        if self.head_dim < 1 or self.value_dim < 1:
            raise ValueError(f"head_dim and value_dim must be >= 1, got {self.head_dim}, {self.value_dim}")
        self.query_norm = bool(query_norm)
        self.backend = backend
        self.chunk_size = chunk_size
        H, K, V = self.n_heads, self.head_dim, self.value_dim
        if isinstance(rotary_max_freq, bool) or not (0 < rotary_max_freq <= math.pi):
            raise ValueError(f"rotary_max_freq must be in (0, π] radians a step, got {rotary_max_freq!r}")
        if rotary_base is not None:
            if isinstance(rotary_base, bool) or not (math.isfinite(rotary_base) and rotary_base > 1):
                raise ValueError(f"rotary_base must be a finite number > 1 or None, got {rotary_base!r}")
            # A saved buffer, so that a state saved without rotary positions or with others is refused at load
            # (_load_from_state_dict) instead of loading into a model that reads its memory differently
            self.register_buffer("rotary_freqs", rotary_frequencies(K, rotary_base, rotary_max_freq))
        self.rotary_base = None if rotary_base is None else float(rotary_base)
        self.rotary_max_freq = float(rotary_max_freq)
        self._split = (H * K, H * K, H * V)
        self.qkv = nn.Linear(self.d_model, sum(self._split))
        self.beta_proj = nn.Linear(self.d_model, H)
        # per head, weights shared across heads, as flash-linear-attention's delta-rule layers normalise their read
        self.out_norm = nn.RMSNorm(V, eps=OUTPUT_NORM_EPS) if output_norm else None
        self.out_proj = nn.Linear(H * V, self.d_model)
        with torch.no_grad():
            self.beta_proj.bias.fill_(self._default_beta_bias() if beta_bias_init is None else float(beta_bias_init))

    target_start_gate = 0.5

    def _default_beta_bias(self) -> float:
        """b_β with a mean starting gate (1 - the transition's eigenvalue: EFLA's ``1 - e^{-βλ}``, DeltaNet's β) of
        :attr:`target_start_gate` over unit-normal block inputs (a fixed generator: the global random stream is
        untouched), found by bisection on b_β. The β projection's weights take part: β = sigmoid(w_β · h + b_β)
        varies from step to step."""
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(64, 16, self.d_model, generator=gen)
        with torch.no_grad():
            u = self.conv_norm(self.conv(h, torch.zeros(64, self.conv.window_size, self.d_model), None)[0])
            _, k, _ = self._raw_heads(u)
            k = self._keys(k).double()
            logit = (h @ self.beta_proj.weight.t()).double()  # [64, 16, H], without the bias
            lo, hi = -40.0, 40.0
            for _ in range(60):  # the mean gate increases with b_β
                mid = (lo + hi) / 2
                gate = float(unit_key_scales(k, self._beta(logit + mid), self.rule)[1].mean())
                lo, hi = (mid, hi) if gate < self.target_start_gate else (lo, mid)
        return (lo + hi) / 2

    @property
    def core_state_shape(self) -> tuple[int, ...]:
        n = self.n_heads * self.head_dim * self.value_dim
        return (self.n_heads, self.head_dim, self.value_dim) if self.rotary_base is None else (n + 1,)

    def matrix_and_position(self, core_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views of a core state ``[B, *core_state_shape]``: the matrix ``[B, H, K, V]`` and, with rotary
        positions, the position of the next step in its episode ``[B]`` (float, 0 after a reset; else None)."""
        if self.rotary_base is None:
            return core_state, None
        B, n = core_state.shape[0], self.n_heads * self.head_dim * self.value_dim
        return core_state[:, :n].view(B, self.n_heads, self.head_dim, self.value_dim), core_state[:, n]

    def _positions(self, start: torch.Tensor, resets: torch.Tensor | None, T: int) -> torch.Tensor:
        """Each step's position in its episode ``[B, T]``: ``start + t`` until the first reset, then the steps
        since the last reset."""
        t = torch.arange(T, device=start.device, dtype=torch.float32)
        pos = start.float()[:, None] + t
        if resets is None:
            return pos
        last = torch.where(resets, t.long(), -1).cummax(dim=1).values
        return torch.where(last >= 0, t - last.float(), pos)

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``x [..., H, K]`` turned by ``pos [...]``: channel i with channel i + ⌊K/2⌋ by the angle pos·ω_i (an
        odd K's last channel is left as it is). A rotation keeps every key's norm (EFLA's gate) and makes q·k
        depend on the distance between the steps."""
        # the angles in float64: in float32, pos·ω is off by ~1e-4 rad at position 1e3 and by 1e-2 at 1e5
        half = x.shape[-1] // 2
        angle = (pos.double()[..., None] * self.rotary_freqs.double())[..., None, :]  # [..., 1, K/2]
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos, rest], dim=-1)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a state that holds this memory's weights but other rotary positions: refused with the setting to load
        # it by, since its weights would load without complaint into a memory that reads its state differently.
        # Other head sizes: torch's size mismatches would name tensors, not the settings to load it by.
        # (Module.load_state_dict passes strict=True here whatever its caller asked: a state without this
        # memory's weights is what a partial load leaves unchecked)
        if f"{prefix}out_proj.weight" in state_dict:
            refusal = self._refusal(state_dict, prefix)
            if refusal is not None:
                error_msgs.append(refusal)
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _saved_head_sizes(self, state_dict, prefix) -> tuple[int, int]:
        """``(head_dim, value_dim)`` of a saved state of this memory, read from its projections' shapes (this
        memory's own sizes when they cannot be read so, or the state has another head count, which the saved
        settings would have named: torch's size checks then speak)."""
        H, qkv, out = self.n_heads, state_dict.get(f"{prefix}qkv.weight"), state_dict.get(f"{prefix}out_proj.weight")
        beta = state_dict.get(f"{prefix}beta_proj.weight")  # [H, d_model]: one β per head
        if qkv is None or out is None or out.ndim != 2 or qkv.ndim != 2 or beta is None or beta.shape[0] != H:
            return self.head_dim, self.value_dim
        values, keys = out.shape[1], qkv.shape[0] - out.shape[1]  # H·V; the queries' and keys' 2·H·K
        if values % H or keys <= 0 or keys % (2 * H):
            return self.head_dim, self.value_dim
        return keys // (2 * H), values // H

    def _refusal(self, state_dict, prefix) -> str | None:
        """Why a saved state of this memory cannot load into it as it was trained, naming the ``memory_kwargs``
        to load it by, or None. Other head sizes (e.g. EFLA's before its keys became 64 wide) and other rotary
        positions (none, or another ladder, compared at the saved head size) are found together, so one message
        names every setting."""
        K, V = self._saved_head_sizes(state_dict, prefix)
        other_heads = (K, V) != (self.head_dim, self.value_dim)
        settings = {"head_dim": K, "value_dim": V} if other_heads else {}
        saved = state_dict.get(f"{prefix}rotary_freqs")
        rotary = None  # how the saved rotary positions differ from this memory's
        if self.rotary_base is None and saved is not None:
            rotary = "none"
        elif self.rotary_base is not None and saved is None:
            rotary = "without"
        elif saved is not None:
            # float32 rounding allowed (a state converted on its way); other settings differ far more. A ladder
            # of another length (a head count the shapes do not tell) is left to torch's size checks
            mine = rotary_frequencies(K, self.rotary_base, self.rotary_max_freq)
            if saved.shape == mine.shape and not torch.allclose(saved.double().cpu(), mine, rtol=1e-6, atol=0.0):
                rotary = "other"
        if rotary is None and not other_heads:
            return None
        settings.update({"rotary_base": None} if rotary == "without" else
                        rotary_settings(saved) if rotary is not None else {})
        load_by = LOAD_BY + format_memory_kwargs(settings)
        if not other_heads:
            if rotary == "none":
                return (f"{prefix}rotary_freqs: {SAVED_WITH_OTHER_ROTARY} ({_settings_text(saved)}) and this memory "
                        f"has none; {load_by}")
            if rotary == "without":
                where = prefix.rstrip(".") or type(self).__name__
                return (f"{where}: {SAVED_WITHOUT_ROTARY} (before they became the delta-rule default, or with "
                        f"rotary_base=None) and this memory has rotary_base={self.rotary_base:g}; {load_by}")
            return (f"{prefix}rotary_freqs: {SAVED_WITH_OTHER_ROTARY} ({_settings_text(saved)}) than this memory's "
                    f"({_settings_text(self.rotary_freqs)}); {load_by}")
        rotary_text = ("" if rotary is None else ", and without rotary positions" if rotary == "without" else
                       f", and with rotary positions ({_settings_text(saved)}) where this memory has none"
                       if rotary == "none" else f", and with other rotary positions ({_settings_text(saved)})")
        return (f"{prefix}qkv.weight: {SAVED_WITH_OTHER_HEADS} (head_dim={K}, value_dim={V}) than this memory's "
                f"(head_dim={self.head_dim}, value_dim={self.value_dim}){rotary_text}; {load_by}")

    # -- the parts that differ between EFLA and DeltaNet -------------------------------------------------
    def _keys(self, k_raw: torch.Tensor) -> torch.Tensor:
        return k_raw

    def _beta(self, logit: torch.Tensor) -> torch.Tensor:
        # ≥ 0 by construction: the kernels' β check (a host sync on CUDA) is skipped for it
        return torch.sigmoid(logit)

    # -- shared ------------------------------------------------------------------------------------------
    def _raw_heads(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``u [..., d]`` → ``q [..., H, K]``, raw keys ``[..., H, K]``, ``v [..., H, V]`` (after the SiLU)."""
        q, k, v = F.silu(self.qkv(u)).split(self._split, dim=-1)
        lead, H = u.shape[:-1], self.n_heads
        return (q.reshape(*lead, H, self.head_dim), k.reshape(*lead, H, self.head_dim),
                v.reshape(*lead, H, self.value_dim))

    def _heads(self, u: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``u [..., d]``, ``h [..., d]`` → ``q [..., H, K]``, keys ``[..., H, K]`` (as the rule takes them),
        ``v [..., H, V]``, ``β [..., H]`` (β from ``h``, before the convolution, as flash-linear-attention's
        layers compute it from their input)."""
        q, k, v = self._raw_heads(u)
        if self.query_norm:
            q = F.normalize(q, dim=-1, eps=1e-6)
        return q, self._keys(k), v, self._beta(self.beta_proj(h))

    def _chunk(self, u, core_state, resets, *, h):
        """The rule over a sequence: ``(o [B, T, H, V], final matrix [B, H, K, V], keys [B, T, H, K], β [B, T, H],
        positions [B, T] or None)``; the keys are the rule's (rotated where rotary positions are on)."""
        q, k, v, beta = self._heads(u, h)
        matrix, start = self.matrix_and_position(core_state)
        pos = None if start is None else self._positions(start, resets, u.shape[1])
        if pos is not None:
            q, k = self._rotate(q, pos), self._rotate(k, pos)
        o, final = chunk_rule(q, k, v, beta, rule=self.rule, initial_state=matrix, resets=resets,
                              backend=self.backend, chunk_size=self.chunk_size, check_beta=False)
        return o, final, k, beta, pos

    def _core(self, u, core_state, resets, *, h):
        o, final, _, _, pos = self._chunk(u, core_state, resets, h=h)
        if pos is not None:
            final = torch.cat([final.flatten(1), pos[:, -1:] + 1], dim=1)
        return self._read(o.to(u.dtype)), final

    def _core_step(self, u, core_state, resets, *, h):
        q, k, v, beta = self._heads(u, h)
        matrix, start = self.matrix_and_position(core_state)
        if start is not None:
            pos = start if resets is None else torch.where(resets, 0.0, start)
            q, k = self._rotate(q, pos), self._rotate(k, pos)
        o = step_rule(q, k, v, beta, matrix, rule=self.rule, resets=resets, backend=self.backend,
                      check_beta=False)
        if start is not None:
            start.copy_(pos + 1)
        return self._read(o.to(u.dtype))

    def _read(self, o: torch.Tensor) -> torch.Tensor:
        """``o [..., H, V]`` → ``W_o [norm(o_1) … norm(o_H)]`` ``[..., d]`` (without ``output_norm``: ``W_o o``)."""
        return self.out_proj((o if self.out_norm is None else self.out_norm(o)).flatten(-2))

    @torch.no_grad()
    def diagnostics(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``key_norm_mean/max``: raw key norms (before DeltaNet's normalisation) over all (b, t, head);
        ``gate_mean`` / ``gate_saturated_frac``: the gate ``1 - eigenvalue`` of each step's transition and the
        fraction above 0.99; ``state_norm_mean/max``: Frobenius norm per (batch, head) of the FINAL matrix state
        reached after the sequence (per-step states would cost a K-fold larger computation)."""
        B, T = x.shape[:2]
        resets = _check_resets(resets, (B, T), x.device)
        core, window = self.state_parts(state)
        h, u, _ = self.front(x, window, resets)
        _, final, k, beta, _ = self._chunk(u, core, resets, h=h)
        # 1 − (the transition's non-unit eigenvalue), from the rule's single definition in rlseq.kernels
        _, gate, _ = unit_key_scales(k.float(), beta.float(), self.rule)
        knorm = self._raw_heads(u)[1].float().norm(dim=-1)
        snorm = final.flatten(2).norm(dim=-1)
        return {
            "key_norm_mean": knorm.mean(),
            "key_norm_max": knorm.max(),
            "gate_mean": gate.mean(),
            "gate_saturated_frac": (gate > 0.99).float().mean(),
            "state_norm_mean": snorm.mean(),
            "state_norm_max": snorm.max(),
        }

    def _describe_bad(self, bad_core: torch.Tensor) -> str:
        pairs = self.matrix_and_position(bad_core)[0].flatten(2).any(-1).nonzero().tolist()  # (batch, head)
        return f", (batch, head) pairs {_short([tuple(p) for p in pairs])}" if pairs else ""

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, n_heads={self.n_heads}, head_dim={self.head_dim}, value_dim={self.value_dim}, "
            f"query_norm={self.query_norm}, backend={self.backend}, chunk_size={self.chunk_size}"
        )


class EFLAMemory(_DeltaRuleMemory):
    """Multi-head EFLA (Error-Free Linear Attention) memory in the shared block.

    Per step t, with ``u = LayerNorm(conv_W(LayerNorm(W_in x)))`` the shared front end::

        q, k, v = silu(W_qkv u)                  (per head)
        q, k    = R(p_t) q, R(p_t) k             (rotary positions: p_t the step's position in its episode)
        β       = sigmoid(w_β · h + b_β)         (per head, ∈ (0, 1); h before the convolution, as fla's layers)
        S_t     = EFLA(S_{t-1}; k, v, β)          (exact rank-1 ODE step, rlseq/kernels/rules.py)
        o       = S_tᵀ q̂                         (q̂ = q/‖q‖ when query_norm, else q)
        y       = LayerNorm(u + W_o [o_1 … o_H])  (o_h → RMSNorm(o_h) first when output_norm)

    Choices and why:

    - **The short convolution is the block's** (see the module docstring): q, k and v are projections of ``u``,
      which sees the last ``conv_size`` inputs, so keys can address "k steps ago" inside that window, and the
      ``none`` control sees the same window. (flash-linear-attention's layers convolve q, k and v after their
      projections, then apply SiLU; convolving their common input instead gives every core the same front end,
      and the SiLU after the projections is kept: without it DeltaNet's unit keys point in any direction and
      the tests' cue-recall task was not learned at its budget.)
    - **Raw keys.** EFLA's key norm ``λ = ‖k‖²`` is its data-dependent gate: the transition's eigenvalue is
      ``exp(-βλ) ∈ (0, 1]`` for ANY key scale, so the state cannot blow up, and huge keys saturate the write
      instead of exploding. Normalising the keys would remove exactly that property.
    - **Matched start.** ``beta_bias_init=None`` sets b_β so that the mean gate (EFLA's ``1 - e^{-βλ}``,
      DeltaNet's β) starts at 0.5 on unit-normal block inputs for both memories; the comparison then starts
      them in the same regime (``memory/gate_mean`` is logged from step 0).
    - **Query normalisation (default on)**: L2 per head, no extra ``1/√K`` scale (the output projection learns
      it), so reads stay bounded whatever the input scale.
    - **Rotary positions (default on).** Without them every key and query is a function of the last W inputs, so
      no query can name "L steps back" for L ≥ W: the delta rule recalled nothing beyond the window that ``none``
      did not. Turned by position, q·k depends on the distance between the steps; a rotation keeps each key's
      norm, so EFLA's gate is unchanged. Under PPO they lift lags 8, 16 and 32 from the ``none`` level and
      cost nothing on RepeatFirstMedium (``docs/memory.md``).
    - **State** ``[B, H·K·V + 1 + (W-1)·d]`` float32; :meth:`state_parts` gives the core's state and the window
      ``[B, W-1, d]`` as views, :meth:`matrix_and_position` the matrix ``[B, H, K, V]`` and the position.
    - Defaults ``n_heads=4``, keys ``head_dim = 2·d_model / n_heads`` and values ``value_dim = head_dim / 2`` (64
      and 32 at the default width 128): 4·64·32 = 8,192 floats of matrix state per sequence. Keys of 64 give the
      rotary ladder 32 pairs (DeltaNet's), which carried lag 16 under PPO (+0.41 → +0.89 over heads of 32), and
      values of 32 keep RepeatFirstMedium, which heads of 64 lost; position-only CartPole went from +0.89 to
      +0.83 over ten seeds, within the spread (``docs/memory.md``, "EFLA's keys of 64, values of 32"). Given
      ``head_dim`` alone, ``value_dim`` is half of it.

    Args:
        in_features: F, size of ``x``.
        d_model: block width (default 128).
        conv_size: W, the front end's convolution width (1: no temporal window).
        join: how the read joins the block (:data:`JOINS`; default ``"residual"``: ``y = LayerNorm(u + m)``).
        n_heads, head_dim, value_dim: H, K, V.
        query_norm: L2-normalise queries per head.
        beta_bias_init: initial bias of the β logit (None: the matched start above).
        backend: kernel backend passed to ``chunk_rule``/``step_rule`` (None: Triton on CUDA, torch on the CPU).
        chunk_size: chunk length of the torch backend's ``chunk_rule`` (None: the kernel's default).
        output_norm: RMS-normalise each head's read ``o_h`` over its V entries (a learned scale shared by the
            heads, flash-linear-attention's ``o_norm``) before ``W_o`` (default True): the read keeps unit scale
            however large the state grows, and EFLA's seeds stay together (``docs/memory.md``). A model saved
            before this default carries no norm and loads without it (:func:`saved_without_read_norm`).
        rotary_base: rotary positions (RoFormer), default :data:`DEFAULT_ROTARY_BASE` (10000): each step's query
            and keys are turned by its position in the episode, channel i with channel i + ⌊K/2⌋ at the frequency
            ``rotary_max_freq · b^(-i/⌊K/2⌋)`` (:func:`rotary_frequencies`; an odd K's last channel stays as it
            is), so that q·k depends on the distance between two steps and a query can address "L steps back"
            beyond the window (``docs/memory.md``: supervised recall, and the horizon tasks under PPO). The state
            holds the next step's position after the matrix: ``[B, H·K·V + 1 + (W-1)·d]``
            (:meth:`matrix_and_position`). None: queries and keys as projected and no position in the state.
        rotary_max_freq: the fastest channel pair's turn per step, in (0, π] radians; default
            :data:`DEFAULT_ROTARY_MAX_FREQ` (π, where RoFormer has 1): at 1 rad adjacent steps stay alike in every
            pair and a query for "8 steps back" also reads 7 and 9 back (``docs/memory.md``). A state saved with
            other rotary settings is refused at load with the settings to load it by: a model saved before rotary
            positions became the default, without the keyword, was trained without them (``rotary_base=None``);
            one whose settings name ``rotary_base`` but hold no frequencies (the option's time, when the fastest
            pair turned 1 rad) loads with those (:func:`with_rotary_freqs_of_option_saves`).
        key_norm_cap: None (default): raw keys. A number c > 0: keys longer than c are scaled to length c, so the
            gate stays at most ``1 - e^{-c²}`` and β keeps control of the write (an option under test on the
            memory benchmark; ``docs/memory.md``, EFLA's seeds on RepeatFirstMedium).
    """

    name = "efla"
    rule = "efla"
    head_width = 2.0
    value_width = 1.0

    def __init__(self, in_features: int, *, key_norm_cap: float | None = None, **kwargs: Any) -> None:
        if key_norm_cap is not None and not (math.isfinite(key_norm_cap) and key_norm_cap > 0):
            raise ValueError(f"key_norm_cap must be a positive finite number or None, got {key_norm_cap}")
        self.key_norm_cap = None if key_norm_cap is None else float(key_norm_cap)
        super().__init__(in_features, **kwargs)

    def _keys(self, k_raw: torch.Tensor) -> torch.Tensor:
        if self.key_norm_cap is None:
            return k_raw
        # keys longer than the cap are scaled down to it, so the gate 1 - exp(-β‖k‖²) stays below
        # 1 - exp(-cap²) and β keeps control of the write (docs/memory.md: EFLA's seeds on RepeatFirstMedium)
        cap = self.key_norm_cap
        return k_raw * (cap / k_raw.norm(dim=-1, keepdim=True).clamp_min(cap))

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", key_norm_cap={self.key_norm_cap}" if self.key_norm_cap is not None else "")


def rotary_frequencies(head_dim: int, base: float, max_freq: float) -> torch.Tensor:
    """The turn per step of each of a head's ``n = ⌊head_dim/2⌋`` channel pairs: ``max_freq · base^(-i/n)``
    (float64 ``[n]``, radians), RoFormer's geometric ladder (``base^(-2i/K)`` for an even K, there from 1 rad)
    from ``max_freq`` down: the fastest pairs tell adjacent steps apart, the slowest barely move over an episode
    (content addressing), those between name "L steps back"."""
    half = head_dim // 2
    return float(max_freq) * float(base) ** (-torch.arange(half, dtype=torch.float64) / max(half, 1))


def rotary_settings(freqs: torch.Tensor) -> dict[str, float]:
    """The ``memory_kwargs`` (``rotary_base``, ``rotary_max_freq``) that made ``freqs`` (:func:`rotary_frequencies`),
    float32-rounded or not: settings that rebuild them within the load's tolerance (rtol 1e-6), with as few digits
    as do. One pair carries no base: only ``rotary_max_freq`` then."""
    f = freqs.double().cpu()
    n = f.numel()
    if n == 0:
        return {}
    max_freq = min(float(f[0]), math.pi)  # a float32-rounded π lies just above π, which the constructor refuses
    if n < 2:
        return {"rotary_max_freq": max_freq}
    # from the whole ladder: the ratio of two neighbours would multiply float32's rounding by n
    raw = float((f[-1] / f[0]) ** (-n / (n - 1)))
    for digits in range(6, 18):
        base = float(f"{raw:.{digits}g}")
        if torch.allclose(rotary_frequencies(2 * n, base, max_freq), f, rtol=1e-6, atol=0.0):
            break
    return {"rotary_base": base, "rotary_max_freq": max_freq}


def settings_refusal(error: BaseException) -> str | None:
    """The line of a load's ``error`` that refuses a delta-rule memory's state for the settings it was trained
    with (other head sizes, rotary positions saved without or with others), naming the ``memory_kwargs`` to load
    it by, or None when the load failed for another reason."""
    markers = (SAVED_WITHOUT_ROTARY, SAVED_WITH_OTHER_ROTARY, SAVED_WITH_OTHER_HEADS)
    return next((line.strip() for line in str(error).splitlines() if any(m in line for m in markers)), None)


def memory_kwargs_to_load(refusal: str) -> dict[str, Any]:
    """The ``memory_kwargs`` a :func:`settings_refusal` line names (``"... load it with memory_kwargs head_dim=32,
    rotary_base=None"`` → ``{"head_dim": 32, "rotary_base": None}``)."""
    if LOAD_BY not in refusal:
        raise ValueError(f"not a settings refusal: {refusal!r}")
    text = refusal.rsplit(LOAD_BY, 1)[1].strip()
    pairs = (item.split("=", 1) for item in text.split(", "))
    return {k.strip(): ast.literal_eval(v.strip()) for k, v in pairs}


def format_memory_kwargs(settings: Mapping[str, Any]) -> str:
    """``"rotary_base=10000, rotary_max_freq=1"``: numbers in the fewest digits that give them back."""
    return ", ".join(f"{k}={repr(v).removesuffix('.0') if isinstance(v, float) else v}" for k, v in settings.items())


def _settings_text(freqs: torch.Tensor) -> str:
    return format_memory_kwargs(rotary_settings(freqs))


def with_rotary_freqs_of_option_saves(module: nn.Module, state_dict: Mapping[str, Any],
                                      memory_kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` with the rotary frequencies of ``module``'s delta-rule memories added where it holds their
    weights and no frequencies although ``memory_kwargs`` (the saved model's) name a ``rotary_base``: a model
    trained while rotary positions were an option, before the frequencies were saved. Its weights were trained
    with the frequencies its settings give (that option's fastest pair turned 1 rad a step), so those are added,
    and the load goes on if they are the module's and is refused with the settings to load by if not; a state
    without them whose settings do not name the keyword was trained without them and is still refused
    (:meth:`_DeltaRuleMemory._load_from_state_dict`)."""
    if memory_kwargs.get("rotary_base") is None:
        return state_dict
    added = {}
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if (isinstance(sub, _DeltaRuleMemory) and sub.rotary_base is not None
                and f"{prefix}out_proj.weight" in state_dict and f"{prefix}rotary_freqs" not in state_dict):
            # at the saved head size (the weights'), which a later default may have changed
            head_dim, _ = sub._saved_head_sizes(state_dict, prefix)
            added[f"{prefix}rotary_freqs"] = rotary_frequencies(
                head_dim, memory_kwargs["rotary_base"], memory_kwargs.get("rotary_max_freq", 1.0)).to(
                sub.rotary_freqs.device)
    return {**state_dict, **added} if added else state_dict


class DeltaNetMemory(_DeltaRuleMemory):
    """DeltaNet memory: the :class:`EFLAMemory` block with the Euler (delta-rule) update and L2-normalised keys::

        k̂ = k/‖k‖,  S_t = (I - β k̂ k̂ᵀ) S_{t-1} + β k̂ vᵀ

    The standard DeltaNet rule (as in flash-linear-attention's layer: unit keys, a short convolution before the
    projections here, see :class:`EFLAMemory`): the transition's eigenvalue ``1 - β`` lies in (0, 1) for ``β = sigmoid(·)``, starting at 0.5.
    ``allow_negative_eigenvalues=True`` uses ``β = 2·sigmoid(·) ∈ (0, 2)``, eigenvalues in (-1, 1), which helps
    state tracking. Every other choice (and argument) is as in :class:`EFLAMemory` but the default head size:
    ``head_dim = value_dim = 2·d_model / n_heads`` (64 at the default width, a 16,384-float matrix), DeltaNet's
    best of the width probe on the memory benchmark (RepeatFirstMedium 0.76 / 1.00 / 0.97 against 0.58 / 0.46 /
    0.48 with heads of 32; ``docs/memory.md``). ``value_dim=32`` gives EFLA's sizes, for a comparison of the rules
    alone. The diagnostics' ``gate`` is β.
    """

    name = "deltanet"
    rule = "deltanet"
    head_width = 2.0
    value_width = 2.0

    def __init__(self, in_features: int, *, allow_negative_eigenvalues: bool = False, **kwargs: Any) -> None:
        self.allow_negative_eigenvalues = bool(allow_negative_eigenvalues)
        super().__init__(in_features, **kwargs)

    def _keys(self, k_raw: torch.Tensor) -> torch.Tensor:
        return F.normalize(k_raw, dim=-1, eps=1e-6)

    def _beta(self, logit: torch.Tensor) -> torch.Tensor:
        b = torch.sigmoid(logit)
        return 2 * b if self.allow_negative_eigenvalues else b

    def extra_repr(self) -> str:
        return super().extra_repr() + f", allow_negative_eigenvalues={self.allow_negative_eigenvalues}"


class _RNNMemory(Memory):
    """Core of :class:`GRUMemory` and :class:`LSTMMemory`: ``m = W_o rnn(u)``, core state ``[B, P, L, hidden]``
    with ``P`` the RNN's state tensors (GRU: h; LSTM: h, c).

    Resets are exact and ``forward`` makes ONE RNN call (cuDNN on the GPU) whatever the resets: without resets
    the whole batch goes through at once; otherwise every sequence is cut into its episode segments, the segments
    are packed (``pack_padded_sequence``) and run together, the first segment of each sequence from the carried
    state and every later one from zeros. No Python loop over time steps, unlike sb3-contrib's
    ``_process_sequence``. Packing reads the segment lengths on the host, which a CUDA graph cannot capture: with
    :meth:`capturable_training` on, ``forward`` is instead a masked scan over time (:meth:`_scan`,
    :func:`rlseq.kernels.rnn.rnn_scan`) on the same weights, the state zeroed where an episode starts.

    ``hidden_size`` (default ``2·d_model``: 256 at the default width), ``num_layers``, ``recurrent_init`` (one of
    :data:`RECURRENT_INITS`: ``"uniform"``, PyTorch's default, or ``"orthogonal"``), ``join`` (the block's) and
    ``backend`` (the scan's: ``"torch"``, ``"triton"``, or None for Triton on float32 CUDA tensors where triton is
    installed) are arguments; the rest go to ``nn.GRU`` / ``nn.LSTM``.
    """

    # nn.GRU / nn.LSTM keywords set here, or that the block cannot carry (proj_size changes the shape of h, which
    # the state and the output projection assume to be hidden_size): the others may be passed on
    fixed_rnn_keywords = ("mode", "input_size", "hidden_size", "num_layers", "batch_first", "bidirectional",
                          "proj_size", "device", "dtype")
    rnn_class: type[nn.RNNBase]
    n_parts: int
    hidden_ratio = 2.0  # default hidden_size / d_model

    def __init__(self, in_features: int, *, d_model: int | None = None, conv_size: int = DEFAULT_CONV_SIZE,
                 join: str = "residual", hidden_size: int | None = None, num_layers: int = 1,
                 recurrent_init: str = "uniform", backend: str | None = None, **rnn_kwargs: Any) -> None:
        super().__init__(in_features, d_model=d_model, conv_size=conv_size, join=join)
        if backend not in (None, "torch", "triton"):
            raise ValueError(f"unknown backend {backend!r} for the {self.name} scan; valid: torch, triton (or None: "
                             "triton on float32 CUDA tensors, torch otherwise)")
        self.backend = backend
        if rnn_kwargs.pop("batch_first", True) is not True or rnn_kwargs.get("bidirectional"):
            raise ValueError(f"{type(self).__name__} is always batch_first and unidirectional")
        if recurrent_init not in RECURRENT_INITS:
            raise ValueError(f"unknown recurrent_init {recurrent_init!r}; valid: {', '.join(RECURRENT_INITS)}")
        self.hidden_size = int(hidden_size) if hidden_size is not None else max(1, round(self.hidden_ratio * self.d_model))
        self.num_layers = int(num_layers)
        self.recurrent_init = recurrent_init
        self.rnn = self.rnn_class(self.d_model, self.hidden_size, num_layers=self.num_layers, batch_first=True,
                                  **rnn_kwargs)
        if recurrent_init == "orthogonal":
            self._orthogonal_init()
        self.out_proj = nn.Linear(self.hidden_size, self.d_model)
        self._scan_resets = False

    def capturable_training(self, on: bool = True) -> None:
        self._scan_resets = bool(on)

    @property
    def train_graph_auto(self) -> bool:
        """Auto captures the Triton scan (one launch per step; captured, faster than cuDNN's packed call run eagerly,
        docs/benchmarks.md), not the torch loop (about 20 launches per step: slower), which is also what backend
        None falls back to where triton is missing. Asked when training starts, not at construction: it imports
        triton."""
        return self.backend == "triton" or (self.backend is None and triton_scan_available(torch.device("cuda")))

    @torch.no_grad()
    def _orthogonal_init(self) -> None:
        """Each gate's recurrent matrix orthogonal, each gate's input matrix Xavier-uniform, biases zero (the
        common practice for RL recurrent cores, e.g. CleanRL's LSTM agents); :class:`LSTMMemory` then sets its
        forget bias."""
        H = self.hidden_size
        for name, p in self.rnn.named_parameters():
            for gate in p.split(H, dim=0):
                if name.startswith("weight_hh"):
                    nn.init.orthogonal_(gate)
                elif name.startswith("weight_ih"):
                    nn.init.xavier_uniform_(gate)
                else:
                    gate.zero_()

    @property
    def core_state_shape(self) -> tuple[int, ...]:
        return (self.n_parts, self.num_layers, self.hidden_size)

    def _unpack(self, state: torch.Tensor):
        """``[B, P, L, H]`` → what the RNN takes: ``[L, B, H]`` (GRU) or a pair of those (LSTM)."""
        parts = tuple(state[:, i].transpose(0, 1).contiguous() for i in range(self.n_parts))
        return parts if self.n_parts > 1 else parts[0]

    def _pack(self, rnn_state) -> torch.Tensor:
        """The RNN's final state (as :meth:`_unpack` gives it) → ``[B, P, L, H]``."""
        parts = rnn_state if isinstance(rnn_state, tuple) else (rnn_state,)
        return torch.stack(parts, 0).permute(2, 0, 1, 3)

    def _core(self, u, state, resets, *, h):
        B, T = u.shape[:2]
        state = state.to(u.dtype)  # [B, P, L, hidden], the core's part
        if self._scan_resets:
            return self._scan(u, state, resets)
        if resets is None or not bool(resets[:, 1:].any()):
            # Fast path: no episode starts after t = 0, one call over the whole batch.
            if resets is not None:
                state = state * (~resets[:, 0]).to(state.dtype).view(B, 1, 1, 1)
            y, final = self.rnn(u, self._unpack(state))
            return self.out_proj(y), self._pack(final)

        # Segment starts (b, t): every reset and every t = 0. Sorted by b then t, so in flat index b*T + t the
        # segments tile [0, B*T) in order and each one's length is the gap to the next start.
        seg = resets.clone()
        seg[:, 0] = True
        starts = seg.reshape(-1).nonzero().flatten()  # flat start indices, ascending
        lengths = torch.diff(starts, append=starts.new_tensor([B * T]))
        seg_b = starts // T
        lmax = int(lengths.max())
        steps = torch.arange(lmax, device=u.device)
        gather = (starts.unsqueeze(1) + steps).clamp_max(B * T - 1)  # [P, lmax]
        padded = u.reshape(B * T, -1)[gather]  # [P, lmax, d]
        # First segment of a sequence starts from the carried state unless it resets at t = 0; the rest from 0.
        keep = ((starts % T) == 0) & ~resets.reshape(-1)[starts]
        h0 = self._unpack(state[seg_b] * keep.to(state.dtype).view(-1, 1, 1, 1))
        packed = nn.utils.rnn.pack_padded_sequence(padded, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, final = self.rnn(packed, h0)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=lmax)
        valid = steps.unsqueeze(0) < lengths.unsqueeze(1)
        y = out[valid].view(B, T, self.hidden_size)  # row-major over (segment, step) == flat (b, t) order
        # The last segment of each sequence holds its final state.
        last = torch.diff(seg_b, append=seg_b.new_tensor([B])).nonzero().flatten()
        return self.out_proj(y), self._pack(final)[last]

    def _scan(self, u: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s core without host reads: each layer's input projection over all ``T`` steps at once, then
        :func:`~rlseq.kernels.rnn.rnn_scan` (the state zeroed, every part, where ``resets`` starts an episode), and
        the RNN's dropout between layers as nn.GRU / nn.LSTM apply it (other random draws than cuDNN's).
        ``u [B, T, d]``, ``state [B, P, L, hidden]`` → ``(m [B, T, d], final [B, P, L, hidden])``."""
        x, finals = u, []
        for layer in range(self.num_layers):
            gates_x = F.linear(x, getattr(self.rnn, f"weight_ih_l{layer}"), getattr(self.rnn, f"bias_ih_l{layer}", None))
            parts = tuple(state[:, i, layer] for i in range(self.n_parts))
            x, parts = rnn_scan(self.name, gates_x, getattr(self.rnn, f"weight_hh_l{layer}"),
                                getattr(self.rnn, f"bias_hh_l{layer}", None), parts, resets, backend=self.backend)
            if layer < self.num_layers - 1 and self.rnn.dropout > 0:
                x = F.dropout(x, self.rnn.dropout, self.training)
            finals.append(torch.stack(parts, 1))  # [B, P, hidden]
        return self.out_proj(x), torch.stack(finals, 2)

    def _core_step(self, u, state, resets, *, h):
        if resets is not None:
            state.masked_fill_(resets.reshape(-1, 1, 1, 1), 0.0)
        # a copy: the RNN's inputs must not be views of the state written below (autograd forbids it)
        y, final = self.rnn(u.unsqueeze(1), self._unpack(state.to(u.dtype, copy=True)))
        state.copy_(self._pack(final))
        return self.out_proj(y.squeeze(1))

    @torch.no_grad()
    def diagnostics(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``state_norm_mean/max``: L2 norm of the whole RNN state over all layers, per sequence, of the FINAL state
        reached after the sequence, as for the delta-rule memories (one ``forward`` call, no loop over time)."""
        _, final = self.forward(x, state, resets)
        n = self.state_parts(final)[0].flatten(1).norm(dim=-1)
        return {"state_norm_mean": n.mean(), "state_norm_max": n.max()}

    def _describe_bad(self, bad_core: torch.Tensor) -> str:
        trip = bad_core.any(-1).nonzero().tolist()  # (batch, part, layer)
        return f", (batch, {self._part_names}, layer) {_short([tuple(t) for t in trip])}" if trip else ""

    _part_names = "part"

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, hidden_size={self.hidden_size}, num_layers={self.num_layers}"
                + (f", recurrent_init={self.recurrent_init}" if self.recurrent_init != "uniform" else "")
                + (f", backend={self.backend}" if self.backend is not None else ""))


class GRUMemory(_RNNMemory):
    """``nn.GRU`` baseline in the shared block: core state ``[B, 1, num_layers, hidden_size]`` float32. POPGym's study
    found the GRU the strongest classic memory. Default ``hidden_size = 2·d_model`` (256 at the default width): on
    the memory benchmark the parameter-matched 96 held it back (RepeatPreviousLag8 +0.09 / −0.07 / −0.10 against
    +0.40 / +0.82 at 256; ``docs/memory.md``)."""

    name = "gru"
    rnn_class = nn.GRU
    n_parts = 1
    _part_names = "h=0"


class LSTMMemory(_RNNMemory):
    """``nn.LSTM`` baseline in the shared block: core state ``[B, 2, num_layers, hidden_size]`` float32, h at
    ``[:, 0]``, c at ``[:, 1]``. Default ``hidden_size = 2·d_model`` (256 at the default width, sb3-contrib's
    RecurrentPPO's), as for :class:`GRUMemory`. ``forget_bias`` sets the forget gate's starting bias (the sum of
    PyTorch's two); None keeps PyTorch's initialisation."""

    name = "lstm"
    rnn_class = nn.LSTM
    n_parts = 2
    _part_names = "h=0/c=1"

    def __init__(self, in_features: int, *, forget_bias: float | None = None, **kwargs: Any) -> None:
        super().__init__(in_features, **kwargs)
        self.forget_bias = forget_bias
        if forget_bias is not None:
            # PyTorch's LSTM adds two biases per gate (ih and hh), gates ordered i, f, g, o: the forget gate's
            # starting bias is their sum, so it goes into one and the other's is zeroed
            H = self.hidden_size
            with torch.no_grad():
                for layer in range(self.num_layers):
                    getattr(self.rnn, f"bias_ih_l{layer}")[H:2 * H].fill_(float(forget_bias))
                    getattr(self.rnn, f"bias_hh_l{layer}")[H:2 * H].zero_()

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", forget_bias={self.forget_bias}" if self.forget_bias is not None else "")


class ActorCriticMemory(nn.Module):
    """Two memories of one kind over the same features, the actor's and the critic's, so that the value loss
    trains a memory of its own (sb3-contrib's ``enable_critic_lstm``) instead of the actor's: the same interface as
    :class:`Memory`, with

    - ``forward(x [B, T, F], state [B, N_a + N_c], resets [B, T]) -> (y [B, T, 2·d], final [B, N_a + N_c])``,
      ``y`` the actor's output then the critic's on the last dim (:attr:`out_features` ``= 2·d``);
    - ``step(x [B, F], state, resets [B]) -> y [B, 2·d]``, ``state`` updated in place;
    - the state ``[B, N_a + N_c]``: the actor's flat state, then the critic's (:meth:`split` gives both as views).

    Both memories are built with the same arguments and initialised independently.
    """

    def __init__(self, name: str, in_features: int, **memory_kwargs: Any) -> None:
        super().__init__()
        self.actor = make_memory(name, in_features, **memory_kwargs)
        self.critic = make_memory(name, in_features, **memory_kwargs)
        self.name = self.actor.name
        self.in_features = self.actor.in_features
        self.d_model = self.actor.d_model
        self.out_features = 2 * self.actor.out_features

    @property
    def train_graph_auto(self) -> bool:
        return self.actor.train_graph_auto

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.actor.state_shape[0] + self.critic.state_shape[0],)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.zeros(batch_size, *self.state_shape, dtype=torch.float32, device=device)

    def split(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``state [B, N_a + N_c]``: the actor's ``[B, N_a]`` and the critic's ``[B, N_c]``."""
        n = self.actor.state_shape[0]
        return state[:, :n], state[:, n:]

    def forward(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        actor_state, critic_state = self.split(state)
        y_actor, final_actor = self.actor(x, actor_state, resets)
        y_critic, final_critic = self.critic(x, critic_state, resets)
        return torch.cat([y_actor, y_critic], -1), torch.cat([final_actor, final_critic], 1)

    def step(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
        actor_state, critic_state = self.split(state)
        return torch.cat([self.actor.step(x, actor_state, resets), self.critic.step(x, critic_state, resets)], -1)

    @torch.no_grad()
    def diagnostics(self, x: torch.Tensor, state: torch.Tensor, resets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The actor's diagnostics under their own names, the critic's prefixed ``critic_``."""
        actor_state, critic_state = self.split(state)
        return {**self.actor.diagnostics(x, actor_state, resets),
                **{f"critic_{k}": v for k, v in self.critic.diagnostics(x, critic_state, resets).items()}}

    def capturable_training(self, on: bool = True) -> None:
        self.actor.capturable_training(on)
        self.critic.capturable_training(on)

    def check_finite(self, state: torch.Tensor, where: str) -> None:
        actor_state, critic_state = self.split(state)
        self.actor.check_finite(actor_state, f"{where} (the actor's memory)")
        self.critic.check_finite(critic_state, f"{where} (the critic's memory)")


_REGISTRY: dict[str, type[Memory]] = {
    "efla": EFLAMemory,
    "deltanet": DeltaNetMemory,
    "gru": GRUMemory,
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

    ``memory_kwargs`` go to the class: every memory takes ``d_model``, ``conv_size`` and ``join``; :class:`EFLAMemory` /
    :class:`DeltaNetMemory` also ``n_heads``, ``head_dim``, ``value_dim``, ``query_norm``, ``output_norm``,
    ``beta_bias_init``, ``backend``, ``chunk_size``, :class:`EFLAMemory` ``key_norm_cap`` and :class:`DeltaNetMemory`
    ``allow_negative_eigenvalues``; :class:`GRUMemory` / :class:`LSTMMemory` ``hidden_size``,
    ``num_layers``, ``recurrent_init``, and :class:`LSTMMemory` ``forget_bias``. An unknown keyword raises ``TypeError`` naming the class.
    ``residual`` (a bool, ``join``'s former name) is still read, so that models saved with it load: ``False`` is
    ``join="read"``, ``True`` ``join="residual"``.
    """
    cls = memory_class(name)
    if "residual" in memory_kwargs:
        residual = memory_kwargs.pop("residual")
        if "join" in memory_kwargs:
            raise TypeError(f"{cls.__name__}: residual and join given together; residual is join's former name "
                            "(False: join='read'), give join alone")
        warnings.warn("memory_kwargs residual is now join: residual=False is join='read'", DeprecationWarning,
                      stacklevel=2)
        memory_kwargs["join"] = "residual" if residual else "read"
    try:
        return cls(in_features, **memory_kwargs)
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        raise TypeError(f"{cls.__name__}: {e} (memory_kwargs {sorted(memory_kwargs)})") from None


def saved_without_read_norm(module: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """Names (in ``module``; ``""`` for ``module`` itself) of the delta-rule memories that have a read norm while
    ``state_dict``, which holds their other weights, has none for them: a state saved before ``output_norm=True``
    became the delta-rule default, which a caller may load by removing those norms (as
    :class:`~rlseq.policies.actor_critic.MemoryPPOPolicy` does). Memories whose weights ``state_dict`` does not
    hold are left out. Raises ``ValueError`` where the state has the norm for some memories and not for others:
    no save of any version looks like that."""
    saved_with, missing = [], []
    for name, sub in module.named_modules():
        if not isinstance(sub, _DeltaRuleMemory):
            continue
        prefix = f"{name}." if name else ""
        if f"{prefix}out_proj.weight" not in state_dict:
            continue
        if f"{prefix}out_norm.weight" in state_dict:
            saved_with.append(name)
        elif sub.out_norm is not None:
            missing.append(name)
    if saved_with and missing:
        raise ValueError(f"the state has a read norm (out_norm.weight) for {', '.join(saved_with)} and none for "
                         f"{', '.join(missing)}: it is not one model's save")
    return missing
