"""Training algorithms. :class:`MemoryPPO`: PPO for memory policies, trained on whole rollouts."""

from rlseq.algos.ppo import MemoryPPO

__all__ = ["MemoryPPO"]
