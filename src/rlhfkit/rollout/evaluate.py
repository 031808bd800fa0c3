"""Held-out evaluation of the policy: mean reward of its responses and their KL to the reference."""

from __future__ import annotations

import contextlib

import torch

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.metric_names import EVAL_FINISHED, EVAL_GOLD, EVAL_KL, EVAL_RESPONSE_LENGTH, EVAL_REWARD
from rlhfkit.lora import adapter_disabled
from rlhfkit.rollout.batch import RolloutBatch, cat_rollouts
from rlhfkit.rollout.experience import ended_with_eos, response_logprobs
from rlhfkit.rollout.generate import generate_rollout


def generate_all(model, engine, tokenizer, rows: list[dict], cfg: GenConfig, plan, greedy: bool = False,
                 group_size: int = 1) -> RolloutBatch:
    """Generate for every row, `cfg.generation_batch_size` prompts per generate() call (0 = all at once); rows
    holding `group_size` copies of each prompt in a row (one per sample) go group_size x that many at a time,
    so a prompt's samples stay in one call. `plan`: the model's speed plan."""
    size = cfg.generation_batch_size * group_size or len(rows)
    parts = [generate_rollout(model, engine, tokenizer, rows[i:i + size], cfg, plan, greedy)
             for i in range(0, len(rows), size)]
    return cat_rollouts(parts, tokenizer.pad_token_id)


@contextlib.contextmanager
def reward_on_device(engine, reward):
    """Every reward model of `reward` on the compute device for the block (`engine.on_device`)."""
    with contextlib.ExitStack() as stack:
        for model in getattr(reward, "models", [getattr(reward, "model", None)]):
            stack.enter_context(engine.on_device(model))
        yield


@torch.no_grad()
def sequence_kl(actor, reference, plans, batch: RolloutBatch, temperature: float, micro: int) -> torch.Tensor:
    """(B,) sum over valid tokens of log pi - log pi_ref (k1): nats per sequence, as in the training metric;
    `plans`: the speed plans of "actor" and "reference"."""
    out = []
    for start in range(0, batch.size, micro):
        part = batch.select(list(range(start, min(start + micro, batch.size))))
        logp = response_logprobs(actor, part, plans["actor"], temperature)
        if reference is None:
            with adapter_disabled(actor):
                ref = response_logprobs(actor, part, plans["reference"], temperature)
        else:
            ref = response_logprobs(reference, part, plans["reference"], temperature)
        out.append(((logp - ref) * part.response_mask).sum(-1))
    return torch.cat(out)


def pooled(name: str, values: torch.Tensor, engine) -> dict:
    """`name` (the mean), `name`_std and `name`_se (the standard error of the mean) of every rank's `values` (0
    where there are none), from the count, sum and sum of squares summed over ranks, in float64."""
    v = values.double()
    n, total, squares = (engine.reduce_sum(float(x)) for x in (v.numel(), v.sum(), (v * v).sum()))
    mean = total / n if n > 0 else 0.0
    std = (max(0.0, squares - total * mean) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return {name: mean, f"{name}_std": std, f"{name}_se": std / n ** 0.5 if n > 0 else 0.0}


def judged_scores(reward, batch: RolloutBatch, finished: torch.Tensor, engine) -> torch.Tensor:
    """(B,) the reward's scores on the CPU; NaN where it left a response unjudged."""
    with reward_on_device(engine, reward):
        return reward(batch, finished).float().cpu()


# each judge's scores (the "reward" and "gold" of eval_samples.jsonl's rows) -> its metric
SCORE_METRICS = {"reward": EVAL_REWARD, "gold": EVAL_GOLD}


@torch.no_grad()
def evaluate_held_out(actor, reference, reward, tokenizer, rows: list[dict], cfg: GenConfig, engine, micro: int,
                      seed: int, eos_ids: list[int], plans, sampler=None, judge=None
                      ) -> tuple[dict, RolloutBatch, dict]:
    """eval/reward (raw reward of one response per held-out prompt; its _std and _se over the judged responses),
    eval/kl, eval/response_length; with `judge` (eval.judge) eval/gold (_std, _se), the judge's scores of the same
    responses. `plans`: the speed plans of "actor" and "reference"; `sampler`: the run's rollout engine
    (rollout/engines.py, its weights synced), None = the native decoder on `actor`. Returns (the metrics averaged
    over ranks, this rank's responses, this rank's per-response scores: "reward" and "gold" tensors, NaN where
    unjudged).

    Sampling uses a fixed seed in a forked RNG: every evaluation draws with the same noise, so a change in
    eval/reward is the policy's, and the training RNG stream is untouched.
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        batch = generate_all(actor, engine, tokenizer, rows, cfg, plans["actor"], greedy=cfg.eval_greedy) \
            if sampler is None else sampler.generate(rows, cfg, greedy=cfg.eval_greedy)
    finished = ended_with_eos(batch, eos_ids)
    scores = {"reward": judged_scores(reward, batch, finished, engine)}
    if judge is not None:
        scores["gold"] = judged_scores(judge, batch, finished, engine)
    with engine.on_device(reference):
        kl = sequence_kl(actor, reference, plans, batch.to(engine.device), cfg.temperature, micro)
    metrics = engine.reduce_mean({EVAL_KL: kl.mean().item(),
                                  EVAL_RESPONSE_LENGTH: batch.response_lengths.float().mean().item(),
                                  EVAL_FINISHED: finished.float().mean().item()})
    for name, values in scores.items():  # a reward function may leave a response unjudged (None)
        metrics.update(pooled(SCORE_METRICS[name], values[torch.isfinite(values)], engine))
    return metrics, batch, scores
