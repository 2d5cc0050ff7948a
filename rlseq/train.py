"""``python -m rlseq.train``: train a memory agent on a procgen game or any gymnasium env and log it for TensorBoard.

    python -m rlseq.train --env caveflyer --memory efla
    python -m rlseq.train --env popgym-RepeatPreviousEasy-v0 --memory efla     # any registered gymnasium id
    python -m rlseq.train --env MyEnv-v0 --env-package my_envs                 # ids that a module registers
    python -m rlseq.train --env caveflyer --memory deltanet --seed 1 --total-steps 5_000_000
    python -m rlseq.train --env caveflyer --memory lstm --algo sb3-recurrent-ppo
    python -m rlseq.train --env caveflyer --memory efla --fast    # GPU: bf16 CNN, fused Adam, channels-last, TF32
    python -m rlseq.train --env caveflyer --memory efla --fast --no-channels-last   # a flag given wins over --fast
    python -m rlseq.train --env caveflyer --memory efla --fused-adam --no-cuda-graph-train   # eager training

``--env`` is a procgen game (``caveflyer``, ``procgen:caveflyer``) or a registered gymnasium id, looked up after
importing the ``--env-package`` modules (``popgym-...`` ids import popgym by themselves); see
:func:`rlseq.envs.resolve_env_id`. Hyperparameters come from the env family's RL Zoo-style file, keyed by env
(a default entry for the rest): ``configs/procgen.yml`` (default ``procgen``), ``configs/popgym.yml``
(``popgym``) or ``configs/gym.yml`` (``gym``, every other gymnasium id); ``--config FILE``, a file of the same
form, overrides it key by key (an entry of two keys changes those two), and flags override both.

Runs land in ``<logdir>/<env>/<variant>/seed<N>/`` (``env`` the id with ``/`` as ``_``, e.g. ``ALE_Pong-v5``;
``variant`` = memory, ``sb3-`` prefixed for the sb3-contrib algorithm, ``-<tag>`` appended), so
``tensorboard --logdir runs/caveflyer`` shows the memories side by side under identical tags. Each run folder
holds ``config.yaml`` (the resolved hyperparameters), TensorBoard event files, ``checkpoints/`` and, when
finished, ``final_model.zip``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

# the names other modules import from rlseq.train stay importable from it
from rlseq.build import _algo_class, _family, build_model, make_env, observation_kind, ppo_kwargs  # noqa: F401
from rlseq.config import (  # noqa: F401
    ALGOS,
    AMP_CHOICES,
    DEFAULT_CONFIG,
    UsageError,
    _check_cuda_graph_train,
    asked,
    config_file_value,
    memories,
    resolve,
)
from rlseq.resume import (  # noqa: F401
    _load_checkpoint, _resume_point, keep_run_budget, refuse_changed_settings, resumed_env_seed)
from rlseq.threads import add_torch_threads_argument, set_torch_threads


class _MemoryNames:
    """Formats as the names of :func:`memories`, so that the import happens only when ``--help`` prints."""

    def __str__(self) -> str:
        return ", ".join(memories())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlseq.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="caveflyer",
                   help="procgen game (caveflyer, procgen:caveflyer) or registered gymnasium id "
                        "(popgym-RepeatPreviousEasy-v0, CartPole-v1, PACKAGE:ID)")
    p.add_argument("--env-package", action="append", default=None, metavar="PACKAGE",
                   help="import PACKAGE before looking --env up, for the ids it registers (repeatable; popgym-... "
                        "ids import popgym by themselves)")
    memory = p.add_argument("--memory", default="efla", help="one of %(memories)s")
    memory.memories = _MemoryNames()  # what %(memories)s prints: looked up only when --help formats it
    p.add_argument("--algo", default="rlseq", help=f"one of {', '.join(ALGOS)} (rlseq: whole-rollout training, the fast path)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-steps", type=float, default=None, help="env steps to train for (config: n_timesteps)")
    p.add_argument("--n-envs", type=int, default=None)
    p.add_argument("--n-steps", type=int, default=None, help="steps per env per rollout")
    p.add_argument("--n-minibatches", type=int, default=None)
    p.add_argument("--n-epochs", type=int, default=None)
    p.add_argument("--learning-rate", default=None,
                   help="PPO's learning rate (learning_rate), for every memory: it replaces the config's "
                        "memory_learning_rate too; lin_<rate> anneals it linearly from <rate> to 0 over the run")
    p.add_argument("--distribution-mode", default=None,
                   help="procgen only: easy, hard, memory, ... (valid modes depend on the game)")
    p.add_argument("--num-levels", type=int, default=None, help="procgen only")
    p.add_argument("--start-level", type=int, default=None, help="procgen only")
    p.add_argument("--num-threads", type=int, default=None, help="procgen only: worker threads")
    add_torch_threads_argument(p)
    p.add_argument("--reward-scale", type=float, default=None, help="multiply rewards (ScaleReward)")
    p.add_argument("--value-shift", "--value-scale", dest="value_shift", type=float, default=None,
                   help="shift value targets by this much without changing the task (PotentialValueShift)")
    p.add_argument("--prev-action-reward", action=argparse.BooleanOptionalAction, default=None,
                   help="feed the previous action and raw reward to the policy (PrevActionReward)")
    p.add_argument("--normalize-reward", action=argparse.BooleanOptionalAction, default=None,
                   help="VecNormalize the PPO reward")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--fast", action="store_true",
                   help="the fast GPU setting: shorthand for --amp bf16 --fused-adam --channels-last --tf32 "
                        "--compile-extractor, and with fused Adam the training CUDA graph comes on by itself "
                        "(--cuda-graph-train's auto). It changes rounding (bf16 CNN, TF32, fused Adam, the compiled "
                        "CNN); each of those flags given explicitly wins (--fast --amp none). On --resume it must "
                        "agree with the checkpoint's amp, fused Adam and channels-last, as those flags must. On the "
                        "CPU the bf16 CNN, channels-last and fused Adam apply too (TF32, the CUDA graphs and the "
                        "compiled CNN are GPU-only here): faster on a CPU with native bf16, possibly slower without")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="allow TF32 convolutions and matmuls on the GPU (faster; acting and training then differ by "
                        "~1e-3, so PPO's first ratio is no longer exactly 1; config: tf32; default off)")
    p.add_argument("--amp", default=None, choices=AMP_CHOICES,
                   help="bf16: run the CNN in bf16 autocast while acting and training (memory, heads, losses and "
                        "optimizer stay fp32); none: all fp32 (config: amp; default none)")
    p.add_argument("--fused-adam", action=argparse.BooleanOptionalAction, default=None,
                   help="fused Adam (one kernel for all parameters; config: fused_adam; default off)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the acting step from a CUDA graph (same computation and random draws, ~100x fewer "
                        "launches; config: cuda_graph; default on, ignored on the CPU)")
    p.add_argument("--cuda-graph-train", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each PPO minibatch update (forward, loss, backward, clipping, Adam step) from a CUDA "
                        "graph: same computation, one launch per minibatch instead of hundreds; needs --fused-adam "
                        "(config: cuda_graph_train; default auto: on wherever it can be used, i.e. on a GPU with fused Adam, "
                        "eager otherwise; --memory gru and lstm then scan over time in Triton instead of one cuDNN "
                        "call; --no-cuda-graph-train: always eager)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory layout for the CNN (cuDNN's tensor-core layout, mostly with --amp bf16; "
                        "config: channels_last; default off)")
    p.add_argument("--compile-extractor", action=argparse.BooleanOptionalAction, default=None,
                   help="run the features extractor through torch.compile, acting and training (procgen training "
                        "4-20%% faster on an H100 at the fast settings; the first step and update "
                        "compile for tens of seconds; other rounding; config: compile_extractor; default off, "
                        "--fast turns it on on a GPU; given on a CPU it compiles there too, with no gain measured)")
    p.add_argument("--conv-size", type=int, default=None, metavar="W",
                   help="width of the block's short convolution, every memory's front end (memory_kwargs conv_size; "
                        "default 4; 1: no window, the control that shows what the window alone explains)")
    p.add_argument("--shared-lstm", action="store_true",
                   help="--algo sb3-recurrent-ppo --memory lstm only: one LSTM for actor and critic (sb3-contrib's "
                        "shared_lstm=True, enable_critic_lstm=False) instead of its default separate critic LSTM")
    p.add_argument("--logdir", default="runs")
    p.add_argument("--tag", default=None, help="suffix of the run's variant folder, e.g. reward1e3")
    p.add_argument("--config", default=None,
                   help="RL Zoo-style YAML file keyed by env id, or with a default entry named procgen, popgym or "
                        "gym: the keys of its entry override those of the repo's configs/procgen.yml, "
                        "configs/popgym.yml or configs/gym.yml (by --env); the other keys keep their defaults")
    p.add_argument("--checkpoint-every", type=float, default=None, help="env steps between atomic checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="continue the run folder from its newest intact checkpoint (other hyperparameters are refused; "
                        "--total-steps and --checkpoint-every may change; without them the run keeps its own). SIGINT "
                        "and SIGTERM save a checkpoint at the next rollout start and print this command")
    p.add_argument("--no-progress-bar", action="store_true",
                   help="no progress lines (the speed after 10 s, the estimate after the second rollout and the "
                        "closing summary are printed still; otherwise a line with the speed, the time left and the "
                        "recent mean return every second on a terminal, every 30 s in a log file)")
    p.add_argument("--verbose", type=int, default=0, help="SB3's verbosity (0: none, 1: its log tables, 2: debug)")
    return p


def env_folder(env: str) -> str:
    """The env id as one folder name: ``ALE/Pong-v5`` -> ``ALE_Pong-v5``."""
    return env.replace("/", "_").replace("\\", "_")


def run_dir(logdir: str | Path, cfg: dict[str, Any]) -> Path:
    variant = cfg["memory"] if cfg["algo"] == "rlseq" else f"sb3-{cfg['memory']}"
    if cfg.get("tag"):
        variant += f"-{cfg['tag']}"
    return Path(logdir) / env_folder(cfg["env"]) / variant / f"seed{cfg['seed']}"


# the exit status when another process holds the run folder: sysexits' EX_TEMPFAIL, "try again later" (a sweep
# records such a run as running elsewhere instead of failed)
BUSY_EXIT = 75
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """SIGINT or SIGTERM outside ``model.learn`` (which checkpoints and stops by itself): raised by the signal
    handler where the process is, like KeyboardInterrupt, so that nothing half-built is kept."""

    def __init__(self, signum: int, where: str = "before training started"):
        super().__init__(signum)
        self.signum, self.where = signum, where


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def _finishing_despite_signals():
    """While the block runs, SIGINT and SIGTERM are held back (their numbers are appended to the list it yields)
    so that the final save completes; a second signal aborts it with :class:`Stopped`."""
    pending: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if pending:
            raise Stopped(signum, where="during the final save (a second signal), which did not complete")
        pending.append(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield pending
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def train(args: argparse.Namespace) -> Path:
    """Resolve, build and train; returns the run folder. The run folder is locked while it trains (another
    process holding it raises :class:`rlseq.checkpoint.RunFolderBusy`)."""
    import torch

    from rlseq.checkpoint import run_folder_lock

    cfg = resolve(args)
    cfg["verbose"] = args.verbose
    cfg["torch_threads"] = set_torch_threads(getattr(args, "torch_threads", None))
    # exact by default: with TF32, acting (batch n_envs) and training (batch B*T) pick different conv kernels
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = cfg["tf32"]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cfg["cuda_graph"] = cfg["cuda_graph"] and torch.device(device).type == "cuda"  # recorded as it runs
    if torch.device(device).type != "cuda" and asked(args, "compile_extractor")[1] == "--fast" \
            and not config_file_value(args, cfg, "compile_extractor"):
        cfg["compile_extractor"] = False  # --fast's compiled CNN: measured faster on a GPU only (recorded as it runs)
    if torch.device(device).type != "cuda" and cfg["cuda_graph_train"] is True:
        cfg["cuda_graph_train"] = False  # a config's true on the CPU: nothing to capture (auto stays auto for a GPU)
    folder = args.run_folder = run_dir(args.logdir, cfg)
    blocked = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise UsageError(f"--logdir {args.logdir}: {blocked} is a file, so the run folder {folder} cannot be made; "
                         "give a folder (or a path that does not exist yet)")
    if args.resume and not folder.is_dir():
        raise UsageError(f"--resume: there is no run folder {folder} (it follows from --logdir, --env, --memory, "
                         "--algo, --tag and --seed); check those, or drop --resume to start the run")
    with run_folder_lock(folder):
        return _train_locked(args, cfg, folder, device)


def _train_locked(args: argparse.Namespace, cfg: dict[str, Any], folder: Path, device: str) -> Path:
    """:func:`train` once it holds the run folder's lock."""
    from stable_baselines3.common.callbacks import CallbackList

    from rlseq.callbacks import Progress, closing_summary, tensorboard_logger
    from rlseq.checkpoint import (LOCK_NAME, CheckpointCallback, restore_pending_records, stop_on_signals,
                                  write_text_atomic)
    from rlseq.envs import ScaledReturnLogger

    ckpt_root = folder / "checkpoints"
    if args.resume:
        keep_run_budget(args, cfg, folder)
    # checked under the lock: no other process can be finishing it
    extending = (folder / "final_model.zip").exists()
    if extending and not _extend_finished_run(args, cfg, folder):
        return folder
    if any(p.name != LOCK_NAME for p in folder.iterdir()) and not args.resume:
        raise UsageError(f"run folder {folder} exists; pass --resume to continue it, or another --seed/--tag/--logdir")
    latest = _resume_point(folder) if args.resume else None
    if latest is None:
        _check_cuda_graph_train(args, cfg)  # on --resume resolve() left it to the checkpoint, and there is none
        env, model = _build_fresh(cfg, device)
    else:
        refuse_changed_settings(cfg, folder, latest)
        model, env = _load_checkpoint(latest, cfg, args, device)
        print(f"resuming {folder} from {latest.name} ({model.num_timesteps:,} env steps done)", flush=True)
    if extending:  # once the checkpoint has loaded with these settings: until the run ends again it is unfinished
        (folder / "final_model.zip").unlink()
    if cfg["algo"] == "rlseq":  # what runs, not "auto" (a True that cannot be used warns and trains eagerly)
        cfg["cuda_graph_train"] = model.trains_from_graph()
    # written once the model is known, so that a resumed run records the precision it really trains with
    settings = {**cfg, "device": device}
    write_text_atomic(folder / "config.yaml", yaml.safe_dump(settings, sort_keys=True))
    # a resumed run's curves go on from its checkpoint: TensorBoard drops what the killed process logged after it
    # (all of it when the killed process left no checkpoint)
    purge_step = model.num_timesteps + 1 if latest is not None else (0 if args.resume else None)
    model.set_logger(tensorboard_logger(folder, stdout=bool(args.verbose), purge_step=purge_step))
    if latest is not None:  # the last update's train/* records: the killed process had not written them yet
        restore_pending_records(model.logger, latest)
    checkpoints = CheckpointCallback(ckpt_root, cfg["checkpoint_every"], settings=settings)
    callbacks = [ScaledReturnLogger(), checkpoints]
    smaller = (f"python -m rlseq.train --env popgym-RepeatPreviousEasy-v0 --memory {cfg['memory']} (about a "
               "minute), or this command with --total-steps 2048 --n-envs 8 --n-steps 64 --tag smoke")
    callbacks.append(Progress(cfg["n_timesteps"], on_cpu=device == "cpu", smaller=smaller,
                              lines=not args.no_progress_bar))
    remaining = cfg["n_timesteps"] - model.num_timesteps
    if remaining > 0:
        with stop_on_signals(checkpoints):
            model.learn(remaining, callback=CallbackList(callbacks), reset_num_timesteps=latest is None)
    with _finishing_despite_signals() as pending:
        if checkpoints.stopped_by is not None:
            env.close()
            _stop_with_resume_hint(args, checkpoints)
        _final_save(model, folder, settings)
        env.close()
        if not pending:
            print(closing_summary(model, folder, Path(args.logdir), env_folder(cfg["env"])), flush=True)
    if pending:
        print(f"stopped by {signal.Signals(pending[0]).name} during the final save, which completed: "
              f"{model.num_timesteps:,} env steps in {folder / 'final_model.zip'}", file=sys.stderr, flush=True)
        raise SystemExit(128 + pending[0])
    return folder


def _build_fresh(cfg: dict[str, Any], device: str):
    """``(env, model)`` of a run that starts at step 0. A value inside ``env_kwargs`` or ``policy_kwargs`` that the
    env or the policy rejects (the config checks only their keys) is one error line naming the mapping."""
    try:
        env = make_env(cfg, seed=cfg["seed"])
    except (TypeError, ValueError) as e:
        if not cfg.get("env_kwargs"):
            raise
        raise UsageError(f"{cfg['env']} could not be made with env_kwargs {cfg['env_kwargs']!r}: "
                         f"{e.__class__.__name__}: {e}") from e
    try:
        return env, build_model(cfg, env, device)
    except (TypeError, ValueError) as e:
        env.close()
        given = {k: cfg[k] for k in ("policy_kwargs", "memory_kwargs") if cfg.get(k)}
        if not given:
            raise
        raise UsageError(f"the model could not be built with {', '.join(f'{k} {v!r}' for k, v in given.items())}: "
                         f"{e.__class__.__name__}: {e}") from e


def _extend_finished_run(args: argparse.Namespace, cfg: dict[str, Any], folder: Path) -> bool:
    """Whether a finished run goes on: ``--resume`` with a larger ``--total-steps`` continues from the checkpoint
    that the final save wrote with ``final_model.zip`` (the caller removes that file once the checkpoint has
    loaded, and the longer run writes it again). Otherwise says the run is finished."""
    from rlseq.checkpoint import resumable_checkpoint

    final = folder / "final_model.zip"
    steps = _saved_num_timesteps(final)
    if not args.resume or cfg["n_timesteps"] <= steps:
        larger = "" if cfg["n_timesteps"] > steps else " with a larger --total-steps"
        more = f"; to train it further, add --resume{larger}" if not args.resume else f"; --resume{larger} extends it"
        print(f"{folder} is finished already ({steps:,} env steps in final_model.zip); nothing to do{more}", flush=True)
        return False
    latest = resumable_checkpoint(folder / "checkpoints")[0]
    if latest is None or int(latest.name[len("step"):]) != steps:
        raise UsageError(f"{folder} is finished, but no intact checkpoint holds its last step ({steps:,} env steps), "
                         "so its optimizer and random state are gone: start a new run with another --tag to train "
                         "longer")
    print(f"extending the finished run {folder} from {steps:,} to {cfg['n_timesteps']:,} env steps from "
          f"{latest.name} (final_model.zip is written again when it ends)", flush=True)
    return True


def _saved_num_timesteps(path: Path) -> int:
    """The env steps of an SB3 model zip, read from its ``data`` entry without building the model."""
    import json
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return int(json.loads(z.read("data"))["num_timesteps"])
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise UsageError(f"{path} is not a readable SB3 model ({e}); move it away to resume the run from its "
                         "newest checkpoint") from None


def _final_save(model, folder: Path, settings: dict[str, Any]) -> None:
    """The last checkpoint and ``final_model.zip``, each written atomically; a :class:`Stopped` that aborts them
    names the checkpoint that a resume continues from (the previous one, or this save's if it completed)."""
    from rlseq.checkpoint import resumable_checkpoint, save_checkpoint

    tmp = folder / ".final_model.tmp.zip"
    try:
        save_checkpoint(model, folder / "checkpoints", settings=settings)
        model.save(tmp)
        tmp.replace(folder / "final_model.zip")
    except OSError:  # a full disk: the checkpoint just saved (or the previous one) is what a resume continues from
        tmp.unlink(missing_ok=True)
        raise
    except Stopped as e:
        kept = resumable_checkpoint(folder / "checkpoints")[0]
        e.where += f"; newest intact checkpoint: {kept.name if kept is not None else 'none'}"
        raise


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run: the one given, with ``--resume``."""
    argv = list(getattr(args, "command_line", None) or [])
    return shlex.join(["python", "-m", "rlseq.train", *argv, *([] if "--resume" in argv else ["--resume"])])


def _stop_with_resume_hint(args: argparse.Namespace, checkpoints) -> None:
    """After SIGINT or SIGTERM: one line with the checkpoint and the command to resume; exit 128 + signal."""
    name = signal.Signals(checkpoints.stopped_by).name
    print(f"stopped by {name}: checkpoint step{checkpoints.stop_step} saved; resume with: {resume_command(args)}",
          file=sys.stderr, flush=True)
    raise SystemExit(128 + checkpoints.stopped_by)


# errors of writing the run folder that the user can fix (space, permissions, a file where a folder goes): one line
# instead of a traceback
WRITE_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "ENOTDIR",
                                                            "EEXIST", "EISDIR", "EFBIG") if hasattr(errno, name))


def write_failure(args: argparse.Namespace, e: OSError) -> str:
    """One line for a write into the run folder that failed: the path and the error, and what is left to continue
    from: the newest intact checkpoint and the command that resumes it, or the command that starts the run."""
    from rlseq.checkpoint import resumable_checkpoint

    what = f"cannot write {e.filename}" if e.filename else "a write failed"
    reason = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
    folder = getattr(args, "run_folder", None)
    if folder is None or not folder.is_dir():
        again = shlex.join(["python", "-m", "rlseq.train", *getattr(args, "command_line", [])])
        return f"{what}: {reason}; no run folder was made; fix it, then run: {again}"
    kept = resumable_checkpoint(folder / "checkpoints")[0] if (folder / "checkpoints").is_dir() else None
    left = f"the newest intact checkpoint is {kept}" if kept is not None else f"{folder} holds no checkpoint yet"
    return f"{what}: {reason}; {left}; free space or fix permissions, then continue with: {resume_command(args)}"


def main(argv: list[str] | None = None) -> None:
    """The CLI. Exit status: 0 trained or finished already, 1 a write into the run folder failed (full disk, no
    permission: one line says what is left to resume), 2 a usage error, 75 (:data:`BUSY_EXIT`) the run folder
    is in use by another process, 128 + the signal number after SIGINT or SIGTERM (one line says what remains)."""
    from rlseq.checkpoint import RunFolderBusy

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = argv
    previous = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS}
    try:
        train(args)
    except UsageError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    except RunFolderBusy as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(BUSY_EXIT) from None
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        print(f"error: {write_failure(args, e)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Stopped as e:  # before learn (no checkpoint is written then), or a second signal in the final save
        folder = getattr(args, "run_folder", None)
        again = resume_command(args) if folder is not None and folder.is_dir() else \
            shlex.join(["python", "-m", "rlseq.train", *argv])
        print(f"stopped by {signal.Signals(e.signum).name} {e.where}; continue with: {again}",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + e.signum) from None
    except KeyboardInterrupt as e:  # a second signal while training: the newest checkpoint is what remains
        signum = e.args[0] if e.args and isinstance(e.args[0], int) else int(signal.SIGINT)
        print(f"stopped by {signal.Signals(signum).name} (a second signal, before the checkpoint); continue from the "
              f"newest checkpoint with: {resume_command(args)}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)



if __name__ == "__main__":
    main()
