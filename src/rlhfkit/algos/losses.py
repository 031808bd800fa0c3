"""Training losses: the reward model's pairwise loss and PPO's clipped policy and value losses.

The policy loss also covers the critic-free variants (DAPO clip-higher, dual-clip, GSPO sequence ratios) and
the ways of reducing a per-token loss to a scalar (``aggregate``).

The causal-LM (SFT / PPO-ptx) loss lives in ``logprobs.lm_loss_sum``.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .masked import masked_mean, masked_sum


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


def _token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, max_len: Optional[int]) -> torch.Tensor:
    # Every valid token weighs the same, so long responses dominate (DAPO's choice, Yu et al. 2025, sec. 3.3).
    return masked_mean(loss_mat, mask)


def _seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, max_len: Optional[int]) -> torch.Tensor:
    # Every sequence weighs the same (original GRPO, Shao et al. 2024, eq. 3); rows with no valid token are
    # left out of the mean over rows.
    row_means = masked_mean(loss_mat, mask, dim=-1)  # (B,)
    return masked_mean(row_means, mask.bool().any(dim=-1))


def _kept_rows(mask: torch.Tensor) -> torch.Tensor:
    # rows with at least one valid token; a row with none was left out of the update (a filtered group, a
    # masked truncated response), so it is not counted in a mean over rows either (0 rows: divide by 1)
    return mask.bool().any(dim=-1).sum().clamp(min=1)


def _seq_mean_token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, max_len: Optional[int]) -> torch.Tensor:
    # Sum over a row's tokens, mean over the rows that have valid tokens.
    return masked_sum(loss_mat, mask) / _kept_rows(mask)


def _seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, mask: torch.Tensor, max_len: Optional[int]
) -> torch.Tensor:
    # Dr.GRPO (Liu et al. 2025, sec. 3.1): a constant denominator per row, so no length bias in either direction.
    if max_len is None or max_len <= 0:
        raise ValueError(f"aggregation 'seq-mean-token-sum-norm' needs a positive max_len, got {max_len}")
    return masked_sum(loss_mat, mask) / (_kept_rows(mask) * max_len)


_AGGREGATORS: Dict[str, Callable[[torch.Tensor, torch.Tensor, Optional[int]], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
AGGREGATIONS: Tuple[str, ...] = tuple(_AGGREGATORS)


def _aggregator(mode: str) -> Callable[[torch.Tensor, torch.Tensor, Optional[int]], torch.Tensor]:
    try:
        return _AGGREGATORS[mode]
    except KeyError:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid modes: {list(AGGREGATIONS)}") from None


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", max_len: Optional[int] = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over valid tokens.

    Modes:
      ``"token-mean"``: sum over all valid tokens / number of valid tokens (``masked_mean``);
      ``"seq-mean-token-mean"``: mean over rows of each row's mean over its valid tokens (rows with no valid
      token are excluded; 0 if no row has one);
      ``"seq-mean-token-sum"``: mean over rows of each row's sum over its valid tokens;
      ``"seq-mean-token-sum-norm"``: sum over all valid tokens / (rows * max_len) (Dr.GRPO, Liu et al. 2025).
    Rows with no valid token (left out of the update) are not counted in any of them.

    Args:
        loss_mat: ``(B, T)`` per-token loss; values at masked positions are ignored (even NaN).
        mask: ``(B, T)`` 1 on valid response tokens.
        mode: one of ``AGGREGATIONS``.
        max_len: the constant length normaliser, required by ``"seq-mean-token-sum-norm"`` only (typically the
            maximum response length of the rollout config, not of the batch, so it does not vary per batch).

    Returns:
        Scalar tensor.
    """
    return _aggregator(mode)(loss_mat, mask, max_len)


def _token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logp - old_logp  # (B, T)


def _sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # GSPO (Zheng et al. 2025, eq. 7 and 10): s_i = exp(mean_t log(pi / pi_old)), and per token
    # s_i,t = sg[s_i] * pi_t / sg[pi_t]: the value is the sequence ratio, the gradient flows through each logp_t.
    seq_log_ratio = masked_mean(logp - old_logp, mask, dim=-1).detach()  # (B,)
    return seq_log_ratio.unsqueeze(-1) + logp - logp.detach()  # (B, T)


_RATIO_LEVELS: Dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    *,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    ratio_level: str = "token",
    log_ratio_clamp: Optional[float] = None,
    aggregation: str = "token-mean",
    max_len: Optional[int] = None,
    weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO clipped surrogate objective (Schulman et al. 2017, eq. 7), negated to be minimised.

    loss = aggregate over valid tokens of max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)),
    ratio = pi / pi_old. Taking the max of the negated terms is the pessimistic bound: once the ratio has moved
    past the clip in the direction the advantage favours, the gradient is zero. The defaults give plain PPO:
    token-level ratio, symmetric clip, mean over all valid tokens.

    Variants used by critic-free methods:
      * ``clip_eps_high`` (DAPO clip-higher, Yu et al. 2025, sec. 3.1): a wider upper clip so low-probability
        tokens can still grow, which keeps entropy from collapsing.
      * ``dual_clip`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5): for
        A < 0 the loss is also capped at -A * dual_clip, so a huge ratio on a bad token cannot blow up the loss.
      * ``ratio_level="sequence"`` (GSPO, Zheng et al. 2025): one length-normalised ratio per sequence,
        exp(mean over valid tokens of log(pi / pi_old)), shared by all its tokens.
      * ``log_ratio_clamp``: the log-ratio that goes into exp (per token, or per sequence for GSPO) is clamped
        to [-c, c] to avoid overflow; verl uses 20. The gradient is zero where the clamp is active.

    Args:
        logp: ``(B, T)`` log-probabilities of the taken tokens under the current policy (with grad).
        old_logp: ``(B, T)`` the same under the policy that generated the rollout.
        advantages: ``(B, T)`` advantage estimates (whitened GAE, or broadcast group advantages).
        mask: ``(B, T)`` 1 on valid response tokens; masked positions are ignored even if they hold NaN.
        clip_eps: the clip range epsilon (the lower one when ``clip_eps_high`` is set).
        clip_eps_high: upper clip range; None means ``clip_eps``.
        dual_clip: the dual-clip constant c > 1; None disables it.
        ratio_level: ``"token"`` (PPO) or ``"sequence"`` (GSPO).
        log_ratio_clamp: bound c > 0 on the log-ratio before exp; None disables it.
        aggregation: how per-token losses become a scalar; one of ``AGGREGATIONS`` (see ``aggregate``).
        max_len: the normaliser for ``aggregation="seq-mean-token-sum-norm"``.
        weights: ``(B, T)`` per-token weights of the loss, or None: truncated importance sampling's
            min(pi_old / pi_sampler, cap) where another engine sampled the tokens (``rollout/sync_check.py``).
            They scale each token's clipped term (constants: no gradient), before aggregation.

    Returns:
        ``(loss, stats)``: a scalar tensor and Python floats
        ``clip_fraction`` (share of valid tokens where the clipped term was strictly larger, i.e. clipping was
        active), ``approx_kl`` (mean over valid tokens of the k2 estimator 0.5 * (logp - old_logp)^2 of
        KL(pi_old || pi), per token whatever ``ratio_level``; see http://joschu.net/blog/kl-approx.html) and,
        when ``dual_clip`` is set, ``dual_clip_fraction`` (share of valid tokens where the cap was active).
        The stats are always token means, whatever ``aggregation``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if log_ratio_clamp is not None and log_ratio_clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be > 0, got {log_ratio_clamp}")
    try:
        ratio_fn = _RATIO_LEVELS[ratio_level]
    except KeyError:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid levels: {list(_RATIO_LEVELS)}") from None
    reduce = _aggregator(aggregation)

    # Zero masked positions first so garbage there (even NaN) cannot reach a valid token (GSPO's row mean)
    # or turn into NaN gradients at masked positions (0 * NaN in exp's backward).
    valid = mask.bool()
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    old_logp = torch.where(valid, old_logp, torch.zeros_like(old_logp))
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))

    log_ratio = ratio_fn(logp, old_logp, mask)  # (B, T)
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    upper = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + upper)
    loss_mat = torch.max(unclipped, clipped)  # (B, T)
    if dual_clip is not None:
        cap = -advantages * dual_clip  # only binds for A < 0, where it is positive
        capped = (advantages < 0) & (loss_mat > cap)
        loss_mat = torch.where(advantages < 0, torch.min(loss_mat, cap), loss_mat)
    if weights is not None:
        loss_mat = loss_mat * torch.where(valid, weights.detach(), torch.zeros_like(weights)).to(loss_mat.dtype)
    loss = reduce(loss_mat, mask, max_len)

    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).to(logp.dtype), mask).item(),
            "approx_kl": masked_mean(0.5 * (logp - old_logp) ** 2, mask).item(),
        }
        if dual_clip is not None:
            stats["dual_clip_fraction"] = masked_mean(capped.to(logp.dtype), mask).item()
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
