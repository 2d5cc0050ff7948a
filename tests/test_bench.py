"""The benchmark entry points run and print their tables (numbers are not asserted: speed lives in benchmarks)."""

from __future__ import annotations

import re

import pytest

from rlseq.bench.__main__ import main as bench_main
from tests.helpers import record_torch_threads


def test_bench_kernels_prints_a_row_per_backend_with_the_oracle_error_on_the_trainers_torch_threads(capsys,
                                                                                                     monkeypatch):
    threads = record_torch_threads(monkeypatch)
    bench_main(["kernels", "--batch", "1", "--head-dim", "16", "--steps", "20", "--heads", "1",
                "--backends", "reference", "torch", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 | 20 |")]
    assert len(rows) == 2 and "reference" in rows[0] and "torch" in rows[1]
    err = float(rows[1].split("|")[-2])
    assert err < 1e-5  # float32 against the float64 oracle
    assert threads == [1]


def test_bench_train_prints_throughput_and_the_phase_breakdown_on_the_torch_threads_asked(capsys, monkeypatch):
    threads = record_torch_threads(monkeypatch)
    bench_main(["train", "--variants", "rlseq-none", "rlseq-efla", "--n-envs", "2", "--n-steps", "8",
                "--n-minibatches", "2", "--n-epochs", "1", "--num-threads", "0", "--warmup", "1", "--rollouts", "1",
                "--device", "cpu", "--torch-threads", "3"])
    assert threads == [3]
    out = capsys.readouterr().out
    assert re.search(r"\| rlseq-efla \| [\d,]+ \| [\d.]+x \|", out)
    assert "train_backward" in out and "| rlseq-none |" in out


def test_bench_envs_prints_the_wrapper_overhead(capsys):
    bench_main(["envs", "--n-envs", "4", "--steps", "10", "--warmup", "2", "--repeats", "2", "--num-threads", "0"])
    out = capsys.readouterr().out
    assert "steps/s" in out and "%" in out


def test_the_same_options_baseline_ignores_the_options_order():
    from rlseq.bench.train import _same_options_baseline

    base = {"rlseq-none": 1.0, "rlseq-none+graph+bf16": 2.0, "rlseq-efla+bf16+graph": 3.0, "sb3-ppo": 4.0}
    assert _same_options_baseline("rlseq-efla+bf16+graph", base) == 2.0
    assert _same_options_baseline("rlseq-efla", base) == 1.0
    assert _same_options_baseline("rlseq-efla+bf16", base) is None


def test_ctrl_c_in_a_bench_is_one_line_and_exit_130(capsys, monkeypatch):
    import rlseq.bench.kernels as K

    def interrupted(args):
        print("| a row |", flush=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(K, "main", interrupted)
    with pytest.raises(SystemExit) as e:
        bench_main(["kernels"])
    out, err = capsys.readouterr()
    assert e.value.code == 130 and out == "| a row |\n"
    assert err == "stopped by SIGINT: the kernels rows printed above are complete, the rest was not measured\n"
