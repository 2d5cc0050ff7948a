"""Training runs lose no work and change nothing silently: resuming from broken checkpoints, changed settings,
SIGINT/SIGTERM, config validation, TensorBoard curves of resumed runs, resumed env seeds, held-out evaluation,
leftovers of killed saves, and --resume of a run folder that does not exist."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from rlseq.train import main as train_main

ENV = "popgym-RepeatPreviousEasy-v0"
BASE = ["--env", ENV, "--memory", "none", "--n-envs", "2", "--n-steps", "8", "--n-minibatches", "1", "--n-epochs", "1",
        "--checkpoint-every", "16", "--normalize-reward", "--no-progress-bar"]
REPO = Path(__file__).resolve().parents[1]


def _argv(logdir: Path, total: int, *extra: str) -> list[str]:
    return [*BASE, "--logdir", str(logdir), "--total-steps", str(total), *extra]


def _folder(logdir: Path) -> Path:
    return logdir / ENV / "none" / "seed0"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A logdir whose run trained 48 steps: checkpoints step32 and step48, final_model.zip."""
    logdir = tmp_path_factory.mktemp("base")
    train_main(_argv(logdir, 48))
    assert sorted(p.name for p in (_folder(logdir) / "checkpoints").glob("step*")) == ["step32", "step48"]
    return logdir


@pytest.fixture
def interrupted(finished, tmp_path) -> Path:
    """A copy of the finished run without its final model: a run killed at step 48."""
    logdir = tmp_path / "runs"
    shutil.copytree(finished, logdir)
    (_folder(logdir) / "final_model.zip").unlink()
    return logdir


def _steps(model_path: Path) -> int:
    from rlseq.algos import MemoryPPO

    return MemoryPPO.load(model_path, device="cpu").num_timesteps


def _checkpoints(logdir: Path) -> list[str]:
    return sorted((p.name for p in (_folder(logdir) / "checkpoints").glob("step*")), key=lambda n: int(n[4:]))


# --- 1. a bad `latest` pointer -------------------------------------------------------------------------------


def _no_model_step(ckpt: Path) -> None:
    """What a crash inside save_checkpoint before model.zip was written could leave, named by latest."""
    (ckpt / "step64").mkdir()
    (ckpt / "step64" / "meta.json").write_text('{"num_timesteps": 64}')
    (ckpt / "latest").write_text("step64\n")


@pytest.mark.parametrize("damage", [
    lambda ckpt: (ckpt / "latest").unlink(),
    lambda ckpt: (ckpt / "latest").write_text(""),
    lambda ckpt: (ckpt / "latest").write_text("step999\n"),
    _no_model_step,
    lambda ckpt: (ckpt / "latest").write_bytes(b"\xff\xfe\x00step\x9c"),
    lambda ckpt: ((ckpt / "latest").unlink(), (ckpt / "latest").mkdir(), (ckpt / "latest" / "x").write_text("x")),
], ids=["deleted", "empty", "missing-step", "step-without-model", "binary", "directory"])
def test_a_bad_latest_pointer_resumes_from_the_newest_intact_checkpoint_and_deletes_none_it_did_not_supersede(
        damage, interrupted, capsys):
    ckpt = _folder(interrupted) / "checkpoints"
    damage(ckpt)
    train_main(_argv(interrupted, 64, "--resume"))
    out, err = capsys.readouterr()
    assert "starting it again from step 0" not in out
    assert "from step48 (48 env steps done)" in out and "latest" in err
    assert _steps(_folder(interrupted) / "final_model.zip") == 64
    # step48 (resumed from) is the one older checkpoint kept; step32 is superseded by it
    assert _checkpoints(interrupted) == ["step48", "step64"]
    assert (ckpt / "step64" / "model.zip").exists() and (ckpt / "latest").read_text().strip() == "step64"
    assert all((moved / "x").read_text() == "x" for moved in ckpt.glob("latest.not-a-file.*"))  # a directory's


@pytest.mark.parametrize("meta", ["null", "[]", '{"files": 5}', '{"files": ["model.zip"], "sizes": [1]}',
                                  '{"files": ["../x"]}', '{"sizes": {"model.zip": "big"}}'])
def test_a_checkpoint_record_of_the_wrong_shape_is_a_torn_checkpoint(meta, interrupted, capsys):
    path = _folder(interrupted) / "checkpoints" / "step48" / "meta.json"
    path.write_text(meta)
    train_main(_argv(interrupted, 64, "--resume"))
    out, err = capsys.readouterr()
    assert f"warning: checkpoint step48 is not usable: {path} is not a checkpoint record (" in err
    assert "from step32 (32 env steps done)" in out
    assert _steps(_folder(interrupted) / "final_model.zip") == 64


# --- 2. a corrupt newest checkpoint --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["model.zip", "rng.pt", "vecnormalize.pkl"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one_naming_the_bad_file(bad, interrupted, capsys):
    path = _folder(interrupted) / "checkpoints" / "step48" / bad
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    train_main(_argv(interrupted, 64, "--resume"))
    out, err = capsys.readouterr()
    assert f"warning: checkpoint step48 is not usable: {path} is unreadable" in err
    assert "from step32 (32 env steps done)" in out
    assert _steps(_folder(interrupted) / "final_model.zip") == 64


def test_a_missing_vecnormalize_file_is_a_broken_checkpoint_not_a_run_without_reward_normalisation(interrupted,
                                                                                                    capsys):
    (_folder(interrupted) / "checkpoints" / "step48" / "vecnormalize.pkl").unlink()
    train_main(_argv(interrupted, 64, "--resume"))
    out, err = capsys.readouterr()
    assert "step48/vecnormalize.pkl is missing" in err and "from step32" in out


def test_no_intact_checkpoint_is_refused_and_nothing_is_deleted(interrupted, capsys, monkeypatch):
    import rlseq.resume as R
    import rlseq.train as T

    ckpt = _folder(interrupted) / "checkpoints"
    for step in ("step32", "step48"):
        (ckpt / step / "rng.pt").write_bytes(b"torn")
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    for module in (T, R):  # a fresh start builds its env in rlseq.train, a resumed run in rlseq.resume
        monkeypatch.setattr(module, "make_env", lambda *a, **k: pytest.fail("an env was built for a refused resume"))
    with pytest.raises(SystemExit) as e:
        train_main(_argv(interrupted, 64, "--resume"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "step48 is not usable" in err and "step32 is not usable" in err and "no checkpoint in" in err
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == before


# --- 3. other settings on --resume ---------------------------------------------------------------------------


def test_resume_with_other_hyperparameters_is_refused_with_every_difference_and_config_yaml_stays_true(
        interrupted, capsys):
    config = _folder(interrupted) / "config.yaml"
    before = config.read_text()
    with pytest.raises(SystemExit) as e:
        train_main(_argv(interrupted, 64, "--resume", "--n-steps", "64", "--learning-rate", "0.1", "--n-envs", "8"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    for line in ("error:   n_steps: 8 in the run, 64 now", "error:   learning_rate: 0.0005 in the run, 0.1 now",
                 "error:   n_envs: 2 in the run, 8 now", "--learning-rate 0.0005 resumes with the run's"):
        assert line in err
    assert config.read_text() == before
    # the budget may grow: recorded as it now is
    train_main(_argv(interrupted, 64, "--resume"))
    assert yaml.safe_load(config.read_text())["n_timesteps"] == 64


def test_resume_without_config_yaml_checks_the_checkpoints_copy_of_the_settings_or_refuses(interrupted, capsys):
    folder = _folder(interrupted)
    (folder / "config.yaml").unlink()
    with pytest.raises(SystemExit) as e:
        train_main(_argv(interrupted, 64, "--resume", "--learning-rate", "0.1", "--n-envs", "8"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:   learning_rate: 0.0005 in the run, 0.1 now" in err and "error:   n_envs: 2 in the run, 8 now" in err
    assert not (folder / "config.yaml").exists()
    step48 = folder / "checkpoints" / "step48"
    saved = {name: (step48 / name).read_bytes() for name in ("config.yaml", "meta.json")}
    meta = json.loads(saved["meta.json"])  # as a checkpoint of an older version: no config.yaml in it
    (step48 / "config.yaml").unlink()
    meta["files"].remove("config.yaml")
    del meta["sizes"]["config.yaml"]
    (step48 / "meta.json").write_text(json.dumps(meta))
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    with pytest.raises(SystemExit) as e:
        train_main(_argv(interrupted, 64, "--resume", "--n-envs", "8"))
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("error:")] == [
        f"error: --resume: {folder / 'config.yaml'} is missing and checkpoint {step48} "
        "holds no copy of the run's settings, so changed flags could not be refused; put the run's config.yaml back, "
        "or start a new run with another --tag"]
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
    for name, data in saved.items():
        (step48 / name).write_bytes(data)
    train_main(_argv(interrupted, 64, "--resume"))
    assert yaml.safe_load((folder / "config.yaml").read_text())["n_envs"] == 2
    assert _steps(folder / "final_model.zip") == 64


def test_a_checkpoints_settings_zeroed_at_their_size_make_it_unusable(interrupted, capsys):
    """A power loss can leave a file of the right size full of zeros: the settings a resume checks must load."""
    path = _folder(interrupted) / "checkpoints" / "step48" / "config.yaml"
    path.write_bytes(bytes(path.stat().st_size))
    train_main(_argv(interrupted, 64, "--resume"))
    out, err = capsys.readouterr()
    assert f"warning: checkpoint step48 is not usable: {path} is unreadable" in err
    assert "from step32 (32 env steps done)" in out


@pytest.mark.parametrize("content", [b"\x00" * 64, b"- 1\n", b"n_envs: [\n"], ids=["zeros", "a-list", "bad-yaml"])
def test_an_unreadable_run_config_is_checked_against_the_checkpoints_copy(interrupted, content, capsys):
    config = _folder(interrupted) / "config.yaml"
    config.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        train_main(_argv(interrupted, 64, "--resume", "--n-envs", "8"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"warning: {config} " in err and "the resumed run's settings are checked against step48's copy" in err
    assert "error:   n_envs: 2 in the run, 8 now" in err
    train_main(_argv(interrupted, 64, "--resume"))
    assert yaml.safe_load(config.read_text())["n_envs"] == 2


def _entry(tmp_path: Path, **settings) -> str:
    path = tmp_path / "entry.yml"
    path.write_text(yaml.safe_dump({ENV: settings}))
    return str(path)


def test_policy_kwargs_given_or_dropped_on_resume_are_refused(interrupted, tmp_path, capsys):
    """A run without policy_kwargs resumed with some (or the other way round) is a change, not a key to skip."""
    config = _folder(interrupted) / "config.yaml"
    assert "policy_kwargs" not in yaml.safe_load(config.read_text())
    with pytest.raises(SystemExit) as e:
        train_main(_argv(interrupted, 64, "--resume", "--config", _entry(tmp_path, policy_kwargs={"net_arch": [16]})))
    assert e.value.code == 2
    assert "error:   policy_kwargs: None in the run, {'net_arch': [16]} now" in capsys.readouterr().err
    settings = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**settings, "policy_kwargs": {"net_arch": [16]}}))
    with pytest.raises(SystemExit) as e:
        train_main(_argv(interrupted, 64, "--resume"))
    assert e.value.code == 2
    assert "error:   policy_kwargs: {'net_arch': [16]} in the run, None now" in capsys.readouterr().err
    config.write_text(yaml.safe_dump({**settings, "policy_kwargs": {}}))  # empty is the same as none
    train_main(_argv(interrupted, 64, "--resume"))
    assert _steps(_folder(interrupted) / "final_model.zip") == 64


def test_a_resume_without_a_budget_keeps_the_runs_budget_and_checkpoint_interval(interrupted, capsys):
    folder = _folder(interrupted)
    settings = yaml.safe_load((folder / "config.yaml").read_text())
    (folder / "config.yaml").write_text(yaml.safe_dump({**settings, "n_timesteps": 64}))  # as a run of 64 steps
    argv = [a for i, a in enumerate(BASE) if "--checkpoint-every" not in BASE[max(i - 1, 0):i + 1]]
    train_main([*argv, "--logdir", str(interrupted), "--resume"])
    out, err = capsys.readouterr()
    assert "note: --resume keeps the run's n_timesteps 64 and checkpoint_every 16" in err
    assert _steps(folder / "final_model.zip") == 64
    assert _checkpoints(interrupted)[-2:] == ["step48", "step64"]
    assert yaml.safe_load((folder / "config.yaml").read_text())["n_timesteps"] == 64


@pytest.mark.parametrize("settings, line", [
    ({"policy_kwargs": {"net_arch": "foo"}},
     "error: the model could not be built with policy_kwargs {'net_arch': 'foo'}: TypeError"),
    ({"env_kwargs": {"max_episode_steps": "abc"}}, f"error: {ENV} could not be made with env_kwargs "
                                                   "{'max_episode_steps': 'abc'}: TypeError"),
], ids=["policy_kwargs", "env_kwargs"])
def test_a_bad_value_inside_the_kwargs_is_one_error_line_and_the_run_can_start_after(tmp_path, settings, line, capsys):
    logdir = tmp_path / "runs"
    with pytest.raises(SystemExit) as e:
        train_main(_argv(logdir, 16, "--config", _entry(tmp_path, **settings)))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert line in err and "Traceback" not in err
    train_main(_argv(logdir, 16))
    assert _steps(_folder(logdir) / "final_model.zip") == 16


def test_a_config_file_that_asks_for_other_speed_settings_on_resume_is_refused(interrupted, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(_argv(interrupted, 64, "--resume", "--config", _entry(tmp_path, fused_adam=True)))
    assert e.value.code == 2
    assert f"the run was trained with fused_adam=False; resume it without {tmp_path / 'entry.yml'}'s fused_adam" \
        in capsys.readouterr().err
    assert not (_folder(interrupted) / "final_model.zip").exists()


@pytest.mark.parametrize("algo", ["rlseq", "sb3-recurrent-ppo"])
def test_an_efla_run_saved_before_the_read_norm_default_resumes_as_it_was_trained(algo, tmp_path, monkeypatch):
    """A run whose checkpoints predate ``output_norm=True`` resumes without the norm (stated by a warning), trains on,
    and its next checkpoints and final model load without the warning, MemoryPPO's and RecurrentPPO's alike."""
    import warnings

    from sb3_contrib import RecurrentPPO

    from rlseq.algos import MemoryPPO
    from tests.helpers import read_norm_off_by_default

    argv = [*BASE[:3], "efla", "--algo", algo, *BASE[4:], "--logdir", str(tmp_path)]
    with monkeypatch.context() as m:
        read_norm_off_by_default(m)
        train_main([*argv, "--total-steps", "32"])
    folder = tmp_path / ENV / ("efla" if algo == "rlseq" else "sb3-efla") / "seed0"
    (folder / "final_model.zip").unlink()
    with pytest.warns(UserWarning, match="no read norm for"):
        train_main([*argv, "--total-steps", "48", "--resume"])
    cls = MemoryPPO if algo == "rlseq" else RecurrentPPO
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*read norm.*")
        final = cls.load(folder / "final_model.zip", device="cpu")
        newest = cls.load(folder / "checkpoints" / "step48" / "model.zip", device="cpu")
    assert final.num_timesteps == 48
    for model in (final, newest):
        assert all(sub.out_norm is None for sub in model.policy.modules() if hasattr(sub, "out_norm"))


# the delta-rule memories' settings before each of their defaults: what rlseq then built (keyword defaults of the
# delta-rule memories, class attributes of EFLA's), the load's refusal, and the settings that load the model as it
# was trained (rlseq.evaluate's note names them)
OLD_DEFAULTS = {
    "no-rotary": ({"rotary_base": None}, {},
                  "saved without rotary positions .* load it with memory_kwargs rotary_base=None", "rotary_base=None"),
    "fastest-1rad": ({"rotary_max_freq": 1.0}, {}, r"saved with other rotary positions \(rotary_base=10000, "
                     r"rotary_max_freq=1\) than this memory's .*; load it with memory_kwargs rotary_base=10000, "
                     r"rotary_max_freq=1",
                     "rotary_base=10000, rotary_max_freq=1"),
    "efla-heads-32": ({}, {"head_width": 1.0}, r"saved with other head sizes \(head_dim=32, value_dim=32\) than "
                      r"this memory's \(head_dim=64, value_dim=32\); load it with memory_kwargs head_dim=32, "
                      r"value_dim=32(?=\n|$)", "head_dim=32, value_dim=32"),
    "efla-heads-32-1rad": ({"rotary_max_freq": 1.0}, {"head_width": 1.0},
                           r"saved with other head sizes \(head_dim=32, value_dim=32\) than this memory's "
                           r"\(head_dim=64, value_dim=32\), and with other rotary positions \(rotary_base=10000, "
                           r"rotary_max_freq=1\); load it with memory_kwargs head_dim=32, value_dim=32, "
                           r"rotary_base=10000, rotary_max_freq=1(?=\n|$)",
                           "head_dim=32, value_dim=32, rotary_base=10000, rotary_max_freq=1"),
}


@pytest.mark.parametrize("old", OLD_DEFAULTS)
@pytest.mark.parametrize("algo", ["rlseq", "rlseq-critic-memory", "sb3-recurrent-ppo"])
def test_a_run_saved_before_a_memory_default_is_refused_at_resume_and_loads_as_it_was_trained(algo, old, tmp_path,
                                                                                               monkeypatch, capsys):
    """Rotary positions add no weights, so a checkpoint saved without them (or with other frequencies) would load
    into today's default silently and read its memory differently; one saved with EFLA's earlier head sizes fails
    on tensor shapes that do not say which settings made them. --resume refuses either in one line and leaves the
    folder as it was; the model itself loads with the settings the message names, and rlseq.evaluate plays it so."""
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.save_util import load_from_zip_file

    from rlseq.algos import MemoryPPO
    from rlseq.policies.memory import EFLAMemory, _DeltaRuleMemory, format_memory_kwargs, memory_kwargs_to_load

    then, efla_then, refusal, note = OLD_DEFAULTS[old]
    critic = algo == "rlseq-critic-memory"  # two delta-rule memories, actor's and critic's, to load alike
    algo = "rlseq" if critic else algo
    argv = [*BASE[:3], "efla", "--algo", algo, *BASE[4:], "--logdir", str(tmp_path),
            *(["--config", str(REPO / "configs/ablations/critic_memory.yml")] if critic else [])]
    with monkeypatch.context() as m:  # as rlseq built the delta-rule memories before that default
        for key, value in then.items():
            m.setitem(_DeltaRuleMemory.__init__.__kwdefaults__, key, value)
        for key, value in efla_then.items():
            m.setattr(EFLAMemory, key, value)
        train_main([*argv, "--total-steps", "32"])
    folder = tmp_path / ENV / ("efla" if algo == "rlseq" else "sb3-efla") / "seed0"
    (folder / "final_model.zip").unlink()
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_main([*argv, "--total-steps", "48", "--resume"])
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "was saved with other memory settings (head sizes or rotary positions)" in errors[0], errors
    assert re.search(f"The load said: .*{refusal}", errors[0]), errors  # names the settings it was trained with
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"} == before
    cls = MemoryPPO if algo == "rlseq" else RecurrentPPO
    newest = folder / "checkpoints" / "step32" / "model.zip"
    with pytest.raises(RuntimeError, match=refusal):
        cls.load(newest, device="cpu")
    trained = memory_kwargs_to_load(errors[0])  # what the message names, read back
    assert format_memory_kwargs(trained) == note
    kwargs = load_from_zip_file(newest, device="cpu", load_data=True)[0]["policy_kwargs"]
    kwargs = {**kwargs, "memory_kwargs": {**(kwargs.get("memory_kwargs") or {}), **trained}}
    model = cls.load(newest, device="cpu", custom_objects={"policy_kwargs": kwargs})
    assert model.num_timesteps == 32
    memories = [sub for sub in model.policy.modules() if isinstance(sub, _DeltaRuleMemory)]
    # sb3-contrib's RecurrentPPO has a critic memory of its own by default
    assert len(memories) == (1 if algo == "rlseq" and not critic else 2)
    assert all(getattr(sub, key) == value for sub in memories for key, value in trained.items())
    # playing it is safe: rlseq.evaluate loads it as it was trained and says so
    from rlseq.evaluate import evaluate

    played = evaluate(folder, 2, n_envs=2, device="cpu", progress=False)
    assert played["model"] == "checkpoints/step32/model.zip" and played["notes"] == [
        f"model.zip was saved with other memory settings than today's defaults: played with memory_kwargs {note}, "
        "as it was trained"]


@pytest.mark.parametrize("heads", ["heads-32", "today"])
@pytest.mark.parametrize("algo", ["rlseq", "sb3-recurrent-ppo"])
def test_a_model_of_the_rotary_option_is_played_with_the_frequencies_it_was_trained_with(algo, heads, tmp_path,
                                                                                       monkeypatch):
    """While rotary positions were an option their frequencies were not saved and the fastest pair turned 1 rad a
    step: such a model (``rotary_base`` in its settings, no ``rotary_freqs`` in its state) is refused by a plain
    load under today's π, and rlseq.evaluate plays it at 1 rad, as it was trained, and says so. Those models had
    EFLA's heads of 32: the frequencies they were trained with are those of the saved head size, not today's."""
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.save_util import load_from_zip_file, save_to_zip_file

    from rlseq.algos import MemoryPPO
    from rlseq.evaluate import evaluate
    from rlseq.policies.memory import EFLAMemory, _DeltaRuleMemory

    config = tmp_path / "option.yml"
    config.write_text(yaml.safe_dump({ENV: {"memory_kwargs": {"efla": {"rotary_base": 10000}}}}))
    argv = [*BASE[:3], "efla", "--algo", algo, *BASE[4:], "--logdir", str(tmp_path), "--config", str(config),
            "--total-steps", "32"]
    with monkeypatch.context() as m:  # as rlseq built the option
        m.setitem(_DeltaRuleMemory.__init__.__kwdefaults__, "rotary_max_freq", 1.0)
        if heads == "heads-32":
            m.setattr(EFLAMemory, "head_width", 1.0)
        train_main(argv)
    folder = tmp_path / ENV / ("efla" if algo == "rlseq" else "sb3-efla") / "seed0"
    path = folder / "final_model.zip"
    data, params, variables = load_from_zip_file(path, device="cpu", load_data=True)
    assert data["policy_kwargs"]["memory_kwargs"] == {"rotary_base": 10000}
    params["policy"] = {k: v for k, v in params["policy"].items() if not k.endswith("rotary_freqs")}
    save_to_zip_file(path, data=data, params=params, pytorch_variables=variables)  # as the option saved it
    cls = MemoryPPO if algo == "rlseq" else RecurrentPPO
    sizes = "head_dim=32, value_dim=32, " if heads == "heads-32" else ""
    with pytest.raises(RuntimeError, match=rf"load it with memory_kwargs {sizes}rotary_base=10000, rotary_max_freq=1"):
        cls.load(path, device="cpu")
    played = evaluate(folder, 2, n_envs=2, device="cpu", progress=False)
    assert played["notes"] == ["final_model.zip was saved with other memory settings than today's defaults: played "
                               f"with memory_kwargs {sizes}rotary_base=10000, rotary_max_freq=1, as it was trained"]


# --- 4. SIGINT and SIGTERM -----------------------------------------------------------------------------------


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_a_checkpoint_prints_one_resume_line_and_exits_128_plus_the_signal(signum, code, tmp_path):
    argv = [*BASE, "--logdir", str(tmp_path), "--total-steps", "100000", "--checkpoint-every", "100000"]
    proc = subprocess.Popen([sys.executable, "-m", "rlseq.train", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    line = proc.stdout.readline()  # printed at the third rollout start: training (and its handlers) running
    assert line.startswith("measured"), line + proc.stderr.read()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {signal.Signals(signum).name}: checkpoint step")
    assert last.endswith("resume with: " + shlex.join(["python", "-m", "rlseq.train", *argv, "--resume"]))
    step = last.split("checkpoint step")[1].split()[0]
    folder = _folder(tmp_path) / "checkpoints" / f"step{step}"
    from rlseq.checkpoint import checkpoint_problem, resumable_checkpoint

    assert int(step) >= 16 and checkpoint_problem(folder) is None
    assert resumable_checkpoint(folder.parent) == (folder, [])


def test_a_first_signal_while_training_is_acknowledged_at_once(tmp_path, capfd):
    from rlseq.checkpoint import CheckpointCallback, stop_on_signals

    callback = CheckpointCallback(tmp_path, every=100)
    with stop_on_signals(callback):
        signal.raise_signal(signal.SIGINT)  # the handler runs before the next line, mid-rollout as far as it knows
        assert capfd.readouterr().err == ("\nSIGINT: stopping after this rollout and its update, with a checkpoint; a "
                                          "second signal stops at once (a resume then continues from the newest "
                                          "checkpoint on disk)\n")
    assert callback._stop_asked == signal.SIGINT and callback.stopped_by is None


# a training process that sends itself ``signum`` from inside a function of the product: at the start of the model
# build ("build"), at the start of the final save ("final"), there and again once the final save has written the
# new checkpoint's model ("final-twice"), or during training and again as the first one's stop is asked
# ("learn-twice"); argv: phase, signal number, total steps, then the train flags
_SIGNAL_FROM_INSIDE = """
import os, sys
import rlseq.checkpoint as C, rlseq.train as T

phase, signum, total, argv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
build, save, rng_state = T.build_model, C.save_checkpoint, C.rng_state
if phase == "learn-twice":
    request_stop, on_step = C.CheckpointCallback.request_stop, C.CheckpointCallback._on_step

    def twice(self, signum):
        request_stop(self, signum)
        os.kill(os.getpid(), signum)

    def signalling_step(self):
        if self.num_timesteps >= 20 and not self._stop_asked:
            os.kill(os.getpid(), signum)
        return on_step(self)

    C.CheckpointCallback.request_stop, C.CheckpointCallback._on_step = twice, signalling_step


def signalling_build(*args, **kwargs):
    os.kill(os.getpid(), signum)
    return build(*args, **kwargs)


def signalling_save(model, *args, **kwargs):
    if model.num_timesteps >= total:  # the final save, not a periodic one
        os.kill(os.getpid(), signum)
        if phase == "final-twice":
            C.rng_state = lambda: (os.kill(os.getpid(), signum), rng_state())[1]
    return save(model, *args, **kwargs)


T.build_model, C.save_checkpoint = (signalling_build, save) if phase == "build" else (build, signalling_save)
T.main(argv)
"""


def _signalled_run(tmp_path: Path, phase: str, signum: int) -> tuple[int, list[str], list[str]]:
    """``(returncode, stderr lines, the argv of the run)`` of a 32-step run sent ``signum`` in ``phase``."""
    argv = _argv(tmp_path, 32)
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_FROM_INSIDE, phase, str(int(signum)), "32", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stderr.strip().splitlines(), argv


def _continue(line: str) -> None:
    """Run the command that ``line`` ends with (``... continue with: python -m rlseq.train ...``) in-process."""
    command = shlex.split(line.split("continue with: ")[1])
    assert command[:3] == ["python", "-m", "rlseq.train"], line
    train_main(command[3:])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_model_is_built_exits_128_plus_it_with_one_line_and_writes_nothing(signum, tmp_path):
    code, err, argv = _signalled_run(tmp_path, "build", signum)
    assert code == 128 + signum, err
    assert err == [f"stopped by {signal.Signals(signum).name} before training started; continue with: "
                   + shlex.join(["python", "-m", "rlseq.train", *argv, "--resume"])]
    assert sorted(p.name for p in _folder(tmp_path).iterdir()) == [".lock"]  # no config, curve or checkpoint
    _continue(err[-1])
    assert _steps(_folder(tmp_path) / "final_model.zip") == 32


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_the_final_save_lets_it_complete_then_exits_128_plus_it_with_one_line(signum, tmp_path):
    code, err, _ = _signalled_run(tmp_path, "final", signum)
    assert code == 128 + signum, err
    assert err == [f"stopped by {signal.Signals(signum).name} during the final save, which completed: 32 env steps "
                   f"in {_folder(tmp_path) / 'final_model.zip'}"]
    assert _steps(_folder(tmp_path) / "final_model.zip") == 32
    from rlseq.checkpoint import resumable_checkpoint

    ckpt = _folder(tmp_path) / "checkpoints"
    assert _checkpoints(tmp_path) == ["step16", "step32"] and resumable_checkpoint(ckpt) == (ckpt / "step32", [])
    assert not list(_folder(tmp_path).glob(".*tmp*")) and not list((_folder(tmp_path) / "checkpoints").glob(".*"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_while_training_exits_128_plus_it_with_one_line(signum, tmp_path):
    code, err, argv = _signalled_run(tmp_path, "learn-twice", signum)
    assert code == 128 + signum, err
    assert err[-1] == (f"stopped by {signal.Signals(signum).name} (a second signal, before the checkpoint); continue "
                       "from the newest checkpoint with: " + shlex.join(["python", "-m", "rlseq.train", *argv, "--resume"]))
    assert not (_folder(tmp_path) / "final_model.zip").exists()


def test_a_second_signal_aborts_the_final_save_and_names_the_intact_checkpoint_a_resume_continues_from(tmp_path):
    code, err, argv = _signalled_run(tmp_path, "final-twice", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert err == ["stopped by SIGTERM during the final save (a second signal), which did not complete; newest "
                   "intact checkpoint: step16; continue with: "
                   + shlex.join(["python", "-m", "rlseq.train", *argv, "--resume"])]
    assert not (_folder(tmp_path) / "final_model.zip").exists() and _checkpoints(tmp_path) == ["step16"]
    assert list((_folder(tmp_path) / "checkpoints").glob(".step32.tmp*")), "the save was not stopped midway"
    _continue(err[-1])  # removes the killed save's temporary folder and trains step 16 to 32 again
    assert _steps(_folder(tmp_path) / "final_model.zip") == 32 and _checkpoints(tmp_path) == ["step16", "step32"]


# --- 5. config files and flags -------------------------------------------------------------------------------


def _config(tmp_path: Path, **changes) -> Path:
    entry = yaml.safe_load((REPO / "configs" / "popgym.yml").read_text())["popgym"]
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump({"popgym": {**entry, **changes}}))
    return path


def _refused(argv: list[str], tmp_path: Path, capsys, monkeypatch) -> list[str]:
    """The error lines of a run that must be refused before anything is built or written."""
    import rlseq.resume as R
    import rlseq.train as T

    for module in (T, R):  # a fresh start builds its env in rlseq.train, a resumed run in rlseq.resume
        monkeypatch.setattr(module, "make_env", lambda *a, **k: pytest.fail("an env was built before validation"))
    logdir = tmp_path / "runs"
    with pytest.raises(SystemExit) as e:
        train_main([*argv, "--logdir", str(logdir)])
    assert e.value.code == 2 and not logdir.exists()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert all(line.startswith("error: ") for line in lines), lines
    return lines


@pytest.mark.parametrize("changes,message", [
    ({"learnign_rate": 1e-3}, "unknown key 'learnign_rate' in"),
    ({"clip_range": True}, "clip_range True"),
    ({"learning_rate": "fast"}, "learning_rate 'fast'"),
    ({"gamma": 1.5}, "gamma 1.5"),
    ({"n_epochs": 0}, "n_epochs 0"),
    ({"n_steps": 2.5}, "n_steps 2.5"),
    ({"normalize_reward": "yes please"}, "normalize_reward 'yes please'"),
    ({"reward_scale": 1e308}, "reward_scale 1e+308 must be > 0 and <= 1e+12"),
    ({"value_shift": -1e300}, "value_shift -1e+300 must be >= -1e+12 and <= 1e+12"),
])
def test_a_bad_config_key_or_value_is_one_error_line(changes, message, tmp_path, capsys, monkeypatch):
    lines = _refused(["--env", ENV, "--config", str(_config(tmp_path, **changes))], tmp_path, capsys, monkeypatch)
    assert len(lines) == 1 and message in lines[0]
    if "learnign_rate" in changes:
        assert "did you mean learning_rate" in lines[0]


@pytest.mark.parametrize("flag,value", [("--reward-scale", "1e308"), ("--value-shift", "1e300")])
def test_a_reward_scale_or_value_shift_that_overflows_float32_is_one_error_line(flag, value, tmp_path, capsys,
                                                                               monkeypatch):
    lines = _refused(["--env", ENV, flag, value], tmp_path, capsys, monkeypatch)
    assert len(lines) == 1 and f"{value[:2]}+{value[-3:]} must be" in lines[0] and "<= 1e+12" in lines[0]


def test_clip_range_yes_in_yaml_is_refused(tmp_path, capsys, monkeypatch):
    path = _config(tmp_path)
    path.write_text(path.read_text().replace("clip_range: 0.2", "clip_range: yes"))
    lines = _refused(["--env", ENV, "--config", str(path)], tmp_path, capsys, monkeypatch)
    assert lines == [f"error: clip_range True must be a number (YAML reads yes/no/on/off as booleans) ({path})"]


def test_a_config_file_of_two_keys_overrides_the_family_defaults(tmp_path):
    from rlseq.train import build_parser, resolve

    path = tmp_path / "two.yml"
    path.write_text(f"{ENV}:\n  n_envs: 4\n  learning_rate: 1.0e-3\n")
    cfg = resolve(build_parser().parse_args(["--env", ENV, "--config", str(path)]))
    defaults = resolve(build_parser().parse_args(["--env", ENV]))
    assert (cfg["n_envs"], cfg["learning_rate"]) == (4, 1e-3)
    assert {k: v for k, v in cfg.items() if k not in ("n_envs", "learning_rate")} == \
        {k: v for k, v in defaults.items() if k not in ("n_envs", "learning_rate")}


def test_a_typo_in_a_two_key_config_file_is_one_line_with_the_close_match(tmp_path, capsys, monkeypatch):
    path = tmp_path / "two.yml"
    path.write_text("popgym:\n  n_envs: 4\n  learnign_rate: 1.0e-3\n")
    lines = _refused(["--env", ENV, "--config", str(path)], tmp_path, capsys, monkeypatch)
    assert len(lines) == 1 and "unknown key 'learnign_rate'" in lines[0] and "did you mean learning_rate" in lines[0]


def test_a_yaml_syntax_error_in_a_config_file_is_one_line_with_its_place(tmp_path, capsys, monkeypatch):
    path = tmp_path / "bad.yml"
    path.write_text("popgym:\n  n_envs: [4\n  gamma: 0.9\n")
    lines = _refused(["--env", ENV, "--config", str(path)], tmp_path, capsys, monkeypatch)
    assert len(lines) == 1 and lines[0].startswith(f"error: config file {path} is not valid YAML at line 3, column")


def test_hyperparameters_outside_an_env_entry_are_refused_with_where_they_go(tmp_path, capsys, monkeypatch):
    path = tmp_path / "flat.yml"
    path.write_text("n_envs: 4\n")
    lines = _refused(["--env", ENV, "--config", str(path)], tmp_path, capsys, monkeypatch)
    assert lines == [f"error: {path} has no entry for '{ENV}' and no 'popgym' default; entries: n_envs; n_envs is a "
                     f"hyperparameter: put it under {ENV}: (this env) or popgym: (every popgym env)"]


@pytest.mark.parametrize("content,message", [
    (b"5\n", "holds the int 5; it must map env ids"),
    (b"- popgym\n", "holds the list ['popgym']; it must map env ids"),
    (b"popgym:\n  n_envs: [4\n", "is not valid YAML at line 3, column 1"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not a UTF-8 text file"),
    (b"popgym: !!python/object/apply:os.system ['echo hi']\n", "!!python tags are not read"),
    (b"popgym:\nn_envs: 4\n", "the entry 'popgym' of {path} is empty (null) (n_envs is outside it: indent under popgym:)"),
    (b"popgym: 3\n", "the entry 'popgym' of {path} must be a mapping of hyperparameters (key: value), not a int"),
])
def test_a_config_file_that_is_no_mapping_of_hyperparameters_is_one_error_line(content, message, tmp_path, capsys,
                                                                               monkeypatch):
    path = tmp_path / "c.yml"
    path.write_bytes(content)
    lines = _refused(["--env", ENV, "--config", str(path)], tmp_path, capsys, monkeypatch)
    assert len(lines) == 1 and message.format(path=path) in lines[0] and str(path) in lines[0], lines


def test_a_config_path_that_is_a_directory_is_one_error_line(tmp_path, capsys, monkeypatch):
    lines = _refused(["--env", ENV, "--config", str(tmp_path)], tmp_path, capsys, monkeypatch)
    assert lines == [f"error: config file {tmp_path} is a directory; give the YAML file in it"]


@pytest.mark.parametrize("memory,memory_kwargs,message", [
    ("efla", {"efla": {"n_head": 4}}, "unknown memory_kwargs key 'n_head' of efla in {path}; did you mean n_heads? "
                                      "valid keys of efla: d_model, conv_size, join, n_heads, head_dim,"),
    ("efla", {"efla": {"head_dim": 0}}, "memory_kwargs efla head_dim 0 must be a whole number >= 1 ({path})"),
    ("gru", {"gru": {"d_model": -8}}, "memory_kwargs gru d_model -8 must be a whole number >= 1 ({path})"),
    ("gru", {"gru": {"hiden_size": 8}}, "did you mean hidden_size"),
    ("lstm", {"lstm": {"proj_size": 4}}, "unknown memory_kwargs key 'proj_size' of lstm"),
    ("lstm", {"lstm": {"recurrent_init": "xavier"}}, "recurrent_init 'xavier' is not valid; valid: uniform, orthogonal"),
    ("gru", {"gru": {"join": "post"}}, "memory_kwargs gru join 'post' is not valid; valid: residual, gated, prenorm, read"),
    ("gru", {"gru": {"residual": False}}, "memory_kwargs gru residual in {path} is now join: residual: false is join: read"),
    ("efla", {"n_heads": 4}, "memory_kwargs key 'n_heads' in {path} is not a memory; memory_kwargs maps a memory "
                             "(efla, deltanet, gru, lstm, none) to its keywords, e.g. {{efla: {{n_heads: 4}}}}"),
    ("efla", {"eflaa": {}}, "memory_kwargs key 'eflaa' in {path} is not a memory; did you mean efla?"),
    ("none", {"deltanet": {"n_head": 2}}, "of deltanet"),  # every memory's entry, not only the one trained
])
def test_a_bad_memory_keyword_is_one_error_line_before_the_run_folder_exists(memory, memory_kwargs, message, tmp_path,
                                                                            capsys, monkeypatch):
    path = _config(tmp_path, memory_kwargs=memory_kwargs)
    lines = _refused(["--env", ENV, "--memory", memory, "--config", str(path)], tmp_path, capsys, monkeypatch)
    assert len(lines) == 1 and message.format(path=path) in lines[0], lines


def test_a_memory_learning_rate_is_that_memory_s_alone(tmp_path, monkeypatch):
    """``memory_learning_rate`` replaces its entry's ``learning_rate`` for the memories it names, in rlseq's block
    only; a later file's ``learning_rate`` (a sweep) and a flag replace it; the resolved config keeps one rate."""
    import rlseq.config as C
    from rlseq.train import build_parser, resolve

    base = _config(tmp_path, learning_rate=5e-4, memory_learning_rate={"lstm": 1e-3, "efla": 2.5e-4})
    monkeypatch.setitem(C.FAMILY_CONFIGS, "popgym", base)

    def resolved(*argv: str) -> dict:
        return resolve(build_parser().parse_args(["--env", ENV, *argv]))

    assert [resolved("--memory", m)["learning_rate"] for m in ("lstm", "efla", "gru")] == [1e-3, 2.5e-4, 5e-4]
    assert "memory_learning_rate" not in resolved("--memory", "lstm")
    assert resolved("--memory", "lstm", "--learning-rate", "2e-4")["learning_rate"] == 2e-4
    # sb3-contrib's own LSTM is another design; the drop-in EFLA block inside RecurrentPPO is rlseq's
    assert resolved("--memory", "lstm", "--algo", "sb3-recurrent-ppo")["learning_rate"] == 5e-4
    assert resolved("--memory", "efla", "--algo", "sb3-recurrent-ppo")["learning_rate"] == 2.5e-4
    sweep = tmp_path / "sweep.yml"
    sweep.write_text("popgym:\n  learning_rate: 2.5e-3\n")
    assert resolved("--memory", "lstm", "--config", str(sweep))["learning_rate"] == 2.5e-3
    sweep.write_text("popgym:\n  memory_learning_rate: {gru: 3.0e-4}\n")
    assert [resolved("--memory", m, "--config", str(sweep))["learning_rate"] for m in ("gru", "lstm")] == [3e-4, 1e-3]
    # RL Zoo's linear schedules, in a memory's table and as a flag, resolved to one spelling
    sweep.write_text("popgym:\n  memory_learning_rate: {gru: lin_3.0e-4}\n")
    assert resolved("--memory", "gru", "--config", str(sweep))["learning_rate"] == "lin_0.0003"
    assert resolved("--memory", "lstm", "--learning-rate", "lin_2e-4")["learning_rate"] == "lin_0.0002"


def test_a_linear_learning_rate_is_sb3_s_linear_schedule_to_zero():
    from rlseq.build import ppo_kwargs

    base = {"n_steps": 8, "n_epochs": 1, "gamma": 0.99, "gae_lambda": 0.95, "ent_coef": 0.0, "vf_coef": 0.5,
            "clip_range": 0.2, "max_grad_norm": 0.5, "seed": 0}
    schedule = ppo_kwargs({**base, "learning_rate": "lin_0.0005"}, "cpu")["learning_rate"]
    assert [schedule(p) for p in (1.0, 0.5, 0.0)] == pytest.approx([5e-4, 2.5e-4, 0.0])
    assert schedule(-0.01) == 0.0  # the last rollout overshoots the budget: the rate stays at 0, never below
    assert ppo_kwargs({**base, "learning_rate": 5e-4}, "cpu")["learning_rate"] == 5e-4


@pytest.mark.parametrize("table,message", [
    ({"lstn": 1e-3}, "memory_learning_rate key 'lstn' in {path} is not a memory; did you mean lstm? valid memories: "
                     "efla, deltanet, gru, lstm, none"),
    ({"lstm": -1.0}, "memory_learning_rate lstm -1.0 must be > 0, or lin_<rate> for a linear schedule to 0 (e.g. "
                     "lin_5e-4) ({path})"),
    ({"lstm": "lin_fast"}, "memory_learning_rate lstm 'lin_fast' must be a number after 'lin_' (a linear schedule "
                           "from that rate to 0, e.g. lin_5e-4) ({path})"),
    (1e-3, "memory_learning_rate in {path} must map a memory"),
])
def test_a_bad_memory_learning_rate_is_one_error_line(table, message, tmp_path, capsys, monkeypatch):
    path = _config(tmp_path, memory_learning_rate=table)
    lines = _refused(["--env", ENV, "--memory", "gru", "--config", str(path)], tmp_path, capsys, monkeypatch)
    assert len(lines) == 1 and message.format(path=path) in lines[0], lines


def test_the_memory_keywords_are_those_the_constructors_take():
    from rlseq.config import memory_keywords
    from rlseq.policies.memory import MEMORIES, make_memory

    for name in MEMORIES:
        keywords = memory_keywords(name)
        assert {"d_model", "conv_size", "join"} <= set(keywords)
        make_memory(name, 3, **{k: v for k, v in keywords.items() if k != "backend"})  # each one is accepted
    assert {"dropout", "bias", "forget_bias"} <= set(memory_keywords("lstm")) and "proj_size" not in memory_keywords("lstm")


@pytest.mark.parametrize("algo,memory,changes,message", [
    ("rlseq", "none", {"policy_kwargs": {"net_arc": [64]}},
     "unknown policy_kwargs key 'net_arc' in {path}; did you mean net_arch? valid keys of the policy of --algo rlseq:"),
    ("sb3-recurrent-ppo", "lstm", {"policy_kwargs": {"lstm_hidden_sise": 64}}, "did you mean lstm_hidden_size?"),
    ("rlseq", "none", {"policy_kwargs": {"memory": "gru"}}, "policy_kwargs key 'memory' in {path} is set by --memory"),
    ("rlseq", "none", {"env_kwargs": {"kk": 2}},
     f"unknown env_kwargs key 'kk' in {{path}}; did you mean k? valid keys of {ENV}: disable_env_checker, k,"),
])
def test_an_unknown_policy_or_env_keyword_is_one_error_line(algo, memory, changes, message, tmp_path, capsys,
                                                           monkeypatch):
    path = _config(tmp_path, **changes)
    lines = _refused(["--env", ENV, "--algo", algo, "--memory", memory, "--config", str(path)], tmp_path, capsys,
                     monkeypatch)
    assert len(lines) == 1 and message.format(path=path) in lines[0], lines


@pytest.mark.parametrize("argv,message", [
    (["--num-levels", "-1"], "error: num_levels -1 must be a whole number >= 0 (--num-levels)"),
    (["--num-threads", "-2"], "error: num_threads -2 must be a whole number >= 0 (--num-threads)"),
    (["--num-levels", str(2**31 - 1), "--start-level", "1"],
     "error: start_level + num_levels must be <= 2**31 - 1 (procgen's level seeds are C ints)"),
])
def test_a_procgen_level_range_out_of_bounds_is_one_error_line_before_the_run_folder_exists(argv, message, tmp_path,
                                                                                            capsys, monkeypatch):
    assert _refused(["--env", "caveflyer", *argv], tmp_path, capsys, monkeypatch) == [message]


def test_known_memory_policy_and_env_keywords_pass(tmp_path):
    from rlseq.train import build_parser, resolve

    path = _config(tmp_path, memory_kwargs={"gru": {"hidden_size": "1e1", "dropout": 0.1, "recurrent_init": "orthogonal"},
                                            "efla": {"head_dim": None, "backend": "torch"}},
                   policy_kwargs={"net_arch": [8], "value_norm": False}, env_kwargs={"k": 2, "max_episode_steps": 50})
    cfg = resolve(build_parser().parse_args(["--env", ENV, "--memory", "gru", "--config", str(path)]))
    assert cfg["memory_kwargs"] == {"hidden_size": 10, "dropout": 0.1, "recurrent_init": "orthogonal"}
    assert cfg["env_kwargs"] == {"k": 2, "max_episode_steps": 50}


def test_numeric_strings_are_accepted_for_number_keys(tmp_path):
    from rlseq.train import build_parser, resolve

    path = _config(tmp_path)
    path.write_text(path.read_text().replace("learning_rate: 0.0005", "learning_rate: 5e-4")
                    .replace("n_timesteps: 100000", "n_timesteps: 1e5"))
    assert yaml.safe_load(path.read_text())["popgym"]["learning_rate"] == "5e-4"  # what PyYAML makes of it
    # the GRU takes the entry's learning_rate (EFLA and the LSTM have their own in memory_learning_rate)
    cfg = resolve(build_parser().parse_args(["--env", ENV, "--memory", "gru", "--config", str(path)]))
    assert cfg["learning_rate"] == 5e-4 and type(cfg["learning_rate"]) is float
    assert cfg["n_timesteps"] == 100_000 and type(cfg["n_timesteps"]) is int


def test_bad_flags_are_each_one_error_line(tmp_path, capsys, monkeypatch):
    lines = _refused(["--env", ENV, "--n-minibatches", "0", "--total-steps", "nan", "--seed", "-1", "--device", "tpu",
                      "--checkpoint-every", "0", "--tag", "../x", "--n-epochs", "0"], tmp_path, capsys, monkeypatch)
    for flag in ("(--n-minibatches)", "(--total-steps)", "--seed -1", "--device 'tpu'", "(--checkpoint-every)",
                 "--tag '../x'", "(--n-epochs)"):
        assert sum(flag in line for line in lines) == 1, (flag, lines)
    assert len(lines) == 7
    assert "must be finite" in _refused(["--env", ENV, "--total-steps", "inf"], tmp_path, capsys, monkeypatch)[0]


def test_device_cuda_without_a_gpu_is_refused(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = _refused(["--env", ENV, "--device", "cuda"], tmp_path, capsys, monkeypatch)
    assert lines == ["error: --device cuda: this host has no CUDA device (torch.cuda.is_available() is False); "
                     "use --device cpu or auto"]


# --- 6. TensorBoard curves of a resumed run ------------------------------------------------------------------


def tensorboard_curve(folder: Path, tag: str = "time/fps") -> list[int]:
    """The steps of ``tag`` as TensorBoard shows them: all event files of the folder, purges applied."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_a_resumed_run_purges_the_steps_logged_after_its_checkpoint(interrupted):
    folder = _folder(interrupted)
    shutil.rmtree(folder / "checkpoints" / "step48")  # killed after logging step 48, before checkpointing it
    assert tensorboard_curve(folder)[-1] == 48
    train_main(_argv(interrupted, 64, "--resume"))
    steps = tensorboard_curve(folder)
    assert [s for s in steps if s] == [16, 32, 48, 64]  # one point per rollout of 16 steps, step 48 once


def test_a_resumed_run_writes_the_records_of_the_update_before_its_checkpoint(finished, interrupted, tmp_path):
    """PPO writes an update's train/* records after the next rollout, past the checkpoint taken at its start: the
    checkpoint keeps them, so the resumed curve has every point an uninterrupted run has, with the same value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def loss(folder: Path) -> dict[int, float]:
        acc = EventAccumulator(str(folder))
        acc.Reload()
        return {e.step: e.value for e in acc.Scalars("train/loss")}

    train_main(_argv(interrupted, 64, "--resume"))
    straight = tmp_path / "straight"
    train_main(_argv(straight, 64))
    resumed, uninterrupted = loss(_folder(interrupted)), loss(_folder(straight))
    assert sorted(resumed) == sorted(uninterrupted) and 64 in resumed
    assert resumed[64] == uninterrupted[64]  # the update at step 48, trained before the checkpoint


# --- 7. a resumed run plays new levels / episodes ------------------------------------------------------------


def test_the_resumed_env_seed_depends_on_the_step():
    from rlseq.train import resumed_env_seed

    assert resumed_env_seed(3, 0) == 3
    seeds = {resumed_env_seed(s, step) for s in range(4) for step in (16, 32, 10**9)}
    assert len(seeds) == 12 and all(0 <= s < 2**30 for s in seeds)


def test_a_resumed_gym_run_seeds_its_envs_from_the_resume_step(interrupted, monkeypatch):
    from stable_baselines3.common.vec_env import DummyVecEnv

    from rlseq.train import resumed_env_seed

    seen, reset = [], DummyVecEnv.reset

    def recording_reset(self):
        seen.append(list(self._seeds))
        return reset(self)

    monkeypatch.setattr(DummyVecEnv, "reset", recording_reset)
    train_main(_argv(interrupted, 64, "--resume"))
    first = resumed_env_seed(0, 48)
    assert first != 0 and seen == [[first, first + 1]]


def test_a_resumed_procgen_run_continues_the_level_stream(tmp_path, monkeypatch):
    from rlseq.envs.procgen import ProcgenVecEnv
    from rlseq.train import resumed_env_seed

    argv = ["--env", "caveflyer", "--memory", "none", "--n-envs", "2", "--n-steps", "16", "--n-minibatches", "1",
            "--n-epochs", "1", "--num-threads", "0", "--checkpoint-every", "32", "--seed", "4", "--logdir",
            str(tmp_path), "--no-progress-bar"]
    builds, build = [], ProcgenVecEnv._build

    def recording_build(self, n_envs, seed):
        builds.append(seed)
        return build(self, n_envs, seed)

    monkeypatch.setattr(ProcgenVecEnv, "_build", recording_build)
    train_main([*argv, "--total-steps", "32"])
    assert set(builds) == {4}
    (tmp_path / "caveflyer" / "none" / "seed4" / "final_model.zip").unlink()
    builds.clear()
    train_main([*argv, "--total-steps", "64", "--resume"])
    assert builds[-1] == resumed_env_seed(4, 32) != 4  # the env the resumed run stepped


# --- 8. held-out evaluation ----------------------------------------------------------------------------------


def test_evaluation_levels_are_disjoint_from_a_finite_training_range_and_honest_about_the_full_one():
    from rlseq.evaluate import LEVEL_SEED_END, evaluation_levels

    assert evaluation_levels({"num_levels": 200, "start_level": 5}, None) == \
        {"start_level": 205, "num_levels": LEVEL_SEED_END - 205, "held_out": True}
    with pytest.raises(ValueError, match=r"reaches into the training levels \[5, 205\)"):
        evaluation_levels({"num_levels": 200, "start_level": 5}, 100)
    assert evaluation_levels({"num_levels": 0}, None)["held_out"] is False
    assert evaluation_levels({}, 2**30)["held_out"] is False


class _RandomAgent:
    """Stands for a trained model in evaluate(): random actions (what is tested is which levels it meets)."""

    @classmethod
    def load(cls, path, device="auto"):
        return cls()

    def predict(self, obs, state=None, episode_start=None, deterministic=False):
        return np.random.randint(0, 15, len(episode_start)), None


def _fake_model(path: Path) -> None:
    """A zip with the members of an SB3 model, which evaluate() takes for one (its loader is replaced)."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("data", "{}")
        z.writestr("policy.pth", b"")


def test_no_evaluation_level_is_a_training_level(tmp_path, capsys, monkeypatch):
    import rlseq.train as T
    from rlseq.evaluate import LEVEL_SEED_END, evaluate, main as evaluate_main

    run = tmp_path / "run"
    run.mkdir()
    _fake_model(run / "final_model.zip")
    # leaper: a random agent's episodes are short. The run trained on all level seeds but the last 1000, so that
    # levels drawn from the whole seed range (procgen's num_levels=0) would be training levels
    first = LEVEL_SEED_END - 1000
    (run / "config.yaml").write_text(yaml.safe_dump({"env": "leaper", "env_family": "procgen", "algo": "rlseq",
                                                     "gamma": 0.99, "env_kwargs": {"num_levels": first - 7,
                                                                                   "start_level": 7,
                                                                                   "num_threads": 0}}))
    monkeypatch.setattr(T, "_algo_class", lambda cfg: _RandomAgent)
    np.random.seed(0)
    res = evaluate(run, 8, n_envs=4, progress=False)
    assert res["held_out"] and res["start_level"] == first and res["num_levels"] == 1000
    assert len(res["level_seeds"]) == 8 and all(s >= first for s in res["level_seeds"]), res["level_seeds"]
    evaluate_main([str(run), "--episodes", "2", "--n-envs", "2"])
    assert f"held-out levels [{first}, {LEVEL_SEED_END})" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        evaluate_main([str(run), "--episodes", "1", "--start-level", "8"])
    assert f"reaches into the training levels [7, {first})" in capsys.readouterr().err


def _evaluate_refused(run: Path, extra: list[str], capsys, monkeypatch) -> str:
    """The one error line of an evaluation refused before any env is built."""
    import rlseq.train as T
    from rlseq.evaluate import main as evaluate_main

    monkeypatch.setattr(T, "make_env", lambda *a, **k: pytest.fail("an env was built before validation"))
    with pytest.raises(SystemExit) as e:
        evaluate_main([str(run), "--episodes", "1", *extra])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("config,message", [
    (None, "config.yaml not found: RUN_DIR must be a run folder written by rlseq.train"),
    (b"\x00\xff\xfe", "run config {path} is not a UTF-8 text file"),
    (b"env: [popgym\n", "run config {path} is not valid YAML at line 2"),
    (b"- 1\n", "{path} holds no mapping of settings but list '[1]'"),
    (b"seed: 0\n", "{path} lacks env, algo (or they are not names)"),
])
def test_evaluate_of_a_missing_or_garbage_config_yaml_is_one_error_line(config, message, tmp_path, capsys,
                                                                       monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    _fake_model(run / "final_model.zip")
    if config is not None:
        (run / "config.yaml").write_bytes(config)
    assert message.format(path=run / "config.yaml") in _evaluate_refused(run, [], capsys, monkeypatch)


def test_evaluate_refuses_no_envs_and_a_cuda_device_this_host_lacks(interrupted, capsys, monkeypatch):
    import torch

    run = _folder(interrupted)
    assert _evaluate_refused(run, ["--n-envs", "0"], capsys, monkeypatch) == "error: --n-envs must be >= 1, got 0"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _evaluate_refused(run, ["--device", "cuda"], capsys, monkeypatch) == \
        "error: --device cuda: this host has no CUDA device (torch.cuda.is_available() is False); use --device cpu or auto"


def test_evaluate_of_a_final_model_that_is_a_directory_and_no_checkpoint_is_one_error_line(interrupted, capsys,
                                                                                           monkeypatch):
    run = _folder(interrupted)
    shutil.rmtree(run / "checkpoints")
    (run / "final_model.zip").mkdir()
    line = _evaluate_refused(run, [], capsys, monkeypatch)
    assert line.startswith(f"error: {run} has neither a readable final_model.zip nor an intact checkpoint; "
                           f"{run / 'final_model.zip'} is not a readable model (IsADirectoryError")


def test_evaluate_names_the_model_it_played_and_the_newer_ones_it_passed_over(interrupted, capsys):
    from rlseq.evaluate import main as evaluate_main

    run = _folder(interrupted)
    (run / "final_model.zip").mkdir()
    (run / "checkpoints" / "step48" / "model.zip").write_bytes(b"torn")
    evaluate_main([str(run), "--episodes", "1", "--n-envs", "1", "--device", "cpu"])
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]  # the rest is the progress bar
    assert len(warnings) == 3, err
    assert f"{run / 'final_model.zip'} is not a readable model" in warnings[0]
    assert "checkpoint step48 is not usable" in warnings[1] and "latest names 'step48'" in warnings[2]
    assert "model checkpoints/step32/model.zip: the newer models are unusable (see the warnings)" in out


# --- 9. leftovers of killed saves ----------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_killed_saves_are_removed_on_resume_and_live_ones_kept(interrupted, capsys):
    ckpt = _folder(interrupted) / "checkpoints"
    dead, live = ckpt / f".step56.tmp{_dead_pid()}", ckpt / f".step56.tmp{os.getppid()}"
    dead.mkdir(), live.mkdir()
    (ckpt / f".latest.tmp{_dead_pid()}").write_text("step56")
    train_main(_argv(interrupted, 64, "--resume"))
    assert not dead.exists() and live.exists()
    assert sorted(p.name for p in ckpt.glob(".*")) == [live.name]
    assert f"removed {dead}" in capsys.readouterr().out


# --- 10. --resume of a run folder that does not exist --------------------------------------------------------


def test_resume_of_a_missing_run_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(_argv(tmp_path, 16, "--resume"))
    assert e.value.code == 2
    assert f"--resume: there is no run folder {_folder(tmp_path)}" in capsys.readouterr().err
    assert not tmp_path.joinpath(ENV).exists()


# --- 11. a run folder that cannot be written -----------------------------------------------------------------


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_full_disk_at_a_checkpoint_is_one_line_naming_the_file_and_the_intact_checkpoint(tmp_path, capsys,
                                                                                          monkeypatch):
    import errno

    import torch

    real_save = torch.save

    def full_at_step32(obj, f, *args, **kwargs):  # the disk fills while the second checkpoint is written
        if ".step32.tmp" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_step32)
    with pytest.raises(SystemExit) as e:
        train_main(_argv(tmp_path, 48))
    assert e.value.code == 1
    line = _one_error(capsys)
    ckpt = _folder(tmp_path) / "checkpoints"
    assert line.startswith(f"error: cannot write {ckpt}/.step32.tmp") and "No space left on device (ENOSPC)" in line
    assert f"the newest intact checkpoint is {ckpt / 'step16'}" in line
    assert line.endswith(shlex.join(["python", "-m", "rlseq.train", *_argv(tmp_path, 48), "--resume"]))
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step16"]  # the torn save took no space
    monkeypatch.setattr(torch, "save", real_save)
    _continue(line)
    assert _steps(_folder(tmp_path) / "final_model.zip") == 48


def test_a_full_disk_at_the_final_model_names_the_final_checkpoint_and_leaves_no_partial_zip(tmp_path, capsys,
                                                                                             monkeypatch):
    import errno

    from rlseq.algos import MemoryPPO

    real_save = MemoryPPO.save

    def full_at_the_final_model(self, path, *args, **kwargs):
        if str(path).endswith(".final_model.tmp.zip"):
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(self, path, *args, **kwargs)

    monkeypatch.setattr(MemoryPPO, "save", full_at_the_final_model)
    with pytest.raises(SystemExit) as e:
        train_main(_argv(tmp_path, 32))
    assert e.value.code == 1
    line = _one_error(capsys)
    folder = _folder(tmp_path)
    assert line.startswith(f"error: cannot write {folder / '.final_model.tmp.zip'}: No space left on device")
    assert f"the newest intact checkpoint is {folder / 'checkpoints' / 'step32'}" in line
    assert not (folder / ".final_model.tmp.zip").exists() and not (folder / "final_model.zip").exists()
    monkeypatch.setattr(MemoryPPO, "save", real_save)
    _continue(line)  # trains nothing: writes the final model of step 32
    assert _steps(folder / "final_model.zip") == 32


def test_a_read_only_checkpoints_folder_is_one_line_naming_the_intact_checkpoint(interrupted, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ckpt = _folder(interrupted) / "checkpoints"
    ckpt.chmod(0o555)
    try:
        with pytest.raises(SystemExit) as e:
            train_main(_argv(interrupted, 64, "--resume"))
    finally:
        ckpt.chmod(0o755)
    assert e.value.code == 1
    line = _one_error(capsys)
    assert f"cannot write {ckpt}" in line and "Permission denied" in line
    assert f"the newest intact checkpoint is {ckpt / 'step48'}" in line and line.endswith("--resume")


def test_a_logdir_that_is_a_file_is_one_error_line_and_the_file_is_kept(tmp_path, capsys):
    logdir = tmp_path / "runs"
    logdir.write_text("notes\n")
    with pytest.raises(SystemExit) as e:
        train_main(_argv(logdir, 16))
    assert e.value.code == 2
    assert _one_error(capsys) == (f"error: --logdir {logdir}: {logdir} is a file, so the run folder {_folder(logdir)} "
                                  "cannot be made; give a folder (or a path that does not exist yet)")
    assert logdir.read_text() == "notes\n"


def _as_numpy2_pickle(data: bytes) -> bytes:
    """A protocol-5 pickle of one frame with numpy 1's module names rewritten to numpy 2's (``numpy._core``), the
    frame's length fixed up: what numpy 2 writes for the same array."""
    assert data[:3] == b"\x80\x05\x95"
    old = b"numpy.core.numeric"
    body = data[11:].replace(bytes([0x8C, len(old)]) + old, bytes([0x8C, len(old) + 1]) + b"numpy._core.numeric")
    return data[:3] + len(body).to_bytes(8, "little") + body


def _numpy2_pickle_reads_back(make: str, error: str, message: str, check: str) -> None:
    """In a fresh interpreter: ``make`` (Python) builds ``data``, a numpy 2 pickle; under numpy 1 loading it must
    raise ``error`` naming ``message`` (else the test would show nothing), and after ``import rlseq.checkpoint``
    ``check`` (Python, on ``pickle.loads(data)`` as ``restored``) must pass."""
    code = f"""
import pickle, numpy as np
{make}
if int(np.__version__.split(".")[0]) < 2:
    try:
        pickle.loads(data)
    except {error} as e:
        assert {message!r} in str(e), e
    else:
        raise AssertionError("numpy 1 read a numpy 2 pickle without help: the test shows nothing")
import rlseq.checkpoint
restored = pickle.loads(data)
{check}
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_a_numpy_2_pickle_reads_back_once_rlseq_checkpoint_is_imported():
    """Checkpoints move between machines (a GPU host's numpy 2, a CPU machine's numpy 1.26): model.zip, rng.pt and
    vecnormalize.pkl hold numpy pickles. A numpy 2 pickle of an array fails to load under numpy 1 until
    rlseq.checkpoint is imported, and loads after."""
    _numpy2_pickle_reads_back(
        "from tests.test_reliability import _as_numpy2_pickle\n"
        "data = _as_numpy2_pickle(pickle.dumps(np.arange(3.0), protocol=5))",
        "ModuleNotFoundError", "numpy._core.numeric", "assert restored.tolist() == [0.0, 1.0, 2.0]")


def test_a_numpy_2_pickle_of_a_random_generator_reads_back_once_rlseq_checkpoint_is_imported():
    """model.zip pickles the spaces with their np_random. numpy 2 pickles a Generator as its bit generator, and the
    bit generator as its class and (state, seed sequence), where numpy 1 wrote a name and a state dict (numpy 1.26
    fails: "<class ...PCG64> is not a known BitGenerator module"). Built here as numpy 2 writes it."""
    make = """
import numpy.random._pickle as rp
source = np.random.Generator(np.random.PCG64(7))
class BitGenerator2:  # numpy 2's BitGenerator.__reduce__
    def __reduce__(self):
        return getattr(rp, "__bit_generator_ctor"), (np.random.PCG64,), (source.bit_generator.state, np.random.SeedSequence(7))
class Generator2:  # numpy 2's Generator.__reduce__
    def __reduce__(self):
        return getattr(rp, "__generator_ctor"), (BitGenerator2(),), None
data = pickle.dumps(Generator2())
"""
    check = """
assert restored.random(3).tolist() == source.random(3).tolist()
again = pickle.dumps(restored)  # and what numpy 1 writes from it is numpy's own pickle, not rlseq's
assert b"rlseq" not in again and pickle.loads(again).random() == restored.random()
legacy = np.random.RandomState(3)
assert pickle.loads(pickle.dumps(legacy)).rand() == legacy.rand()
"""
    _numpy2_pickle_reads_back(make, "ValueError", "is not a known BitGenerator", check)
