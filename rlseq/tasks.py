"""Small gymnasium tasks that need memory: used by the tests and as examples.

:class:`CueRecallEnv` ("rlseq/CueRecall-v0"): a cue is shown at t = 0 only; ``delay`` blank steps later a query
flag appears and the agent must name the cue. A memoryless policy sees the same query observation whatever the
cue, so its expected return is exactly chance; a policy with memory can be perfect.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["CueRecallEnv", "chance_return"]


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
