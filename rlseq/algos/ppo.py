"""PPO for memory policies that trains on whole rollouts (rlseq's fast path).

Built on SB3's :class:`~stable_baselines3.PPO` (logging, schedules, callbacks, save/load, VecNormalize);
what changes is how rollouts are stored and replayed:

- acting calls the memory's ``step`` with the state kept on the device;
- the buffer stores the memory state once per environment per rollout (at its start);
- a minibatch is a subset of environments, each with its full ``n_steps`` sequence; episode starts inside
  a sequence become ``resets`` of one ``chunk_rule`` call (CleanRL's scheme, with the kernel doing resets).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.utils import FloatSchedule, obs_as_tensor
from stable_baselines3.common.vec_env import VecEnv, VecTransposeImage

from rlseq.algos.acting import ActingStep
from rlseq.algos.buffer import SequenceRolloutBuffer
from rlseq.algos.phases import PhaseTimer
from rlseq.policies.actor_critic import MemoryPPOPolicy


class MemoryPPO(PPO):
    """PPO with a sequence memory, trained on whole rollouts.

    Same arguments as SB3's :class:`~stable_baselines3.PPO`, except that minibatches are counted in
    environments: ``n_minibatches`` splits the ``n_envs`` sequences of a rollout (``n_envs`` must be
    divisible by it); ``batch_size`` is derived (``n_envs * n_steps // n_minibatches`` samples).
    The policy's memory is chosen with ``policy_kwargs=dict(memory="efla" | "deltanet" | "lstm" | "none",
    memory_kwargs=...)``; policy names ``"CnnPolicy"``, ``"MlpPolicy"`` and ``"MultiInputPolicy"`` all
    map to :class:`MemoryPPOPolicy`, which picks its features extractor from the observation space.

    ``predict(obs, state, episode_start)`` works as in sb3-contrib's RecurrentPPO, with ``state`` a NumPy
    array ``[n_envs, ...]`` holding the memory.

    Speed options, both off by default and both saved with the model (they live in ``policy_kwargs``):
    ``policy_kwargs=dict(amp_dtype=torch.bfloat16)`` runs the features extractor (the IMPALA CNN) in bf16
    autocast while acting and training, the rest in fp32 (see :class:`MemoryPPOPolicy`);
    ``policy_kwargs=dict(optimizer_kwargs=dict(eps=1e-5, fused=True))`` uses fused Adam.
    ``cuda_graph`` (default True) replays the acting step from a CUDA graph on CUDA devices (ignored on the CPU;
    see :class:`~rlseq.algos.acting.ActingStep`): same computation and same random draws, ~100x fewer launches.
    Pass False for a features extractor or memory that cannot be captured.
    """

    policy_aliases: ClassVar[dict[str, type]] = {
        "CnnPolicy": MemoryPPOPolicy,
        "MlpPolicy": MemoryPPOPolicy,
        "MultiInputPolicy": MemoryPPOPolicy,
    }
    policy: MemoryPPOPolicy
    rollout_buffer: SequenceRolloutBuffer

    def __init__(
        self,
        policy: str | type[MemoryPPOPolicy],
        env: GymEnv | str,
        learning_rate: float | Schedule = 5e-4,
        n_steps: int = 256,
        n_minibatches: int = 8,
        n_epochs: int = 3,
        gamma: float = 0.999,
        gae_lambda: float = 0.95,
        clip_range: float | Schedule = 0.2,
        clip_range_vf: float | Schedule | None = None,
        normalize_advantage: bool = True,
        ent_coef: float = 0.01,
        vf_coef: float = 0.5,
        max_grad_norm: float = 0.5,
        target_kl: float | None = None,
        stats_window_size: int = 100,
        tensorboard_log: str | None = None,
        policy_kwargs: dict[str, Any] | None = None,
        verbose: int = 0,
        seed: int | None = None,
        device: torch.device | str = "auto",
        cuda_graph: bool = True,
        _init_setup_model: bool = True,
    ):
        self.n_minibatches = n_minibatches
        self._memory_state: torch.Tensor | None = None
        self.cuda_graph = cuda_graph
        self._acting: ActingStep | None = None
        self.phases = PhaseTimer()  # enable with model.phases.enabled = True (python -m rlseq.bench train)
        super().__init__(
            policy, env, learning_rate=learning_rate, n_steps=n_steps, batch_size=2, n_epochs=n_epochs,
            gamma=gamma, gae_lambda=gae_lambda, clip_range=clip_range, clip_range_vf=clip_range_vf,
            normalize_advantage=normalize_advantage, ent_coef=ent_coef, vf_coef=vf_coef,
            max_grad_norm=max_grad_norm, target_kl=target_kl, stats_window_size=stats_window_size,
            tensorboard_log=tensorboard_log, policy_kwargs=policy_kwargs, verbose=verbose, seed=seed,
            device=device, _init_setup_model=False,
        )
        if _init_setup_model:
            self._setup_model()

    def _setup_model(self) -> None:
        if self.n_minibatches < 1 or self.n_envs % self.n_minibatches != 0:
            raise ValueError(
                f"n_minibatches={self.n_minibatches} must divide n_envs={self.n_envs}: a minibatch is a subset of "
                "environments, each with its whole rollout"
            )
        self.batch_size = self.n_envs * self.n_steps // self.n_minibatches
        self._setup_lr_schedule()
        self.set_random_seed(self.seed)
        self.policy = self.policy_class(self.observation_space, self.action_space, self.lr_schedule, **self.policy_kwargs)
        self.policy = self.policy.to(self.device)
        self.phases = PhaseTimer(self.device)
        self.rollout_buffer = SequenceRolloutBuffer(
            self.n_steps, self.n_envs, self.observation_space, self.action_space, self.device,
            gamma=self.gamma, gae_lambda=self.gae_lambda,
        )
        self.clip_range = FloatSchedule(self.clip_range)
        if self.clip_range_vf is not None:
            if isinstance(self.clip_range_vf, (float, int)) and self.clip_range_vf <= 0:
                raise ValueError("clip_range_vf must be positive, or None to disable value clipping")
            self.clip_range_vf = FloatSchedule(self.clip_range_vf)

    def _excluded_save_params(self) -> list[str]:
        return super()._excluded_save_params() + ["_memory_state", "phases", "_acting"]

    def _setup_learn(self, total_timesteps: int, callback: MaybeCallback = None, reset_num_timesteps: bool = True,
                     tb_log_name: str = "run", progress_bar: bool = False) -> tuple[int, BaseCallback]:
        fresh_env = reset_num_timesteps or self._last_obs is None
        total, callback = super()._setup_learn(total_timesteps, callback, reset_num_timesteps, tb_log_name, progress_bar)
        if fresh_env or self._memory_state is None:
            # a fresh env starts every episode: the memory starts empty (episode_starts are all True too)
            self._memory_state = self.policy.initial_state(self.n_envs)
        return total, callback

    # --- acting -----------------------------------------------------------------------------------------

    def collect_rollouts(self, env: VecEnv, callback: BaseCallback, rollout_buffer: SequenceRolloutBuffer,
                         n_rollout_steps: int) -> bool:
        assert self._last_obs is not None and self._memory_state is not None
        self.policy.set_training_mode(False)
        rollout_buffer.reset(self._memory_state)
        callback.on_rollout_start()
        t0 = time.perf_counter()
        if self._acting is None or self._acting.policy is not self.policy:
            self._acting = ActingStep(self.policy, cuda_graph=self.cuda_graph and self.device.type == "cuda")
        # Step under SB3's VecTransposeImage: it transposes every frame on the CPU (~0.5 ms per 64 frames, ~10% of
        # a GPU rollout); the acting step transposes on the device instead. Callbacks see channel-last frames.
        transposer = env if isinstance(env, VecTransposeImage) and not env.skip else None
        if transposer is not None:
            env = transposer.venv
        obs = _channels_last(self._last_obs, transposer)
        phase = self.phases
        for n_steps in range(n_rollout_steps):
            with phase("act"):
                step = self._acting.step(obs, self._last_episode_starts, self._memory_state,
                                         where=f"acting at env step {self.num_timesteps}", hwc=transposer is not None)
            clipped = step.actions_np
            if isinstance(self.action_space, spaces.Box):
                clipped = np.clip(clipped, self.action_space.low, self.action_space.high)
            with phase("env"):
                env.step_async(clipped)  # procgen steps on its own threads from here until step_wait
            with phase("buffer"):
                rollout_buffer.add_step(step.obs, step.actions, step.episode_starts, step.values, step.log_probs)
            with phase("env"):
                new_obs, rewards, dones, infos = env.step_wait()
            self.num_timesteps += env.num_envs
            callback.update_locals(locals())
            if not callback.on_step():
                self._last_obs = obs if transposer is None else transposer.transpose_observations(obs)
                return False
            self._update_info_buffer(infos, dones)
            rewards = self._bootstrap_truncated(rewards, dones, infos)
            with phase("buffer"):
                rollout_buffer.add_rewards(torch.as_tensor(rewards, device=self.device, dtype=torch.float32))
                obs, self._last_episode_starts = new_obs, dones
        self._last_obs = new_obs if transposer is None else transposer.transpose_observations(new_obs)
        starts = torch.as_tensor(dones, device=self.device).bool()
        with phase("act"), torch.no_grad():
            last_values = self.policy.predict_values(obs_as_tensor(self._last_obs, self.device), self._memory_state, starts)
        with phase("buffer"):
            rollout_buffer.compute_returns_and_advantage(last_values, starts)
        self.policy.memory.check_finite(self._memory_state, where=f"acting, rollout ending at env step {self.num_timesteps}")
        self._rollout_seconds = time.perf_counter() - t0
        callback.update_locals(locals())
        callback.on_rollout_end()
        return True

    def _bootstrap_truncated(self, rewards: np.ndarray, dones: np.ndarray, infos: list[dict]) -> np.ndarray:
        """Add ``γ V(terminal obs)`` to the reward of episodes cut by a time limit, as SB3's PPO does. The
        value reads the terminal observation with the memory of the episode that just ended."""
        idx = [i for i, d in enumerate(dones) if d and infos[i].get("terminal_observation") is not None
               and infos[i].get("TimeLimit.truncated", False)]
        if not idx:
            return rewards
        rewards = rewards.copy()
        for i in idx:
            obs = self.policy.obs_to_tensor(infos[i]["terminal_observation"])[0]
            state = self._memory_state[i : i + 1]
            no_reset = torch.zeros(1, dtype=torch.bool, device=self.device)
            rewards[i] += self.gamma * self.policy.predict_values(obs, state, no_reset)[0].item()
        return rewards

    # --- training ---------------------------------------------------------------------------------------

    def ppo_losses(self, batch, clip_range: float, clip_range_vf: float | None) -> dict[str, torch.Tensor]:
        """The PPO losses of one minibatch of sequences (SB3's PPO formulas, over all ``B × T`` samples)."""
        values, log_prob, entropy = self.policy.evaluate_sequences(
            batch.observations, batch.actions, batch.initial_state, batch.episode_starts)
        return self._losses_from(values.flatten(), log_prob.flatten(), None if entropy is None else entropy.flatten(),
                                 batch, clip_range, clip_range_vf)

    def _losses_from(self, values, log_prob, entropy, batch, clip_range, clip_range_vf) -> dict[str, torch.Tensor]:
        advantages = batch.advantages.flatten()
        if self.normalize_advantage and advantages.numel() > 1:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        old_log_prob, old_values, returns = batch.old_log_prob.flatten(), batch.old_values.flatten(), batch.returns.flatten()
        ratio = torch.exp(log_prob - old_log_prob)
        policy_loss = -torch.min(advantages * ratio, advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)).mean()
        values_pred = values if clip_range_vf is None else old_values + torch.clamp(values - old_values, -clip_range_vf, clip_range_vf)
        value_loss = F.mse_loss(returns, values_pred)
        entropy_loss = -torch.mean(-log_prob) if entropy is None else -torch.mean(entropy)
        with torch.no_grad():
            log_ratio = log_prob - old_log_prob
            approx_kl = torch.mean((torch.exp(log_ratio) - 1) - log_ratio)
            clip_fraction = torch.mean((torch.abs(ratio - 1) > clip_range).float())
        return dict(loss=policy_loss + self.ent_coef * entropy_loss + self.vf_coef * value_loss, policy_loss=policy_loss,
                    value_loss=value_loss, entropy_loss=entropy_loss, approx_kl=approx_kl, clip_fraction=clip_fraction)

    def train(self) -> None:
        t0 = time.perf_counter()
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        clip_range = self.clip_range(self._current_progress_remaining)
        clip_range_vf = self.clip_range_vf(self._current_progress_remaining) if self.clip_range_vf is not None else None
        stats: dict[str, list[torch.Tensor]] = {}
        continue_training = True
        for epoch in range(self.n_epochs):
            epoch_kl = []
            for i, batch in enumerate(self.rollout_buffer.minibatches(self.n_minibatches)):
                with self.phases("train_forward"):
                    losses = self.ppo_losses(batch, clip_range, clip_range_vf)
                if not torch.isfinite(losses["loss"]):
                    self._report_nonfinite_loss(batch, epoch, i, losses)
                epoch_kl.append(losses["approx_kl"])
                if self.target_kl is not None and losses["approx_kl"].item() > 1.5 * self.target_kl:
                    continue_training = False
                    if self.verbose >= 1:
                        print(f"Early stopping at epoch {epoch} due to reaching max kl: {losses['approx_kl'].item():.2f}")
                    break
                with self.phases("train_backward"):
                    self.policy.optimizer.zero_grad(set_to_none=True)
                    losses["loss"].backward()
                with self.phases("optimizer"):
                    grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
                    self.policy.optimizer.step()
                for name, value in losses.items():
                    stats.setdefault(name, []).append(value.detach())
                stats.setdefault("grad_norm", []).append(grad_norm.detach())
            self._n_updates += 1
            if not continue_training:
                break

        # one host sync for all the statistics, not one per minibatch
        means = {k: torch.stack(v).float().mean().item() for k, v in stats.items()}
        record = self.logger.record
        if means:
            record("train/entropy_loss", means["entropy_loss"])
            record("train/policy_gradient_loss", means["policy_loss"])
            record("train/value_loss", means["value_loss"])
            record("train/clip_fraction", means["clip_fraction"])
            record("train/loss", means["loss"])
            record("train/grad_norm", means["grad_norm"])
        if epoch_kl:
            record("train/approx_kl", torch.stack(epoch_kl).mean().item())
        record("train/explained_variance", self.rollout_buffer.explained_variance())
        record("train/n_updates", self._n_updates, exclude="tensorboard")
        record("train/clip_range", clip_range)
        if clip_range_vf is not None:
            record("train/clip_range_vf", clip_range_vf)
        returns = self.rollout_buffer.returns
        record("train/value_target_abs_mean", returns.abs().mean().item())
        record("train/value_target_abs_max", returns.abs().max().item())
        with self.phases("diagnostics"):
            self._record_memory_diagnostics()
        steps = self.n_envs * self.n_steps
        seconds = getattr(self, "_rollout_seconds", 0.0) + time.perf_counter() - t0
        record("time/env_steps_per_s", steps / max(seconds, 1e-9))

    @torch.no_grad()
    def _report_nonfinite_loss(self, batch, epoch: int, index: int, losses: dict[str, torch.Tensor]) -> None:
        """Raise with where a non-finite loss arose, and the memory's health on that minibatch."""
        where = f"training at env step {self.num_timesteps}, epoch {epoch}, minibatch {index} (envs {batch.env_indices.tolist()})"
        self.policy.memory.check_finite(batch.initial_state, where=where + ", stored initial state")
        diag = self.policy.memory_diagnostics(batch.observations, batch.initial_state, batch.episode_starts)
        parts = ", ".join(f"{k}={float(v):.4g}" for k, v in diag.items())
        terms = ", ".join(f"{k}={float(v):.4g}" for k, v in losses.items())
        raise FloatingPointError(f"non-finite PPO loss at {where}: {terms}; memory: {parts or 'n/a'}")

    @torch.no_grad()
    def _record_memory_diagnostics(self) -> None:
        n = max(1, self.n_envs // self.n_minibatches)
        batch = self.rollout_buffer.batch(torch.arange(n, device=self.device))
        for name, value in self.policy.memory_diagnostics(batch.observations, batch.initial_state, batch.episode_starts).items():
            self.logger.record(f"memory/{name}", float(value))


def _channels_last(obs: np.ndarray | dict[str, np.ndarray], transposer: VecTransposeImage | None):
    """Undo ``transposer``'s CHW transpose of the image entries (once per rollout, for its first step)."""
    if transposer is None:
        return obs
    if isinstance(obs, dict):
        return {k: np.ascontiguousarray(np.moveaxis(v, 1, -1)) if k in transposer.image_space_keys else v
                for k, v in obs.items()}
    return np.ascontiguousarray(np.moveaxis(obs, 1, -1))
