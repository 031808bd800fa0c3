"""The sampler/trainer check and correction: proof on every iteration that a separate rollout engine samples from the
weights being trained, and truncated importance sampling for what remains of the gap.

Where the sampler is not the trained module itself (rollout.engine=vllm), the old log-probs come from a trainer
forward and the sampler reports its own log-probs of the same tokens. With the weights synced the two agree to
rounding (float32 on a CPU: ~4e-5 nats mean; bf16 on a GPU: ~1e-2); a sync that failed or was skipped, or a template,
tokenizer or dtype that differs, shows as a gap. `logprob_gap` measures it over every rank's valid tokens and
`check_gap` stops the run past `rollout.sync_max_gap` with the likely causes.

TIS (truncated importance sampling; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"): the tokens were drawn by the sampler pi_sampler, the PPO ratio refers to the trainer's pi_old, so each
token's loss is weighed by min(pi_old / pi_sampler, cap).
"""

from __future__ import annotations

import torch

from rlhfkit.errors import RunError


def logprob_gap(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, tolerance: float,
                engine) -> dict:
    """rollout/logprob_gap_mean, _max (|trainer - sampler| over the valid tokens of every rank) and
    rollout/logprob_beyond (the share of them beyond `tolerance`); (B, R) inputs, `mask` 1 on valid tokens."""
    valid = mask.bool()
    gap = (trainer.detach().float() - sampler.detach().float()).abs()[valid]
    count = engine.reduce_sum(float(gap.numel()))
    total = engine.reduce_sum(float(gap.double().sum()))
    beyond = engine.reduce_sum(float((gap > tolerance).sum()))
    largest = engine.reduce_max(float(gap.max()) if gap.numel() else 0.0)
    return {"rollout/logprob_gap_mean": total / count if count else 0.0, "rollout/logprob_gap_max": largest,
            "rollout/logprob_beyond": beyond / count if count else 0.0}


def check_gap(metrics: dict, bound: float | None, tolerance: float, iteration: int, engine_name: str) -> None:
    """A RunError when the iteration's mean gap is past `bound` (None: log only). Every rank holds the same pooled
    metrics, so every rank stops together."""
    mean = metrics["rollout/logprob_gap_mean"]
    if bound is None or mean <= bound:
        return
    raise RunError(
        f"rollout: at iteration {iteration} the {engine_name} engine's log-probs of its sampled tokens differ from "
        f"the trainer's by {mean:.3g} nats on average (max {metrics['rollout/logprob_gap_max']:.3g}; "
        f"{metrics['rollout/logprob_beyond']:.1%} of tokens beyond rollout.sync_tolerance={tolerance}), past "
        f"rollout.sync_max_gap={bound}: the engine is not sampling from the policy being trained. Likely causes: "
        f"the weights did not reach the engine (a sync that failed or was skipped, or parameter names it did not "
        f"load); a chat template or tokenizer that differs between the trainer and the engine; a dtype gap (the "
        f"engine in bf16 or float16 while the trainer computes in float32; see engine.precision). To train anyway, "
        f"raise rollout.sync_max_gap (or set it to null to log only)")


def tis_weights(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """(B, R) min(exp(trainer - sampler), cap) on valid tokens, 0 elsewhere: the truncated importance weight of
    each sampled token, pi_old / pi_sampler."""
    ratio = torch.exp((trainer - sampler).float()).clamp(max=cap)
    return torch.where(mask.bool(), ratio, torch.zeros_like(ratio))


def tis_metrics(weights: torch.Tensor, mask: torch.Tensor, cap: float, engine) -> dict:
    """rollout/tis_mean, _min, _max and rollout/tis_capped (share of valid tokens at the cap), over every rank."""
    valid = mask.bool()
    w = weights[valid].double()
    count = engine.reduce_sum(float(w.numel()))
    mean = engine.reduce_sum(float(w.sum())) / count if count else 1.0
    capped = engine.reduce_sum(float((w >= cap).sum())) / count if count else 0.0
    low = -engine.reduce_max(-float(w.min()) if w.numel() else -1.0)
    high = engine.reduce_max(float(w.max()) if w.numel() else 1.0)
    return {"rollout/tis_mean": mean, "rollout/tis_min": low, "rollout/tis_max": high, "rollout/tis_capped": capped}
