"""Reductions over the valid (mask == 1) elements of a tensor.

Every PPO statistic is taken over valid response tokens only: prompt tokens, left padding and everything after
EOS must not count. Masked positions are selected away with ``torch.where`` rather than multiplied by zero, so
garbage there (even ``inf``/``NaN``) cannot leak into a result or its gradient.
"""

from __future__ import annotations

from typing import Optional

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is 1.

    Args:
        x: any shape, e.g. ``(B, T)``.
        mask: same shape as ``x``; 0/1, bool or float.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.
    """
    valid = torch.where(mask.bool(), x, torch.zeros_like(x))
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 (not NaN) where nothing is valid.

    Args:
        x: any shape, e.g. ``(B, T)``.
        mask: same shape as ``x``; 0/1, bool or float.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    # The sum is 0 wherever the count is 0, so clamping the count turns 0/0 into 0 instead of NaN.
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Scalar variance of ``x`` over positions where ``mask`` is 1.

    Args:
        x: any shape, e.g. ``(B, T)``.
        mask: same shape as ``x``; 0/1, bool or float.
        unbiased: divide by ``n - 1`` (Bessel) instead of ``n``. With fewer than two valid elements the
            divisor is clamped to 1, so the result is 0 rather than NaN/inf.
    """
    mean = masked_mean(x, mask)
    sq_dev_sum = masked_sum((x - mean) ** 2, mask)
    n = masked_sum(torch.ones_like(x), mask)
    divisor = n - 1 if unbiased else n
    return sq_dev_sum / divisor.clamp(min=1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to mean 0 and (unbiased) variance 1 over its valid elements.

    Whitening advantages over valid tokens keeps the policy-gradient scale steady across batches
    (standard in PPO implementations; Ouyang et al. 2022 and Ziegler et al. 2019 codebases do the same).

    Args:
        x: any shape, e.g. advantages ``(B, T)``.
        mask: same shape as ``x``; 0/1, bool or float.
        shift_mean: if False the mean is added back, i.e. only the scale is normalised (used for rewards,
            where the sign of the mean carries information).
        eps: added to the variance before the square root.

    Returns:
        Same shape as ``x``; masked positions are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
