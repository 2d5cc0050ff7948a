"""The actor-critic that rlseq's own PPO trains: features → memory → policy and value heads.

One network, shared by actor and critic as in the Procgen paper's IMPALA agent. Only the memory differs
between `efla`, `deltanet`, `gru`, `lstm` and `none`, so comparisons isolate the memory.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.distributions import (
    BernoulliDistribution,
    CategoricalDistribution,
    DiagGaussianDistribution,
    Distribution,
    MultiCategoricalDistribution,
    make_proba_distribution,
)
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.preprocessing import is_image_space, preprocess_obs
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor, FlattenExtractor
from stable_baselines3.common.type_aliases import PyTorchObs, Schedule
from torch import nn
from torch.distributions import Bernoulli, Categorical, Normal

from rlseq.policies.memory import (ActorCriticMemory, Memory, make_memory, saved_without_read_norm,
                                   with_rotary_freqs_of_option_saves)


def default_features_extractor(observation_space: spaces.Space) -> type[BaseFeaturesExtractor]:
    """IMPALA CNN for images, the image+vector extractor for ``Dict`` observations, flatten otherwise."""
    if isinstance(observation_space, spaces.Dict):
        from rlseq.policies.extractors import ImpalaCombinedExtractor

        return ImpalaCombinedExtractor
    if is_image_space(observation_space, check_channels=False):
        from rlseq.policies.extractors import ImpalaCNN

        return ImpalaCNN
    return FlattenExtractor


def _has_image(space: spaces.Space) -> bool:
    """Whether an observation space is, or holds, an image (the IMPALA CNN's output then feeds the heads directly)."""
    if isinstance(space, spaces.Dict):
        return any(_has_image(sub) for sub in space.spaces.values())
    return is_image_space(space, check_channels=False)


def _mlp(in_dim: int, sizes: list[int], activation: type[nn.Module]) -> tuple[nn.Module, int]:
    layers: list[nn.Module] = []
    for size in sizes:
        layers += [nn.Linear(in_dim, size), activation()]
        in_dim = size
    return nn.Sequential(*layers), in_dim


def _unvalidated(dist: Distribution, params: torch.Tensor, log_std: torch.Tensor | None) -> Distribution:
    """SB3's ``dist.proba_distribution(params[, log_std])`` with its torch distributions made with
    ``validate_args=False``: torch's argument and sample checks are host syncs (one per call, so no CUDA graph could
    capture them), and the policy checks finiteness itself (:meth:`MemoryPPOPolicy.act` returns a flag, training
    checks the loss). The same parameters as SB3's own construction, so the same log-probs and entropies."""
    if isinstance(dist, DiagGaussianDistribution):
        dist.distribution = Normal(params, torch.ones_like(params) * log_std.exp(), validate_args=False)
    elif isinstance(dist, CategoricalDistribution):
        dist.distribution = Categorical(logits=params, validate_args=False)
    elif isinstance(dist, MultiCategoricalDistribution):
        dist.distribution = [Categorical(logits=split, validate_args=False)
                             for split in torch.split(params, list(dist.action_dims), dim=1)]
    elif isinstance(dist, BernoulliDistribution):
        dist.distribution = Bernoulli(logits=params, validate_args=False)
    else:
        raise TypeError(f"MemoryPPOPolicy does not support {type(dist).__name__} (action spaces: Discrete, "
                        "MultiDiscrete, MultiBinary, Box)")
    return dist


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def parse_amp_dtype(amp_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``None`` / ``"none"`` → None; ``torch.bfloat16`` / ``"bf16"`` / ``"bfloat16"`` → ``torch.bfloat16``."""
    if amp_dtype is None or amp_dtype in ("none", "fp32", "float32"):
        return None
    if isinstance(amp_dtype, str):
        if amp_dtype not in AMP_DTYPES:
            raise ValueError(f"unknown amp_dtype {amp_dtype!r}; valid: None, {', '.join(AMP_DTYPES)}")
        return AMP_DTYPES[amp_dtype]
    if amp_dtype == torch.bfloat16:
        return amp_dtype
    raise ValueError(f"amp_dtype {amp_dtype} is not supported: use torch.bfloat16 (fp16 would need a gradient scaler)")


class ValueNormalizer(nn.Module):
    """PopArt value normalisation of a linear value head (van Hasselt et al. 2016, "Learning values across many
    orders of magnitude"; Hessel et al. 2019).

    The head predicts a normalised value ``n``; the value is ``μ + σ n``. :meth:`update` moves ``μ`` and ``σ``
    towards the statistics of new returns (exponential moving averages of the first and second moments, debiased,
    ``decay`` per call) and, from the second call on, rescales the head's weight and bias so that every output
    ``μ + σ n`` stays exactly what it was ("preserving outputs precisely"). The value loss divided by ``σ²`` is the
    normalised head's loss.

    ``σ`` is kept in ``[min_std, max_std]`` (PopArt's ``[1e-4, 1e6]``): returns of size 1e-3 get normalised targets
    of size 1, as returns of size 1e3 do; the bounds only stop a constant target from dividing by zero and a
    diverging one from overflowing. What makes the first statistics trustworthy is the head's start, not the
    bounds: :class:`MemoryPPOPolicy` zeroes the head when it normalises, so the first rollout's targets are
    discounted rewards (bootstrapped from values of 0), not the outputs of a random critic, whose spread would set
    σ (at 0.5 for rewards of size 1e-3 on CartPole, and still 0.25 eight rollouts later: the averages remember
    for ~``1 / (1 − decay)`` rollouts). The first update (debiased: the first rollout's statistics as they are)
    does not rescale the head: its outputs are those of an untrained head, and ``n`` staying as initialised means
    the values start at the first rollout's mean (from 0 at any value offset). Targets that are all one number
    (every step terminal, one reward) put σ at its floor; a head that has learned their outputs then grows by up
    to ``1 / min_std``.

    The floor is also relative to the mean, ``σ ≥ rel_min_std · |μ|`` (default 1e-6): values, returns and rollout
    values are float32, resolved to ~6e-8 of their size, so a σ below that scale would normalise rounding noise
    (at μ = 1e6, σ ≥ 1: an ulp of 1e6 is 1/16 of it).

    When ``optimizer`` is given to :meth:`update`, its Adam moments of the head's weight and bias are rescaled with
    them: the rescale multiplies those parameters' future gradients by ``s = σ_old / σ_new``, so ``exp_avg`` is
    multiplied by ``s`` and ``exp_avg_sq`` (and AMSGrad's ``max_exp_avg_sq``) by ``s²``. Adam's next step of the
    head, in normalised units, is then the one it would have taken had the statistics not moved (up to ``eps``).
    Without it, after σ grows ×1000 the head's gradients are 1000× smaller than ``exp_avg_sq`` remembers, and its
    steps stay that much smaller until the average forgets (~ln(10⁶) / (1 − β₂) steps); after σ shrinks, the steps
    grow until it catches up. Other optimizers' state is left as it is.

    Buffers (saved with the model): ``mean``, ``std`` and the raw moments with their update count.
    """

    #: Adam's (and AdamW's) per-parameter state, by the power of the gradient scale each holds
    MOMENT_POWERS = {"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2}

    def __init__(self, head: nn.Linear, decay: float = 0.9, min_std: float = 1e-4, max_std: float = 1e6,
                 rel_min_std: float = 1e-6) -> None:
        super().__init__()
        if not 0 < min_std <= max_std or rel_min_std < 0:
            raise ValueError("need 0 < min_std <= max_std and rel_min_std >= 0, "
                             f"got {min_std}, {max_std}, {rel_min_std}")
        self.head = [head]  # a list: not a submodule (the policy owns the head and its parameters)
        self.decay, self.min_std, self.max_std = float(decay), float(min_std), float(max_std)
        self.rel_min_std = float(rel_min_std)
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("std", torch.ones(()))
        self.register_buffer("moments", torch.zeros(2, dtype=torch.float64))  # E[R], E[R²], not yet debiased
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def denormalize(self, normalized: torch.Tensor) -> torch.Tensor:
        return normalized * self.std + self.mean

    @torch.no_grad()
    def update(self, returns: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Fold the value targets ``returns`` (any shape) into the statistics and, unless this is the first call,
        rescale the head in place (the parameters keep their addresses, as a captured CUDA graph needs), and
        ``optimizer``'s Adam moments of the head with it (also in place, no host sync: a captured Adam step reads
        them where they are)."""
        r = returns.detach().double().flatten()
        # non-finite targets are left out (no host sync): the PPO loss reports where they are, with the statistics
        # of the good ones intact
        finite = torch.isfinite(r)
        r = torch.where(finite, r, 0.0)
        n = finite.sum().clamp_min(1)
        self.moments.mul_(self.decay).add_((1 - self.decay) * torch.stack([r.sum() / n, r.square().sum() / n]))
        first = self.count == 0
        self.count.add_(1)
        m1, m2 = self.moments / (1 - self.decay ** self.count)
        new_mean = m1.float()
        floor = (self.rel_min_std * m1.abs()).clamp_min(self.min_std)
        spread = (m2 - m1 * m1).clamp_min(0).sqrt()
        new_std = torch.minimum(torch.maximum(spread, floor), floor.new_tensor(self.max_std)).float()
        # a where, not an if: no host sync
        scale = torch.where(first, 1.0, self.std / new_std)
        shift = torch.where(first, 0.0, (self.mean - new_mean) / new_std)
        head = self.head[0]
        head.weight.mul_(scale)
        head.bias.mul_(scale).add_(shift)
        if optimizer is not None:
            for param in (head.weight, head.bias):
                state = optimizer.state.get(param, {})  # empty before the optimizer's first step
                for key, power in self.MOMENT_POWERS.items():
                    if isinstance(state.get(key), torch.Tensor):
                        state[key].mul_(scale.to(state[key].dtype) ** power)
        self.mean.copy_(new_mean)
        self.std.copy_(new_std)


@contextlib.contextmanager
def adopting_saved_read_norms(policy: BasePolicy, state_dict: Mapping[str, Any], strict: bool) -> Iterator[None]:
    """Around ``policy.load_state_dict(state_dict, strict)``: a state saved before the read norm became the
    delta-rule default loads as it was trained.

    Where every delta-rule memory whose weights ``state_dict`` holds lacks its read norm there
    (:func:`~rlseq.policies.memory.saved_without_read_norm`), and ``output_norm`` was not given explicitly, those
    norms are removed and the optimizer is made again over the remaining parameters (same class, arguments and
    learning rate), so that the optimizer state SB3 loads after the policy's matches it. Once the load has
    succeeded, ``policy.memory_kwargs`` say ``output_norm=False`` and a warning says so; if it fails, the policy
    and its optimizer are restored. A partial load (``strict=False``) changes nothing. ``MemoryPPO`` then records
    the setting in its ``policy_kwargs`` (:func:`record_adopted_read_norms`), so that it saves as it now is."""
    given = policy.memory_kwargs.get("output_norm")
    names = saved_without_read_norm(policy, state_dict) if strict and given is None else []
    if not names:
        yield
        return
    modules = dict(policy.named_modules())
    norms, optimizer = {name: modules[name].out_norm for name in names}, policy.optimizer
    for name in names:
        modules[name].out_norm = None
    policy.optimizer = policy.optimizer_class(policy.parameters(), lr=optimizer.param_groups[0]["lr"],
                                              **policy.optimizer_kwargs)
    try:
        yield
    except BaseException:
        for name, norm in norms.items():
            modules[name].out_norm = norm
        policy.optimizer = optimizer
        raise
    policy.memory_kwargs["output_norm"] = False
    warnings.warn(f"{type(policy).__name__}: the saved state has no read norm for {', '.join(names)} (saved "
                  "before output_norm=True became the delta-rule default): loaded without it, as it was trained "
                  "(memory_kwargs output_norm=False)", stacklevel=4)


def record_adopted_read_norms(model: Any) -> None:
    """An SB3 algorithm ``model`` just loaded: where its policy was loaded without the read norm
    (:func:`adopting_saved_read_norms`), its ``policy_kwargs`` say ``output_norm=False`` too, so that its next save
    loads as it is, without the norm and without the warning."""
    if getattr(model.policy, "memory_kwargs", {}).get("output_norm") is not False:
        return
    memory_kwargs = dict(model.policy_kwargs.get("memory_kwargs") or {})
    if memory_kwargs.get("output_norm") is not False:
        model.policy_kwargs = {**model.policy_kwargs, "memory_kwargs": {**memory_kwargs, "output_norm": False}}


class MemoryPPOPolicy(BasePolicy):
    """Actor-critic with a sequence memory between the features extractor and the heads.

    Data flow per step: ``obs → features_extractor → memory → (net_arch MLP) → action distribution, value``.

    :param observation_space: gymnasium observation space (images are channel-first after SB3's
        ``VecTransposeImage``; ``Dict`` spaces go through the image+vector extractor).
    :param action_space: any action space SB3's distributions support.
    :param lr_schedule: learning-rate schedule (SB3 convention).
    :param memory: one of :data:`~rlseq.policies.memory.MEMORIES` (``"efla"``, ``"deltanet"``, ``"gru"``,
        ``"lstm"``, ``"none"``).
    :param memory_kwargs: passed to the memory class (e.g. ``n_heads``, ``head_dim``).
    :param net_arch: hidden layer sizes of the MLP between the memory and both heads (shared). None (default):
        ``[64, 64]`` for vector observations, ``Dict`` ones included (the memory block's output is a normalised
        embedding, and a control task needs a nonlinear map of it), ``[]`` where the observation holds an image
        (as in the Procgen paper, whose heads read the CNN features directly).
    :param features_extractor_class: default chosen from the observation space
        (:func:`default_features_extractor`).
    :param ortho_init: SB3's orthogonal initialisation of the heads (gain 0.01 policy, 1 value).
    :param amp_dtype: ``None`` (default: everything in fp32) or ``torch.bfloat16`` (also ``"bf16"``): run the
        features extractor (the IMPALA CNN) under ``torch.autocast`` with that dtype, in acting and in training
        alike, and cast its output back to fp32. The memory, the heads, the losses and the optimizer stay fp32.
        fp16 is refused: it would need a gradient scaler.
    :param channels_last: keep the features extractor's convolution weights and the image batches in the
        channels-last (NHWC) memory layout, which cuDNN's tensor-core kernels prefer (mostly useful with
        ``amp_dtype``). Same network; convolution algorithms, and so rounding, may differ.
    :param value_norm: normalise the value head's targets by running statistics of the returns, preserving its
        outputs (PopArt, van Hasselt et al. 2016; Hessel et al. 2019): see :class:`ValueNormalizer`. On by
        default: it keeps the value loss (and so its share of the clipped gradient) O(1) whatever the reward and
        value scales, which an unnormalised critic under a 0.5 gradient clip does not survive. The value head then
        starts at zero (values of 0 until the first update sets them to the first rollout's mean return).
    :param critic_memory: give the critic a memory of its own, of the same kind and arguments, and a trunk of its own
        (sb3-contrib's ``enable_critic_lstm``; :class:`~rlseq.policies.memory.ActorCriticMemory`): the value loss
        then no longer trains the actor's memory. Off by default: the actor and the critic share the memory and the
        trunk. The state doubles.
    :param optimizer_kwargs: SB3's; ``None`` means ``{"eps": 1e-5}`` for Adam. Fused Adam is
        ``optimizer_kwargs=dict(eps=1e-5, fused=True)`` (give ``eps`` too: explicit kwargs replace the default).

    The recurrent state is one tensor per batch of environments, ``[n_envs, ...]`` (see
    :meth:`initial_state`); ``predict`` takes and returns it as a NumPy array.
    """

    def __init__(
        self,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        lr_schedule: Schedule,
        memory: str = "efla",
        memory_kwargs: dict[str, Any] | None = None,
        net_arch: list[int] | None = None,
        activation_fn: type[nn.Module] = nn.ReLU,
        ortho_init: bool = True,
        use_sde: bool = False,
        features_extractor_class: type[BaseFeaturesExtractor] | None = None,
        features_extractor_kwargs: dict[str, Any] | None = None,
        normalize_images: bool = True,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.Adam,
        optimizer_kwargs: dict[str, Any] | None = None,
        amp_dtype: torch.dtype | str | None = None,
        channels_last: bool = False,
        value_norm: bool = True,
        critic_memory: bool = False,
    ):
        if use_sde:
            raise ValueError("gSDE is not supported by MemoryPPOPolicy")
        if optimizer_kwargs is None:
            optimizer_kwargs = {"eps": 1e-5} if optimizer_class is torch.optim.Adam else {}
        super().__init__(
            observation_space,
            action_space,
            features_extractor_class or default_features_extractor(observation_space),
            features_extractor_kwargs or {},
            normalize_images=normalize_images,
            optimizer_class=optimizer_class,
            optimizer_kwargs=optimizer_kwargs,
        )
        self.memory_name = memory
        self.memory_kwargs = dict(memory_kwargs or {})
        self.net_arch = list(net_arch) if net_arch is not None else ([] if _has_image(observation_space) else [64, 64])
        self.activation_fn = activation_fn
        self.ortho_init = ortho_init
        self.amp_dtype = parse_amp_dtype(amp_dtype)
        self.channels_last = bool(channels_last)

        self.features_extractor = self.make_features_extractor()
        if self.channels_last:
            self.features_extractor.to(memory_format=torch.channels_last)
        self.critic_memory = bool(critic_memory)
        features_dim = self.features_extractor.features_dim
        self.memory: Memory | ActorCriticMemory = (
            ActorCriticMemory(memory, features_dim, **self.memory_kwargs) if self.critic_memory
            else make_memory(memory, features_dim, **self.memory_kwargs))
        memory_out = self.memory.out_features // (2 if self.critic_memory else 1)
        self.trunk, latent_dim = _mlp(memory_out, self.net_arch, activation_fn)
        # with a critic memory the value head reads it through a trunk of its own
        self.critic_trunk = _mlp(memory_out, self.net_arch, activation_fn)[0] if self.critic_memory else None
        self.action_dist: Distribution = make_proba_distribution(action_space)
        self.action_net = self.action_dist.proba_distribution_net(latent_dim=latent_dim)
        if isinstance(self.action_net, tuple):  # Gaussian: (mean net, log_std parameter)
            self.action_net, self.log_std = self.action_net
        self.value_net = nn.Linear(latent_dim, 1)
        if ortho_init:
            for module, gain in ((self.trunk, np.sqrt(2)), (self.critic_trunk, np.sqrt(2)), (self.action_net, 0.01),
                                 (self.value_net, 1.0)):
                if module is not None:
                    module.apply(partial(self.init_weights, gain=gain))
        self.value_norm = bool(value_norm)
        self.value_normalizer = None
        if self.value_norm:
            # values of 0 until the first update sets them to the first rollout's mean: the first statistics are
            # then those of the rewards, not of a random critic's outputs (see ValueNormalizer)
            nn.init.zeros_(self.value_net.weight)
            nn.init.zeros_(self.value_net.bias)
            self.value_normalizer = ValueNormalizer(self.value_net)
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)

    def _get_constructor_parameters(self) -> dict[str, Any]:
        data = super()._get_constructor_parameters()
        data.update(
            memory=self.memory_name,
            memory_kwargs=self.memory_kwargs,
            net_arch=self.net_arch,
            activation_fn=self.activation_fn,
            ortho_init=self.ortho_init,
            features_extractor_class=self.features_extractor_class,
            features_extractor_kwargs=self.features_extractor_kwargs,
            normalize_images=self.normalize_images,
            optimizer_class=self.optimizer_class,
            optimizer_kwargs=self.optimizer_kwargs,
            amp_dtype=self.amp_dtype,
            channels_last=self.channels_last,
            value_norm=self.value_norm,
            critic_memory=self.critic_memory,
            lr_schedule=self._dummy_schedule,
        )
        return data

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` inside :func:`adopting_saved_read_norms` (models saved before the read
        norm became the delta-rule default load as they were trained)."""
        state_dict = with_rotary_freqs_of_option_saves(self, state_dict, self.memory_kwargs)
        with adopting_saved_read_norms(self, state_dict, strict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # --- state ----------------------------------------------------------------------------------------

    def initial_state(self, n_envs: int) -> torch.Tensor:
        """Zero memory state for ``n_envs`` environments, ``[n_envs, ...]`` on the policy's device."""
        return self.memory.initial_state(n_envs, self.device)

    # --- pieces -----------------------------------------------------------------------------------------

    def features(self, obs: PyTorchObs) -> torch.Tensor:
        """``obs [N, ...]`` → features ``[N, F]``, fp32 (the extractor runs under autocast when ``amp_dtype`` is set).

        Every path (acting, training, values, diagnostics) goes through here, so acting and training see the
        same precision and PPO's first ratio stays ~1.
        """
        x = preprocess_obs(obs, self.observation_space, normalize_images=self.normalize_images)
        if self.channels_last:
            x = {k: _nhwc(v) for k, v in x.items()} if isinstance(x, dict) else _nhwc(x)
        if self.amp_dtype is None:
            return self.features_extractor(x)
        with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype):
            features = self.features_extractor(x)
        # the memory's kernels and the heads expect fp32
        return features.float()

    def _head_outputs(self, memory_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``memory_out [N, F]`` → the action distribution's parameters and the values ``[N]``."""
        if self.critic_trunk is None:
            latent_pi = latent_vf = self.trunk(memory_out)
        else:  # [actor's output, critic's output] (ActorCriticMemory)
            actor_out, critic_out = memory_out.chunk(2, dim=-1)
            latent_pi, latent_vf = self.trunk(actor_out), self.critic_trunk(critic_out)
        values = self.value_net(latent_vf).squeeze(-1)
        if self.value_normalizer is not None:
            values = self.value_normalizer.denormalize(values)
        return self.action_net(latent_pi), values

    def value_scale(self) -> torch.Tensor | float:
        """The scale by which the value loss is divided (σ² of :class:`ValueNormalizer`, 1 without it): the loss
        of the normalised head, whose gradient is O(1) whatever the return scale."""
        return 1.0 if self.value_normalizer is None else self.value_normalizer.std.square()

    def value_std(self) -> torch.Tensor | float:
        """σ of :class:`ValueNormalizer` (1 without it): the unit of the normalised head, e.g. for value clipping."""
        return 1.0 if self.value_normalizer is None else self.value_normalizer.std

    def _heads(self, memory_out: torch.Tensor) -> tuple[Distribution, torch.Tensor]:
        mean_actions, values = self._head_outputs(memory_out)
        return self._distribution(mean_actions), values

    def _distribution(self, mean_actions: torch.Tensor) -> Distribution:
        return _unvalidated(self.action_dist, mean_actions, getattr(self, "log_std", None))

    # --- acting: one step, state updated in place -------------------------------------------------------

    def forward(
        self, obs: PyTorchObs, state: torch.Tensor, episode_starts: torch.Tensor, deterministic: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One acting step for ``n_envs`` environments.

        ``episode_starts [n_envs]`` bool zeroes the memory of the environments whose episode starts now.
        Returns ``(actions, values [n_envs], log_probs [n_envs])`` and updates ``state`` in place.
        """
        dist, values = self._heads(self.memory.step(self.features(obs), state, episode_starts))
        actions = dist.get_actions(deterministic=deterministic)
        return actions, values, dist.log_prob(actions)

    def act(
        self, obs: PyTorchObs, state: torch.Tensor, episode_starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` for the rollout loop, free of host syncs so that it can be captured in a CUDA graph.

        Returns ``(actions, values, log_probs, finite)``: ``finite`` is a 0-dim bool tensor, False when the step's
        action parameters or values were NaN/inf. Such a step samples from zeroed action parameters instead of
        failing inside the sampler (a CUDA device assert would end the process without saying where); the caller
        must check ``finite`` and raise. Finite steps compute exactly what :meth:`forward` computes.
        """
        mean_actions, values = self._head_outputs(self.memory.step(self.features(obs), state, episode_starts))
        finite = torch.isfinite(mean_actions).all() & torch.isfinite(values).all()
        if hasattr(self, "log_std"):
            finite = finite & torch.isfinite(self.log_std).all()
        mean_actions = torch.where(finite, mean_actions, torch.zeros_like(mean_actions))
        dist = self._distribution(mean_actions)
        actions = dist.get_actions()
        log_probs = dist.log_prob(actions)
        return actions, values, log_probs, finite

    def evaluate_step(
        self, obs: PyTorchObs, actions: torch.Tensor, state: torch.Tensor, episode_starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step-by-step evaluation of given actions: ``(values, log_prob, entropy)``, each ``[n_envs]``;
        updates ``state`` in place. Used to check the sequence path."""
        dist, values = self._heads(self.memory.step(self.features(obs), state, episode_starts))
        return values, dist.log_prob(actions), dist.entropy()

    @torch.no_grad()
    def predict_values(self, obs: PyTorchObs, state: torch.Tensor, episode_starts: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Values ``[n]`` of ``obs`` for states that follow ``state``; ``state`` itself is left unchanged."""
        _, values = self._head_outputs(self.memory.step(self.features(obs), state.clone(), episode_starts))
        return values

    # --- training: whole sequences, one memory call ----------------------------------------------------

    def _sequence_features(self, obs: PyTorchObs, B: int, T: int) -> torch.Tensor:
        """``obs [B, T, ...]`` (or a dict of those) → features ``[B, T, F]``, one extractor call for all steps."""
        flat = {k: v.flatten(0, 1) for k, v in obs.items()} if isinstance(obs, dict) else obs.flatten(0, 1)
        return self.features(flat).view(B, T, -1)

    def evaluate_sequences(
        self, obs: PyTorchObs, actions: torch.Tensor, initial_state: torch.Tensor, resets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Evaluate actions over whole sequences.

        ``obs``: ``[B, T, ...]`` (or a dict of those), ``actions [B, T, ...]``, ``initial_state [B, ...]``
        (the state entering step 0), ``resets [B, T]`` bool (episode starts) → ``(values, log_prob,
        entropy)``, each ``[B, T]``.
        """
        B, T = resets.shape
        y, _ = self.memory(self._sequence_features(obs, B, T), initial_state, resets)
        dist, values = self._heads(y.flatten(0, 1))
        flat_actions = actions.flatten(0, 1)
        if isinstance(self.action_space, spaces.Discrete):
            flat_actions = flat_actions.long().flatten()
        entropy, log_prob = dist.entropy(), dist.log_prob(flat_actions)
        # SB3's Distribution object keeps the torch distribution it made last, whose parameters would hold this
        # minibatch's autograd graph alive into the next one: the CUDA-graph train step's capture would then reuse
        # gradient accumulators made on its warm-up stream (torch warns of the stream mismatch)
        self.action_dist.distribution = None
        return values.view(B, T), log_prob.view(B, T), None if entropy is None else entropy.view(B, T)

    @torch.no_grad()
    def memory_diagnostics(self, obs: PyTorchObs, initial_state: torch.Tensor, resets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The memory's diagnostics (key norms, gates, state norms) over sequences ``obs [B, T, ...]``."""
        B, T = resets.shape
        return self.memory.diagnostics(self._sequence_features(obs, B, T), initial_state, resets)

    # --- SB3 predict with a recurrent state -----------------------------------------------------------

    def _predict(self, observation: PyTorchObs, deterministic: bool = False) -> torch.Tensor:
        raise NotImplementedError("a memory policy needs its state: call predict(obs, state, episode_start)")

    def predict(  # type: ignore[override]
        self,
        observation: np.ndarray | dict[str, np.ndarray],
        state: np.ndarray | None = None,
        episode_start: np.ndarray | None = None,
        deterministic: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """SB3-style prediction: ``(actions, next_state)``. ``state`` is what the previous call returned
        (None: a fresh memory); ``episode_start [n_envs]`` marks environments whose episode starts now."""
        self.set_training_mode(False)
        obs_tensor, vectorized = self.obs_to_tensor(observation)
        n_envs = (next(iter(obs_tensor.values())) if isinstance(obs_tensor, dict) else obs_tensor).shape[0]
        if state is None:
            state_t = self.initial_state(n_envs)
        else:
            state_t = torch.as_tensor(np.asarray(state), device=self.device, dtype=torch.float32).clone()
            expected = (n_envs, *self.memory.state_shape)
            if tuple(state_t.shape) != expected:
                raise ValueError(f"state must have shape {list(expected)} for {n_envs} environments, got {list(state_t.shape)}")
        if episode_start is None:
            starts = torch.zeros(n_envs, dtype=torch.bool, device=self.device)
        else:
            episode_start = np.asarray(episode_start)
            if episode_start.size != n_envs:
                raise ValueError(f"episode_start must have shape [{n_envs}] (one flag per environment of the "
                                 f"observation), got shape {list(episode_start.shape)}")
            starts = torch.as_tensor(episode_start, device=self.device).bool().reshape(n_envs)
        with torch.no_grad():
            actions, _, _ = self.forward(obs_tensor, state_t, starts, deterministic=deterministic)
        actions_np = actions.cpu().numpy()
        if isinstance(self.action_space, spaces.Box):
            actions_np = np.clip(actions_np, self.action_space.low, self.action_space.high)
        if not vectorized:
            actions_np = actions_np.squeeze(axis=0)
        return actions_np, state_t.cpu().numpy()
