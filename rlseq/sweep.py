"""``python -m rlseq.sweep CONFIG.yaml``: expand a grid of training runs and run it on one machine.

    python -m rlseq.sweep configs/experiments/caveflyer_scales.yml --dry-run
    python -m rlseq.sweep configs/experiments/caveflyer_scales.yml --gpus all --runs-per-gpu 3
    python -m rlseq.sweep configs/experiments/caveflyer_scales.yml --only memory=efla,deltanet --only condition=reward1e3
    python -m rlseq.sweep configs/experiments/caveflyer_scales.yml --status

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
(its output goes to ``train.log`` in that folder). Runs are ordered seed by seed, so a grid cut short still
has every memory and condition at the seeds it reached. A run whose folder holds ``final_model.zip`` is
skipped; any other run is started with ``--resume``, so an interrupted run continues from its last
checkpoint. Every run's flags are checked by the training CLI before anything starts.

Parallelism: ``--runs-per-gpu`` processes on each GPU of ``--gpus`` (each pinned with
``CUDA_VISIBLE_DEVICES``), or ``--parallel`` processes on the CPU with ``--gpus none``. Each process gets
``OMP_NUM_THREADS`` = CPU cores / processes unless set. A run that exits non-zero (for example a memory
state that turned NaN, which the trainer reports with where it arose) is recorded as failed with the end
of its log and is not retried: a divergence is a result. SIGINT or SIGTERM to the sweep is passed on to the
running processes and starts no new one; the runs it stops are recorded as ``stopped`` and resume from their
last checkpoint the next time the sweep is started. A sweep killed outright (SIGKILL) cannot pass anything
on; on Linux its training processes then get SIGTERM from the kernel. Every training process locks its run
folder, so a second sweep (or a stray process) never writes into a run that is training: that run fails at
once with the holder's pid. ``<logdir>/sweep-<name>.json`` holds the state of every
run and is rewritten atomically whenever one starts or ends. The exit code is 0 when every run of the grid
(or of ``--only``) finished, 1 when one failed or was stopped, 2 for a bad sweep file or flag.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

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
    state: str = "pending"  # pending | finished | running | done | failed | stopped
    returncode: int | None = None
    gpu: str | None = None
    started: float | None = None
    seconds: float | None = None
    log_tail: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.env}/{self.memory}-{self.condition}/seed{self.seed}"


def _flag_argv(flags: dict[str, Any], known: set[str]) -> list[str]:
    """``{total_steps: 5e6, tf32: true, normalize_reward: false}`` -> ``--total-steps 5000000.0 --tf32 --no-normalize-reward``.

    ``false`` for an on/off flag without a ``--no-`` form (``tf32: false``) just leaves the flag out.
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
            for item in value:
                argv += [opt, str(item)]
        elif value is not None:
            argv += [opt, str(value)]
    return argv


def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and check a sweep file (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise SweepError(f"sweep file {path} does not exist")
    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    if not isinstance(spec, dict):
        raise SweepError(f"{path}: expected a mapping with keys {', '.join(sorted(SWEEP_KEYS))}")
    unknown = set(spec) - SWEEP_KEYS
    if unknown:
        raise SweepError(f"{path}: unknown keys {', '.join(sorted(unknown))}; valid keys: {', '.join(sorted(SWEEP_KEYS))}")
    for key in ("envs", "memories", "seeds"):
        if not isinstance(spec.get(key), list) or not spec[key]:
            raise SweepError(f"{path}: {key!r} must be a non-empty list")
    conditions = spec.get("conditions") or {"default": {}}
    if not isinstance(conditions, dict) or not all(isinstance(v, dict) or v is None for v in conditions.values()):
        raise SweepError(f"{path}: 'conditions' must map a name to a mapping of train flags")
    spec["conditions"] = {str(k): dict(v or {}) for k, v in conditions.items()}
    spec["flags"] = spec.get("flags") or {}
    if not isinstance(spec["flags"], dict):
        raise SweepError(f"{path}: 'flags' must be a mapping of train flags")
    if "runs_per_gpu" in spec and (not isinstance(spec["runs_per_gpu"], int) or spec["runs_per_gpu"] < 1):
        raise SweepError(f"{path}: 'runs_per_gpu' must be an integer >= 1")
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
    parser = build_parser()
    known = set(parser._option_string_actions)
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
        run = Run(cfg["env"], str(memory), int(seed), cond, argv, run_dir(logdir, cfg))
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


def _slots(gpus: list[str] | None, runs_per_gpu: int, parallel: int) -> list[str | None]:
    if gpus is None:
        return [None] * parallel
    return [g for g in gpus for _ in range(runs_per_gpu)]


def _parse_gpus(text: str) -> list[str] | None:
    if text == "none":
        return None
    if text == "all":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise SweepError("--gpus all: no CUDA device is visible; use --gpus none --parallel N for the CPU")
        # the child's CUDA_VISIBLE_DEVICES replaces ours: pin it to what we see (ours may be "2,3" or UUIDs)
        visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        return visible[:n] if len(visible) >= n else [str(i) for i in range(n)]
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus):
        raise SweepError(f"--gpus takes all, none or comma-separated GPU indices like 0,1; got {text!r}")
    return gpus


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


def _stop_with_parent(sweep_pid: int) -> None:
    """In a training process, before exec (Linux): get SIGTERM when the sweep dies, even by SIGKILL, so no
    orphan keeps training into a folder that the next sweep resumes (its run-folder lock would refuse it)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != sweep_pid:  # the sweep died between the fork and prctl: no signal will come
        os._exit(1)


def execute(runs: list[Run], slots: list[str | None], *, status_path: Path, spec_name: str,
            threads_per_run: int | None = None, poll_s: float = 0.5) -> int:
    """Run the pending runs on ``slots`` (one process each); returns the number of failed runs.

    A SIGINT/SIGTERM is passed on to the running processes; they are recorded as ``stopped``, not failed.
    """
    for r in runs:
        if (r.folder / "final_model.zip").exists():
            r.state = "finished"
    queue = [r for r in runs if r.state == "pending"]
    free = list(slots)
    active: dict[subprocess.Popen, tuple[Run, str | None]] = {}
    threads = threads_per_run or max(1, (os.cpu_count() or 1) // max(1, len(slots)))
    stopping: int | None = None  # the signal that stops the sweep
    signalled: set[subprocess.Popen] = set()  # processes it was passed on to: stopped, not failed

    def forward(new_only: bool = False) -> None:
        for proc in list(active):
            if not (new_only and proc in signalled):
                signalled.add(proc)
                proc.send_signal(stopping)  # a no-op for a process that has exited

    def stop(signum, _frame):
        nonlocal stopping
        stopping = signum
        forward()

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"sweep {spec_name}: {len(runs)} runs, {len(runs) - len(queue)} finished already, {len(queue)} to run "
          f"on {len(slots)} slots", flush=True)
    _write_status(status_path, spec_name, runs)
    try:
        while (queue and not stopping) or active:
            while queue and free and not stopping:
                run, slot = queue.pop(0), free.pop(0)
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                if threads_per_run:  # an explicit --threads-per-run wins over the environment
                    env["OMP_NUM_THREADS"] = str(threads_per_run)
                else:
                    env.setdefault("OMP_NUM_THREADS", str(threads))
                argv = [sys.executable, "-m", "rlseq.train", *run.argv, "--resume", "--no-progress-bar"]
                if slot is None:
                    env["CUDA_VISIBLE_DEVICES"] = ""
                    argv += ["--device", "cpu"]
                else:
                    env["CUDA_VISIBLE_DEVICES"] = slot
                run.folder.mkdir(parents=True, exist_ok=True)
                with open(run.folder / "train.log", "a") as log:
                    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n")
                    log.flush()
                    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            preexec_fn=functools.partial(_stop_with_parent, os.getpid())
                                            if sys.platform == "linux" else None)
                run.state, run.gpu, run.started = "running", slot, time.time()
                active[proc] = (run, slot)
                if stopping:  # the signal came between Popen and here
                    forward(new_only=True)
                print(f"start  {run.name}  gpu={slot if slot is not None else 'cpu'}  "
                      f"from step {run_progress(run):,}", flush=True)
                _write_status(status_path, spec_name, runs)
            for proc in [p for p in active if p.poll() is not None]:
                run, slot = active.pop(proc)
                run.returncode, run.seconds = proc.returncode, time.time() - run.started
                run.state = "done" if proc.returncode == 0 else "stopped" if proc in signalled else "failed"
                run.log_tail = log_tail(run.folder / "train.log") if run.state == "failed" else []
                free.append(slot)
                print(f"{run.state:6} {run.name}  rc={proc.returncode}  {run.seconds / 60:.1f} min  "
                      f"steps={run_progress(run):,}", flush=True)
                for line in run.log_tail[-3:]:
                    print(f"       | {line}", flush=True)
                _write_status(status_path, spec_name, runs)
            time.sleep(poll_s)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _write_status(status_path, spec_name, runs)
    failed = [r for r in runs if r.state == "failed"]
    left = [r for r in runs if r.state in ("pending", "running", "stopped")]
    print(f"sweep {spec_name}: {sum(r.state in ('done', 'finished') for r in runs)} finished, {len(failed)} failed"
          + (f", {len(left)} not run (stopped)" if left else ""), flush=True)
    return len(failed)


def print_status(runs: list[Run]) -> None:
    """One line per run: finished, or the env steps of its newest checkpoint."""
    for r in runs:
        if (r.folder / "final_model.zip").exists():
            state = "finished"
        elif r.folder.exists():
            state = f"interrupted at {run_progress(r):,} steps (checkpoint)"
        else:
            state = "not started"
        print(f"{r.name:45} {state}")


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
    p.add_argument("--gpus", default=None,
                   help="all, none, or indices like 0,1 (default: all when CUDA is available, else none)")
    p.add_argument("--runs-per-gpu", type=int, default=None, help="processes per GPU (default: the file's runs_per_gpu, else 1)")
    p.add_argument("--parallel", type=int, default=1, help="processes with --gpus none (default 1)")
    p.add_argument("--threads-per-run", type=int, default=None, help="OMP_NUM_THREADS per run (default: cores / processes)")
    p.add_argument("--only", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"restrict the grid; KEY one of {', '.join(FILTER_KEYS)}; repeatable")
    p.add_argument("--logdir", default=None, help="override the file's logdir")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    p.add_argument("--status", action="store_true", help="print each run's state and exit")
    return p


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
        gpus_text = args.gpus
        if gpus_text is None:
            import torch

            gpus_text = "all" if torch.cuda.is_available() else "none"
        per_gpu = args.runs_per_gpu or int(spec.get("runs_per_gpu", 1))
        if per_gpu < 1 or args.parallel < 1:
            raise SweepError("--runs-per-gpu and --parallel must be >= 1")
        slots = _slots(_parse_gpus(gpus_text), per_gpu, args.parallel)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logdir = Path(args.logdir if args.logdir is not None else spec["logdir"])
    execute(runs, slots, status_path=logdir / f"sweep-{spec['name']}.json", spec_name=spec["name"],
            threads_per_run=args.threads_per_run)
    return 0 if all(r.state in ("done", "finished") for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
