"""Drop-in policies for the UNMODIFIED ``sb3_contrib.RecurrentPPO``: an EFLA or DeltaNet memory where
``MlpLstmPolicy`` / ``CnnLstmPolicy`` / ``MultiInputLstmPolicy`` have their LSTM.

Change only the policy argument::

    from sb3_contrib import RecurrentPPO
    from rlseq.policies import EflaCnnPolicy

    model = RecurrentPPO(EflaCnnPolicy, env)             # was RecurrentPPO("CnnLstmPolicy", env)
    model = RecurrentPPO(EflaMlpPolicy, env,
                         policy_kwargs=dict(memory_kwargs=dict(n_heads=4, head_dim=16, value_dim=16)))

How the memory fits into RecurrentPPO:

- **State packing.** RecurrentPPO keeps LSTM-shaped ``(h, c)`` pairs ``[num_layers, n_envs, hidden_size]`` for
  actor and critic, sized from ``policy.lstm_actor.num_layers / hidden_size``. A memory state of ``n`` floats per
  env (EFLA ``H·K·V``, its rotary position and the convolution window) is flattened and split in two halves: the first half in the h slot, the second in the
  c slot (``num_layers = 1``, ``hidden_size = ceil(n / 2)``), so both slots carry state and none is wasted.
- **Training is one kernel call per minibatch.** ``_process_sequence`` (a Python loop over time steps in
  sb3-contrib whenever a minibatch contains an episode start) is overridden: the minibatch's padded sequences
  go through the memory's ``forward`` (one ``chunk_rule`` call for EFLA/DeltaNet, one packed ``nn.LSTM`` call for
  the LSTM) with the episode starts as resets. Acting (one step, no grad) uses the memory's ``step``.
- **Consistency.** Acting and training compute the same function, so PPO's ratio is exactly 1 (to fp32
  rounding) at the first minibatch; ``tests/test_sb3_policies.py`` checks it through RecurrentPPO's own buffer.
  On CUDA, PyTorch's default ``torch.backends.cudnn.allow_tf32 = True`` runs the CNN's convolutions in TF32,
  whose rounding differs between the acting batch and the training minibatch: measured on an H200, log-probs
  and values then differ by ~3e-3 (2.5e-6 with TF32 off; 1.4e-6 for the MLP policies with the Triton kernels).
  This holds for sb3-contrib's own CnnLstmPolicy too; set ``torch.backends.cudnn.allow_tf32 = False`` where it
  matters.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from gymnasium import spaces
from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor, FlattenExtractor, MlpExtractor
from stable_baselines3.common.type_aliases import Schedule
from torch import nn

from rlseq.policies.actor_critic import adopting_saved_read_norms
from rlseq.policies.extractors import ImpalaCNN, ImpalaCombinedExtractor
from rlseq.policies.memory import Memory, make_memory, with_rotary_freqs_of_option_saves

__all__ = [
    "DeltaNetCnnPolicy",
    "DeltaNetMlpPolicy",
    "DeltaNetMultiInputPolicy",
    "EflaCnnPolicy",
    "EflaMlpPolicy",
    "EflaMultiInputPolicy",
    "MemoryActorCriticPolicy",
    "MemoryCnnPolicy",
    "MemoryMlpPolicy",
    "MemoryMultiInputPolicy",
    "PackedMemory",
]


class PackedMemory(nn.Module):
    """A :class:`Memory` seen by RecurrentPPO as an LSTM: ``num_layers = 1`` and ``hidden_size = ceil(n / 2)``
    for a memory state of ``n`` floats per sequence, packed into the ``(h, c)`` pair ``[1, B, hidden_size]``
    (first half of the flattened state in h, second half in c; one float of padding when n is odd).

    RecurrentPPO reads ``num_layers`` and ``hidden_size`` to size its buffers; sb3-contrib's ``predict`` builds
    zero states from them, which unpack to the memory's zero initial state.
    """

    def __init__(self, memory: Memory) -> None:
        super().__init__()
        self.memory = memory
        self.state_numel = math.prod(memory.state_shape)
        self.num_layers = 1
        self.hidden_size = max(1, -(-self.state_numel // 2))  # ≥ 1: keeps numpy/torch away from 0-size slots
        self.input_size = memory.in_features

    def pack(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, *state_shape]`` → ``(h, c)`` each ``[1, B, hidden_size]``."""
        flat = state.reshape(state.shape[0], -1)
        pad = 2 * self.hidden_size - self.state_numel
        if pad:
            flat = nn.functional.pad(flat, (0, pad))
        h, c = flat.split(self.hidden_size, dim=1)
        return h.unsqueeze(0), c.unsqueeze(0)

    def unpack(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``(h, c)`` each ``[1, B, hidden_size]`` → a new ``[B, *state_shape]`` float32 tensor."""
        h, c = states[0], states[1]
        flat = torch.cat([h[0], c[0]], dim=1)[:, : self.state_numel]
        return flat.reshape(flat.shape[0], *self.memory.state_shape).float()

    def run(
        self, features: torch.Tensor, states: tuple[torch.Tensor, ...], episode_starts: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """sb3-contrib's ``_process_sequence`` contract: ``features [n_seq·T, F]`` (sequence-major),
        ``states`` packed for ``n_seq`` sequences, ``episode_starts [n_seq·T]`` float → ``(latent [n_seq·T, out],
        packed final states)``. Acting (T = 1, no grad) takes the memory's ``step``; anything else one ``forward``."""
        n_seq = states[0].shape[1]
        state = self.unpack(states)
        x = features.reshape(n_seq, -1, features.shape[-1])
        resets = episode_starts.reshape(n_seq, -1) > 0.5
        if x.shape[1] == 1 and not torch.is_grad_enabled():
            y = self.memory.step(x[:, 0], state, resets[:, 0])  # state updated in place (it is a fresh tensor)
            return y, self.pack(state)
        y, final = self.memory(x, state, resets)
        return y.reshape(-1, y.shape[-1]), self.pack(final)


class MemoryActorCriticPolicy(RecurrentActorCriticPolicy):
    """sb3-contrib recurrent actor-critic with an rlseq :class:`Memory` in place of the LSTM.

    Data flow as in ``RecurrentActorCriticPolicy``: ``obs → features_extractor → memory → mlp_extractor →
    action / value heads``.

    :param memory: one of ``"efla"``, ``"deltanet"``, ``"gru"``, ``"lstm"``, ``"none"`` (subclasses fix a default).
    :param memory_kwargs: for the memory class (``d_model``, ``n_heads``, ``head_dim``, ``value_dim``, ``conv_size``,
        ``query_norm``, ``backend``, ``allow_negative_eigenvalues``, ``hidden_size``...), merged over the class's
        defaults.
    :param shared_memory: actor and critic share one memory; the critic reads its output detached (only the
        actor's gradient trains it). Same as sb3-contrib's ``shared_lstm`` (also accepted under that name);
        implies ``enable_critic_memory=False`` unless that is given.
    :param enable_critic_memory: the critic has its own memory (default, as in sb3-contrib). With both options
        off the critic is feed-forward (a linear map of the features). Same as ``enable_critic_lstm``.
    :param lstm_hidden_size, n_lstm_layers, lstm_kwargs: accepted so that ``policy_kwargs`` written for the LSTM
        policies keep working: for ``memory="lstm"`` or ``"gru"`` they set the RNN inside the block (its output
        width stays ``d_model``); for EFLA/DeltaNet ``lstm_hidden_size`` sets the block width ``d_model`` (the
        output size), and with it the default head size (EFLA ``d_model / 4``, DeltaNet ``d_model / 2``), unless
        ``memory_kwargs`` does;
        ``n_lstm_layers > 1`` and ``lstm_kwargs`` are not supported there (error / warning).

    All other arguments are ``RecurrentActorCriticPolicy``'s.

    **Buffer memory cost in RecurrentPPO.** ``RecurrentRolloutBuffer`` stores the actor's AND the critic's state
    (h and c) for EVERY step of every env, as float32 NumPy arrays, whether the critic has a memory or not:
    ``2 · n`` floats per env-step for a state of ``n`` floats. EFLA's defaults (4 heads × 64 × 32 and the
    convolution window, n = 8,577, padded to 8,578): 67 KiB per env-step, i.e. 1.05 GiB for 64 envs × 256 steps,
    and ``get()`` makes a flattened copy of the same size again (DeltaNet's 4 heads × 64 × 64: 131 KiB per
    env-step; the default LSTM, hidden 256: 7 KiB). rlseq's own PPO (``rlseq.algos.MemoryPPO``) stores ONE state per env per
    rollout and trains on whole rollouts; prefer it for large runs.
    """

    default_memory: ClassVar[str] = "efla"
    default_memory_kwargs: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        lr_schedule: Schedule,
        net_arch: list[int] | dict[str, list[int]] | None = None,
        activation_fn: type[nn.Module] = nn.Tanh,
        ortho_init: bool = True,
        use_sde: bool = False,
        log_std_init: float = 0.0,
        full_std: bool = True,
        use_expln: bool = False,
        squash_output: bool = False,
        features_extractor_class: type[BaseFeaturesExtractor] = FlattenExtractor,
        features_extractor_kwargs: dict[str, Any] | None = None,
        share_features_extractor: bool = True,
        normalize_images: bool = True,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.Adam,
        optimizer_kwargs: dict[str, Any] | None = None,
        memory: str | None = None,
        memory_kwargs: dict[str, Any] | None = None,
        shared_memory: bool | None = None,
        enable_critic_memory: bool | None = None,
        lstm_hidden_size: int | None = None,
        n_lstm_layers: int | None = None,
        shared_lstm: bool | None = None,
        enable_critic_lstm: bool | None = None,
        lstm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.memory_name = (memory or self.default_memory).lower()
        self.memory_kwargs = self._resolve_memory_kwargs(
            self.memory_name, memory_kwargs, lstm_hidden_size, n_lstm_layers, lstm_kwargs
        )
        self.shared_lstm = _one_of("shared_memory", shared_memory, "shared_lstm", shared_lstm, False)
        self.enable_critic_lstm = _one_of(
            "enable_critic_memory", enable_critic_memory, "enable_critic_lstm", enable_critic_lstm, True
        )
        if self.shared_lstm and self.enable_critic_lstm:
            if enable_critic_memory is None and enable_critic_lstm is None:
                self.enable_critic_lstm = False  # asking for a shared memory implies no separate critic memory
            else:
                raise ValueError("choose between a shared memory, a separate critic memory or none for the critic")
        if self.shared_lstm and not share_features_extractor:
            raise ValueError("if the features extractor is not shared, the memory cannot be shared")
        self.lstm_kwargs: dict[str, Any] = {}
        # The memories are built in _build_mlp_extractor, once features_dim is known and before the optimizer
        # is created; RecurrentActorCriticPolicy.__init__ is skipped because it builds nn.LSTMs sized for the
        # packed state (for EFLA that would be millions of unused parameters).
        ActorCriticPolicy.__init__(
            self,
            observation_space,
            action_space,
            lr_schedule,
            net_arch,
            activation_fn,
            ortho_init,
            use_sde,
            log_std_init,
            full_std,
            use_expln,
            squash_output,
            features_extractor_class,
            features_extractor_kwargs,
            share_features_extractor,
            normalize_images,
            optimizer_class,
            optimizer_kwargs,
        )
        # (n_layers, 1, hidden_size): sb3-contrib's predict() builds zero states from it
        self.lstm_hidden_state_shape = (self.lstm_actor.num_layers, 1, self.lstm_actor.hidden_size)

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def _resolve_memory_kwargs(
        cls,
        name: str,
        memory_kwargs: dict[str, Any] | None,
        lstm_hidden_size: int | None,
        n_lstm_layers: int | None,
        lstm_kwargs: dict[str, Any] | None,
    ) -> dict[str, Any]:
        kw = dict(cls.default_memory_kwargs.get(name, {}))
        legacy: dict[str, Any] = {}
        if name in ("lstm", "gru"):
            if lstm_hidden_size is not None:
                legacy["hidden_size"] = lstm_hidden_size
            if n_lstm_layers is not None:
                legacy["num_layers"] = n_lstm_layers
            legacy.update(lstm_kwargs or {})
        elif name in ("efla", "deltanet"):
            if lstm_hidden_size is not None:
                legacy["d_model"] = lstm_hidden_size
            if n_lstm_layers not in (None, 1):
                raise ValueError(f"n_lstm_layers={n_lstm_layers}: the {name} memory is a single block")
            if lstm_kwargs:
                warnings.warn(f"lstm_kwargs {sorted(lstm_kwargs)} ignored by the {name} memory", stacklevel=3)
        kw.update(legacy)
        kw.update(memory_kwargs or {})
        return kw

    def _build_mlp_extractor(self) -> None:
        """Build the memories (features_dim is known now) and the MLP extractor on their output size."""
        actor = make_memory(self.memory_name, self.features_dim, **self.memory_kwargs)
        self.lstm_actor = PackedMemory(actor)
        self.lstm_output_dim = actor.out_features
        self.lstm_critic = None
        self.critic = None
        if self.enable_critic_lstm:
            self.lstm_critic = PackedMemory(make_memory(self.memory_name, self.features_dim, **self.memory_kwargs))
        elif not self.shared_lstm:
            self.critic = nn.Linear(self.features_dim, self.lstm_output_dim)  # feed-forward critic, as sb3-contrib
        self.mlp_extractor = MlpExtractor(
            self.lstm_output_dim, net_arch=self.net_arch, activation_fn=self.activation_fn, device=self.device
        )

    def _get_constructor_parameters(self) -> dict[str, Any]:
        data = ActorCriticPolicy._get_constructor_parameters(self)
        data.update(
            memory=self.memory_name,
            memory_kwargs=self.memory_kwargs,
            shared_memory=self.shared_lstm,
            enable_critic_memory=self.enable_critic_lstm,
        )
        return data

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` inside :func:`~rlseq.policies.actor_critic.adopting_saved_read_norms`
        (models saved before the read norm became the delta-rule default load as they were trained; sb3-contrib's
        ``RecurrentPPO`` keeps ``output_norm`` out of its ``policy_kwargs``, so such a model warns at every load
        until :func:`~rlseq.policies.actor_critic.record_adopted_read_norms` is called before it is saved)."""
        state_dict = with_rotary_freqs_of_option_saves(self, state_dict, self.memory_kwargs)
        with adopting_saved_read_norms(self, state_dict, strict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # -- the sequence processing ---------------------------------------------------------------------------
    @staticmethod
    def _process_sequence(  # type: ignore[override]
        features: torch.Tensor,
        lstm_states: tuple[torch.Tensor, ...],
        episode_starts: torch.Tensor,
        lstm: PackedMemory,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One memory call over the whole minibatch (no Python loop over time steps). See
        :meth:`PackedMemory.run`."""
        return lstm.run(features, lstm_states, episode_starts)

    # -- conveniences --------------------------------------------------------------------------------------
    @property
    def memory_actor(self) -> Memory:
        return self.lstm_actor.memory

    @property
    def memory_critic(self) -> Memory | None:
        return self.lstm_critic.memory if self.lstm_critic is not None else None


def _one_of(new: str, new_value: bool | None, old: str, old_value: bool | None, default: bool) -> bool:
    if new_value is not None and old_value is not None and bool(new_value) != bool(old_value):
        raise ValueError(f"{new}={new_value} contradicts {old}={old_value} (they are the same option)")
    if new_value is not None:
        return bool(new_value)
    return bool(old_value) if old_value is not None else default


class MemoryMlpPolicy(MemoryActorCriticPolicy):
    """Vector observations (SB3's ``FlattenExtractor``); choose the memory with ``memory=...`` (the block's input
    projection gives it its own width, ``d_model``, whatever the observation's)."""


class MemoryCnnPolicy(MemoryActorCriticPolicy):
    """Image observations through the :class:`ImpalaCNN` (256 features) by default; choose the memory with
    ``memory=...``. Pass ``features_extractor_class=NatureCNN`` to reproduce ``CnnLstmPolicy``'s extractor."""

    def __init__(self, *args: Any, features_extractor_class: type[BaseFeaturesExtractor] = ImpalaCNN, **kwargs: Any):
        super().__init__(*args, features_extractor_class=features_extractor_class, **kwargs)


class MemoryMultiInputPolicy(MemoryActorCriticPolicy):
    """``Dict`` observations (e.g. :class:`rlseq.envs.PrevActionReward`) through :class:`ImpalaCombinedExtractor`."""

    def __init__(
        self, *args: Any, features_extractor_class: type[BaseFeaturesExtractor] = ImpalaCombinedExtractor, **kwargs: Any
    ):
        super().__init__(*args, features_extractor_class=features_extractor_class, **kwargs)


class EflaMlpPolicy(MemoryMlpPolicy):
    """``MlpLstmPolicy`` with an :class:`~rlseq.policies.EFLAMemory` (see :class:`MemoryActorCriticPolicy`,
    including the buffer-memory cost of a matrix state in RecurrentPPO)."""

    default_memory = "efla"


class EflaCnnPolicy(MemoryCnnPolicy):
    """``CnnLstmPolicy`` with an :class:`~rlseq.policies.EFLAMemory` over :class:`ImpalaCNN` features (see
    :class:`MemoryActorCriticPolicy`, including the buffer-memory cost of a matrix state in RecurrentPPO)."""

    default_memory = "efla"


class EflaMultiInputPolicy(MemoryMultiInputPolicy):
    """``MultiInputLstmPolicy`` with an :class:`~rlseq.policies.EFLAMemory`."""

    default_memory = "efla"


class DeltaNetMlpPolicy(MemoryMlpPolicy):
    """``MlpLstmPolicy`` with a :class:`~rlseq.policies.DeltaNetMemory` (see :class:`MemoryActorCriticPolicy`)."""

    default_memory = "deltanet"


class DeltaNetCnnPolicy(MemoryCnnPolicy):
    """``CnnLstmPolicy`` with a :class:`~rlseq.policies.DeltaNetMemory` over :class:`ImpalaCNN` features (see
    :class:`MemoryActorCriticPolicy`)."""

    default_memory = "deltanet"


class DeltaNetMultiInputPolicy(MemoryMultiInputPolicy):
    """``MultiInputLstmPolicy`` with a :class:`~rlseq.policies.DeltaNetMemory`."""

    default_memory = "deltanet"
