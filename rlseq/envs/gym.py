"""Any registered gymnasium environment as an SB3 ``VecEnv``, and the env ids the training CLI accepts.

:func:`resolve_env_id` turns a ``--env`` argument into ``(family, id)``:

* a procgen game (``caveflyer``, ``procgen:caveflyer``, ``procgen-caveflyer-v0``) -> ``("procgen", "caveflyer")``;
* a registered gymnasium id -> ``("popgym", id)`` for ``popgym-...`` ids and other ids of POPGym's envs, else
  ``("gym", id)``.

Ids are looked up in ``gymnasium.registry`` after importing the packages that register them: the ones named
with ``packages`` (``--env-package``, like RL Zoo's ``--gym-packages``), the ``module`` of a ``module:id``
argument, and, by their prefix, ``popgym`` for ``popgym-...`` ids and :mod:`rlseq.tasks` for ``rlseq/...`` ids.
An unknown id raises ``ValueError`` naming the closest registered ids.

:func:`make_gym` builds ``n_envs`` copies in a ``DummyVecEnv`` (these envs step in microseconds: worker
processes would cost more than they save), each under SB3's ``Monitor`` (so ``info["episode"]`` holds the
env's own return, as procgen's envs report it) and :class:`SB3Observation` where SB3 cannot take the
observation space (``Tuple`` spaces). Env ``i`` is seeded ``seed + i``.

SB3 computes the input width of a ``MultiDiscrete`` observation as a NumPy integer, which ``nn.LSTM`` refuses
(``input_size should be of type int``): :class:`FlattenExtractor` and :class:`CombinedExtractor` are SB3's
extractors with a Python ``int`` width, for sb3-contrib's stock LSTM policies over such spaces.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable, Sequence
from typing import Any, Callable, NamedTuple

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from stable_baselines3.common import torch_layers

__all__ = [
    "CombinedExtractor",
    "ENV_FAMILIES",
    "EnvId",
    "FlattenExtractor",
    "SB3Observation",
    "adapt_observation",
    "env_family",
    "import_env_packages",
    "make_gym",
    "resolve_env_id",
    "suggest_env_ids",
]

#: Families of env ids: each has its own config file (``configs/<family>.yml``) and default entry.
ENV_FAMILIES = ("procgen", "popgym", "gym")
# id prefix -> the module whose import registers those ids
_PREFIX_PACKAGES = {"popgym-": "popgym", "rlseq/": "rlseq.tasks"}


class EnvId(NamedTuple):
    """A resolved ``--env``: its family (one of :data:`ENV_FAMILIES`), the id (the bare game name for procgen)
    and the packages imported to register it (those named by the caller or a ``module:`` prefix)."""

    family: str
    id: str
    packages: tuple[str, ...]


def import_env_packages(names: Iterable[str]) -> None:
    """Import each module of ``names`` (they register gymnasium ids as a side effect); ``ValueError`` naming the
    module that fails."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # a broken package may raise anything while it registers its envs
            raise ValueError(f"env package {name!r} failed to import ({type(e).__name__}: {e})") from e


def env_family(env_id: str) -> str:
    """``"procgen"`` for a procgen game name; ``"popgym"`` for ``popgym-...`` ids and for any registered id whose
    env is POPGym's (such as rlseq's horizon tasks, so they train with POPGym's hyperparameters); else ``"gym"``."""
    from rlseq.envs.procgen import PROCGEN_GAMES

    if env_id in PROCGEN_GAMES:
        return "procgen"
    if env_id.startswith("popgym-"):
        return "popgym"
    spec = gym.registry.get(env_id)
    entry = getattr(spec, "entry_point", None)
    return "popgym" if isinstance(entry, str) and entry.startswith("popgym.") else "gym"


def suggest_env_ids(name: str, n: int = 5) -> list[str]:
    """The registered gymnasium ids and procgen games closest to ``name`` (case-insensitive ``difflib``)."""
    from rlseq.envs.procgen import PROCGEN_GAMES

    candidates = {c.lower(): c for c in [*gym.registry, *PROCGEN_GAMES]}
    return [candidates[c] for c in difflib.get_close_matches(name.lower(), list(candidates), n=n, cutoff=0.6)]


def resolve_env_id(name: str, packages: Sequence[str] = ()) -> EnvId:
    """Resolve a ``--env`` argument (see the module docstring); imports the packages it needs.

    :raises ValueError: a package fails to import, or the id is neither a procgen game nor registered (the
        message lists the closest ids).
    """
    from rlseq.envs.procgen import PROCGEN_GAMES, normalize_procgen_name

    name = name.strip()
    packages = tuple(packages)
    try:
        return EnvId("procgen", normalize_procgen_name(name), packages)
    except ValueError:
        pass
    module, sep, rest = name.partition(":")
    if sep and rest and module != "procgen":
        name, packages = rest, (*packages, module)
    import_env_packages(dict.fromkeys(packages))
    for prefix, package in _PREFIX_PACKAGES.items():
        if name.startswith(prefix) and name not in gym.registry:
            try:
                importlib.import_module(package)
            except ImportError as e:
                raise ValueError(f"{name} is a {package} id, but {package} failed to import ({e}); "
                                 f"install it (pip install {package.split('.')[0]})") from e
    if name in gym.registry:
        return EnvId(env_family(name), name, packages)
    close = suggest_env_ids(name)
    hint = f"closest: {', '.join(close)}. " if close else ""
    raise ValueError(f"unknown env {name!r}: not a procgen game nor a registered gymnasium id; {hint}Ids of another "
                     f"package need --env-package PACKAGE (or PACKAGE:ID). Procgen games: {', '.join(PROCGEN_GAMES)}")


def adapt_observation(space: spaces.Space) -> tuple[spaces.Space, Callable[[Any], Any]] | None:
    """The space SB3 gets instead of ``space`` and the map of observations onto it, or None if SB3 takes
    ``space`` as it is.

    * ``Tuple`` of ``Discrete`` / ``MultiDiscrete`` -> one ``MultiDiscrete`` (each entry shifted to start at 0);
    * ``Tuple`` of ``Box`` -> one flat float ``Box`` (the flattened parts concatenated);
    * any other ``Tuple`` (mixed or nested) -> gymnasium's ``flatten`` (one-hot for discrete parts);
    * ``Dict``: the same per key.
    """
    if isinstance(space, spaces.Dict):
        parts = {key: adapt_observation(sub) for key, sub in space.spaces.items()}
        if all(p is None for p in parts.values()):
            return None
        new = spaces.Dict({key: sub if parts[key] is None else parts[key][0] for key, sub in space.spaces.items()})
        fns = {key: (lambda x: x) if p is None else p[1] for key, p in parts.items()}
        return new, lambda obs: {key: fns[key](value) for key, value in obs.items()}
    if not isinstance(space, spaces.Tuple):
        return None
    subs = space.spaces
    if all(isinstance(s, (spaces.Discrete, spaces.MultiDiscrete)) for s in subs):
        nvec = np.concatenate([np.atleast_1d(s.n if isinstance(s, spaces.Discrete) else s.nvec).ravel() for s in subs])
        start = np.concatenate([np.atleast_1d(s.start).ravel() for s in subs]).astype(np.int64)
        return (spaces.MultiDiscrete(nvec.astype(np.int64)),
                lambda obs: np.concatenate([np.atleast_1d(np.asarray(x, np.int64)).ravel() for x in obs]) - start)
    if all(isinstance(s, spaces.Box) for s in subs):
        dtype = np.result_type(np.float32, *(s.dtype for s in subs))
        low = np.concatenate([s.low.ravel() for s in subs]).astype(dtype)
        high = np.concatenate([s.high.ravel() for s in subs]).astype(dtype)
        return (spaces.Box(low, high, dtype=dtype),
                lambda obs: np.concatenate([np.asarray(x, dtype).ravel() for x in obs]))
    flat = spaces.flatten_space(space)
    return flat, lambda obs: spaces.flatten(space, obs)


class SB3Observation(gym.ObservationWrapper):
    """Observations in a space SB3's policies take (see :func:`adapt_observation`), e.g. POPGym's Autoencode
    ``Tuple(Discrete(2), Discrete(4))`` -> ``MultiDiscrete([2, 4])``."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        adapted = adapt_observation(env.observation_space)
        if adapted is None:
            raise ValueError(f"{env.observation_space} needs no adaptation")
        self.observation_space, self._map = adapted

    def observation(self, observation: Any) -> Any:
        return self._map(observation)


def make_gym(env_id: str, n_envs: int, *, seed: int = 0, env_kwargs: dict[str, Any] | None = None):
    """``n_envs`` copies of ``gymnasium.make(env_id, **env_kwargs)`` under ``Monitor`` (and
    :class:`SB3Observation` where needed) in a ``DummyVecEnv``; env ``i`` seeded ``seed + i`` at the first reset
    (observation) and at once (its action space)."""
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    env_kwargs = dict(env_kwargs or {})

    def factory(rank: int) -> Callable[[], gym.Env]:
        def make() -> gym.Env:
            env = Monitor(gym.make(env_id, **env_kwargs))
            if adapt_observation(env.observation_space) is not None:
                env = SB3Observation(env)
            env.action_space.seed(seed + rank)
            return env

        return make

    venv = DummyVecEnv([factory(i) for i in range(n_envs)])
    venv.seed(seed)
    return venv


class FlattenExtractor(torch_layers.FlattenExtractor):
    """SB3's ``FlattenExtractor`` whose ``features_dim`` is a Python int for ``MultiDiscrete`` spaces too."""

    def __init__(self, observation_space: spaces.Space) -> None:
        super().__init__(observation_space)
        self._features_dim = int(self._features_dim)


class CombinedExtractor(torch_layers.CombinedExtractor):
    """SB3's ``CombinedExtractor`` whose ``features_dim`` is a Python int for ``MultiDiscrete`` keys too."""

    def __init__(self, observation_space: spaces.Dict, **kwargs: Any) -> None:
        super().__init__(observation_space, **kwargs)
        self._features_dim = int(self._features_dim)
