"""Pure torch math for RLHF: masking, log-probs, KL, GAE, group advantages, reward shaping and losses (PPO,
the reward model's, and the DPO family's).

Imports only torch: no configs, no torch.distributed, no I/O.
"""

from .advantages import compute_gae
from .group import (
    broadcast_to_tokens,
    discounted_returns,
    group_baseline,
    group_filter_mask,
    group_view,
    grpo_advantages,
    per_group,
    rloo_advantages,
)
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from .logprobs import (entropy_from_logits, linear_lm_loss_sum, linear_token_logprobs, lm_loss_sum,
                       token_logprobs)
from .losses import AGGREGATIONS, aggregate, pairwise_loss, policy_loss, value_loss
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .preference import PairLogps, cdpo_loss, dpo_loss, ipo_loss, nll_term, simpo_loss
from .rewards import last_valid_index, shape_rewards

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "PairLogps",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "broadcast_to_tokens",
    "cdpo_loss",
    "compute_gae",
    "discounted_returns",
    "dpo_loss",
    "entropy_from_logits",
    "group_baseline",
    "group_filter_mask",
    "group_view",
    "grpo_advantages",
    "ipo_loss",
    "kl_penalty",
    "last_valid_index",
    "linear_lm_loss_sum",
    "linear_token_logprobs",
    "lm_loss_sum",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "nll_term",
    "pairwise_loss",
    "per_group",
    "policy_loss",
    "rloo_advantages",
    "shape_rewards",
    "simpo_loss",
    "token_logprobs",
    "value_loss",
]
