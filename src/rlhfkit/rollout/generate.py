"""Sampling responses from the actor: left-padded prompts, KV cache, stop at EOS, response masks."""

from __future__ import annotations

import torch

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.data.tokenize import pad_sequences
from rlhfkit.models.lora import base_model
from rlhfkit.rollout.batch import RolloutBatch


def eos_token_ids(tokenizer, model) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's generation_config EOS (chat models
    often stop on an end-of-turn token that is not the tokenizer's EOS, e.g. Llama 3's <|eot_id|>)."""
    ids = {tokenizer.eos_token_id}
    extra = getattr(base_model(model).generation_config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
    return sorted(i for i in ids if i is not None)


def response_mask(response_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """(B, R) float: 1 on tokens up to and including the first EOS; every token when there is no EOS.

    Everything after the first EOS is padding that generate() wrote for finished rows; it must not count in
    log-probs, values or rewards.
    """
    is_eos = torch.isin(response_ids, torch.tensor(eos_ids, device=response_ids.device))
    width = response_ids.size(1)
    positions = torch.arange(width, device=response_ids.device)
    # index of the first EOS, or the last column when a row never emits one (truncated)
    last_column = torch.full_like(positions[:1], width - 1)
    first_eos = torch.where(is_eos.any(-1), is_eos.long().argmax(-1), last_column)  # (B,)
    return (positions[None, :] <= first_eos[:, None]).float()


@torch.no_grad()
def generate_rollout(model, engine, tokenizer, rows: list[dict], cfg: GenConfig, greedy: bool = False) -> RolloutBatch:
    """Sample one response per prompt row ({prompt_ids, prompt_text, messages}) with the KV cache.

    Prompts are left-padded so new tokens are appended at the same column for every row; generate() derives
    position ids from the attention mask, so padding does not shift positions. Under ZeRO-3 `engine.gathered`
    collects the parameters once for the whole call instead of once per token (TRL PR #1483).
    """
    device = engine.device
    pad_id = tokenizer.pad_token_id
    prompt_ids = pad_sequences([r["prompt_ids"] for r in rows], pad_id, side="left").to(device)
    prompt_mask = pad_sequences([[1] * len(r["prompt_ids"]) for r in rows], 0, side="left").to(device)
    eos_ids = eos_token_ids(tokenizer, model)
    sampling = {} if greedy else {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
    was_training = model.training
    model.eval()  # no gradient-checkpointing path (it turns the KV cache off)
    try:
        with engine.gathered(model):
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=not greedy,
                                 max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens,
                                 eos_token_id=eos_ids, pad_token_id=pad_id, use_cache=True, **sampling,
                                 **engine.generation_kwargs(model))
    finally:
        model.train(was_training)
    response_ids = out[:, prompt_ids.size(1):]
    mask = response_mask(response_ids, eos_ids)
    response_ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, pad_id))
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=mask, prompt_texts=[r["prompt_text"] for r in rows], response_texts=texts,
                        messages=[r.get("messages") for r in rows])
