"""``python -m rlseq.sweep CONFIG.yaml``: expand a grid of training runs and run it with Ray, on this machine or
on a cluster.

    python -m rlseq.sweep configs/experiments/caveflyer_scales.yml --dry-run
    python -m rlseq.sweep configs/experiments/caveflyer_scales.yml --gpus all --runs-per-gpu 3
    python -m rlseq.sweep configs/experiments/caveflyer_scales.yml --only memory=efla,deltanet --only condition=reward1e3
    python -m rlseq.sweep configs/experiments/caveflyer_scales.yml --status
    python -m rlseq.sweep configs/experiments/caveflyer_scales.yml --address auto --gpus-per-run 0.33 --cpus-per-run 4

The sweep file (YAML) names the grid and the flags of ``python -m rlseq.train`` that every run shares::

    logdir: runs                    # the one runs/ tree that rlseq.compare reads
    envs: [caveflyer]
    memories: [efla, deltanet, lstm, none]
    seeds: [0, 1, 2]
    conditions:                     # name -> train flags; the name becomes the run's --tag
      standard: {}
      reward1e3: {reward_scale: 1000.0, prev_action_reward: true, normalize_reward: false}
    flags: {total_steps: 5_000_000, tf32: true}    # shared by every run (a condition's flags win)
    runs_per_gpu: 3                 # default of --runs-per-gpu

Each run is one ``python -m rlseq.train`` process writing ``<logdir>/<env>/<memory>-<condition>/seed<N>/``
(its output goes to ``train.log`` in that folder), started by a Ray task that holds ``--cpus-per-run`` CPUs
and ``--gpus-per-run`` GPUs (fractional: ``--runs-per-gpu 3`` is a third of a GPU each; Ray sets the task's
``CUDA_VISIBLE_DEVICES``). Runs are queued seed by seed, so a grid cut short still has every memory and
condition at the seeds it reached. A run whose folder holds ``final_model.zip`` is skipped; any other run is
started with ``--resume``, so an interrupted run continues from its last checkpoint. Every run's flags are
checked by the training CLI before anything starts.

Where: without ``--address`` the sweep starts Ray inside itself on this machine (bound to 127.0.0.1, no
dashboard; ``--gpus`` picks its GPUs, ``--parallel N`` gives it N runs' worth of CPUs) and stops it at the end.
``--address auto|HOST:PORT`` joins a running cluster (``ray start --head`` / ``ray start --address ...``); the
runs tree must then be on storage that every node sees under the same path (docs/multi_machine.md).

Failures: a trainer that exits non-zero (for example a memory state that turned NaN, which the trainer
reports with where it arose) is restarted from its last checkpoint ``--retries`` times (default 1), then
recorded as failed with the end of its log; a usage error (exit 2) is recorded at once, as it would recur. A run whose worker or node dies is rescheduled by Ray (up to
``--retries`` times) and resumes from its checkpoint. SIGINT or SIGTERM to the sweep cancels the queued runs
and stops every trainer with SIGTERM (through ``ray.cancel``); the runs it stops are recorded as ``stopped`` and resume the next
time the sweep is started (tasks that have not ended a minute later are killed). A sweep killed outright
(SIGKILL) takes its embedded Ray with it (a reaper process ends what Ray itself leaves behind), and each trainer
gets SIGTERM when its Ray worker dies.

Two sweeps over one tree (two terminals, or hosts sharing the disk) split the grid: a sweep's task locks the
run folder (``.sweep.lock``) before it starts a trainer, and the trainer locks it too (``.lock``, exit status
75 when another process holds it). A run that the other sweep (or any other training process) holds is recorded
as ``elsewhere``, one that it finished as ``finished``; neither is failed, retried or trained twice. Each
sweep's end re-reads the runs it left elsewhere, so the status file of the sweep that ends last shows the
grid finished. ``<logdir>/sweep-<name>.json`` holds the state of
every run (node, GPU, attempts, env steps) and is rewritten atomically whenever one starts or ends (two sweeps of
one file share it: the last writer's view holds); a progress
bar over the grid's env steps (from the checkpoints) shows done / running / failed and the ETA. The exit code
is 0 when every run of the grid (or of ``--only``) finished, 1 when one failed, was stopped or is still
training elsewhere, 2 for a bad sweep file or flag.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlseq import reaper


GRID_KEYS = ("envs", "memories", "seeds", "conditions")
SWEEP_KEYS = frozenset(GRID_KEYS + ("logdir", "flags", "runs_per_gpu", "description"))
FILTER_KEYS = ("env", "memory", "seed", "condition")
# train flags a sweep sets itself, per run
RESERVED_FLAGS = frozenset({"env", "memory", "seed", "tag", "logdir", "resume", "device"})


class SweepError(ValueError):
    """A malformed sweep file or flag, reported before any run starts."""


@dataclass
class Run:
    """One training process of the grid."""

    env: str
    memory: str
    seed: int
    condition: str
    argv: list[str]
    folder: Path
    total_steps: int = 0  # env steps of the finished run
    # pending | finished (before this sweep reached it, or by another sweep) | running | done (trained here) |
    # elsewhere (another sweep or process holds it) | failed | stopped
    state: str = "pending"
    returncode: int | None = None
    node: str | None = None  # the Ray node's address
    gpu: str | None = None  # the GPU ids Ray gave it (None on the CPU)
    attempts: int = 0  # trainer starts: retries after a failure and reschedules after a lost node count
    started: float | None = None
    seconds: float | None = None
    log_tail: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.env}/{self.memory}-{self.condition}/seed{self.seed}"


def _flag_argv(flags: dict[str, Any], known: dict[str, argparse.Action]) -> list[str]:
    """``{total_steps: 5e6, tf32: true, normalize_reward: false}`` -> ``--total-steps 5000000.0 --tf32 --no-normalize-reward``.

    ``known``: the training parser's actions by option string. ``false`` for an on/off flag without a ``--no-``
    form (``tf32: false``) just leaves the flag out. A list is refused unless the flag is repeatable: repeated,
    a one-value flag would train with its last item only.
    """
    argv: list[str] = []
    for key, value in flags.items():
        key = str(key)
        if key in RESERVED_FLAGS:
            raise SweepError(f"flag {key!r} is set by the sweep for each run; remove it from the sweep file")
        opt = "--" + key.replace("_", "-")
        if opt not in known:
            flags_known = sorted(o[2:].replace("-", "_") for o in known
                                 if o.startswith("--") and not o.startswith("--no-") and o[2:].replace("-", "_") not in RESERVED_FLAGS)
            raise SweepError(f"unknown train flag {key!r}; flags of python -m rlseq.train: {', '.join(flags_known)}")
        if value is True:
            argv.append(opt)
        elif value is False:
            if "--no-" + key.replace("_", "-") in known:
                argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, list):  # a repeatable flag, e.g. env_package: [a, b]
            if not isinstance(known[opt], argparse._AppendAction):
                raise SweepError(f"flag {key!r} takes one value, got the list {value!r}; to train several values, "
                                 "make each one a condition (conditions: {name: {" + key + ": value}})")
            for item in value:
                argv += [opt, str(item)]
        elif value is not None:
            argv += [opt, str(value)]
    return argv


def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and check a sweep file (see the module docstring)."""
    from rlseq.config import UsageError, read_yaml

    path = Path(path)
    try:
        spec = read_yaml(path, "sweep file")
    except UsageError as e:
        raise SweepError(str(e)) from None
    spec = {} if spec is None else spec
    if not isinstance(spec, dict):
        raise SweepError(f"{path}: expected a mapping with keys {', '.join(sorted(SWEEP_KEYS))}")
    unknown = set(spec) - SWEEP_KEYS
    if unknown:
        raise SweepError(f"{path}: unknown keys {', '.join(sorted(unknown))}; valid keys: {', '.join(sorted(SWEEP_KEYS))}")
    for key in ("envs", "memories", "seeds"):
        if not isinstance(spec.get(key), list) or not spec[key]:
            raise SweepError(f"{path}: {key!r} must be a non-empty list")
        if any(item is None or isinstance(item, (dict, list)) for item in spec[key]):
            raise SweepError(f"{path}: {key!r} must list plain names or numbers, got {spec[key]!r} (an empty "
                             "item is null)")
    conditions = spec.get("conditions") or {"default": {}}
    if not isinstance(conditions, dict) or not all(isinstance(v, dict) or v is None for v in conditions.values()):
        raise SweepError(f"{path}: 'conditions' must map a name to a mapping of train flags")
    spec["conditions"] = {str(k): dict(v or {}) for k, v in conditions.items()}
    spec["flags"] = spec.get("flags") or {}
    if not isinstance(spec["flags"], dict):
        raise SweepError(f"{path}: 'flags' must be a mapping of train flags")
    per_gpu = spec.get("runs_per_gpu", 1)
    if isinstance(per_gpu, bool) or not isinstance(per_gpu, int) or per_gpu < 1:  # YAML reads yes/on as true
        raise SweepError(f"{path}: 'runs_per_gpu' must be an integer >= 1, got {per_gpu!r}")
    spec.setdefault("logdir", "runs")
    spec["name"] = path.stem
    return spec


def expand(spec: dict[str, Any], only: dict[str, set[str]] | None = None, logdir: str | Path | None = None) -> list[Run]:
    """The runs of the grid, seed-major, restricted to ``only`` (``{"memory": {"efla"}, ...}``).

    Every run's flags go through the training CLI's parser and ``resolve`` (which builds nothing), so a
    bad name or flag fails here with the CLI's message instead of minutes later in a child process.
    """
    from rlseq.train import UsageError, build_parser, resolve, run_dir

    only = only or {}
    grid = {"env": [str(e) for e in spec["envs"]], "memory": [str(m) for m in spec["memories"]],
            "seed": [str(s) for s in spec["seeds"]], "condition": list(spec["conditions"])}
    for key, wanted in only.items():
        if key not in FILTER_KEYS:
            raise SweepError(f"unknown filter {key!r}; valid filters: {', '.join(FILTER_KEYS)}")
        missing = sorted(set(wanted) - set(grid[key]))
        if missing:
            raise SweepError(f"--only {key}={','.join(missing)}: not in the grid; valid {key} values: {', '.join(grid[key])}")
    logdir = str(logdir if logdir is not None else spec["logdir"])
    blocked = next((p for p in (Path(logdir), *Path(logdir).parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:  # every trainer and the status file would fail on it
        raise SweepError(f"logdir {logdir}: {blocked} is a file; give a folder (or a path that does not exist yet)")
    parser = build_parser()
    known = parser._option_string_actions
    runs = []
    for seed, (cond, cflags), env, memory in itertools.product(
            spec["seeds"], spec["conditions"].items(), spec["envs"], spec["memories"]):
        values = {"env": str(env), "memory": str(memory), "seed": str(seed), "condition": cond}
        if any(values[k] not in allowed for k, allowed in only.items()):
            continue
        argv = ["--env", str(env), "--memory", str(memory), "--seed", str(seed), "--tag", cond, "--logdir", logdir,
                *_flag_argv({**spec["flags"], **cflags}, known)]
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            raise SweepError(f"run {env}/{memory}-{cond}/seed{seed}: the training CLI rejects {' '.join(argv)}") from None
        try:
            cfg = resolve(args)
        except UsageError as e:
            raise SweepError(f"run {env}/{memory}-{cond}/seed{seed}: {e}") from None
        run = Run(cfg["env"], str(memory), int(seed), cond, argv, run_dir(logdir, cfg), int(cfg["n_timesteps"]))
        twin = next((r for r in runs if r.folder == run.folder), None)
        if twin is not None:  # two processes would write one folder
            raise SweepError(f"the grid names run {run.name} twice (check for repeated envs, memories or seeds)")
        runs.append(run)
    if not runs:
        raise SweepError("the filters leave no run of the grid")
    return runs


def run_progress(run: Run) -> int:
    """Env steps of the newest checkpoint of ``run`` (0 if none)."""
    from rlseq.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run.folder / "checkpoints")
    return int(ckpt.name[len("step"):]) if ckpt is not None else 0


def _parse_gpus(text: str) -> list[str] | None:
    """``--gpus``: ``none`` -> None, ``all`` -> the GPUs this process sees, ``0,1`` -> those indices."""
    if text == "none":
        return None
    if text == "all":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise SweepError("--gpus all: no CUDA device is visible; use --gpus none --parallel N for the CPU")
        # Ray hands out what CUDA_VISIBLE_DEVICES names: keep ours when it is set (it may be "2,3" or UUIDs)
        visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        return visible[:n] if len(visible) >= n else [str(i) for i in range(n)]
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus):
        raise SweepError(f"--gpus takes all, none or comma-separated GPU indices like 0,1; got {text!r}")
    import torch

    if torch.cuda.device_count() == 0:  # Ray would hand out GPUs that are not there, and every run would fail
        raise SweepError(f"--gpus {text}: no CUDA device is visible; use --gpus none --parallel N for the CPU")
    return gpus


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast where ``ray.init`` would wait: a ``HOST:PORT`` (or ``ray://HOST:PORT``) that accepts no TCP
    connection. ``auto`` (found by Ray itself) is left to Ray."""
    host, port = _host_port(address)
    if not host or port is None:
        return
    e = _connect_error(host, port, timeout_s)
    if e is not None:
        raise SweepError(f"--address {address}: nothing answers there ({e.strerror or e}); start the head node "
                         "with `ray start --head` on that host, or give its address as `ray start` printed it") from None


def _write_status(path: Path, spec_name: str, runs: list[Run]) -> None:
    def row(r: Run) -> dict[str, Any]:
        d = asdict(r)
        d.update(name=r.name, folder=str(r.folder), steps=run_progress(r))
        d.pop("argv")
        return d

    from rlseq.checkpoint import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"sweep": spec_name, "time": time.time(), "runs": [row(r) for r in runs]}, indent=1))


def log_tail(path: Path, n: int = 15) -> list[str]:
    """The last ``n`` lines of a log file (none if it cannot be read)."""
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _stop_with_parent(parent_pid: int) -> None:
    """In a training process, before exec (Linux): get SIGTERM when its parent (the sweep's Ray worker) dies,
    even by SIGKILL, so no orphan keeps training into a folder that the next sweep resumes (its run-folder
    lock would refuse it)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died between the fork and prctl: no signal will come
        os._exit(1)


# --- one run: a Ray task on whichever node has its resources ----------------------------------------------

# a trainer that died of SIGINT or SIGTERM, or caught one and exited 128 + its number (rlseq.train does, after its
# stop checkpoint), was stopped, not failed: a retry would train on after someone (the parent-death signal of a
# killed sweep's worker, a user's kill) asked it to stop
STOPPED_BY = tuple(code for sig in (signal.SIGINT, signal.SIGTERM) for code in (-sig, 128 + sig))
# rlseq.train's exit status for a usage error (a bad flag or config, a torn checkpoint with no intact one): the
# same command would fail the same way, so it is not retried
USAGE_EXIT = 2


class Board:
    """The sweep's mailbox, a Ray actor on the driver's node: tasks report when a run starts (or restarts)."""

    def __init__(self) -> None:
        self._events: list[tuple[str, dict[str, Any]]] = []

    def started(self, name: str, info: dict[str, Any]) -> None:
        self._events.append((name, info))

    def drain(self) -> list[tuple[str, dict[str, Any]]]:
        events, self._events = self._events, []
        return events


def _trainer_preexec(parent_pid: int) -> None:
    """Before exec: the trainer acts on SIGINT and SIGTERM whatever the Ray worker did with them (an ignored
    signal stays ignored across exec), and dies with the worker on Linux."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    if sys.platform == "linux":
        _stop_with_parent(parent_pid)


def _cancellable() -> None:
    """Let ``ray.cancel`` reach this task. Ray cancels a running task by interrupting its thread as a SIGINT would
    (``_thread.interrupt_main``), which Python drops unless SIGINT has a Python handler; a sweep started with ``&``
    from a script has SIGINT ignored, and so have the Ray workers it starts (an ignored signal stays ignored across
    fork and exec). Without this the trainer is never told to stop: on SIGINT it trains to its end, on SIGTERM
    until the grace period ends and its task is killed, without its stop checkpoint."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL)):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _train_once(argv: list[str], env: dict[str, str], cwd: str | None, folder: Path,
                poll_s: float = 1.0) -> tuple[int, bool]:
    """One trainer process, its output appended to ``folder/train.log``; returns ``(returncode, stopped)``.

    The sweep stops a run with ``ray.cancel``, which raises KeyboardInterrupt here; the trainer then gets
    SIGTERM and ends with its last checkpoint. No Ray call here: a task blocked in ray.get or ray.wait lends its
    CPUs to the next queued run (more trainers than the resources allow), and in a cancelled task ray.get fails.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.log", "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n")
        log.flush()
        # its own session: a signal to the whole process group (a terminal's Ctrl-C, `timeout`, `kill -- -PGID`)
        # would reach the trainer directly and again through this process below, and a second signal stops a
        # trainer at once, short of its stop checkpoint; this way every stop reaches it exactly once
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
                                preexec_fn=functools.partial(_trainer_preexec, os.getpid()))
    try:
        while proc.poll() is None:  # a blocking wait would defer the KeyboardInterrupt until the trainer ends
            try:
                proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        while True:
            try:
                proc.wait()
                break
            except KeyboardInterrupt:  # a second cancel: the trainer is stopping already
                pass
        return proc.returncode, True
    return proc.returncode, proc.returncode in STOPPED_BY


SWEEP_LOCK_NAME = ".sweep.lock"  # held by a sweep's task; a second sweep on the tree leaves the run alone


def run_environment(spec: dict[str, Any], gpus: list[str]) -> dict[str, str]:
    """The environment of one run's trainer: its torch threads (``OMP_NUM_THREADS``), its share of the cores
    (``RLSEQ_CPUS``, which procgen's ``num_threads: auto`` takes in place of every core the host has) and its GPUs."""
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(spec["threads"]), RLSEQ_CPUS=str(spec["cpus"]),
                CUDA_VISIBLE_DEVICES=",".join(gpus))


def train_run(spec: dict[str, Any], board: Any) -> dict[str, Any]:
    """Train one run inside a Ray task: ``python -m rlseq.train ... --resume`` until it finishes, and again from
    its last checkpoint after a non-zero exit, ``spec["retries"]`` times at most. A run that was stopped
    (by the sweep or a signal), refused by the trainer as a usage error (exit 2: it would fail again the same
    way), finished by another process, or in another process's hands (another sweep on the same tree) is not
    retried. Returns ``{"state", "returncode", "started", "ended", ...}``."""
    import ray

    from rlseq.checkpoint import folder_lock
    from rlseq.train import BUSY_EXIT

    gpus = [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    env = run_environment(spec, gpus)
    argv = [sys.executable, "-m", "rlseq.train", *spec["argv"], "--resume", "--no-progress-bar"]
    if not gpus:
        argv += ["--device", "cpu"]
    cwd = spec["cwd"] if os.path.isdir(spec["cwd"]) else None
    folder = Path(spec["folder"])
    info: dict[str, Any] = {"node": ray.util.get_node_ip_address(), "gpu": ",".join(gpus) or None,
                            "started": time.time()}
    started, rc, state, tail = info["started"], None, "failed", []
    _cancellable()
    try:
        with folder_lock(folder, SWEEP_LOCK_NAME) as holder:
            if holder is not None:  # another sweep on the same tree has it
                state, tail = "elsewhere", [f"another sweep works on this run: {holder}"]
            for attempt in range(spec["retries"] + 1 if holder is None else 0):
                if (folder / "final_model.zip").exists():  # finished by another sweep since this one started
                    state = "finished"
                    break
                if attempt:
                    info = dict(info, started=time.time(), retry_after=rc)
                board.started.remote(spec["name"], info)  # no wait for the answer (see _train_once)
                rc, stopped = _train_once(argv, env, cwd, folder)
                # BUSY_EXIT: a process outside any sweep trains into the folder
                state = "done" if rc == 0 else "elsewhere" if rc == BUSY_EXIT else "stopped" if stopped else "failed"
                if state != "failed" or rc == USAGE_EXIT:
                    break
    except KeyboardInterrupt:  # cancelled between two trainers
        state = "stopped"
    if state in ("failed", "elsewhere") and not tail:
        tail = log_tail(folder / "train.log")
    return {"state": state, "returncode": rc, "started": started, "ended": time.time(), "node": info["node"],
            "gpu": info["gpu"], "log_tail": tail}


# --- the driver ----------------------------------------------------------------------------------------------

STOP_GRACE_S = 60.0  # how long stopped trainers get to exit before their tasks are killed


@dataclass
class Resources:
    """What each run asks of Ray, and where Ray runs: ``address`` None starts an embedded single-machine Ray."""

    cpus_per_run: float = 1.0
    gpus_per_run: float | None = None  # None: 1 / runs_per_gpu when there are GPUs, else 0
    runs_per_gpu: int = 1
    gpus: list[str] | None = None  # embedded Ray only: the GPUs it may use
    parallel: int | None = None  # embedded Ray only: CPUs = parallel x cpus_per_run (default: every core)
    address: str | None = None
    threads_per_run: int | None = None
    retries: int = 1


# ray.init swaps a loopback address (a node's, or the cluster address given) for the host's routable one unless
# this is off; it is read when ray is imported, and by the processes of an embedded Ray, which inherit it
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _host_port(address: str) -> tuple[str, int | None]:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return host.strip("[]"), (int(port) if port.isdigit() else None)


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")  # the hosts Ray rewrites


def _routable_ip() -> str:
    """This host's address as Ray picks it when it rewrites a loopback one: the source of a route outwards."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 53))  # UDP: nothing is sent
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _connect_error(host: str, port: int, timeout_s: float) -> OSError | None:
    """Why a TCP connection to ``host:port`` fails, or None when something accepts it."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return e
    return None


def _answers(host: str, port: int, timeout_s: float = 2.0) -> bool:
    return _connect_error(host, port, timeout_s) is None


def _ray_env(res: Resources) -> dict[str, str]:
    """The environment ``ray`` must be imported and started in. An embedded Ray stays on the loopback and sees
    only ``--gpus``. Joining at a loopback address, Ray would connect to this host's routable address instead:
    right for a head started by a plain ``ray start --head``, a hang for one that listens on the loopback only
    (``--node-ip-address 127.0.0.1``), so there Ray is kept on the loopback too."""
    if res.address is None:
        return {**LOOPBACK_ONLY, **({"CUDA_VISIBLE_DEVICES": ",".join(res.gpus)} if res.gpus is not None else {})}
    host, port = _host_port(res.address)
    if _is_loopback(host) and port is not None and not res.address.startswith("ray://"):  # Ray Client: no rewrite
        routable = _routable_ip()
        if not _is_loopback(routable) and not _answers(routable, port):
            return dict(LOOPBACK_ONLY)
    return {}


def _start_ray(res: Resources) -> Any:
    """Join the cluster at ``res.address``, or start Ray on this machine bound to 127.0.0.1, without the
    dashboard, so that nothing on the network can reach it, and with a reaper (:mod:`rlseq.reaper`) that ends
    its processes if the sweep is killed outright. :func:`_stop_ray` ends both."""
    import logging

    global _reaper
    env = _ray_env(res)
    if env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0" and "ray" in sys.modules:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:  # read at import: too late to keep Ray on the loopback
            raise SweepError("ray was imported before rlseq.sweep could keep it on the loopback "
                             "(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); start the sweep in a fresh process")
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if res.address is not None:
            import ray

            ray.init(address=res.address, log_to_driver=False, logging_level=logging.WARNING)
            return ray
        _reaper = reaper.start()
        import ray

        cpus = res.parallel * res.cpus_per_run if res.parallel else float(os.cpu_count() or 1)
        try:
            ray.init(address="local", num_cpus=max(cpus, res.cpus_per_run), num_gpus=len(res.gpus or []),
                     include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=100 * 2**20,
                     log_to_driver=False, logging_level=logging.WARNING)
        except BaseException:  # (Ctrl-C included) what ray.init had started before it failed is ended too
            reaper.stop(_reaper, reap=True)
            _reaper = None
            raise
    finally:  # the caller's environment as it was (a later `ray start` in it must not see the switch)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    addresses = {n["NodeManagerAddress"] for n in ray.nodes()}
    if addresses != {"127.0.0.1"}:
        _stop_ray(ray)
        raise SweepError(f"the embedded Ray bound to {', '.join(sorted(addresses))} instead of 127.0.0.1 "
                         "(was ray imported before rlseq.sweep set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0?)")
    return ray


_reaper = None  # the embedded Ray's reaper while it runs


def _stop_ray(ray: Any) -> None:
    """Shut Ray down (and an embedded Ray's reaper, which then leaves everything alone)."""
    global _reaper
    try:
        ray.shutdown()
    finally:
        reaper.stop(_reaper)
        _reaper = None


def _plan(ray: Any, res: Resources) -> tuple[float, int]:
    """GPUs per run and how many runs the cluster's live nodes hold at once; a run no node can hold is an error."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    gpus = res.gpus_per_run
    if gpus is None:
        gpus = 1.0 / res.runs_per_gpu if (res.gpus is not None or res.address) and any(n.get("GPU") for n in nodes) else 0.0
    if res.address is None and res.gpus is None:
        gpus = 0.0  # --gpus none
    slots = [min(int(n.get("CPU", 0) / res.cpus_per_run + 1e-9), int(n.get("GPU", 0) / gpus + 1e-9) if gpus else 1 << 30)
             for n in nodes]
    if not any(slots):
        have = ", ".join(f"{n.get('CPU', 0):g} CPU/{n.get('GPU', 0):g} GPU" for n in nodes)
        raise SweepError(f"no Ray node can hold a run of {res.cpus_per_run:g} CPU and {gpus:g} GPU (nodes: {have})")
    return gpus, sum(slots)


def _steps(run: Run) -> int:
    return run.total_steps if (run.folder / "final_model.zip").exists() else min(run.total_steps, run_progress(run))


def execute(runs: list[Run], res: Resources, *, status_path: Path, spec_name: str, poll_s: float = 0.5,
            progress: bool = True) -> int:
    """Run the pending runs as Ray tasks; returns the number of failed runs.

    A SIGINT/SIGTERM cancels every task, which stops its trainer with SIGTERM (recorded as ``stopped``, not
    failed); tasks still running ``STOP_GRACE_S`` later are killed, and their trainers with them.
    """
    for r in runs:
        if (r.folder / "final_model.zip").exists():
            r.state = "finished"
    queue = [r for r in runs if r.state == "pending"]
    if not queue:
        print(f"sweep {spec_name}: {len(runs)} runs, {len(runs)} finished already, 0 to run", flush=True)
        _write_status(status_path, spec_name, runs)
        return 0
    ray = _start_ray(res)
    stopping: int | None = None

    def stop(signum, _frame):
        nonlocal stopping
        stopping = signum

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    refs: dict[Any, Run] = {}
    bar = None
    try:
        gpus_per_run, slots = _plan(ray, res)
        print(f"sweep {spec_name}: {len(runs)} runs, {len(runs) - len(queue)} finished already, {len(queue)} to run "
              f"on {slots} slots ({res.cpus_per_run:g} CPU, {gpus_per_run:g} GPU each; "
              f"{len(ray.nodes())} Ray node{'s' * (len(ray.nodes()) > 1)})", flush=True)
        _write_status(status_path, spec_name, runs)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        from tqdm.auto import tqdm

        board = ray.remote(Board).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)).remote()
        task = ray.remote(train_run)
        # max_retries: a run whose worker or node died is rescheduled (and resumes from its checkpoint)
        opts = {"num_cpus": res.cpus_per_run, "num_gpus": gpus_per_run, "max_retries": res.retries}
        threads = res.threads_per_run or max(1, int(res.cpus_per_run))
        for run in queue:
            logdir_at = run.argv.index("--logdir") + 1
            argv = [*run.argv[:logdir_at], str(Path(run.argv[logdir_at]).absolute()), *run.argv[logdir_at + 1:]]
            spec = {"name": run.name, "argv": argv, "folder": str(run.folder.absolute()), "cwd": os.getcwd(),
                    "threads": threads, "cpus": max(1, int(res.cpus_per_run)), "retries": res.retries}
            refs[task.options(**opts, name=f"rlseq.sweep:{run.name}").remote(spec, board)] = run
        bar = tqdm(total=sum(r.total_steps for r in runs), initial=sum(_steps(r) for r in runs), unit="step",
                   unit_scale=True, smoothing=0, dynamic_ncols=True, disable=not progress,
                   mininterval=1 if sys.stderr.isatty() else 30, desc=f"sweep {spec_name}")
        stop_sent = None
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=poll_s)
            by_name = {r.name: r for r in runs}
            for name, info in ray.get(board.drain.remote()):
                _on_start(by_name[name], info, bar)
                _write_status(status_path, spec_name, runs)
            for ref in ready:
                _on_end(ray, refs.pop(ref), ref, bar, stopping=stopping is not None)
                _write_status(status_path, spec_name, runs)
            if stopping and stop_sent is None:
                stop_sent = time.time()
                for ref in refs:  # a queued run is dropped; a running one stops its trainer with SIGTERM
                    ray.cancel(ref)
            elif stop_sent is not None and time.time() > stop_sent + STOP_GRACE_S:
                for ref in refs:
                    ray.cancel(ref, force=True)
            counts = {s: sum(r.state == s for r in runs) for s in ("running", "failed", "pending")}
            bar.set_postfix_str(f"{sum(r.state in ('done', 'finished') for r in runs)} done, {counts['running']} "
                                f"running, {counts['failed']} failed, {counts['pending']} queued", refresh=False)
            bar.update(sum(_steps(r) for r in runs) - bar.n)  # redraws at most every mininterval
    finally:
        for ref in refs:  # an error in the driver: no task may outlive it
            ray.cancel(ref, force=True)
        for s, h in old.items():
            signal.signal(s, h)
        if bar is not None:
            bar.close()
        _stop_ray(ray)
        for r in runs:  # what another sweep was training may have finished meanwhile
            if r.state == "elsewhere" and (r.folder / "final_model.zip").exists():
                r.state = "finished"
        _write_status(status_path, spec_name, runs)
    failed = [r for r in runs if r.state == "failed"]
    left = [r for r in runs if r.state in ("pending", "running", "stopped")]
    elsewhere = [r for r in runs if r.state == "elsewhere"]
    print(f"sweep {spec_name}: {sum(r.state in ('done', 'finished') for r in runs)} finished, {len(failed)} failed"
          + (f", {len(left)} not run (stopped)" if left else "")
          + (f", {len(elsewhere)} running elsewhere (another sweep or process holds them)" if elsewhere else ""),
          flush=True)
    return len(failed)


def _on_start(run: Run, info: dict[str, Any], bar: Any) -> None:
    run.attempts += 1
    if run.state in ("done", "failed", "stopped", "finished", "elsewhere"):  # its end overtook this message
        return
    run.state, run.node, run.gpu = "running", info["node"], info["gpu"]
    run.started = run.started or info["started"]
    why = f"  retry after rc={info['retry_after']}" if "retry_after" in info else (
        "  rescheduled" if run.attempts > 1 else "")
    bar.write(f"start  {run.name}  node={run.node}  gpu={run.gpu or 'cpu'}  from step {run_progress(run):,}{why}")


def _on_end(ray: Any, run: Run, ref: Any, bar: Any, *, stopping: bool) -> None:
    from ray.exceptions import RayError, TaskCancelledError

    try:
        out = ray.get(ref)
    except TaskCancelledError:
        run.state = "stopped" if run.state == "running" else "pending"
    except RayError as e:  # a task killed while stopping, or lost more often than --retries allows
        run.state = "stopped" if stopping else "failed"
        run.log_tail = [*log_tail(run.folder / "train.log"), f"ray: {type(e).__name__}: {str(e).splitlines()[0]}"]
        run.seconds = time.time() - run.started if run.started else None
    else:
        run.state, run.returncode, run.log_tail = out["state"], out["returncode"], out["log_tail"]
        if run.state == "finished" and run.attempts:
            # this sweep's trainer finished the run, and its node was lost before the task reported: Ray
            # rescheduled the task, which found the final model (written only after a successful end)
            run.state, run.returncode = "done", 0
        run.started = run.started or out["started"]
        run.seconds, run.node, run.gpu = out["ended"] - run.started, out["node"], out["gpu"]
    if run.state == "pending":
        return
    took = f"  {run.seconds / 60:.1f} min" if run.seconds is not None else ""
    bar.write(f"{run.state:6} {run.name}  rc={run.returncode}{took}  steps={run_progress(run):,}")
    for line in run.log_tail[-3:]:
        bar.write(f"       | {line}")


def print_status(runs: list[Run]) -> None:
    """One line per run (finished, the env steps of its newest checkpoint, or not started), then the counts."""
    counts = dict.fromkeys(("finished", "interrupted", "not started"), 0)
    for r in runs:
        if (r.folder / "final_model.zip").exists():
            state = kind = "finished"
        elif r.folder.exists():
            state, kind = f"interrupted at {run_progress(r):,} steps (checkpoint)", "interrupted"
        else:
            state = kind = "not started"
        counts[kind] += 1
        print(f"{r.name:45} {state}")
    print(f"{len(runs)} runs: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))


def _parse_only(items: list[str]) -> dict[str, set[str]]:
    only: dict[str, set[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise SweepError(f"--only takes KEY=V1,V2 with KEY one of {', '.join(FILTER_KEYS)}; got {item!r}")
        only.setdefault(key, set()).update(v.strip() for v in values.split(","))
    return only


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlseq.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep YAML file, e.g. configs/experiments/caveflyer_scales.yml")
    p.add_argument("--address", default=None, metavar="auto|HOST:PORT",
                   help="join a running Ray cluster (ray start --head ...); default: start Ray on this machine only")
    p.add_argument("--cpus-per-run", type=float, default=1.0, help="Ray CPUs each run holds (default 1)")
    p.add_argument("--gpus-per-run", type=float, default=None,
                   help="Ray GPUs each run holds, fractional to share a GPU (default: 1 / runs-per-gpu when there are GPUs, else 0)")
    p.add_argument("--runs-per-gpu", type=int, default=None, help="runs sharing one GPU (default: the file's runs_per_gpu, else 1)")
    p.add_argument("--gpus", default=None,
                   help="this machine only: all, none, or indices like 0,1 (default: all when CUDA is available, else none)")
    p.add_argument("--parallel", type=int, default=None,
                   help="this machine only: runs at once, i.e. Ray gets parallel x cpus-per-run CPUs (default: every core)")
    p.add_argument("--threads-per-run", type=int, default=None, help="OMP_NUM_THREADS per run (default: cpus-per-run)")
    p.add_argument("--retries", type=int, default=1,
                   help="times a failed run restarts from its last checkpoint, and a run whose node died is rescheduled (default 1)")
    p.add_argument("--only", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"restrict the grid; KEY one of {', '.join(FILTER_KEYS)}; repeatable")
    p.add_argument("--logdir", default=None, help="override the file's logdir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the start/end lines stay)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    p.add_argument("--status", action="store_true", help="print each run's state and the counts, and exit")
    return p


def _resources(args: argparse.Namespace, spec: dict[str, Any]) -> Resources:
    per_gpu = args.runs_per_gpu if args.runs_per_gpu is not None else int(spec.get("runs_per_gpu", 1))
    if per_gpu < 1 or (args.parallel is not None and args.parallel < 1):
        raise SweepError("--runs-per-gpu and --parallel must be >= 1")
    # written so that NaN fails too (every comparison with it is False)
    if not (0 < args.cpus_per_run < math.inf) or not (args.gpus_per_run is None or 0 <= args.gpus_per_run < math.inf) \
            or args.retries < 0:
        raise SweepError("--cpus-per-run must be a finite number > 0, --gpus-per-run a finite number >= 0, and "
                         "--retries >= 0")
    if args.address is not None:
        if args.gpus not in (None, "none") or args.parallel is not None:
            raise SweepError("--gpus and --parallel apply to the Ray this sweep starts; on a cluster each node offers "
                             "what `ray start` gave it (use --gpus-per-run and --cpus-per-run)")
        _check_reachable(args.address)
        gpus = None
        gpus_per_run = 0.0 if args.gpus == "none" else args.gpus_per_run
    else:
        gpus_text = args.gpus
        if gpus_text is None:
            import torch

            gpus_text = "all" if torch.cuda.is_available() else "none"
        gpus = _parse_gpus(gpus_text)
        gpus_per_run = args.gpus_per_run
    return Resources(cpus_per_run=args.cpus_per_run, gpus_per_run=gpus_per_run, runs_per_gpu=per_gpu, gpus=gpus,
                     parallel=args.parallel, address=args.address, threads_per_run=args.threads_per_run,
                     retries=args.retries)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_sweep(args.sweep)
        runs = expand(spec, _parse_only(args.only), args.logdir)
        if args.dry_run:
            for r in runs:
                done = " (finished)" if (r.folder / "final_model.zip").exists() else ""
                print(f"python -m rlseq.train {' '.join(r.argv)} --resume{done}")
            return 0
        if args.status:
            print_status(runs)
            return 0
        res = _resources(args, spec)
        logdir = Path(args.logdir if args.logdir is not None else spec["logdir"])
        execute(runs, res, status_path=logdir / f"sweep-{spec['name']}.json", spec_name=spec["name"],
                progress=not args.no_progress)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if all(r.state in ("done", "finished") for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
