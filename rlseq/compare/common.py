"""Names every step of :mod:`rlseq.compare` shares: the tags it reads, the column layout, the error type and
how a variant name (``<memory>[-<tag>]``) splits and sorts."""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_METRIC = "rollout/ep_rew_mean"
THROUGHPUT_TAGS = ("time/env_steps_per_s", "time/fps")  # first one present wins
DIAGNOSTIC_TAGS = (
    "memory/gate_saturated_frac",
    "memory/key_norm_max",
    "memory/state_norm_max",
    "memory/nonfinite_events",
)
# what --save-scalars keeps besides every rollout/, memory/ and time/ tag: enough to redo every figure and table
# the y-axis label of each diagnostics panel
DIAGNOSTIC_LABELS = {
    "memory/gate_saturated_frac": "fraction of gates > 0.99",
    "memory/key_norm_max": "largest key norm",
    "memory/state_norm_max": "largest memory-state norm",
    "memory/nonfinite_events": "non-finite events so far",
}
SAVED_TRAIN_TAGS = ("train/value_target_abs_mean", "train/value_target_abs_max", "train/explained_variance",
                    "train/entropy_loss", "train/value_loss", "train/approx_kl", "train/clip_fraction",
                    "train/grad_norm")
LOG_SCALE_TAGS = frozenset({"memory/key_norm_max", "memory/state_norm_max"})
COLUMNS = ["env", "variant", "seed", "step", "tag", "value"]
MEMORY_ORDER = ("efla", "deltanet", "lstm", "none")  # tables and legends list these first, in this order
LAYOUT_HELP = (
    "expected layout: RUNS_DIR/<env>/<memory>[-<tag>]/seed<N>/events.out.tfevents.* "
    "(RUNS_DIR may also be runs/, runs/<env>/<variant> or one seed folder)"
)


class CompareError(RuntimeError):
    """A user-facing problem with the input (missing folder, no runs, unknown metric)."""


def _base_memory(variant: str) -> str:
    return variant.split("-", 1)[0]


def _tag(variant: str) -> str:
    return variant.split("-", 1)[1] if "-" in variant else ""


def variant_order(variants: Iterable[str]) -> list[str]:
    """efla, deltanet, lstm, none first (each followed by its tagged variants), then the rest sorted."""
    def key(v: str) -> tuple[int, str, int, str]:
        base = _base_memory(v)
        rank = MEMORY_ORDER.index(base) if base in MEMORY_ORDER else len(MEMORY_ORDER)
        return rank, base, int(v != base), v

    return sorted(set(variants), key=key)
