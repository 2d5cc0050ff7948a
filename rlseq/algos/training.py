"""One PPO minibatch update (forward, loss, backward, gradient clipping, Adam step), replayable from a CUDA graph.

On a GPU, :meth:`MemoryPPO.train` is bound by the host: each minibatch update (the IMPALA CNN over ``B × T``
frames, the memory's chunk kernel, the heads, the PPO loss, its backward, ``clip_grad_norm_`` and fused Adam) is
hundreds of small kernel launches issued one by one from Python. :class:`TrainStep` captures one update in a CUDA
graph and replays it for every minibatch, as :class:`~rlseq.algos.acting.ActingStep` does for acting.

What a graph needs, and how the update provides it:

- fixed input addresses: each minibatch is copied into static device buffers (:meth:`TrainStep.update`);
- no host reads: the learning rate and the clip ranges are 0-dim device tensors filled before each ``train()``
  call (:meth:`TrainStep.begin`); a non-finite loss is not checked on the host per minibatch but sets a sticky
  device flag that the fused Adam kernel reads as its skip flag and then skips the update (its step counts are
  restored too), so the parameters and the optimizer state stay those before the bad minibatch, as when the eager
  loop raises there; the flag and the statistics are read once, after the last minibatch (:meth:`TrainStep.read`);
- a memory pass without host reads: :meth:`~rlseq.policies.memory.Memory.capturable_training` (the GRU and LSTM
  scan over time, :func:`~rlseq.kernels.rnn.rnn_scan`, instead of packing episode segments, whose lengths cuDNN
  reads on the host);
- capturable kernels: warm-up updates on a side stream first (lazy initialisation, Triton compilation, Adam's
  state), ``zero_grad(set_to_none=True)`` so that backward makes the gradients in the graph's own memory, and
  the policy's distributions made without argument checks (each one is a host sync).

Everything the graph needs from the optimizer (the tensor learning rate, the skip flag, permission to capture)
goes through :class:`~rlseq.algos.graph_adam.GraphAdam`, which says which torch mechanisms it relies on.

The same code runs without a graph (``cuda_graph=False``, any device), which is how the CPU tests check it
against the eager loop of :meth:`MemoryPPO.train`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlseq.algos.buffer import SequenceBatch
from rlseq.algos.graph_adam import GraphAdam, fused_adam

if TYPE_CHECKING:
    from rlseq.algos.ppo import MemoryPPO

# the loss terms of MemoryPPO.ppo_losses, then the gradient norm: the per-minibatch statistics train() logs
STAT_NAMES = ("loss", "policy_loss", "value_loss", "entropy_loss", "approx_kl", "clip_fraction", "grad_norm")
_FINITE = len(STAT_NAMES)  # the column of the log that holds isfinite(loss) (1.0 / 0.0)


class ClipRange:
    """A clip range ``ε`` around ``centre`` as 0-dim float32 device tensors that a CUDA graph reads:
    ``eps``, ``low = centre − ε`` and ``high = centre + ε``.

    :meth:`fill` computes the bounds in Python floats and rounds them once to float32, as torch rounds the scalar
    bounds of the eager loss, so both clamp (and count clipped ratios) at the same float32 values.
    """

    def __init__(self, centre: float, device: torch.device):
        self.centre = float(centre)
        self.eps, self.low, self.high = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(3))

    def fill(self, eps: float) -> None:
        """Set ``ε`` (no host sync: three fills on the device's stream)."""
        self.eps.fill_(eps)
        self.low.fill_(self.centre - eps)
        self.high.fill_(self.centre + eps)


def clip_bounds(clip: float | ClipRange, centre: float) -> tuple[Any, Any, Any]:
    """``(ε, centre − ε, centre + ε)`` of a clip range given as a float (eager loop) or a :class:`ClipRange`."""
    if isinstance(clip, ClipRange):
        return clip.eps, clip.low, clip.high
    return clip, centre - clip, centre + clip


@dataclass
class TrainStats:
    """What :meth:`TrainStep.read` reads back after the last minibatch of a ``train()`` call.

    ``means``: each of :data:`STAT_NAMES` averaged over all updates; ``recent_approx_kl``: ``approx_kl`` averaged over
    the last ``recent`` updates (the last epoch, which is what ``train/approx_kl`` logs); ``first_bad``: the index
    of the first update whose loss was not finite (None when all were); that update and all later ones were skipped.
    """

    means: dict[str, float]
    recent_approx_kl: float
    first_bad: int | None


def graph_obstacles(model: MemoryPPO) -> list[str]:
    """Why ``model``'s minibatch updates cannot be replayed from a CUDA graph (empty: they can)."""
    reasons = []
    if model.device.type != "cuda":
        reasons.append(f"the model is on {model.device}, not a CUDA device")
    optimizer = model.policy.optimizer
    if not fused_adam(optimizer):
        groups = optimizer.param_groups
        reasons.append(
            f"the optimizer is {type(optimizer).__name__} with fused={[g.get('fused') for g in groups]}, "
            f"capturable={[g.get('capturable') for g in groups]}: the graph needs torch.optim.Adam or AdamW with "
            "fused=True (optimizer_kwargs=dict(eps=1e-5, fused=True), --fused-adam), whose found_inf input skips the "
            "update of a non-finite loss inside the graph (the unfused capturable Adam refuses found_inf)")
    if model.target_kl is not None:
        reasons.append(f"target_kl={model.target_kl} is set: its early stop reads approx_kl on the host after every "
                       "minibatch")
    return reasons


class TrainStep:
    """The minibatch updates of one :class:`~rlseq.algos.ppo.MemoryPPO` ``train()`` call, eager or from a CUDA graph.

    :param model: the MemoryPPO; its ``ppo_losses``, ``policy``, ``policy.optimizer`` (torch Adam/AdamW with
        ``fused=True``), ``max_grad_norm``, ``ent_coef``, ``vf_coef`` and ``normalize_advantage`` define the update.
    :param cuda_graph: capture the update in a CUDA graph after :attr:`N_WARMUP` eager warm-up updates and replay it
        (CUDA only). Without it the same update runs eagerly.

    Per ``train()`` call: :meth:`begin` (learning rate and clip ranges into their device tensors, flag cleared),
    :meth:`update` once per minibatch, :meth:`end` (the optimizer's float learning rate back), then :meth:`read`
    (the one host read). Every minibatch passed to :meth:`update` is applied exactly once: the warm-up updates are
    real updates, and the minibatch used to capture is replayed (capture does not execute).

    The graph is captured again when a parameter, a buffer or an optimizer state tensor moves (``load``,
    ``set_parameters``), when the minibatch shapes change, or when a constant baked into it changes (``ent_coef``,
    ``vf_coef``, ``max_grad_norm``, ``normalize_advantage``, Adam's betas/eps/weight decay, TF32 switches). If the
    capture raises, :meth:`update` raises a ``RuntimeError`` with the cause: an aborted capture can leave the
    process's CUDA state (the generator's graph bookkeeping) unusable for later captures, so going on eagerly in the
    same process is not safe (measured on an H100: the acting graph's random draws failed afterwards). The
    parameters are those of the updates before it; the run's last checkpoint is intact.
    """

    N_WARMUP = 2

    def __init__(self, model: MemoryPPO, *, cuda_graph: bool = False):
        self.model = model
        self.policy = model.policy
        self.device = model.device
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"a CUDA-graph train step needs the model on a CUDA device; it is on {self.device}")
        if not fused_adam(self.policy.optimizer):
            raise ValueError("TrainStep needs torch.optim.Adam or AdamW with fused=True: its found_inf input skips the "
                             f"update of a non-finite loss (got {type(self.policy.optimizer).__name__})")
        self.cuda_graph = cuda_graph
        kw = dict(dtype=torch.float32, device=self.device)
        self._adam = GraphAdam(self.device)  # the learning-rate tensors and the skip flag of the optimizer
        self._clip = ClipRange(1.0, self.device)
        self._clip_vf: ClipRange | None = None
        # 1.0 once a loss was non-finite in this train() call: the optimizer's skip flag (float32, 0-dim: fused Adam
        # subtracts it from its 0-dim step counts)
        self._bad = torch.zeros((), **kw)
        self._batch: SequenceBatch | None = None  # the static minibatch buffers
        self._layout: tuple | None = None
        self._log: torch.Tensor | None = None  # [n_updates, len(STAT_NAMES) + 1] of this call
        self._row = 0
        self._out: torch.Tensor | None = None  # the graph's static output: [len(STAT_NAMES) + 1]
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_key: tuple | None = None
        self._warmups = 0  # warm-up updates done for the current key
        # one side stream for every warm-up (torch's recipe): the autograd engine records the stream a parameter's
        # gradient accumulator was made on, and a fresh stream per warm-up would not match it
        self._side = torch.cuda.Stream(self.device) if cuda_graph else None

    # --- per train() call ---------------------------------------------------------------------------------

    def begin(self, clip_range: float, clip_range_vf: float | None, n_updates: int) -> None:
        """Start a ``train()`` call of ``n_updates`` minibatch updates: the optimizer's learning rates (the floats
        SB3's schedule just set) and the clip ranges go into their device tensors, the flag is cleared."""
        if self._adam.attach(self.policy.optimizer, self._bad):
            self._graph = None  # it reads the old learning-rate tensors
        self._clip.fill(clip_range)
        if clip_range_vf is None:
            self._clip_vf = None
        else:
            if self._clip_vf is None:
                self._clip_vf = ClipRange(0.0, self.device)
            self._clip_vf.fill(clip_range_vf)
        self._bad.zero_()
        self._log = torch.zeros(n_updates, len(STAT_NAMES) + 1, dtype=torch.float32, device=self.device)
        self._row = 0
        if self._graph is not None and self._key() != self._graph_key:
            self._graph, self._warmups = None, 0  # something it reads moved, or a constant it baked in changed

    def update(self, batch: SequenceBatch) -> None:
        """Apply one minibatch (``[B, T, ...]`` sequences as :meth:`SequenceRolloutBuffer.minibatches` yields them):
        copied into the static buffers, then replayed from the graph, captured, a warm-up or an eager update."""
        if self._log is None or self._row >= len(self._log):
            raise RuntimeError("TrainStep.update() outside begin()/end(), or more updates than begin() was told")
        self._stage(batch)
        if not self.cuda_graph:
            out = self._eager_update()
        elif self._graph is not None:
            self._graph.replay()
            out = self._out
        elif self._warmups < self.N_WARMUP:
            out = self._warmup_update()
            self._warmups += 1
        else:
            out = self._capture()
        self._log[self._row].copy_(out)  # one small copy: the statistics stay on the device until read()
        self._row += 1

    def end(self) -> None:
        """Give the optimizer back its float learning rates and no skip flag (what the eager loop and checkpoints
        expect). Safe to call more than once, and after an error in :meth:`update`."""
        self._adam.detach()

    def read(self, recent: int) -> TrainStats:
        """The statistics of this call's updates, with ONE host read (the means, the flag and each update's loss
        finiteness together). ``recent``: how many of the last updates ``recent_approx_kl`` averages."""
        assert self._log is not None
        log = self._log[: self._row]
        # a contiguous column per statistic: the same reduction the eager loop applies to its stacked scalars
        means = [log[:, j].contiguous().mean() for j in range(len(STAT_NAMES))]
        kl = log[-recent:, STAT_NAMES.index("approx_kl")].contiguous().mean()
        host = torch.cat([torch.stack([*means, kl]), log[:, _FINITE]]).tolist()
        finite = host[len(means) + 1:]
        first_bad = next((k for k, f in enumerate(finite) if f != 1.0), None)
        return TrainStats(dict(zip(STAT_NAMES, host[: len(means)])), host[len(means)], first_bad)

    # --- the update -------------------------------------------------------------------------------------------

    def _update(self) -> torch.Tensor:
        """Loss, backward, clipping and the Adam step on the static minibatch; no host syncs (captured as is).
        Returns ``[len(STAT_NAMES) + 1]``: the statistics, then ``isfinite(loss)``."""
        model, optimizer = self.model, self.policy.optimizer
        losses = model.ppo_losses(self._batch, self._clip, self._clip_vf)
        loss = losses["loss"]
        finite = torch.isfinite(loss)
        # sticky: once set, every later update of this call is skipped, as the eager loop stops at the bad one
        torch.maximum(self._bad, (~finite).float(), out=self._bad)
        loss.backward()
        # non-finite gradients give a NaN norm and NaN gradients; harmless: Adam skips them, the next backward
        # overwrites them
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), model.max_grad_norm)
        optimizer.step()  # fused Adam: does nothing (steps included) when its skip flag (self._bad) is 1
        return torch.stack([*(losses[name].detach().float() for name in STAT_NAMES[:-1]), grad_norm.detach().float(),
                            finite.float()])

    def _eager_update(self) -> torch.Tensor:
        self.policy.optimizer.zero_grad(set_to_none=True)
        return self._update()

    def _warmup_update(self) -> torch.Tensor:
        """An eager update on a side stream (torch's recipe before a capture: cuBLAS/cuDNN handles, Triton
        compilation and autotuning, Adam's lazily made state all happen outside the capture)."""
        current, side = torch.cuda.current_stream(self.device), self._side
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = self._eager_update()
        current.wait_stream(side)
        return out

    def _capture(self) -> torch.Tensor:
        """Capture the update of the staged minibatch and replay it (capture does not execute)."""
        optimizer = self.policy.optimizer
        optimizer.zero_grad(set_to_none=True)  # backward makes .grad in the graph's pool; replays overwrite them
        graph = torch.cuda.CUDAGraph()
        try:
            with GraphAdam.capturing(optimizer), torch.cuda.graph(graph):
                out = self._update()
        except Exception as err:
            raise RuntimeError(
                f"capturing the PPO minibatch update of the {self.policy.memory.name} memory in a CUDA graph failed "
                f"({type(err).__name__}: {err}); rerun with MemoryPPO(..., cuda_graph_train=False) or "
                "--no-cuda-graph-train (--resume continues from the last checkpoint)") from err
        self._graph, self._out, self._graph_key = graph, out, self._key()
        graph.replay()
        return out

    # --- staging --------------------------------------------------------------------------------------------

    def _stage(self, batch: SequenceBatch) -> None:
        """Copy ``batch`` into the static buffers (made, and the graph dropped, when the shapes change)."""
        layout = _layout(batch)
        if layout != self._layout:
            self._batch = _map_batch(batch, torch.empty_like)
            self._layout, self._graph, self._warmups = layout, None, 0
        _map_batch(self._batch, lambda dst, src: dst.copy_(src), batch)

    def _key(self) -> tuple:
        """What the captured graph depends on besides the staged data: tensor addresses and baked-in constants."""
        model, optimizer = self.model, self.policy.optimizer
        state = [t.data_ptr() for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        hyper = [(g["betas"], g["eps"], g["weight_decay"], g["amsgrad"], g["maximize"], g["decoupled_weight_decay"])
                 for g in optimizer.param_groups]
        return (id(optimizer), tuple(p.data_ptr() for p in self.policy.parameters()),
                tuple(b.data_ptr() for b in self.policy.buffers()), tuple(state), tuple(map(str, hyper)),
                model.ent_coef, model.vf_coef, model.max_grad_norm, model.normalize_advantage, self._clip_vf is None,
                self.policy.amp_dtype, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def _tensors(batch: SequenceBatch) -> dict[str, torch.Tensor]:
    """The tensors of ``batch`` by name (dict observations as ``observations.<key>``)."""
    out = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, dict):
            out.update({f"{field.name}.{k}": v for k, v in value.items()})
        else:
            out[field.name] = value
    return out


def _layout(batch: SequenceBatch) -> tuple:
    return tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in _tensors(batch).items())


def _map_batch(batch: SequenceBatch, fn, other: SequenceBatch | None = None) -> SequenceBatch:
    """``fn(x)`` (or ``fn(x, y)`` with the matching tensor ``y`` of ``other``) for every tensor of ``batch``."""
    kwargs = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        peer = getattr(other, field.name) if other is not None else None
        if isinstance(value, dict):
            kwargs[field.name] = {k: fn(v) if other is None else fn(v, peer[k]) for k, v in value.items()}
        else:
            kwargs[field.name] = fn(value) if other is None else fn(value, peer)
    return SequenceBatch(**kwargs)
