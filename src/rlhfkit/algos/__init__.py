"""Pure torch math for RLHF: masking, log-probs, KL, GAE, reward shaping and losses.

Imports only torch: no configs, no torch.distributed, no I/O.
"""

from .advantages import compute_gae
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from .logprobs import entropy_from_logits, lm_loss_sum, token_logprobs
from .losses import pairwise_loss, policy_loss, value_loss
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .rewards import last_valid_index, shape_rewards

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "compute_gae",
    "entropy_from_logits",
    "kl_penalty",
    "last_valid_index",
    "lm_loss_sum",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_loss",
    "policy_loss",
    "shape_rewards",
    "token_logprobs",
    "value_loss",
]
