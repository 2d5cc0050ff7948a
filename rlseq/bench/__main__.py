"""``python -m rlseq.bench SUITE [options]``: each suite is a module with ``add_arguments`` and ``main``."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

SUITES = {
    "kernels": ("rlseq.bench.kernels", "chunk_rule fwd+bwd and step_rule per backend at RL shapes"),
    "gpu-check": ("rlseq.bench.gpu_check", "the Triton kernels on a GPU against the float64 oracle (and --time)"),
    "envs": ("rlseq.bench.envs", "procgen vector env steps/s with and without the scale wrappers"),
    "train": ("rlseq.bench.train", "end-to-end env-steps/s of training per memory"),
    "memory": ("rlseq.bench.memory", "does each memory remember: PPO on POPGym tasks per memory, IQM report"),
    "recall": ("rlseq.bench.recall", "how far back each memory block recalls when taught directly (supervised)"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlseq.bench", description=__doc__)
    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (module, help_text) in SUITES.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    try:
        importlib.import_module(SUITES[args.suite][0]).main(args)
    except KeyboardInterrupt:  # a timing loop cut short: what it printed stands, the rest is not worth a traceback
        print(f"stopped by SIGINT: the {args.suite} rows printed above are complete, the rest was not measured",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None


if __name__ == "__main__":
    main()
