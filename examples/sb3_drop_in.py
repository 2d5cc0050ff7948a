"""A normal sb3-contrib RecurrentPPO script with an EFLA memory: only the policy argument changes.

    python examples/sb3_drop_in.py                           # caveflyer, EflaCnnPolicy, 200k steps
    python examples/sb3_drop_in.py --policy CnnLstmPolicy    # the stock LSTM policy, same everything else
    python examples/sb3_drop_in.py --timesteps 512 --n-envs 2 --n-steps 64   # a smoke run on the CPU

Procgen paper settings where they fit a quick run (64 envs, 256 steps, 3 epochs, lr 5e-4, γ 0.999, λ 0.95,
entropy 0.01, reward normalisation). With RecurrentPPO every step's memory state is stored in the rollout
buffer (see the EflaCnnPolicy docstring for the cost); rlseq's own ``rlseq.algos.MemoryPPO`` avoids that and
trains on whole rollouts.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sb3_contrib import RecurrentPPO
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import VecNormalize

from rlseq.envs import make_procgen
from rlseq.policies import DeltaNetCnnPolicy, EflaCnnPolicy

POLICIES = {"EflaCnnPolicy": EflaCnnPolicy, "DeltaNetCnnPolicy": DeltaNetCnnPolicy, "CnnLstmPolicy": "CnnLstmPolicy"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--game", default="caveflyer")
    p.add_argument("--policy", choices=sorted(POLICIES), default="EflaCnnPolicy")
    p.add_argument("--timesteps", type=int, default=200_000)
    p.add_argument("--n-envs", type=int, default=64)
    p.add_argument("--n-steps", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--eval-episodes", type=int, default=None, help="default: one per env")
    p.add_argument("--save", default="sb3_drop_in_model.zip")
    args = p.parse_args()

    # TF32 convolutions (PyTorch's CUDA default) round differently for the acting batch and the training
    # minibatch: PPO's first ratio would be off by ~1e-3. Exact fp32 keeps acting and training consistent.
    torch.backends.cudnn.allow_tf32 = False

    env = make_procgen(args.game, args.n_envs, distribution_mode="easy", seed=args.seed)  # reports info["episode"]
    env = VecNormalize(env, norm_obs=False, norm_reward=True, gamma=0.999)

    policy_kwargs = {}
    if args.policy != "CnnLstmPolicy":
        # 4 heads of 32 × 32: a 4096-float state per env (EFLA's default is 64 × 32, DeltaNet's 64 × 64), half
        # the buffer memory of EFLA's default (RecurrentPPO stores the state of every step)
        policy_kwargs = dict(memory_kwargs=dict(n_heads=4, head_dim=32, value_dim=32))

    model = RecurrentPPO(
        POLICIES[args.policy],  # was: "CnnLstmPolicy"
        env,
        n_steps=args.n_steps,
        batch_size=args.n_envs * args.n_steps // 8,
        n_epochs=3,
        learning_rate=5e-4,
        gamma=0.999,
        gae_lambda=0.95,
        ent_coef=0.01,
        clip_range=0.2,
        policy_kwargs=policy_kwargs,
        seed=args.seed,
        device=args.device,
        verbose=1,
    )
    model.learn(args.timesteps)
    model.save(args.save)

    # Round trip: the loaded model acts exactly like the trained one.
    loaded = RecurrentPPO.load(args.save, device=args.device)
    obs = env.reset()
    starts = np.ones(env.num_envs, dtype=bool)
    s0 = s1 = None
    for _ in range(16):
        a0, s0 = model.predict(obs, state=s0, episode_start=starts, deterministic=True)
        a1, s1 = loaded.predict(obs, state=s1, episode_start=starts, deterministic=True)
        assert np.array_equal(a0, a1), "save → load changed the actions"
        obs, _, starts, _ = env.step(a0)
    print("save → load → predict: identical actions")

    env.training = False  # evaluate on raw rewards, without updating the normalisation statistics
    env.norm_reward = False
    mean, std = evaluate_policy(model, env, n_eval_episodes=args.eval_episodes or args.n_envs)
    print(f"{args.game} {args.policy}: mean return {mean:.2f} ± {std:.2f} after {args.timesteps} steps")
    env.close()


if __name__ == "__main__":
    main()
