"""The acting step of the rollout loop: observations in, actions out, for all environments at once.

On a GPU one eager acting step is ~100 small kernel launches (the IMPALA CNN, the memory step, the heads and
the sampler) issued one by one from Python for only 64 environments, so it is bound by launch latency.
:class:`ActingStep` can capture the whole step once in a CUDA graph and replay it with one launch per step.
The graph reads the weights in place, so optimizer updates reach it; it is captured again when the memory
state tensor or a parameter moves.

Both modes run the same :meth:`MemoryPPOPolicy.act` on the same staged inputs, draw from the same CUDA
generator, and are checked against each other on the GPU (the CUDA tests of ``tests/test_acting.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.preprocessing import is_image_space

from rlseq.policies.actor_critic import MemoryPPOPolicy


@dataclass
class ActingOutput:
    """One step for ``n_envs`` environments. The tensors live on the policy's device and, with a CUDA graph,
    are overwritten by the next step: copy what must outlive it (the rollout buffer does)."""

    obs: torch.Tensor | dict[str, torch.Tensor]  # the staged observations in the policy's layout, [n_envs, ...]
    episode_starts: torch.Tensor  # [n_envs] bool
    actions: torch.Tensor
    values: torch.Tensor  # [n_envs]
    log_probs: torch.Tensor  # [n_envs]
    actions_np: np.ndarray  # actions on the host, what the env receives (before clipping)


class ActingStep:
    """``step(obs, episode_starts, state)``: one acting step of ``policy`` for ``n_envs`` environments.

    :param policy: the policy; its :meth:`~MemoryPPOPolicy.act` is what runs.
    :param cuda_graph: capture the step in a CUDA graph at the first call and replay it after that (CUDA only).

    Observations and episode starts are copied into fixed device buffers (through pinned host memory on a GPU),
    which is what lets a graph read them. ``state [n_envs, ...]`` is updated in place.
    """

    def __init__(self, policy: MemoryPPOPolicy, *, cuda_graph: bool = False):
        self.policy = policy
        self.device = policy.device
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph acting needs the policy on a CUDA device; it is on {self.device}")
        self.cuda_graph = cuda_graph
        space = policy.observation_space
        # entries the policy sees as (channel-first) images: these may arrive channel-last (hwc=True)
        self._image_keys = ({k for k, s in space.spaces.items() if is_image_space(s)} if isinstance(space, spaces.Dict)
                            else ({None} if is_image_space(space) else set()))
        self._layout: tuple | None = None  # (n_envs, hwc, {key: (shape, dtype)}) the buffers were made for
        self._host: dict[str | None, torch.Tensor] = {}  # what arrives, on the host (pinned on a GPU)
        self._arrive: dict[str | None, torch.Tensor] = {}  # the same on the device
        self._policy_obs: dict[str | None, torch.Tensor] = {}  # in the policy's layout: what the graph reads
        self._starts: torch.Tensor | None = None
        self._starts_host: torch.Tensor | None = None
        self._finite_host: torch.Tensor | None = None  # the step's all-finite flag, on the host (pinned on a GPU)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_key: tuple | None = None
        # the parameters as objects, listed once: walking the modules for them took 140-190 us a step on a busy
        # 2-core VM (52 tensors of the IMPALA policy), their data pointers ~6 us; a parameter moved by .to() or replaced
        # in .data shows in its pointer (a Parameter object swapped for a new one would also leave the optimizer
        # updating the old one)
        self._params = list(policy.parameters())
        self._out: tuple[torch.Tensor, ...] | None = None

    # --- staging ------------------------------------------------------------------------------------------

    def _buffers(self, obs: dict[str | None, np.ndarray], n_envs: int, hwc: bool) -> None:
        pin = self.device.type == "cuda"
        self._host, self._arrive, self._policy_obs = {}, {}, {}
        for k, x in obs.items():
            host = torch.empty(x.shape, dtype=torch.from_numpy(x[:0]).dtype)
            self._host[k] = host.pin_memory() if pin else host
            self._arrive[k] = torch.empty(x.shape, dtype=host.dtype, device=self.device)
            if hwc and k in self._image_keys:
                n, h, w, c = x.shape
                self._policy_obs[k] = torch.empty((n, c, h, w), dtype=host.dtype, device=self.device)
            else:
                self._policy_obs[k] = self._arrive[k]
        self._starts_host = torch.zeros(n_envs, dtype=torch.bool, pin_memory=pin)
        self._starts = torch.zeros(n_envs, dtype=torch.bool, device=self.device)
        self._finite_host = torch.zeros((), dtype=torch.bool, pin_memory=pin)

    def _stage(self, obs: np.ndarray | dict[str, np.ndarray], episode_starts: np.ndarray, hwc: bool) -> None:
        entries = dict(obs) if isinstance(obs, dict) else {None: obs}
        entries = {k: np.asarray(v) for k, v in entries.items()}
        n_envs = len(episode_starts)
        layout = (n_envs, hwc, {k: (v.shape, v.dtype) for k, v in entries.items()})
        if layout != self._layout:
            self._buffers(entries, n_envs, hwc)
            self._layout, self._graph = layout, None
        # the previous step ended with a device-to-host copy of its actions, so these host buffers are free
        for k, v in entries.items():
            self._host[k].numpy()[...] = v
            self._arrive[k].copy_(self._host[k], non_blocking=True)
            if self._policy_obs[k] is not self._arrive[k]:
                self._policy_obs[k].copy_(self._arrive[k].permute(0, 3, 1, 2))  # on the device: ~free, not ~0.5 ms
        self._starts_host.numpy()[...] = np.asarray(episode_starts, dtype=bool).reshape(n_envs)
        self._starts.copy_(self._starts_host, non_blocking=True)

    @property
    def _obs(self) -> torch.Tensor | dict[str, torch.Tensor]:
        return self._policy_obs[None] if None in self._policy_obs else dict(self._policy_obs)

    # --- the step -----------------------------------------------------------------------------------------

    def step(self, obs: np.ndarray | dict[str, np.ndarray], episode_starts: np.ndarray, state: torch.Tensor,
             where: str = "acting", hwc: bool = False) -> ActingOutput:
        """Act for all environments: ``obs`` as the VecEnv returns it, ``episode_starts [n_envs]`` bool (True:
        the memory of that environment is zeroed first). With ``hwc=True`` the image entries arrive channel-last
        (``[n_envs, H, W, C]``, as procgen makes them) and are transposed on the device into the policy's
        ``[n_envs, C, H, W]``. Raises :class:`FloatingPointError` (or the memory's
        :class:`~rlseq.policies.memory.MemoryStateError`) naming ``where`` if the step's outputs are not finite."""
        self._stage(obs, episode_starts, hwc)
        if self.cuda_graph:
            key = self.graph_key(state)
            if self._graph is None or key != self._graph_key:
                self._capture(state)
                self._graph_key = key
            self._graph.replay()
            actions, values, log_probs, finite = self._out
        else:
            with torch.no_grad():
                actions, values, log_probs, finite = self.policy.act(self._obs, state, self._starts)
        if self.device.type == "cuda":
            # the flag's copy waits for nothing; the actions' copy below waits for the stream, so for it too: one
            # host-device sync a step instead of two
            self._finite_host.copy_(finite, non_blocking=True)
            finite = self._finite_host
        actions_np = actions.cpu().numpy()  # the sync point of the step
        if not bool(finite):
            self.policy.memory.check_finite(state, where=where)  # names the environments when the memory is at fault
            raise FloatingPointError(
                f"non-finite action parameters or values at {where} while the {self.policy.memory.name} memory "
                "state is finite: the features extractor or the heads produced NaN/inf (check the weights and the "
                "observations)")
        return ActingOutput(self._obs, self._starts, actions, values, log_probs, actions_np)

    def graph_key(self, state: torch.Tensor) -> tuple:
        """What the captured graph reads by address: ``state``'s storage and shape, and every parameter's storage.
        The graph is captured again when it changes."""
        return state.data_ptr(), tuple(state.shape), tuple(p.data_ptr() for p in self._params)

    def _capture(self, state: torch.Tensor) -> None:
        """Warm up on a side stream with a scratch state (cuDNN and cuBLAS handles, Triton compilation), then
        capture ``policy.act`` reading the fixed buffers and updating ``state`` in place. The CUDA generator is
        restored after the warm-up, so the replayed steps draw what eager steps would."""
        policy, device = self.policy, self.device
        rng = torch.cuda.get_rng_state(device)
        scratch = state.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                policy.act(self._obs, scratch, self._starts)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.set_rng_state(rng, device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), torch.cuda.graph(graph):
                self._out = policy.act(self._obs, state, self._starts)
        except RuntimeError as err:
            raise RuntimeError(
                f"capturing the acting step of the {policy.memory.name} memory in a CUDA graph failed ({err}); "
                "train without a CUDA graph for acting (python -m rlseq.train --no-cuda-graph, or "
                "MemoryPPO(..., cuda_graph=False))") from err
        self._graph = graph

