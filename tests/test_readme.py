"""Every command and Python snippet of the README runs as written, in the order written, with tiny budgets.

The commands run one after the other in one scratch folder (so a command may use what an earlier one wrote, as it
does for a reader), each with flags appended that shrink its budget: argparse keeps the last value of a flag, so
the README's own values are overridden, not edited. A command that cannot run here is skipped with the reason
(the install steps CI has already done, the test run itself, a server). A command the rules below do not know
fails the test: a new README command needs a rule.

Each command runs in its own process, forked from one that has imported only the third-party libraries every
command imports first (torch, SB3, gymnasium): a fresh interpreter spends ~5 s of CPU on them, twenty times over.
rlseq, POPGym and procgen are imported by each command itself, as in a reader's shell.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# enough steps for a POPGym episode to end (rlseq.compare reads the episode returns)
TINY_TRAIN = ["--total-steps", "512", "--n-envs", "2", "--n-steps", "64", "--n-minibatches", "1",
              "--checkpoint-every", "256"]
# procgen's IMPALA CNN (in bf16 autocast under --fast) is slow on a CPU: two rollouts of 2 envs x 8 steps, one epoch
TINY_PROCGEN_TRAIN = ["--total-steps", "32", "--n-envs", "2", "--n-steps", "8", "--n-minibatches", "1", "--n-epochs", "1",
                      "--checkpoint-every", "16"]
TINY_BENCH_MEMORY = ["--steps", "64", "--n-envs", "2", "--n-steps", "16", "--n-minibatches", "1", "--episodes", "2",
                     "--jobs", "2"]
# (pattern on the command, what to do): a reason string skips it, a list is appended to it
RULES: list[tuple[str, str | list[str]]] = [
    (r"^(python3? -m )?pip install", "an install step: CI's own install did it"),
    (r"-m pytest", "the test run itself"),
    (r"^tensorboard ", "a server"),
    (r"^ray start ", "a node of a Ray cluster (tests/test_ray_cluster.py starts a real one)"),
    (r"-m rlseq\.train --env caveflyer ", TINY_PROCGEN_TRAIN),
    (r"-m rlseq\.train ", TINY_TRAIN),
    (r"-m rlseq\.bench memory --report-only", []),
    (r"-m rlseq\.bench memory --quick", TINY_BENCH_MEMORY),
    (r"-m rlseq\.bench memory", TINY_BENCH_MEMORY + ["--tasks", "popgym-RepeatPreviousEasy-v0", "--variants", "none",
                                                     "sb3-lstm", "--seeds", "0", "--out", "runs/tiny_grid"]),
    (r"-m rlseq\.bench recall", ["--steps", "3", "--length", "20", "--d-model", "16", "--eval-sequences", "4",
                                 "--jobs", "2"]),
    (r"-m rlseq\.bench kernels", ["--shapes", "1,20,1,8", "--repeats", "1"]),
    (r"-m rlseq\.bench envs", ["--n-envs", "2", "--steps", "4", "--warmup", "1", "--repeats", "1"]),
    (r"-m rlseq\.bench train", ["--n-envs", "2", "--n-steps", "8", "--n-minibatches", "1", "--n-epochs", "1",
                                "--warmup", "1", "--rollouts", "1"]),
    (r"-m rlseq\.compare ", []),
    (r"-m rlseq\.evaluate ", ["--episodes", "2"]),
    (r"-m rlseq\.sweep .*--dry-run", []),
    (r"-m rlseq\.sweep .*--status", []),
    (r"-m rlseq\.sweep ", "a grid of GPU runs (its --dry-run and --status lines run)"),
]
# (pattern on the command, code, file, text): a budget no flag sets, as code that runs in the command's own process
# just before the command (after the fork: nowhere else), and the text the command then writes into the file (in the
# scratch folder), which shows that the budget took. The published report's bootstrap CIs take 2000 resamples each,
# a minute of rliable here; 100 run the same code (tests/test_bench_memory.py checks the report's numbers)
PRELUDES: list[tuple[str, str, str, str]] = [
    (r"-m rlseq\.bench memory --report-only --out docs/memory_benchmark",
     "import rlseq.bench.memory_report as R; R.write_report.__kwdefaults__['reps'] = 100",
     "docs/memory_benchmark.md", "(rliable, 100 resamples"),
]


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """The README's fenced blocks in order, as (language, body)."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.M | re.S)]


def bash_commands(body: str) -> list[str]:
    """The commands of a bash block: one per line, trailing comments removed, ``&&`` chains split."""
    out = []
    for line in body.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out += [part.strip() for part in line.split("&&")]
    return out


def plan(command: str) -> tuple[str | None, list[str]]:
    """(reason to skip or None, argv) of one README command."""
    for pattern, action in RULES:
        if re.search(pattern, command):
            if isinstance(action, str):
                return action, []
            argv = shlex.split(command)
            if argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            return None, argv + action
    raise AssertionError(f"no rule for the README command {command!r}: add one to tests/test_readme.py")


def steps() -> list[tuple[str, str]]:
    """("bash" | "python", command or snippet) in README order."""
    out: list[tuple[str, str]] = []
    for lang, body in readme_blocks(README.read_text()):
        if lang == "bash":
            out += [("bash", c) for c in bash_commands(body)]
        elif lang == "python":
            out.append(("python", body))
    return out


# (pattern, replacement) of a snippet's budget: one rollout of 4 steps per env (its env count as written), and a
# minibatch no larger than that rollout (8 envs x 4 steps)
SNIPPET_BUDGET = [(r"\.learn\([\d_]+\)", ".learn(1)"), (r"\bn_steps=\d+", "n_steps=4"), (r"\bbatch_size=\d+", "batch_size=32")]


def shrink_snippet(code: str) -> str:
    """A README snippet with its training budget cut to one short rollout."""
    for pattern, tiny in SNIPPET_BUDGET:
        code = re.sub(pattern, tiny, code)
    return code


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """One scratch folder for the whole README, holding what its commands read from the repo."""
    d = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "configs", d / "configs")
    shutil.copytree(ROOT / "docs" / "memory_benchmark", d / "docs" / "memory_benchmark")
    return d


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    return env


PRELOAD = ("torch", "torch._dynamo", "stable_baselines3", "sb3_contrib", "gymnasium")  # torch.optim imports _dynamo
# One JSON job a line on stdin ({"module", "args"} for `python -m`, {"code"} for `python -c`, and "stdout",
# "stderr" file paths); answers its exit status a line. The child does what the interpreter does for -m / -c and
# at exit (non-daemon threads joined, atexit run, streams flushed). Fork is safe only without other threads.
RUNNER = r"""
import atexit, importlib, json, os, runpy, sys, threading, types
for name in sys.argv[1:]:
    importlib.import_module(name)
assert os.listdir("/proc/self/task") == [str(os.getpid())], "the runner has threads: forking it is unsafe"
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, job["stdout"]), (2, job["stderr"]), (0, os.devnull)):
            new = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(new, fd)
            os.close(new)
        code = 0
        try:
            if "module" in job:
                sys.argv, sys.path[0] = ["-m", *job["args"]], os.getcwd()
                if "prelude" in job:
                    exec(compile(job["prelude"], "<prelude>", "exec"), {})
                runpy._run_module_as_main(job["module"])
            else:
                sys.argv, main = ["-c"], types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(job["code"], "<string>", "exec"), main.__dict__)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


@pytest.fixture(scope="module")
def runner(workdir):
    """The forking runner, in the README's scratch folder."""
    with open(workdir / "runner.log", "w") as log:  # the imports' warnings, or why the runner ended
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, *PRELOAD], cwd=workdir, env=_env(), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    proc.log = workdir / "runner.log"
    yield proc
    proc.stdin.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_step(runner: subprocess.Popen, job: dict, logs: Path, timeout: float = 600) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one README command or snippet, run by ``runner``."""
    out, err = logs / "stdout", logs / "stderr"
    runner.stdin.write(json.dumps({**job, "stdout": str(out), "stderr": str(err)}) + "\n")
    runner.stdin.flush()
    if not select.select([runner.stdout], [], [], timeout)[0]:
        os.killpg(runner.pid, signal.SIGKILL)
        raise AssertionError(f"no answer within {timeout} s")
    answer = runner.stdout.readline()
    assert answer, f"the runner ended ({runner.wait()}): {runner.log.read_text()[-3000:]}"
    return int(answer), out.read_text(errors="replace"), err.read_text(errors="replace")


STEPS = steps()


def test_the_readme_has_commands_and_every_one_has_a_rule():
    assert sum(kind == "bash" for kind, _ in STEPS) >= 10
    for kind, text in STEPS:
        if kind == "bash":
            plan(text)


@pytest.mark.parametrize("code", ["print('out'); import sys; print('err', file=sys.stderr)", "import sys; sys.exit(3)",
                                  "raise SystemExit('a message')", "raise ValueError('x')", "print(__name__, __file__)", "print(__name__)",
                                  "import atexit; atexit.register(print, 'at exit')",
                                  "import threading, time; threading.Thread(target=lambda: time.sleep(0.2) or "
                                  "print('joined')).start()"])
def test_the_runner_ends_a_snippet_as_python_does(code, runner, tmp_path):
    expected = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    status, stdout, stderr = run_step(runner, {"code": code}, tmp_path)
    assert (status, stdout) == (expected.returncode, expected.stdout)
    assert stderr.splitlines()[-1:] == expected.stderr.splitlines()[-1:]


def test_the_runner_runs_a_module_as_python_m_does(runner, tmp_path):
    expected = subprocess.run([sys.executable, "-m", "json.tool", "--no-such-flag"], capture_output=True, text=True)
    status, stdout, stderr = run_step(runner, {"module": "json.tool", "args": ["--no-such-flag"]}, tmp_path)
    assert (status, stdout, stderr) == (expected.returncode, expected.stdout, expected.stderr) and status == 2


@pytest.mark.parametrize("index", range(len(STEPS)), ids=[f"{i}:{t[:50]}" for i, (_, t) in enumerate(STEPS)])
def test_readme_step_runs(index, runner, workdir, tmp_path):
    kind, text = STEPS[index]
    preludes = [p for p in PRELUDES if kind == "bash" and re.search(p[0], text)]
    if kind == "python":
        skip, job = None, {"code": shrink_snippet(text)}
    else:
        skip, argv = plan(text)
        if not skip:
            assert argv[:2] == [sys.executable, "-m"], f"not a `python -m` command: {text}"
            job = {"module": argv[2], "args": argv[3:]}
            if preludes:
                job["prelude"] = preludes[0][1]
    if skip:
        pytest.skip(skip)
    code, stdout, stderr = run_step(runner, job, tmp_path)
    assert code == 0, (f"README {kind} step failed ({code}): {text}\n"
                       f"--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-3000:]}")
    for _, _, file, written in preludes:
        assert written in (workdir / file).read_text(), f"the budget did not reach {file}: {text}"


def test_every_prelude_meets_a_readme_command():
    """A prelude whose command has left the README (or changed) would silently stop shrinking anything."""
    for pattern, *_ in PRELUDES:
        assert sum(kind == "bash" and bool(re.search(pattern, text)) for kind, text in STEPS) == 1, pattern
