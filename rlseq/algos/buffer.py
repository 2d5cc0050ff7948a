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
    memory of 4 heads × 64 × 32 would otherwise cost 32 KB per step per env.

    Shapes: ``[n_steps, n_envs, ...]`` per field; :meth:`minibatches` yields env subsets transposed to
    ``[B, n_steps, ...]``.

    Filling: per step, :meth:`add_step` (what acting knows, while the env steps) then :meth:`add_rewards`.
    """

    def __init__(self, n_steps: int, n_envs: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: torch.device, gamma: float = 0.99, gae_lambda: float = 0.95):
        self.n_steps, self.n_envs = n_steps, n_envs
        self.observation_space, self.action_space = observation_space, action_space
        self.device, self.gamma, self.gae_lambda = torch.device(device), gamma, gae_lambda
        self.pos = 0  # steps stored by add_step
        self.rewards_pos = 0  # steps whose reward is stored too
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
        self.pos = self.rewards_pos = 0
        self.initial_state = initial_state.detach().clone()

    def _obs_storage(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.n_steps, self.n_envs, *obs.shape[1:], dtype=obs.dtype, device=self.device)

    def add_step(self, obs: torch.Tensor | dict[str, torch.Tensor], actions: torch.Tensor,
                 episode_starts: torch.Tensor, values: torch.Tensor, log_probs: torch.Tensor) -> None:
        """Store what the acting step knows, tensors ``[n_envs, ...]``. The reward follows with
        :meth:`add_rewards`, so these copies can run while the env steps."""
        t = self.pos
        if t >= self.n_steps:
            raise RuntimeError(f"the rollout buffer holds {self.n_steps} steps; call reset() first")
        if self.rewards_pos != t:
            raise RuntimeError(f"step {self.rewards_pos} has no reward yet: call add_rewards() before the next add_step()")
        if isinstance(obs, dict):
            if self.observations is None:
                self.observations = {k: self._obs_storage(v) for k, v in obs.items()}
            for k, v in obs.items():
                self.observations[k][t].copy_(v)
        else:
            if self.observations is None:
                self.observations = self._obs_storage(obs)
            self.observations[t].copy_(obs)
        self.actions[t].copy_(actions.reshape(self.actions[t].shape))
        self.episode_starts[t].copy_(episode_starts)
        self.values[t].copy_(values)
        self.log_probs[t].copy_(log_probs)
        self.pos += 1

    def add_rewards(self, rewards: torch.Tensor) -> None:
        """The rewards ``[n_envs]`` of the step stored last by :meth:`add_step`. From pinned host memory the copy
        is asynchronous: leave ``rewards`` unchanged until the device has run it (the rollout loop's next acting
        step synchronises before the loop writes the next rewards there)."""
        if self.pos != self.rewards_pos + 1:
            raise RuntimeError("add_rewards() must follow add_step(), once per step")
        self.rewards[self.rewards_pos].copy_(rewards, non_blocking=True)
        self.rewards_pos += 1

    @property
    def full(self) -> bool:
        return self.rewards_pos == self.n_steps

    @torch.no_grad()
    def compute_returns_and_advantage(self, last_values: torch.Tensor, dones: torch.Tensor) -> None:
        """GAE(λ) as in SB3's ``RolloutBuffer``: ``episode_starts[t+1]`` (or ``dones`` after the last step)
        cuts the bootstrap. ``last_values``, ``dones``: ``[n_envs]``.

        Computed in float64 and rounded once into the float32 ``advantages`` and ``returns``: with values of 1e6,
        ``r + γV' − V`` in float32 cancels to within ~0.06 (an ulp of 1e6), which the recursion then sums over
        ~``1 / (1 − γλ)`` steps; an advantage of size 1 would be mostly rounding. In float64 the advantages are
        exact to float32's relative precision, and the returns to half an ulp of their own size.
        """
        rewards, values = self.rewards.double(), self.values.double()
        next_non_terminal = torch.cat([(~self.episode_starts[1:]).double(), 1.0 - dones.double().view(1, -1)])
        next_values = torch.cat([values[1:], last_values.double().view(1, -1)])
        deltas = rewards + self.gamma * next_values * next_non_terminal - values
        advantages = reverse_linear_recurrence(deltas, self.gamma * self.gae_lambda * next_non_terminal)
        self.advantages.copy_(advantages)
        self.returns.copy_(advantages + values)

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


def reverse_linear_recurrence(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a[t] = x[t] + c[t] · a[t+1]`` over dim 0 with ``a[T] = 0`` (GAE's recursion), for ``x``, ``c`` of one shape
    ``[T, ...]``: a scan of the affine maps ``y ↦ x[t] + c[t] y`` in ⌈log2 T⌉ steps of a few whole-tensor operations
    (Hillis–Steele), instead of T steps of a loop (on a GPU, T rounds of kernel launches)."""
    a, c = x.clone(), c.clone()
    k = 1
    while k < a.shape[0]:
        # each a[t] (c[t]) holds the composition of the maps t .. t+k-1; append the next k (the right-hand sides
        # are evaluated before the writes)
        a[:-k] = a[:-k] + c[:-k] * a[k:]
        c[:-k] = c[:-k] * c[k:]
        k *= 2
    return a
