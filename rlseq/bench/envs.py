"""``python -m rlseq.bench envs``: procgen vector-env steps/s with and without the scale wrappers.

Two measurements:

1. End to end: steps/s of the raw gym3 env, of :class:`ProcgenVecEnv` and of
   each wrapper stack on top of it, with random actions.  All configurations
   step one shared native env, interleaved repeat by repeat, and the median
   is reported, so drifting machine load hits all of them alike.
2. Isolated wrapper cost: the same wrapper stacks over a *replay* VecEnv that
   returns recorded procgen batches (done steps and infos included) at almost
   no cost.  Their extra time per step, divided by the real env's time per
   step, is the wrapper overhead; unlike the difference of two noisy
   end-to-end numbers it resolves a few percent on a busy 2-core machine.

The requirement checked at the end: all three wrappers together cost < 10% of
the env's own throughput.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlseq.bench.timing import describe_environment, round_robin, row

_LIMIT = 0.10  # wrappers must cost under 10% of the env's own step time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", default="caveflyer", help="procgen game (default: caveflyer)")
    parser.add_argument("--distribution-mode", default="easy", help="procgen distribution mode (default: easy)")
    parser.add_argument("--n-envs", type=int, default=64, help="parallel games (default: 64)")
    parser.add_argument("--steps", type=int, default=100, help="vector steps per timed repeat (default: 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed vector steps before each repeat (default: 10)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats; the median is reported (default: 15)")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="procgen worker threads (default: procgen's default, 4)"
    )
    parser.add_argument("--seed", type=int, default=0, help="level seed and action seed (default: 0)")


def _stacks() -> dict[str, Callable[[Any], Any]]:
    from rlseq.envs import PotentialValueShift, PrevActionReward, ScaleReward

    return {
        "+ ScaleReward(1e3)": lambda v: ScaleReward(v, 1e3),
        "+ PotentialValueShift(1e5)": lambda v: PotentialValueShift(v, 1e5, gamma=0.999),
        "+ PrevActionReward": lambda v: PrevActionReward(v),
        "+ all three": lambda v: PrevActionReward(PotentialValueShift(ScaleReward(v, 1e3), 1e5, gamma=0.999)),
    }


def _replay(venv: Any, recorded: list[tuple[Any, ...]]) -> Any:
    """A VecEnv that returns ``recorded``, step results of ``venv``, in a loop at almost no cost (``venv`` answers
    everything else and is never stepped)."""
    from stable_baselines3.common.vec_env import VecEnvWrapper

    class Replay(VecEnvWrapper):
        k = 0

        def reset(self) -> np.ndarray:
            return recorded[0][0]

        def step_async(self, actions: np.ndarray) -> None:
            pass

        def step_wait(self) -> Any:
            obs, rew, dones, infos = recorded[self.k]
            self.k = (self.k + 1) % len(recorded)
            # wrappers edit the infos of done envs in place: hand out fresh copies of those
            infos = [
                info if not info else {**info, "episode": dict(info["episode"])} if "episode" in info else dict(info)
                for info in infos
            ]
            return obs, rew, dones, infos

    return Replay(venv)


def _per_step(steppers: dict[str, Callable[[np.ndarray], Any]], actions: np.ndarray, steps: int, warmup: int,
              repeats: int) -> dict[str, float]:
    """Median seconds per vector step of each stepper: ``repeats`` round-robin rounds of ``steps`` timed steps,
    each after ``warmup`` untimed ones, the actions drawn in turn from ``actions``."""
    pool = itertools.cycle(actions)

    def run(step: Callable[[np.ndarray], Any], n: int) -> Callable[[], None]:
        return lambda: [step(next(pool)) for _ in range(n)]

    times = round_robin([run(s, steps) for s in steppers.values()], repeats,
                        before=[run(s, warmup) for s in steppers.values()])
    return {name: statistics.median(t) / steps for name, t in zip(steppers, times)}


def main(args: argparse.Namespace) -> None:
    from rlseq.envs import make_procgen

    n, steps, repeats, warmup = args.n_envs, args.steps, args.repeats, args.warmup
    if n < 1 or steps < 1 or repeats < 1 or warmup < 0:
        raise SystemExit("--n-envs, --steps and --repeats must be >= 1 and --warmup >= 0")
    stacks = _stacks()

    def build() -> Any:
        return make_procgen(
            args.env, n, distribution_mode=args.distribution_mode, seed=args.seed, num_threads=args.num_threads
        )

    rng = np.random.default_rng(args.seed)
    actions = rng.integers(0, 15, size=(4096, n))  # random, not constant, actions

    # --- 1. end to end --------------------------------------------------------
    # Every configuration drives the *same* native env: separate instances of
    # identical envs differ by several percent among themselves (thread pools,
    # memory placement), which would swamp the wrappers' cost.  The wrappers'
    # own bookkeeping goes stale when other configurations step the shared
    # env, which does not matter for timing.
    shared = build()
    shared.reset()
    native = shared._env
    steppers = {"gym3 ProcgenGym3Env (raw)": lambda a: (native.act(a.astype(np.int32)), native.observe()),
                "ProcgenVecEnv": shared.step, **{name: wrap(shared).step for name, wrap in stacks.items()}}
    per_step = _per_step(steppers, actions, steps, warmup, repeats)

    # --- 2. isolated wrapper cost ---------------------------------------------
    recorder = build()
    recorder.reset()
    recorded = [recorder.step(actions[k % len(actions)]) for k in range(max(steps, 256))]
    n_done = sum(int(r[2].sum()) for r in recorded)
    replays = {"replay": _replay(recorder, recorded),
               **{name: wrap(_replay(recorder, recorded)) for name, wrap in stacks.items()}}
    for env in replays.values():
        env.reset()
    replay_per_step = _per_step({k: v.step for k, v in replays.items()}, actions, len(recorded), warmup, repeats)

    base = per_step["ProcgenVecEnv"]
    print(f"# procgen {args.env} ({args.distribution_mode}), {n} envs, num_threads={args.num_threads or 'default(4)'}")
    print(f"# {describe_environment(torch.device('cpu'))}")
    print(f"# {steps} vector steps x {repeats} round-robin repeats (median), {warmup} warm-up steps, random actions")
    print("\n| configuration | env-steps/s | ms/vec-step | vs ProcgenVecEnv |\n|---|---:|---:|---:|")
    for name, sec in per_step.items():
        print(row(name, f"{n / sec:,.0f}", f"{sec * 1e3:.3f}", f"{(sec / base - 1) * 100:+.1f}%"))
    print(f"\nisolated wrapper cost over a replay VecEnv ({len(recorded)} recorded steps, {n_done} episode ends), "
          f"as a share of ProcgenVecEnv's {base * 1e3:.3f} ms/vec-step:\n")
    print("| wrappers | us/vec-step | overhead |\n|---|---:|---:|")
    for name in stacks:
        extra = max(replay_per_step[name] - replay_per_step["replay"], 0.0)
        print(row(name, f"{extra * 1e6:.1f}", f"{extra / base * 100:.2f}%"))
    worst = max(replay_per_step["+ all three"] - replay_per_step["replay"], 0.0) / base
    print(f"\n{'PASS' if worst < _LIMIT else 'FAIL'}: all three wrappers cost {worst * 100:.2f}% of the env's step time "
          f"(limit {_LIMIT * 100:.0f}%)")
    shared.close()
    recorder.close()
