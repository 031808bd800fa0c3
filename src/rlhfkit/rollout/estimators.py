"""Advantage estimators, looked up by name (`ppo.advantage_estimator`).

An estimator turns a batch carrying per-token rewards (`experience.add_rewards`) into advantages and returns,
both (B, R) and 0 on masked positions, before any whitening. Its entry says what it needs: `critic` (values
V(s_t) from a value model in `batch.values`) and `row_local` (a row's advantages depend on that row alone, so
the critic's values may come micro-batch by micro-batch, fused with the critic's update). A critic-free
estimator (GRPO's group baseline, RLOO, REINFORCE++) is one more entry with `critic=False`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlhfkit.algos import compute_gae
from rlhfkit.config.ppo_schema import PPOSection
from rlhfkit.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class Estimator:
    name: str
    advantages: Callable[[RolloutBatch, PPOSection], tuple[torch.Tensor, torch.Tensor]]
    critic: bool  # needs batch.values from a value model
    row_local: bool  # a row's advantages need only that row's rewards (and values)
    doc: str


def gae(batch: RolloutBatch, cfg: PPOSection) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the shaped rewards, with the critic's values (ppo.gamma, ppo.lam)."""
    return compute_gae(batch.rewards, batch.values, batch.response_mask, cfg.gamma, cfg.lam)


ESTIMATORS = {
    "gae": Estimator("gae", gae, critic=True, row_local=True,
                     doc="GAE (Schulman et al. 2016) with the critic's values: PPO as in InstructGPT"),
}
