"""``python -m rlseq.bench train``: end-to-end env-steps/s of training, per memory, in one process.

Each variant trains on the same procgen env and configuration (``configs/procgen.yml`` unless overridden):
after ``--warmup`` rollouts (compilation, allocator, procgen start-up), ``--rollouts`` rollouts are timed,
each a full collect + update, with the phase timer off. The variants are built and warmed up first, then
timed round-robin, one rollout each per round, the first variant of a round rotating, so that every variant
sees the same machine state (a host's speed drifts by ~10% between minutes; ``--sequential`` times one
variant after the other instead). For rlseq's MemoryPPO one more rollout is then run with the phase timer
on (it synchronises the device at each phase boundary) to give the breakdown. Ratios are taken against
``rlseq-none`` with the same ``+`` options, and against plain ``sb3-lstm``, when those are in the call.

Variants: ``rlseq-none``, ``rlseq-efla``, ``rlseq-deltanet``, ``rlseq-gru``, ``rlseq-lstm`` (MemoryPPO), ``sb3-lstm``
(stock sb3-contrib RecurrentPPO with ``CnnLstmPolicy``) and ``sb3-ppo`` (stock SB3 PPO with ``CnnPolicy``).
``sb3-lstm`` and ``sb3-ppo`` use SB3's default NatureCNN, as a user's stock script would; the rlseq variants
and ``sb3-lstm-impala`` (RecurrentPPO with the same IMPALA CNN and a 256-unit LSTM, the like-for-like
baseline of ``rlseq-lstm``) use the IMPALA CNN of the config.

Speed settings, one per ``+`` option of a variant, labelled in the tables: ``tf32`` (TF32 convolutions and
matmuls; off by default, as in ``python -m rlseq.train``, so the baseline is true fp32), ``bf16`` (the CNN in bf16
autocast), ``fused`` (fused Adam), ``graph`` (acting replayed from a CUDA graph), ``tgraph`` (each PPO minibatch
update replayed from a CUDA graph; needs ``fused``), ``nhwc`` (channels-last CNN), ``autotune`` (cuDNN times its
convolution algorithms per shape and keeps the fastest, ``torch.backends.cudnn.benchmark``) and ``compile`` (the
features extractor through ``torch.compile``, the trainer's ``--compile-extractor``, compiled in the warm-up before
any graph is captured); all but
``tf32`` and ``autotune`` for the rlseq variants only (the sb3 variants stay stock). One call compares them side by side in one process::

    python -m rlseq.bench train --variants rlseq-efla rlseq-efla+graph rlseq-efla+graph+bf16+fused+tf32
    python -m rlseq.bench train --variants rlseq-efla+graph+bf16+fused+nhwc+tf32 rlseq-efla+graph+bf16+fused+nhwc+tf32+tgraph

With ``tgraph`` the training phases ``train_forward``, ``train_backward`` and ``optimizer`` become one phase,
``train_step`` (staging the minibatch and replaying its update).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from rlseq.bench.timing import describe_environment, round_robin, row
from rlseq.threads import add_torch_threads_argument, set_torch_threads

VARIANTS = ("rlseq-none", "rlseq-efla", "rlseq-deltanet", "rlseq-gru", "rlseq-lstm", "sb3-lstm", "sb3-lstm-impala", "sb3-ppo")
# per-variant settings: VARIANT+OPTION[+OPTION...]
OPTIONS = ("bf16", "fused", "tf32", "graph", "tgraph", "nhwc", "autotune", "compile")
PROCESS_OPTIONS = ("tf32", "autotune")  # process-wide switches: any variant
# train_step: a minibatch update replayed from a CUDA graph (tgraph), in place of train_forward/backward/optimizer
PHASES = ("env", "act", "buffer", "train_forward", "train_backward", "optimizer", "train_step", "diagnostics")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", default="caveflyer")
    parser.add_argument("--variants", nargs="+", default=None, type=_variant, metavar="VARIANT[+OPTION]",
                        help=f"{', '.join(VARIANTS)} (default: all; sb3-lstm-impala only on procgen); options (rlseq "
                             f"variants): {', '.join(OPTIONS)} ({' and '.join(PROCESS_OPTIONS)}: any variant)")
    parser.add_argument("--n-envs", type=int, default=None, help="default: the config's (64)")
    parser.add_argument("--n-steps", type=int, default=None, help="default: the config's (256)")
    parser.add_argument("--n-minibatches", type=int, default=None)
    parser.add_argument("--n-epochs", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=None, help="procgen threads")
    add_torch_threads_argument(parser)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rollouts first")
    parser.add_argument("--rollouts", type=int, default=2, help="timed rollouts")
    parser.add_argument("--sequential", action="store_true",
                        help="time each variant's rollouts in one block, one variant after the other")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)


def _variant(name: str) -> str:
    """Validate ``VARIANT[+OPTION...]`` (argparse type)."""
    base, *options = name.split("+")
    if base not in VARIANTS:
        raise argparse.ArgumentTypeError(f"unknown variant {base!r}; valid: {', '.join(VARIANTS)}")
    for option in options:
        if option not in OPTIONS:
            raise argparse.ArgumentTypeError(f"unknown option {option!r} of {name}; valid: {', '.join(OPTIONS)}")
        if option not in PROCESS_OPTIONS and not base.startswith("rlseq-"):
            raise argparse.ArgumentTypeError(f"{option} applies to the rlseq variants only, not {base}")
    if "tgraph" in options and "fused" not in options:
        raise argparse.ArgumentTypeError(f"tgraph needs fused Adam: add +fused to {name}")
    return name


def settings(variant: str) -> dict:
    """``{"tf32", "amp", "fused_adam", "cuda_graph", "cuda_graph_train", "channels_last", "cudnn_benchmark",
    "compile"}`` of one variant, from its ``+`` options (:func:`_variant` keeps all but tf32 and autotune to the
    rlseq variants).
    ``cuda_graph_train`` is always True or False, never ``python -m rlseq.train``'s auto: only tgraph turns it on."""
    options = variant.split("+")[1:]
    return {"tf32": "tf32" in options, "amp": "bf16" if "bf16" in options else None, "fused_adam": "fused" in options,
            "cuda_graph": "graph" in options, "cuda_graph_train": "tgraph" in options, "channels_last": "nhwc" in options,
            "cudnn_benchmark": "autotune" in options, "compile": "compile" in options}


def describe_settings(s: dict) -> str:
    return (f"TF32 {'on' if s['tf32'] else 'off'}, CNN {s['amp'] or 'fp32'}, Adam {'fused' if s['fused_adam'] else 'unfused'}, "
            f"acting {'CUDA graph' if s.get('cuda_graph') else 'eager'}, CNN layout {'NHWC' if s.get('channels_last') else 'NCHW'}"
            + (", training CUDA graph" if s.get("cuda_graph_train") else "")
            + (", cuDNN autotuned" if s.get("cudnn_benchmark") else "")
            + (", extractor compiled" if s.get("compile") else ""))


def _config(args: argparse.Namespace, memory: str, algo: str, speed: dict | None = None) -> dict:
    from rlseq.train import build_parser, resolve

    argv = ["--env", args.env, "--memory", memory, "--algo", algo, "--seed", str(args.seed)]
    if speed is not None:  # always explicit, so a config file's amp / fused_adam cannot leak into the labels, and
        # the training graph's auto default cannot turn it on for +fused without +tgraph
        argv += ["--amp", speed["amp"] or "none", "--fused-adam" if speed["fused_adam"] else "--no-fused-adam",
                 "--tf32" if speed["tf32"] else "--no-tf32",
                 "--cuda-graph" if speed["cuda_graph"] else "--no-cuda-graph",
                 "--cuda-graph-train" if speed["cuda_graph_train"] else "--no-cuda-graph-train",
                 "--channels-last" if speed["channels_last"] else "--no-channels-last",
                 "--compile-extractor" if speed["compile"] else "--no-compile-extractor"]
    for flag in ("n_envs", "n_steps", "n_minibatches", "n_epochs", "num_threads"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return resolve(build_parser().parse_args(argv))


def _apply_switches(variant: str) -> None:
    """Set the process-wide TF32 and cuDNN autotuning switches of ``variant`` (read when kernels run: before it
    builds or runs)."""
    s = settings(variant)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = s["tf32"]
    torch.backends.cudnn.benchmark = s["cudnn_benchmark"]


def _build(variant: str, args: argparse.Namespace, device: str):
    from stable_baselines3.common.logger import configure

    from rlseq.train import build_model, make_env, observation_kind, ppo_kwargs

    speed = settings(variant)
    _apply_switches(variant)
    variant = variant.split("+")[0]
    if variant.startswith("rlseq-"):
        cfg = _config(args, variant.split("-", 1)[1], "rlseq", speed)
        if speed["compile"]:
            import torch._dynamo.config as dynamo_config

            # the compiled extractors of one call share dynamo's count of compiled versions per code object (its
            # guards: grad mode, autocast, TF32, strides), 2-3 per variant; past the limit it would run eager code
            # under this variant's label, so the limit is raised and reaching it is an error
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
            dynamo_config.fail_on_recompile_limit_hit = True
        model = build_model(cfg, make_env(cfg, seed=args.seed), device)  # +compile: the trainer's compile_extractor
    else:
        cfg = {**_config(args, "lstm", "rlseq"), "algo": "sb3-recurrent-ppo"}
        env = make_env(cfg, seed=args.seed)
        kind = observation_kind(env.observation_space)[0]
        if variant == "sb3-lstm-impala" and kind != "image":
            raise SystemExit(f"{variant} needs an image observation; {args.env} has none")
        if variant == "sb3-lstm-impala" or (variant == "sb3-lstm" and kind != "image"):
            model = build_model(cfg, env, device)  # the CLI's sb3-contrib LSTM: over the IMPALA CNN on images
        else:  # stock: SB3's NatureCNN on images, as a user's script would have it
            from sb3_contrib import RecurrentPPO
            from stable_baselines3 import PPO

            lstm = variant == "sb3-lstm"
            policy = {"image": "Cnn", "vector": "Mlp", "dict": "MultiInput"}[kind] + ("LstmPolicy" if lstm else "Policy")
            model = (RecurrentPPO if lstm else PPO)(policy, env, **ppo_kwargs(cfg, device),
                                                    batch_size=cfg["n_envs"] * cfg["n_steps"] // cfg["n_minibatches"])
    model.set_logger(configure(None, []))
    return model, cfg


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Bench:
    """One variant's model, warmed up, and the time of its timed rollouts so far."""

    def __init__(self, variant: str, args: argparse.Namespace, device: str) -> None:
        self.variant, self.device = variant, device
        self.model, cfg = _build(variant, args, device)
        self.per_rollout = cfg["n_envs"] * cfg["n_steps"]
        self.seconds, self.rollouts = 0.0, 0
        self.model.learn(args.warmup * self.per_rollout)
        _sync(device)

    def timed(self, rollouts: int) -> None:
        _apply_switches(self.variant)
        _sync(self.device)
        t0 = time.perf_counter()
        self.model.learn(rollouts * self.per_rollout, reset_num_timesteps=False)
        _sync(self.device)
        self.seconds += time.perf_counter() - t0
        self.rollouts += rollouts

    def result(self) -> dict:
        """The env-steps/s of the timed rollouts, then (rlseq) one profiled rollout's phase shares."""
        out = {"variant": self.variant, "steps_per_s": self.rollouts * self.per_rollout / self.seconds}
        model = self.model
        if hasattr(model, "phases"):
            _apply_switches(self.variant)
            model.phases.enabled = True
            model.phases.reset()
            t1 = time.perf_counter()
            model.learn(self.per_rollout, reset_num_timesteps=False)
            _sync(self.device)
            total = time.perf_counter() - t1
            phases = dict(model.phases.totals)
            phases["other"] = max(0.0, total - sum(phases.values()))
            out["phases"] = {k: v / total for k, v in phases.items()}
            out["profiled_steps_per_s"] = self.per_rollout / total
        return out

    def close(self) -> None:
        self.model.env.close()
        del self.model
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def measure_all(args: argparse.Namespace, device: str) -> list[dict]:
    """Every variant's result, timed round-robin (or one after the other with ``--sequential``)."""
    if args.sequential:
        results = []
        for variant in args.variants:
            bench = _Bench(variant, args, device)
            bench.timed(args.rollouts)
            results.append(bench.result())
            bench.close()
        return results
    benches = [_Bench(v, args, device) for v in args.variants]
    round_robin([functools.partial(b.timed, 1) for b in benches], args.rollouts)  # each times itself, synchronised
    results = [b.result() for b in benches]
    for b in benches:
        b.close()
    return results


def _same_options_baseline(variant: str, base: dict[str, float]) -> float | None:
    """env-steps/s of ``rlseq-none`` with ``variant``'s ``+`` options, in any order, if that was measured."""
    options = set(variant.split("+")[1:])
    return next((v for name, v in base.items()
                 if name.split("+")[0] == "rlseq-none" and set(name.split("+")[1:]) == options), None)


def main(args: argparse.Namespace) -> None:
    set_torch_threads(args.torch_threads)  # the trainer's rule, so that the rates are those of rlseq.train
    if args.variants is None:  # the IMPALA-CNN anchor needs images: procgen's
        from rlseq.envs import env_family

        args.variants = [v for v in VARIANTS if v != "sb3-lstm-impala" or env_family(args.env) == "procgen"]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    graphed = [v for v in args.variants if settings(v)["cuda_graph"] or settings(v)["cuda_graph_train"]]
    if graphed and not device.startswith("cuda"):
        raise SystemExit(f"CUDA-graph acting or training (+graph, +tgraph) needs a GPU device: {', '.join(graphed)}")
    print(describe_environment(torch.device(device)))
    cfg = _config(args, "efla", "rlseq")
    threads = cfg["env_kwargs"].get("num_threads")  # procgen's; num_threads: auto depends on the host
    print(f"{args.env}, {cfg['n_envs']} envs x {cfg['n_steps']} steps, {cfg['n_epochs']} epochs, "
          f"{cfg['n_minibatches']} minibatches{'' if threads is None else f', procgen at {threads} threads'}; "
          f"{args.warmup} warm-up + {args.rollouts} timed rollouts per variant")
    label = describe_settings(settings("rlseq-none"))
    print(f"settings: {label} (a variant's +options change these)")
    print("timing: " + ("one variant after the other" if args.sequential else
                        "round-robin, one rollout per variant per round") + "\n", flush=True)
    results = measure_all(args, device)
    for res in results:
        variant = res["variant"]
        print(f"  {variant} ({describe_settings(settings(variant))}): {res['steps_per_s']:,.0f} env-steps/s", flush=True)
    base = {r["variant"]: r["steps_per_s"] for r in results}
    print(f"\n| variant ({label}) | env-steps/s | vs rlseq-none (same options) | vs sb3-lstm |\n|---|---:|---:|---:|")
    for r in results:
        ref = _same_options_baseline(r["variant"], base)
        vs_none = f"{r['steps_per_s'] / ref:.2f}x" if ref else "n/a"
        vs_sb3 = f"{r['steps_per_s'] / base['sb3-lstm']:.2f}x" if "sb3-lstm" in base else "n/a"
        print(row(r["variant"], f"{r['steps_per_s']:,.0f}", vs_none, vs_sb3))
    profiled = [r for r in results if "phases" in r]
    if profiled:
        names = [p for p in PHASES if any(p in r["phases"] for r in profiled)] + ["other"]
        print("\nShare of a profiled rollout (device synchronised at phase boundaries):\n")
        print(row(f"variant ({label})", "profiled env-steps/s", *names) + "\n|---|---:|" + "---:|" * len(names))
        for r in profiled:
            shares = (f"{100 * r['phases'].get(n, 0.0):.0f}%" for n in names)
            print(row(r["variant"], f"{r['profiled_steps_per_s']:,.0f}", *shares))
