"""Critic-free advantages: group baselines over n samples per prompt, and REINFORCE++ discounted returns.

Group sampling lays a batch out as ``n`` consecutive samples per prompt: rows ``[g*n, (g+1)*n)`` of a ``(B,)``
score vector belong to prompt ``g``, so ``B`` must be a multiple of ``n``. Every function here returns tensors
without gradient: advantages and returns are targets, not something to differentiate through.
"""

from __future__ import annotations

import torch


def _as_float(scores: torch.Tensor) -> torch.Tensor:
    """Detached floating-point copy; verifier rewards often arrive as bool or int."""
    scores = scores.detach()
    return scores if scores.is_floating_point() else scores.to(torch.get_default_dtype())


def group_view(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Reshape per-sample scores into one row per prompt.

    Args:
        scores: ``(B,)`` one score per sample, ``n`` consecutive samples per prompt.
        n: samples per prompt.

    Returns:
        ``(G, n)`` with ``G = B // n`` (a view of ``scores``).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (B,), got shape {tuple(scores.shape)}")
    if n < 1:
        raise ValueError(f"samples per prompt n must be >= 1, got {n}")
    if scores.numel() % n != 0:
        raise ValueError(
            f"batch size {scores.numel()} is not divisible by samples per prompt n={n}; "
            "the batch must hold n consecutive samples for every prompt"
        )
    return scores.view(-1, n)


def _require_two_samples(n: int, name: str) -> None:
    # With one sample the group baseline is the sample itself (and its std undefined): no learning signal.
    if n < 2:
        raise ValueError(f"{name} needs at least 2 samples per prompt to form a baseline, got n={n}")


def _judged_groups(scores: torch.Tensor, n: int, judged: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(G, n) scores, (G, n) 1.0 on judged samples, (G, 1) judged count k and (G, 1) mean of the judged scores."""
    groups = group_view(_as_float(scores), n)
    weight = group_view(judged.to(groups.dtype), n)
    k = weight.sum(dim=1, keepdim=True)
    return groups, weight, k, (groups * weight).sum(dim=1, keepdim=True) / k.clamp(min=1)


def grpo_advantages(
    scores: torch.Tensor, n: int, scale_by_std: bool = True, eps: float = 1e-6, judged: torch.Tensor | None = None
) -> torch.Tensor:
    """GRPO outcome advantages, A_i = (r_i - mean(r_group)) / (std(r_group) + eps).

    Shao et al. 2024, "DeepSeekMath", section 4.1.2 (outcome supervision). The std is the unbiased sample std
    (divides by n - 1), torch's default and what TRL and verl use. ``scale_by_std=False`` is Dr.GRPO
    (Liu et al. 2025, "Understanding R1-Zero-Like Training"), which drops the division because it up-weights
    prompts that are nearly always solved or nearly always failed.

    Args:
        scores: ``(B,)`` outcome score of each sample, ``n`` consecutive samples per prompt.
        n: samples per prompt, at least 2.
        scale_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std; a group of equal scores then gets 0 advantages, not NaN.
        judged: ``(B,)`` bool, the samples the reward judged (None: all): each group's mean and std are over its
            k judged samples only, and the others get 0 (a group with one judged sample: 0 everywhere).

    Returns:
        ``(B,)`` advantages, without gradient. The caller broadcasts them to tokens (``broadcast_to_tokens``).
    """
    _require_two_samples(n, "grpo")
    if judged is not None:
        groups, weight, k, mean = _judged_groups(scores, n, judged)
        centred = (groups - mean) * weight
        if scale_by_std:
            std = ((centred ** 2).sum(dim=1, keepdim=True) / (k - 1).clamp(min=1)).sqrt()
            centred = centred / (std + eps)
        return centred.reshape(-1)
    groups = group_view(_as_float(scores), n)  # (G, n)
    centred = groups - groups.mean(dim=1, keepdim=True)  # (G, n)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(scores: torch.Tensor, n: int, judged: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out advantages, A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r_group)).

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs", eq. 6. Leaving the sample out keeps the baseline independent of r_i, so the gradient
    estimate stays unbiased.

    Args:
        scores: ``(B,)`` outcome score of each sample, ``n`` consecutive samples per prompt.
        n: samples per prompt, at least 2.
        judged: ``(B,)`` bool, the samples the reward judged (None: all): the others are left out of every
            baseline (k judged samples: k / (k - 1) * (r_i - their mean)) and get 0, as does a lone judged one.

    Returns:
        ``(B,)`` advantages, without gradient.
    """
    _require_two_samples(n, "rloo")
    if judged is not None:
        groups, weight, k, mean = _judged_groups(scores, n, judged)
        factor = torch.where(k > 1, k / (k - 1).clamp(min=1), torch.zeros_like(k))
        return (factor * (groups - mean) * weight).reshape(-1)
    groups = group_view(_as_float(scores), n)  # (G, n)
    return (n / (n - 1) * (groups - groups.mean(dim=1, keepdim=True))).reshape(-1)


def group_baseline(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Scores minus their group mean, r_i - mean(r_group).

    The first step of REINFORCE++-baseline (Hu 2025, "REINFORCE++"): subtract the per-prompt mean, then the
    caller whitens over the whole batch. With n = 1 every result is 0.

    Args:
        scores: ``(B,)`` outcome score of each sample, ``n`` consecutive samples per prompt.
        n: samples per prompt.

    Returns:
        ``(B,)`` centred scores, without gradient.
    """
    groups = group_view(_as_float(scores), n)  # (G, n)
    return (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)


def group_filter_mask(scores: torch.Tensor, n: int, atol: float = 0.0) -> torch.Tensor:
    """Which samples to keep under DAPO dynamic sampling: those whose group's scores are not all equal.

    Yu et al. 2025, "DAPO", section 3.2: a group where every sample got the same reward has zero group-relative
    advantage and so contributes no gradient; dropping it keeps the effective batch informative.

    Args:
        scores: ``(B,)`` outcome score of each sample, ``n`` consecutive samples per prompt.
        n: samples per prompt.
        atol: a group counts as all-equal when max - min <= atol.

    Returns:
        ``(B,)`` bool, True for samples of groups to keep (the same value for all ``n`` rows of a group).
    """
    groups = group_view(_as_float(scores), n)  # (G, n)
    spread = groups.max(dim=1).values - groups.min(dim=1).values  # (G,)
    return (spread > atol).repeat_interleave(n)


def per_group(fn, scores: torch.Tensor, group: torch.Tensor, n: int, judged: torch.Tensor | None = None,
              **kwargs) -> torch.Tensor:
    """`fn(scores in groups of n consecutive rows, n, **kwargs)` (a function of this module) for rows in any order:
    the rows are put in group order, `fn` applied, and its results put back in the batch's order.

    Args:
        scores: ``(B,)`` one score per sample.
        group: ``(B,)`` the prompt index of each row; each index appears on ``n`` rows.
        n: samples per prompt.
        judged: ``(B,)`` bool, where some row is unjudged: passed to ``fn`` in the same order.

    Returns:
        ``(B,)`` ``fn``'s per-row result, in the order of ``scores``.
    """
    order = torch.argsort(group.to(scores.device), stable=True)
    if judged is not None and not bool(judged.all()):
        kwargs["judged"] = judged.to(scores.device)[order]
    out = torch.empty_like(scores)
    out[order] = fn(scores[order], n, **kwargs)
    return out


def broadcast_to_tokens(values_per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each row's value on every valid token of that row (outcome advantages are per sequence).

    Args:
        values_per_row: ``(B,)`` one value per sequence.
        mask: ``(B, R)`` 1 on valid response tokens (bool or float).

    Returns:
        ``(B, R)`` in the dtype of ``values_per_row``; 0 at masked positions.
    """
    values = values_per_row.unsqueeze(-1).expand(mask.shape)  # (B, R)
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Monte-Carlo returns G_t = r_t + gamma * G_{t+1} over the valid tokens of each row.

    REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models")
    uses these as token advantages: rewards are the outcome score on the last valid token minus beta * KL at
    every token (``shape_rewards``), and the returns are then whitened over the batch (``masked_whiten``).

    As in ``compute_gae``, masked positions are transparent: the carried G_{t+1} passes through them
    unchanged and they are 0 in the output, so holes and padding give the result of the unpadded sequence.
    The episode ends at the last valid token (G after it is 0).

    Args:
        rewards: ``(B, R)`` per-token rewards; values at masked positions are ignored (even NaN).
        mask: ``(B, R)`` 1 on valid response tokens (bool or float).
        gamma: discount factor.

    Returns:
        ``(B, R)`` returns, 0 at masked positions, without gradient.
    """
    valid = mask.bool()
    rewards = rewards.detach()
    zeros = torch.zeros_like(rewards)
    rewards = torch.where(valid, rewards, zeros)  # garbage at masked positions never enters the sum

    carried = zeros[:, 0]  # (B,) G of the next valid token; 0 past the end of the episode
    returns_reversed = []
    for t in reversed(range(rewards.size(1))):
        g = rewards[:, t] + gamma * carried
        carried = torch.where(valid[:, t], g, carried)
        returns_reversed.append(torch.where(valid[:, t], g, zeros[:, t]))
    return torch.stack(returns_reversed[::-1], dim=1)
