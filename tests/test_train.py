"""MemoryPPO (whole-rollout training) and the training CLI: losses, save/load, checkpoints, TensorBoard."""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import configure

from rlseq.algos import MemoryPPO
from rlseq.policies.memory import MEMORIES
from rlseq.train import main as train_main
from tests.helpers import collect_rollout as _collect
from tests.helpers import record_torch_threads
from tests.helpers import tiny_bench_train

MEMORY_KWARGS = {
    "efla": {"n_heads": 2, "head_dim": 16},
    "deltanet": {"n_heads": 2, "head_dim": 16},
    "lstm": {"hidden_size": 32},
    "none": {},
}
TINY = ["--n-envs", "2", "--n-steps", "16", "--n-minibatches", "2", "--n-epochs", "1", "--num-threads", "0"]


class _NoOp(BaseCallback):
    def _on_step(self) -> bool:
        return True


def _cartpole_model(memory: str, n_envs: int = 4, n_steps: int = 48, seed: int = 0, **policy_kwargs) -> MemoryPPO:
    env = make_vec_env("CartPole-v1", n_envs=n_envs, seed=seed)
    model = MemoryPPO("MlpPolicy", env, n_steps=n_steps, n_minibatches=2, seed=seed, device="cpu",
                      policy_kwargs=dict(memory=memory, memory_kwargs=MEMORY_KWARGS[memory], **policy_kwargs))
    model.set_logger(configure(None, []))
    return model



@pytest.mark.parametrize(("memory", "critic_memory"), [("efla", False), ("deltanet", False), ("lstm", False),
                                                      ("none", False), ("efla", True), ("lstm", True)])
def test_sequence_losses_equal_a_step_by_step_recomputation(memory, critic_memory):
    model = _cartpole_model(memory, critic_memory=critic_memory)
    _collect(model)  # first rollout: the memory starts empty
    model.train()  # move the weights and the memory state away from zero
    _collect(model, setup=False)  # second rollout: starts from the memory state carried over
    buf = model.rollout_buffer
    assert buf.episode_starts[1:].any(), "the rollout should contain episode starts inside the sequences"
    if memory != "none":
        assert buf.initial_state.abs().max() > 0, "the second rollout must start from a carried-over state"
    batch = buf.batch(torch.arange(model.n_envs))
    with torch.no_grad():
        seq = model.ppo_losses(batch, clip_range=0.2, clip_range_vf=0.5)
        values, log_probs, entropies = [], [], []
        state = batch.initial_state.clone()
        for t in range(model.n_steps):
            v, lp, ent = model.policy.evaluate_step(batch.observations[:, t], batch.actions[:, t], state, batch.episode_starts[:, t])
            values.append(v), log_probs.append(lp), entropies.append(ent)
        values, log_probs, entropies = (torch.stack(x, 1).flatten() for x in (values, log_probs, entropies))
        step = model._losses_from(values, log_probs, entropies, batch, 0.2, 0.5)
    for name in seq:
        assert torch.allclose(seq[name], step[name], rtol=1e-5, atol=1e-6), name
    # and acting stored the same log-probabilities: PPO's ratio is 1 on the first minibatch
    assert torch.allclose(log_probs, batch.old_log_prob.flatten(), atol=1e-5)
    assert torch.allclose(values, batch.old_values.flatten(), atol=1e-5)


def test_buffer_stores_the_memory_state_once_per_rollout():
    model = _cartpole_model("efla", n_envs=4, n_steps=32)
    _collect(model)
    buf = model.rollout_buffer
    per_env_state = int(np.prod(model.policy.initial_state(1).shape))
    assert tuple(buf.initial_state.shape) == (4, *model.policy.initial_state(1).shape[1:])
    # everything but the observations, per step and env, is a handful of scalars: no per-step state
    obs_bytes = buf.observations.numel() * buf.observations.element_size()
    assert buf.nbytes() - obs_bytes < 4 * per_env_state * 4 + 32 * 4 * 8 * 8


def test_buffer_copies_run_while_the_env_steps_and_rewards_land_on_their_step():
    from stable_baselines3.common.vec_env import VecEnvWrapper

    class Recorder(VecEnvWrapper):
        """Records each step's rewards and the buffer's fill state while the env is stepping."""

        def __init__(self, venv):
            super().__init__(venv)
            self.rewards, self.pending = [], []

        def reset(self):
            return self.venv.reset()

        def step_wait(self):
            buf = model.rollout_buffer
            self.pending.append((buf.pos, buf.rewards_pos))
            obs, _, dones, infos = self.venv.step_wait()
            # CartPole pays 1 every step: distinct rewards show a reward stored one step off
            rewards = (np.arange(self.num_envs) + 10 * len(self.rewards)).astype(np.float32)
            self.rewards.append(rewards.copy())
            assert not any(i.get("TimeLimit.truncated", False) for i in infos)  # no bootstrap is added to them
            return obs, rewards, dones, infos

    model = _cartpole_model("efla", n_envs=4, n_steps=40)
    model.env = Recorder(model.env)
    _collect(model)
    env, buf = model.env, model.rollout_buffer
    # at every step_wait the step's observations and actions are stored and its reward is not
    assert env.pending == [(t + 1, t) for t in range(40)]
    assert buf.full and buf.pos == buf.rewards_pos == 40
    assert np.array_equal(buf.rewards.numpy(), np.stack(env.rewards))
    # the order is enforced
    buf.reset(model._memory_state)
    step = (buf.observations[0], buf.actions[0], buf.episode_starts[0], buf.values[0], buf.log_probs[0])
    with pytest.raises(RuntimeError, match="must follow add_step"):
        buf.add_rewards(buf.rewards[0])
    buf.add_step(*step)
    with pytest.raises(RuntimeError, match="has no reward yet"):
        buf.add_step(*step)
    assert not buf.full


def test_save_load_predict_roundtrip(tmp_path):
    model = _cartpole_model("efla", n_envs=2, n_steps=16)
    model.learn(64)
    obs = model.env.reset()
    a1, s1 = model.predict(obs, state=None, episode_start=np.ones(2, bool), deterministic=True)
    a2, s2 = model.predict(obs, state=s1, episode_start=np.zeros(2, bool), deterministic=True)
    model.save(tmp_path / "m.zip")
    loaded = MemoryPPO.load(tmp_path / "m.zip", device="cpu")
    b1, t1 = loaded.predict(obs, state=None, episode_start=np.ones(2, bool), deterministic=True)
    b2, t2 = loaded.predict(obs, state=t1, episode_start=np.zeros(2, bool), deterministic=True)
    assert np.array_equal(a1, b1) and np.array_equal(a2, b2)
    assert np.allclose(s2, t2) and not np.allclose(s1, s2)
    with pytest.raises(ValueError, match="state must have shape"):
        loaded.predict(obs, state=s1[:, :1], episode_start=np.zeros(2, bool))


def test_a_critic_memory_is_trained_by_the_value_loss_alone_and_survives_save_load(tmp_path):
    """``critic_memory=True``: the value loss reaches the critic's memory and trunk, not the actor's; the policy
    loss the actor's, not the critic's; the doubled state round-trips through save/load and predict."""
    model = _cartpole_model("efla", n_envs=2, n_steps=16, critic_memory=True)
    policy = model.policy
    actor_n = policy.memory.actor.state_shape[0]
    assert policy.initial_state(2).shape == (2, actor_n + policy.memory.critic.state_shape[0])
    torch.nn.init.normal_(policy.value_net.weight)  # the value head starts at zero, where no gradient passes it
    obs = torch.randn(2, 5, 4)
    resets = torch.zeros(2, 5, dtype=torch.bool)
    resets[:, 0] = True
    values, log_prob, _ = policy.evaluate_sequences(obs, torch.randint(0, 2, (2, 5)), policy.initial_state(2), resets)

    def touched(loss):
        grads = torch.autograd.grad(loss, list(policy.parameters()), retain_graph=True, allow_unused=True)
        return {name.split(".")[0] + "." + name.split(".")[1] for (name, _), g in zip(policy.named_parameters(), grads)
                if g is not None and g.abs().sum() > 0}

    by_value, by_policy = touched(values.sum()), touched(log_prob.sum())
    assert any(n.startswith("memory.critic") for n in by_value) and any(n.startswith("critic_trunk") for n in by_value)
    assert not any(n.startswith(("memory.actor", "trunk.", "action_net")) for n in by_value), by_value
    assert any(n.startswith("memory.actor") for n in by_policy)
    assert not any(n.startswith(("memory.critic", "critic_trunk", "value_net")) for n in by_policy), by_policy
    model.learn(64)
    env_obs = model.env.reset()
    a1, s1 = model.predict(env_obs, state=None, episode_start=np.ones(2, bool), deterministic=True)
    model.save(tmp_path / "m.zip")
    loaded = MemoryPPO.load(tmp_path / "m.zip", device="cpu")
    assert loaded.policy.critic_memory
    b1, t1 = loaded.predict(env_obs, state=None, episode_start=np.ones(2, bool), deterministic=True)
    assert np.array_equal(a1, b1) and np.allclose(s1, t1) and s1.shape == (2, loaded.policy.memory.state_shape[0])


def test_n_minibatches_must_divide_n_envs():
    env = make_vec_env("CartPole-v1", n_envs=6)
    with pytest.raises(ValueError, match="n_minibatches=4 must divide n_envs=6"):
        MemoryPPO("MlpPolicy", env, n_minibatches=4, device="cpu")


def test_memory_state_nan_is_reported_with_where():
    model = _cartpole_model("efla", n_envs=2, n_steps=8)
    model._setup_learn(100)
    model._last_episode_starts = np.zeros(2, dtype=bool)  # no reset at step 0 would wipe it
    model._memory_state[1].view(-1)[7] = float("nan")  # whatever the state layout, one entry of env 1
    cb = _NoOp()
    cb.init_callback(model)
    with pytest.raises(FloatingPointError, match=r"non-finite efla memory state at acting at env step 0: batch indices \[1\]"):
        model.collect_rollouts(model.env, cb, model.rollout_buffer, model.n_steps)


# --- the CLI ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--memory", "transformer"], "valid memories: " + ", ".join(MEMORIES)),
        (["--env", "pong"], "caveflyer"),
        (["--algo", "dqn"], "valid algos: rlseq, sb3-recurrent-ppo"),
        (["--distribution-mode", "extreme"], "valid: easy, hard, memory, exploration"),
        (["--n-envs", "6", "--n-minibatches", "4"], "must divide"),
        (["--algo", "sb3-recurrent-ppo", "--memory", "none"], "needs a recurrent memory"),
        (["--algo", "sb3-recurrent-ppo", "--amp", "bf16"], "--amp needs --algo rlseq"),
        (["--algo", "sb3-recurrent-ppo", "--cuda-graph"], "--cuda-graph needs --algo rlseq"),
        (["--cuda-graph", "--device", "cpu"], "--cuda-graph needs a GPU"),
        (["--algo", "sb3-recurrent-ppo", "--channels-last"], "--channels-last needs --algo rlseq"),
        (["--algo", "sb3-recurrent-ppo", "--fast"], "--fast needs --algo rlseq"),
    ],
)
def test_bad_flags_fail_fast_with_the_valid_choices(argv, message, tmp_path, capsys, monkeypatch):
    import rlseq.resume as R
    import rlseq.train as T

    for module in (T, R):  # a fresh start builds its env in rlseq.train, a resumed run in rlseq.resume
        monkeypatch.setattr(module, "make_env", lambda *a, **k: pytest.fail("an env was built before validation"))
    with pytest.raises(SystemExit) as e:
        train_main(argv + ["--logdir", str(tmp_path)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _scalars(run: Path, tag: str, files: list[Path] | None = None) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for f in files if files is not None else sorted(run.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out += [(e.step, e.value) for e in acc.Scalars(tag)]
    return out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    logdir = tmp_path_factory.mktemp("runs")
    train_main(["--env", "caveflyer", "--memory", "efla", "--total-steps", "96", "--seed", "3", "--logdir", str(logdir),
                "--no-progress-bar", *TINY])
    return logdir


def test_cli_runs_end_to_end_and_writes_the_run_folder(tiny_run):
    run = tiny_run / "caveflyer" / "efla" / "seed3"
    assert (run / "final_model.zip").exists() and (run / "config.yaml").exists()
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["n_envs"] == 2 and cfg["n_steps"] == 16 and cfg["memory"] == "efla" and cfg["gamma"] == 0.999
    # what ran on the CPU, not the config's "auto"
    assert cfg["cuda_graph_train"] is False and cfg["cuda_graph"] is False and cfg["tf32"] is False
    steps = [s for s, _ in _scalars(run, "time/fps")]
    assert steps and max(steps) == 96
    assert _scalars(run, "memory/gate_saturated_frac") and _scalars(run, "memory/state_norm_max")
    assert _scalars(run, "train/grad_norm") and _scalars(run, "train/value_target_abs_max")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensorboard_server_serves_a_scalar_of_a_finished_run(tiny_run):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tiny_run / "caveflyer"),
                             "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline, runs = time.time() + 60, []
        while time.time() < deadline:
            try:
                runs = json.load(urllib.request.urlopen(f"{base}/data/runs", timeout=5))
                if runs:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert "efla/seed3" in runs, runs
        query = urllib.parse.urlencode({"run": "efla/seed3", "tag": "time/fps"})
        deadline = time.time() + 30
        while True:
            try:
                points = json.load(urllib.request.urlopen(f"{base}/data/plugin/scalars/scalars?{query}", timeout=5))
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        assert [p[1] for p in points] == [s for s, _ in _scalars(tiny_run / "caveflyer" / "efla" / "seed3", "time/fps")]
        assert all(p[2] > 0 for p in points)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_finished_run_is_not_trained_again(tiny_run, capsys):
    argv = ["--env", "caveflyer", "--memory", "efla", "--total-steps", "96", "--seed", "3", "--logdir", str(tiny_run), *TINY]
    train_main(argv + ["--resume"])
    assert "finished already" in capsys.readouterr().out


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path, capsys):
    argv = ["--env", "caveflyer", "--memory", "deltanet", "--total-steps", "256", "--seed", "1", "--logdir", str(tmp_path),
            "--checkpoint-every", "32", "--no-progress-bar", *TINY]
    run = tmp_path / "caveflyer" / "deltanet" / "seed1"
    proc = subprocess.Popen([sys.executable, "-m", "rlseq.train", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    latest = run / "checkpoints" / "latest"
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and int(latest.read_text().strip()[4:]) >= 64:
            break
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "final_model.zip").exists()
    saved = int((run / "checkpoints" / latest.read_text().strip() / "meta.json").read_text().split(":")[1].split(",")[0])
    assert saved >= 64
    with pytest.raises(SystemExit) as e:  # without --resume the interrupted run is not overwritten
        train_main(argv)
    assert e.value.code == 2 and "exists; pass --resume" in capsys.readouterr().err
    old_files = set(run.glob("events.out.tfevents.*"))
    logged_before_kill = max(s for s, _ in _scalars(run, "time/fps"))

    train_main(argv + ["--resume"])
    assert (run / "final_model.zip").exists()
    new_files = sorted(set(run.glob("events.out.tfevents.*")) - old_files)
    new_steps = [s for s, _ in _scalars(run, "time/fps", new_files)]
    # the curve continues in the same folder from the checkpoint: what is lost is at most the steps logged
    # after the last checkpoint (a run killed between a log and the next checkpoint logs those again)
    assert new_files and new_steps[0] == saved + 32 and new_steps[-1] == 256
    assert logged_before_kill - saved <= 32
    from rlseq.algos import MemoryPPO as M

    assert M.load(run / "final_model.zip", device="cpu").num_timesteps == 256


@pytest.mark.parametrize(
    "extra,variant",
    [
        (["--algo", "sb3-recurrent-ppo", "--memory", "efla"], "sb3-efla"),
        (["--memory", "deltanet", "--prev-action-reward", "--reward-scale", "1000", "--no-normalize-reward",
          "--value-shift", "1e4", "--tag", "extreme"], "deltanet-extreme"),
    ],
)
def test_cli_other_algorithm_and_the_scale_wrappers(extra, variant, tmp_path):
    train_main(["--env", "caveflyer", "--total-steps", "64", "--logdir", str(tmp_path), "--no-progress-bar", *TINY, *extra])
    run = tmp_path / "caveflyer" / variant / "seed0"
    assert (run / "final_model.zip").exists()
    if variant == "deltanet-extreme":
        import yaml

        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["reward_scale"] == 1000 and cfg["value_shift"] == 1e4 and cfg["prev_action_reward"] is True
        # each step earns (1 − γ)·1e4 = 10 from the shift alone, so the 16-step targets of an untrained critic
        # already exceed 20; unshifted, caveflyer's rewards are almost all 0 this early
        assert min(v for _, v in _scalars(run, "train/value_target_abs_mean")) > 20


def test_evaluate_reports_unscaled_returns_and_that_a_full_distribution_run_has_no_held_out_levels(tiny_run, capsys):
    from rlseq.evaluate import evaluate, main as evaluate_main

    run = tiny_run / "caveflyer" / "efla" / "seed3"
    res = evaluate(run, 3, n_envs=2, progress=False)
    # trained with num_levels=0: every level seed is a training level, so the evaluation says it is not held out
    assert res["episodes"] == 3 and res["held_out"] is False and res["num_levels"] == 0
    assert 0.0 <= res["min"] <= res["mean"] <= res["max"] <= 12.0  # caveflyer's game scores
    with pytest.raises(SystemExit):
        evaluate_main([str(tiny_run / "nope"), "--episodes", "1"])
    assert "config.yaml" in capsys.readouterr().err


def test_truncated_episodes_are_bootstrapped_with_the_memory_of_the_ending_episode():
    import gymnasium as gym

    env = make_vec_env(lambda: gym.wrappers.TimeLimit(gym.make("CartPole-v1").unwrapped, max_episode_steps=5), n_envs=2, seed=0)
    model = MemoryPPO("MlpPolicy", env, n_steps=12, n_minibatches=1, seed=0, device="cpu", gamma=0.9,
                      policy_kwargs=dict(memory="efla", memory_kwargs=MEMORY_KWARGS["efla"]))
    model.set_logger(configure(None, []))
    with torch.no_grad():  # a critic that reads the memory (a fresh one is zero): the bootstrap has a value to add
        torch.nn.init.orthogonal_(model.policy.value_net.weight)
        model.policy.value_net.bias.fill_(0.5)
    model._setup_learn(100)
    seen = []
    real = model._bootstrap_truncated

    def spy(rewards, dones, infos):
        truncated = [i for i, d in enumerate(dones) if d and infos[i].get("TimeLimit.truncated", False)]
        expected = rewards.copy()
        if truncated:  # γ V(terminal obs) read with the memory as it stands after the episode's last step
            # one batch of the truncated envs, as the rollout makes it: fp32 matmuls of another batch size round
            # differently, which this comparison must not be about
            obs = model.policy.obs_to_tensor(np.stack([infos[i]["terminal_observation"] for i in truncated]))[0]
            state = model._memory_state[truncated].clone()
            with torch.no_grad():
                values = model.policy.predict_values(obs, state, torch.zeros(len(truncated), dtype=torch.bool))
            for j, i in enumerate(truncated):
                expected[i] += 0.9 * values[j].item()
        out = real(rewards, dones, infos)
        seen.append((truncated, out, expected))
        return out

    model._bootstrap_truncated = spy
    cb = _NoOp()
    cb.init_callback(model)
    model.collect_rollouts(model.env, cb, model.rollout_buffer, model.n_steps)
    truncated_steps = [(t, out, exp) for t, out, exp in seen if t]
    assert truncated_steps, "CartPole under a 5-step limit must truncate within 12 steps"
    for t, out, exp in truncated_steps:
        assert np.allclose(out, exp, rtol=1e-6)
        assert all(out[i] != 1.0 for i in t)  # CartPole pays 1 per step: the bootstrap was added


# --- speed options: bf16 autocast of the CNN, fused Adam ------------------------------------------------


def _procgen_model(amp, n_envs: int = 4, n_steps: int = 16, seed: int = 0, **policy_kwargs) -> MemoryPPO:
    from rlseq.envs import make_procgen

    env = make_procgen("caveflyer", n_envs, seed=seed, num_threads=0)
    model = MemoryPPO("CnnPolicy", env, n_steps=n_steps, n_minibatches=2, n_epochs=1, seed=seed, device="cpu",
                      policy_kwargs=dict(memory="efla", memory_kwargs=MEMORY_KWARGS["efla"], amp_dtype=amp, **policy_kwargs))
    model.set_logger(configure(None, []))
    return model


def test_amp_bf16_runs_only_the_cnn_in_bf16_in_acting_and_training():
    model = _procgen_model("bf16")
    policy = model.policy
    assert policy.amp_dtype is torch.bfloat16
    seen: dict[str, list] = {"conv": [], "memory": [], "heads": []}
    phase = ["act"]
    policy.features_extractor.stages[0].conv.register_forward_hook(lambda m, i, o: seen["conv"].append((phase[0], o.dtype)))
    policy.memory.register_forward_pre_hook(lambda m, args: seen["memory"].append(args[0].dtype))  # training path
    step = policy.memory.step
    policy.memory.step = lambda x, *a, **k: (seen["memory"].append(x.dtype), step(x, *a, **k))[1]  # acting path
    for head in (policy.action_net, policy.value_net):
        head.register_forward_pre_hook(lambda m, args: seen["heads"].append(args[0].dtype))
    _collect(model)  # acting, and the last values (predict_values)
    phase[0] = "train"
    model.train()
    # the same autocast on both paths: that is what keeps PPO's first ratio ~1
    assert {p for p, _ in seen["conv"]} == {"act", "train"}
    assert all(dt == torch.bfloat16 for _, dt in seen["conv"])
    assert seen["memory"] and all(dt == torch.float32 for dt in seen["memory"])
    assert seen["heads"] and all(dt == torch.float32 for dt in seen["heads"])
    assert model._memory_state.dtype == torch.float32
    batch = model.rollout_buffer.batch(torch.arange(model.n_envs))
    losses = model.ppo_losses(batch, clip_range=0.2, clip_range_vf=None)
    assert all(v.dtype == torch.float32 for v in losses.values())
    policy.optimizer.zero_grad()
    losses["loss"].backward()
    # parameters, their gradients and so Adam's moments stay fp32
    assert all(p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32) for p in policy.parameters())
    model.env.close()


def test_amp_bf16_is_close_to_fp32_keeps_the_first_ratio_near_1_and_trains_finite():
    model = _procgen_model("bf16")
    _collect(model)
    model.train()  # move the weights away from their initialisation
    _collect(model, setup=False)
    batch = model.rollout_buffer.batch(torch.arange(model.n_envs))
    policy = model.policy
    with torch.no_grad():
        # recomputation under the same setting as acting: PPO's first ratio is ~1 (not exactly: bf16 rounds
        # the CNN's output, and acting (4 frames) and training (64 frames) may accumulate in another order)
        values, log_prob, _ = policy.evaluate_sequences(batch.observations, batch.actions, batch.initial_state,
                                                        batch.episode_starts)
        assert torch.allclose(log_prob.flatten(), batch.old_log_prob.flatten(), atol=1e-3)
        assert torch.allclose(values.flatten(), batch.old_values.flatten(), atol=1e-2, rtol=1e-2)
        amp = model.ppo_losses(batch, clip_range=0.2, clip_range_vf=None)
        assert float(amp["approx_kl"]) < 1e-5
        f_amp = policy._sequence_features(batch.observations, model.n_envs, model.n_steps)
        policy.amp_dtype = None  # the same weights in fp32
        f_32 = policy._sequence_features(batch.observations, model.n_envs, model.n_steps)
        fp32 = model.ppo_losses(batch, clip_range=0.2, clip_range_vf=None)
        _, log_prob_32, _ = policy.evaluate_sequences(batch.observations, batch.actions, batch.initial_state,
                                                      batch.episode_starts)
        policy.amp_dtype = torch.bfloat16
    assert f_amp.dtype == torch.float32
    assert float((f_amp - f_32).norm() / f_32.norm()) < 2e-2  # bf16 keeps 8 bits of mantissa: ~0.4% per value
    assert torch.allclose(log_prob, log_prob_32, atol=1e-2)
    for name in ("loss", "value_loss", "entropy_loss"):
        assert torch.allclose(amp[name], fp32[name], rtol=5e-2, atol=1e-3), (name, amp[name], fp32[name])
    model.learn(3 * model.n_envs * model.n_steps, reset_num_timesteps=False)
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    model.env.close()


def test_amp_dtype_accepts_bf16_only():
    from rlseq.policies.actor_critic import parse_amp_dtype

    assert parse_amp_dtype(None) is None and parse_amp_dtype("none") is None
    assert parse_amp_dtype("bf16") is parse_amp_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="gradient scaler"):
        parse_amp_dtype(torch.float16)
    with pytest.raises(ValueError, match="unknown amp_dtype"):
        parse_amp_dtype("fp8")


def test_amp_off_is_the_exact_fp32_path():
    model = _cartpole_model("efla", n_envs=2, n_steps=8)
    assert model.policy.amp_dtype is None and "amp_dtype" not in model.policy_kwargs
    obs = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(model.policy.features(obs), model.policy.features_extractor(obs))


def test_channels_last_is_the_same_network_in_nhwc_and_survives_save_load(tmp_path):
    models = [_procgen_model(None, channels_last=cl) for cl in (False, True)]
    nchw, nhwc = (m.policy for m in models)
    nhwc.load_state_dict(nchw.state_dict())
    conv = nhwc.features_extractor.stages[0].conv.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    _collect(models[0])
    batch = models[0].rollout_buffer.batch(torch.arange(4))
    with torch.no_grad():
        out = [p.evaluate_sequences(batch.observations, batch.actions, batch.initial_state, batch.episode_starts)
               for p in (nchw, nhwc)]
    for a, b in zip(out[0], out[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    models[1].save(tmp_path / "m.zip")
    loaded = MemoryPPO.load(tmp_path / "m.zip", device="cpu")
    assert loaded.policy.channels_last
    assert loaded.policy.features_extractor.stages[0].conv.weight.is_contiguous(memory_format=torch.channels_last)
    for m in models:
        m.env.close()


def test_fused_adam_gives_the_same_parameters_as_unfused():
    models = []
    for optimizer_kwargs in (None, dict(eps=1e-5, fused=True)):
        env = make_vec_env("CartPole-v1", n_envs=4, seed=0)
        model = MemoryPPO("MlpPolicy", env, n_steps=32, n_minibatches=2, n_epochs=3, seed=0, device="cpu",
                          policy_kwargs=dict(memory="efla", memory_kwargs=MEMORY_KWARGS["efla"],
                                             optimizer_kwargs=optimizer_kwargs))
        model.set_logger(configure(None, []))
        models.append(model)
    unfused, fused = models
    assert fused.policy.optimizer.defaults["fused"] and not unfused.policy.optimizer.defaults.get("fused")
    assert fused.policy.optimizer.defaults["eps"] == unfused.policy.optimizer.defaults["eps"] == 1e-5
    before = {k: v.clone() for k, v in unfused.policy.state_dict().items()}
    assert all(torch.equal(before[k], v) for k, v in fused.policy.state_dict().items())  # same seed, same init
    _collect(unfused)
    fused.rollout_buffer = unfused.rollout_buffer  # the same data for both
    for model in models:
        torch.manual_seed(1)  # the same minibatch order
        model.train()  # 3 epochs x 2 minibatches = 6 Adam steps
    moved = 0
    for (name, a), b in zip(unfused.policy.named_parameters(), fused.policy.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
        moved += int(not torch.equal(a, before[name]))
    assert moved > 0, "the optimizer steps should move the parameters"


def test_cli_amp_and_fused_adam_are_saved_and_survive_resume(tmp_path, capsys):
    import yaml

    base = ["--env", "caveflyer", "--memory", "efla", "--logdir", str(tmp_path), "--checkpoint-every", "32",
            "--no-progress-bar", *TINY]
    run = tmp_path / "caveflyer" / "efla" / "seed0"

    def check(steps: int) -> None:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["amp"] == "bf16" and cfg["fused_adam"] is True
        model = MemoryPPO.load(run / "final_model.zip", device="cpu")
        assert model.num_timesteps == steps and model.policy.amp_dtype is torch.bfloat16
        assert model.policy.optimizer.defaults["fused"] and model.policy.optimizer.defaults["eps"] == 1e-5

    train_main(base + ["--total-steps", "32", "--amp", "bf16", "--fused-adam"])
    check(32)
    # an interrupted run: the final model is gone, the checkpoint at step 32 is there
    (run / "final_model.zip").unlink()
    with pytest.raises(SystemExit) as e:  # asking for another precision on resume is refused, not ignored
        train_main(base + ["--total-steps", "64", "--resume", "--amp", "none"])
    assert e.value.code == 2 and "trained with amp=bf16" in capsys.readouterr().err
    train_main(base + ["--total-steps", "64", "--resume"])  # no flags: the checkpoint's settings hold
    check(64)


def test_bench_train_labels_the_speed_settings(capsys):
    from rlseq.bench.__main__ import main as bench_main

    tiny_bench_train(["rlseq-none", "rlseq-none+bf16+fused+nhwc"], n_envs=2)
    out = capsys.readouterr().out
    assert "| variant (TF32 off, CNN fp32, Adam unfused, acting eager, CNN layout NCHW) |" in out
    assert "timing: round-robin, one rollout per variant per round" in out
    assert "| rlseq-none+bf16+fused+nhwc |" in out
    assert "rlseq-none+bf16+fused+nhwc (TF32 off, CNN bf16, Adam fused, acting eager, CNN layout NHWC)" in out
    with pytest.raises(SystemExit):
        bench_main(["train", "--variants", "sb3-ppo+bf16"])
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench_main(["train", "--variants", "rlseq-none+graph", "--device", "cpu"])


def test_bench_train_times_round_robin_and_takes_ratios_against_none_with_the_same_options(capsys, monkeypatch):
    import rlseq.bench.train as BT

    order = []
    timed = BT._Bench.timed
    monkeypatch.setattr(BT._Bench, "timed", lambda self, n: (order.append((self.variant, n)), timed(self, n)))
    tiny = ["--n-envs", "2", "--n-steps", "8", "--n-minibatches", "2", "--n-epochs", "1", "--num-threads", "0",
            "--warmup", "1", "--device", "cpu"]
    variants = ["rlseq-none+fused", "rlseq-efla+fused", "rlseq-efla"]
    BT.main(_bench_args(BT, variants, tiny))
    out = capsys.readouterr().out
    # two rounds, one rollout per variant each, the round's first variant rotating
    assert order == [(variants[0], 1), (variants[1], 1), (variants[2], 1), (variants[1], 1), (variants[2], 1),
                     (variants[0], 1)]
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in out.splitlines()
            if line.startswith("| rlseq-") and line.count("|") == 5}  # the speed table, not the phase shares
    speed = {v: float(rows[v][0].replace(",", "")) for v in variants}
    assert rows["rlseq-none+fused"][1].strip() == "1.00x"
    ratio = float(rows["rlseq-efla+fused"][1].strip().rstrip("x"))
    a, b = speed["rlseq-efla+fused"], speed["rlseq-none+fused"]
    # the table prints speeds rounded to units and the ratio of the unrounded ones to 2 decimals
    rounding = (a / b) * (0.5 / a + 0.5 / b) + 0.005
    assert ratio == pytest.approx(a / b, abs=rounding)
    assert rows["rlseq-efla"][1].strip() == "n/a"  # no rlseq-none with the same (no) options in the call

    order.clear()
    BT.main(_bench_args(BT, variants[:2], tiny + ["--sequential"]))
    assert order == [(variants[0], 2), (variants[1], 2)]
    assert "timing: one variant after the other" in capsys.readouterr().out


def _bench_args(BT, variants: list[str], extra: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    BT.add_arguments(parser)
    return parser.parse_args(["--variants", *variants, "--rollouts", "2", *extra])


def test_acting_under_vectransposeimage_transposes_on_the_device_with_the_same_rollout():
    """MemoryPPO steps the env under SB3's VecTransposeImage and transposes frames in the acting step; an
    identity wrapper on top hides the transposer and gives the plain path: both rollouts must be identical."""
    from stable_baselines3.common.vec_env import VecEnvWrapper, VecTransposeImage

    from rlseq.envs import make_procgen

    class Identity(VecEnvWrapper):
        def reset(self):
            return self.venv.reset()

        def step_wait(self):
            return self.venv.step_wait()

    rollouts = []
    for hide in (False, True):
        env = VecTransposeImage(make_procgen("caveflyer", 4, seed=0, num_threads=0))
        env = Identity(env) if hide else env
        model = MemoryPPO("CnnPolicy", env, n_steps=24, n_minibatches=2, n_epochs=1, seed=0, device="cpu",
                          policy_kwargs=dict(memory="efla", memory_kwargs=MEMORY_KWARGS["efla"]))
        model.set_logger(configure(None, []))
        _collect(model)
        b = model.rollout_buffer
        rollouts.append((b.observations.clone(), b.actions.clone(), b.values.clone(), b.rewards.clone(),
                         b.episode_starts.clone(), model._last_obs.copy()))
        model.env.close()
    (fast, plain) = rollouts
    assert fast[0].shape[2:] == (3, 64, 64)  # stored channel-first, as the policy reads them
    for a, b in zip(fast[:5], plain[:5]):
        assert torch.equal(a, b)
    assert np.array_equal(fast[5], plain[5]) and fast[5].shape[1:] == (3, 64, 64)  # SB3's layout between rollouts


def test_a_run_folder_in_use_is_refused_and_free_again_once_its_holder_ends(tmp_path, capsys, monkeypatch):
    import rlseq.resume as R
    import rlseq.train as T
    from rlseq.checkpoint import LOCK_NAME, run_folder_lock

    folder = tmp_path / "caveflyer" / "efla" / "seed5"
    argv = ["--env", "caveflyer", "--memory", "efla", "--total-steps", "32", "--seed", "5", "--logdir", str(tmp_path),
            "--no-progress-bar", *TINY]
    build = T.make_env
    for module in (T, R):  # a fresh start builds its env in rlseq.train, a resumed run in rlseq.resume
        monkeypatch.setattr(module, "make_env", lambda *a, **k: pytest.fail("an env was built for a folder in use"))
    with run_folder_lock(folder):  # stands for another training process
        for extra in ([], ["--resume"]):
            with pytest.raises(SystemExit) as e:
                train_main(argv + extra)
            assert e.value.code == T.BUSY_EXIT == 75  # "try again later", told apart from a usage error (2)
            assert f"run folder {folder} is in use by another training process (pid {os.getpid()} on {socket.gethostname()})" in capsys.readouterr().err
    for module in (T, R):
        monkeypatch.setattr(module, "make_env", build)
    train_main(argv)  # a folder holding only the released lock is a fresh run, not "exists; pass --resume"
    assert (folder / "final_model.zip").exists() and (folder / LOCK_NAME).exists()



def test_cuda_graph_train_without_fused_adam_is_refused_on_a_resume_that_finds_no_checkpoint(tmp_path, capsys,
                                                                                             monkeypatch):
    import rlseq.resume as R
    import rlseq.train as T

    # resolve() leaves this check to the checkpoint on --resume; with none found the run starts fresh and must check
    for module in (T, R):  # a fresh start builds its env in rlseq.train, a resumed run in rlseq.resume
        monkeypatch.setattr(module, "make_env", lambda *a, **k: pytest.fail("an env was built for a refused run"))
    (tmp_path / "caveflyer" / "efla" / "seed0").mkdir(parents=True)  # killed before its first checkpoint
    with pytest.raises(SystemExit) as e:
        train_main(["--env", "caveflyer", "--memory", "efla", "--logdir", str(tmp_path), "--no-progress-bar",
                    "--cuda-graph-train", "--resume", *TINY])
    assert e.value.code == 2
    assert "--cuda-graph-train needs --fused-adam" in capsys.readouterr().err

# --- --fast and cuda_graph_train: auto -----------------------------------------------------------------


def _resolved(*argv: str, config: Path | None = None) -> dict:
    from rlseq.train import build_parser, resolve

    extra = ["--config", str(config)] if config is not None else []
    return resolve(build_parser().parse_args(["--env", "caveflyer", *extra, *argv]))


SPEED_KEYS = ("amp", "fused_adam", "channels_last", "tf32", "compile_extractor")


def test_fast_is_the_five_speed_flags_and_a_flag_given_explicitly_wins():
    assert tuple(_resolved()[k] for k in SPEED_KEYS) == (None, False, False, False, False)
    fast = _resolved("--fast")
    assert tuple(fast[k] for k in SPEED_KEYS) == ("bf16", True, True, True, True)
    assert fast["cuda_graph_train"] == "auto"  # comes on with fused Adam on a GPU, by itself
    for argv, key, value in [(["--amp", "none"], "amp", None), (["--no-fused-adam"], "fused_adam", False),
                             (["--no-channels-last"], "channels_last", False), (["--no-tf32"], "tf32", False),
                             (["--no-compile-extractor"], "compile_extractor", False)]:
        for order in (["--fast", *argv], [*argv, "--fast"]):
            cfg = _resolved(*order)
            assert cfg[key] == value and all(cfg[k] == fast[k] for k in SPEED_KEYS if k != key), (order, cfg)
    assert _resolved("--fast", "--no-cuda-graph-train")["cuda_graph_train"] is False


@pytest.mark.parametrize("text,expected", [("auto", "auto"), ("null", "auto"), ("true", True), ("false", False),
                                           ("'Auto'", "auto")])
def test_config_cuda_graph_train_takes_auto_null_true_false(text, expected, tmp_path):
    from rlseq.train import DEFAULT_CONFIG

    original = DEFAULT_CONFIG.read_text()
    assert "\n  cuda_graph_train: auto " in original
    config = tmp_path / "c.yml"
    config.write_text(original.replace("\n  cuda_graph_train: auto ", f"\n  cuda_graph_train: {text} "))
    assert _resolved(config=config)["cuda_graph_train"] == expected
    assert type(_resolved(config=config)["cuda_graph_train"]) is type(expected)


def test_a_bad_config_cuda_graph_train_is_refused_with_the_valid_values(tmp_path, capsys):
    from rlseq.train import DEFAULT_CONFIG, UsageError

    config = tmp_path / "c.yml"
    config.write_text(DEFAULT_CONFIG.read_text().replace("\n  cuda_graph_train: auto ", "\n  cuda_graph_train: sometimes "))
    with pytest.raises(UsageError, match=r"cuda_graph_train 'sometimes' is not valid; valid: auto, null, true, false"):
        _resolved(config=config)
    with pytest.raises(SystemExit) as e:
        train_main(["--config", str(config), "--logdir", str(tmp_path)])
    assert e.value.code == 2 and "valid: auto, null, true, false" in capsys.readouterr().err


def test_fast_on_the_cpu_trains_records_what_ran_and_must_agree_with_the_checkpoint_on_resume(tmp_path, capsys,
                                                                                             restore_tf32):
    import yaml

    base = ["--env", "caveflyer", "--memory", "efla", "--logdir", str(tmp_path), "--no-progress-bar", *TINY]
    fast_run, plain_run = (tmp_path / "caveflyer" / "efla" / f"seed{s}" for s in (0, 1))
    train_main(base + ["--total-steps", "32", "--fast"])
    cfg = yaml.safe_load((fast_run / "config.yaml").read_text())
    # --fast's compiled CNN is for a GPU: on the CPU it stays off, and the record says so
    assert tuple(cfg[k] for k in SPEED_KEYS) == ("bf16", True, True, True, False)
    assert cfg["cuda_graph_train"] is False and cfg["device"] == "cpu"  # auto on the CPU: eager, recorded as such
    model = MemoryPPO.load(fast_run / "final_model.zip", device="cpu")
    assert model.policy.amp_dtype is torch.bfloat16 and model.policy.channels_last and not model.compile_extractor
    assert model.policy.features_extractor._compiled_call_impl is None
    # saved as auto: the same model loaded on a GPU trains from the graph
    assert model.policy.optimizer.defaults["fused"] and model.cuda_graph_train is None
    train_main(base + ["--total-steps", "32", "--seed", "1"])
    for run in (fast_run, plain_run):
        (run / "final_model.zip").unlink()  # interrupted runs, with their checkpoint at step 32
    refusals = [(["--seed", "1", "--fast"], "the run was trained with amp=None, and --fast asks for amp=bf16; "
                                            "resume it without --fast, or add --amp none"),
                (["--seed", "1", "--fast", "--amp", "none"], "the run was trained with fused_adam=False, and --fast "
                                                             "asks for fused_adam=True; resume it without --fast, or "
                                                             "add --no-fused-adam"),
                (["--fast", "--amp", "none"], "the run was trained with amp=bf16; resume it without --amp")]
    for extra, message in refusals:
        with pytest.raises(SystemExit) as e:
            train_main(base + ["--total-steps", "64", "--resume", *extra])
        assert e.value.code == 2 and message in capsys.readouterr().err, extra
    train_main(base + ["--total-steps", "64", "--resume", "--fast"])  # the same command plus --resume
    assert MemoryPPO.load(fast_run / "final_model.zip", device="cpu").num_timesteps == 64
    assert yaml.safe_load((fast_run / "config.yaml").read_text())["tf32"] is True


def test_the_compiled_extractor_is_a_run_setting_saved_with_the_model_and_changed_on_load(tmp_path):
    """``compile_extractor``: the features extractor compiled in place (compiling waits for its first call, which
    this test never makes), kept by save and load, changed by ``load``'s keyword (as a resumed run does)."""
    from rlseq.envs import make_procgen

    env = make_procgen("caveflyer", 2, seed=0, num_threads=0)
    model = MemoryPPO("CnnPolicy", env, n_steps=8, compile_extractor=True, device="cpu")
    extractor = model.policy.features_extractor
    assert extractor._compiled_call_impl is not None
    keys = set(model.policy.state_dict())
    assert not any("_orig_mod" in k for k in keys)  # in place: the checkpoint keys are the eager model's
    model.save(tmp_path / "m.zip")
    loaded = MemoryPPO.load(tmp_path / "m.zip", device="cpu")
    assert loaded.compile_extractor and loaded.policy.features_extractor._compiled_call_impl is not None
    assert set(loaded.policy.state_dict()) == keys
    plain = MemoryPPO.load(tmp_path / "m.zip", device="cpu", compile_extractor=False)
    assert not plain.compile_extractor and plain.policy.features_extractor._compiled_call_impl is None
    env.close()


def test_the_compiled_extractor_follows_the_command_on_resume_and_is_played_uncompiled(tmp_path, capsys,
                                                                                       monkeypatch):
    """An explicit ``--compile-extractor`` holds on the CPU, and so does a config file's beside ``--fast`` (only
    ``--fast``'s own is dropped there); ``--resume`` builds the policy with the resumed command's setting and states
    the change; ``rlseq.evaluate`` plays a model saved with it uncompiled. ``nn.Module.compile`` is recorded
    instead of run (compiling takes half a minute here)."""
    import yaml

    from rlseq.evaluate import load_as_trained

    compiled: list[str] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__))
    base = ["--env", "caveflyer", "--memory", "efla", "--logdir", str(tmp_path), "--no-progress-bar", *TINY]
    run = tmp_path / "caveflyer" / "efla" / "seed0"
    train_main(base + ["--total-steps", "32", "--compile-extractor"])
    assert compiled == ["ImpalaCNN"] and yaml.safe_load((run / "config.yaml").read_text())["compile_extractor"]
    played = load_as_trained(MemoryPPO, run / "final_model.zip", "cpu", [])
    assert not played.compile_extractor and compiled == ["ImpalaCNN"]
    assert MemoryPPO.load(run / "final_model.zip", device="cpu").compile_extractor  # saved with the model
    (run / "final_model.zip").unlink()  # an interrupted run, with its checkpoint at step 32
    capsys.readouterr()
    train_main(base + ["--total-steps", "64", "--resume"])
    assert "note: compile_extractor was True in the run and is False from now on" in capsys.readouterr().err
    assert compiled == ["ImpalaCNN", "ImpalaCNN"]  # the second is MemoryPPO.load's above: the resume compiled nothing
    assert not yaml.safe_load((run / "config.yaml").read_text())["compile_extractor"]
    assert not MemoryPPO.load(run / "final_model.zip", device="cpu").compile_extractor
    # a config file that asks for it keeps it beside --fast, whose own compiled CNN is dropped on the CPU
    config = tmp_path / "compile.yml"
    config.write_text("procgen:\n  compile_extractor: true\n")
    train_main(base + ["--total-steps", "32", "--seed", "1", "--fast", "--config", str(config)])
    assert compiled == ["ImpalaCNN"] * 3
    assert yaml.safe_load((run.with_name("seed1") / "config.yaml").read_text())["compile_extractor"]
    train_main(base + ["--total-steps", "32", "--seed", "2", "--fast"])
    assert compiled == ["ImpalaCNN"] * 3


def test_num_threads_auto_is_the_usable_cores_within_8_and_16(monkeypatch):
    import rlseq.config as C

    for cores, threads in ((2, 8), (8, 8), (12, 12), (16, 16), (64, 16)):
        monkeypatch.setattr(C.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert C.auto_procgen_threads() == threads
        assert _resolved()["env_kwargs"]["num_threads"] == threads  # configs/procgen.yml says auto
    assert _resolved("--num-threads", "3")["env_kwargs"]["num_threads"] == 3
    # a sweep's run takes its share of the cores, not the host's
    monkeypatch.setattr(C.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    for share, threads in (("4", 8), ("12", 12), ("40", 16), ("", 16), ("none", 16)):
        monkeypatch.setenv("RLSEQ_CPUS", share)
        assert C.auto_procgen_threads() == threads, share


def test_a_sweep_run_gets_its_share_of_the_cores_and_its_threads():
    from rlseq.sweep import run_environment

    env = run_environment({"threads": 2, "cpus": 6}, ["1"])
    assert (env["OMP_NUM_THREADS"], env["RLSEQ_CPUS"], env["CUDA_VISIBLE_DEVICES"]) == ("2", "6", "1")


def test_a_resume_states_a_changed_tf32_or_compiled_extractor_and_refuses_a_changed_learning_setting(
        tmp_path, capsys):
    import yaml

    from rlseq.resume import refuse_changed_settings
    from rlseq.train import UsageError

    saved = {"tf32": False, "compile_extractor": False, "gamma": 0.99, "env_kwargs": {"num_threads": 8}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    checkpoint = tmp_path / "checkpoints" / "step64"
    checkpoint.mkdir(parents=True)
    refuse_changed_settings({**saved, "tf32": True, "compile_extractor": True, "env_kwargs": {"num_threads": 16}},
                            tmp_path, checkpoint)
    err = capsys.readouterr().err
    assert "note: tf32 was False in the run and is True from now on" in err
    assert "note: compile_extractor was False in the run and is True from now on" in err
    with pytest.raises(UsageError, match=r"gamma: 0\.99 in the run, 0\.9 now"):
        refuse_changed_settings({**saved, "gamma": 0.9}, tmp_path, checkpoint)


# --- torch threads, the closing summary, extending a finished run, evaluating an interrupted one -------------

CARTPOLE = ["--env", "CartPole-v1", "--memory", "efla", "--n-envs", "2", "--n-steps", "32", "--n-minibatches", "1",
            "--n-epochs", "1", "--no-progress-bar"]


def test_the_torch_threads_rule():
    from rlseq.threads import torch_threads

    assert torch_threads(None, {}) == 1
    assert torch_threads(None, {"OMP_NUM_THREADS": "3"}) == 3
    assert torch_threads(None, {"OMP_NUM_THREADS": "0"}) == torch_threads(None, {"OMP_NUM_THREADS": "four"}) == 1
    assert torch_threads(2, {"OMP_NUM_THREADS": "3"}) == 2


def test_the_trainer_takes_one_torch_thread_unless_asked_and_ends_with_the_return_and_the_next_commands(
        tmp_path, capsys, monkeypatch):
    import yaml

    calls = record_torch_threads(monkeypatch)
    train_main([*CARTPOLE, "--total-steps", "64", "--logdir", str(tmp_path)])
    run = tmp_path / "CartPole-v1" / "efla" / "seed0"
    assert calls == [1] and yaml.safe_load((run / "config.yaml").read_text())["torch_threads"] == 1
    out = capsys.readouterr().out.splitlines()
    done = next(i for i, line in enumerate(out) if line.startswith("done: "))
    assert re.fullmatch(rf"done: 64 env steps in {re.escape(str(run))}; return [\d.]+, the mean of the last \d+ "
                        r"episodes?", out[done])
    assert out[done + 1:] == ["next:",
                              f"  python -m rlseq.evaluate {run} --episodes 100   # new episodes, unscaled return",
                              f"  python -m rlseq.compare {tmp_path / 'CartPole-v1'}   # against the other memories' "
                              "runs of this env (--memory gru, none, ...)",
                              f"  tensorboard --logdir {tmp_path / 'CartPole-v1'}"]
    train_main([*CARTPOLE, "--total-steps", "64", "--logdir", str(tmp_path), "--seed", "1", "--torch-threads", "3"])
    assert calls == [1, 3]
    with pytest.raises(SystemExit) as e:
        train_main([*CARTPOLE, "--logdir", str(tmp_path), "--seed", "2", "--torch-threads", "0"])
    assert e.value.code == 2 and capsys.readouterr().err == "error: --torch-threads 0 must be >= 1\n"


def test_a_linear_learning_rate_anneals_to_zero_over_the_budget_and_goes_on_from_a_resume(tmp_path, capsys):
    """``lin_<rate>`` (RL Zoo's spelling) falls linearly with the env steps done, and a resumed run goes on down
    the same line instead of starting at the full rate again; a resume that moves the budget says so."""
    argv = [*CARTPOLE, "--logdir", str(tmp_path), "--learning-rate", "lin_1e-3", "--checkpoint-every", "128"]
    run = tmp_path / "CartPole-v1" / "efla" / "seed0"

    def rate(step: int, budget: int = 384) -> float:
        # SB3 logs an update's rate with the next rollout (64 env steps here): the update after the rollout
        # ending at step s - 64 trained at 1e-3 * (1 - (s - 64) / budget)
        return pytest.approx(1e-3 * (1 - (step - 64) / budget), rel=1e-6)

    train_main([*argv, "--total-steps", "384"])
    assert yaml.safe_load((run / "config.yaml").read_text())["learning_rate"] == "lin_0.001"
    rates = dict(_scalars(run, "train/learning_rate"))
    assert sorted(rates) == [128, 192, 256, 320, 384] and all(v == rate(s) for s, v in rates.items()), rates
    # back to the checkpoint at step 256: the resumed update trains at 1e-3 * (1 - 320 / 384), where a schedule
    # started again over the 128 steps left would train at 1e-3 * (1 - 64 / 128)
    (run / "final_model.zip").unlink()
    shutil.rmtree(run / "checkpoints" / "step384")
    (run / "checkpoints" / "latest").write_text("step256\n")
    capsys.readouterr()
    train_main([*argv, "--total-steps", "384", "--resume"])
    assert "anneals to 0" not in capsys.readouterr().err
    assert dict(_scalars(run, "train/learning_rate"))[384] == rate(384)
    train_main([*argv, "--total-steps", "512", "--resume"])
    assert "learning rate lin_0.001 anneals to 0 at 512 env steps from now on, not at the 384 it was annealing to" \
        in capsys.readouterr().err
    # a resume with another budget that left no checkpoint of its own: its config.yaml says 1024, the checkpoint
    # it goes on from trained towards 512
    settings = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**settings, "n_timesteps": 1024}))
    (run / "final_model.zip").unlink()
    train_main([*argv, "--total-steps", "1024", "--resume"])
    assert "anneals to 0 at 1,024 env steps from now on, not at the 512 it was annealing to" in capsys.readouterr().err


def test_resume_with_a_larger_total_steps_extends_a_finished_run(tmp_path, capsys):
    argv = [*CARTPOLE, "--logdir", str(tmp_path)]
    run = tmp_path / "CartPole-v1" / "efla" / "seed0"
    train_main([*argv, "--total-steps", "64"])
    final = run / "final_model.zip"
    before = final.read_bytes()
    train_main([*argv, "--total-steps", "128"])  # without --resume: it says how
    assert "finished already (64 env steps in final_model.zip); nothing to do; to train it further, add --resume" \
        in capsys.readouterr().out and final.read_bytes() == before
    with pytest.raises(SystemExit):  # a changed setting is refused, and the run stays finished
        train_main([*argv, "--total-steps", "128", "--resume", "--learning-rate", "0.1"])
    assert "learning_rate" in capsys.readouterr().err and final.read_bytes() == before

    train_main([*argv, "--total-steps", "128", "--resume"])
    out = capsys.readouterr().out
    assert f"extending the finished run {run} from 64 to 128 env steps from step64" in out
    assert MemoryPPO.load(final, device="cpu").num_timesteps == 128
    assert [s for s, _ in _scalars(run, "time/fps")] == [64, 128]  # one curve, continued
    train_main([*argv, "--total-steps", "128", "--resume"])
    assert "finished already (128 env steps" in capsys.readouterr().out


def test_evaluate_names_the_checkpoint_of_an_interrupted_run_and_one_episode_has_no_spread(tmp_path, capsys):
    from rlseq.evaluate import main as evaluate_main

    train_main([*CARTPOLE, "--total-steps", "64", "--logdir", str(tmp_path)])
    run = tmp_path / "CartPole-v1" / "efla" / "seed0"
    (run / "final_model.zip").unlink()  # what a stopped run leaves: its checkpoints
    capsys.readouterr()
    evaluate_main([str(run), "--episodes", "1", "--n-envs", "1"])
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"{re.escape(str(run))}: return [\d.]+ \(1 episode; env seeds from \d+; model "
                        r"checkpoints/step64/model.zip: the run has no final_model.zip, this is its newest intact "
                        r"checkpoint\)", line), line
