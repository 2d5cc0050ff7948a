"""``python -m rlseq.bench memory``: statistics and report on synthetic result files with known numbers, the
grid and its skip / resume logic, a failed run's record, and one tiny POPGym slice end to end."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from rlseq.bench import memory as M
from rlseq.bench import memory_report as R
from rlseq.bench.__main__ import main as bench_main
from tests.helpers import START_LIMIT_S, wait_for

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T1, T2 = "popgym-RepeatPreviousEasy-v0", "popgym-RepeatFirstEasy-v0"


@pytest.fixture(autouse=True)
def _children_import_rlseq(monkeypatch):
    """Training processes and workers import rlseq from this checkout, whatever their working directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _runs(table: dict[tuple[str, str], list[float]]) -> pd.DataFrame:
    rows = [{"task": t, "variant": v, "seed": s, "eval_mean": x, "env_steps_per_s": 100.0 * (s + 1)}
            for (t, v), xs in table.items() for s, x in enumerate(xs)]
    return pd.DataFrame(rows)


# --- statistics ------------------------------------------------------------------------------------------


def test_the_iqm_of_known_numbers_and_a_ci_that_contains_it():
    s = R.summarize(_runs({(T1, "efla"): [0.1, 0.2, 0.3, 1.0], (T1, "gru"): [0.4, 0.5, 0.6], (T1, "none"): [0.7]}),
                    reps=500).set_index("variant")
    assert s.loc["efla", "iqm"] == pytest.approx(0.25)  # 4 seeds: the middle two, (0.2 + 0.3) / 2
    assert s.loc["gru", "iqm"] == pytest.approx(0.5)    # below 4 seeds nothing is trimmed: the mean
    for v in ("efla", "gru"):
        assert s.loc[v, "ci_low"] <= s.loc[v, "iqm"] <= s.loc[v, "ci_high"]
    assert 0.4 <= s.loc["gru", "ci_low"] and s.loc["gru", "ci_high"] <= 0.6
    assert s.loc["none", "n"] == 1 and math.isnan(s.loc["none", "ci_low"]) and s.loc["none", "iqm"] == 0.7
    again = R.summarize(_runs({(T1, "efla"): [0.1, 0.2, 0.3, 1.0]}), reps=500)
    assert again["ci_low"].iloc[0] == s.loc["efla", "ci_low"]  # seeded: the same CI every time


def test_the_verdicts_name_the_best_its_overlaps_and_what_is_at_or_below_none():
    summary = pd.DataFrame([
        {"task": T1, "variant": "efla", "n": 3, "iqm": 0.9, "ci_low": 0.8, "ci_high": 1.0},
        {"task": T1, "variant": "gru", "n": 3, "iqm": 0.7, "ci_low": 0.5, "ci_high": 0.85},
        {"task": T1, "variant": "lstm", "n": 3, "iqm": -0.3, "ci_low": -0.4, "ci_high": -0.2},
        {"task": T1, "variant": "none", "n": 3, "iqm": -0.3, "ci_low": -0.35, "ci_high": -0.25},
        {"task": T1, "variant": "sb3-lstm", "n": 1, "iqm": -0.5, "ci_low": math.nan, "ci_high": math.nan},
    ])
    v = R.verdicts(summary)[T1]
    assert v["best"] == "efla" and v["overlap"] == ["gru"]
    assert v["none_iqm"] == -0.3 and v["at_or_below_none"] == ["lstm", "sb3-lstm"]


def test_the_fair_block_checks_hold_rnns_to_the_anchors_and_efla_to_every_baseline():
    T3 = "popgym-CountRecallEasy-v0"

    def row(task, variant, n, iqm, lo, hi):
        return {"task": task, "variant": variant, "n": n, "iqm": iqm, "ci_low": lo, "ci_high": hi}

    summary = pd.DataFrame([
        row(T1, "efla", 5, 0.70, 0.60, 0.80), row(T1, "gru", 5, 0.85, 0.81, 0.90),
        row(T1, "lstm", 5, 0.20, 0.10, 0.30), row(T1, "sb3-lstm", 5, 0.50, 0.35, 0.62),
        row(T1, "sb3-lstm-shared", 1, 0.30, math.nan, math.nan), row(T1, "none", 5, -0.5, -0.6, -0.4),
        # T2: no anchor yet; EFLA's CI reaches DeltaNet's, the strongest there, by the smallest margin
        row(T2, "efla", 5, 0.40, 0.30, 0.50), row(T2, "deltanet", 5, 0.60, 0.50, 0.70),
        row(T2, "gru", 5, 0.55, 0.45, 0.65), row(T2, "efla-conv1", 5, 0.90, 0.85, 0.95),
        # T3: the GRU has the highest IQM, but the LSTM's CI lies higher, and EFLA's wholly below the LSTM's
        row(T3, "efla", 5, 0.55, 0.50, 0.60), row(T3, "gru", 5, 0.80, 0.30, 0.95),
        row(T3, "lstm", 5, 0.79, 0.78, 0.80),
    ])
    checks = R.fair_block_checks(summary)
    by = {(r.task, r.check, r.subject, r.against): r for r in checks.itertuples()}
    assert set(by) == {(T1, "anchor", "gru", "sb3-lstm"), (T1, "anchor", "gru", "sb3-lstm-shared"),
                       (T1, "anchor", "lstm", "sb3-lstm"), (T1, "anchor", "lstm", "sb3-lstm-shared"),
                       (T1, "reference", "efla", "gru"), (T2, "reference", "efla", "deltanet"),
                       (T3, "reference", "efla", "lstm")}
    assert by[T1, "anchor", "gru", "sb3-lstm"].holds
    assert not by[T1, "anchor", "lstm", "sb3-lstm"].holds                 # 0.30 < 0.35
    assert by[T1, "anchor", "lstm", "sb3-lstm"].gap == pytest.approx(0.05)
    assert by[T1, "anchor", "lstm", "sb3-lstm-shared"].holds              # one seed: a point, 0.30 <= 0.30
    assert not by[T1, "reference", "efla", "gru"].holds                   # 0.80 < 0.81
    assert by[T2, "reference", "efla", "deltanet"].holds                  # 0.50 >= 0.50; controls are no rivals
    assert not by[T3, "reference", "efla", "lstm"].holds                  # 0.60 < 0.78, though 0.60 >= the GRU's 0.30
    section = "\n".join(R._fair_block_section(summary, [T1, T2, T3]))
    assert f"Below an anchor: {R.short_task(T1)} (lstm vs sb3-lstm)." in section
    assert f"efla below a baseline: {R.short_task(T1)} (efla vs gru), {R.short_task(T3)} (efla vs lstm)." in section
    assert R.short_task(T3) not in "\n".join(R._fair_block_section(summary, [T1, T2]))  # the report's tasks only
    assert R._fair_block_section(summary[summary["variant"] == "none"], [T1]) == []


def test_speeds_are_medians_over_runs():
    per_task, overall = R.speeds(_runs({(T1, "efla"): [0, 0, 0], (T2, "efla"): [0], (T1, "none"): [0, 0]}))
    assert per_task.loc[T1, "efla"] == 200.0 and per_task.loc[T2, "efla"] == 100.0
    assert overall["efla"] == 150.0 and overall["none"] == 150.0


# --- the report from result files ------------------------------------------------------------------------


def _result(out: Path, task: str, variant: str, seed: int, mean: float, steps: int = 1000) -> None:
    paths = R.run_paths(out, task, variant, seed)
    paths["result"].parent.mkdir(parents=True, exist_ok=True)
    doc = {"name": f"{task}/{variant}/seed{seed}", "task": task, "variant": variant, "seed": seed, "steps": steps,
           "episodes": 8, "eval_mean": mean, "eval_std": 0.1, "env_steps_per_s": 1000.0 + seed, "train_wall_s": 5.0,
           "eval_wall_s": 1.0, "config": {"algo": "rlseq", "n_envs": 4},
           "versions": {"python": "3.x", "torch": "2.x", "rlseq": "abc"}}
    paths["result"].write_text(json.dumps(doc))
    steps_axis = np.arange(0, steps + 1, 250)
    pd.DataFrame({"step": steps_axis, "ep_rew_mean": mean * steps_axis / steps}).to_csv(paths["curve"], index=False)


def _synthetic(out: Path) -> None:
    """T1: efla 0.8/0.9, none -0.5/-0.4, sb3-lstm 0.1/0.2; T2: efla seed 1 never ran, sb3-lstm seed 1 failed."""
    grid = {"tasks": [T1, T2], "variants": ["efla", "none", "sb3-lstm"], "seeds": [0, 1], "steps": {T1: 1000, T2: 1000},
            "episodes": 8}
    out.mkdir(parents=True)
    (out / R.MANIFEST).write_text(json.dumps({"invocations": [
        {"command": "python -m rlseq.bench memory --quick", "started": "2030-01-01 00:00", "jobs": 2, "cpu": "CPU X",
         "cores": 2, "wall_s": 600.0, "runs": 12, "grid": grid}]}))
    for seed in (0, 1):
        for variant, base in (("efla", 0.8), ("none", -0.5), ("sb3-lstm", 0.1)):
            _result(out, T1, variant, seed, base + 0.1 * seed)
    for variant in ("efla", "none", "sb3-lstm"):
        _result(out, T2, variant, 0, 0.5)
    _result(out, T2, "none", 1, 0.5)
    failed = R.run_paths(out, T2, "sb3-lstm", 1)["failed"]
    failed.write_text(json.dumps({"name": f"{T2}/sb3-lstm/seed1", "task": T2, "variant": "sb3-lstm", "seed": 1,
                                  "reason": "training exited with code 1",
                                  "log_tail": ["Traceback", "ValueError: nan"]}))
    R.random_path(out, T1).write_text(json.dumps({"task": T1, "mean": -0.5, "episodes": 8}))


def _few_resamples(monkeypatch) -> None:
    """The report's bootstrap CIs with 100 resamples instead of 2000 (write_report's default, which
    ``--report-only`` uses too): the same code; the two-seed CIs checked below are each the range of the seeds."""
    monkeypatch.setitem(R.write_report.__kwdefaults__, "reps", 100)


def test_the_report_names_the_variants_of_each_ppo_setting(tmp_path, monkeypatch):
    """Variants trained with other PPO settings (another algo, a memory's own learning rate) are each named
    under their setting."""
    _few_resamples(monkeypatch)
    out = tmp_path / "memory_benchmark"
    _synthetic(out)
    for path in (out / "results").rglob("*.json"):
        doc = json.loads(path.read_text())
        if doc.get("variant") == "sb3-lstm":
            doc["config"] = {"algo": "sb3-recurrent-ppo", "n_envs": 4}
        elif doc.get("variant") == "efla":
            doc["config"] = {"algo": "rlseq", "n_envs": 4, "learning_rate": 2.5e-4}
        path.write_text(json.dumps(doc))
    text = R.write_report(out).read_text()
    assert "PPO (none): algo rlseq, n_envs 4." in text
    assert "PPO (efla): algo rlseq, n_envs 4, learning_rate 0.00025." in text
    assert "PPO (sb3-lstm): algo sb3-recurrent-ppo, n_envs 4." in text


def test_the_report_from_synthetic_result_files(tmp_path, monkeypatch):
    _few_resamples(monkeypatch)
    out = tmp_path / "memory_benchmark"
    _synthetic(out)
    path = R.write_report(out)
    assert path == tmp_path / "memory_benchmark.md"
    text = path.read_text()
    assert "(rliable, 100 resamples" in text  # the command line below reads the same default
    assert (out / R.CURVES_PNG).read_bytes()[:8] == PNG_MAGIC
    assert "![learning curves](memory_benchmark/curves.png)" in text
    assert "| task | random | efla | none | sb3-lstm |" in text
    assert "| RepeatPreviousEasy | -0.50 | 0.85 [0.80, 0.90] | -0.45 [-0.50, -0.40] | 0.15 [0.10, 0.20] |" in text
    assert "| RepeatFirstEasy | n/a | 0.50 (n=1) | 0.50 [0.50, 0.50] | 0.50 (n=1) |" in text
    assert "- **RepeatPreviousEasy**: best efla (0.85); CI overlaps the best: no other; at or below none (-0.45): " \
           "no variant." in text
    assert "- **RepeatFirstEasy**: best efla (0.50); CI overlaps the best: none, sb3-lstm; at or below none " \
           "(0.50): efla, sb3-lstm." in text
    assert f"- {T2}/sb3-lstm/seed1: training exited with code 1 — `ValueError: nan`" in text
    assert "## Not run yet" in text and f"- **{R.short_task(T2)}**: efla seed 1" in text
    assert "| RepeatPreviousEasy | 1,000 | 1,000 | 1,000 |" in text  # speeds: median of 1000 and 1001
    assert "python -m rlseq.bench memory --quick" in text and "Total wall time: 10.0 min" in text
    assert "Versions: python 3.x, torch 2.x, rlseq abc." in text
    assert "PPO: algo rlseq, n_envs 4." in text  # one setting for every variant: no variants named
    # the command line regenerates the same report from the files alone
    path.unlink()
    bench_main(["memory", "--report-only", "--out", str(out)])
    assert path.read_text().replace(str(out), "OUT") == text.replace(str(out), "OUT")


def test_greedy_returns_get_their_own_table_from_the_results_that_have_them(tmp_path, monkeypatch):
    _few_resamples(monkeypatch)
    out = tmp_path / "memory_benchmark"
    _synthetic(out)
    assert "greedy actions" not in R.write_report(out).read_text()  # results made before greedy was recorded
    for seed, greedy in ((0, 1.0), (1, 0.9)):
        path = R.run_paths(out, T1, "efla", seed)["result"]
        path.write_text(json.dumps({**json.loads(path.read_text()), "eval_greedy_mean": greedy}))
    text = R.write_report(out).read_text()
    section = text.split("## Final evaluation return, greedy actions")[1].split("\n## ")[0]
    assert "2 of 10 results have it" in section
    assert "new episodes (sampled actions, env seeds unlike training; the same again with greedy actions)" in text
    assert "| RepeatPreviousEasy | -0.50 | 0.95 [0.90, 1.00] | – | – |" in section
    assert R.short_task(T2) not in section
    # the headline table keeps the sampled returns
    assert "| RepeatPreviousEasy | -0.50 | 0.85 [0.80, 0.90] |" in text.split("## Final evaluation return, greedy")[0]


def test_speeds_get_a_table_per_machine_and_a_warning_where_results_do_not_name_theirs(tmp_path, monkeypatch):
    _few_resamples(monkeypatch)
    out = tmp_path / "memory_benchmark"
    _synthetic(out)  # results without a cpu, one invocation on "CPU X"
    speed = R.write_report(out).read_text().split("## Training speed")[1].split("\n## ")[0]
    assert "| RepeatPreviousEasy |" in speed and "### " not in speed  # one table: one machine named
    manifest = R.read_manifest(out)
    manifest["invocations"].append({**manifest["invocations"][0], "cpu": "CPU Y", "started": "2030-01-02 00:00"})
    (out / R.MANIFEST).write_text(json.dumps(manifest))
    speed = R.write_report(out).read_text().split("## Training speed")[1]
    assert "The invocations ran on 2 machines (CPU X, CPU Y) and these results do not record which made them" in speed
    for variant, cpu in (("efla", "CPU X"), ("none", "CPU Y")):  # sb3-lstm's results stay unrecorded
        for path in (out / "results").rglob(f"{variant}/seed*.json"):
            if not path.name.endswith(".failed.json"):
                doc = json.loads(path.read_text())
                path.write_text(json.dumps({**doc, "cpu": cpu, "env_steps_per_s": 10.0 if cpu == "CPU X" else 20.0}))
    speed = R.write_report(out).read_text().split("## Training speed")[1].split("## Learning curves")[0]
    assert "do not record" not in speed
    x, rest = speed.split("### CPU X")[1].split("### CPU Y")
    y, unrecorded = rest.split("### Machine not recorded")
    assert "| task | efla |" in x and "| RepeatPreviousEasy | 10 |" in x
    assert "| task | none |" in y and "| RepeatFirstEasy | 20 |" in y
    assert "| task | sb3-lstm |" in unrecorded and "| RepeatPreviousEasy | 1,000 |" in unrecorded


def test_hand_written_notes_are_appended_and_the_terminal_table_matches_the_report(tmp_path):
    out = tmp_path / "memory_benchmark"
    _synthetic(out)
    (out / R.NOTES).write_text("## Reading the table\n\nEFLA is below the anchor on T2 because ...\n")
    text = R.write_report(out, reps=100).read_text()  # what is checked here does not depend on the resamples
    assert text.rstrip().endswith("## Reading the table\n\nEFLA is below the anchor on T2 because ...")
    table = R.returns_table(out, reps=100)
    assert table.splitlines()[0] == "| task | random | efla | none | sb3-lstm |"
    assert table in text


def test_report_only_without_results_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit, match="run the benchmark first"):
        bench_main(["memory", "--report-only", "--out", str(tmp_path / "empty")])


# --- the grid, skip and resume ---------------------------------------------------------------------------


def test_the_grid_is_seed_major_and_trains_the_anchor_with_sb3_contrib():
    assert M.variants()[-3:] == ["sb3-lstm", "sb3-lstm-shared", "sb3-efla"]
    assert {"efla", "deltanet", "gru", "lstm", "none", "none-conv1", "efla-conv1"} <= set(M.variants())
    runs = M.build_grid([T1, T2], ["efla", "sb3-lstm"], [0, 1], {T1: 100, T2: 200})
    assert [(r.seed, r.task, r.variant) for r in runs] == [
        (s, t, v) for s in (0, 1) for t in (T1, T2) for v in ("efla", "sb3-lstm")]
    anchor = runs[1]
    assert anchor.folder("logs") == Path("logs") / T1 / "sb3-lstm" / "seed0"
    argv = anchor.train_argv("logs", device="cpu", extra=["--n-envs", "4"])
    assert argv[:6] == ["--env", T1, "--memory", "lstm", "--algo", "sb3-recurrent-ppo"]
    assert argv[-3:] == ["--n-envs", "4", "--resume"]
    assert runs[2].steps == 200 and runs[0].folder("logs") == Path("logs") / T1 / "efla" / "seed0"
    # every argv is one the training CLI takes
    from rlseq.train import build_parser, resolve

    cfg = resolve(build_parser().parse_args(argv))
    assert cfg["algo"] == "sb3-recurrent-ppo" and cfg["n_timesteps"] == 100 and cfg["n_envs"] == 4
    # the drop-in row: rlseq's EFLA block inside sb3-contrib's RecurrentPPO, in its own folder
    drop_in = M.BenchRun(T1, "sb3-efla", 0, 100)
    assert drop_in.folder("logs") == Path("logs") / T1 / "sb3-efla" / "seed0"
    cfg = resolve(build_parser().parse_args(drop_in.train_argv("logs", device="cpu")))
    assert cfg["algo"] == "sb3-recurrent-ppo" and cfg["memory"] == "efla" and "policy_kwargs" not in cfg


def test_the_window_controls_and_the_shared_anchor_are_flags_the_training_cli_takes():
    """``<memory>-conv1`` trains the same memory with conv_size 1 in its own folder; ``sb3-lstm-shared`` is
    sb3-contrib's LSTM with one LSTM for actor and critic."""
    from rlseq.train import build_parser, resolve

    control, shared = M.BenchRun(T1, "none-conv1", 0, 100), M.BenchRun(T1, "sb3-lstm-shared", 0, 100)
    assert control.folder("logs") == Path("logs") / T1 / "none-conv1" / "seed0"
    assert shared.folder("logs") == Path("logs") / T1 / "sb3-lstm-shared" / "seed0"
    cfg = resolve(build_parser().parse_args(control.train_argv("logs", device="cpu")))
    assert cfg["memory"] == "none" and cfg["memory_kwargs"] == {"conv_size": 1} and cfg["tag"] == "conv1"
    cfg = resolve(build_parser().parse_args(shared.train_argv("logs", device="cpu")))
    assert cfg["algo"] == "sb3-recurrent-ppo" and cfg["policy_kwargs"]["shared_lstm"] is True
    assert cfg["policy_kwargs"]["enable_critic_lstm"] is False
    from rlseq.config import UsageError

    with pytest.raises(UsageError, match="--shared-lstm is an option of sb3-contrib's own LSTM"):
        resolve(build_parser().parse_args(["--env", T1, "--memory", "efla", "--shared-lstm"]))
    with pytest.raises(UsageError, match="--conv-size sets rlseq's block"):
        resolve(build_parser().parse_args(["--env", T1, "--memory", "lstm", "--algo", "sb3-recurrent-ppo",
                                           "--conv-size", "1"]))


def test_an_ablation_config_reaches_every_run(tmp_path, capsys):
    """``--config`` hands a partial training config to every run (the training CLI merges it over
    configs/popgym.yml); a missing file is refused before anything runs."""
    from rlseq.train import build_parser, resolve

    cfg_file = tmp_path / "ablation.yml"
    cfg_file.write_text("popgym:\n  learning_rate: 1.0e-3\n  memory_kwargs: {gru: {join: read}}\n")
    common = ["memory", "--dry-run", "--tasks", T1, "--variants", "gru", "--seeds", "0", "--steps", "1000",
              "--out", str(tmp_path / "out"), "--logdir", str(tmp_path / "runs")]
    bench_main([*common, "--config", str(cfg_file)])
    line = next(x for x in capsys.readouterr().out.splitlines() if "rlseq.train" in x)
    argv = line.split("python -m rlseq.train ")[1].split()
    assert argv[argv.index("--config") + 1] == str(cfg_file.resolve())
    cfg = resolve(build_parser().parse_args(argv))
    assert cfg["learning_rate"] == 1e-3 and cfg["memory_kwargs"] == {"join": "read"}
    assert cfg["n_envs"] == 8  # the rest stays configs/popgym.yml's
    with pytest.raises(SystemExit, match="no such file"):
        bench_main([*common, "--config", str(tmp_path / "missing.yml")])


def test_the_readme_describes_the_grid_the_code_runs():
    """The README's numbers of the full grid (tasks, variants, seeds, budgets, episodes) are the code's."""
    import re

    text = " ".join((REPO / "README.md").read_text().split())
    tasks, variants, seeds = map(int, re.search(r"the full grid: (\d+) tasks x (\d+) variants x (\d+) seeds",
                                                text).groups())
    assert (tasks, variants, seeds) == (len(M.TASKS), len(M.DEFAULT_VARIANTS), len(M.SEEDS))
    assert f"with PPO on {len(M.TASKS)} tasks" in text and f"{len(M.SEEDS)} seeds." in text
    lags = ", ".join(t.split("Lag")[1].split("-")[0] for t in M.HORIZON_TASKS)
    assert lags.rsplit(", ", 1)[0] + " and " + lags.rsplit(", ", 1)[1] + " steps back" in text
    assert {M.TASK_STEPS[t] for t in (*M.HORIZON_TASKS[2:], *M.LONG_TASKS)} == {500_000}
    assert {M.TASK_STEPS[t] for t in M.HORIZON_TASKS[:2]} == {200_000} and M.DEFAULT_STEPS == 100_000
    assert M.HORIZON_TASKS[2] == "rlseq/RepeatPreviousLag4-v0"
    assert ("500k env steps a run on the lags from 4 on and the Medium tasks, 200k on lags 1 and 2 (inside the "
            "window), 100k on the Easy ones") in text
    assert len(M.EASY_TASKS) == 10 and "POPGym's ten Easy tasks" in text
    assert f"plays {M.EPISODES} new episodes" in text
    for variant in M.DEFAULT_VARIANTS:
        assert f"`{variant}`" in text, variant


def test_the_default_grid_writes_to_runs_not_to_the_published_results():
    """A user's ``bench memory`` (no --out) never meets the committed results in docs/memory_benchmark: it would
    find them done, or refuse them as another commit's."""
    import argparse

    parser = argparse.ArgumentParser()
    M.add_arguments(parser)
    g = M.resolve_grid(parser.parse_args([]))
    assert g["out"] == Path("runs/memory_benchmark") and g["logdir"] == Path("runs/memory_benchmark")
    assert M.resolve_grid(parser.parse_args(["--quick"]))["out"] == Path(M.QUICK_OUT)
    assert M.resolve_grid(parser.parse_args(["--out", "docs/memory_benchmark"]))["out"] == Path("docs/memory_benchmark")


def test_results_of_another_commit_are_refused(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _result(out, T1, "efla", 0, 0.5)  # made at "abc" (see _result)
    runs = M.build_grid([T1, T2], ["efla", "none"], [0, 1], {T1: 1000, T2: 1000})
    assert M.commit_conflicts(runs, out, "abc") == []
    bad = M.commit_conflicts(runs, out, "def")
    assert len(bad) == 1 and "made at abc" in bad[0]
    assert M.commit_conflicts(M.build_grid([T2], ["efla"], [0], {T2: 1000}), out, "def") == []  # other tasks: fine
    monkeypatch.setattr(M, "versions", lambda: {"rlseq": "def"})
    with pytest.raises(SystemExit, match="another rlseq commit than this one \\(def\\)"):
        bench_main(["memory", "--tasks", T1, "--variants", "efla", "--seeds", "0", "--steps", "1000", "--out",
                    str(out), "--logdir", str(tmp_path / "runs")])


def test_runs_with_other_settings_than_a_variant_s_results_are_refused(tmp_path):
    """An ablation (--config) or other PPO flags for a variant whose results in --out were made with the defaults:
    refused, as another budget is; the same command again, other variants and tasks, results that record no
    settings and failed runs are not."""
    out = tmp_path / "out"
    run = M.BenchRun(T1, "efla", 0, 1000)
    _result(out, T1, "efla", 0, 0.5)
    path = R.run_paths(out, T1, "efla", 0)["result"]
    path.write_text(json.dumps({**json.loads(path.read_text()), "settings": M.planned_settings(run, [])}))
    _result(out, T1, "none", 0, 0.5)  # recorded before results had settings: never compared
    _failure(out, T2, "efla", 0)
    ablation = tmp_path / "gated.yml"
    ablation.write_text("popgym:\n  memory_kwargs: {efla: {join: gated}}\n")
    _invocation(out, "2030-01-01 00:00", "CPU A")  # an ablation stopped before it finished a run: not compared
    manifest = R.read_manifest(out)
    manifest["invocations"][0]["config"] = ablation.read_text()
    (out / R.MANIFEST).write_text(json.dumps(manifest))
    base = ["memory", "--seeds", "0", "--steps", "1000", "--out", str(out), "--logdir", str(tmp_path / "runs"),
            "--dry-run"]
    for flags in (["--config", str(ablation)], ["--n-envs", "4"]):
        with pytest.raises(SystemExit, match=f"other training settings .* for 1 task and variant pair.*\\n  "
                                             f"{T1}/efla: results made with settings [0-9a-f]{{12}} .*; these runs: "
                                             f"[0-9a-f]{{12}}$"):
            bench_main([*base, "--tasks", T1, "--variants", "efla", "none", *flags])
        bench_main([*base, "--tasks", T1, "--variants", "none", "gru", *flags])  # no settings recorded / no results
        bench_main([*base, "--tasks", T2, "--variants", "efla", *flags])  # a failure record alone
    bench_main([*base, "--tasks", T1, "--variants", "efla"])  # the same settings as its result: fine
    assert M.planned_settings(run, ["--n-envs", "8"]) == M.planned_settings(run, [])  # popgym.yml's n_envs: the same
    # an unreadable result stops each check before anything runs, and the report, with an error that names it
    other = R.run_paths(out, T2, "efla", 1)["result"]  # no run of the grid below: only the settings check reads it
    other.write_text("{")
    with pytest.raises(SystemExit, match=_unreadable(other, "result file", "nothing was run")):
        bench_main([*base, "--tasks", T1, "--variants", "efla"])
    other.unlink()
    good = path.read_text()
    path.write_text("{")  # the grid's own run: the budget check reads it first
    with pytest.raises(SystemExit, match=_unreadable(path, "result file", "nothing was run")):
        bench_main([*base, "--tasks", T1, "--variants", "efla"])
    with pytest.raises(SystemExit, match=_unreadable(path, "result file", "nothing was run")):
        M.commit_conflicts([run], out, "abc")
    with pytest.raises(SystemExit, match=_unreadable(path, "result file", "no report was written")):
        R.load_results(out)
    path.write_text(good)
    (out / R.MANIFEST).write_text("[")
    with pytest.raises(SystemExit, match=_unreadable(out / R.MANIFEST, "benchmark manifest", "nothing was changed")):
        R.read_manifest(out)


def _unreadable(path: Path, what: str, stopped: str) -> str:
    """The error of an unreadable JSON file, as a pattern."""
    return re.escape(f"error: {path} is not a readable {what} (") + f".*\\); {re.escape(stopped)}$"


def _invocation(out: Path, started: str, cpu: str, wall_s: float | None = 60.0) -> None:
    manifest = R.read_manifest(out)
    manifest["invocations"].append({"command": "python -m rlseq.bench memory --tasks T", "started": started,
                                    "jobs": 2, "cpu": cpu, "cores": 2, "wall_s": wall_s, "runs": 4,
                                    "grid": {"tasks": [T1, T2], "variants": ["efla", "none"], "seeds": [0, 1],
                                             "steps": {T1: 1000, T2: 1000}, "episodes": 8}})
    out.mkdir(parents=True, exist_ok=True)
    (out / R.MANIFEST).write_text(json.dumps(manifest))


def _failure(out: Path, task: str, variant: str, seed: int) -> Path:
    path = R.run_paths(out, task, variant, seed)["failed"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": f"{task}/{variant}/seed{seed}", "task": task, "variant": variant,
                                "seed": seed, "reason": "training exited with code 2", "log_tail": []}))
    return path


def test_another_machines_runs_merge_in_and_runs_already_there_keep_their_result(tmp_path, monkeypatch, capsys):
    _few_resamples(monkeypatch)
    out, other, third = tmp_path / "memory_benchmark", tmp_path / "other", tmp_path / "third"
    _invocation(out, "2030-01-01 00:00", "CPU A", wall_s=None)  # still running when other copied it
    _result(out, T1, "efla", 0, 0.9)
    failed_here = _failure(out, T1, "none", 0)
    R.random_path(out, T1).write_text(json.dumps({"task": T1, "mean": -0.51, "episodes": 8}))
    _invocation(other, "2030-01-01 00:00", "CPU A", wall_s=3600.0)
    _invocation(other, "2030-01-01 00:05", "CPU B")
    _result(other, T1, "efla", 0, -0.3)  # made twice: out's stays
    _result(other, T1, "none", 0, -0.5)  # failed in out, finished there
    _result(other, T2, "efla", 1, 0.7)
    _failure(other, T2, "none", 1)  # a failure elsewhere is not merged
    R.random_path(other, T1).write_text(json.dumps({"task": T1, "mean": -0.4, "episodes": 8}))
    R.random_path(other, T2).write_text(json.dumps({"task": T2, "mean": -0.49, "episodes": 8}))
    _result(third, T2, "efla", 1, 0.7)  # the same run with the same result in a second source: one run
    bench_main(["memory", "--merge", str(other), str(third), "--out", str(out)])
    said = capsys.readouterr().out
    assert "merged 2 run(s) into" in said and ", and 1 invocation(s) (1 more completed)" in said
    assert "1 run(s) already there kept their result" in said
    assert f"note: {third} has no benchmark.json" in said
    assert json.loads(R.run_paths(out, T1, "efla", 0)["result"].read_text())["eval_mean"] == 0.9
    assert json.loads(R.run_paths(out, T1, "none", 0)["result"].read_text())["eval_mean"] == -0.5
    assert not failed_here.exists()
    curve = R.run_paths(other, T2, "efla", 1)["curve"].read_text()
    assert R.run_paths(out, T2, "efla", 1)["curve"].read_text() == curve
    assert not R.run_paths(out, T2, "none", 1)["failed"].exists()
    assert json.loads(R.random_path(out, T1).read_text())["mean"] == -0.51  # out's own stays
    assert json.loads(R.random_path(out, T2).read_text())["mean"] == -0.49
    invocations = R.read_manifest(out)["invocations"]
    assert [(inv["cpu"], inv["wall_s"]) for inv in invocations] == [("CPU A", 3600.0), ("CPU B", 60.0)]
    report = R.report_path(out).read_text()
    assert "| RepeatFirstEasy |" in report and "Total wall time: 61.0 min" in report
    before = (out / R.MANIFEST).read_text()
    R.report_path(out).unlink()
    bench_main(["memory", "--merge", str(other), "--out", str(out)])  # again: nothing new, nothing rewritten
    assert "merged 0 run(s) into" in capsys.readouterr().out
    assert (out / R.MANIFEST).read_text() == before and not R.report_path(out).exists()


@pytest.mark.parametrize("what", ["commit", "steps", "invocation", "settings"])
def test_a_merge_that_would_mix_commits_or_budgets_in_a_task_writes_nothing(tmp_path, what):
    out, other = tmp_path / "out", tmp_path / "other"
    _result(out, T1, "efla", 0, 0.9)
    _result(other, T2, "efla", 0, 0.5)  # another task: no conflict of its own
    _result(other, T1, "none", 0, -0.5, steps=2000 if what == "steps" else 1000)
    if what == "commit":
        path = R.run_paths(other, T1, "none", 0)["result"]
        doc = json.loads(path.read_text())
        doc["versions"]["rlseq"] = "def"
        path.write_text(json.dumps(doc))
    if what == "invocation":  # a smoke run at another budget that finished nothing
        _invocation(other, "2030-01-01 00:05", "CPU B")
        manifest = R.read_manifest(other)
        manifest["invocations"][0]["grid"]["steps"][T1] = 5000
        (other / R.MANIFEST).write_text(json.dumps(manifest))
    if what == "settings":  # an ablation's seed of T1's efla into the defaults' results; its none is another
        for folder, seed, digest in ((out, 0, "aaaaaaaaaaaa"), (other, 1, "bbbbbbbbbbbb")):  # variant: no conflict
            if folder == other:
                _result(folder, T1, "efla", seed, 0.5)
            path = R.run_paths(folder, T1, "efla", seed)["result"]
            path.write_text(json.dumps({**json.loads(path.read_text()), "settings": digest}))
        path = R.run_paths(other, T1, "none", 0)["result"]
        path.write_text(json.dumps({**json.loads(path.read_text()), "settings": "cccccccccccc"}))
    expected = {"commit": "commits abc .*, def", "steps": "budgets 1000 .*, 2000",
                "invocation": "budgets 1000 .*, 5000 .*started 2030-01-01 00:05",
                "settings": "settings aaaaaaaaaaaa .*, bbbbbbbbbbbb "}[what]
    where = f"{T1}/efla" if what == "settings" else T1
    with pytest.raises(SystemExit, match=f"would mix rlseq commits, env-step budgets or training settings in 1 "
                                         f"task.*\\n  {where}: {expected}"):
        bench_main(["memory", "--merge", str(other), "--out", str(out)])
    assert sorted(p.name for p in (out / "results").rglob("*.json")) == ["seed0.json"]
    assert not (out / R.MANIFEST).exists()


def test_a_merge_refuses_what_it_cannot_merge_and_writes_nothing(tmp_path):
    out, other, third = tmp_path / "out", tmp_path / "other", tmp_path / "third"
    _result(out, T1, "efla", 0, 0.9)
    _result(other, T2, "efla", 0, 0.5)
    _result(third, T2, "efla", 0, 0.4)
    with pytest.raises(SystemExit, match="no results folder there"):
        bench_main(["memory", "--merge", str(other), str(tmp_path / "nowhere"), "--out", str(out)])
    with pytest.raises(SystemExit, match="is --out itself"):
        bench_main(["memory", "--merge", str(tmp_path / "." / "out"), "--out", str(out)])
    with pytest.raises(SystemExit, match=f"1 run\\(s\\) have different results in two of the folders.*\\n  "
                                         f"{T2}/efla/seed0: "):
        bench_main(["memory", "--merge", str(other), str(third), "--out", str(out)])
    with pytest.raises(SystemExit, match="--merge takes the folders to merge and --out alone, not --seeds, --dry-run"):
        bench_main(["memory", "--merge", str(other), "--out", str(out), "--seeds", "0", "--dry-run"])
    R.run_paths(third, T2, "efla", 0)["result"].write_text("{\"task\": ")  # cut short
    with pytest.raises(SystemExit, match=_unreadable(R.run_paths(third, T2, "efla", 0)["result"], "result file",
                                                     "nothing was merged")):
        bench_main(["memory", "--merge", str(third), "--out", str(out)])
    R.random_path(other, T2).write_text("{")  # read before any result is written
    with pytest.raises(SystemExit, match=_unreadable(R.random_path(other, T2), "chance-level file",
                                                     "nothing was merged")):
        bench_main(["memory", "--merge", str(other), "--out", str(out)])
    assert [p.name for p in (out / "results").rglob("*.json")] == ["seed0.json"]


def test_run_folders_begun_at_another_commit_are_refused(tmp_path, monkeypatch):
    """An interrupted or not yet evaluated run folder trained by other code is not resumed under this commit."""
    out, logdir = tmp_path / "out", tmp_path / "runs"
    run, fresh = M.build_grid([T1], ["none", "efla"], [0], {T1: 1000})
    folder = run.folder(logdir)
    (folder / "checkpoints").mkdir(parents=True)
    assert M.folder_conflicts([run, fresh], logdir, "abc") == [f"{folder}: started at a commit not recorded"]
    M.commit_marker(folder).write_text("abc\n")
    assert M.folder_conflicts([run, fresh], logdir, "abc") == []
    assert M.folder_conflicts([run, fresh], logdir, "def") == [f"{folder}: started at abc"]
    monkeypatch.setattr(M, "versions", lambda: {"rlseq": "def"})
    with pytest.raises(SystemExit, match=r"1 run folder\(s\) began training at another rlseq commit than this one "
                                         r"\(def\).*\n  .*seed0: started at abc"):
        bench_main(["memory", "--tasks", T1, "--variants", "none", "efla", "--seeds", "0", "--steps", "1000",
                    "--out", str(out), "--logdir", str(logdir)])
    assert not fresh.folder(logdir).exists() and not (out / "results").exists()


def test_results_whose_code_has_changed_since_are_flagged(tmp_path):
    """The report names the files behind a result that differ in the checkout, so an old table is not read as
    today's code; other files, unknown commits and folders without git say nothing."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    (tmp_path / "rlseq" / "policies").mkdir(parents=True)
    (tmp_path / "rlseq" / "policies" / "memory.py").write_text("hidden = 96\n")
    (tmp_path / "README.md").write_text("a\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "first")
    first = git("rev-parse", "--short=12", "HEAD")
    assert R.changed_since([first, "unknown"], tmp_path) == {}
    (tmp_path / "README.md").write_text("b\n")  # not code a result depends on
    assert R.changed_since([first], tmp_path) == {}
    (tmp_path / "rlseq" / "policies" / "memory.py").write_text("hidden = 256\n")
    assert R.changed_since([first + "+dirty"], tmp_path) == {first + "+dirty": ["rlseq/policies/memory.py"]}
    assert R.changed_since([first], tmp_path / "rlseq" / "nowhere") == {}


def test_probability_of_improvement_and_budget_check_on_synthetic_data():
    rows = [{"task": "A", "variant": "efla", "seed": s, "eval_mean": 1.0 + s} for s in range(5)]
    rows += [{"task": "A", "variant": "gru", "seed": s, "eval_mean": 0.0 + s} for s in range(5)]
    rows += [{"task": "A", "variant": "none", "seed": s, "eval_mean": 10.0} for s in range(5)]
    poi = R.probability_of_improvement(pd.DataFrame(rows), reps=200).set_index("variant")
    # efla beats gru in 15 of 25 pairs and ties 4 (counted half): (15 + 2) / 25
    assert poi.loc["gru", "poi"] == pytest.approx(17 / 25) and poi.loc["none", "poi"] == 0.0
    assert poi.loc["gru", "ci_low"] <= poi.loc["gru", "poi"] <= poi.loc["gru", "ci_high"]
    assert poi.loc["none", "ci_high"] == 0.0 and set(poi["n"]) == {5}
    steps = np.arange(0, 1001, 50)
    curves = pd.concat([
        pd.DataFrame({"task": "A", "variant": "efla", "seed": 0, "step": steps, "value": steps / 1000}),  # rising
        pd.DataFrame({"task": "A", "variant": "gru", "seed": 0, "step": steps, "value": np.minimum(steps, 500) / 500}),
    ])
    summary = pd.DataFrame({"task": ["A", "A"], "variant": ["efla", "gru"], "iqm": [1.0, 0.9]})
    check = R.budget_check(curves, summary).set_index("variant")
    assert check.loc["efla", "gain"] == pytest.approx(0.2, abs=0.01) and not check.loc["efla", "flat"]
    assert check.loc["gru", "gain"] == pytest.approx(0.0) and check.loc["gru", "flat"]


def test_the_horizon_figure_gives_every_variant_its_own_colour_and_marker(tmp_path, monkeypatch):
    """Past ten variants matplotlib's colour cycle repeats; each row of the grid must still be told apart, and
    from the chance line."""
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure

    variants = M.variants()
    assert len(variants) > 10
    summary = pd.DataFrame({"task": "rlseq/RepeatPreviousLag8-v0", "variant": variants, "n": 5,
                            "iqm": np.linspace(-0.5, 1.0, len(variants)), "ci_low": -0.5, "ci_high": 1.0})
    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))[1])
    chance = {"rlseq/RepeatPreviousLag8-v0": {"mean": -0.5}}
    assert R.plot_horizon(summary, tmp_path / "horizon.png", variants, chance) == tmp_path / "horizon.png"
    handles, labels = figures[0].axes[0].get_legend_handles_labels()
    # A row with one lag is a lone point: colour and marker must tell it apart, whatever its line style.
    looks = {label: (h.lines[0].get_color(), h.lines[0].get_marker())
             for h, label in zip(handles, labels) if label in variants}
    assert sorted(looks) == sorted(variants)
    assert len(set(looks.values())) == len(variants), looks
    # and the chance line is none of them (`none` is grey)
    (level,) = [h for h, label in zip(handles, labels) if label == "random actions"]
    assert all(max(abs(a - b) for a, b in zip(to_rgb(level.get_color()), to_rgb(colour))) > 0.25
               for colour, _ in looks.values())


def test_the_horizon_task_rewards_the_card_lag_steps_back_and_resets_clear_it():
    """rlseq/RepeatPreviousLagL-v0: an answer earns +1/(scored steps) when it names the card seen L steps before
    the current one and the negative otherwise; the first L steps are not scored; a new episode starts from an
    empty history; returns of a perfect, a one-off and a random policy are 1, below 0 and about -0.5."""
    import gymnasium as gym

    from rlseq.envs.gym import resolve_env_id
    from rlseq.tasks import HORIZON_LAGS, horizon_lag, horizon_task

    assert horizon_task(8) == "rlseq/RepeatPreviousLag8-v0" and horizon_lag(horizon_task(8)) == 8
    assert horizon_lag("popgym-RepeatPreviousEasy-v0") is None and HORIZON_LAGS[-1] == 64
    assert [t for t in M.HORIZON_TASKS] == [horizon_task(lag) for lag in HORIZON_LAGS]
    with pytest.raises(ValueError, match="lags: 1, 2, 4"):
        horizon_task(3)
    assert resolve_env_id(horizon_task(4)).family == "popgym"  # POPGym's hyperparameters
    for lag in (1, 8):
        env = gym.make(horizon_task(lag))
        for policy in ("perfect", "off-by-one", "random"):
            returns = []
            for episode in range(2):  # the second episode checks that the reset cleared the history
                obs, _ = env.reset(seed=episode)
                seen, done, scored = [int(obs)], False, 0
                rng = np.random.default_rng(episode)
                while not done:
                    t = len(seen) - 1
                    target = seen[t - lag] if t >= lag else 0
                    action = {"perfect": target, "off-by-one": seen[t - lag + 1] if t >= lag else 0,
                              "random": int(rng.integers(4))}[policy]
                    obs, reward, terminated, truncated, _ = env.step(action)
                    returns.append(float(reward))
                    if t < lag:
                        assert reward == 0.0  # not scored: the card lag steps back does not exist yet
                    else:
                        scored += 1
                        assert reward == pytest.approx((1 if action == target else -1) / (104 - lag - 1))
                    seen.append(int(obs))
                    done = terminated or truncated
                assert scored == 103 - lag
            total = sum(returns) / 2  # per episode
            if policy == "perfect":
                assert total == pytest.approx(1.0)
            elif policy == "off-by-one":  # the neighbouring card matches only by chance
                assert total < 0
            else:
                assert -0.8 < total < -0.2
        env.close()
    parser = __import__("argparse").ArgumentParser()
    M.add_arguments(parser)
    g = M.resolve_grid(parser.parse_args(["--quick", "--seeds", "7"]))
    assert g["tasks"] == list(M.QUICK["tasks"]) and g["variants"] == list(M.QUICK["variants"]) and g["seeds"] == [7]
    assert set(g["steps"].values()) == {M.QUICK["steps"]} and g["out"] == Path(M.QUICK_OUT)
    full = M.resolve_grid(parser.parse_args(["--jobs", "3", "--out", "x/bench"]))
    assert full["tasks"] == list(M.TASKS) and full["variants"] == list(M.DEFAULT_VARIANTS)
    assert full["seeds"] == list(M.SEEDS) and len(M.SEEDS) >= 5
    assert full["steps"][T1] == M.TASK_STEPS.get(T1, M.DEFAULT_STEPS) and full["logdir"] == Path("runs/bench")
    with pytest.raises(SystemExit, match="unknown variant"):
        M.resolve_grid(parser.parse_args(["--variants", "transformer"]))


def _progress_lines(steps: list[int], total: int) -> str:
    """What rlseq.train's Progress prints into train.log (not a terminal) at each of ``steps``."""
    import contextlib
    import io

    from rlseq.callbacks import Progress

    progress = Progress(total, on_cpu=True)
    progress.tty, progress.t0, progress.n0 = False, 0.0, 0
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        for n in steps:
            progress.model = types.SimpleNamespace(num_timesteps=n, ep_info_buffer=[])
            progress._line(10.0)
    return buf.getvalue()


def test_a_running_trainers_progress_lines_count_between_checkpoints(tmp_path):
    """The grid's progress bar reads a running trainer's last progress line; a resume keeps only the checkpoint,
    so lines of a log last written before the grid started, or of a trainer since restarted, do not count."""
    logdir = tmp_path / "runs"
    (run,) = M.build_grid([T1], ["efla"], [0], {T1: 10_000})
    folder = run.folder(logdir)
    (folder / "checkpoints" / "step2000").mkdir(parents=True)
    (folder / "checkpoints" / "step2000" / "model.zip").write_bytes(b"")
    (folder / "checkpoints" / "latest").write_text("step2000\n")
    log = folder / "train.log"
    log.write_text("\n=== 2026-01-01 10:00:00 python -m rlseq.train ...\n" + _progress_lines([2048, 3072], 10_000))
    os.utime(log, (1000.0, 1000.0))
    assert M.trained_steps(run, logdir) == 2000  # what a resume keeps
    assert M.trained_steps(run, logdir, since=999.0) == 3072
    assert M.trained_steps(run, logdir, since=1001.0) == 2000  # a trainer of before the grid
    with log.open("a") as f:  # restarted from the checkpoint: the steps past it are gone until reached again
        f.write("\n=== 2026-01-01 10:05:00 python -m rlseq.train ...\nmeasured 310 env-steps/s ...\n")
    assert M.trained_steps(run, logdir, since=1001.0) == 2000
    with log.open("a") as f:
        f.write(_progress_lines([2560] * 2000 + [4096], 10_000))  # the section's head is now past the read tail
    assert M.trained_steps(run, logdir, since=1001.0) == 4096
    (folder / "final_model.zip").write_bytes(b"")
    assert M.trained_steps(run, logdir, since=1001.0) == 10_000


def test_finished_runs_are_skipped_and_interrupted_ones_resume(tmp_path, capsys):
    out, logdir = tmp_path / "out", tmp_path / "runs"
    done, trained, partial, fresh = M.build_grid([T1], ["efla", "gru", "none", "sb3-lstm"], [0], {T1: 1000})
    _result(out, T1, "efla", 0, 0.5)
    (trained.folder(logdir)).mkdir(parents=True)
    (trained.folder(logdir) / "final_model.zip").write_bytes(b"")
    ckpt = partial.folder(logdir) / "checkpoints"
    (ckpt / "step400").mkdir(parents=True)
    (ckpt / "step400" / "model.zip").write_bytes(b"")
    (ckpt / "latest").write_text("step400\n")
    assert M.is_done(done, out) and not M.is_done(trained, out)
    assert [M.trained_steps(r, logdir) for r in (trained, partial, fresh)] == [1000, 400, 0]
    assert M.budget_conflicts([done, trained, partial, fresh], out, logdir) == []
    bench_main(["memory", "--dry-run", "--tasks", T1, "--variants", "efla", "gru", "none", "sb3-lstm", "--seeds", "0",
                "--steps", "1000", "--out", str(out), "--logdir", str(logdir)])
    states = [line.split("python")[0].strip() for line in capsys.readouterr().out.splitlines() if "rlseq.train" in line]
    assert states == ["done", "at 1,000 steps", "at 400 steps", "at 0 steps"]
    # another budget is refused instead of mixed into a task
    (partial.folder(logdir) / "config.yaml").write_text("n_timesteps: 2000\n")
    other = M.build_grid([T1], ["efla", "gru", "none"], [0], {T1: 500})
    conflicts = M.budget_conflicts(other, out, logdir)
    assert len(conflicts) == 2 and "1,000 steps" in conflicts[0] and "2,000 steps" in conflicts[1]


def test_a_failed_training_is_recorded_with_the_end_of_its_log(tmp_path):
    out, logdir = tmp_path / "out", tmp_path / "runs"
    run = M.BenchRun(T1, "none", 0, 64)
    spec = {"name": run.name, "task": T1, "variant": "none", "seed": 0, "steps": 64, "folder": str(run.folder(logdir)),
            "argv": run.train_argv(logdir, device="cpu", extra=["--n-minibatches", "3"]),  # 8 envs: refused
            "paths": {k: str(v) for k, v in R.run_paths(out, T1, "none", 0).items()}, "episodes": 8, "device": "cpu",
            "versions": {}}
    answer = M.run_one(spec)
    assert answer["state"] == "failed" and answer["reason"] == "training exited with code 2"
    assert any("--n-minibatches 3 must divide" in line for line in answer["log_tail"])
    res = R.load_results(out)
    assert [f["name"] for f in res.failures] == [run.name] and res.runs.empty


# --- end to end ------------------------------------------------------------------------------------------


def test_a_tiny_slice_end_to_end(tmp_path, capsys):
    out, logdir = tmp_path / "bench", tmp_path / "runs"
    argv = ["memory", "--tasks", T1, "--variants", "none", "efla", "sb3-efla", "--seeds", "0", "--steps", "512", "--n-envs", "4",
            "--n-steps", "32", "--n-minibatches", "2", "--episodes", "8", "--jobs", "2", "--out", str(out),
            "--logdir", str(logdir)]
    bench_main(argv)
    for variant in ("none", "efla", "sb3-efla"):
        doc = json.loads(R.run_paths(out, T1, variant, 0)["result"].read_text())
        assert doc["episodes"] == 8 and -1.0 <= doc["eval_mean"] <= 1.0 and doc["env_steps_per_s"] > 0
        assert -1.0 <= doc["eval_greedy_mean"] <= 1.0 and doc["eval_greedy_std"] >= 0.0
        # what the grid checks before training is what the run trained with
        extra = ["--n-envs", "4", "--n-steps", "32", "--n-minibatches", "2"]
        assert doc["settings"] == M.planned_settings(M.BenchRun(T1, variant, 0, 512), extra)
        assert doc["config"]["n_envs"] == 4 and doc["versions"]["popgym"]
        curve = pd.read_csv(R.run_paths(out, T1, variant, 0)["curve"])
        assert list(curve.columns) == ["step", "ep_rew_mean"] and curve["step"].max() == 512
        folder = M.BenchRun(T1, variant, 0, 512).folder(logdir)
        assert M.commit_marker(folder).read_text() == f"{doc['versions']['rlseq']}\n"
    text = (tmp_path / "bench.md").read_text()
    assert "| RepeatPreviousEasy |" in text and "| task | random | efla | none | sb3-efla |" in text
    assert "## Final evaluation return, greedy actions" in text and "3 of 3 results have it" in text
    assert (out / R.CURVES_PNG).exists() and json.loads(R.random_path(out, T1).read_text())["episodes"] == 8
    # the same command again: everything is done, nothing runs and no invocation is added
    capsys.readouterr()
    bench_main(argv)
    assert "3 done already, 0 to run" in capsys.readouterr().out
    assert len(R.read_manifest(out)["invocations"]) == 1


def test_a_host_without_the_evaluation_modules_is_refused_before_anything_trains(tmp_path, monkeypatch):
    out, logdir = tmp_path / "bench", tmp_path / "runs"
    monkeypatch.setattr(M, "EVALUATION_MODULES", ("tbparse", "rlseq_no_such_module"))
    assert M.missing_modules(M.EVALUATION_MODULES) == ["rlseq_no_such_module"]
    with pytest.raises(SystemExit, match="needs rlseq_no_such_module .*nothing was trained"):
        bench_main(["memory", "--tasks", T1, "--variants", "none", "--seeds", "0", "--steps", "256", "--out", str(out),
                    "--logdir", str(logdir)])
    assert not logdir.exists() and not (out / "results").exists()


def test_without_the_report_modules_the_runs_are_evaluated_and_the_report_is_left_for_later(tmp_path, monkeypatch,
                                                                                               capsys):
    out, logdir = tmp_path / "bench", tmp_path / "runs"
    monkeypatch.setattr(M, "REPORT_MODULES", ("matplotlib", "rlseq_no_such_module"))
    bench_main(["memory", "--tasks", T1, "--variants", "none", "--seeds", "0", "--steps", "256", "--n-envs", "4",
                "--n-steps", "32", "--n-minibatches", "2", "--episodes", "4", "--jobs", "1", "--out", str(out),
                "--logdir", str(logdir)])
    said = capsys.readouterr().out
    assert "the report needs rlseq_no_such_module" in said and f"--report-only --out {out}" in said
    assert json.loads(R.run_paths(out, T1, "none", 0)["result"].read_text())["episodes"] == 4
    assert not (tmp_path / "bench.md").exists() and not (out / R.CURVES_PNG).exists()


def test_the_schedule_is_seed_major_with_the_slowest_runs_of_a_seed_first():
    grid = M.build_grid(["rlseq/RepeatPreviousLag1-v0", "rlseq/RepeatPreviousLag8-v0"],
                        ["none", "efla", "lstm", "sb3-lstm", "none-conv1"], [1, 0], dict(M.TASK_STEPS))
    order = M.schedule(grid)
    assert sorted(order, key=lambda r: r.name) == sorted(grid, key=lambda r: r.name)
    assert [r.seed for r in order] == sorted(r.seed for r in grid)
    first = [(r.variant, r.task[-6:]) for r in order if r.seed == 0]
    assert first[0] == ("sb3-lstm", "ag8-v0") and first[1] == ("lstm", "ag8-v0")
    assert first[-1][0].startswith("none") and first[-1][1] == "ag1-v0"  # the cheapest memory at the shortest budget


def test_runs_not_yet_run_are_listed_per_task_with_their_seeds():
    missing = [f"{t}/{v}/seed{s}" for t, v, s in [("rlseq/RepeatPreviousLag8-v0", "gru", 3),
                                                  ("rlseq/RepeatPreviousLag8-v0", "gru", 4),
                                                  ("rlseq/RepeatPreviousLag8-v0", "lstm", 4),
                                                  ("popgym-CountRecallMedium-v0", "efla", 0),
                                                  ("popgym-CountRecallMedium-v0", "efla", 1),
                                                  ("popgym-CountRecallMedium-v0", "none", 0),
                                                  ("popgym-CountRecallMedium-v0", "none", 1)]]
    assert R._missing_lines(missing) == ["- **CountRecallMedium**: efla, none: seeds 0, 1",
                                         "- **RepeatPreviousLag8**: gru seeds 3, 4; lstm seed 4"]


def test_a_stopped_idle_worker_leaves_without_a_traceback(tmp_path):
    """The benchmark stops its workers with SIGTERM; one waiting for its next run exits 0 and prints nothing."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import multiprocessing as mp, os, time
        from concurrent.futures import ProcessPoolExecutor
        from rlseq.bench.memory import _init_worker
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            pool = ProcessPoolExecutor(max_workers=2, mp_context=ctx, initializer=_init_worker,
                                       initargs=(os.getpid(),))
            pool.submit(abs, -1).result()
            time.sleep(0.5)
            workers = ctx.active_children()
            for p in workers:
                p.terminate()
            # the executor's own thread joins its workers: a second join here would race it for their exit status
            # (the loser's waitpid fails and reads None) and fail this test while the worker has long left
            pool.shutdown(wait=True)
            print("exitcodes", sorted({p.exitcode for p in workers}))
    """)
    (tmp_path / "stop.py").write_text(script)
    proc = subprocess.run([sys.executable, str(tmp_path / "stop.py")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip().endswith("exitcodes [0]"), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr


def test_the_first_stop_signal_repeated_at_once_is_one_stop_and_anything_else_is_a_second(monkeypatch):
    stops = M.StopSignals()
    stops(signal.SIGTERM)
    stops(signal.SIGTERM)  # `timeout`: to its child, then to the group
    assert stops == [signal.SIGTERM]
    stops(signal.SIGINT)
    assert stops == [signal.SIGTERM, signal.SIGINT]
    monkeypatch.setattr(M, "REPEAT_S", -1.0)  # later than the window: a second request
    late = M.StopSignals()
    late(signal.SIGINT)
    late(signal.SIGINT)
    assert late == [signal.SIGINT, signal.SIGINT]


# a budget the runs of a stopped grid cannot finish before the stop reaches them: each waits for its first checkpoint
# (a tenth of the budget, ~4 s of training on one core of a 2-core machine), and the rest is ~9x that (200,000 steps
# doubled the wait for nothing)
STOP_BUDGET = 100_000


@pytest.mark.parametrize("sig,seeds,jobs,group", [("SIGTERM", 3, 1, False), ("SIGINT", 2, 2, False),
                                                  ("SIGTERM", 2, 2, True)])
def test_a_stopped_grid_says_so_in_one_line_and_starts_nothing_more(tmp_path, sig, seeds, jobs, group):
    """A signal to the benchmark (a timeout, Ctrl-C) stops every trainer with a stop checkpoint: one line, no
    traceback, and no run that the pool had queued behind them starts (with one job the second run is queued in
    the worker already). ``group``: to the whole process group, as `timeout` and a terminal's Ctrl-C send it; the
    trainers, each in a session of its own, get it once, from their workers."""
    import subprocess
    import sys

    out, logdir = tmp_path / "bench", tmp_path / "runs"
    argv = [sys.executable, "-m", "rlseq.bench", "memory", "--tasks", T1, "--variants", "none", "--seeds",
            *map(str, range(seeds)), "--steps", str(STOP_BUDGET), "--n-envs", "4", "--n-steps", "32", "--n-minibatches",
            "2", "--episodes", "8", "--jobs", str(jobs), "--out", str(out), "--logdir", str(logdir)]
    runs = [M.BenchRun(T1, "none", s, STOP_BUDGET) for s in range(seeds)]
    started = runs[:jobs]  # seed-major: the first `jobs` seeds start, the rest wait
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=group)
    try:
        wait_for(lambda: all(M.trained_steps(r, logdir) > 0 for r in started), proc)  # each has a checkpoint
        assert proc.poll() is None, f"the grid ended before it could be stopped: {proc.communicate()}"
        assert all(M.trained_steps(r, logdir) > 0 for r in started), f"no checkpoint within {START_LIMIT_S} s"
        if group:
            os.killpg(proc.pid, getattr(signal, sig))
        else:
            proc.send_signal(getattr(signal, sig))
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].endswith("run(s) stopped; the same command resumes them"), stderr
    assert f"stopping ({sig})" in stdout + stderr
    for r in started:  # each trainer saved where it was stopped, told once
        log = (r.folder(logdir) / "train.log").read_text()
        assert "stopped by SIGTERM: checkpoint step" in log and log.count(": stopping after this rollout") == 1, log
    assert not any(r.folder(logdir).exists() for r in runs[jobs:]), "a queued run started after the stop"


def test_a_run_whose_worker_died_during_a_stop_is_stopped_not_failed():
    """On a stop, an idle worker's exit breaks the process pool and every running future ends in
    BrokenProcessPool, though its trainer saves its stop checkpoint: the run is to resume, not a failure."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    run = M.BenchRun(T1, "none", 0, 1000)
    bar = types.SimpleNamespace(write=lambda line: None)
    for stopping, state in ((True, "stopped"), (False, "failed")):
        fut: Future = Future()
        fut.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
        answers: dict[str, list] = {"done": [], "failed": [], "stopped": []}
        M._collect(fut, run, answers, set(), bar, stopping=stopping)
        assert [a["name"] for a in answers[state]] == [run.name] and sum(map(len, answers.values())) == 1
