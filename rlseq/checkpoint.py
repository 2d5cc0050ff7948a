"""Atomic checkpoints of a training run, and resuming from them.

A checkpoint is a folder ``checkpoints/step<N>/`` with the model (weights and optimizer), the VecNormalize
statistics, the RNG states and a small ``meta.json``. It is written under a temporary name and renamed into
place, and ``checkpoints/latest`` (a one-line file, also replaced atomically) names the newest complete one.
A crash at any moment leaves either the previous or the new checkpoint, never a torn one; a disk that tears a
file anyway (or a hand that edits the folder) is caught on resume: :func:`resumable_checkpoint` takes the newest
checkpoint whose files all read back, whatever ``latest`` says, and names every newer one it skips and why.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import signal
import socket
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecNormalize


def read_numpy2_pickles() -> None:
    """Let numpy 1.x read what numpy 2 pickled: a checkpoint written on one machine, resumed on another.

    numpy 2 renamed ``numpy.core`` to ``numpy._core``, and its pickles name the new modules (every array that
    SB3's cloudpickle writes names ``numpy._core.numeric._frombuffer``). numpy 2 still reads numpy 1's names;
    numpy 1.26 carries stubs for only a few of the new ones, and fails on the rest with ``ModuleNotFoundError:
    numpy._core.numeric``. Each missing ``numpy._core.X`` is aliased to numpy 1's ``numpy.core.X``, the module of
    the same contents. numpy 2 also pickles random generators (the spaces' ``np_random`` in model.zip) by their
    bit generator's class or instance where numpy 1 wrote its name: numpy 1's three unpickling helpers are given
    numpy 2's reading of their argument. Nothing changes under numpy 2. Called when this module is imported."""
    if int(np.__version__.split(".")[0]) >= 2:
        return
    import sys

    import numpy.random._pickle as random_pickle

    for name, module in list(sys.modules.items()):
        if name.startswith("numpy.core.") and module is not None:
            sys.modules.setdefault("numpy._core." + name[len("numpy.core."):], module)
    if getattr(random_pickle, "_rlseq_reads_numpy2", False):
        return
    bit_generator_ctor = getattr(random_pickle, "__bit_generator_ctor")
    reading: dict[type, type] = {}

    def numpy2_state(cls: type) -> type:
        """``cls`` reading numpy 2's pickled state, ``(state dict, seed sequence)``, as well as numpy 1's dict."""
        if cls not in reading:
            def __setstate__(self: Any, state: Any) -> None:
                cls.__setstate__(self, state[0] if isinstance(state, tuple) else state)
            reading[cls] = type(cls.__name__, (cls,), {"__setstate__": __setstate__, "__module__": cls.__module__})
        return reading[cls]

    def bit_generator(arg: Any = "MT19937") -> Any:
        if isinstance(arg, np.random.BitGenerator):  # numpy 2: the bit generator itself
            return arg
        if isinstance(arg, type):  # numpy 2: its class, then its state as (dict, seed sequence)
            return numpy2_state(arg)()
        return bit_generator_ctor(arg)  # numpy 1: its name

    def generator(arg: Any = "MT19937", ctor: Any = bit_generator) -> Any:
        return np.random.Generator(ctor(arg))

    def random_state(arg: Any = "MT19937", ctor: Any = bit_generator) -> Any:
        return np.random.RandomState(ctor(arg))

    for name, fn in (("__bit_generator_ctor", bit_generator), ("__generator_ctor", generator),
                     ("__randomstate_ctor", random_state)):
        fn.__module__, fn.__name__, fn.__qualname__ = random_pickle.__name__, name, name  # pickled as numpy's own
        setattr(random_pickle, name, fn)
    random_pickle._rlseq_reads_numpy2 = True


read_numpy2_pickles()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync it, and rename it onto ``path``: readers see the old or the
    new file, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:  # a full disk: the half-written temporary would only take more of it
        if tmp.is_file():
            tmp.unlink()
        raise


LOCK_NAME = ".lock"
SETTINGS_NAME = "config.yaml"  # the run's settings, in the run folder and in each checkpoint
PENDING_LOGS_NAME = "pending_logs.json"  # the logger's records not yet written when the checkpoint was taken


class RunFolderBusy(RuntimeError):
    """Another live process trains into the same run folder."""


@contextlib.contextmanager
def folder_lock(folder: Path, name: str = LOCK_NAME):
    """Try to hold an exclusive lock on ``folder/name`` while the block runs: yields None once it is held, or the
    holder (``pid N on HOST``) when another process holds it (the block then runs without it).

    The lock is ``flock``: the kernel drops it when the holder exits, however it exits (SIGKILL included), so a
    dead process never blocks a resume. The descriptor is not inherited by child processes. On systems without
    ``fcntl`` (Windows) no lock is taken and None is yielded.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield None
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield None
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def run_folder_lock(folder: Path):
    """Hold :func:`folder_lock` on a run folder while the block runs.

    Two processes training into one folder would interleave their checkpoints and event files, so the second
    one raises :class:`RunFolderBusy` at once, naming the first one.
    """
    with folder_lock(folder) as holder:
        if holder is not None:
            raise RunFolderBusy(f"run folder {folder} is in use by another training process ({holder}); "
                                "wait for it to end or stop it, then --resume")
        yield


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(model: BaseAlgorithm, root: Path, keep: int = 2, settings: dict[str, Any] | None = None) -> Path:
    """Write ``root/step<N>`` atomically and point ``root/latest`` at it; of the older checkpoints keep the newest
    ``keep - 1`` (a newer one, which a resumed run has not reached again, is never deleted). ``settings`` (the
    run's resolved config) is stored with it as ``config.yaml``: what a resume compares its flags with when the
    run folder's own copy is gone."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step{model.num_timesteps}"
    tmp = root / f".step{model.num_timesteps}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        model.save(tmp / "model.zip")
        venv = model.get_vec_normalize_env()
        if venv is not None:
            venv.save(str(tmp / "vecnormalize.pkl"))
        torch.save(rng_state(), tmp / "rng.pt")
        pending = pending_records(getattr(model, "_logger", None))
        if pending is not None:
            (tmp / PENDING_LOGS_NAME).write_text(json.dumps(pending))
        if settings is not None:
            (tmp / SETTINGS_NAME).write_text(yaml.safe_dump(settings, sort_keys=True))
        sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        meta = {"num_timesteps": model.num_timesteps, "time": time.time(), "files": list(sizes), "sizes": sizes}
        (tmp / "meta.json").write_text(json.dumps(meta))
    except OSError:  # a full disk: free what the unfinished checkpoint took (the previous one stays as it was)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    aside = None
    if final.exists():  # a re-save of this step: moved aside, not deleted, until the new one is in place
        aside = root / f".{final.name}.old{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    write_text_atomic(root / "latest", final.name + "\n")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    older = [p for p in checkpoint_folders(root) if _step(p) < model.num_timesteps]
    for old in older[keep - 1:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _step(folder: Path) -> int:
    return int(folder.name[len("step"):])


def checkpoint_folders(root: Path) -> list[Path]:
    """The ``step<N>`` folders under ``root``, newest (largest N) first, intact or not."""
    folders = [p for p in root.glob("step*") if p.is_dir() and p.name[len("step"):].isdigit()]
    return sorted(folders, key=_step, reverse=True)


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from, naming the bad file, or None when every file reads back.

    Reads each file fully (the zip's CRCs, the pickles), so a truncated or torn file is caught here rather than
    halfway through a resume."""
    meta_path = folder / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        return f"{meta_path} is unreadable ({e.__class__.__name__}: {e})"
    shape = _meta_shape_problem(meta)
    if shape is not None:
        return f"{meta_path} is not a checkpoint record ({shape})"
    missing = [name for name in meta.get("files", ["model.zip", "rng.pt"]) if not (folder / name).is_file()]
    if missing:
        return f"{folder / missing[0]} is missing"
    for name, size in meta.get("sizes", {}).items():
        if (folder / name).stat().st_size != size:
            return f"{folder / name} is unreadable (truncated: {(folder / name).stat().st_size} of {size} bytes)"
    checks = [("model.zip", _check_zip), ("rng.pt", lambda p: torch.load(p, weights_only=False)),
              ("vecnormalize.pkl", _check_pickle), (SETTINGS_NAME, load_settings),
              (PENDING_LOGS_NAME, lambda p: json.loads(p.read_text()))]
    for name, check in checks:
        path = folder / name
        if not path.exists():
            continue
        try:
            check(path)
        except Exception as e:  # noqa: BLE001  (any failure to read the file makes the checkpoint unusable)
            return f"{path} is unreadable ({e.__class__.__name__}: {e})"
    return None


def pending_records(logger: Any) -> dict[str, Any] | None:
    """The numbers an SB3 logger holds for its next dump (PPO's ``train/*`` of the update before a checkpoint,
    written only after the next rollout), as JSON-ready ``{"values", "counts", "excluded"}``; None when there are
    none. A resumed run restores them (:func:`restore_pending_records`), so its curves lose no update."""
    values = getattr(logger, "name_to_value", None)
    if not values:
        return None
    numbers = {k: float(v) for k, v in values.items()
               if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}
    if not numbers:
        return None
    excluded = getattr(logger, "name_to_excluded", {})
    return {"values": numbers, "counts": {k: int(logger.name_to_count.get(k, 0)) for k in numbers},
            "excluded": {k: list(excluded[k]) for k in numbers if k in excluded}}


def restore_pending_records(logger: Any, checkpoint: Path) -> None:
    """Put the records :func:`pending_records` saved with ``checkpoint`` (if any) back into ``logger``."""
    path = checkpoint / PENDING_LOGS_NAME
    if not path.is_file():
        return
    pending = json.loads(path.read_text())
    for key, value in pending["values"].items():
        logger.name_to_value[key] = value
        logger.name_to_count[key] = pending["counts"].get(key, 0)
        if key in pending["excluded"]:
            logger.name_to_excluded[key] = tuple(pending["excluded"][key])


def load_settings(path: Path) -> dict[str, Any]:
    """A ``config.yaml`` (a run folder's or a checkpoint's) as the mapping a resume compares its flags with; raises
    (``OSError``, ``yaml.YAMLError``, ``ValueError``) for a file that is not one: a file of the right size can still
    be zeros after a power loss."""
    settings = yaml.safe_load(path.read_text())
    if not isinstance(settings, dict):
        raise ValueError(f"holds a {type(settings).__name__}, not a mapping of settings")
    return settings


def _meta_shape_problem(meta: Any) -> str | None:
    """What is wrong with the shape of a parsed ``meta.json`` (valid JSON may still be ``null`` or a list), or None."""
    if not isinstance(meta, dict):
        return f"a {type(meta).__name__}, not an object"
    files, sizes = meta.get("files", []), meta.get("sizes", {})
    if not isinstance(files, list) or not all(isinstance(f, str) and f and "/" not in f for f in files):
        return f"'files' is {files!r}, not a list of file names"
    if not isinstance(sizes, dict) or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes.values()) \
            or not all(isinstance(f, str) and f and "/" not in f for f in sizes):
        return f"'sizes' is {sizes!r}, not a mapping of file names to byte counts"
    return None


def _check_zip(path: Path) -> None:
    """An SB3 model archive whose members all pass their CRC (a truncated one can still open as the torch zip
    stored inside it, hence the check of SB3's own members)."""
    with zipfile.ZipFile(path) as z:
        if not {"data", "policy.pth"} <= set(z.namelist()):
            raise zipfile.BadZipFile("not an SB3 model archive (no data and policy.pth members)")
        bad = z.testzip()
    if bad is not None:
        raise zipfile.BadZipFile(f"member {bad} fails its CRC")


def _check_pickle(path: Path) -> None:
    with open(path, "rb") as f:
        pickle.load(f)


def resumable_checkpoint(root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` whose files all read back (None if there is none), and one warning
    per newer checkpoint skipped (naming its bad file) and for a ``latest`` pointer that names something else."""
    warnings, found = [], None
    for folder in checkpoint_folders(root):
        problem = checkpoint_problem(folder)
        if problem is None:
            found = folder
            break
        warnings.append(f"checkpoint {folder.name} is not usable: {problem}")
    pointer = root / "latest"
    named = read_pointer(pointer)
    if found is not None and named != found.name:
        what = "is missing" if named is None else ("is empty" if not named else f"names {named!r}")
        what = "is not a file" if pointer.exists() and not pointer.is_file() else what
        warnings.append(f"{pointer} {what}; the newest intact checkpoint is {found.name}")
    return found, warnings


def read_pointer(pointer: Path) -> str | None:
    """The step folder name a ``latest`` file holds (None when there is no such file; bytes that are not text
    read as replacement characters, naming no checkpoint)."""
    try:
        return pointer.read_bytes()[:200].decode(errors="replace").strip() if pointer.is_file() else None
    except OSError:
        return None


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint folder under ``root`` that holds a ``model.zip``, or None: a cheap look for progress
    reports, which reads no file (:func:`resumable_checkpoint` checks them)."""
    return next((folder for folder in checkpoint_folders(root) if (folder / "model.zip").is_file()), None)


def remove_stale_temporaries(root: Path) -> list[str]:
    """Clean up after saves killed midway, those whose pid is not a live process: delete the ``.step<N>.tmp<pid>``
    folders and ``.latest.tmp<pid>`` files, and put a ``.step<N>.old<pid>`` (a re-saved step's previous copy)
    back as ``step<N>`` when the new one never took its place, else delete it. Returns one line per action."""
    done = []
    for path in sorted(root.glob(".step*.old*")):
        name, pid = path.name[1:].rsplit(".old", 1)
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if (root / name).exists():
            shutil.rmtree(path)
            done.append(f"removed {path}, the previous copy of {name}, which was saved again")
        else:
            os.replace(path, root / name)
            done.append(f"restored {root / name} from {path}: a save of it again was killed midway")
    for path in list(root.glob(".step*.tmp*")) + list(root.glob(".latest.tmp*")):
        pid = path.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            done.append(f"removed {path}, left by a checkpoint save that did not finish")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def load_vecnormalize(checkpoint: Path, venv):
    """Wrap ``venv`` with the VecNormalize statistics saved in ``checkpoint`` (if any)."""
    path = checkpoint / "vecnormalize.pkl"
    return VecNormalize.load(str(path), venv) if path.exists() else venv


class CheckpointCallback(BaseCallback):
    """Save an atomic checkpoint every ``every`` env steps, and once more when asked to stop.

    Checked when a rollout starts, i.e. after the previous rollout's update: a checkpoint holds a whole
    number of rollouts *and* their updates, so resuming repeats no update and skips none. :meth:`request_stop`
    (a signal handler's call, see :func:`stop_on_signals`) makes the next rollout start save a checkpoint and
    end training at the following env step; :attr:`stopped_by` then holds the signal number. ``settings`` is
    stored with each checkpoint (:func:`save_checkpoint`).
    """

    def __init__(self, root: Path, every: int, keep: int = 2, verbose: int = 0,
                 settings: dict[str, Any] | None = None):
        super().__init__(verbose)
        self.settings = settings
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 env step, got {every}")
        self.root, self.every, self.keep = Path(root), int(every), keep
        self._last = 0
        self._stop_asked: int | None = None
        self.stopped_by: int | None = None
        self.stop_step: int | None = None

    def request_stop(self, signum: int) -> None:
        self._stop_asked = self._stop_asked or signum

    def _on_training_start(self) -> None:
        self._last = self.model.num_timesteps

    def _on_step(self) -> bool:
        return self.stopped_by is None

    def _on_rollout_start(self) -> None:
        due = self.model.num_timesteps - self._last >= self.every
        if due or (self._stop_asked and checkpoint_problem(self.root / f"step{self.model.num_timesteps}")):
            _flush_event_files(self.logger)  # a checkpoint on disk implies the curves up to it are too
            path = save_checkpoint(self.model, self.root, self.keep, self.settings)
            self._last = self.model.num_timesteps
            if self.verbose:
                print(f"checkpoint: {path}")
        if self._stop_asked:
            self.stopped_by, self.stop_step = self._stop_asked, self.model.num_timesteps


def _flush_event_files(logger: Any) -> None:
    for output in getattr(logger, "output_formats", []):
        writer = getattr(output, "writer", None)
        if writer is not None:
            writer.flush()


@contextlib.contextmanager
def stop_on_signals(callback: CheckpointCallback, signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
    """While the block runs, SIGINT and SIGTERM ask ``callback`` to checkpoint and stop at the next rollout start
    instead of killing the process mid-rollout; a second signal raises :class:`KeyboardInterrupt` at once, with the
    signal's number as its argument (the CLI exits with 128 + it)."""

    def handler(signum: int, frame: Any) -> None:
        if callback._stop_asked:
            raise KeyboardInterrupt(signum)
        callback.request_stop(signum)
        # at once, as a rollout can take a minute on a CPU; os.write, because a print here could land inside
        # another print of the interrupted code (a reentrant write of sys.stderr raises)
        os.write(2, f"\n{signal.Signals(signum).name}: stopping after this rollout and its update, with a checkpoint; "
                    "a second signal stops at once (a resume then continues from the newest checkpoint on disk)\n"
                 .encode())

    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
