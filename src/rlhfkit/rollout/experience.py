"""Experience making: the forwards over prompt + response, the shaped rewards and the advantages.

InstructGPT's objective (Ouyang et al. 2022, eq. 2) as a per-token reward: the sequence score r(x, y) on the
last valid response token and -beta * KL(pi || pi_ref) on every token (Ziegler et al. 2019, section 2).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from rlhfkit.accel import grad_in_place
from rlhfkit.algos.rewards import last_valid_index
from rlhfkit.algos import (entropy_from_logits, kl_penalty, linear_token_logprobs, masked_mean, masked_whiten,
                           shape_rewards, token_logprobs)
from rlhfkit.config.ppo_schema import PPOSection
from rlhfkit.accel.cpu_linear import packed_weights
from rlhfkit.models.forward import (causal_logits, final_hidden, head_logprobs_weight, head_matmul, mixed_precision,
                                    packed_outputs, position_ids, read_packed, token_scores)
from rlhfkit.models.prefix import common_prefix_outputs, shared_prefix_logits
from rlhfkit.lora import adapter_disabled
from rlhfkit.rollout.batch import RolloutBatch


def response_logits(model, batch: RolloutBatch, plan, temperature: float = 1.0) -> torch.Tensor:
    """(B, R, V) logits predicting each response token, divided by the sampling temperature, on the paths of
    `model`'s speed plan.

    The behaviour policy that sampled the tokens is softmax(z / T), so pi_old, pi and pi_ref are all taken
    at the same T (as TRL and OpenRLHF do); otherwise the ratio and the KL compare different distributions.
    Only the last R + 1 positions go through the LM head: the prompt's logits are never needed. Rows that
    share a prompt (a group of samples) compute it once (`shared_prefix_logits`, `plan.shared_prompt`), and so do
    the tokens that every row begins with (`common_prefix_outputs`, `plan.common_prefix`).
    """
    logits = None
    if batch.groups_share_prompts:  # every rank's batch is one of groups: all take the same two forwards
        logits = shared_prefix_logits(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                      batch.response_attended, plan, always=True)
    width = batch.response_ids.size(1)
    if logits is None:  # the tokens every row begins with (a chat template's system prompt) computed once
        logits = common_prefix_outputs(model, batch.input_ids[:, :-1], batch.attention_mask[:, :-1], width, plan,
                                       kind="logits")
    if logits is None:  # one forward over prompt + response
        logits = causal_logits(model, batch.input_ids, batch.attention_mask, keep=width + 1)
        # position P - 1 + j predicts response token j: the kept positions P - 1 .. P + R - 1, less the last
        logits = logits[:, -(width + 1):-1]
    return logits / temperature if temperature != 1.0 else logits


def response_hidden(model, batch: RolloutBatch, plan) -> torch.Tensor:
    """(B, R, H) the hidden states the LM head reads to predict each response token (the positions of
    `response_logits`), the head run on one position per forward; on the paths of `model`'s speed plan."""
    hidden = None
    if batch.groups_share_prompts:
        hidden = shared_prefix_logits(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                      batch.response_attended, plan, always=True, hidden=True)
    if hidden is None:  # the tokens every row begins with once, where that computes fewer tokens than packing
        hidden = common_prefix_outputs(model, batch.input_ids[:, :-1], batch.attention_mask[:, :-1],
                                       batch.response_ids.size(1), plan)
    if hidden is None and plan.padding_free:  # the response's padding after EOS and the prompts' costs nothing
        flat, where = packed_outputs(model, batch.input_ids, batch.attention_mask, plan)
        hidden = read_packed(flat, where[:, batch.prompt_width - 1:-1])
    if hidden is None:
        width = batch.response_ids.size(1)
        mask = batch.attention_mask
        hidden = final_hidden(model, batch.input_ids, mask, position_ids(mask))[:, -(width + 1):-1]
    return hidden


def response_logprobs_and_entropy(model, batch: RolloutBatch, plan, temperature: float = 1.0,
                                  entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) log-probabilities of the sampled response tokens and (B, R) entropies of the policy there (without
    a gradient; zeros unless `entropy`), on the paths of `model`'s speed plan.

    Where the plan runs the LM head in chunks (`forward.head_logprobs_weight`), it runs on the valid response
    positions only (`algos.linear_token_logprobs`): no (B, R, V) logits, their log-softmax or their gradient are
    held, and padding after EOS costs no head compute; positions outside `response_mask` hold 0. Else from the
    model's own logits (`response_logits`)."""
    weight = head_logprobs_weight(model, plan)
    if weight is None:
        logits = response_logits(model, batch, plan, temperature)
        logp = token_logprobs(logits, batch.response_ids)
        with torch.no_grad():
            ent = entropy_from_logits(logits).float() if entropy else torch.zeros_like(logp)
        return logp, ent
    valid = batch.response_mask.bool()
    hidden = response_hidden(model, batch, plan)[valid]  # (K, H)
    with mixed_precision(plan):  # the head at the forward's precision
        logp, ent = linear_token_logprobs(hidden, weight, batch.response_ids[valid], temperature, entropy=entropy,
                                          linear=head_matmul(model),
                                          grad_target=grad_in_place.target if plan.grad_in_place else None)
    full = torch.zeros(valid.shape, dtype=logp.dtype, device=logp.device)
    return full.masked_scatter(valid, logp), full.detach().masked_scatter(valid, ent)


def response_logprobs(model, batch: RolloutBatch, plan, temperature: float = 1.0) -> torch.Tensor:
    """(B, R) log-probabilities of the sampled response tokens (`response_logprobs_and_entropy`)."""
    return response_logprobs_and_entropy(model, batch, plan, temperature, entropy=False)[0]


def response_values(critic, batch: RolloutBatch, plan) -> torch.Tensor:
    """(B, R) critic values of the state before each response token (same columns as the logits); padding-free
    where the critic's plan says so (`plan.padding_free`; then 0 where the state is padding); the tokens every
    row begins with computed once where it says so (`prefix.common_prefix_outputs`)."""
    values = common_prefix_outputs(critic, batch.input_ids[:, :-1], batch.attention_mask[:, :-1],
                                   batch.response_ids.size(1), plan, kind="scores")
    if values is not None:
        return values
    if plan.padding_free:
        flat, where = packed_outputs(critic, batch.input_ids, batch.attention_mask, plan, scores=True)
        return read_packed(flat, where[:, batch.prompt_width - 1:-1])
    return token_scores(critic, batch.input_ids, batch.attention_mask)[:, batch.prompt_width - 1:-1]


def length_sorted_chunks(batch: RolloutBatch, size: int, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """`rows` (default: all) in groups of `size`, by increasing valid length (prompt + response).

    Rows of similar length share a micro-batch, so `RolloutBatch.select` trims nearly all of its padding:
    a left-padded batch is as wide as its longest prompt plus its longest response, and padding costs as
    much compute as real tokens. Any grouping gives the same per-row results (positions come from the mask).
    With groups (`batch.group`), the rows of one prompt stay next to each other (groups in order of their
    longest row), so a micro-batch holds whole groups and computes each prompt once (`shared_prefix_logits`).
    """
    rows = torch.arange(batch.size) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    lengths = (batch.prompt_mask.sum(-1) + batch.response_attended.sum(-1)).cpu()[rows]
    group = None if batch.group is None else batch.group.cpu()[rows]
    if group is None or group.unique().numel() == group.numel():  # no two rows of one prompt
        return list(rows[torch.argsort(lengths, stable=True)].split(size))
    longest = {}
    for g, n in zip(group.tolist(), lengths.tolist()):
        longest[g] = max(longest.get(g, 0), n)
    order = sorted(range(len(rows)), key=lambda i: (longest[int(group[i])], int(group[i]), int(lengths[i])))
    return list(rows[torch.tensor(order, dtype=torch.long)].split(size))


def sort_by_length(batch: RolloutBatch) -> RolloutBatch:
    """The rows in order of increasing valid length, so that consecutive rows (the micro-batches of the
    reward model, for one) carry little padding between them."""
    return batch.select(length_sorted_chunks(batch, batch.size)[0], trim=False)


@torch.no_grad()
def per_token(batch: RolloutBatch, micro_batch_size: int, fn) -> torch.Tensor:
    """(B, R) `fn(part) -> (b, r)` over length-sorted, trimmed micro-batches, scattered back in row order;
    0 on masked positions, so nothing after EOS can leak into a sum or a later comparison."""
    out = torch.zeros_like(batch.response_mask)
    for rows in length_sorted_chunks(batch, micro_batch_size):
        part = batch.select(rows)
        index = rows.to(out.device)
        out[index, :part.response_ids.size(1)] = fn(part).to(out.dtype)
    return torch.where(batch.response_mask.bool(), out, torch.zeros_like(out))


def reference_logprobs(batch: RolloutBatch, reference, actor, plan, temperature: float, micro: int) -> torch.Tensor:
    """(B, R) log pi_ref, on the paths of the reference's speed plan; `reference=None` means the actor with its LoRA
    adapter disabled (no second copy)."""
    model = actor if reference is None else reference
    adapter = adapter_disabled(actor) if reference is None else contextlib.nullcontext()
    with adapter, packed_weights(model, plan.onednn_linear):  # oneDNN's weight layout once for all micro-batches
        return per_token(batch, micro, lambda part: response_logprobs(model, part, plan, temperature))


def add_model_outputs(batch: RolloutBatch, actor, critic, reference, plans, temperature: float,
                      micro_batch_size: int, old_from_sampling: bool = False, timer=None) -> RolloutBatch:
    """Old log-probs (actor), reference log-probs and values: one no-grad forward each, in micro-batches, each
    model on the paths of its speed plan (`plans[role]`, roles "actor", "critic", "reference").

    With `old_from_sampling` the log-probs recorded while sampling (`sample_logprobs`, taken at the same
    temperature) are the old log-probs and the actor runs no forward at all. `reference=None` means the
    actor with its LoRA adapter disabled is the reference; `critic=None` skips the values. `timer(phase)`,
    when given, times each forward.
    """
    timer = timer or (lambda _phase: contextlib.nullcontext())
    if old_from_sampling:
        old = torch.where(batch.response_mask.bool(), batch.sample_logprobs, torch.zeros_like(batch.response_mask))
    else:
        with timer("old_logprobs"):
            old = per_token(batch, micro_batch_size,
                            lambda part: response_logprobs(actor, part, plans["actor"], temperature))
    with timer("reference"):
        ref = reference_logprobs(batch, reference, actor, plans["reference"], temperature, micro_batch_size)
    values = None
    if critic is not None:  # None: the values come with the critic's update (stages/ppo_update.py)
        with timer("values"):
            values = per_token(batch, micro_batch_size, lambda part: response_values(critic, part, plans["critic"]))
    return replace(batch, old_logprobs=old, ref_logprobs=ref, values=values)


def ended_with_eos(batch: RolloutBatch, eos_ids: list[int]) -> torch.Tensor:
    """(B,) bool: the response stopped by itself (its last valid token is an EOS; an episode's: its last turn's)."""
    last = last_valid_index(batch.response_mask)
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


def add_rewards(batch: RolloutBatch, scores: torch.Tensor, kl_coef: float, cfg: PPOSection) -> RolloutBatch:
    """Per-token KL and rewards (the score on the last valid token, -kl_coef * KL on every token)."""
    mask = batch.response_mask
    kl = torch.where(mask.bool(), kl_penalty(batch.old_logprobs, batch.ref_logprobs, cfg.kl_estimator,
                                             clamp=cfg.kl_clamp), torch.zeros_like(mask))
    return replace(batch, scores=scores, kl=kl, rewards=shape_rewards(scores, kl, mask, kl_coef, cfg.score_clip))


def kl_rows(batch: RolloutBatch, kept: torch.Tensor | None = None) -> torch.Tensor:
    """(K,) the summed per-token KL (`add_rewards`) of each row, nats per sequence. `kept` (B,) bool: only the rows
    the update keeps (the others' masks are zero, and counting them would understate the KL)."""
    per_row = (batch.kl * batch.response_mask).sum(-1)
    return per_row[kept.to(per_row.device)] if kept is not None else per_row


def kl_per_sequence(batch: RolloutBatch, kept: torch.Tensor | None = None) -> float:
    """This rank's mean of `kl_rows`: what the adaptive KL controller targets; 0 when no row is kept."""
    per_row = kl_rows(batch, kept)
    return per_row.mean().item() if per_row.numel() else 0.0


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor, engine, eps: float = 1e-8) -> torch.Tensor:
    """`masked_whiten` with the mean and (unbiased) variance of the valid elements of every rank's batch."""
    valid = mask.bool()
    count = engine.reduce_sum(float(valid.sum()))
    mean = engine.reduce_sum(float(torch.where(valid, x, torch.zeros_like(x)).sum())) / max(count, 1.0)
    centred = torch.where(valid, x - mean, torch.zeros_like(x))
    var = engine.reduce_sum(float((centred ** 2).sum())) / max(count - 1, 1.0)
    return torch.where(valid, centred / (var + eps) ** 0.5, torch.zeros_like(x))


def finish_advantages(batch: RolloutBatch, advantages: torch.Tensor, returns: torch.Tensor, cfg: PPOSection,
                      whiten: str = "config", engine=None):
    """Store advantages and returns, the advantages whitened as the estimator says (`estimators.Estimator`):
    "config" when `ppo.whiten_advantages`, "global" always, "none" never; over the valid tokens of every rank's
    batch (`engine`; without one, this batch's), so N ranks whiten as one process would. Returns (batch,
    metrics before whitening)."""
    mask = batch.response_mask
    metrics = {
        "return/mean": masked_mean(returns, mask).item(),
        **({"value/mean": masked_mean(batch.values, mask).item()} if batch.values is not None else {}),
        "advantage/mean": masked_mean(advantages, mask).item(),
    }
    if whiten == "global" or (whiten == "config" and cfg.whiten_advantages):
        advantages = whiten_over_ranks(advantages, mask, engine) if engine is not None and engine.world_size > 1 \
            else masked_whiten(advantages, mask)
    return replace(batch, advantages=advantages, returns=returns), metrics


def add_advantages(batch: RolloutBatch, scores: torch.Tensor, kl_coef: float, cfg: PPOSection):
    """Per-token rewards, then the advantages and returns of `cfg.advantage_estimator` (GAE: `batch` carries the
    critic's values). Returns (batch, metrics before whitening, with the KL per sequence)."""
    estimator = cfg.estimator()
    batch = add_rewards(batch, scores, kl_coef, cfg)
    advantages, returns = estimator.advantages(batch, cfg)
    batch, metrics = finish_advantages(batch, advantages, returns, cfg, estimator.whiten)
    return batch, {"kl": kl_per_sequence(batch), **metrics}
