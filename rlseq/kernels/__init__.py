"""Delta-rule kernels (EFLA and DeltaNet), independent of any model.

- :func:`chunk_rule`: whole sequences with episode resets, for training (backends reference / torch / triton).
- :func:`step_rule`: one step with an in-place state, for acting.
- :func:`naive_rule`: the float64 step-by-step oracle that defines both rules.
"""

from rlseq.kernels.api import BACKENDS, chunk_rule, step_rule, triton_available
from rlseq.kernels.naive import naive_rule
from rlseq.kernels.rules import RULES, phi, step_size, unit_key_form

__all__ = ["BACKENDS", "RULES", "chunk_rule", "naive_rule", "phi", "step_rule", "step_size", "triton_available", "unit_key_form"]
