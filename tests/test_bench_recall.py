"""``python -m rlseq.bench recall``: the supervised probe measures what it says (the window shows in the memoryless
control, a recurrent core reaches past it), its results repeat for a seed, and bad input gets a clear error."""

from __future__ import annotations

import json

import pytest

from rlseq.bench import recall as R
from rlseq.bench.__main__ import main as bench_main

# small enough for CI: a few seconds per cell on one core
TINY = R.RecallSettings(length=16, batch=32, steps=150, eval_sequences=128, d_model=32)
# a CLI call that must stop before running anything still gets a budget that would end at once
TINY_FLAGS = ["--variants", "none", "--lags", "1", "--seeds", "0", "--steps", "1", "--length", "4", "--jobs", "1"]


def test_the_window_shows_in_the_memoryless_control():
    """`none` sees the last 4 inputs through the front end's convolution: lag 1 is inside that window, lag 6 is not,
    and without the window (`none-conv1`) even lag 1 is at chance (1/4)."""
    inside = R.recall_cell("none", 1, 0, TINY)["accuracy"]
    outside = R.recall_cell("none", 6, 0, TINY)["accuracy"]
    no_window = R.recall_cell("none-conv1", 1, 0, TINY)["accuracy"]
    assert inside > 0.95
    assert abs(outside - 0.25) < 0.08
    assert abs(no_window - 0.25) < 0.08


def test_a_recurrent_core_recalls_beyond_the_window():
    gru = R.recall_cell("gru", 6, 0, TINY)
    assert gru["accuracy"] > 0.5  # chance is 0.25; `none` is at chance at this lag (above)
    assert gru["params"] > R.recall_cell("none", 6, 0, TINY)["params"]


def test_a_cell_repeats_for_a_seed_and_differs_between_seeds():
    a, b, c = (R._worker(("efla", 2, s, TINY)) for s in (0, 0, 1))
    assert a["accuracy"] == b["accuracy"] and a["loss"] == b["loss"]
    assert a["loss"] != c["loss"]


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="unknown variant.*valid: efla, deltanet"):
        R.run_grid(["eflaa"], [1], [0], TINY)
    with pytest.raises(ValueError, match=r"lag\(s\) 16 outside \[1, length=16\)"):
        R.run_grid(["none"], [1, 16], [0], TINY)
    with pytest.raises(ValueError, match="efla: .*unexpected keyword argument 'n_head'"):
        R.run_grid(["efla"], [1], [0], R.RecallSettings(memory_kwargs={"efla": {"n_head": 2}}))
    with pytest.raises(SystemExit, match="--symbols must be >= 2"):
        bench_main(["recall", "--symbols", "1", *TINY_FLAGS])


def test_the_cli_prints_the_table_and_writes_every_record(tmp_path, capsys):
    out = tmp_path / "recall.json"
    bench_main(["recall", "--variants", "none", "none-conv1", "--lags", "1", "2", "--seeds", "0", "1",
                "--steps", "20", "--length", "12", "--d-model", "16", "--jobs", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| variant | params | L=1 | L=2 |" in printed and "| chance | | 0.25 | 0.25 |" in printed
    body = json.loads(out.read_text())
    assert body["settings"]["steps"] == 20 and body["settings"]["d_model"] == 16
    cells = {(r["variant"], r["lag"], r["seed"]) for r in body["records"]}
    assert cells == {(v, lag, s) for v in ("none", "none-conv1") for lag in (1, 2) for s in (0, 1)}
    row = next(line for line in printed.splitlines() if line.startswith("| none |"))
    accs = [r["accuracy"] for r in sorted(body["records"], key=lambda r: r["seed"])
            if r["variant"] == "none" and r["lag"] == 1]
    assert f"{sum(accs) / 2:.2f} ({accs[0]:.2f} / {accs[1]:.2f})" in row
    assert not list(tmp_path.glob("*.tmp"))


def test_a_config_s_memory_kwargs_reach_the_blocks_and_its_other_entries_are_named(tmp_path, capsys):
    config = tmp_path / "ablation.yml"
    config.write_text("popgym:\n  learning_rate: 1.0e-3\n  memory_kwargs:\n    efla: {join: read, n_heads: 2}\n")
    out = tmp_path / "recall.json"
    bench_main(["recall", "--variants", "efla", "efla-conv1", "--lags", "1", "--seeds", "0", "--steps", "2",
                "--length", "8", "--d-model", "16", "--jobs", "1", "--config", str(config), "--out", str(out)])
    assert f"{config}: not used by the recall probe: learning_rate" in capsys.readouterr().out
    assert json.loads(out.read_text())["settings"]["memory_kwargs"] == {"efla": {"join": "read", "n_heads": 2}}
    settings = R.RecallSettings(d_model=16, memory_kwargs={"efla": {"join": "read", "n_heads": 2}})
    block, no_window = R._memory("efla", settings), R._memory("efla-conv1", settings)
    assert (block.join, block.n_heads, block.conv.kernel_size) == ("read", 2, 4)
    assert (no_window.join, no_window.n_heads, no_window.conv.kernel_size) == ("read", 2, 1)
    config.write_text("popgym:\n  memory_kwargs: [1, 2]\n")
    with pytest.raises(SystemExit, match="memory_kwargs must map memory names"):
        bench_main(["recall", "--config", str(config), *TINY_FLAGS])


def test_the_same_command_again_runs_only_the_missing_cells_and_other_settings_are_refused(tmp_path, capsys):
    out = tmp_path / "recall.json"
    argv = ["recall", "--variants", "none", "--lags", "1", "--steps", "5", "--length", "8", "--d-model", "8",
            "--jobs", "1", "--out", str(out)]
    bench_main([*argv, "--seeds", "0"])
    first = json.loads(out.read_text())["records"]
    capsys.readouterr()
    bench_main([*argv, "--seeds", "0", "1"])
    printed = capsys.readouterr().out
    assert f"{out}: 1 cell(s) already there" in printed and "2 cells (1 run now)" in printed
    assert "none L=1   seed 0" not in printed and "none L=1   seed 1" in printed
    records = json.loads(out.read_text())["records"]
    assert records[0] == first[0] and [r["seed"] for r in records] == [0, 1]
    assert argv[5:7] == ["--steps", "5"]
    with pytest.raises(SystemExit, match=r"other settings \(steps differ\)"):
        bench_main([*argv[:6], "6", *argv[7:], "--seeds", "0"])
    assert json.loads(out.read_text())["records"] == records
    body = json.loads(out.read_text())
    body["records"][0]["torch"] = "0.0.1"
    out.write_text(json.dumps(body))
    with pytest.raises(SystemExit, match="cells made under torch 0.0.1"):
        bench_main([*argv, "--seeds", "0"])


def test_a_cell_named_twice_runs_once_and_the_records_come_in_grid_order():
    settings = R.RecallSettings(length=6, batch=4, steps=2, eval_sequences=4, d_model=8)
    records = R.run_grid(["none", "none", "none-conv1"], [2, 1, 2], [1, 0, 1], settings, jobs=2)
    assert [(r["variant"], r["lag"], r["seed"]) for r in records] == [
        (v, lag, s) for s in (1, 0) for lag in (2, 1) for v in ("none", "none-conv1")]
