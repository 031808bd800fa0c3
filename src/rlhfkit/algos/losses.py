"""Training losses: the reward model's pairwise loss and PPO's clipped policy and value losses.

The causal-LM (SFT / PPO-ptx) loss lives in ``logprobs.lm_loss_sum``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .masked import masked_mean


def pairwise_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: Optional[Union[torch.Tensor, float]] = None,
) -> torch.Tensor:
    """Bradley-Terry preference loss, mean of -log sigmoid(r_chosen - r_rejected - margin).

    Ouyang et al. 2022, eq. 1; the optional margin is Llama 2's (Touvron et al. 2023, eq. 2), which asks for a
    larger gap on pairs labelled as clearly better.

    Args:
        chosen: ``(B,)`` rewards of the preferred responses.
        rejected: ``(B,)`` rewards of the other responses.
        margin: ``(B,)`` tensor, a float, or None (no margin).

    Returns:
        Scalar loss. ``F.logsigmoid`` stays finite for large negative gaps where log(sigmoid(.)) would not.
    """
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO clipped surrogate objective (Schulman et al. 2017, eq. 7), negated to be minimised.

    loss = mean over valid tokens of max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)), ratio = pi / pi_old.
    Taking the max of the negated terms is the pessimistic bound: once the ratio has moved past the clip in the
    direction the advantage favours, the gradient is zero.

    Args:
        logp: ``(B, T)`` log-probabilities of the taken tokens under the current policy (with grad).
        old_logp: ``(B, T)`` the same under the policy that generated the rollout.
        advantages: ``(B, T)`` advantage estimates (usually whitened GAE).
        mask: ``(B, T)`` 1 on valid response tokens.
        clip_eps: the clip range epsilon.

    Returns:
        ``(loss, stats)``: a scalar tensor and Python floats
        ``clip_fraction`` (share of valid tokens where the clipped term was strictly larger, i.e. clipping was
        active) and ``approx_kl`` (mean over valid tokens of the k2 estimator 0.5 * (logp - old_logp)^2 of
        KL(pi_old || pi); see http://joschu.net/blog/kl-approx.html).
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).to(logp.dtype), mask).item(),
            "approx_kl": masked_mean(0.5 * log_ratio**2, mask).item(),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: Optional[float] = 0.2,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Clipped value loss, 0.5 * mean over valid tokens of max((V - R)^2, (V_clip - R)^2).

    V_clip = V_old + clip(V - V_old, -eps, eps). Value clipping is the one from the PPO reference code
    (OpenAI baselines ppo2) as used for language models by Ziegler et al. 2019; it keeps the critic from moving
    far from the values the advantages were computed with.

    Args:
        values: ``(B, T)`` current critic values (with grad).
        old_values: ``(B, T)`` critic values recorded during the rollout.
        returns: ``(B, T)`` value targets (GAE returns).
        mask: ``(B, T)`` 1 on valid response tokens.
        clip_eps: clip range in value units; None disables clipping.

    Returns:
        ``(loss, stats)``: a scalar tensor and ``{"value_clip_fraction": float}`` (share of valid tokens where
        the clipped error was strictly larger; 0.0 when clipping is disabled).
    """
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * masked_mean(unclipped, mask), {"value_clip_fraction": 0.0}
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).to(values.dtype), mask).item()
    return loss, {"value_clip_fraction": clip_fraction}
