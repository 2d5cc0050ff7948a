"""Every command and Python snippet of the README runs as written, in the order written, with tiny budgets.

The commands run one after the other in one scratch folder (so a command may use what an earlier one wrote, as it
does for a reader), each with flags appended that shrink its budget: argparse keeps the last value of a flag, so
the README's own values are overridden, not edited. A command that cannot run here is skipped with the reason
(the install steps CI has already done, the test run itself, a server). A command the rules below do not know
fails the test: a new README command needs a rule.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
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


STEPS = steps()


def test_the_readme_has_commands_and_every_one_has_a_rule():
    assert sum(kind == "bash" for kind, _ in STEPS) >= 10
    for kind, text in STEPS:
        if kind == "bash":
            plan(text)


@pytest.mark.parametrize("index", range(len(STEPS)), ids=[f"{i}:{t[:50]}" for i, (_, t) in enumerate(STEPS)])
def test_readme_step_runs(index, workdir):
    kind, text = STEPS[index]
    if kind == "python":
        argv, skip = [sys.executable, "-c", shrink_snippet(text)], None
    else:
        skip, argv = plan(text)
    if skip:
        pytest.skip(skip)
    proc = subprocess.run(argv, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"README {kind} step failed ({proc.returncode}): {text}\n"
                                  f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
