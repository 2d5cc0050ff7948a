"""Several VecEnv stacks presented as one VecEnv, and stepped one group at a time by the pipelined rollout.

:class:`VecEnvGroups` holds ``G`` complete env stacks of ``n_envs / G`` envs each (procgen plus its wrappers,
each with its own native env and thread pool). To SB3 it is one ``VecEnv`` of ``n_envs`` envs: env ``i`` is
env ``i mod m`` of group ``i // m`` (``m = n_envs / G``), and whole-batch results are concatenated in group
order. :class:`~rlseq.algos.MemoryPPO` also drives the groups one by one (:meth:`VecEnvGroups.step_group_async`,
:meth:`VecEnvGroups.step_group_wait`), so that while one group's procgen step runs on its C++ threads, the
host acts for another group::

    for g in groups:  step_group_wait(g) -> store rewards -> act for group g -> step_group_async(g)

Reward normalisation
--------------------
A ``VecNormalize`` in a group's stack keeps the running variance of the discounted return (``ret_rms``) that
scales the rewards. The groups' ``VecNormalize`` wrappers are made to share **one** ``RunningMeanStd`` object
(and one ``obs_rms`` when they normalise observations): each group adds its envs' returns to it in turn, and
``RunningMeanStd`` combines batch moments exactly (Chan et al.'s parallel update), so after every full step
the statistic is the one a single stack of all ``n_envs`` envs would hold, up to float rounding. The one
difference: within a step, group ``g`` scales its rewards by the statistic that holds groups ``0..g`` of this
step (a single stack scales every env by the statistic after the whole step), a lag of a fraction of one step.
Each group keeps its own per-env discounted returns (``VecNormalize.returns``), as they are per env anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from stable_baselines3.common.vec_env import VecEnv, VecEnvWrapper, VecNormalize, unwrap_vec_normalize
from stable_baselines3.common.vec_env.base_vec_env import VecEnvIndices, VecEnvObs, VecEnvStepReturn

__all__ = ["VecEnvGroups", "concat_obs", "concat_step_results", "envs_per_group", "find_env_groups"]


def envs_per_group(n_envs: int, n_groups: int) -> int:
    """``n_envs / n_groups``; raises ``ValueError`` unless ``n_groups >= 1`` divides ``n_envs``."""
    if n_groups < 1:
        raise ValueError(f"the number of env groups must be >= 1, got {n_groups}")
    if n_envs % n_groups:
        raise ValueError(f"{n_groups} env groups must divide n_envs={n_envs}: every group holds n_envs / groups envs")
    return n_envs // n_groups


def concat_obs(parts: Sequence[VecEnvObs]) -> VecEnvObs:
    """Concatenate the groups' observations along the env axis (arrays, dicts or tuples of arrays)."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: np.concatenate([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts)


def concat_step_results(results: Sequence[VecEnvStepReturn]) -> VecEnvStepReturn:
    """``(obs, rewards, dones, infos)`` of all envs from the groups' ``step_wait`` results, in group order."""
    obs, rewards, dones, infos = zip(*results)
    return (concat_obs(obs), np.concatenate(rewards), np.concatenate(dones),
            [info for group in infos for info in group])


def find_env_groups(env: VecEnv) -> VecEnvGroups | None:
    """The :class:`VecEnvGroups` that ``env`` is or wraps (through ``VecEnvWrapper`` s), else None."""
    while isinstance(env, VecEnvWrapper):
        env = env.venv
    return env if isinstance(env, VecEnvGroups) else None


class VecEnvGroups(VecEnv):
    """``G`` VecEnv stacks of ``m`` envs each as one VecEnv of ``n_envs = G * m`` envs.

    :param groups: the stacks, all with ``m`` envs and the same observation and action spaces (the container's
        spaces are group 0's). Use :meth:`build` to make them from a factory with distinct seeds.

    The SB3 ``VecEnv`` API: ``reset``, ``step_async``/``step_wait`` and ``get_images`` work on all envs and
    concatenate in group order (observations ``[n_envs, ...]``, rewards and dones ``[n_envs]``, ``n_envs``
    infos); ``get_attr``, ``set_attr``, ``env_method`` and ``env_is_wrapped`` route each global env index to
    its group; ``seed(s)`` seeds group ``g`` with ``s + g * m`` (so env ``i`` gets ``s + i``, SB3's convention,
    and the groups play different levels); ``close`` closes every group.

    Per group, for a pipelined rollout: :meth:`step_group_async` and :meth:`step_group_wait` step group ``g``
    alone (actions ``[m, ...]`` in, ``(obs [m, ...], rewards [m], dones [m], infos)`` out), and
    :meth:`group_slice` gives its envs' global indices. Several groups may be in flight at once.

    ``VecNormalize`` wrappers in the groups share one running statistic (module docstring); :attr:`vec_normalize`
    is group 0's, which holds it (save that; restore with :meth:`map_groups` and ``VecNormalize.load``).
    """

    def __init__(self, groups: Sequence[VecEnv]):
        groups = list(groups)
        if not groups:
            raise ValueError("VecEnvGroups needs at least one group")
        first = groups[0]
        for g, group in enumerate(groups[1:], 1):
            if group.num_envs != first.num_envs:
                raise ValueError(f"every group must hold the same number of envs: group 0 has {first.num_envs}, "
                                 f"group {g} has {group.num_envs}")
            if group.observation_space != first.observation_space or group.action_space != first.action_space:
                raise ValueError(f"group {g}'s spaces differ from group 0's: {group.observation_space}, "
                                 f"{group.action_space} vs {first.observation_space}, {first.action_space}")
        self.groups: list[VecEnv] = groups
        self.n_groups = len(groups)
        self.envs_per_group = first.num_envs
        self._waiting = [False] * self.n_groups  # group g has a step in flight (step_group_async, no wait yet)
        super().__init__(self.n_groups * self.envs_per_group, first.observation_space, first.action_space)
        self._share_statistics()

    @classmethod
    def build(cls, make_group: Callable[[int, int | None], VecEnv], n_envs: int, n_groups: int,
              seed: int | None = None) -> VecEnvGroups:
        """``n_groups`` stacks ``make_group(n_envs / n_groups, seed)``, group ``g`` seeded ``seed + g * n_envs / n_groups``
        (None: each stack's own default). Raises ``ValueError`` unless ``n_groups`` divides ``n_envs``."""
        m = envs_per_group(n_envs, n_groups)
        return cls([make_group(m, None if seed is None else seed + g * m) for g in range(n_groups)])

    # --- groups -------------------------------------------------------------------------------------------

    def group_slice(self, g: int) -> slice:
        """The global indices of group ``g``'s envs."""
        if not 0 <= g < self.n_groups:
            raise IndexError(f"env group {g} out of range: there are {self.n_groups} groups")
        return slice(g * self.envs_per_group, (g + 1) * self.envs_per_group)

    @property
    def vec_normalizes(self) -> list[VecNormalize]:
        """Each group's ``VecNormalize`` (empty when the groups have none)."""
        found = [unwrap_vec_normalize(group) for group in self.groups]
        return [v for v in found if v is not None]

    @property
    def vec_normalize(self) -> VecNormalize | None:
        """Group 0's ``VecNormalize``: its statistics are every group's (None without reward normalisation)."""
        found = self.vec_normalizes
        return found[0] if found else None

    def map_groups(self, fn: Callable[[VecEnv], VecEnv]) -> VecEnvGroups:
        """Replace every group by ``fn(group)`` (e.g. ``lambda v: VecNormalize.load(path, v)``: each load reads its
        own copy of the statistics, which the groups then share, group 0's). Returns ``self``."""
        if any(self._waiting):
            raise RuntimeError("map_groups() while a group step is in flight: call step_group_wait() first")
        groups = [fn(group) for group in self.groups]
        for g, group in enumerate(groups):
            if (group.num_envs != self.envs_per_group or group.observation_space != self.observation_space
                    or group.action_space != self.action_space):
                raise ValueError(f"map_groups: group {g} changed its number of envs or its spaces")
        self.groups = groups
        self._share_statistics()
        return self

    def _share_statistics(self) -> None:
        """Make every group's ``VecNormalize`` use group 0's running statistics (one statistic for all envs)."""
        norms = [unwrap_vec_normalize(group) for group in self.groups]
        if all(v is None for v in norms):
            return
        if any(v is None for v in norms):
            raise ValueError("either every env group or none must have a VecNormalize: "
                             f"groups {[g for g, v in enumerate(norms) if v is None]} have none")
        first = norms[0]
        settings = ("norm_obs", "norm_reward", "gamma", "epsilon", "clip_obs", "clip_reward")
        for g, norm in enumerate(norms[1:], 1):
            differ = [s for s in settings if getattr(norm, s) != getattr(first, s)]
            if differ:
                raise ValueError(f"group {g}'s VecNormalize differs from group 0's in {', '.join(differ)}")
            norm.ret_rms = first.ret_rms
            if first.norm_obs:
                norm.obs_rms = first.obs_rms

    # --- pipelined stepping ------------------------------------------------------------------------------

    def in_flight(self, g: int) -> bool:
        """Whether group ``g`` has a step started by :meth:`step_group_async` and not yet waited for."""
        self.group_slice(g)  # range check
        return self._waiting[g]

    def step_group_async(self, g: int, actions: np.ndarray) -> None:
        """Start group ``g``'s step with its envs' ``actions [m, ...]``; returns while the step runs (procgen:
        on its own threads)."""
        envs = self.group_slice(g)
        if self._waiting[g]:
            raise RuntimeError(f"env group {g} has a step in flight: call step_group_wait({g}) first")
        if len(actions) != self.envs_per_group:
            raise ValueError(f"env group {g} takes {self.envs_per_group} actions, got {len(actions)} (envs {envs.start}.."
                             f"{envs.stop - 1})")
        self.groups[g].step_async(actions)
        self._waiting[g] = True

    def step_group_wait(self, g: int) -> VecEnvStepReturn:
        """Wait for group ``g``'s step: ``(obs [m, ...], rewards [m], dones [m], infos)`` of its envs."""
        self.group_slice(g)  # range check
        if not self._waiting[g]:
            raise RuntimeError(f"step_group_wait({g}) without a preceding step_group_async({g})")
        self._waiting[g] = False
        return self.groups[g].step_wait()

    # --- the VecEnv API -----------------------------------------------------------------------------------

    def reset(self) -> VecEnvObs:
        """Reset every group (a group step in flight is finished first and its result dropped)."""
        for g in range(self.n_groups):
            if self._waiting[g]:
                self.step_group_wait(g)
        obs = concat_obs([group.reset() for group in self.groups])
        self.reset_infos = [info for group in self.groups for info in group.reset_infos]
        self._reset_seeds()
        self._reset_options()
        return obs

    def step_async(self, actions: np.ndarray) -> None:
        actions = np.asarray(actions)
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got an array of shape {actions.shape}")
        for g in range(self.n_groups):
            self.step_group_async(g, actions[self.group_slice(g)])

    def step_wait(self) -> VecEnvStepReturn:
        return concat_step_results([self.step_group_wait(g) for g in range(self.n_groups)])

    def close(self) -> None:
        for group in self.groups:
            group.close()

    def get_images(self) -> Sequence[np.ndarray | None]:
        return [image for group in self.groups for image in group.get_images()]

    def seed(self, seed: int | None = None) -> Sequence[int | None]:
        """Seed group ``g`` with ``seed + g * m`` (env ``i`` with ``seed + i``), at the next reset."""
        if seed is None:  # one random base for all, so the groups' seeds still differ
            seed = int(np.random.randint(0, np.iinfo(np.uint32).max, dtype=np.uint32))
        seeds: list[int | None] = []
        for g, group in enumerate(self.groups):
            seeds += list(group.seed(seed + g * self.envs_per_group))
        return seeds

    def set_options(self, options: list[dict] | dict | None = None) -> None:
        if isinstance(options, (list, tuple)):
            for g, group in enumerate(self.groups):
                group.set_options(list(options[self.group_slice(g)]))
        else:
            for group in self.groups:
                group.set_options(options)

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        return self._per_env(lambda group, local: group.get_attr(attr_name, local), indices)

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        def call(group: VecEnv, local: list[int]) -> list[None]:
            group.set_attr(attr_name, value, local)
            return [None] * len(local)

        self._per_env(call, indices)

    def env_method(self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any) -> list[Any]:
        return self._per_env(
            lambda group, local: group.env_method(method_name, *method_args, indices=local, **method_kwargs), indices)

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        return self._per_env(lambda group, local: group.env_is_wrapped(wrapper_class, local), indices)

    def _per_env(self, call: Callable[[VecEnv, list[int]], list[Any]], indices: VecEnvIndices) -> list[Any]:
        """``call(group, local_indices)`` once per group that ``indices`` touch; the answers in ``indices``' order."""
        wanted = self._global_indices(indices)
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for position, i in enumerate(wanted):
            g, local = divmod(i, self.envs_per_group)
            positions, locals_ = by_group.setdefault(g, ([], []))
            positions.append(position)
            locals_.append(local)
        out: list[Any] = [None] * len(wanted)
        for g, (positions, locals_) in by_group.items():
            for position, value in zip(positions, call(self.groups[g], locals_)):
                out[position] = value
        return out

    def _global_indices(self, indices: VecEnvIndices) -> list[int]:
        if indices is None:
            return list(range(self.num_envs))
        wanted: Iterable[int] = [indices] if isinstance(indices, (int, np.integer)) else indices
        out = []
        for i in wanted:
            if not -self.num_envs <= int(i) < self.num_envs:
                raise IndexError(f"env index {i} out of range for {self.num_envs} envs")
            out.append(int(i) % self.num_envs)
        return out

    def __repr__(self) -> str:
        return f"VecEnvGroups({self.n_groups} groups x {self.envs_per_group} envs: {self.groups[0]!r}, ...)"
