"""Advantage estimators, looked up by name (`ppo.advantage_estimator`).

An estimator turns a batch carrying scores and per-token rewards (`experience.add_rewards`: the score on the last
valid token, -beta * KL on every token) into advantages and returns, both (B, R) and 0 on masked positions.
Its entry says what it needs and how its advantages are normalised afterwards:
- `critic`: values V(s_t) from a value model in `batch.values` (only GAE; the others load no critic at all);
- `row_local`: a row's advantages need only that row, so a critic's values may come micro-batch by
  micro-batch, fused with its update;
- `group`: it compares the `ppo.n_samples_per_prompt` responses of one prompt (rows sharing `batch.group`);
- `whiten`: "config" (over the valid tokens of all ranks when `ppo.whiten_advantages`), "global" (the same,
  always: REINFORCE++), "none" (the group statistics already normalise: GRPO, RLOO).

Outcome scores are clipped to `ppo.score_clip` first, as in the shaped reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlhfkit.algos import compute_gae, last_valid_index
from rlhfkit.algos.group import (broadcast_to_tokens, discounted_returns, group_baseline, grpo_advantages,
                                 rloo_advantages)
from rlhfkit.config.ppo_schema import PPOSection
from rlhfkit.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class Estimator:
    name: str
    advantages: Callable[[RolloutBatch, PPOSection], tuple[torch.Tensor, torch.Tensor]]
    critic: bool  # needs batch.values from a value model
    row_local: bool  # a row's advantages need only that row's rewards (and values)
    group: bool  # compares the samples of one prompt
    whiten: str  # "config", "global" or "none"
    doc: str


def clipped_scores(batch: RolloutBatch, cfg: PPOSection) -> torch.Tensor:
    scores = batch.scores.float()
    return scores.clamp(-cfg.score_clip, cfg.score_clip) if cfg.score_clip is not None else scores


def per_group(fn, scores: torch.Tensor, group: torch.Tensor, n: int, judged: torch.Tensor | None = None,
              **kwargs) -> torch.Tensor:
    """`fn(scores in groups of n consecutive rows, n, **kwargs)` for rows in any order: rows are put in group order,
    the function applied, and the results put back in the batch's order. `judged` (B,) bool, where some row is
    unjudged: passed to `fn` in the same order."""
    order = torch.argsort(group.to(scores.device), stable=True)
    if judged is not None and not bool(judged.all()):
        kwargs["judged"] = judged.to(scores.device)[order]
    out = torch.empty_like(scores)
    out[order] = fn(scores[order], n, **kwargs)
    return out


def gae(batch: RolloutBatch, cfg: PPOSection) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the shaped rewards, with the critic's values (ppo.gamma, ppo.lam)."""
    return compute_gae(batch.rewards, batch.values, batch.response_mask, cfg.gamma, cfg.lam)


def grpo(batch: RolloutBatch, cfg: PPOSection) -> tuple[torch.Tensor, torch.Tensor]:
    """(r - group mean) / (group std + eps) on every response token (ppo.grpo_scale_by_std=false: Dr.GRPO's
    r - group mean)."""
    adv = per_group(grpo_advantages, clipped_scores(batch, cfg), batch.group, cfg.n_samples_per_prompt, batch.judged,
                    scale_by_std=cfg.grpo_scale_by_std)
    tokens = broadcast_to_tokens(adv, batch.response_mask)
    return tokens, tokens


def rloo(batch: RolloutBatch, cfg: PPOSection) -> tuple[torch.Tensor, torch.Tensor]:
    """r - the mean of the other n - 1 samples of the prompt, on every response token."""
    adv = per_group(rloo_advantages, clipped_scores(batch, cfg), batch.group, cfg.n_samples_per_prompt, batch.judged)
    tokens = broadcast_to_tokens(adv, batch.response_mask)
    return tokens, tokens


def reinforce_pp(batch: RolloutBatch, cfg: PPOSection) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted returns of the shaped rewards (score - beta * KL per token), ppo.gamma; whitened globally."""
    returns = discounted_returns(batch.rewards, batch.response_mask, cfg.gamma)
    return returns, returns


def reinforce_pp_baseline(batch: RolloutBatch, cfg: PPOSection) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with the prompt's group mean subtracted from the score before the returns."""
    scores = clipped_scores(batch, cfg)
    baseline = scores - per_group(group_baseline, scores, batch.group, cfg.n_samples_per_prompt)  # group means
    last = last_valid_index(batch.response_mask)  # (B,) where the score sits in the shaped reward
    rewards = batch.rewards.clone()
    rewards[torch.arange(batch.size, device=rewards.device), last] -= baseline.to(rewards.dtype)
    returns = discounted_returns(rewards, batch.response_mask, cfg.gamma)
    return returns, returns


ESTIMATORS = {
    "gae": Estimator("gae", gae, critic=True, row_local=True, group=False, whiten="config",
                     doc="GAE (Schulman et al. 2016) with the critic's values: PPO as in InstructGPT"),
    "grpo": Estimator("grpo", grpo, critic=False, row_local=False, group=True, whiten="none",
                      doc="GRPO (Shao et al. 2024): the score standardised within its prompt's group"),
    "rloo": Estimator("rloo", rloo, critic=False, row_local=False, group=True, whiten="none",
                      doc="RLOO (Ahmadian et al. 2024): the score minus the mean of the prompt's other samples"),
    "reinforce_pp": Estimator("reinforce_pp", reinforce_pp, critic=False, row_local=True, group=False,
                              whiten="global", doc="REINFORCE++ (Hu 2025): KL-shaped discounted returns, "
                                                   "whitened over the global batch"),
    "reinforce_pp_baseline": Estimator("reinforce_pp_baseline", reinforce_pp_baseline, critic=False,
                                       row_local=False, group=True, whiten="global",
                                       doc="REINFORCE++ with the prompt's group mean as the score's baseline"),
}
