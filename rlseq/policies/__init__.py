"""Memory layers (EFLA, DeltaNet, GRU, LSTM, none), feature extractors and drop-in sb3-contrib policies.

* :mod:`rlseq.policies.memory`: :class:`Memory` and its implementations, :func:`make_memory`, :data:`MEMORIES`.
* :mod:`rlseq.policies.extractors`: :class:`ImpalaCNN` and :class:`ImpalaCombinedExtractor` (SB3 extractors).
* :mod:`rlseq.policies.sb3_contrib`: :class:`EflaCnnPolicy`, :class:`EflaMlpPolicy`, :class:`DeltaNetCnnPolicy`,
  :class:`DeltaNetMlpPolicy` (and MultiInput variants) for ``sb3_contrib.RecurrentPPO``.

Importing this package is light: the memories load at once (torch only); the SB3 extractors and policies load
on first attribute access; no Triton kernel compiles and no environment is built at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlseq._lazy import lazy_exports

from rlseq.policies.memory import (
    MEMORIES,
    ActorCriticMemory,
    DeltaNetMemory,
    EFLAMemory,
    GRUMemory,
    LSTMMemory,
    Memory,
    MemoryStateError,
    NoMemory,
    make_memory,
)

_LAZY = {
    "ImpalaCNN": "extractors",
    "ImpalaCombinedExtractor": "extractors",
    "MemoryActorCriticPolicy": "sb3_contrib",
    "EflaCnnPolicy": "sb3_contrib",
    "EflaMlpPolicy": "sb3_contrib",
    "EflaMultiInputPolicy": "sb3_contrib",
    "DeltaNetCnnPolicy": "sb3_contrib",
    "DeltaNetMlpPolicy": "sb3_contrib",
    "DeltaNetMultiInputPolicy": "sb3_contrib",
    "MemoryCnnPolicy": "sb3_contrib",
    "MemoryMlpPolicy": "sb3_contrib",
    "MemoryMultiInputPolicy": "sb3_contrib",
}

__all__ = sorted(
    ["MEMORIES", "ActorCriticMemory", "DeltaNetMemory", "EFLAMemory", "GRUMemory", "LSTMMemory", "Memory", "MemoryStateError", "NoMemory", "make_memory", *_LAZY]
)

if TYPE_CHECKING:  # pragma: no cover
    from rlseq.policies.extractors import ImpalaCNN, ImpalaCombinedExtractor
    from rlseq.policies.sb3_contrib import (
        DeltaNetCnnPolicy,
        DeltaNetMlpPolicy,
        DeltaNetMultiInputPolicy,
        EflaCnnPolicy,
        EflaMlpPolicy,
        EflaMultiInputPolicy,
        MemoryActorCriticPolicy,
        MemoryCnnPolicy,
        MemoryMlpPolicy,
        MemoryMultiInputPolicy,
    )


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
