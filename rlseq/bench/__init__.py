"""Benchmarks: ``python -m rlseq.bench {kernels,envs,train}``. Speed targets live here, never in unit tests."""
