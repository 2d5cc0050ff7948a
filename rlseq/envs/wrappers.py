"""VecEnv wrappers that put rewards and value targets on extreme scales.

All wrappers are SB3 ``VecEnvWrapper`` s, so they stack on any ``VecEnv``
(not only procgen) and compose with ``VecNormalize``, ``VecTransposeImage``
and ``VecMonitor``.

Typical stack for the scale experiments::

    venv = make_procgen("caveflyer", 64, distribution_mode="memory", seed=0)
    venv = ScaleReward(venv, 1e3)                         # rewards x 1e3
    venv = PotentialValueShift(venv, 1e5, gamma=0.999)    # values ~ V + 1e5
    venv = PrevActionReward(venv)                         # Dict obs for memory RL
    # optional: VecNormalize(venv, norm_obs_keys=["prev_reward"]) on top

Episode statistics
------------------
``info["episode"]["r"]`` (what SB3 logs as ``rollout/ep_rew_mean``) is left
untouched, so it stays the *unscaled game return* written by the base env and
runs at different scales remain comparable.  Each reward-changing wrapper
(``ScaleReward``, ``PotentialValueShift``) writes the undiscounted return of
the rewards *it emits* to ``info["episode"]["r_scaled"]``; when they are
stacked the outermost one writes last, so ``r_scaled`` is always the return
of the reward the agent is trained on (before any ``VecNormalize``).
:class:`ScaledReturnLogger` logs it as ``rollout/ep_rew_scaled_mean``.

A ``VecMonitor`` placed *above* these wrappers would overwrite
``info["episode"]`` with the scaled return; the procgen env already reports
episode statistics, so use no ``VecMonitor`` there, or put it directly on a
base env that lacks statistics (below the scale wrappers).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecNormalize, VecTransposeImage
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvObs, VecEnvStepReturn, VecEnvWrapper

__all__ = ["ScaleReward", "PotentialValueShift", "PrevActionReward", "ScaledReturnLogger", "VecCheckFinite",
           "with_finite_check"]


def _finite_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got bool")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _reward_dtype(rewards: np.ndarray) -> np.dtype:
    # Keep the incoming float dtype (float32 for procgen / SB3 VecEnvs).
    return rewards.dtype if rewards.dtype.kind == "f" else np.dtype(np.float32)


class _RewardTransform(VecEnvWrapper):
    """Base class: transform rewards and record the emitted episode return.

    Subclasses implement :meth:`_transform`, which gets float64 rewards and
    returns float64 rewards; the result is cast back to the incoming dtype.
    """

    def __init__(self, venv: VecEnv) -> None:
        super().__init__(venv)
        self._emitted_return = np.zeros(self.num_envs, dtype=np.float64)

    def _transform(self, rewards: np.ndarray, dones: np.ndarray, infos: list[dict[str, Any]]) -> np.ndarray:
        raise NotImplementedError

    def reset(self) -> VecEnvObs:
        obs = self.venv.reset()
        self._emitted_return[:] = 0.0
        return obs

    def step_wait(self) -> VecEnvStepReturn:
        obs, rewards, dones, infos = self.venv.step_wait()
        rewards = np.asarray(rewards)
        dones = np.asarray(dones, dtype=bool)
        out = self._transform(rewards.astype(np.float64), dones, infos).astype(_reward_dtype(rewards))
        # Accumulate what the agent actually receives (after the dtype cast).
        self._emitted_return += out
        done_idx = np.flatnonzero(dones)
        for i in done_idx:
            episode = infos[i].get("episode")
            if isinstance(episode, dict):
                episode["r_scaled"] = float(self._emitted_return[i])
        self._emitted_return[done_idx] = 0.0
        return obs, out, dones, infos


class ScaleReward(_RewardTransform):
    """Multiply every reward by ``scale`` (``r' = scale * r``).

    Returns and values scale by the same factor; the optimal policy is
    unchanged.  ``scale`` must be finite and > 0 (0 erases the task and a
    negative scale would turn maximisation into minimisation).  The
    experiments use 1e-3 .. 1e4.
    """

    def __init__(self, venv: VecEnv, scale: float) -> None:
        scale = _finite_float("scale", scale)
        if scale <= 0.0:
            raise ValueError(
                f"scale must be > 0, got {scale!r} (0 removes the reward signal, a negative scale inverts the task)"
            )
        super().__init__(venv)
        self.scale = scale

    def _transform(self, rewards: np.ndarray, dones: np.ndarray, infos: list[dict[str, Any]]) -> np.ndarray:
        return rewards * self.scale


class PotentialValueShift(_RewardTransform):
    r"""Shift every value target by ``shift`` without changing the task.

    Potential-based reward shaping (Ng, Harada & Russell, 1999) with the
    constant potential :math:`\Phi(s) = -\text{shift}` on every non-terminal
    state and :math:`\Phi = 0` on terminal (absorbing) states:

    .. math::
        r'_t = r_t + \gamma \Phi(s_{t+1}) - \Phi(s_t)
             = \begin{cases}
                 r_t + (1-\gamma)\,\text{shift} & s_{t+1}\ \text{non-terminal}\\
                 r_t + \text{shift}             & s_{t+1}\ \text{terminal}
               \end{cases}

    The shaping terms telescope, so for *every* trajectory that ends in a
    terminal state, :math:`\sum_t \gamma^t r'_t = \sum_t \gamma^t r_t + \text{shift}`
    exactly, whatever its length.  Hence :math:`V'^\pi(s) = V^\pi(s) + \text{shift}`
    and :math:`Q'^\pi(s,a) = Q^\pi(s,a) + \text{shift}` for every policy
    :math:`\pi`: advantages, the policy gradient and the optimal policy are
    unchanged; only the critic's targets move to :math:`|V| \approx |\text{shift}|`
    (e.g. 1e4 .. 1e6 with :math:`\gamma = 0.999`, where the per-step term is
    only ``1e-3 * shift``).  A plain constant per-step offset, by contrast,
    would reward or punish ending episodes early; the terminal ``+shift``
    is exactly what cancels that.

    ``gamma`` (required, no default) must equal the agent's discount factor,
    otherwise the shaping no longer telescopes and the task does change.

    Time-limit truncation: a truncated episode did not reach a terminal state,
    so its last state keeps the potential ``-shift``.  With
    ``bootstrap_truncation=True`` (default) a done env whose info has
    ``TimeLimit.truncated=True`` gets the *non-terminal* reward
    :math:`r + (1-\gamma)\text{shift}`; the agent is expected to add
    :math:`\gamma V'(s_T)` itself, as SB3's PPO and sb3-contrib's RecurrentPPO
    do (from ``terminal_observation``), which restores the full ``+shift``.
    Use ``bootstrap_truncation=False`` for an agent that treats time-outs as
    terminal: then every done step gets ``+shift``.  Mixing the two (no
    bootstrapping but ``bootstrap_truncation=True``) gives truncated episodes
    only :math:`\text{shift}(1-\gamma^T)` and *does* change the task.
    """

    def __init__(self, venv: VecEnv, shift: float, gamma: float, *, bootstrap_truncation: bool = True) -> None:
        shift = _finite_float("shift", shift)
        gamma = _finite_float("gamma", gamma)
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1] and equal to the agent's discount factor, got {gamma!r}")
        super().__init__(venv)
        self.shift = shift
        self.gamma = gamma
        self.bootstrap_truncation = bool(bootstrap_truncation)

    def _transform(self, rewards: np.ndarray, dones: np.ndarray, infos: list[dict[str, Any]]) -> np.ndarray:
        out = rewards + (1.0 - self.gamma) * self.shift
        for i in np.flatnonzero(dones):
            if self.bootstrap_truncation and infos[i].get("TimeLimit.truncated", False):
                continue  # s_{t+1} is not terminal: keep the non-terminal term
            out[i] += self.gamma * self.shift  # terminal: Phi(s_{t+1}) = 0
        return out


class PrevActionReward(VecEnvWrapper):
    """Give the policy the previous action and reward alongside the image.

    Observation (a ``gymnasium.spaces.Dict``, batched over envs)::

        "image":       the wrapped observation, unchanged (uint8 [n, 64, 64, 3] for procgen)
        "prev_action": float32 [n, n_actions], one-hot of the action taken at the previous step
        "prev_reward": float32 [n, 1], the reward the wrapped venv emitted at the previous step

    This is the usual memory-RL input (RL^2, IMPALA-LSTM).  The reward is the
    one emitted by the *wrapped* venv, so a ``ScaleReward`` or
    ``PotentialValueShift`` below this wrapper feeds its scaled reward into
    the memory, while a ``VecNormalize`` above it changes only the PPO reward,
    not this input (normalise it with ``norm_obs_keys=["prev_reward"]`` if
    wanted; never normalise the uint8 image).

    Both fields are zero after ``reset()`` and on the first observation of
    every new episode (the obs returned with ``done=True``), so nothing leaks
    across episode boundaries.  ``infos[i]["terminal_observation"]`` is
    converted to the same Dict form and carries the action and reward of the
    episode's final step.

    If the wrapped observation space is itself a ``Dict``, the two keys are
    added to it instead (``image_key`` is then unused).  Only ``Discrete``
    action spaces are supported.
    """

    def __init__(self, venv: VecEnv, *, image_key: str = "image") -> None:
        action_space = venv.action_space
        if not isinstance(action_space, spaces.Discrete):
            raise TypeError(f"PrevActionReward needs a Discrete action space, got {action_space}")
        inner = venv.observation_space
        if isinstance(inner, spaces.Dict):
            clash = {"prev_action", "prev_reward"} & set(inner.spaces)
            if clash:
                raise ValueError(f"the wrapped observation space already has key(s) {sorted(clash)}")
            fields = dict(inner.spaces)
            self._image_key: str | None = None
        else:
            fields = {image_key: inner}
            self._image_key = image_key
        self.n_actions = int(action_space.n)
        self._action_start = int(action_space.start)
        fields["prev_action"] = spaces.Box(0.0, 1.0, (self.n_actions,), dtype=np.float32)
        fields["prev_reward"] = spaces.Box(-np.inf, np.inf, (1,), dtype=np.float32)
        super().__init__(venv, observation_space=spaces.Dict(fields))
        self._last_actions = np.zeros(self.num_envs, dtype=np.int64)

    def _wrap(self, obs: Any, prev_action: np.ndarray, prev_reward: np.ndarray) -> dict[str, Any]:
        out = dict(obs) if self._image_key is None else {self._image_key: obs}
        out["prev_action"] = prev_action
        out["prev_reward"] = prev_reward
        return out

    def reset(self) -> VecEnvObs:
        obs = self.venv.reset()
        n = self.num_envs
        return self._wrap(obs, np.zeros((n, self.n_actions), np.float32), np.zeros((n, 1), np.float32))

    def step_async(self, actions: np.ndarray) -> None:
        idx = np.asarray(actions).reshape(self.num_envs).astype(np.int64) - self._action_start
        if idx.min() < 0 or idx.max() >= self.n_actions:
            raise ValueError(f"actions out of range for {self.venv.action_space}: {actions}")
        self._last_actions = idx
        self.venv.step_async(actions)

    def step_wait(self) -> VecEnvStepReturn:
        obs, rewards, dones, infos = self.venv.step_wait()
        n = self.num_envs
        prev_action = np.zeros((n, self.n_actions), dtype=np.float32)
        prev_action[np.arange(n), self._last_actions] = 1.0
        prev_reward = np.asarray(rewards, dtype=np.float32).reshape(n, 1).copy()
        done_idx = np.flatnonzero(np.asarray(dones))
        for i in done_idx:
            terminal = infos[i].get("terminal_observation")
            if terminal is not None:
                # The final frame of the episode pairs with the episode's last action/reward.
                infos[i]["terminal_observation"] = self._wrap(terminal, prev_action[i].copy(), prev_reward[i].copy())
        # obs[i] of a done env is the first frame of a new episode: nothing came before it.
        prev_action[done_idx] = 0.0
        prev_reward[done_idx] = 0.0
        return self._wrap(obs, prev_action, prev_reward), rewards, dones, infos


class ScaledReturnLogger(BaseCallback):
    """Log the mean scaled episode return as ``rollout/ep_rew_scaled_mean``.

    SB3 keeps the last 100 ``info["episode"]`` dicts in ``model.ep_info_buffer``
    but logs only ``r`` and ``l``; this adds the ``r_scaled`` written by
    :class:`ScaleReward` / :class:`PotentialValueShift`.  Pass it to
    ``model.learn(callback=ScaledReturnLogger())``.
    """

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        buffer = getattr(self.model, "ep_info_buffer", None) or []
        values = [ep["r_scaled"] for ep in buffer if "r_scaled" in ep]
        if values:
            self.logger.record("rollout/ep_rew_scaled_mean", float(np.mean(values)))


class VecCheckFinite(VecEnvWrapper):
    """Raise as soon as the wrapped env returns a NaN or inf observation or reward, naming the env index, the step
    and the field (``reward``, ``observation``, ``observation['key']``, or a done env's ``terminal_observation``).

    SB3's ``VecCheckNan`` names the field but not the env; this check also costs one ``np.isfinite`` per
    floating-point array per step (integer arrays, such as uint8 images, are finite by construction). Steps are
    counted from the wrapper's creation (step 1 is the first ``step_wait``; step 0 is a ``reset``). Raises
    :class:`FloatingPointError`. :func:`with_finite_check` puts one below every ``VecNormalize`` of a stack, so a
    bad value is reported before it turns a running statistic NaN.
    """

    def __init__(self, venv: VecEnv) -> None:
        super().__init__(venv)
        self.steps = 0

    def reset(self) -> VecEnvObs:
        obs = self.venv.reset()
        self._check_obs(obs, "observation", "after reset")
        return obs

    def step_wait(self) -> VecEnvStepReturn:
        obs, rewards, dones, infos = self.venv.step_wait()
        self.steps += 1
        at = f"at step {self.steps} (counted from the wrapper's creation)"
        self._check(np.asarray(rewards), "reward", at)
        self._check_obs(obs, "observation", at)
        for i in np.flatnonzero(np.asarray(dones)):
            terminal = infos[i].get("terminal_observation")
            if terminal is not None:
                self._check_obs(terminal, "terminal_observation", at, env=int(i))
        return obs, rewards, dones, infos

    def _check_obs(self, obs: Any, name: str, at: str, env: int | None = None) -> None:
        if isinstance(obs, dict):
            for key, value in obs.items():
                self._check(np.asarray(value), f"{name}[{key!r}]", at, env)
        else:
            self._check(np.asarray(obs), name, at, env)

    @staticmethod
    def _check(x: np.ndarray, name: str, at: str, env: int | None = None) -> None:
        """``x``: ``[n_envs, ...]`` (or one env's array when ``env`` is given)."""
        if x.dtype.kind not in "fc" or np.isfinite(x).all():
            return
        if env is None:
            bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
            envs = np.flatnonzero(bad).tolist()
            first = x[envs[0]]
        else:
            envs, first = [env], x
        value = first.flat[np.flatnonzero(~np.isfinite(first))[0]]
        raise FloatingPointError(f"non-finite {name} ({value}) from env {envs[0]} {at}"
                                 + (f"; envs {envs} in all" if len(envs) > 1 else "")
                                 + ": the env or a reward/observation wrapper produced it")


def with_finite_check(venv: VecEnv) -> VecEnv:
    """``venv`` with a :class:`VecCheckFinite` in its wrapper stack (unchanged if it has one).

    It goes directly below the innermost ``VecNormalize`` or ``VecTransposeImage`` (so that no running statistic
    ever sees a non-finite value, and a rollout that steps below SB3's ``VecTransposeImage`` still passes through
    it), or on top of the stack when it has neither. The stack is modified in place: that wrapper's ``venv`` becomes
    the check.
    """
    chain = [venv]
    while isinstance(chain[-1], VecEnvWrapper):
        chain.append(chain[-1].venv)
    if any(isinstance(layer, VecCheckFinite) for layer in chain):
        return venv
    above = [layer for layer in chain if isinstance(layer, (VecNormalize, VecTransposeImage))]
    if not above:
        return VecCheckFinite(venv)
    above[-1].venv = VecCheckFinite(above[-1].venv)
    return venv
