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
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

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


class _Gym3Stepper:
    """The raw native env through gym3's own API, for reference."""

    def __init__(self, native: Any) -> None:
        self.native = native

    def step(self, actions: np.ndarray) -> Any:
        self.native.act(actions.astype(np.int32))
        return self.native.observe()


def _make_replay(recorded: list[tuple[Any, ...]], observation_space: Any, action_space: Any) -> Any:
    from stable_baselines3.common.vec_env.base_vec_env import VecEnv

    class ReplayVecEnv(VecEnv):
        """Returns recorded procgen step results in a loop (near-zero cost)."""

        def __init__(self) -> None:
            self.render_mode = None
            super().__init__(recorded[0][0].shape[0], observation_space, action_space)
            self._k = 0

        def reset(self) -> np.ndarray:
            return recorded[0][0]

        def step_async(self, actions: np.ndarray) -> None:
            pass

        def step_wait(self) -> Any:
            obs, rew, dones, infos = recorded[self._k]
            self._k = (self._k + 1) % len(recorded)
            # wrappers edit the infos of done envs in place: hand out fresh copies of those
            infos = [
                info if not info else {**info, "episode": dict(info["episode"])} if "episode" in info else dict(info)
                for info in infos
            ]
            return obs, rew, dones, infos

        def close(self) -> None:
            pass

        def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
            return [getattr(self, attr_name) for _ in self._get_indices(indices)]

        def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
            setattr(self, attr_name, value)

        def env_method(self, method_name: str, *args: Any, indices: Any = None, **kwargs: Any) -> list[Any]:
            return [getattr(self, method_name)(*args, **kwargs) for _ in self._get_indices(indices)]

        def env_is_wrapped(self, wrapper_class: type, indices: Any = None) -> list[bool]:
            return [False for _ in self._get_indices(indices)]

    return ReplayVecEnv()


def _time_steps(stepper: Any, actions: np.ndarray, start: int, steps: int, warmup: int) -> float:
    """Seconds per vector step of ``stepper.step`` over ``steps`` steps after ``warmup``."""
    pool = len(actions)
    for k in range(warmup):
        stepper.step(actions[(start + k) % pool])
    t0 = time.perf_counter()
    for k in range(steps):
        stepper.step(actions[(start + warmup + k) % pool])
    return (time.perf_counter() - t0) / steps


def _interleaved_medians(
    steppers: dict[str, Any], actions: np.ndarray, steps: int, warmup: int, repeats: int
) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in steppers}
    for rep in range(repeats):
        order = list(steppers) if rep % 2 == 0 else list(reversed(steppers))  # cancel order effects
        for name in order:
            samples[name].append(_time_steps(steppers[name], actions, rep * (steps + warmup), steps, warmup))
    return {name: statistics.median(s) for name, s in samples.items()}


def _describe() -> str:
    try:
        import torch

        from rlseq.bench.timing import describe_environment

        return describe_environment(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - the header line is informational only
        import os
        import platform

        return f"CPU, {os.cpu_count()} cores; python {platform.python_version()}"


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
    steppers: dict[str, Any] = {"gym3 ProcgenGym3Env (raw)": _Gym3Stepper(shared._env), "ProcgenVecEnv": shared}
    steppers.update({name: wrap(shared) for name, wrap in stacks.items()})
    per_step = _interleaved_medians(steppers, actions, steps, warmup, repeats)

    # --- 2. isolated wrapper cost ---------------------------------------------
    recorder = build()
    recorder.reset()
    recorded = [recorder.step(actions[k % len(actions)]) for k in range(max(steps, 256))]
    n_done = sum(int(r[2].sum()) for r in recorded)
    replays = {"replay": _make_replay(recorded, recorder.observation_space, recorder.action_space)}
    replays.update(
        {name: wrap(_make_replay(recorded, recorder.observation_space, recorder.action_space)) for name, wrap in stacks.items()}
    )
    for env in replays.values():
        env.reset()
    replay_per_step = _interleaved_medians(replays, actions, len(recorded), warmup, repeats)

    base = per_step["ProcgenVecEnv"]
    print(f"# procgen {args.env} ({args.distribution_mode}), {n} envs, num_threads={args.num_threads or 'default(4)'}")
    print(f"# {_describe()}")
    print(f"# {steps} vector steps x {repeats} interleaved repeats (median), {warmup} warm-up steps, random actions")
    print()
    print(f"{'configuration':<30} {'env-steps/s':>12} {'ms/vec-step':>12} {'vs ProcgenVecEnv':>17}")
    for name, sec in per_step.items():
        rel = f"{(sec / base - 1) * 100:+.1f}%"
        print(f"{name:<30} {n / sec:>12,.0f} {sec * 1e3:>12.3f} {rel:>17}")
    print()
    print(
        f"isolated wrapper cost over a replay VecEnv ({len(recorded)} recorded steps, {n_done} episode ends), "
        f"as a share of ProcgenVecEnv's {base * 1e3:.3f} ms/vec-step:"
    )
    print(f"{'wrappers':<30} {'us/vec-step':>12} {'overhead':>12}")
    worst = 0.0
    for name in stacks:
        extra = max(replay_per_step[name] - replay_per_step["replay"], 0.0)
        share = extra / base
        if name == "+ all three":
            worst = share
        print(f"{name:<30} {extra * 1e6:>12.1f} {share * 100:>11.2f}%")
    verdict = "PASS" if worst < _LIMIT else "FAIL"
    print()
    print(f"{verdict}: all three wrappers cost {worst * 100:.2f}% of the env's step time (limit {_LIMIT * 100:.0f}%)")

    shared.close()
    recorder.close()


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m rlseq.bench.envs", description=__doc__)
    add_arguments(_parser)
    main(_parser.parse_args())
