"""Experience making: the forwards over prompt + response, the shaped rewards and GAE advantages.

InstructGPT's objective (Ouyang et al. 2022, eq. 2) as a per-token reward: the sequence score r(x, y) on the
last valid response token and -beta * KL(pi || pi_ref) on every token (Ziegler et al. 2019, section 2).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rlhfkit.algos import compute_gae, kl_penalty, masked_mean, masked_whiten, shape_rewards, token_logprobs
from rlhfkit.config.ppo_schema import PPOSection
from rlhfkit.models.forward import causal_logits, token_scores
from rlhfkit.models.lora import adapter_disabled
from rlhfkit.rollout.batch import RolloutBatch


def response_logits(model, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """(B, R, V) logits predicting each response token, divided by the sampling temperature.

    The behaviour policy that sampled the tokens is softmax(z / T), so pi_old, pi and pi_ref are all taken
    at the same T (as TRL and OpenRLHF do); otherwise the ratio and the KL compare different distributions.
    """
    logits = causal_logits(model, batch.input_ids, batch.attention_mask)
    # column P - 1 + j predicts response token j
    logits = logits[:, batch.prompt_width - 1:-1]
    return logits / temperature if temperature != 1.0 else logits


def response_logprobs(model, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """(B, R) log-probabilities of the sampled response tokens."""
    return token_logprobs(response_logits(model, batch, temperature), batch.response_ids)


def response_values(critic, batch: RolloutBatch) -> torch.Tensor:
    """(B, R) critic values of the state before each response token (same columns as the logits)."""
    return token_scores(critic, batch.input_ids, batch.attention_mask)[:, batch.prompt_width - 1:-1]


@torch.no_grad()
def add_model_outputs(batch: RolloutBatch, actor, critic, reference, temperature: float,
                      micro_batch_size: int) -> RolloutBatch:
    """Old log-probs (actor), reference log-probs and values: one forward each, in micro-batches.

    `reference=None` means the actor with its LoRA adapter disabled is the reference (no second copy).
    """
    old, ref, values = [], [], []
    for start in range(0, batch.size, micro_batch_size):
        rows = list(range(start, min(start + micro_batch_size, batch.size)))
        part = batch.select(rows, trim=False)
        old.append(response_logprobs(actor, part, temperature))
        if reference is None:
            with adapter_disabled(actor):
                ref.append(response_logprobs(actor, part, temperature))
        else:
            ref.append(response_logprobs(reference, part, temperature))
        values.append(response_values(critic, part))
    mask = batch.response_mask.bool()
    zero = torch.zeros_like(batch.response_mask)
    # masked positions hold 0, so nothing after EOS can leak into a sum or a later comparison
    return replace(batch, old_logprobs=torch.where(mask, torch.cat(old), zero),
                   ref_logprobs=torch.where(mask, torch.cat(ref), zero),
                   values=torch.where(mask, torch.cat(values), zero))


def ended_with_eos(batch: RolloutBatch, eos_ids: list[int]) -> torch.Tensor:
    """(B,) bool: the response stopped by itself (its last valid token is an EOS)."""
    last = (batch.response_lengths.long() - 1).clamp(min=0)
    last_tokens = batch.response_ids.gather(1, last[:, None]).squeeze(1)
    return torch.isin(last_tokens, torch.tensor(eos_ids, device=last_tokens.device))


def adjust_scores(raw: torch.Tensor, finished: torch.Tensor, cfg: PPOSection, stats: dict | None) -> torch.Tensor:
    """(B,) scores after optional normalisation with the RM's stored mean/std and the missing-EOS penalty
    (clipping happens in shape_rewards)."""
    scores = raw.float()
    if cfg.normalize_reward and stats is not None:
        scores = (scores - stats["mean"]) / max(stats["std"], 1e-6)
    if cfg.missing_eos_penalty is not None:
        # a response cut off at max_new_tokens is penalised, so the policy learns to finish (TRL's option)
        scores = torch.where(finished, scores, scores - cfg.missing_eos_penalty)
    return scores


def add_advantages(batch: RolloutBatch, scores: torch.Tensor, kl_coef: float, cfg: PPOSection):
    """Per-token rewards, GAE advantages and returns. Returns (batch, metrics before whitening)."""
    mask = batch.response_mask
    kl = torch.where(mask.bool(), kl_penalty(batch.old_logprobs, batch.ref_logprobs, cfg.kl_estimator),
                     torch.zeros_like(mask))
    rewards = shape_rewards(scores, kl, mask, kl_coef, cfg.score_clip)
    advantages, returns = compute_gae(rewards, batch.values, mask, cfg.gamma, cfg.lam)
    metrics = {
        "kl": (kl * mask).sum(-1).mean().item(),  # nats per sequence, what the KL controller targets
        "return/mean": masked_mean(returns, mask).item(),
        "value/mean": masked_mean(batch.values, mask).item(),
        "advantage/mean": masked_mean(advantages, mask).item(),
    }
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return replace(batch, scores=scores, kl=kl, rewards=rewards, advantages=advantages, returns=returns), metrics
