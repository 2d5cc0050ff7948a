"""Rollout storage for memory policies: whole sequences per environment, one memory state per rollout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from gymnasium import spaces


@dataclass
class SequenceBatch:
    """A minibatch of environments, each with its full rollout. Time is dim 1: ``[B, T, ...]``."""

    observations: torch.Tensor | dict[str, torch.Tensor]
    actions: torch.Tensor
    episode_starts: torch.Tensor  # [B, T] bool: the memory resets before these steps
    old_values: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    initial_state: torch.Tensor  # [B, ...]: the memory state entering the rollout's first step
    env_indices: torch.Tensor


class SequenceRolloutBuffer:
    """Rollout buffer on the training device.

    Observations keep their dtype (uint8 images stay uint8: 4× less memory and copy than float32). The
    memory state is stored **once per environment per rollout**, at its start, never per step: a matrix
    memory of 4 heads × 32 × 32 would otherwise cost 16 KB per step per env.

    Shapes: ``[n_steps, n_envs, ...]`` per field; :meth:`minibatches` yields env subsets transposed to
    ``[B, n_steps, ...]``.

    Filling: per step, :meth:`add_step` (what acting knows) then :meth:`add_rewards`, for all envs or, with
    ``envs=slice(a, b)``, for one contiguous group of envs (tensors ``[b - a, ...]``): the pipelined rollout
    stores each env group's records when that group acts and its rewards when its step returns. Every env
    moves through the steps in order; a step is complete when every env has its records and its reward
    (:attr:`pos`, :attr:`rewards_pos` count the complete steps).
    """

    def __init__(self, n_steps: int, n_envs: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: torch.device, gamma: float = 0.99, gae_lambda: float = 0.95):
        self.n_steps, self.n_envs = n_steps, n_envs
        self.observation_space, self.action_space = observation_space, action_space
        self.device, self.gamma, self.gae_lambda = torch.device(device), gamma, gae_lambda
        # per env, so that env groups can store their slices at their own times (the pipelined rollout)
        self._steps = np.zeros(n_envs, dtype=np.int64)  # steps stored by add_step
        self._rewarded = np.zeros(n_envs, dtype=np.int64)  # steps whose reward is stored too
        self.observations: torch.Tensor | dict[str, torch.Tensor] | None = None
        self.initial_state: torch.Tensor | None = None
        z = lambda dtype=torch.float32: torch.zeros(n_steps, n_envs, dtype=dtype, device=self.device)  # noqa: E731
        self.rewards, self.values, self.log_probs = z(), z(), z()
        self.advantages, self.returns = z(), z()
        self.episode_starts = z(torch.bool)
        if isinstance(action_space, spaces.Discrete):
            self.actions = torch.zeros(n_steps, n_envs, dtype=torch.long, device=self.device)
        else:
            self.actions = torch.zeros(n_steps, n_envs, *action_space.shape, dtype=torch.float32, device=self.device)

    def reset(self, initial_state: torch.Tensor) -> None:
        """Start a rollout from the memory ``initial_state [n_envs, ...]`` (copied)."""
        self._steps[:] = 0
        self._rewarded[:] = 0
        self.initial_state = initial_state.detach().clone()

    @property
    def pos(self) -> int:
        """Steps whose acting records (:meth:`add_step`) every env has."""
        return int(self._steps.min())

    @property
    def rewards_pos(self) -> int:
        """Steps whose rewards (:meth:`add_rewards`) every env has."""
        return int(self._rewarded.min())

    def _obs_storage(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.n_steps, self.n_envs, *obs.shape[1:], dtype=obs.dtype, device=self.device)

    def _env_slice(self, envs: slice | None) -> slice:
        if envs is None:
            return slice(0, self.n_envs)
        start, stop, stride = envs.indices(self.n_envs)
        if stride != 1 or start >= stop:
            raise ValueError(f"envs must be a non-empty contiguous slice of the {self.n_envs} envs, got {envs}")
        return slice(start, stop)

    @staticmethod
    def _step_of(counters: np.ndarray, envs: slice) -> int:
        """The step that the envs ``envs`` are at in ``counters``; they must all be at the same one."""
        steps = counters[envs]
        if (steps != steps[0]).any():
            raise RuntimeError(f"envs {envs.start}..{envs.stop - 1} are at different steps ({sorted(set(steps.tolist()))}): "
                               "store each env group's records with the same env slice every step")
        return int(steps[0])

    def add_step(self, obs: torch.Tensor | dict[str, torch.Tensor], actions: torch.Tensor,
                 episode_starts: torch.Tensor, values: torch.Tensor, log_probs: torch.Tensor,
                 envs: slice | None = None) -> None:
        """Store what the acting step knows for the envs ``envs`` (a contiguous slice; all by default): tensors
        ``[n, ...]`` for those ``n`` envs. Their reward follows with :meth:`add_rewards`, so these copies can
        run while the env steps."""
        envs = self._env_slice(envs)
        t = self._step_of(self._steps, envs)
        if t >= self.n_steps:
            raise RuntimeError(f"the rollout buffer holds {self.n_steps} steps; call reset() first")
        rewarded = self._step_of(self._rewarded, envs)
        if rewarded != t:
            raise RuntimeError(f"step {rewarded} of envs {envs.start}..{envs.stop - 1} has no reward yet: call "
                               "add_rewards() before the next add_step()")
        if isinstance(obs, dict):
            if self.observations is None:
                self.observations = {k: self._obs_storage(v) for k, v in obs.items()}
            for k, v in obs.items():
                self.observations[k][t, envs].copy_(v)
        else:
            if self.observations is None:
                self.observations = self._obs_storage(obs)
            self.observations[t, envs].copy_(obs)
        self.actions[t, envs].copy_(actions.reshape(self.actions[t, envs].shape))
        self.episode_starts[t, envs].copy_(episode_starts)
        self.values[t, envs].copy_(values)
        self.log_probs[t, envs].copy_(log_probs)
        self._steps[envs] += 1

    def add_rewards(self, rewards: torch.Tensor, envs: slice | None = None) -> None:
        """The rewards ``[n]`` of the envs ``envs`` (all by default) for the step stored last by :meth:`add_step`."""
        envs = self._env_slice(envs)
        t = self._step_of(self._rewarded, envs)
        if self._step_of(self._steps, envs) != t + 1:
            raise RuntimeError("add_rewards() must follow add_step(), once per step")
        self.rewards[t, envs].copy_(rewards)
        self._rewarded[envs] += 1

    @property
    def full(self) -> bool:
        return self.rewards_pos == self.n_steps

    @torch.no_grad()
    def compute_returns_and_advantage(self, last_values: torch.Tensor, dones: torch.Tensor) -> None:
        """GAE(λ) as in SB3's ``RolloutBuffer``: ``episode_starts[t+1]`` (or ``dones`` after the last step)
        cuts the bootstrap."""
        last_gae = torch.zeros(self.n_envs, device=self.device)
        for t in reversed(range(self.n_steps)):
            if t == self.n_steps - 1:
                next_non_terminal, next_values = 1.0 - dones.float(), last_values
            else:
                next_non_terminal, next_values = 1.0 - self.episode_starts[t + 1].float(), self.values[t + 1]
            delta = self.rewards[t] + self.gamma * next_values * next_non_terminal - self.values[t]
            last_gae = delta + self.gamma * self.gae_lambda * next_non_terminal * last_gae
            self.advantages[t] = last_gae
        self.returns.copy_(self.advantages + self.values)

    def minibatches(self, n_minibatches: int, generator: torch.Generator | None = None) -> Iterator[SequenceBatch]:
        """Random disjoint subsets of environments, each with its whole sequence (CleanRL's scheme)."""
        if not self.full:
            raise RuntimeError("the rollout is not complete")
        perm = torch.randperm(self.n_envs, generator=generator).to(self.device)
        for idx in perm.chunk(n_minibatches):
            yield self.batch(idx)

    def batch(self, idx: torch.Tensor) -> SequenceBatch:
        """The sequences of environments ``idx``, as ``[len(idx), n_steps, ...]``."""
        def seq(x: torch.Tensor) -> torch.Tensor:
            return x[:, idx].transpose(0, 1).contiguous()

        obs = {k: seq(v) for k, v in self.observations.items()} if isinstance(self.observations, dict) else seq(self.observations)
        return SequenceBatch(
            observations=obs, actions=seq(self.actions), episode_starts=seq(self.episode_starts),
            old_values=seq(self.values), old_log_prob=seq(self.log_probs), advantages=seq(self.advantages),
            returns=seq(self.returns), initial_state=self.initial_state[idx], env_indices=idx,
        )

    def explained_variance(self) -> float:
        from stable_baselines3.common.utils import explained_variance

        return float(explained_variance(self.values.flatten().cpu().numpy(), self.returns.flatten().cpu().numpy()))

    def nbytes(self) -> int:
        """Bytes held by the buffer (to document its memory cost)."""
        tensors = [self.rewards, self.values, self.log_probs, self.advantages, self.returns, self.episode_starts, self.actions]
        if isinstance(self.observations, dict):
            tensors += list(self.observations.values())
        elif self.observations is not None:
            tensors.append(self.observations)
        if self.initial_state is not None:
            tensors.append(self.initial_state)
        return int(sum(t.numel() * t.element_size() for t in tensors))
