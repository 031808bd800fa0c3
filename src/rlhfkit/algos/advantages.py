"""Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
Generalized Advantage Estimation", eq. 16)."""

from __future__ import annotations

from typing import Tuple

import torch


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and value targets for a batch of token sequences.

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   returns_t = A_t + V_t.

    Masked positions are transparent: the recursion carries V_{t+1} and A_{t+1} straight through them, so
    right padding after EOS, left padding and holes all give the same result as the unpadded sequence. The
    episode ends at the last valid token, where V_{t+1} = 0 and A_{t+1} = 0.

    Args:
        rewards: ``(B, T)`` per-token rewards (e.g. from ``shape_rewards``).
        values: ``(B, T)`` critic values V(s_t) at each token.
        mask: ``(B, T)`` 1 on valid response tokens, 0 elsewhere (bool or float).
        gamma: discount factor.
        lam: GAE lambda; 1 gives Monte-Carlo returns, 0 gives one-step TD.

    Returns:
        ``(advantages, returns)``, both ``(B, T)`` and 0 at masked positions. Neither carries gradient.
    """
    valid = mask.bool()
    zeros = torch.zeros_like(values)
    # Zero first so that garbage at masked positions (even NaN) cannot enter any delta.
    rewards = torch.where(valid, rewards.to(values.dtype), zeros).detach()
    values = torch.where(valid, values, zeros).detach()

    T = rewards.size(1)
    next_value = zeros[:, 0]  # (B,) V of the next valid token; 0 past the end of the episode
    next_advantage = zeros[:, 0]  # (B,)
    advantages_reversed = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # Only valid tokens advance the recursion; masked ones pass the carried state through unchanged.
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        advantages_reversed.append(torch.where(valid[:, t], advantage, zeros[:, t]))
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = torch.where(valid, advantages + values, zeros)
    return advantages, returns
