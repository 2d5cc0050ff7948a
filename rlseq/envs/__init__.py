"""Environments for rlseq: procgen as a native SB3 VecEnv, any gymnasium env, and scale wrappers.

* :func:`make_procgen` / :class:`ProcgenVecEnv`: procgen's natively
  vectorised env as an SB3 ``VecEnv`` (uint8 64x64x3 images, Discrete(15)),
  with Monitor-style ``info["episode"]`` statistics.
* :data:`PROCGEN_GAMES`, :data:`PROCGEN_DISTRIBUTION_MODES`: the 16 games and
  the distribution modes each one supports.
* :func:`make_gym`: any registered gymnasium id as an SB3 ``DummyVecEnv``
  (``Monitor`` statistics, ``Tuple`` observations adapted by
  :class:`SB3Observation`); :func:`resolve_env_id` maps ``--env`` to a
  procgen game or a gymnasium id (importing the packages that register it).
* :class:`ScaleReward`: rewards x scale.
* :class:`PotentialValueShift`: value targets + shift, same optimal policy.
* :class:`PrevActionReward`: Dict observation with previous action/reward.
* :class:`ScaledReturnLogger`: SB3 callback logging the scaled return.
* :class:`VecCheckFinite`: raises on a NaN/inf observation or reward, naming
  the env, the step and the field.

Importing this package is cheap: the submodules (which import SB3, and in
turn torch) load on first attribute access, and procgen itself loads only
when an env is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlseq._lazy import lazy_exports

_EXPORTS = {
    "make_procgen": "procgen",
    "ProcgenVecEnv": "procgen",
    "PROCGEN_GAMES": "procgen",
    "PROCGEN_DISTRIBUTION_MODES": "procgen",
    "normalize_procgen_name": "procgen",
    "EnvId": "gym",
    "FlattenExtractor": "gym",
    "CombinedExtractor": "gym",
    "SB3Observation": "gym",
    "adapt_observation": "gym",
    "env_family": "gym",
    "import_env_packages": "gym",
    "make_gym": "gym",
    "resolve_env_id": "gym",
    "suggest_env_ids": "gym",
    "ScaleReward": "wrappers",
    "PotentialValueShift": "wrappers",
    "PrevActionReward": "wrappers",
    "ScaledReturnLogger": "wrappers",
    "VecCheckFinite": "wrappers",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .procgen import (
        PROCGEN_DISTRIBUTION_MODES,
        PROCGEN_GAMES,
        ProcgenVecEnv,
        make_procgen,
        normalize_procgen_name,
    )
    from .gym import (
        CombinedExtractor,
        EnvId,
        FlattenExtractor,
        SB3Observation,
        adapt_observation,
        env_family,
        import_env_packages,
        make_gym,
        resolve_env_id,
        suggest_env_ids,
    )
    from .wrappers import PotentialValueShift, PrevActionReward, ScaledReturnLogger, ScaleReward, VecCheckFinite


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
