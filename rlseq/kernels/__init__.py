"""Sequence kernels, independent of any model: the delta rules (EFLA and DeltaNet) and the GRU and LSTM scans.

- :func:`chunk_rule`: a delta rule over whole sequences with episode resets, for training (backends reference /
  torch / triton).
- :func:`step_rule`: one step with an in-place state, for acting.
- :func:`naive_rule`: the float64 step-by-step oracle that defines both rules.
- :func:`rnn_scan`: a GRU or LSTM layer over whole sequences with episode resets, without host reads (backends
  reference / torch / triton), for a training pass that a CUDA graph captures.
"""

from rlseq.kernels.api import BACKENDS, chunk_rule, step_rule, triton_available
from rlseq.kernels.naive import naive_rule
from rlseq.kernels.rnn import rnn_scan
from rlseq.kernels.rules import RULES, phi, step_size, unit_key_form

__all__ = ["BACKENDS", "RULES", "chunk_rule", "naive_rule", "phi", "rnn_scan", "step_rule", "step_size",
           "triton_available", "unit_key_form"]
