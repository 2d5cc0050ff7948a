"""Tests for rlseq.compare on synthetic TensorBoard event files with known values.

Layout written once for the test run (runs/<env>/<variant>/seed<N>/):

* caveflyer/efla      3 seeds, final values 1, 2, 3 (mean 2, std ddof=1 = 1, IQM = mean: < 4 seeds);
                      seed0 split over two event files (resume from step 500 with stale steps 550 / 600
                      in the old file); env_steps_per_s medians 100, 200, 300 (+ a time/fps that must be
                      ignored); memory diagnostics.
* caveflyer/deltanet  4 seeds, finals 1, 2, 4, 10 (mean 4.25, std sqrt(16.25), IQM = mean(2, 4) = 3,
                      median 3); only time/fps = 50 (throughput fallback).
* caveflyer/lstm      1 seed, final 5: std and CI are n/a.
* bigfish/efla        2 seeds ending at steps 1000 and 800 (curve grid must stop at 800).

The multi-input tests split caveflyer into two runs trees (``split_runs``) and merge them back.

Steps run 0..1000 every 100; with final_fraction=0.1 a seed's final value is the mean over steps
>= 900, where the synthetic curves sit exactly at their final value.
"""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("tbparse")
pytest.importorskip("rliable")
pytest.importorskip("matplotlib")

from rlseq import compare  # noqa: E402

METRIC = "rollout/ep_rew_mean"
STEPS = list(range(0, 1001, 100))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _curve(final: float, steps: list[int]) -> list[float]:
    """Ramp from 0 that reaches ``final`` at step 900 and stays there."""
    return [final * min(s, 900) / 900 for s in steps]


def _write(run_dir: Path, scalars: dict[str, list[tuple[int, float]]], *, t0: float) -> None:
    """One event file in run_dir; wall times t0 + step so file order is explicit."""
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(log_dir=str(run_dir))
    for tag, points in scalars.items():
        for step, value in points:
            w.add_scalar(tag, value, step, walltime=t0 + step)
    w.close()


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    cave = root / "caveflyer"
    for seed, (final, tput) in enumerate([(1.0, 100.0), (2.0, 200.0), (3.0, 300.0)]):
        d = cave / "efla" / f"seed{seed}"
        curve = list(zip(STEPS, _curve(final, STEPS)))
        extra = {
            "time/env_steps_per_s": [(s, tput + (5.0 if s == 0 else 0.0)) for s in STEPS],  # median = tput
            "time/fps": [(s, 1.0) for s in STEPS],  # must lose against env_steps_per_s
            "memory/key_norm_max": [(s, 10.0 ** (s / 500)) for s in STEPS],
            "memory/gate_saturated_frac": [(s, 0.01 * seed) for s in STEPS],
        }
        if seed == 0:
            # Crashed run: logged up to 600 (+ 550), the checkpoint was at 500; stale values are 99.
            old = [(s, v) for s, v in curve if s <= 400] + [(500, 99.0), (550, 99.0), (600, 99.0)]
            _write(d, {METRIC: old, **{k: [p for p in v if p[0] <= 600] for k, v in extra.items()}}, t0=1000)
            new = [(s, v) for s, v in curve if s >= 500]
            _write(d, {METRIC: new, **{k: [p for p in v if p[0] >= 500] for k, v in extra.items()}}, t0=5000)
        else:
            _write(d, {METRIC: curve, **extra}, t0=1000)
    for seed, final in enumerate([10.0, 1.0, 4.0, 2.0]):  # unsorted on purpose
        curve = list(zip(STEPS, _curve(final, STEPS)))
        _write(cave / "deltanet" / f"seed{seed}", {METRIC: curve, "time/fps": [(s, 50.0) for s in STEPS]},
               t0=1000)
    _write(cave / "lstm" / "seed0", {METRIC: list(zip(STEPS, _curve(5.0, STEPS)))}, t0=1000)
    for seed, last in enumerate([1000, 800]):
        steps = [s for s in STEPS if s <= last]
        _write(root / "bigfish" / "efla" / f"seed{seed}", {METRIC: list(zip(steps, _curve(7.0, steps)))},
               t0=1000)
    return root


@pytest.fixture(scope="session")
def cave_df(runs_root: Path) -> pd.DataFrame:
    return compare.load_runs(runs_root / "caveflyer")


def test_load_runs_shape_and_resume(cave_df: pd.DataFrame) -> None:
    df = cave_df
    assert list(df.columns) == ["env", "variant", "seed", "step", "tag", "value"]
    assert set(df["env"]) == {"caveflyer"}
    assert set(df["variant"]) == {"efla", "deltanet", "lstm"}
    seeds = df.groupby("variant")["seed"].unique().map(sorted).to_dict()
    assert seeds == {"efla": [0, 1, 2], "deltanet": [0, 1, 2, 3], "lstm": [0]}
    assert not df.duplicated(["env", "variant", "seed", "tag", "step"]).any()
    m = df[df["tag"] == METRIC]
    # 3 efla + 4 deltanet + 1 lstm seeds, 11 points each.
    assert len(m) == 8 * len(STEPS)
    r = m[(m["variant"] == "efla") & (m["seed"] == 0)].set_index("step")["value"]
    assert list(r.index) == STEPS  # the orphaned step 550 is gone
    assert r[500] == pytest.approx(_curve(1.0, [500])[0]) and r[600] == pytest.approx(_curve(1.0, [600])[0])
    assert (r != 99.0).all()
    # Other tags were merged the same way (the resumed files overlap on 500 and 600).
    k = df[(df["variant"] == "efla") & (df["seed"] == 0) & (df["tag"] == "memory/key_norm_max")]
    assert list(k["step"]) == STEPS


def test_final_returns(cave_df: pd.DataFrame) -> None:
    f = compare.final_returns(cave_df, final_fraction=0.1)
    got = f[f["variant"] == "efla"].sort_values("seed")["final"].tolist()
    assert got == [1.0, 2.0, 3.0]
    # final_fraction=1: mean over every point of the ramp (0, 1/9, ..., 8/9, 1, 1) * final.
    f1 = compare.final_returns(cave_df, final_fraction=1.0)
    lstm = f1.loc[f1["variant"] == "lstm", "final"].item()
    assert lstm == pytest.approx(np.mean(_curve(5.0, STEPS)), rel=1e-6)
    with pytest.raises(compare.CompareError, match="not found"):
        compare.final_returns(cave_df, metric="rollout/nope")


def test_summarize_exact_numbers(cave_df: pd.DataFrame) -> None:
    s = compare.summarize(cave_df, reps=500).set_index("variant")
    assert list(s.index) == ["efla", "deltanet", "lstm"]  # memory order, not alphabetical

    e = s.loc["efla"]
    assert e["n_seeds"] == 3
    assert e["final_mean"] == 2.0
    assert e["final_std"] == 1.0  # np.std([1, 2, 3], ddof=1)
    assert e["iqm"] == 2.0  # 3 seeds: 25% trim removes nothing
    assert e["median"] == 2.0
    assert e["env_steps_per_s"] == 200.0  # mean of per-seed medians 100, 200, 300
    assert 1.0 <= e["iqm_ci_low"] <= e["iqm"] <= e["iqm_ci_high"] <= 3.0
    assert e["steps_min"] == e["steps_max"] == 1000

    d = s.loc["deltanet"]
    assert d["n_seeds"] == 4
    assert d["final_mean"] == 4.25
    assert d["final_std"] == pytest.approx(math.sqrt(16.25), rel=1e-12)  # ((3.25² + 2.25² + .25² + 5.75²) / 3)
    assert d["iqm"] == 3.0  # sorted 1, 2, 4, 10 -> mean of the middle two
    assert d["median"] == 3.0
    assert d["env_steps_per_s"] == 50.0  # time/fps fallback
    assert 1.0 <= d["iqm_ci_low"] <= 3.0 <= d["iqm_ci_high"] <= 10.0

    lstm = s.loc["lstm"]
    assert lstm["n_seeds"] == 1 and lstm["final_mean"] == 5.0 and lstm["iqm"] == 5.0
    assert math.isnan(lstm["final_std"]) and math.isnan(lstm["iqm_ci_low"]) and math.isnan(lstm["iqm_ci_high"])
    assert math.isnan(lstm["env_steps_per_s"])

    # Fixed bootstrap seed: reproducible CIs (rliable samples from the global np.random, which
    # summarize seeds and then restores).
    np.random.seed(123)
    before = np.random.rand()
    np.random.seed(123)
    np.random.rand(17)  # different global state than the first call saw
    again = compare.summarize(cave_df, reps=500).set_index("variant")
    pd.testing.assert_frame_equal(again, s)
    np.random.seed(123)
    compare.summarize(cave_df, reps=50)
    assert np.random.rand() == before


def test_iqm_curve_matches_rliable() -> None:
    _, metrics = compare._rliable()
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(5, 1, 7))
    want = [metrics.aggregate_iqm(scores[:, :, j]) for j in range(7)]
    np.testing.assert_allclose(compare.stats._iqm_over_runs(scores), want, rtol=1e-12)


def test_curve_grid_stops_at_shortest_seed(runs_root: Path) -> None:
    df = compare.load_runs(runs_root / "bigfish")
    grid, vals = compare.stats._seed_curves(df[df["tag"] == METRIC], 9)
    assert grid[0] == 0 and grid[-1] == 800 and vals.shape == (2, 9)


def test_styles_consistent() -> None:
    a = compare.variant_styles(["lstm", "efla"])
    b = compare.variant_styles(["none", "efla-reward1e3", "efla", "deltanet", "zzz"])
    assert a["efla"]["color"] == b["efla"]["color"] == compare.MEMORY_COLORS["efla"]
    assert b["efla-reward1e3"]["color"] == b["efla"]["color"]
    assert b["efla-reward1e3"]["linestyle"] != b["efla"]["linestyle"]
    assert b["efla-reward1e3"]["marker"] != b["efla"]["marker"]  # a lone point shows no line style
    assert b["zzz"]["color"] not in compare.MEMORY_COLORS.values()
    assert compare.variant_order(b) == ["efla", "efla-reward1e3", "deltanet", "none", "zzz"]


def test_cli_writes_png_and_table(runs_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert compare.main([str(runs_root / "caveflyer"), "--out", str(out), "--reps", "300"]) == 0
    for name in ("compare.png", "compare_diagnostics.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000
    md = (out / "compare.md").read_text()
    assert md == capsys.readouterr().out
    returns_table, diagnostics = md.split("## Memory diagnostics")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in returns_table.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    assert set(rows) == {"efla", "deltanet", "lstm"}
    assert "| caveflyer | efla | 3 |" in diagnostics and "| caveflyer | deltanet |" not in diagnostics
    # seeds, env steps, final mean, std, IQM, CI, median, env-steps/s
    assert rows["efla"][:5] == ["3", "1k", "2.00", "1.00", "2.00"] and rows["efla"][6:] == ["2.00", "200"]
    assert rows["deltanet"][:5] == ["4", "1k", "4.25", f"{math.sqrt(16.25):.2f}", "3.00"]
    assert rows["deltanet"][6:] == ["3.00", "50"]
    assert rows["lstm"] == ["1", "1k", "5.00", "n/a", "5.00", "n/a", "5.00", "n/a"]
    assert "## caveflyer" in md


def test_cli_iqm_and_multi_env(runs_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stray = runs_root / "stray"  # an event file outside any seed<N> folder: skipped with a warning
    if not stray.exists():
        _write(stray, {METRIC: [(0, 1.0)]}, t0=0)
    with pytest.warns(UserWarning, match="outside any seed"):
        compare.main([str(runs_root), "--out", str(tmp_path), "--aggregate", "iqm", "--reps", "200",
                      "--points", "20"])
    md = capsys.readouterr().out
    assert "## bigfish" in md and "## caveflyer" in md
    assert md.index("## bigfish") < md.index("## caveflyer")
    bigfish = md[md.index("## bigfish"):md.index("## caveflyer")]
    # Seeds stopped at different steps; the short one's final is its value at 800: 7 * 800 / 900.
    assert f"| efla | 2 | 800–1k | {(7 + 7 * 8 / 9) / 2:.2f} |" in bigfish
    assert (tmp_path / "compare.png").read_bytes()[:8] == PNG_MAGIC


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        compare.main([str(tmp_path / "missing")])
    assert "not found" in str(e.value.code)
    empty = tmp_path / "empty"
    (empty / "efla" / "seed0").mkdir(parents=True)
    (empty / "efla" / "seed0" / "config.yaml").write_text("memory: efla\n")
    with pytest.raises(SystemExit) as e:
        compare.main([str(empty)])
    msg = str(e.value.code)
    assert "no TensorBoard event files" in msg and "seed<N>" in msg
    assert not (empty / "compare.md").exists()
    with pytest.raises(compare.CompareError):
        compare.load_runs(empty)


def test_unknown_metric_cli(runs_root: Path, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SystemExit) as e:
            compare.main([str(runs_root / "caveflyer"), "--out", str(tmp_path), "--metric", "rollout/nope"])
    assert "rollout/nope" in str(e.value.code) and METRIC in str(e.value.code)


def _finals(rows: dict[str, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([("cave", v, s, x, 1000) for v, xs in rows.items() for s, x in enumerate(xs)],
                        columns=["env", "variant", "seed", "final", "last_step"])


def test_relative_to_baseline_pairs_variants_by_tag() -> None:
    from rliable import metrics
    from scipy.stats import f as f_dist

    a, b = [1.0, 2.0, 6.0], [2.0, 2.0, 5.0]
    finals = _finals({"efla-r": a, "deltanet-r": b, "efla-v": [3.0, 3.0], "deltanet": [1.0, 2.0], "efla": [4.0]})
    rel = compare.relative_to_baseline(finals, "deltanet", reps=500).set_index("variant")
    assert set(rel.index) == {"efla-r", "efla"}  # efla-v has no deltanet-v; deltanet rows are the baseline
    r = rel.loc["efla-r"]
    assert r["baseline"] == "deltanet-r" and r["mean_ratio"] == pytest.approx(3.0 / 3.0)
    s = np.std(a, ddof=1) / np.std(b, ddof=1)
    assert r["std_ratio"] == pytest.approx(s)
    assert r["std_ci_low"] == pytest.approx(s / math.sqrt(f_dist.ppf(0.975, 2, 2)))
    assert r["std_ci_high"] == pytest.approx(s / math.sqrt(f_dist.ppf(0.025, 2, 2)))
    assert r["ratio_ci_low"] < 1.0 < r["ratio_ci_high"]
    p = metrics.probability_of_improvement(np.array(a)[:, None], np.array(b)[:, None])
    assert r["p_improve"] == pytest.approx(p) and r["p_ci_low"] <= p <= r["p_ci_high"]
    one = rel.loc["efla"]  # one seed against two: ratios but no CIs
    assert one["mean_ratio"] == pytest.approx(4.0 / 1.5) and math.isnan(one["ratio_ci_low"])
    # a row's CIs do not depend on the other runs in the report
    # (six seeds each, so that different bootstrap draws give different percentiles)
    x6, y6 = [1.0, 2.5, 6.0, 3.2, 4.1, 0.7], [2.0, 2.2, 5.0, 3.9, 1.1, 2.8]
    alone = compare.relative_to_baseline(_finals({"efla-r": x6, "deltanet-r": y6}), "deltanet", reps=500)
    crowded = compare.relative_to_baseline(  # efla-a is compared first and draws its own bootstrap
        _finals({"efla-a": [1.0, 4.0, 2.0], "deltanet-a": [2.0, 3.0], "efla-r": x6, "deltanet-r": y6}), "deltanet",
        reps=500)
    cols = ["ratio_ci_low", "ratio_ci_high", "p_ci_low", "p_ci_high"]

    def row(table):
        return table.set_index("variant").loc["efla-r", cols].tolist()
    assert row(crowded) == row(alone)


def test_diagnostics_summary_peaks_and_tail() -> None:
    rows = []
    for seed, (peak, nonfinite) in enumerate([(1e3, 0.0), (1e8, 2.0), (5.0, 0.0)]):
        for step in range(0, 1001, 100):
            rows += [("cave", "deltanet-r", seed, step, "memory/key_norm_max", peak * step / 1000),
                     ("cave", "deltanet-r", seed, step, "memory/gate_saturated_frac", 1.0 if step >= 900 else 0.0),
                     ("cave", "deltanet-r", seed, step, "memory/nonfinite_events", nonfinite * step / 1000),
                     ("cave", "deltanet-r", seed, step, "train/value_target_abs_mean", 10.0 * seed)]
    rows.append(("cave", "none", 0, 0, "rollout/ep_rew_mean", 1.0))  # no diagnostics: no row
    d = compare.diagnostics_summary(pd.DataFrame(rows, columns=compare.COLUMNS))
    assert list(d["variant"]) == ["deltanet-r"]
    r = d.iloc[0]
    assert r["saturated_final"] == 1.0 and r["key_norm_peak_median"] == 1e3 and r["key_norm_peak_max"] == 1e8
    assert r["nonfinite_events"] == 2.0 and r["nonfinite_seeds"] == 1 and r["value_target_final"] == 10.0
    assert math.isnan(r["state_norm_peak_max"])


def test_every_diagnostics_panel_has_a_y_axis_label(monkeypatch, tmp_path: Path) -> None:
    from rlseq.compare import plots

    rows = [("cave", variant, 0, step, tag, 1.0 + step) for variant in ("efla", "none") for step in (0, 100)
            for tag in compare.DIAGNOSTIC_TAGS]
    figures = []
    monkeypatch.setattr(plots, "_finish", lambda fig, handles, path: figures.append(fig))
    plots.plot_diagnostics(pd.DataFrame(rows, columns=compare.COLUMNS), tmp_path / "d.png")
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == ["fraction of gates > 0.99", "largest key norm",
                                                    "largest memory-state norm", "non-finite events so far"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_cli_baseline_panels_and_scalars_roundtrip(runs_root: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out, csv = tmp_path / "out", tmp_path / "s" / "scalars.csv.gz"
    assert compare.main([str(runs_root / "caveflyer"), "--out", str(out), "--reps", "200", "--baseline", "deltanet",
                         "--panels", "condition", "--save-scalars", str(csv)]) == 0
    md = capsys.readouterr().out
    assert "## Against deltanet (same tag)" in md and "## Memory diagnostics" in md
    row = next(line for line in md.splitlines() if line.startswith("| caveflyer | efla | deltanet |"))
    assert row.split("|")[5].strip() == f"{2.0 / 4.25:.3g}"
    saved = pd.read_csv(csv)
    assert set(saved["tag"]) == {METRIC, "time/env_steps_per_s", "time/fps", "memory/key_norm_max",
                                 "memory/gate_saturated_frac"}
    # the saved summary reproduces the same tables without the event files
    assert compare.main([str(csv), "--out", str(tmp_path / "again"), "--reps", "200", "--baseline", "deltanet"]) == 0
    again = capsys.readouterr().out
    assert again.split("\n", 1)[1] == md.split("\n", 1)[1]
    with pytest.raises(SystemExit) as e:
        compare.main([str(runs_root / "caveflyer"), "--out", str(tmp_path), "--baseline", "gru"])
    assert "no variant has a gru run" in str(e.value.code)
    assert not (tmp_path / "compare.png").exists() and not (tmp_path / "compare.md").exists()  # nothing written


def test_cli_baseline_without_panels_names_variants_left_out(runs_root: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--baseline prints its table with any --panels; a variant with no baseline run (bigfish has no
    deltanet) is named in a warning and under the table instead of vanishing."""
    with pytest.warns(UserWarning) as record:
        assert compare.main([str(runs_root), "--out", str(tmp_path), "--aggregate", "iqm", "--reps", "100",
                             "--points", "10", "--baseline", "deltanet"]) == 0
    md = capsys.readouterr().out
    table = md[md.index("## Against deltanet (same tag)"):]
    assert "| caveflyer | efla | deltanet | 3 vs 4 |" in table and "| caveflyer | lstm | deltanet | 1 vs 4 |" in table
    assert "| bigfish |" not in table
    assert "Left out (no deltanet run under the same tag in the same env): bigfish/efla." in table
    left_out = [str(w.message) for w in record if "--baseline deltanet" in str(w.message)]
    assert left_out == ["--baseline deltanet: no deltanet run under the same tag for bigfish/efla; "
                        "left out of the baseline table"]
    assert compare.without_baseline(compare.final_returns(compare.load_runs(runs_root / "caveflyer")),
                                    "deltanet") == []


@pytest.fixture(scope="session")
def split_runs(runs_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """runs_root/caveflyer as two runs trees: part 1 = efla seeds 0 (resumed) and 1 + lstm, part 2 = efla
    seed 2 + deltanet, so efla's seeds come from both parts."""
    base = tmp_path_factory.mktemp("parts")
    part1, part2 = base / "part1" / "caveflyer", base / "part2" / "caveflyer"
    for run in sorted((runs_root / "caveflyer").glob("*/seed*")):
        variant, seed = run.parent.name, run.name
        dest = part1 if variant == "lstm" or (variant == "efla" and seed != "seed2") else part2
        shutil.copytree(run, dest / variant / seed)
    return part1, part2


def test_cli_merges_saved_csv_with_runs_tree(runs_root: Path, split_runs: tuple[Path, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    part1, part2 = split_runs
    csv = tmp_path / "scalars.csv.gz"  # part 1 survives only as its saved scalars
    assert compare.main([str(part1), "--out", str(tmp_path / "p1"), "--reps", "50", "--save-scalars", str(csv)]) == 0
    capsys.readouterr()
    whole = compare.load_runs(runs_root / "caveflyer")
    pd.testing.assert_frame_equal(compare.load_inputs([csv, part2]), whole)

    args = ["--reps", "200", "--points", "20", "--aggregate", "iqm", "--baseline", "deltanet", "--panels", "condition"]
    assert compare.main([str(runs_root / "caveflyer"), "--out", str(tmp_path / "all"), *args]) == 0
    md_all = capsys.readouterr().out
    # The saved CSV is both an input and the --save-scalars target: read first, then replaced by all runs.
    assert compare.main([str(csv), str(part2), "--out", str(tmp_path / "merged"), *args,
                         "--save-scalars", str(csv)]) == 0
    md = capsys.readouterr().out
    assert md.splitlines()[0] == f"# rlseq comparison: {csv} + {part2}"
    assert md.split("\n", 1)[1] == md_all.split("\n", 1)[1]
    assert "| caveflyer | efla | deltanet | 3 vs 4 |" in md and "| efla | 3 | 1k | 2.00 | 1.00 |" in md
    for name in ("compare.png", "compare_diagnostics.png"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "all" / name).read_bytes()
    pd.testing.assert_frame_equal(compare.load_scalars(csv), whole)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all", "merged", "p1", "scalars.csv.gz"]  # no temp left


def test_multi_input_errors(split_runs: tuple[Path, Path], tmp_path: Path) -> None:
    part1, part2 = split_runs
    csv = tmp_path / "part1.csv.gz"
    compare.load_runs(part1).to_csv(csv, index=False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        compare.main([str(csv), str(part2), str(part1), "--out", str(out)])
    msg = str(e.value.code)
    assert "caveflyer/efla/seed0" in msg and f"both {csv} and {part1}" in msg
    with pytest.raises(SystemExit) as e:  # the same input twice is the same clash
        compare.main([str(part2), str(part2), "--out", str(out)])
    assert f"run caveflyer/deltanet/seed0 is in both {part2} and {part2}" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        compare.main([str(csv), str(part2)])
    assert "--out is required with several inputs" in str(e.value.code)
    assert not out.exists() and not (part2 / "compare.md").exists() and not (tmp_path / "compare.md").exists()

    # A numeric env name read back from a CSV is still the runs tree's name, so the clash is caught.
    tree = tmp_path / "runs" / "2048"
    shutil.copytree(part1 / "lstm", tree / "lstm")
    compare.load_runs(tree).to_csv(tmp_path / "2048.csv", index=False)
    assert compare.load_scalars(tmp_path / "2048.csv")["env"].unique().tolist() == ["2048"]
    with pytest.raises(compare.CompareError, match="run 2048/lstm/seed0 is in both"):
        compare.load_inputs([tmp_path / "2048.csv", tree])


# ------------------------------------------------------------------------------------ damaged event files
def _event_file_bytes(tmp: Path, points: list[tuple[int, float]], t0: float) -> bytes:
    _write(tmp, {METRIC: points}, t0=t0)
    (f,) = tmp.glob("events.out.tfevents.*")
    return f.read_bytes()


def _seed_dir(root: Path, seed: int) -> Path:
    d = root / "cave" / "efla" / f"seed{seed}"
    d.mkdir(parents=True)
    return d


def test_truncated_event_file_warns_and_keeps_what_is_readable(tmp_path: Path) -> None:
    points = [(s, float(s)) for s in STEPS]
    data = _event_file_bytes(tmp_path / "src", points, t0=1000)
    bad = _seed_dir(tmp_path / "runs", 0) / "events.out.tfevents.1.host"
    bad.write_bytes(data[:-5])  # the last point's record is cut off mid-write
    with pytest.warns(UserWarning) as record:
        df = compare.load_runs(tmp_path / "runs")
    msgs = [str(w.message) for w in record]
    assert len(msgs) == 1 and str(bad) in msgs[0] and "cut off" in msgs[0]
    assert f"{len(points) - 1} scalar point(s) kept" in msgs[0]
    assert list(df["step"]) == STEPS[:-1]
    scan = compare.scan_event_file(bad)
    assert scan.damage_at is not None and scan.reason == "truncated record" and scan.n_points == len(points) - 1


def test_damage_mid_file_counts_the_points_after_it(tmp_path: Path) -> None:
    """Garbage between two intact stretches: the reader stops at it, so the points after it are lost and the
    warning says how many."""
    head = _event_file_bytes(tmp_path / "a", [(s, 1.0) for s in STEPS[:3]], t0=1000)
    tail = _event_file_bytes(tmp_path / "b", [(s, 2.0) for s in STEPS[3:]], t0=2000)
    garbage = np.random.default_rng(0).bytes(40)
    f = _seed_dir(tmp_path / "runs", 0) / "events.out.tfevents.1.host"
    f.write_bytes(head + garbage + tail)
    scan = compare.scan_event_file(f)
    assert (scan.damage_at, scan.unreadable_bytes) == (len(head), len(garbage))
    assert scan.n_points == len(STEPS) and scan.points_after_damage == len(STEPS) - 3
    with pytest.warns(UserWarning, match=r"damaged at byte") as record:
        df = compare.load_runs(tmp_path / "runs")
    msg = str(record[0].message)
    assert str(f) in msg and f"{len(STEPS) - 3} scalar point(s) in intact records after it are lost" in msg
    assert f"the {len(garbage)} unreadable byte(s)" in msg and msg.endswith("; 3 kept")
    assert list(df["step"]) == STEPS[:3]


def test_random_bytes_event_file_is_named_and_its_run_left_out(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    _write(_seed_dir(runs, 0), {METRIC: [(s, 1.0) for s in STEPS]}, t0=1000)
    junk = _seed_dir(runs, 1) / "events.out.tfevents.2.host"
    junk.write_bytes(np.random.default_rng(1).bytes(3000))
    with pytest.warns(UserWarning) as record:
        assert compare.main([str(runs / "cave"), "--out", str(tmp_path / "out"), "--reps", "10"]) == 0
    msgs = [str(w.message) for w in record]
    assert f"{junk}: not a readable TensorBoard event file (no intact record in its 3000 bytes); skipped" in msgs
    assert "run cave/efla/seed1 has no readable scalars in its 1 event file(s); left out" in msgs
    assert "| efla | 1 |" in capsys.readouterr().out  # the intact seed alone
    # an intact file gives no warning at all
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare.load_runs(runs / "cave" / "efla" / "seed0")


def test_payload_checksum_failure_is_counted(tmp_path: Path) -> None:
    """A flipped byte inside one record's event (its framing intact) fails that record's checksum: the reader
    stops there, and the warning counts the points it did not return."""
    import struct

    data = bytearray(_event_file_bytes(tmp_path / "src", [(s, float(s)) for s in STEPS], t0=1000))
    offsets, pos = [], 0
    while pos < len(data):  # record = length (8) + its CRC (4) + event + event CRC (4)
        offsets.append(pos)
        pos += 16 + struct.unpack_from("<Q", data, pos)[0]
    assert len(offsets) == 1 + len(STEPS)  # the file-version record, then one record per point
    bad = offsets[5]  # the fifth point's record
    data[bad + 12 + struct.unpack_from("<Q", data, bad)[0] - 1] ^= 0xFF  # last byte of its event: the value
    f = _seed_dir(tmp_path / "runs", 0) / "events.out.tfevents.1.host"
    f.write_bytes(bytes(data))
    assert compare.scan_event_file(f).damage_at is None  # the framing is intact
    with pytest.warns(UserWarning) as record:
        df = compare.load_runs(tmp_path / "runs")
    (msg,) = [str(w.message) for w in record]
    assert msg == (f"{f}: {len(STEPS) - 4} of {len(STEPS)} scalar point(s) could not be read (a record fails its "
                   "checksum, and the reader stops there); 4 kept")
    assert list(df["step"]) == STEPS[:4]


@pytest.mark.parametrize("seeds", [1, 2])
def test_the_curves_show_a_reference_level_and_do_not_call_one_seed_a_spread(tmp_path, monkeypatch, seeds):
    """``references`` draws a dotted level per panel (the memory report's random actions), in a colour no variant
    has (``none`` is grey); a figure of one seed per variant says so instead of "mean ± std across seeds"."""
    from matplotlib.colors import to_rgb

    from rlseq.compare import plots

    shown = {}

    def keep(fig, handles, path):
        shown.update(title=fig._suptitle.get_text(), labels=list(handles),
                     levels=[line.get_ydata()[0] for ax in fig.axes for line in ax.get_lines()
                             if line.get_label() == "random actions"],
                     colours={(line.get_label(), to_rgb(line.get_color())) for ax in fig.axes
                              for line in ax.get_lines()})

    monkeypatch.setattr(plots, "_finish", keep)
    rows = [{"env": env, "variant": variant, "seed": s, "step": step, "tag": compare.DEFAULT_METRIC,
             "value": float(step)}
            for env in ("A", "B") for variant in ("efla", "none") for s in range(seeds) for step in (0, 10, 20)]
    plots.plot_curves(pd.DataFrame(rows), tmp_path / "c.png", references={"A": -0.5})
    assert "random actions" in shown["labels"] and shown["levels"] == [-0.5]  # panel A only
    (chance,) = {c for label, c in shown["colours"] if label == "random actions"}
    # told apart by eye: grey (#808080) against `none`'s #7f7f7f would differ as strings and not on the page
    assert all(max(abs(a - b) for a, b in zip(chance, c)) > 0.25
               for label, c in shown["colours"] if label != "random actions")
    assert shown["title"].endswith("one seed" if seeds == 1 else "mean ± std across seeds")
