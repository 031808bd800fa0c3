"""Per-token rewards for PPO on language models.

InstructGPT (Ouyang et al. 2022, eq. 2) and Ziegler et al. 2019 use R(x, y) = r(x, y) - beta * KL: the
reward model's sequence-level score arrives on the final response token, and the KL penalty against the
reference model is paid at every token.
"""

from __future__ import annotations

from typing import Optional, Union

import torch


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row.

    Works for right padding (the 1s are a prefix), left padding (a suffix) and any other pattern, unlike
    ``mask.sum(-1) - 1`` which is only right for right padding.

    Args:
        mask: ``(B, T)`` 0/1, bool or float.

    Returns:
        ``(B,)`` long; 0 for a row with no 1s.
    """
    positions = torch.arange(mask.size(-1), device=mask.device)
    return (positions * mask.bool().long()).max(dim=-1).values


def shape_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    score_clip: Optional[Union[float, int]] = None,
) -> torch.Tensor:
    """Combine sequence scores and per-token KL into per-token rewards.

    Args:
        scores: ``(B,)`` reward-model score of each sequence.
        kl: ``(B, T)`` per-token KL estimate (e.g. ``kl_penalty(..., "k1")``).
        mask: ``(B, T)`` 1 on valid response tokens.
        kl_coef: KL coefficient beta (e.g. a KL controller's ``.value``).
        score_clip: if given, scores are clamped to ``[-score_clip, score_clip]`` first.

    Returns:
        ``(B, T)``: ``-kl_coef * kl`` on valid tokens, plus the score on each row's last valid token; 0 at
        masked positions. A row with no valid token gets no score.
    """
    valid = mask.bool()
    rewards = torch.where(valid, -kl_coef * kl, torch.zeros_like(kl))
    scores = scores.to(rewards.dtype)
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    scores = torch.where(valid.any(dim=-1), scores, torch.zeros_like(scores))
    # scatter_add (not in-place indexing) keeps the function out-of-place and autograd-friendly.
    return rewards.scatter_add(-1, last_valid_index(mask).unsqueeze(-1), scores.unsqueeze(-1))
