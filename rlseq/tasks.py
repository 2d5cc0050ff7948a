"""Gymnasium tasks that need memory: the memory benchmark's horizon sweep, and a small task for the tests.

``rlseq/RepeatPreviousLag{L}-v0`` for L in :data:`HORIZON_LAGS` (1, 2, 4, ..., 64): POPGym's RepeatPrevious card
game (two decks, 103 steps an episode) asking at every step for the suit of the card seen L steps before the
current one. Each correct answer earns ``+1/(104 - (L+1))``, each wrong one the negative, so returns lie in [-1, 1]
and uniformly random answers score -0.5 in expectation; the first L steps of an episode are not scored. A
memory that holds a card for L steps scores 1; one that does not scores -0.5. Sweeping L measures how far back a
memory remembers (the benchmark's horizon curve); the block's front end sees lags below its convolution width
(L <= 3 at width 4) without any memory. POPGym's own ``k`` counts the current card as ``k = 1``: lag L is
``k = L + 1`` (POPGym's RepeatPreviousEasy, ``k = 4``, is lag 3). These ids run with POPGym's hyperparameters
(``configs/popgym.yml``).

:class:`CueRecallEnv` ("rlseq/CueRecall-v0"): a cue is shown at t = 0 only; ``delay`` blank steps later a query
flag appears and the agent must name the cue. A memoryless policy sees the same query observation whatever the
cue, so its expected return is exactly chance; a policy with memory can be perfect.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["HORIZON_LAGS", "CueRecallEnv", "chance_return", "horizon_task", "horizon_lag"]

#: lags of the horizon sweep, steps back
HORIZON_LAGS = (1, 2, 4, 8, 16, 32, 64)
_HORIZON_PREFIX, _HORIZON_SUFFIX = "rlseq/RepeatPreviousLag", "-v0"
_HORIZON_DECKS = 2  # 104 cards: room for lag 64 with 39 scored steps


def horizon_task(lag: int) -> str:
    """The gymnasium id of the horizon task at ``lag`` steps back (one of :data:`HORIZON_LAGS`)."""
    if lag not in HORIZON_LAGS:
        raise ValueError(f"no horizon task at lag {lag!r}; lags: {', '.join(map(str, HORIZON_LAGS))}")
    return f"{_HORIZON_PREFIX}{lag}{_HORIZON_SUFFIX}"


def horizon_lag(task: str) -> int | None:
    """The lag of a horizon task id, or None for any other id (no import of gymnasium's registry)."""
    if task.startswith(_HORIZON_PREFIX) and task.endswith(_HORIZON_SUFFIX):
        digits = task[len(_HORIZON_PREFIX) : -len(_HORIZON_SUFFIX)]
        if digits.isdigit():
            return int(digits)
    return None


class CueRecallEnv(gym.Env):
    """Recall a cue after a delay.

    Episode of ``delay + 2`` steps (t = 0 … delay + 1). Observation ``float32 [n_cues + 2]``:

    - t = 0: one-hot cue in the first ``n_cues`` entries (the cue is uniform over ``n_cues``), and the
      "cue" flag (entry ``n_cues``) set;
    - 0 < t ≤ delay: all zeros (blank);
    - t = delay + 1: only the "query" flag (entry ``n_cues + 1``) set.

    Actions ``Discrete(n_cues)``. Reward 0 everywhere except at the query step: ``+1`` if the action equals the
    cue, ``-1/(n_cues - 1)`` otherwise, so a memoryless policy's expected return is exactly 0 and an optimal one
    gets 1. The episode then terminates. Rewards do not depend on the actions before the query.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, n_cues: int = 2, delay: int = 4) -> None:
        if n_cues < 2 or delay < 0:
            raise ValueError(f"need n_cues >= 2 and delay >= 0, got {n_cues}, {delay}")
        self.n_cues, self.delay = int(n_cues), int(delay)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(self.n_cues + 2,), dtype=np.float32)
        self.action_space = spaces.Discrete(self.n_cues)
        self._t = 0
        self._cue = 0

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.n_cues + 2, dtype=np.float32)
        if self._t == 0:
            obs[self._cue] = 1.0
            obs[self.n_cues] = 1.0
        elif self._t == self.delay + 1:
            obs[self.n_cues + 1] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._t = 0
        self._cue = int(self.np_random.integers(self.n_cues))
        return self._obs(), {"cue": self._cue}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self._t == self.delay + 1:  # the query step
            correct = int(action) == self._cue
            reward = 1.0 if correct else -1.0 / (self.n_cues - 1)
            return self._obs(), reward, True, False, {"cue": self._cue, "correct": correct}
        self._t += 1
        return self._obs(), 0.0, False, False, {"cue": self._cue}


def chance_return(n_cues: int = 2) -> float:
    """Expected return of any memoryless policy on :class:`CueRecallEnv` (0 by construction)."""
    return 1.0 / n_cues - (1 - 1.0 / n_cues) / (n_cues - 1)


if "rlseq/CueRecall-v0" not in gym.registry:
    gym.register("rlseq/CueRecall-v0", entry_point=CueRecallEnv)
for _lag in HORIZON_LAGS:
    if horizon_task(_lag) not in gym.registry:
        # POPGym counts the current card as k = 1 (see the module docstring); imported lazily by gymnasium
        gym.register(horizon_task(_lag), entry_point="popgym.envs.repeat_previous:RepeatPrevious",
                     kwargs={"num_decks": _HORIZON_DECKS, "k": _lag + 1})
