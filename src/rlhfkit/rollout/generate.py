"""Sampling responses from the actor: left-padded prompts, KV cache, stop at EOS, response masks."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.data.templates import end_token_ids
from rlhfkit.data.tokenize import pad_sequences
from rlhfkit.accel.cpu_linear import packed_weights
from rlhfkit.accel.decode_gemm import streaming_decode
from rlhfkit.models.forward import cache_kwargs, pack_padded, returned_cache, unpack_states
from rlhfkit.models.prefix import common_prefix_layout, contiguous_groups, unique_rows
from rlhfkit.lora import base_model
from rlhfkit.models.segments import full_attention_cache, packed_attention, packed_row_tokens
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.rollout.group_decode import GroupCache, decoding_in_groups, group_cache


def eos_token_ids(tokenizer, model) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's generation_config EOS (chat models
    often stop on an end-of-turn token that is not the tokenizer's EOS, e.g. Llama 3's <|eot_id|>). The one
    definition is `end_token_ids`, which SFT and RM data use too, so a rendered response ends where rollouts stop."""
    return end_token_ids(tokenizer, getattr(base_model(model), "generation_config", None))


# generation_config.json settings that would change the sampled distribution; the rollout samples with gen.*
# only (PPO's ratio and KL refer to the policy's own distribution), so a model folder's values are not applied
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' own defaults
_PROCESSOR_DEFAULTS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
                       "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None,
                       "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                       "sequence_bias": None, "forced_bos_token_id": None, "forced_eos_token_id": None}


def ignored_generation_settings(model, cfg: GenConfig) -> list[str]:
    """The settings of the model's generation_config.json that rollouts do not apply, as `name=value`:
    logits processors (repetition penalty, n-gram blocking, ...) and sampling values other than gen.*'s
    (a chat model's temperature 0.6 / top_p 0.9). Empty when the folder sets nothing of the kind."""
    config = getattr(base_model(model), "generation_config", None)
    if config is None:
        return []
    ignored = []
    if getattr(config, "do_sample", False):  # the folder's sampling values, where they differ from gen.*
        ours = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
        for name, default in _SAMPLING_DEFAULTS.items():
            value = getattr(config, name, None)
            if value is not None and value != default and value != ours[name]:
                ignored.append(f"{name}={value}")
    for name, default in _PROCESSOR_DEFAULTS.items():
        value = getattr(config, name, None)
        if value is not None and value != default:
            ignored.append(f"{name}={value}")
    return ignored


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


def _filter_logits(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(b, V) temperature-scaled logits with everything outside top-k / the top-p nucleus set to -inf
    (the same rule as transformers' TopK/TopP warpers: the most likely token always survives)."""
    if 0 < top_k < scores.size(-1):
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1)  # ascending
        drop = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores


def draw_tokens(probs: torch.Tensor) -> torch.Tensor:
    """(b, 1) one token per row drawn from (b, V) probabilities (zeros allowed), by inverse CDF: one uniform
    number per row where `torch.multinomial` (generate's sampler) draws an exponential per vocabulary entry,
    ~18x the time (0.56 vs 0.03 ms at 16 x 2048, ~5% of a decode step). The same distribution, not the same
    draws. The point is kept strictly below the row's total, so a zero-probability token is never returned."""
    cdf = probs.double().cumsum(-1)  # float64: no rounding drift over a large vocabulary
    total = cdf[:, -1:]
    point = torch.minimum(torch.rand_like(total) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True)


class PreallocatedLayer(DynamicLayer):
    """A KV-cache layer that allocates room for every position once and writes each step's keys/values in
    place. transformers' DynamicLayer concatenates instead, copying the whole cache at every generated token:
    O(T^2) memory traffic, 15-25% of the decoding time at batch 64 on CPU."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, _ = key_states.shape
        self.key_buffer = key_states.new_empty(batch, heads, self.capacity, key_states.size(-1))
        self.value_buffer = value_states.new_empty(batch, heads, self.capacity, value_states.size(-1))
        self.is_initialized = True

    packed_where = None  # set by `prefill` for a padding-free prefill (`forward.unpack_states`)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        packed = None
        if self.packed_where is not None:  # the prefill's packed row: stored left-padded, attended as it came
            packed, where, self.packed_where = (key_states, value_states), self.packed_where, None
            key_states, value_states = unpack_states(key_states, where), unpack_states(value_states, where)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.size(-2)
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return packed if packed is not None else (self.keys, self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows `beam_idx` of the cache (any count: a prompt prefilled once serves every row that shares it)."""
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, beam_idx.to(self.key_buffer.device))
            self.value_buffer = self.value_buffer.index_select(0, beam_idx.to(self.value_buffer.device))
            self.keys, self.values = self.key_buffer[:, :, :self.length], self.value_buffer[:, :, :self.length]


def kv_cache(model, capacity: int):
    """A cache with `capacity` positions preallocated per layer when the model's default cache is made of
    plain full-attention layers; otherwise None (the model builds its own: sliding windows, hybrids...)."""
    cache = full_attention_cache(model)
    if cache is None:
        return None
    cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


def prefill(model, prompt_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, capacity: int, plan,
             groups_allowed: bool = True):
    """The prompts' forward that fills the KV cache: `(cache, logits of the last position, groups, mask of the
    cache's columns)`, taking the paths `model`'s speed plan has on.

    Rows with the same prompt (a group of samples of one prompt) are computed once (`plan.shared_prompt`). When
    the rows come in blocks of G consecutive samples per prompt and the plan has `group_decode`, the cache keeps
    each prompt once and `groups` (a `GroupCache`) is what the decode steps' attention needs; otherwise the
    cache (`kv_cache`'s, `capacity` positions) is indexed out to every row and `groups` is None. Not
    `groups_allowed` while every forward is a collective across ranks (ZeRO-3 without a gather): all ranks
    must then make the same calls, whatever their rows. The tokens every prompt begins with are computed once
    where the plan has `common_prefix` (`_common_prefix_prefill`); left-padded prompts go through the model packed
    where it has `packed_prefill` (`_packed_prefill`).
    """
    cache = kv_cache(model, capacity)
    unique = unique_rows(prompt_ids, mask) if cache is not None and plan.shared_prompt else None
    group = 0
    if unique is not None:
        first, inverse = unique
        group = contiguous_groups(inverse)
        if group and groups_allowed and plan.group_decode:  # each block's first row, in row order
            first = torch.arange(0, prompt_ids.size(0), group, device=prompt_ids.device)
            inverse = torch.arange(first.numel(), device=prompt_ids.device).repeat_interleave(group)
            cache = group_cache(model, capacity - prompt_ids.size(1))
        else:
            group = 0
        prompt_ids, mask, positions = prompt_ids[first], mask[first], positions[first]
    if unique is None and cache is not None and groups_allowed and plan.common_prefix:
        shared = _common_prefix_prefill(model, prompt_ids, mask, positions, cache)
        if shared is not None:
            return shared
    if cache is not None and plan.packed_prefill and not mask.all() and bool(mask[:, -1].all()):
        cache, logits = _packed_prefill(model, prompt_ids, mask, cache, plan)
    else:
        kwargs = dict(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                      **cache_kwargs(model, cache))
        try:
            out = model(**kwargs, logits_to_keep=1)
        except TypeError as exc:  # a model class without logits_to_keep
            if "logits_to_keep" not in str(exc):
                raise
            out = model(**kwargs)
        cache, logits = returned_cache(out), out.logits[:, -1]
    if unique is None:
        return cache, logits, None, mask
    if group:
        return cache, logits[inverse], GroupCache(cache, mask, group), mask[inverse]
    cache.reorder_cache(inverse)
    return cache, logits[inverse], None, mask[inverse]


def _common_prefix_prefill(model, prompt_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache):
    """The prefill with the tokens every prompt begins with (a chat template's system prompt) computed once
    (`prefix.common_prefix_layout`): that run as one row fills `cache`, which is copied out to every row, then the
    rest of each prompt runs against it at its own positions. Returns `prefill`'s `(cache, logits, None, mask)`,
    the mask now of the cache's columns (the run, then the rest); None when the prompts share too little."""
    layout = common_prefix_layout(prompt_ids, mask, keep=1)
    if layout is None:
        return None
    start, length, full_mask = layout
    rows, cut = prompt_ids.size(0), prompt_ids.size(1) - full_mask.size(1) + length
    run = dict(input_ids=prompt_ids[:1, start:start + length],
               position_ids=torch.arange(length, device=mask.device)[None], use_cache=True,
               **cache_kwargs(model, cache))
    rest = dict(input_ids=prompt_ids[:, cut:], attention_mask=full_mask, position_ids=positions[:, cut:],
                use_cache=True, **cache_kwargs(model, cache))
    try:
        model(**run, logits_to_keep=1)
        cache.reorder_cache(torch.zeros(rows, dtype=torch.long, device=mask.device))
        out = model(**rest, logits_to_keep=1)
    except TypeError as exc:  # a model class without logits_to_keep: the plain prefill
        if "logits_to_keep" not in str(exc):
            raise
        return None
    return returned_cache(out), out.logits[:, -1], None, full_mask


def _packed_prefill(model, prompt_ids: torch.Tensor, mask: torch.Tensor, cache, plan):
    """The prefill without padding (`plan.packed_prefill`): the left-padded prompts' real
    tokens packed into rows (`forward.pack_padded`), attention per prompt (`segments.packed_attention`), each
    layer's keys and values stored in the cache left-padded as the padded forward would have (`unpack_states`;
    zeros on padding, which the decode steps' mask hides). Returns `(cache, (B, V) logits of each prompt's last
    token)`. The same values as the padded prefill to float rounding, without computing the padding (16 SmolLM2
    chat prompts of 48-87 tokens: 1030 tokens instead of 1392)."""
    ids, positions, where = pack_padded(prompt_ids, mask, packed_row_tokens(model, plan, inference=True))
    for layer in cache.layers:
        layer.packed_where = where
    last = where[:, -1]  # left padding: every prompt ends in the last column
    width = ids.size(1)
    columns, slot = torch.unique(last % width, return_inverse=True)  # the LM head runs on these columns only
    with packed_attention(model, plan, positions) as spans:
        if not spans:  # transformers builds no packed mask when a cache is passed: only the per-sequence path will do
            raise RuntimeError("the packed prefill needs attention per sequence (plan.segment_attention)")
        kwargs = dict(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=True, **spans,
                      **cache_kwargs(model, cache))
        try:
            logits = model(**kwargs, logits_to_keep=columns).logits  # (N, len(columns), V)
        except TypeError as exc:  # a model class without logits_to_keep (or without index tensors for it)
            if "logits_to_keep" not in str(exc):
                raise
            logits, slot = model(**kwargs).logits, last % width
    if any(layer.packed_where is not None for layer in cache.layers):  # a layer the model never updated
        raise RuntimeError("the packed prefill left cache layers unfilled")
    return cache, logits[last // width, slot]


def sample_tokens(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cfg: GenConfig, eos_ids: list[int],
                  pad_id: int, plan, greedy: bool = False, synced=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with the KV cache that also returns each sampled token's log-probability.

    Args:
        prompt_ids, prompt_mask: ``(B, P)`` left-padded prompts.
        plan: the model's speed plan (the prefill's paths, `prefill`; the decode steps' group attention).
        synced: a callable ``all_done(local_done: bool) -> bool`` agreeing across ranks, for ZeRO-3 without a
            gather (every forward is a collective, so a finished rank keeps stepping until all are done).

    Returns:
        ``(response_ids, logprobs)``, both ``(B, n)`` with n <= max_new_tokens: the tokens (pad after a row's
        EOS) and log softmax(z / T)[token] of the full distribution, the behaviour policy that PPO's ratio
        and KL refer to (top-k/top-p/min_new_tokens only decide what is drawn). They are the old log-probs for
        free: no second forward of the actor over prompt + response (TRL keeps generation logits likewise).

    A plain loop over ``model(...)`` rather than ``model.generate``: it records these log-probs as it goes
    (generate's ``output_scores`` keeps a (B, R, V) float32 copy, already altered by top-k/top-p/min-length)
    and its KV cache is written in place (`PreallocatedLayer`). It samples generate's distribution for the same
    settings (temperature, top-k, top-p, min_new_tokens), drawn by inverse CDF (`draw_tokens`).
    """
    batch = prompt_ids.size(0)
    eos = torch.tensor(eos_ids, device=prompt_ids.device)
    temperature = 1.0 if greedy else cfg.temperature
    mask = prompt_mask.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding does not shift positions
    cache, logits, groups, mask = prefill(model, prompt_ids, mask, positions,
                                           prompt_ids.size(1) + cfg.max_new_tokens, plan, groups_allowed=synced is None)
    position = positions[:, -1:]
    done = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    filtered = 0 < cfg.top_k < logits.size(-1) or cfg.top_p < 1.0
    tokens, logprobs = [], []
    for step in range(cfg.max_new_tokens):
        scores = logits.float() if temperature == 1.0 else logits.float() / temperature
        logp = torch.log_softmax(scores, dim=-1)
        forbid_eos = step < cfg.min_new_tokens  # EOS is forbidden before min_new_tokens
        if greedy or filtered:
            if forbid_eos:
                scores = scores.index_fill(1, eos, float("-inf"))
            token = scores.argmax(-1, keepdim=True) if greedy else draw_tokens(
                _filter_logits(scores, cfg.top_k, cfg.top_p).softmax(-1))
        else:  # the full distribution: its probabilities are exp(logp), no second softmax
            probs = logp.exp()
            token = draw_tokens(probs.index_fill(1, eos, 0.0) if forbid_eos else probs)
        token = token.masked_fill(done[:, None], pad_id)  # finished rows only carry padding
        tokens.append(token)
        logprobs.append(logp.gather(1, token))
        done = done | torch.isin(token[:, 0], eos)
        all_done = bool(done.all()) if synced is None else synced(bool(done.all()))
        if all_done or step == cfg.max_new_tokens - 1:
            break
        position = position + 1
        if groups is not None:  # the prompts' padding is in `groups`; every response token is attended
            with decoding_in_groups(model):
                out = model(input_ids=token, position_ids=position, use_cache=True, rlhfkit_groups=groups,
                            **cache_kwargs(model, cache))
        else:
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            out = model(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True,
                        **cache_kwargs(model, cache))
        cache, logits = returned_cache(out), out.logits[:, -1]
    return torch.cat(tokens, dim=1), torch.cat(logprobs, dim=1)


@torch.no_grad()
def generate_rollout(model, engine, tokenizer, rows: list[dict], cfg: GenConfig, plan,
                     greedy: bool = False) -> RolloutBatch:
    """Sample one response per prompt row ({prompt_ids, prompt_text, messages}) with the KV cache, on the paths
    of `model`'s speed plan.

    Prompts are left-padded so new tokens are appended at the same column for every row; positions come from
    the attention mask, so padding does not shift them. Under ZeRO-3 `engine.gathered` collects the
    parameters once for the whole call instead of once per token (TRL PR #1483) and hands back the plain
    model, without DeepSpeed's hooks, to decode with. On a CPU the decode steps' linear layers run on oneDNN's
    packed weights (`cpu_linear.packed_weights`, `plan.onednn_linear`) or the streaming kernel
    (`decode_gemm.streaming_decode`, `plan.streaming_decode`). The batch carries the sampled tokens'
    log-probabilities (`sample_logprobs`, 0 after EOS).
    """
    device = engine.device
    pad_id = tokenizer.pad_token_id
    prompt_ids = pad_sequences([r["prompt_ids"] for r in rows], pad_id, side="left").to(device)
    prompt_mask = pad_sequences([[1] * len(r["prompt_ids"]) for r in rows], 0, side="left").to(device)
    eos_ids = eos_token_ids(tokenizer, model)

    def all_ranks_done(local_done: bool) -> bool:
        return engine.reduce_sum(0.0 if local_done else 1.0) == 0

    synced = all_ranks_done if engine.generation_kwargs(model).get("synced_gpus") else None
    was_training = model.training
    model.eval()  # no gradient-checkpointing path (it turns the KV cache off)
    try:
        with engine.gathered(model) as generator, packed_weights(generator, plan.onednn_linear), \
                streaming_decode(generator, plan.streaming_decode):
            response_ids, logprobs = sample_tokens(generator, prompt_ids, prompt_mask, cfg, eos_ids, pad_id, plan,
                                                   greedy, synced)
    finally:
        model.train(was_training)
    mask = response_mask(response_ids, eos_ids)
    response_ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, pad_id))
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=mask, prompt_texts=[r["prompt_text"] for r in rows], response_texts=texts,
                        messages=[r.get("messages") for r in rows], fields=[r.get("fields", {}) for r in rows],
                        sample_logprobs=torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs)))
