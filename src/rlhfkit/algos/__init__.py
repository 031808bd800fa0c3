"""Pure torch math for RLHF: masking, log-probs, KL, GAE, group advantages, reward shaping and losses.

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
    rloo_advantages,
)
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from .logprobs import entropy_from_logits, lm_loss_sum, token_logprobs
from .losses import AGGREGATIONS, aggregate, pairwise_loss, policy_loss, value_loss
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .rewards import last_valid_index, shape_rewards

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "broadcast_to_tokens",
    "compute_gae",
    "discounted_returns",
    "entropy_from_logits",
    "group_baseline",
    "group_filter_mask",
    "group_view",
    "grpo_advantages",
    "kl_penalty",
    "last_valid_index",
    "lm_loss_sum",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_loss",
    "policy_loss",
    "rloo_advantages",
    "shape_rewards",
    "token_logprobs",
    "value_loss",
]
