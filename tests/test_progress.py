"""The training progress of ``rlseq.train``: what it prints from the first seconds, on a clock of the test's own."""

from __future__ import annotations

from types import SimpleNamespace

import rlseq.callbacks as C


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _progress(monkeypatch, *, total: int, on_cpu: bool, every_s: float = 30.0):
    clock = Clock()
    monkeypatch.setattr(C.time, "perf_counter", clock)
    p = C.Progress(total, on_cpu=on_cpu, smaller="SMALLER", every_s=every_s)
    p.tty = False
    model = SimpleNamespace(num_timesteps=0)
    p.model = model
    p._on_training_start()
    return p, model, clock


def _advance(p, model, clock, *, seconds: float, steps: int, per_call: int = 10) -> None:
    calls = max(1, steps // per_call)
    for _ in range(calls):
        clock.t += seconds / calls
        model.num_timesteps += steps // calls
        p._on_step()


def test_first_seconds_then_the_estimate_after_the_second_rollout_then_lines_that_agree_with_it(monkeypatch, capsys):
    p, model, clock = _progress(monkeypatch, total=100_000, on_cpu=False)
    _advance(p, model, clock, seconds=9, steps=900)
    assert capsys.readouterr().out == ""  # nothing before 10 s
    _advance(p, model, clock, seconds=2, steps=200)
    out = capsys.readouterr().out
    assert "first 10 s: acting at 100 env-steps/s" in out and "at least" in out and "GPU" not in out
    # the first rollout ends at 2,000 steps after 20 s of acting and 80 s of compiling and training: it is not
    # what the run will take, so no estimate yet
    _advance(p, model, clock, seconds=9, steps=900)
    clock.t += 80
    p._on_rollout_start()
    assert capsys.readouterr().out == ""
    # the second rollout: 2,000 steps in 20 s of acting and 20 s of training, 50 env-steps/s
    _advance(p, model, clock, seconds=20, steps=2000)
    clock.t += 20
    p._on_rollout_start()
    out = capsys.readouterr().out
    assert "measured 50 env-steps/s over the second rollout and its update (the first, which compiles and warms " \
           "up, left out): about 32.0 min for the remaining 96,000 steps" in out
    # a log file gets one line every 30 s, with the time left at the estimate's rate (since the first rollout's
    # end) and the recent mean return, unscaled and as PPO saw it
    model.ep_info_buffer = [{"r": 10.0, "l": 10}, {"r": 20.0, "l": 20}]
    _advance(p, model, clock, seconds=30, steps=1500)
    model.ep_info_buffer = [{"r": 10.0, "r_scaled": 1e4, "l": 10}, {"r": 30.0, "r_scaled": 3e4, "l": 30}]
    _advance(p, model, clock, seconds=30, steps=1500)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["4,010/100,000 env steps (4%), 50 env-steps/s, 32.0 min left, return 15",
                     "5,510/100,000 env steps (6%), 50 env-steps/s, 31.5 min left, return 20 (scaled 2e+04)"]


def test_the_first_seconds_rate_leaves_the_first_step_out(monkeypatch, capsys):
    p, model, clock = _progress(monkeypatch, total=100_000, on_cpu=False)
    clock.t += 6  # the first step compiles the acting kernels
    model.num_timesteps += 10
    p._on_step()
    _advance(p, model, clock, seconds=8, steps=1600, per_call=100)
    assert "first 10 s: acting at 200 env-steps/s" in capsys.readouterr().out


def test_a_line_before_any_episode_ended_says_so(monkeypatch, capsys):
    p, model, clock = _progress(monkeypatch, total=1000, on_cpu=False)
    _advance(p, model, clock, seconds=30, steps=300)
    assert capsys.readouterr().out.strip().endswith("300/1,000 env steps (30%), 10 env-steps/s, 70 s left, "
                                                    "no episode ended yet")


def test_a_gpu_sized_run_on_a_cpu_says_so_with_a_smaller_command(monkeypatch, capsys):
    p, model, clock = _progress(monkeypatch, total=25_000_000, on_cpu=True)
    _advance(p, model, clock, seconds=11, steps=880)
    out = capsys.readouterr().out
    assert "acting at 80 env-steps/s" in out and "at least 86.8 h" in out
    assert "this config is sized for a GPU; a CPU-sized run: SMALLER" in out


def test_the_same_run_on_a_gpu_does_not(monkeypatch, capsys):
    p, model, clock = _progress(monkeypatch, total=25_000_000, on_cpu=False)
    _advance(p, model, clock, seconds=11, steps=880)
    assert "GPU" not in capsys.readouterr().out


def test_a_first_rollout_shorter_than_the_first_seconds_gives_the_estimate_alone(monkeypatch, capsys):
    p, model, clock = _progress(monkeypatch, total=10_000, on_cpu=True)
    _advance(p, model, clock, seconds=4, steps=1000)
    p._on_rollout_start()
    _advance(p, model, clock, seconds=8, steps=2000)
    p._on_rollout_start()
    out = capsys.readouterr().out
    assert "measured 250 env-steps/s over the second rollout" in out and "first 10 s" not in out and "GPU" not in out


def test_a_gpu_sized_run_on_a_cpu_whose_first_rollout_ends_within_the_first_seconds_still_gets_the_smaller_command(
        monkeypatch, capsys):
    p, model, clock = _progress(monkeypatch, total=25_000_000, on_cpu=True)
    _advance(p, model, clock, seconds=4, steps=16_384)  # --fast's 64 x 256 steps at 4,096 env-steps/s
    clock.t += 4  # its update
    p._on_rollout_start()
    out = capsys.readouterr().out
    assert "measured 2,048 env-steps/s over the first rollout and its update: about 3.4 h" in out
    assert "this config is sized for a GPU; a CPU-sized run: SMALLER" in out
    _advance(p, model, clock, seconds=30, steps=16_384)
    assert "GPU" not in capsys.readouterr().out  # said once
