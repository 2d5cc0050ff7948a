"""Benchmarks: ``python -m rlseq.bench {kernels,gpu-check,envs,train,memory}``. Speed targets live here, never in
unit tests."""
