"""The sweep runner: grid expansion and validation, and tiny CPU sweeps run end to end (finish, skip, resume, fail)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import rlseq.sweep as S
from rlseq import reaper
from tests.helpers import START_LIMIT_S, wait_for

REPO = Path(__file__).resolve().parents[1]
SCALES = REPO / "configs" / "experiments" / "caveflyer_scales.yml"
# the TINY flags of test_train.py, as sweep-file flags
TINY = {"n_envs": 2, "n_steps": 16, "n_minibatches": 2, "n_epochs": 1, "num_threads": 0}


@pytest.fixture(autouse=True)
def _children_import_rlseq(monkeypatch):
    """Training processes started by the sweep import rlseq from this checkout, whatever their working directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _sweep_file(tmp_path: Path, name: str = "tiny", **overrides) -> Path:
    spec = {"logdir": str(tmp_path / "runs"), "envs": ["caveflyer"], "memories": ["efla"], "seeds": [0],
            "conditions": {"tiny": {}}, "flags": {"total_steps": 32, **TINY}}
    spec.update(overrides)
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _status(tmp_path: Path, name: str = "tiny") -> dict[str, dict]:
    doc = json.loads((tmp_path / "runs" / f"sweep-{name}.json").read_text())
    assert doc["sweep"] == name
    return {r["name"]: r for r in doc["runs"]}


def _cpu(path: Path, *extra: str) -> list[str]:
    return [str(path), "--gpus", "none", "--threads-per-run", "1", *extra]


# --- the grid -------------------------------------------------------------------------------------------


def test_the_caveflyer_scales_experiment_expands_to_36_runs_seed_major():
    spec = S.load_sweep(SCALES)
    runs = S.expand(spec)
    memories, conditions = ["efla", "deltanet", "lstm", "none"], ["standard", "reward1e3", "value1e4"]
    assert len(runs) == 36
    assert [(r.seed, r.condition, r.memory) for r in runs] == [
        (s, c, m) for s in (0, 1, 2) for c in conditions for m in memories]
    assert len({r.folder for r in runs}) == 36
    cond_flags = {
        "standard": ["--normalize-reward"],
        "reward1e3": ["--reward-scale", "1000.0", "--prev-action-reward", "--no-normalize-reward"],
        "value1e4": ["--value-shift", "10000.0", "--no-normalize-reward"],
    }
    for r in runs:
        assert r.env == "caveflyer"
        assert r.folder == Path("runs") / "caveflyer" / f"{r.memory}-{r.condition}" / f"seed{r.seed}"
        assert r.argv == ["--env", "caveflyer", "--memory", r.memory, "--seed", str(r.seed), "--tag", r.condition,
                          "--logdir", "runs", "--total-steps", "5000000", "--tf32", "--checkpoint-every", "500000",
                          "--num-threads", "4", *cond_flags[r.condition]]
    # the argv is what the training CLI reads: the condition's values arrive in the resolved config
    from rlseq.train import build_parser, resolve

    cfg = resolve(build_parser().parse_args(next(r for r in runs if r.condition == "reward1e3").argv))
    assert cfg["reward_scale"] == 1000.0 and cfg["prev_action_reward"] is True and cfg["normalize_reward"] is False
    assert cfg["n_timesteps"] == 5_000_000 and cfg["checkpoint_every"] == 500_000
    assert cfg["env_kwargs"]["num_threads"] == 4
    assert S.expand(spec, logdir="/elsewhere")[0].folder == Path("/elsewhere/caveflyer/efla-standard/seed0")


def test_only_filters_select_a_subset_and_reject_unknown_names(capsys):
    spec = S.load_sweep(SCALES)
    runs = S.expand(spec, S._parse_only(["memory=efla,deltanet", "condition=reward1e3"]))
    assert [r.name for r in runs] == [f"caveflyer/{m}-reward1e3/seed{s}" for s in (0, 1, 2) for m in ("efla", "deltanet")]
    assert [r.name for r in S.expand(spec, S._parse_only(["seed=2", "memory=none", "env=caveflyer"]))] == [
        f"caveflyer/none-{c}/seed2" for c in ("standard", "reward1e3", "value1e4")]
    with pytest.raises(S.SweepError, match="unknown filter 'mem'; valid filters: env, memory, seed, condition"):
        S.expand(spec, {"mem": {"efla"}})
    with pytest.raises(S.SweepError, match="valid memory values: efla, deltanet, lstm, none"):
        S.expand(spec, {"memory": {"transformer"}})
    with pytest.raises(S.SweepError, match="valid seed values: 0, 1, 2"):
        S.expand(spec, {"seed": {"0", "7"}})
    with pytest.raises(S.SweepError, match="KEY=V1,V2"):
        S._parse_only(["memory"])
    assert S.main([str(SCALES), "--dry-run", "--only", "memory=lstm", "--only", "seed=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"python -m rlseq.train {' '.join(r.argv)} --resume"
                     for r in S.expand(spec, {"memory": {"lstm"}, "seed": {"1"}})]
    assert len(lines) == 3


@pytest.mark.parametrize("flags", [["--cpus-per-run", "nan"], ["--cpus-per-run", "inf"], ["--gpus-per-run", "nan"],
                                   ["--runs-per-gpu", "0"], ["--retries", "-1"]], ids=lambda f: " ".join(f))
def test_bad_resource_flags_are_one_error_line_before_ray_starts(flags, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(S, "_start_ray", lambda *a, **k: pytest.fail("Ray was started"))
    assert S.main(_cpu(_sweep_file(tmp_path), *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --") and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def test_a_list_is_repeated_for_a_repeatable_flag_only():
    from rlseq.train import build_parser

    known = build_parser()._option_string_actions
    assert S._flag_argv({"env_package": ["a", "b"]}, known) == ["--env-package", "a", "--env-package", "b"]
    with pytest.raises(S.SweepError, match="flag 'n_envs' takes one value"):
        S._flag_argv({"n_envs": [4]}, known)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"memory": ["efla"]}, r"unknown keys memory; valid keys: "),
        ({"memories": ["efla", "transformer"]}, "unknown memory 'transformer'; valid memories: efla, deltanet, gru, lstm, none"),
        ({"flags": {"total_steps": 32, "learning_rat": 1e-3}}, "unknown train flag 'learning_rat'; flags of python -m rlseq.train: .*learning_rate"),
        ({"flags": {"tf33": False}}, "unknown train flag 'tf33'"),  # a false on/off flag is checked too
        ({"flags": {"seed": 3}}, "flag 'seed' is set by the sweep"),
        ({"conditions": {"a": {"logdir": "x"}}}, "flag 'logdir' is set by the sweep"),
        ({"seeds": []}, "'seeds' must be a non-empty list"),
        ({"conditions": {"a": {"n_envs": 3}}}, "run caveflyer/efla-a/seed0: --n-minibatches 2 must divide --n-envs 3"),
        ({"seeds": [0, 1, 0]}, "names run caveflyer/efla-tiny/seed0 twice"),
        ({"flags": [1, 2]}, "'flags' must be a mapping"),
        ({"flags": {"n_steps": [16, 32]}}, r"flag 'n_steps' takes one value, got the list \[16, 32\]; to train "
                                           "several values, make each one a condition"),
        ({"conditions": {"a": {"learning_rate": [1e-3]}}}, "flag 'learning_rate' takes one value"),
        ({"runs_per_gpu": True}, "'runs_per_gpu' must be an integer >= 1, got True"),
    ],
)
def test_a_bad_sweep_file_fails_before_anything_runs(overrides, message, tmp_path, capsys, monkeypatch):
    path = _sweep_file(tmp_path, **overrides)
    with pytest.raises(S.SweepError, match=message):
        S.expand(S.load_sweep(path))
    monkeypatch.setattr(S.subprocess, "Popen", lambda *a, **k: pytest.fail("a run was started"))
    assert S.main(_cpu(path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("error: ") == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("content,message", [
    (b"envs: [caveflyer\nmemories: [efla]\n", "is not valid YAML at line 2"),
    (b"\xff\xfe\x00e\x00n\x00v\x00", "is not a UTF-8 text file"),
    (b"envs: !!python/object/apply:os.system ['true']\n", "!!python tags are not read"),
    (b"envs: [caveflyer, null]\nmemories: [efla]\nseeds: [0]\n", "'envs' must list plain names or numbers"),
    (b"envs: [caveflyer]\nmemories: [efla]\nseeds:\n  -\n", "'seeds' must list plain names or numbers"),
    (b"envs: [caveflyer]\nmemories: [efla]\nseeds: [0]\nflags: {config: DIR}\n", "config file DIR is a directory"),
])
def test_a_sweep_file_that_is_not_a_grid_is_one_error_line(content, message, tmp_path, capsys):
    path = tmp_path / "bad.yml"
    path.write_bytes(content.replace(b"DIR", str(tmp_path).encode()))
    assert S.main(_cpu(path, "--dry-run")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message.replace("DIR", str(tmp_path)) in lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_logdir_that_is_a_file_is_one_error_line(tmp_path, capsys):
    (tmp_path / "runs").write_text("notes\n")
    assert S.main(_cpu(_sweep_file(tmp_path))) == 2
    assert capsys.readouterr().err == (f"error: logdir {tmp_path / 'runs'}: {tmp_path / 'runs'} is a file; give a "
                                       "folder (or a path that does not exist yet)\n")
    assert (tmp_path / "runs").read_text() == "notes\n"


def test_a_sweep_path_that_is_a_directory_is_one_error_line(tmp_path, capsys):
    assert S.main([str(tmp_path), "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: sweep file {tmp_path} is a directory; give the YAML file in it\n"


def test_missing_sweep_file_and_bad_parallelism(tmp_path, capsys):
    assert S.main([str(tmp_path / "nope.yml"), "--dry-run"]) == 2
    assert "error: sweep file" in capsys.readouterr().err
    assert S.main(_cpu(_sweep_file(tmp_path), "--parallel", "0")) == 2
    assert "--parallel must be >= 1" in capsys.readouterr().err


def test_gpus_and_the_resources_each_run_asks_of_ray(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert S._parse_gpus("0,1") == ["0", "1"] and S._parse_gpus(" 3 ") == ["3"] and S._parse_gpus("none") is None
    for bad in ("gpu0", "", ",", "0,a", "-1", "0;1"):
        with pytest.raises(S.SweepError, match="--gpus takes all, none or comma-separated GPU indices"):
            S._parse_gpus(bad)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(S.SweepError, match="no CUDA device is visible"):
        S._parse_gpus("all")
    # "all" hands Ray the GPUs this process sees, not physical indices
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert S._parse_gpus("all") == ["3", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert S._parse_gpus("all") == ["0", "1"]
    assert S.main([str(SCALES), "--gpus", "1,x"]) == 2
    assert "error: --gpus takes" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # indices on a host without a GPU
    with pytest.raises(S.SweepError, match="--gpus 0: no CUDA device is visible"):
        S._parse_gpus("0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    class FakeRay:  # what _plan reads of a cluster
        def __init__(self, *nodes):
            self._nodes = [{"Alive": alive, "Resources": r} for alive, r in nodes]

        def nodes(self):
            return self._nodes

    two_gpus = FakeRay((True, {"CPU": 16.0, "GPU": 2.0}), (True, {"CPU": 4.0}), (False, {"CPU": 64.0, "GPU": 8.0}))
    # runs_per_gpu 3: a third of a GPU each, 6 runs on the GPU node; the CPU-only node holds none
    assert S._plan(two_gpus, S.Resources(runs_per_gpu=3, gpus=["0", "1"])) == (pytest.approx(1 / 3), 6)
    assert S._plan(two_gpus, S.Resources(cpus_per_run=4, gpus_per_run=0.5, address="auto")) == (0.5, 4)
    assert S._plan(two_gpus, S.Resources(cpus_per_run=2, gpus=None)) == (0.0, 10)  # --gpus none: the CPUs only
    with pytest.raises(S.SweepError, match="no Ray node can hold a run of 32 CPU and 0 GPU"):
        S._plan(two_gpus, S.Resources(cpus_per_run=32, gpus=None))
    for bad in (["--cpus-per-run", "0"], ["--gpus-per-run", "-1"], ["--retries", "-1"],
                ["--address", "auto", "--gpus", "0"], ["--address", "auto", "--parallel", "2"]):
        assert S.main([str(SCALES), *bad]) == 2
        assert capsys.readouterr().err.startswith("error: ")


def test_an_address_where_nothing_answers_is_one_error_line_before_ray_starts(capsys, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(S, "_start_ray", lambda res: pytest.fail("Ray must not start"))
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        assert S.main([str(SCALES), "--address", address]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --address {address}: nothing answers there") and err.count("\n") == 1
    with socket.socket() as server:  # a listening port passes the check
        server.bind(("127.0.0.1", 0))
        server.listen()
        S._check_reachable(f"127.0.0.1:{server.getsockname()[1]}")
    S._check_reachable("auto")  # Ray's own discovery: left to Ray


def test_a_loopback_address_keeps_ray_on_the_loopback_only_where_the_head_listens_only_there(monkeypatch):
    answering: set[str] = set()
    monkeypatch.setattr(S, "_routable_ip", lambda: "192.0.2.7")
    monkeypatch.setattr(S, "_answers", lambda host, port, timeout_s=2.0: host in answering)
    head = S.Resources(address="127.0.0.1:6379")
    assert S._ray_env(head) == S.LOOPBACK_ONLY  # `ray start --head --node-ip-address 127.0.0.1`
    assert S._ray_env(S.Resources(address="localhost:6379")) == S.LOOPBACK_ONLY
    assert S._ray_env(S.Resources(address="ray://127.0.0.1:10001")) == {}  # Ray Client rewrites nothing
    answering.add("192.0.2.7")  # a plain `ray start --head`: Ray's own rewrite reaches it
    assert S._ray_env(head) == {}
    assert S._ray_env(S.Resources(address="10.1.2.3:6379")) == {} and S._ray_env(S.Resources(address="auto")) == {}
    assert S._ray_env(S.Resources(gpus=["1", "3"])) == {**S.LOOPBACK_ONLY, "CUDA_VISIBLE_DEVICES": "1,3"}
    monkeypatch.setattr(S, "_routable_ip", lambda: "127.0.0.1")  # no route outwards: Ray rewrites nothing
    assert S._ray_env(S.Resources(address="127.0.0.1:6379")) == {}


@pytest.mark.parametrize("env,expected", [(S.LOOPBACK_ONLY, "127.0.0.1:6379"), ({}, "192.0.2.7:6379")])
def test_the_loopback_switch_is_what_stops_ray_rewriting_a_loopback_address(env, expected):
    # Ray's own canonicalisation of the address ray.init is given, on a host whose routable address is 192.0.2.7
    code = ("from ray._private import services as s; s.node_ip_address_from_perspective = lambda *a, **k: "
            "'192.0.2.7'; print(s.canonicalize_bootstrap_address('127.0.0.1:6379'))")
    base = {k: v for k, v in os.environ.items() if k not in S.LOOPBACK_ONLY}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip().splitlines()[-1] == expected, out.stderr[-2000:]


# --- tiny sweeps on the CPU -----------------------------------------------------------------------------
# These sweeps train, on a POPGym env: its trainer starts ~2 s sooner than procgen's caveflyer with its IMPALA CNN,
# and what they test is the sweep around its trainer processes. Caveflyer runs of the training CLI are tested in
# tests/test_train.py; the caveflyer sweep files' runs and flags (procgen's --num-threads too) in the grid tests above.
ENV = "popgym-RepeatPreviousEasy-v0"
TRAIN = {k: v for k, v in TINY.items() if k != "num_threads"}  # --num-threads is a procgen option


def _training_sweep(tmp_path: Path, flags: dict | None = None, **overrides) -> Path:
    return _sweep_file(tmp_path, envs=[ENV], flags={"total_steps": 32, **TRAIN, **(flags or {})}, **overrides)



def test_a_tiny_sweep_runs_in_parallel_and_a_second_invocation_starts_nothing(tmp_path, capsys):
    path = _training_sweep(tmp_path, memories=["efla", "none"])
    assert S.main(_cpu(path, "--parallel", "2")) == 0
    out = capsys.readouterr().out
    assert "2 runs, 0 finished already, 2 to run on 2 slots" in out and "2 finished, 0 failed" in out
    runs = tmp_path / "runs" / ENV
    folders = [runs / "efla-tiny" / "seed0", runs / "none-tiny" / "seed0"]
    status = _status(tmp_path)
    assert list(status) == [f"{ENV}/efla-tiny/seed0", f"{ENV}/none-tiny/seed0"]
    for folder, row in zip(folders, status.values()):
        assert (folder / "final_model.zip").exists() and (folder / "config.yaml").exists()
        assert list(folder.glob("events.out.tfevents.*"))
        log = (folder / "train.log").read_text()
        assert "--resume --no-progress-bar --device cpu" in log and "done: 32 env steps" in log
        assert row["state"] == "done" and row["returncode"] == 0 and row["steps"] == 32 and row["gpu"] is None
        assert row["folder"] == str(folder) and row["log_tail"] == [] and row["seconds"] > 0
    # both ran at once: each started before the other ended
    (a, b) = status.values()
    assert a["started"] < b["started"] + b["seconds"] and b["started"] < a["started"] + a["seconds"]

    before = {f: f.stat().st_mtime_ns for d in folders for f in d.rglob("*") if f.is_file()}
    assert S.main(_cpu(path, "--parallel", "2")) == 0
    out = capsys.readouterr().out
    assert "2 runs, 2 finished already, 0 to run" in out and "start " not in out
    assert {f: f.stat().st_mtime_ns for d in folders for f in d.rglob("*") if f.is_file()} == before
    assert [r["state"] for r in _status(tmp_path).values()] == ["finished", "finished"]
    assert S.main([str(path), "--status"]) == 0
    *lines, summary = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in lines] == ["finished", "finished"]
    assert summary == "2 runs: 2 finished, 0 interrupted, 0 not started"
    assert S.main([str(path), "--dry-run"]) == 0
    assert all(line.endswith("--resume (finished)") for line in capsys.readouterr().out.splitlines())


def test_a_stopped_sweep_resumes_its_run_from_the_last_checkpoint(tmp_path, capsys):
    # a budget the run cannot finish before the signal reaches it through Ray
    path = _training_sweep(tmp_path, flags={"total_steps": 100_000, "checkpoint_every": 32})
    run = tmp_path / "runs" / ENV / "efla-tiny" / "seed0"
    latest = run / "checkpoints" / "latest"
    sweep = subprocess.Popen([sys.executable, "-m", "rlseq.sweep", *_cpu(path)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait_for(latest.exists, sweep)
        assert sweep.poll() is None, f"the sweep ended before it could be stopped: {sweep.stdout.read().decode()[-3000:]}"
        assert latest.exists(), f"no checkpoint within {START_LIMIT_S} s"
        sweep.send_signal(signal.SIGTERM)  # the sweep passes it on to the training process
        out = sweep.communicate(timeout=60)[0].decode()
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert sweep.returncode == 1, out
    assert "0 finished, 0 failed, 1 not run (stopped)" in out
    assert not (run / "final_model.zip").exists(), "the run finished before the signal reached it"
    saved = int(latest.read_text().strip()[len("step"):])
    assert 32 <= saved < 100_000
    row = _status(tmp_path)[f"{ENV}/efla-tiny/seed0"]
    # the training process checkpoints on SIGTERM and exits 128 + SIGTERM
    assert row["state"] == "stopped" and row["returncode"] == 128 + signal.SIGTERM and row["steps"] == saved
    assert S.main([str(path), "--status"]) == 0
    assert f"interrupted at {saved} steps (checkpoint)" in capsys.readouterr().out

    # the budget may change on resume: two more rollouts finish the run
    total = saved + 64
    _training_sweep(tmp_path, flags={"total_steps": total, "checkpoint_every": 32})
    assert S.main(_cpu(path)) == 0
    assert f"from step {saved}" in capsys.readouterr().out
    log = (run / "train.log").read_text()
    assert f"resuming {run} from step{saved} ({saved} env steps done)" in log
    assert f"done: {total} env steps" in log and log.count("=== ") == 2
    row = _status(tmp_path)[f"{ENV}/efla-tiny/seed0"]
    assert row["state"] == "done" and row["steps"] == total
    from rlseq.algos import MemoryPPO

    assert MemoryPPO.load(run / "final_model.zip", device="cpu").num_timesteps == total


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_sweep_started_in_the_background_stops_its_trainer_on_a_signal(tmp_path, sig):
    """``python -m rlseq.sweep ... &`` in a script: the shell starts it with SIGINT ignored, which Ray's workers
    inherit, and Ray's cancel (an interrupt of the task's thread) does nothing where SIGINT is ignored. The
    trainer must still get its SIGTERM, checkpoint and exit 128 + SIGTERM, on either signal to the sweep."""
    path = _training_sweep(tmp_path, flags={"total_steps": 100_000, "checkpoint_every": 32})
    run = tmp_path / "runs" / ENV / "efla-tiny" / "seed0"
    latest = run / "checkpoints" / "latest"
    sweep = subprocess.Popen([sys.executable, "-m", "rlseq.sweep", *_cpu(path)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=dict(os.environ),
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `&` does
    try:
        wait_for(latest.exists, sweep)
        assert sweep.poll() is None, f"the sweep ended before it could be stopped: {sweep.stdout.read().decode()[-3000:]}"
        if not latest.exists():
            sweep.kill()
            pytest.fail(f"no checkpoint within {START_LIMIT_S} s: {sweep.communicate()[0].decode()[-3000:]}")
        sweep.send_signal(sig)
        # well inside the sweep's 60 s grace, after which it would kill the task and its trainer with it
        out = sweep.communicate(timeout=45)[0].decode()
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert sweep.returncode == 1 and "0 finished, 0 failed, 1 not run (stopped)" in out, out
    assert not (run / "final_model.zip").exists(), "the run trained to its end"
    row = _status(tmp_path)[f"{ENV}/efla-tiny/seed0"]
    assert row["state"] == "stopped" and row["returncode"] == 128 + signal.SIGTERM, row
    assert "stopped by SIGTERM: checkpoint step" in (run / "train.log").read_text()  # its stop checkpoint


def test_a_failed_run_is_recorded_with_its_log_and_the_others_still_run(tmp_path, capsys):
    # a run whose trainer refuses to start although its flags are fine (so the sweep's own checks pass): its only
    # checkpoint is torn. The first run (seed-major, then the file's condition order) exits non-zero, and the
    # next one still runs in the one slot
    path = _training_sweep(tmp_path, memories=["none"], conditions={"broken": {}, "ok": {}})
    torn = tmp_path / "runs" / ENV / "none-broken" / "seed0" / "checkpoints"
    (torn / "step16").mkdir(parents=True)
    (torn / "step16" / "model.zip").write_text("not a zip\n")
    (torn / "latest").write_text("step16\n")
    assert S.main(_cpu(path, "--parallel", "1")) == 1
    out = capsys.readouterr().out
    assert f"failed {ENV}/none-broken/seed0  rc=2" in out and "1 finished, 1 failed" in out
    broken, ok = _status(tmp_path).values()
    assert broken["name"] == f"{ENV}/none-broken/seed0" and broken["state"] == "failed"
    assert broken["returncode"] == 2 and broken["attempts"] == 1  # a usage error is not retried
    assert any(f"no checkpoint in {torn} is intact" in line for line in broken["log_tail"])
    assert ok["state"] == "done" and ok["returncode"] == 0 and ok["steps"] == 32
    assert ok["started"] >= broken["started"] + broken["seconds"]
    assert not (Path(broken["folder"]) / "final_model.zip").exists()
    assert (Path(ok["folder"]) / "final_model.zip").exists()


def _alive(pid: int) -> bool:
    return reaper._stat(pid) is not None  # a zombie has ended


@pytest.mark.parametrize("code,rc,stopped", [("raise SystemExit(143)", 143, True), ("raise SystemExit(130)", 130, True),
                                             ("import os; os.kill(os.getpid(), 15)", -15, True),
                                             ("raise SystemExit(1)", 1, False)])
def test_a_trainer_stopped_by_a_signal_is_not_retried(tmp_path, code, rc, stopped):
    # rlseq.train catches SIGINT/SIGTERM, saves and exits 128 + the signal: stopped, like one that died of it
    assert S._train_once([sys.executable, "-c", code], dict(os.environ), None, tmp_path, poll_s=0.05) == (rc, stopped)


def test_a_trainer_runs_in_a_session_of_its_own_so_a_group_signal_reaches_it_only_through_its_supervisor(tmp_path):
    # a trainer told twice (by the group's signal, then by the worker passing it on) would stop at once, short of
    # its stop checkpoint
    code = f"import os; open({str(tmp_path / 'ids')!r}, 'w').write(f'{{os.getsid(0)}} {{os.getpgid(0)}} {{os.getpid()}}')"
    assert S._train_once([sys.executable, "-c", code], dict(os.environ), None, tmp_path, poll_s=0.05) == (0, False)
    sid, pgid, pid = map(int, (tmp_path / "ids").read_text().split())
    assert sid == pgid == pid and sid != os.getsid(0) and pgid != os.getpgid(0)


def _name(pid: int) -> str:
    try:
        return f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    except OSError:
        return str(pid)


def _lock_holder_after(folder: Path, seconds: float) -> str | None:
    """Wait up to ``seconds`` for the run-folder lock of ``folder`` to be free; None once it is, else its holder.

    The lock, not /proc, says when a trainer is gone: its leader shows as a zombie while its other threads still
    exit and still hold the lock's descriptor."""
    from rlseq.checkpoint import folder_lock

    deadline = time.monotonic() + seconds
    while True:
        with folder_lock(folder) as holder:
            if holder is None or time.monotonic() > deadline:
                return holder
        time.sleep(0.1)


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl")
def test_a_killed_sweep_takes_its_training_processes_with_it(tmp_path):
    from rlseq.checkpoint import LOCK_NAME

    path = _training_sweep(tmp_path, flags={"total_steps": 1_000_000})
    run = tmp_path / "runs" / ENV / "efla-tiny" / "seed0"
    ray_processes: dict[int, int] = {}
    sweep = subprocess.Popen([sys.executable, "-m", "rlseq.sweep", *_cpu(path)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=dict(os.environ))
    pid = None
    try:
        lock = run / LOCK_NAME
        wait_for(lambda: lock.exists() and bool(lock.read_text().strip()), sweep)  # its pid, once it trains
        assert sweep.poll() is None, f"the sweep ended (exit {sweep.returncode}) before its trainer started"
        assert lock.exists() and lock.read_text().strip(), f"the training process did not start within {START_LIMIT_S} s"
        pid = int(lock.read_text().split()[1])  # "pid N on HOST"
        assert pid != sweep.pid and _alive(pid)
        ray_processes = reaper.descendants(sweep.pid)  # GCS, raylet, its agents and workers, the reaper
        time.sleep(3 * reaper.POLL_S)  # the reaper's own list has taken in all of these
        sweep.kill()  # SIGKILL: the sweep cannot pass anything on
        sweep.wait()
        holder = _lock_holder_after(run, 60)  # free: every trainer of the sweep has ended (a retry included)
        assert holder is None, f"the training process outlived its sweep: {holder} (the first was pid {pid})"
        assert not _alive(pid)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(reaper._same(p, t) for p, t in ray_processes.items()):
            time.sleep(0.1)
        left = [_name(p) for p, t in ray_processes.items() if reaper._same(p, t)]
        assert not left, f"the killed sweep's Ray processes live on: {left}"
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
        if pid is not None and _alive(pid):  # a failed check must not leave it training
            os.kill(pid, signal.SIGKILL)
        for p, t in ray_processes.items():  # nor leave the processes it looked for
            if reaper._same(p, t):
                os.kill(p, signal.SIGKILL)


def test_two_sweeps_over_one_tree_train_each_run_once_and_record_none_as_failed(tmp_path):
    # two terminals (or two hosts on a shared disk) start the same sweep at once: each run is trained by one of
    # them; the other finds it finished, or held by the first one ("elsewhere"), and never records it as failed
    popgym = "popgym-RepeatPreviousEasy-v0"
    path = _sweep_file(tmp_path, envs=[popgym], memories=["none"], seeds=[0, 1, 2],
                       flags={"total_steps": 64, "n_envs": 2, "n_steps": 16, "n_minibatches": 1, "n_epochs": 1})
    names = [f"{popgym}/none-tiny/seed{s}" for s in (0, 1, 2)]
    argv = [sys.executable, "-m", "rlseq.sweep", *_cpu(path, "--parallel", "1", "--no-progress")]
    sweeps = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        outs = [s.communicate(timeout=600)[0] for s in sweeps]
    finally:
        for s in sweeps:
            if s.poll() is None:
                s.kill()
                s.wait()
    ended = []  # (sweep, state, run) of each "<state> <run>" line a sweep prints when a run's task ends
    for i, out in enumerate(outs):
        ended += [(i, line.split()[0], line.split()[1]) for line in out.splitlines()
                  if len(line.split()) > 1 and line.split()[1] in names]
    assert not [e for e in ended if e[1] == "failed"], outs
    for i in range(2):  # each sweep accounts for every run once
        assert sorted(run for j, state, run in ended if j == i and state != "start") == names, outs[i]
    for name in names:
        trained = [i for i, state, run in ended if run == name and state == "done"]
        assert len(trained) == 1, (name, outs)  # one sweep trained it; the other one did not claim it
        log = (tmp_path / "runs" / name / "train.log").read_text()
        assert log.count("done: 64 env steps") == 1, log
    assert any(state in ("elsewhere", "finished") for _, state, _ in ended), "the sweeps did not overlap: " + \
        "\n".join(outs)
    # each sweep exits 0 unless a run was still training elsewhere when it ended (1, and said so)
    for s, out in zip(sweeps, outs):
        assert s.returncode == 0 or (s.returncode == 1 and "running elsewhere" in out.splitlines()[-1]), out
    assert 0 in [s.returncode for s in sweeps], outs  # the later one saw the grid finished
    # the status file holds what the sweep that ended last saw: every run finished
    status = _status(tmp_path)
    assert list(status) == names and all(row["state"] in ("done", "finished") for row in status.values()), status


def test_status_ends_with_the_counts(tmp_path, capsys):
    folders = [tmp_path / name for name in ("a", "b", "c")]
    (folders[0] / "checkpoints" / "step64").mkdir(parents=True)
    (folders[0] / "checkpoints" / "latest").write_text("step64\n")
    folders[1].mkdir()
    (folders[1] / "final_model.zip").write_bytes(b"")
    runs = [S.Run(env="caveflyer", memory="efla", seed=i, condition="c", argv=[], folder=f)
            for i, f in enumerate(folders)]
    S.print_status(runs)
    assert capsys.readouterr().out.splitlines()[-1] == "3 runs: 1 finished, 1 interrupted, 1 not started"
