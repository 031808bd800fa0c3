"""Step 4 of a PPO iteration, "optimise": actor and critic on one rollout (and the PPO-ptx text mixed in).

Losses are normalised by the valid tokens of the whole mini-batch over all ranks (`engine.total`), not per
micro-batch, so one optimizer step is the same for micro-batch 1 x accumulation k and micro-batch k x
accumulation 1, on one rank or many.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import torch

from rlhfkit.algos import (aggregate, entropy_from_logits, kl_penalty, lm_loss_sum, masked_mean, policy_loss,
                           token_logprobs, value_loss)
from rlhfkit.config.ppo_schema import PPOConfig, PPOSection
from rlhfkit.data.readers import read_rows
from rlhfkit.data.tokenize import collate_sft
from rlhfkit.errors import DataError, where
from rlhfkit.models.forward import causal_logits
from rlhfkit.registry.estimators import ESTIMATORS, Estimator
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.rollout.experience import (finish_advantages, length_sorted_chunks, response_logits,
                                       response_logprobs_and_entropy, response_values)
from rlhfkit.stages.ppo_timing import untimed


def loss_count(mask: torch.Tensor, aggregation: str, max_len: int) -> float:
    """What a policy-loss aggregation averages over, in a (micro-)batch: valid tokens (token-mean), responses
    (seq-mean-*), or responses x the longest response (Dr.GRPO's constant normaliser). The loss of a micro-batch
    times its count is its share of the sum that the whole step divides by the global count."""
    if aggregation == "token-mean":
        return mask.sum().item()
    rows = float((mask.sum(-1) > 0).sum())  # rows left out of the update (no valid token) are not counted
    return rows * max_len if aggregation == "seq-mean-token-sum-norm" else rows


def actor_loss(model, part: RolloutBatch, cfg: PPOSection, temperature: float, max_len: int,
               plan) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate (Schulman et al. 2017, eq. 7) with the configured clip ranges, ratio level and
    aggregation, plus an optional k3 KL-to-reference loss term and entropy bonus (aggregated the same way)."""
    if cfg.entropy_coef > 0:  # the entropy bonus takes its gradient through the logits
        logits = response_logits(model, part, plan, temperature)  # (b, R, V)
        logp = token_logprobs(logits, part.response_ids)  # (b, R)
    else:  # the LM head in chunks where the model allows it; the entropy only as a statistic
        logits = None
        logp, entropy = response_logprobs_and_entropy(model, part, plan, temperature)
    mask = part.response_mask
    loss, stats = policy_loss(logp, part.old_logprobs, part.advantages, mask, cfg.clip_eps,
                              clip_eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip, ratio_level=cfg.ratio_level,
                              log_ratio_clamp=cfg.log_ratio_clamp, aggregation=cfg.loss_aggregation, max_len=max_len,
                              weights=part.tis_weights)
    stats["policy_loss"] = loss.item()
    # the KL and entropy terms average like the policy loss (`loss_count` scales the three together)
    if cfg.kl_loss_coef > 0:
        # KL as a loss instead of (or besides) the reward penalty; k3 is unbiased and >= 0 (verl's default)
        kl = kl_penalty(logp, part.ref_logprobs, "k3", clamp=cfg.kl_clamp)
        loss = loss + cfg.kl_loss_coef * aggregate(kl, mask, cfg.loss_aggregation, max_len)
        stats["kl_loss"] = masked_mean(kl.detach(), mask).item()
    if logits is not None:  # an entropy bonus keeps exploration up (with gradient through the logits)
        entropy = entropy_from_logits(logits)
        loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.loss_aggregation, max_len)
        stats["entropy"] = masked_mean(entropy.detach(), mask).item()
    else:
        stats["entropy"] = masked_mean(entropy, mask).item()
    return loss, stats


def samples_per_iteration(cfg: PPOConfig) -> int:
    """train.batch_size prompts x ppo.n_samples_per_prompt responses each, over all ranks."""
    return cfg.train.batch_size * cfg.ppo.n_samples_per_prompt


def mini_batch_size(cfg: PPOConfig) -> int:
    """Samples per optimizer step, over all ranks."""
    return cfg.ppo.mini_batch_size or samples_per_iteration(cfg)


def single_step(cfg: PPOConfig) -> bool:
    """One optimizer step per rollout: one PPO epoch over one mini-batch (the default)."""
    return cfg.ppo.epochs == 1 and mini_batch_size(cfg) == samples_per_iteration(cfg)


def critic_update(critic, batch: RolloutBatch, cfg: PPOConfig, engine, plan, rows: torch.Tensor | None = None,
                  timer=untimed, estimator: Estimator | None = None) -> tuple[dict, tuple | None]:
    """One optimizer step of the critic on `rows` of `batch` (default: all): the clipped value loss over
    micro-batches of rows of similar length, normalised by the rows' valid tokens over all ranks. When no rank
    has a valid token in them, no step is taken (a step on zero gradients would still move the weights).

    The loss compares the critic's new values with old values and returns: the rollout's (`batch.values`,
    `batch.returns`), or, given a row-local `estimator` (GAE), this update's own forward's. With one optimizer
    step per rollout (`single_step`) the update's forward runs at the very weights that gave the rollout's
    values, over the same tokens: the same numbers twice. So each micro-batch's forward (with grad) gives its
    rows' values, the estimator their advantages and returns from the row's own rewards (`experience.add_rewards`),
    and the loss's gradient follows at once; the forwards run even when no step is taken, for the values.

    Returns (critic metrics, None), or with `estimator` (critic metrics, (values, advantages, returns)), each
    (B, R) over every row of `batch`.
    """
    rows = torch.arange(batch.size) if rows is None else rows
    local_tokens = batch.response_mask[rows].sum().item()
    n_tokens = engine.total(local_tokens)
    empty = engine.reduce_sum(float(local_tokens)) == 0  # (n_tokens is at least 1)
    if estimator is not None:
        assert estimator.critic and estimator.row_local, estimator.name
        values, advantages, returns = (torch.zeros_like(batch.response_mask) for _ in range(3))
    stats = defaultdict(float, empty_steps=float(empty))
    with timer("critic_update"):
        chunks = [] if empty and estimator is None else length_sorted_chunks(batch, cfg.train.micro_batch_size, rows)
        for part_rows in chunks:
            part = batch.select(part_rows).to(engine.device)
            mask = part.response_mask
            new = response_values(critic.module, part, plan)  # (b, R), with grad, on the critic's speed plan
            if estimator is None:
                old, part_returns = part.values, part.returns
            else:
                old = torch.where(mask.bool(), new.detach(), torch.zeros_like(new))
                part_advantages, part_returns = estimator.advantages(replace(part, values=old), cfg.ppo)
                index, width = part_rows.to(values.device), mask.size(1)
                values[index, :width], advantages[index, :width], returns[index, :width] = old, part_advantages, \
                    part_returns
            loss, part_stats = value_loss(new, old, part_returns, mask, cfg.ppo.value_clip)
            part_tokens = mask.sum().item()
            if not empty:
                critic.backward(loss * part_tokens, n_tokens)
            part_stats["value_loss"] = loss.item()
            share = part_tokens / max(local_tokens, 1.0)  # for metrics: token-weighted means
            for k, v in part_stats.items():
                stats[k] += v * share
        if not empty:
            step = critic.step()
            stats.update(critic_grad_norm=step["grad_norm"], skipped_critic_steps=step.get("skipped", 0.0))
    return dict(stats), ((values, advantages, returns) if estimator is not None else None)


def critic_update_with_values(batch: RolloutBatch, critic, cfg: PPOConfig, engine, plan, timer=untimed,
                              estimator: Estimator = ESTIMATORS["gae"]):
    """The critic's values, the advantages and the critic's optimizer step from one critic forward per
    micro-batch (`critic_update` with the estimator), then the advantages finished over the whole batch
    (whitened, `finish_advantages`). Used with one optimizer step per rollout and a row-local estimator.

    Returns (batch with values, advantages and returns; advantage metrics; critic metrics).
    """
    stats, (values, advantages, returns) = critic_update(critic, batch, cfg, engine, plan, timer=timer,
                                                         estimator=estimator)
    batch, advantage_metrics = finish_advantages(replace(batch, values=values), advantages, returns, cfg.ppo,
                                                 estimator.whiten, engine)
    return batch, advantage_metrics, engine.reduce_mean(stats)


def ptx_text(row) -> str:
    """A PPO-ptx row's document: its `text` field, a string (a .txt file's paragraphs are such rows)."""
    if "text" not in row.data:
        raise DataError(f"{where(row.source, row.line)}: PPO-ptx text needs a `text` field (found "
                        f"{sorted(row.data)}); a .txt file works as it is")
    text = row.data["text"]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise DataError(f"{where(row.source, row.line)}: field 'text': expected a string, got {kind}")
    return text


class PtxText:
    """Tokenised pretraining documents for PPO-ptx, drawn by a seeded generator keyed on the update index so
    a resumed run draws the same texts."""

    def __init__(self, source: str, tokenizer, max_length: int, seed: int):
        texts = [ptx_text(row) for row in read_rows(source)]
        encoded = tokenizer(texts)["input_ids"]
        self.rows = [{"input_ids": ids[:max_length], "labels": ids[:max_length]} for ids in encoded if len(ids) >= 2]
        if not self.rows:
            raise DataError(f"{source}: no PPO-ptx text of at least 2 tokens")
        self.seed = seed

    def draw(self, n: int, key: int) -> list[dict]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        return [self.rows[i] for i in torch.randint(len(self.rows), (n,), generator=g).tolist()]


def ptx_backward(actor, rows: list[dict], coef: float, micro: int, pad_id: int, engine) -> float:
    """Accumulate coef * causal-LM loss (InstructGPT eq. 2, the gamma * E[log pi(x)] term) into the actor's
    gradients, normalised by the texts' token count. Returns the loss per token."""
    n_tokens = engine.total(sum(len(r["labels"]) - 1 for r in rows))
    total = 0.0
    for start in range(0, len(rows), micro):
        batch = {k: v.to(engine.device) for k, v in collate_sft(rows[start:start + micro], pad_id).items()}
        logits = causal_logits(actor.module, batch["input_ids"], batch["attention_mask"])
        nll, _ = lm_loss_sum(logits[:, :-1], batch["labels"][:, 1:])
        actor.backward(coef * nll, n_tokens)
        total += nll.item()
    return engine.reduce_sum(total) / n_tokens


def ppo_update(batch: RolloutBatch, actor, critic, cfg: PPOConfig, engine, iteration: int, plans: dict,
               update_actor: bool = True, ptx: PtxText | None = None, ema=None, pad_id: int = 0,
               timer=untimed, update_critic: bool = True) -> dict:
    """PPO epochs x mini-batches over `batch`; one optimizer step of each model per mini-batch, each model on the
    paths of its speed plan (`plans["actor"]`, `plans["critic"]`).

    Returns the metrics averaged over the optimizer steps (and ranks); `timer` splits the time between the
    actor_update and critic_update phases. The critic's step is `critic_update` on the same rows;
    `update_critic=False` when `critic_update_with_values` took it already.
    """
    micro = cfg.train.micro_batch_size
    mini = mini_batch_size(cfg) // engine.world_size  # this rank's rows of one
    temperature, aggregation, max_len = cfg.gen.temperature, cfg.ppo.loss_aggregation, cfg.gen.max_new_tokens
    sums, steps = defaultdict(float), 0
    for epoch in range(cfg.ppo.epochs):
        # seeded by iteration and epoch, so a resumed run shuffles the same way
        order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(
            cfg.train.seed * 1000 + iteration * 100 + epoch))
        for start in range(0, batch.size, mini):
            rows = order[start:start + mini]
            local_tokens = batch.response_mask[rows].sum().item()
            n_tokens = engine.total(local_tokens)
            # the actor's loss averages over the aggregation's count (tokens by default)
            local_count = loss_count(batch.response_mask[rows], aggregation, max_len)
            n_actor = n_tokens if aggregation == "token-mean" else engine.total(local_count)
            # a mini-batch whose rows were all left out of the update (filtered groups, masked truncations) over
            # all ranks takes no optimizer step: a step on zero gradients would still move the weights (Adam's
            # momentum, weight decay). PPO-ptx text alone still steps the actor.
            empty = engine.reduce_sum(float(local_tokens)) == 0  # (n_tokens is at least 1)
            stats = defaultdict(float, empty_steps=float(empty))
            # micro-batches of rows of similar length carry little padding; the mini-batch's gradient is the
            # same sum for any grouping of its rows
            for part_rows in ([] if empty or not update_actor else length_sorted_chunks(batch, micro, rows)):
                part = batch.select(part_rows).to(engine.device)
                share = part.response_mask.sum().item() / max(local_tokens, 1.0)  # for metrics: token-weighted means
                with timer("actor_update"):
                    loss, actor_stats = actor_loss(actor.module, part, cfg.ppo, temperature, max_len, plans["actor"])
                    count = loss_count(part.response_mask, aggregation, max_len)
                    actor.backward(loss * count, n_actor)
                for k, v in actor_stats.items():  # token means; the loss by the aggregation's own count
                    stats[k] += v * (count / max(local_count, 1.0) if k == "policy_loss" else share)
            if update_actor and (not empty or ptx is not None):
                with timer("actor_update"):
                    if ptx is not None:
                        # one seeded draw for the step over all ranks, each rank backpropagating its share
                        draw = engine.shard(ptx.draw(cfg.ptx.batch_size, iteration * 1000 + steps))
                        stats["ptx_loss"] = ptx_backward(actor, draw, cfg.ptx.coef, micro, pad_id, engine)
                    actor_step = actor.step()
                stats["actor_grad_norm"] = actor_step["grad_norm"]
                stats["skipped_actor_steps"] = actor_step.get("skipped", 0.0)
                if ema is not None and not actor_step.get("skipped"):
                    ema.update(actor.module)
            if update_critic:
                critic_stats, _ = critic_update(critic, batch, cfg, engine, plans["critic"], rows, timer)
                stats.update(critic_stats)
            for k, v in stats.items():
                sums[k] += v
            steps += 1
    return engine.reduce_mean({k: v / steps for k, v in sums.items()})
