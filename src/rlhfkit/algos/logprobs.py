"""Per-token log-probabilities, entropy and the summed causal-LM loss from logits.

Logits are ``(B, T, V)`` with V up to ~256k, so a full ``(B, T, V)`` float32 copy can dominate memory. The
functions below avoid materialising one where they can.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

_FULL_PRECISION = (torch.float32, torch.float64)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] for every position.

    Args:
        logits: ``(B, T, V)``, already aligned with ``labels`` (the caller shifts).
        labels: ``(B, T)`` integer token ids.

    Returns:
        ``(B, T)`` log-probabilities, float32 (or float64 for float64 logits).
    """
    if logits.dtype in _FULL_PRECISION:
        # log p(y) = z_y - logsumexp(z): only (B, T) outputs, no (B, T, V) log-softmax copy.
        picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    # bf16/fp16 logsumexp loses too much precision for PPO ratios; upcast one row at a time so the float32
    # copy is (T, V), not (B, T, V).
    rows = []
    for row_logits, row_labels in zip(logits, labels):
        row_logp = F.log_softmax(row_logits.float(), dim=-1)
        rows.append(torch.gather(row_logp, -1, row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at every position.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, which avoids log(0) for tiny probabilities.

    Args:
        logits: ``(B, T, V)``.

    Returns:
        ``(B, T)`` entropies in nats.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def lm_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> Tuple[torch.Tensor, int]:
    """Summed token negative log-likelihood and the number of tokens it covers.

    Returning the sum (not the mean) lets the SFT loop divide by the token count of the whole accumulated
    batch, so micro-batch 1 x accumulation 8 equals micro-batch 8 x accumulation 1.

    Args:
        logits: ``(B, T, V)``, already aligned with ``labels`` (the caller shifts).
        labels: ``(B, T)`` integer token ids; ``ignore_index`` marks positions without a loss.
        ignore_index: label value to skip (prompt tokens, padding).

    Returns:
        ``(nll_sum, n_tokens)``: a scalar tensor and a Python int.
    """
    vocab = logits.size(-1)
    # Upcast as Hugging Face models do for their own loss: a bf16 cross-entropy is noticeably off.
    nll_sum = F.cross_entropy(
        logits.reshape(-1, vocab).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    n_tokens = int((labels != ignore_index).sum().item())
    return nll_sum, n_tokens
