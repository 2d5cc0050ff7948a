"""rlseq: sequence-model memories (EFLA, DeltaNet, GRU, LSTM) for recurrent reinforcement learning.

Importing rlseq is light: kernels compile on first use and no environment is built at import time.
"""

__version__ = "0.1.0"


def _silence_gym_notice() -> None:
    """The legacy ``gym`` package (pulled in by procgen, imported by SB3 when present) prints a 4-line deprecation
    notice on stderr at import, on every rlseq command, for nothing the user did. Its text comes from the tiny
    ``gym_notices`` table, emptied here before anything imports gym."""
    try:
        import gym_notices.notices as notices
    except ImportError:
        return
    notices.notices.clear()


_silence_gym_notice()
