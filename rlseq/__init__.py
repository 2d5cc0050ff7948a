"""rlseq: sequence-model memories (EFLA, DeltaNet, LSTM) for recurrent reinforcement learning.

Importing rlseq is light: kernels compile on first use and no environment is built at import time.
"""

__version__ = "0.1.0"
