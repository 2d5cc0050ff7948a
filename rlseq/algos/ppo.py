"""PPO for memory policies that trains on whole rollouts (rlseq's fast path).

Built on SB3's :class:`~stable_baselines3.PPO` (logging, schedules, callbacks, save/load, VecNormalize);
what changes is how rollouts are stored and replayed:

- acting calls the memory's ``step`` with the state kept on the device (:class:`~rlseq.algos.acting.ActingStep`);
- the buffer stores the memory state once per environment per rollout (at its start);
- a minibatch is a subset of environments, each with its full ``n_steps`` sequence; episode starts inside
  a sequence become ``resets`` of one ``chunk_rule`` call (CleanRL's scheme, with the kernel doing resets);
- each minibatch update runs eagerly or is replayed from a CUDA graph (:class:`~rlseq.algos.training.TrainStep`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.save_util import load_from_zip_file
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.utils import FloatSchedule, obs_as_tensor
from stable_baselines3.common.vec_env import VecEnv, VecTransposeImage

from rlseq.algos.acting import ActingOutput, ActingStep
from rlseq.algos.buffer import SequenceRolloutBuffer
from rlseq.algos.phases import PhaseTimer
from rlseq.algos.training import ClipRange, TrainStep, clip_bounds, graph_obstacles
from rlseq.envs.wrappers import with_finite_check
from rlseq.policies.actor_critic import MemoryPPOPolicy, record_adopted_read_norms


class MemoryPPO(PPO):
    """PPO with a sequence memory, trained on whole rollouts.

    Same arguments as SB3's :class:`~stable_baselines3.PPO`, except that minibatches are counted in
    environments: ``n_minibatches`` splits the ``n_envs`` sequences of a rollout (``n_envs`` must be
    divisible by it; the default None takes the largest divisor of ``n_envs`` up to 4, so any env count
    works, also when ``load`` is given an env of another size); ``batch_size`` is derived (``n_envs * n_steps //
    n_minibatches`` samples, at least 2 while advantages are normalised). Callbacks see SB3's PPO locals
    (``actions``, ``clipped_actions``, ``values``, ``log_probs``, ``obs_tensor``, ``new_obs``, ...). The defaults
    (``n_steps=128``, ``n_epochs=4``, ``gamma=0.99``, lr 5e-4, entropy 0.01) suit small vector tasks such as
    POPGym's; Procgen's (256 steps, 8 minibatches, 3 epochs, gamma 0.999) live in ``configs/procgen.yml``.
    The policy's memory is chosen with ``policy_kwargs=dict(memory="efla" | "deltanet" | "gru" | "lstm" | "none",
    memory_kwargs=...)``; policy names ``"CnnPolicy"``, ``"MlpPolicy"`` and ``"MultiInputPolicy"`` all
    map to :class:`MemoryPPOPolicy`, which picks its features extractor from the observation space.

    ``predict(obs, state, episode_start)`` works as in sb3-contrib's RecurrentPPO, with ``state`` a NumPy
    array ``[n_envs, ...]`` holding the memory.

    The env: every observation and reward is checked for NaN/inf as it leaves the env, below any
    ``VecNormalize`` (:func:`~rlseq.envs.wrappers.with_finite_check`), so a bad value raises naming the env, the
    step and the field before it reaches a running statistic or the loss. On a procgen env a truncated episode
    is bootstrapped from the value already computed for its last frame (procgen's ``terminal_observation`` is a
    copy of that frame: :meth:`_bootstrap_truncated`).

    Precision: ``tf32`` (default False) allows TF32 convolutions and matmuls on a GPU while ``learn`` runs (the
    process's two torch switches are set on entry and restored on exit). Off, acting and training compute the same
    fp32 function, so PPO's first ratio is 1 to fp32 rounding; on, acting (batch ``n_envs``) and training (batch
    ``B × T``) may pick different TF32 kernels and differ by ~1e-3. ``python -m rlseq.train --tf32`` turns it on.
    It is saved with the model (set ``model.tf32`` after loading to change it).

    ``compile_extractor`` (default False) runs the features extractor through ``torch.compile`` (in place: its
    parameters and checkpoint keys are unchanged), acting and training alike, inside the CUDA graphs too. On an H100
    at the fast settings it made procgen training with the IMPALA CNN 12-20% faster without a memory and 4-18% with
    EFLA (the compiled code fuses what the eager CNN runs as separate kernels, its pooling's backward most of all:
    ``docs/benchmarks.md``); on a CPU it only costs the compile. The first acting step and the first update each
    compile (tens of seconds). Fused kernels round differently, so it is off by default; ``python -m rlseq.train
    --fast`` turns it on on a GPU.
    It is saved with the model and applied when the policy is built: ``MemoryPPO.load(path,
    compile_extractor=False)`` changes it.

    Speed options, off by default and saved with the model (they live in ``policy_kwargs``):
    ``policy_kwargs=dict(amp_dtype=torch.bfloat16)`` runs the features extractor (the IMPALA CNN) in bf16
    autocast while acting and training, the rest in fp32 (see :class:`MemoryPPOPolicy`);
    ``policy_kwargs=dict(optimizer_kwargs=dict(eps=1e-5, fused=True))`` uses fused Adam.

    ``cuda_graph`` (default True) replays the acting step from a CUDA graph on CUDA devices (ignored on the CPU;
    see :class:`~rlseq.algos.acting.ActingStep`): same computation and same random draws, ~100x fewer launches.
    Pass False for a features extractor or memory that cannot be captured.

    ``cuda_graph_train`` replays each PPO minibatch update (forward, loss, backward, gradient clipping, fused Adam
    step) from a CUDA graph (see :class:`~rlseq.algos.training.TrainStep`): the same computation in the same order
    (for the GRU and LSTM: the same function, their scan in place of the packed cuDNN call, so other rounding),
    one launch per minibatch instead of hundreds (the learning rate is read from a float32 tensor: a rate that is not a
    float32 number is rounded by at most 6e-8 relative). It needs a CUDA device, fused Adam/AdamW and
    ``target_kl=None`` (:func:`~rlseq.algos.training.graph_obstacles` lists what stands in the way); the memory's
    training pass is made capturable for it (:meth:`~rlseq.policies.memory.Memory.capturable_training`: the GRU and
    LSTM then scan over time instead of packing episode segments for cuDNN). ``None`` (the default, "auto") uses the
    graph whenever nothing stands in the way, except for memories whose capturable pass is not known to be faster
    (``memory.train_graph_auto`` False: the GRU and LSTM with ``backend="torch"``, whose scan is a loop of small
    kernels), and otherwise trains eagerly without a word; ``True``
    asks for it: when it cannot be used, ``train()`` warns once why and runs its eager loop; ``False`` always trains
    eagerly. It is saved with the model (set ``model.cuda_graph_train`` after loading to change it). A capture that
    fails raises, auto or not (an aborted capture can leave the process's CUDA state unusable). With the graph a
    non-finite loss is found after the last minibatch instead of before the bad update, which (like every later one
    of that ``train()`` call) is skipped by the optimizer, so the same :class:`FloatingPointError` is raised with
    the parameters where the eager loop leaves them.
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
        n_steps: int = 128,
        n_minibatches: int | None = None,
        n_epochs: int = 4,
        gamma: float = 0.99,
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
        cuda_graph_train: bool | None = None,
        tf32: bool = False,
        compile_extractor: bool = False,
        _init_setup_model: bool = True,
    ):
        if cuda_graph_train not in (None, True, False):
            raise ValueError(f"cuda_graph_train={cuda_graph_train!r}; valid: None (auto: when it can be used), True, "
                             "False")
        self.n_minibatches = n_minibatches
        self._auto_minibatches = n_minibatches is None  # then chosen again for another env count (load)
        self._memory_state: torch.Tensor | None = None
        self.cuda_graph = cuda_graph
        self._acting: ActingStep | None = None
        self.cuda_graph_train = None if cuda_graph_train is None else bool(cuda_graph_train)
        self.tf32 = bool(tf32)
        self.compile_extractor = bool(compile_extractor)
        self._train_step: TrainStep | None = None  # the captured minibatch update (cuda_graph_train)
        self._train_graph_warned: set[str] = set()  # the fallback warnings already given
        self.phases = PhaseTimer()  # enable with model.phases.enabled = True (python -m rlseq.bench train)
        with warnings.catch_warnings():
            # the batch size follows from n_minibatches in _setup_model, which checks it; SB3's checks of this
            # stand-in (a truncated mini-batch) would speak of a batch size that is not the run's
            warnings.filterwarnings("ignore", message=".*mini-batch size of 2.*")
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
        if self.n_minibatches is None or (getattr(self, "_auto_minibatches", False)
                                          and self.n_envs % self.n_minibatches != 0):
            # whole sequences per minibatch: up to 4 minibatches, as many as divide the env count evenly (chosen
            # again when a model saved with the automatic choice is loaded with another env count)
            self.n_minibatches = max(d for d in range(1, min(4, self.n_envs) + 1) if self.n_envs % d == 0)
        if self.n_minibatches < 1 or self.n_envs % self.n_minibatches != 0:
            raise ValueError(
                f"n_minibatches={self.n_minibatches} must divide n_envs={self.n_envs}: a minibatch is a subset of "
                "environments, each with its whole rollout (a loaded model: load(..., n_minibatches=N) sets another)"
            )
        self.batch_size = self.n_envs * self.n_steps // self.n_minibatches
        if self.normalize_advantage and self.batch_size < 2:
            raise ValueError(f"a minibatch of {self.batch_size} sample (n_envs={self.n_envs} × n_steps={self.n_steps} "
                             f"/ n_minibatches={self.n_minibatches}) cannot normalise advantages; take more envs or "
                             "steps, or normalize_advantage=False")
        self._setup_lr_schedule()
        self.set_random_seed(self.seed)
        self.policy = self.policy_class(self.observation_space, self.action_space, self.lr_schedule, **self.policy_kwargs)
        self.policy = self.policy.to(self.device)
        if self.compile_extractor:
            self.policy.features_extractor.compile()  # compiles at its first call
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

    def set_parameters(self, load_path_or_dict, exact_match: bool = True, device: torch.device | str = "auto") -> None:
        """SB3's, with the policy's state loaded before its optimizer's (a model saved before the read norm became
        the delta-rule default drops that norm and remakes its optimizer first:
        :func:`~rlseq.policies.actor_critic.adopting_saved_read_norms`), its ``policy_kwargs`` then saying so, and
        the acting and training graphs made again, since the parameters they captured may have changed."""
        if not isinstance(load_path_or_dict, dict):
            _, load_path_or_dict, _ = load_from_zip_file(load_path_or_dict, device=device, load_data=False)
        params = {k: load_path_or_dict[k] for k in sorted(load_path_or_dict, key=lambda k: k != "policy")}
        super().set_parameters(params, exact_match=exact_match, device=device)
        record_adopted_read_norms(self)
        self._acting = self._train_step = None

    def _excluded_save_params(self) -> list[str]:
        return super()._excluded_save_params() + ["_memory_state", "phases", "_acting", "_train_step",
                                                  "_train_graph_warned"]

    @staticmethod
    def _wrap_env(env: GymEnv, verbose: int = 0, monitor_wrapper: bool = True) -> VecEnv:
        """SB3's wrapping, then the finiteness check of :func:`~rlseq.envs.wrappers.with_finite_check`."""
        return with_finite_check(PPO._wrap_env(env, verbose, monitor_wrapper))

    def learn(self, *args: Any, **kwargs: Any) -> MemoryPPO:
        """SB3's ``learn`` (same arguments), with TF32 allowed or not as ``tf32`` says (see the class docstring)."""
        with _tf32(self.tf32):
            return super().learn(*args, **kwargs)

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
        """Fill ``rollout_buffer`` with ``n_rollout_steps`` steps of every env, as SB3's PPO does.

        Each step: act (all envs; the memory state reads the observations) → ``step_async`` → buffer copies (while
        the env steps) → ``step_wait`` → callbacks → rewards (with the bootstrap of time-limit truncations).
        Returns False when a callback stops the training; ``_last_obs``, ``_last_episode_starts`` and the memory
        state are then where the env is (the memory has read every observation the env returned but the last one),
        so a later ``learn(reset_num_timesteps=False)`` goes on from there; that step's reward is not stored.
        """
        assert self._last_obs is not None and self._memory_state is not None
        if self._acting is None or self._acting.policy is not self.policy:
            self._acting = ActingStep(self.policy, cuda_graph=self.cuda_graph and self.device.type == "cuda")
        self.policy.set_training_mode(False)
        rollout_buffer.reset(self._memory_state)
        callback.on_rollout_start()
        t0 = time.perf_counter()
        # Step under SB3's VecTransposeImage: it transposes every frame on the CPU (~0.5 ms per 64 frames, ~10% of
        # a GPU rollout); the acting step transposes on the device instead. Callbacks see channel-last frames.
        transposer = env if isinstance(env, VecTransposeImage) and not env.skip else None
        venv = env if transposer is None else transposer.venv
        stand_in = terminal_observation_is_last_seen(venv)
        obs, phase = _channels_last(self._last_obs, transposer), self.phases
        # the rewards go up from pinned memory without a sync (pageable memory would wait for the device each step)
        rewards_host = torch.empty(self.n_envs, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        for n_steps in range(n_rollout_steps):
            with phase("act"):
                step, clipped = self._act(obs, f"acting at env step {self.num_timesteps}", transposer is not None)
            # SB3's names, for callbacks that read self.locals
            actions, clipped_actions, obs_tensor = step.actions_np, clipped, step.obs  # noqa: F841
            values, log_probs = step.values, step.log_probs  # noqa: F841
            with phase("env"):
                venv.step_async(clipped)  # procgen steps on its own threads from here until step_wait
            with phase("buffer"):
                rollout_buffer.add_step(step.obs, step.actions, step.episode_starts, step.values, step.log_probs)
            with phase("env"):
                new_obs, rewards, dones, infos = venv.step_wait()
            self.num_timesteps += self.n_envs
            callback.update_locals(locals())
            if not callback.on_step():
                # the memory has read obs: the env's next observation is new_obs, not obs again
                self._last_obs, self._last_episode_starts = _sb3_layout(new_obs, transposer), dones
                return False
            self._update_info_buffer(infos, dones)
            if stand_in:
                rewards = self._bootstrap_truncated_from(rewards, dones, infos, step.values)
            else:
                rewards = self._bootstrap_truncated(rewards, dones, infos if transposer is None else
                                                    _transposed_terminals(infos, dones, transposer))
            with phase("buffer"):
                rewards_host.numpy()[...] = rewards
                rollout_buffer.add_rewards(rewards_host)
            obs, self._last_episode_starts = new_obs, dones
        self._last_obs = _sb3_layout(obs, transposer)
        starts = torch.as_tensor(self._last_episode_starts, device=self.device).bool()
        with phase("act"), torch.no_grad():
            last_values = self.policy.predict_values(obs_as_tensor(self._last_obs, self.device), self._memory_state, starts)
        values = last_values  # noqa: F841  (SB3's name at on_rollout_end)
        with phase("buffer"):
            rollout_buffer.compute_returns_and_advantage(last_values, starts)
        self.policy.memory.check_finite(self._memory_state, where=f"acting, rollout ending at env step {self.num_timesteps}")
        self._rollout_seconds = time.perf_counter() - t0
        callback.update_locals(locals())
        callback.on_rollout_end()
        return True

    def _act(self, obs, where: str, hwc: bool) -> tuple[ActingOutput, np.ndarray]:
        """One acting step of all envs from ``_last_episode_starts`` and the memory state (updated in place), and
        the actions the env gets (clipped to a Box action space)."""
        step = self._acting.step(obs, self._last_episode_starts, self._memory_state, where=where, hwc=hwc)
        clipped = step.actions_np
        if isinstance(self.action_space, spaces.Box):
            clipped = np.clip(clipped, self.action_space.low, self.action_space.high)
        return step, clipped

    def _bootstrap_truncated(self, rewards: np.ndarray, dones: np.ndarray, infos: list[dict]) -> np.ndarray:
        """Add ``γ V(terminal obs)`` to the reward of episodes cut by a time limit, as SB3's PPO does. The value
        reads ``infos[i]["terminal_observation"]`` (in the policy's layout) with the memory of the episode that
        just ended (the state after this step)."""
        idx = _truncated(dones, infos, need_terminal=True)
        if not idx:
            return rewards
        terminal = [infos[i]["terminal_observation"] for i in idx]
        batch = ({k: np.stack([t[k] for t in terminal]) for k in terminal[0]} if isinstance(terminal[0], dict)
                 else np.stack(terminal))
        no_reset = torch.zeros(len(idx), dtype=torch.bool, device=self.device)
        values = self.policy.predict_values(self.policy.obs_to_tensor(batch)[0], self._memory_state[idx], no_reset)
        return _add_discounted(rewards, idx, self.gamma, values)

    def _bootstrap_truncated_from(self, rewards: np.ndarray, dones: np.ndarray, infos: list[dict],
                                  step_values: torch.Tensor) -> np.ndarray:
        """:meth:`_bootstrap_truncated` for an env whose terminal observation is a copy of the last observation
        the acting step read (procgen: :func:`terminal_observation_is_last_seen`): the memory must not read it
        twice, so its value is the one that step computed, ``step_values [n_envs]``."""
        idx = _truncated(dones, infos, need_terminal=False)
        return _add_discounted(rewards, idx, self.gamma, step_values[idx]) if idx else rewards

    # --- training ---------------------------------------------------------------------------------------

    def ppo_losses(self, batch, clip_range: float | ClipRange,
                   clip_range_vf: float | ClipRange | None) -> dict[str, torch.Tensor]:
        """The PPO losses of one minibatch of sequences (SB3's PPO formulas, over all ``B × T`` samples). The clip
        ranges are floats, or :class:`~rlseq.algos.training.ClipRange` device tensors (what a CUDA graph reads)."""
        values, log_prob, entropy = self.policy.evaluate_sequences(
            batch.observations, batch.actions, batch.initial_state, batch.episode_starts)
        return self._losses_from(values.flatten(), log_prob.flatten(), None if entropy is None else entropy.flatten(),
                                 batch, clip_range, clip_range_vf)

    def _losses_from(self, values, log_prob, entropy, batch, clip_range, clip_range_vf) -> dict[str, torch.Tensor]:
        """SB3's PPO losses from the policy's ``values``, ``log_prob`` and ``entropy`` (None: estimated from
        ``log_prob``), each flattened to ``[B·T]``, against ``batch``'s records; 0-dim tensors by name."""
        advantages = batch.advantages.flatten()
        if self.normalize_advantage and advantages.numel() > 1:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        old_log_prob, old_values, returns = batch.old_log_prob.flatten(), batch.old_values.flatten(), batch.returns.flatten()
        eps, low, high = clip_bounds(clip_range, 1.0)
        ratio = torch.exp(log_prob - old_log_prob)
        policy_loss = -torch.min(advantages * ratio, advantages * torch.clamp(ratio, low, high)).mean()
        if clip_range_vf is None:
            values_pred = values
        else:
            _, vf_low, vf_high = clip_bounds(clip_range_vf, 0.0)
            unit = self.policy.value_std()  # the clip range is in units of the normalised head
            values_pred = old_values + torch.clamp(values - old_values, vf_low * unit, vf_high * unit)
        # divided by σ² of the value normaliser: the normalised head's loss, O(1) at any return scale
        value_loss = F.mse_loss(returns, values_pred) / self.policy.value_scale()
        entropy_loss = -torch.mean(-log_prob) if entropy is None else -torch.mean(entropy)
        with torch.no_grad():
            log_ratio = log_prob - old_log_prob
            approx_kl = torch.mean((torch.exp(log_ratio) - 1) - log_ratio)
            clip_fraction = torch.mean((torch.abs(ratio - 1) > eps).float())
        return dict(loss=policy_loss + self.ent_coef * entropy_loss + self.vf_coef * value_loss, policy_loss=policy_loss,
                    value_loss=value_loss, entropy_loss=entropy_loss, approx_kl=approx_kl, clip_fraction=clip_fraction)

    def train(self) -> None:
        """PPO updates on the rollout buffer: ``n_epochs`` passes over ``n_minibatches`` random env subsets, eagerly
        or, when :meth:`trains_from_graph`, each update replayed from a CUDA graph (:class:`~rlseq.algos.training.TrainStep`),
        the memory's training pass then in its capturable form."""
        step = self._graph_train_step()
        # only for the updates: diagnostics and evaluation keep the memory's eager pass
        self.policy.memory.capturable_training(step is not None)
        try:
            self._train(step)
        finally:
            self.policy.memory.capturable_training(False)

    def trains_from_graph(self) -> bool:
        """Whether ``train()`` replays its minibatch updates from a CUDA graph: ``cuda_graph_train`` is True, or None
        (auto) for a memory with ``train_graph_auto``, and :func:`~rlseq.algos.training.graph_obstacles` finds
        nothing in the way."""
        return self._graph_wanted() and not graph_obstacles(self)

    def _graph_wanted(self) -> bool:
        return self.cuda_graph_train is True or (self.cuda_graph_train is None and self.policy.memory.train_graph_auto)

    def _graph_train_step(self) -> TrainStep | None:
        """The CUDA-graph :class:`TrainStep` for this ``train()`` call, or None for the eager loop: when
        ``cuda_graph_train`` is False, or when the graph cannot be used (auto: silently; True: one warning saying
        why). A capture that fails raises (:class:`TrainStep`)."""
        if not self._graph_wanted():
            return None
        reasons = graph_obstacles(self)
        if reasons:
            message = "; ".join(reasons)
            if self.cuda_graph_train and message not in self._train_graph_warned:  # asked for, so say why not
                self._train_graph_warned.add(message)
                warnings.warn(f"cuda_graph_train: {message}. Training runs the eager loop instead.", RuntimeWarning,
                              stacklevel=3)
            return None
        if self._train_step is None or self._train_step.policy is not self.policy or not self._train_step.cuda_graph:
            self._train_step = TrainStep(self, cuda_graph=True)
        return self._train_step

    def _train(self, step: TrainStep | None) -> None:
        """:meth:`train` with the minibatch updates run by ``step`` (None: the eager loop)."""
        t0 = time.perf_counter()
        self.policy.set_training_mode(True)
        if self.policy.value_normalizer is not None:
            # before the updates: the buffer's values keep their meaning (outputs are preserved; at the first update
            # the untrained head's values move to the returns' mean), the targets get this rollout's scale, and
            # Adam's moments of the head follow its rescale
            self.policy.value_normalizer.update(self.rollout_buffer.returns, self.policy.optimizer)
        if self._n_updates == 0:  # the memory as initialised, at step 0 (e.g. EFLA's and DeltaNet's starting gates)
            with self.phases("diagnostics"):
                self._record_memory_diagnostics()
            self.logger.dump(step=0)
        self._update_learning_rate(self.policy.optimizer)
        clip_range = self.clip_range(self._current_progress_remaining)
        clip_range_vf = self.clip_range_vf(self._current_progress_remaining) if self.clip_range_vf is not None else None
        if step is None:
            means, approx_kl = self._train_eager(clip_range, clip_range_vf)
        else:
            means, approx_kl = self._train_steps(step, clip_range, clip_range_vf)

        record = self.logger.record
        if means:
            record("train/entropy_loss", means["entropy_loss"])
            record("train/policy_gradient_loss", means["policy_loss"])
            record("train/value_loss", means["value_loss"])
            record("train/clip_fraction", means["clip_fraction"])
            record("train/loss", means["loss"])
            if "grad_norm" in means:  # not when target_kl stopped the first minibatch before its update
                record("train/grad_norm", means["grad_norm"])
        if approx_kl is not None:
            record("train/approx_kl", approx_kl)
        if hasattr(self.policy, "log_std"):  # a Box action space, as SB3's PPO records it
            record("train/std", torch.exp(self.policy.log_std).mean().item())
        record("train/explained_variance", self.rollout_buffer.explained_variance())
        record("train/n_updates", self._n_updates, exclude="tensorboard")
        record("train/clip_range", clip_range)
        if clip_range_vf is not None:
            record("train/clip_range_vf", clip_range_vf)
        returns = self.rollout_buffer.returns
        record("train/value_target_abs_mean", returns.abs().mean().item())
        record("train/value_target_abs_max", returns.abs().max().item())
        if self.policy.value_normalizer is not None:
            record("train/value_norm_mean", self.policy.value_normalizer.mean.item())
            record("train/value_norm_std", self.policy.value_normalizer.std.item())
        with self.phases("diagnostics"):
            self._record_memory_diagnostics()
        steps = self.n_envs * self.n_steps
        seconds = getattr(self, "_rollout_seconds", 0.0) + time.perf_counter() - t0
        record("time/env_steps_per_s", steps / max(seconds, 1e-9))

    def _train_eager(self, clip_range: float, clip_range_vf: float | None) -> tuple[dict[str, float], float | None]:
        """The eager minibatch loop: a host check of each loss before its update, ``target_kl`` early stopping.
        Returns the mean of each statistic over the updates, and the mean ``approx_kl`` of the last epoch."""
        stats: dict[str, list[torch.Tensor]] = {}
        continue_training = True
        epoch_kl: list[torch.Tensor] = []
        for epoch in range(self.n_epochs):
            epoch_kl = []
            for i, batch in enumerate(self.rollout_buffer.minibatches(self.n_minibatches)):
                with self.phases("train_forward"):
                    losses = self.ppo_losses(batch, clip_range, clip_range_vf)
                if not torch.isfinite(losses["loss"]):
                    self._report_nonfinite_loss(batch, epoch, i, losses)
                epoch_kl.append(losses["approx_kl"])
                for name, value in losses.items():  # before the KL check, as SB3 counts the minibatch that stops
                    stats.setdefault(name, []).append(value.detach())
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
                stats.setdefault("grad_norm", []).append(grad_norm.detach())
            self._n_updates += 1
            if not continue_training:
                break
        means = {k: torch.stack(v).float().mean().item() for k, v in stats.items()}
        return means, (torch.stack(epoch_kl).mean().item() if epoch_kl else None)

    def _train_steps(self, step: TrainStep, clip_range: float,
                     clip_range_vf: float | None) -> tuple[dict[str, float], float | None]:
        """The minibatch loop through ``step`` (graph replays on a GPU): the same minibatches in the same order as
        :meth:`_train_eager`, no host sync until the last one. A non-finite loss raises here, after the loop, as
        the eager loop would have raised at that minibatch (``step`` skipped it and every later update)."""
        env_indices = []
        step.begin(clip_range, clip_range_vf, self.n_epochs * self.n_minibatches)
        try:
            for _ in range(self.n_epochs):
                for batch in self.rollout_buffer.minibatches(self.n_minibatches):
                    with self.phases("train_step"):
                        step.update(batch)
                    env_indices.append(batch.env_indices)
                self._n_updates += 1
        finally:
            step.end()
        result = step.read(recent=self.n_minibatches)
        if result.first_bad is not None:
            epoch, i = divmod(result.first_bad, self.n_minibatches)
            self._n_updates -= self.n_epochs - epoch  # the eager loop stops in that epoch, before counting it
            # the parameters are those before that minibatch: its losses recomputed eagerly are the ones that failed
            batch = self.rollout_buffer.batch(env_indices[result.first_bad])
            losses = self.ppo_losses(batch, clip_range, clip_range_vf)
            self._report_nonfinite_loss(batch, epoch, i, losses)
        return result.means, result.recent_approx_kl

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


def _sb3_layout(obs: np.ndarray | dict[str, np.ndarray], transposer: VecTransposeImage | None):
    """``obs`` as SB3 keeps ``_last_obs``: transposed to CHW by ``transposer``, if any."""
    return obs if transposer is None else transposer.transpose_observations(obs)


def _channels_last(obs: np.ndarray | dict[str, np.ndarray], transposer: VecTransposeImage | None):
    """Undo ``transposer``'s CHW transpose of the image entries (once per rollout, for its first step)."""
    if transposer is None:
        return obs
    if isinstance(obs, dict):
        return {k: np.ascontiguousarray(np.moveaxis(v, 1, -1)) if k in transposer.image_space_keys else v
                for k, v in obs.items()}
    return np.ascontiguousarray(np.moveaxis(obs, 1, -1))


@contextmanager
def _tf32(allowed: bool) -> Iterator[None]:
    """TF32 convolutions and matmuls allowed or not inside the block (torch's two process-wide switches)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def terminal_observation_is_last_seen(env: VecEnv) -> bool:
    """Whether ``env``'s ``infos[i]["terminal_observation"]`` is a copy of the last observation the agent acted on
    rather than the observation the episode ended in: true of procgen (:class:`~rlseq.envs.ProcgenVecEnv`, which
    never shows its final frame), and of any base env with a true ``terminal_observation_is_last_seen``
    attribute."""
    from rlseq.envs.procgen import ProcgenVecEnv

    base = env.unwrapped
    return isinstance(base, ProcgenVecEnv) or bool(getattr(base, "terminal_observation_is_last_seen", False))


def _truncated(dones: np.ndarray, infos: list[dict], need_terminal: bool) -> list[int]:
    """The envs whose episode a time limit cut at this step (with a ``terminal_observation`` if ``need_terminal``)."""
    return [i for i, done in enumerate(dones) if done and infos[i].get("TimeLimit.truncated", False)
            and (not need_terminal or infos[i].get("terminal_observation") is not None)]


def _add_discounted(rewards: np.ndarray, idx: list[int], gamma: float, values: torch.Tensor) -> np.ndarray:
    """A copy of ``rewards`` with ``gamma * values[j]`` added to entry ``idx[j]``."""
    rewards = rewards.copy()
    rewards[idx] += gamma * values.double().cpu().numpy()
    return rewards


def _transposed_terminals(infos: list[dict], dones: np.ndarray, transposer: VecTransposeImage) -> list[dict]:
    """``infos`` with the done envs' terminal observations in the policy's (channel-first) layout, as SB3's
    VecTransposeImage would have returned them (new dicts; ``infos`` itself, which the callbacks saw, is kept)."""
    out = list(infos)
    for i in np.flatnonzero(dones):
        if infos[i].get("terminal_observation") is not None:
            out[i] = {**infos[i], "terminal_observation": transposer.transpose_observations(infos[i]["terminal_observation"])}
    return out
