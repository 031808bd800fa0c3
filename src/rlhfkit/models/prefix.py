"""Forwards that compute a shared prefix once: the prompt of a group of samples, and the run of tokens every
rollout row begins with (a chat template's system prompt).

Both fill a KV cache with the shared tokens in one forward and run the rest of each row against it, broadcast to
the rows, so gradients flow through the cache into the prefix's forward and the results equal the full
forward's up to float rounding. Used by the rollout (`rollout/generate.py`), the reference and old log-probs
(`rollout/experience.py`) and the actor update; `models/forward.py` holds the plain forwards they build on.
"""

from __future__ import annotations

import contextlib
import math

import torch
from transformers.cache_utils import DynamicLayer

from rlhfkit.models.forward import cache_kwargs, decoder_outputs, hidden_states, position_ids, scalar_outputs
from rlhfkit.models.group_pack import common_prefix_packed, contiguous_rows, group_packed_hidden, group_packing
from rlhfkit.lora import base_model, checkpointed
from rlhfkit.models.segments import full_attention_cache


def shares_prefixes(model) -> bool:
    """Whether a forward may compute a prompt shared by several rows once and reuse its KV cache: not while
    a model with gradient checkpointing is in training mode. transformers then drops the cache inside every
    layer, with or without autograd (so a no-grad forward of the training actor, its old log-probs or the
    reference with the LoRA adapter off, would run the responses without their prompt)."""
    return not (base_model(model).training and checkpointed(model))


def unique_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(first, inverse)` when some rows of (ids, mask) are identical: `first` indexes one row of each distinct
    value, and `inverse[i]` is the position in `first` of row i's value. None when every row is distinct."""
    keys = torch.cat([ids, mask.to(ids.dtype)], dim=1)
    values, inverse = torch.unique(keys, dim=0, return_inverse=True)
    if values.size(0) == keys.size(0):
        return None
    first = torch.full((values.size(0),), keys.size(0), dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inverse, torch.arange(keys.size(0), device=ids.device), reduce="amin")
    return first, inverse


def contiguous_groups(inverse: torch.Tensor) -> int:
    """The largest G >= 2 such that the rows come in blocks of G consecutive rows of one prompt each
    (`inverse[i]`: row i's prompt, as `unique_rows` numbers them), else 0. Blocks may repeat a prompt (the
    same prompt twice in a batch) and runs of one prompt may span several blocks."""
    rows = inverse.numel()
    starts = torch.ones(rows, dtype=torch.bool, device=inverse.device)
    starts[1:] = inverse[1:] != inverse[:-1]
    edges = starts.nonzero().flatten().tolist() + [rows]
    group = math.gcd(*(b - a for a, b in zip(edges, edges[1:])))
    return group if group >= 2 else 0


class PrefixLayer(DynamicLayer):
    """A KV-cache layer that keeps only the prefix it was filled with (the first `update`): later calls get
    the prefix with their own keys/values appended, and the cache does not keep them. The response forward
    of `shared_prefix_logits` is the last use of the cache, so holding every layer's (B, P + R) keys and
    values to its end is waste: without autograd (reference, old log-probs) each layer's are freed after its
    attention; with autograd the attention keeps them for the backward anyway."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def shared_prefix_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                         response_mask: torch.Tensor, plan, always: bool = False,
                         hidden: bool = False) -> torch.Tensor | None:
    """(B, R, V) logits predicting each response token, with every distinct prompt computed once.

    GRPO and RLOO sample several responses of one prompt, and the prompt is often the longer part. The distinct
    prompts (left-padded, identical rows merged) run one forward that fills the KV cache and gives the logits of
    each response's first token; the cache is then indexed out to every row, and the responses run against it.
    Gradients flow through the shared cache into the prompt's forward, so the result and its gradient equal
    the full forward's (up to float rounding). None when the model's plan does not say so (`plan.shared_prompt`),
    when no two rows share a prompt, or when the model cannot take a cache here (`shares_prefixes`, or a model class
    without a cache argument or `logits_to_keep`).

    With `always`, the two forwards run even when no prompt repeats: under ZeRO-3 every forward is a
    collective, so each rank must make the same number of calls whatever its rows (callers pass a setting
    that holds for every rank: the run samples groups).

    With `hidden`, (B, R, H): the hidden states the LM head would read at those positions (`decoder_outputs`),
    the head itself run on one position per forward; where the plan says so (`group_pack.group_packing`), from one
    forward of the prompts and responses packed in one row instead (`group_pack.group_packed_hidden`).
    """
    if not (plan.shared_prompt and shares_prefixes(model)):
        return None
    unique = unique_rows(prompt_ids, prompt_mask)
    if unique is None and always:
        every = torch.arange(prompt_ids.size(0), device=prompt_ids.device)
        unique = (every, every)
    cache = full_attention_cache(model) if unique is not None else None
    if cache is None:
        return None
    cache.layers = [PrefixLayer() for _ in cache.layers]
    first, inverse = unique
    group = contiguous_groups(inverse)
    if group:  # blocks of G rows per prompt: each block's first row, and the cache repeated by a broadcast
        first = torch.arange(0, prompt_ids.size(0), group, device=prompt_ids.device)
        inverse = torch.arange(first.numel(), device=prompt_ids.device).repeat_interleave(group)
    if hidden and group_packing(model, plan):  # prompts and responses in one packed row: one forward, not two
        packed = group_packed_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, first, inverse)
        if packed is not None:
            return packed
    mask = prompt_mask.long()[first]
    capture = decoder_outputs(model) if hidden else contextlib.nullcontext([])
    try:
        with capture as captured:
            out = model(input_ids=prompt_ids[first], attention_mask=mask, position_ids=position_ids(mask),
                        use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    except TypeError as exc:  # a model class without these arguments
        if any(name in str(exc) for name in ("logits_to_keep", "past_key_values", "'cache'", "use_cache")):
            return None
        raise
    if group:  # a copy by broadcast: its gradient is a sum over each block (index_select's is a scatter-add)
        for layer in cache.layers:
            layer.keys, layer.values = (x.unsqueeze(1).expand(-1, group, *x.shape[1:]).flatten(0, 1)
                                        for x in (layer.keys, layer.values))
    else:
        cache.reorder_cache(inverse)  # index_select per layer: differentiable, the gradient sums over rows
    head = (captured[-1] if hidden else out.logits)[:, -1:][inverse]  # predicts response token 0
    if response_ids.size(1) == 1:
        return head
    full_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    width = prompt_ids.size(1)
    kwargs = dict(input_ids=response_ids[:, :-1], attention_mask=full_mask[:, :-1],
                  position_ids=position_ids(full_mask)[:, width:-1], use_cache=True, **cache_kwargs(model, cache))
    if hidden:
        rest = hidden_states(model, **kwargs)
    else:
        rest = model(**kwargs).logits
    return torch.cat([head.to(rest.dtype), rest], dim=1)


MIN_COMMON_PREFIX = 8  # tokens: a shorter shared run saves less than the second forward costs


def common_prefix_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         keep: int) -> tuple[int, int, torch.Tensor] | None:
    """`(start, length, rest_mask)` when the left-padded rows (B, T) share a run of at least `MIN_COMMON_PREFIX`
    tokens (`common_prefix_span`) and computing it once takes fewer tokens than the rows' real ones: the run is
    row 0's columns start .. start + length - 1, and the rest of every row is its columns from first + length on
    (first: the earliest start), under `rest_mask` (B, T - first): ones for the run's `length` columns (held in a
    cache), then the row's own mask from first + length on, with its own copy of the run masked out. Else None."""
    first, length = common_prefix_span(input_ids, attention_mask, keep)
    rows, width = input_ids.shape
    cut = first + length
    if length < MIN_COMMON_PREFIX or rows * (width - cut) + length >= int(attention_mask.sum()):
        return None
    starts = (~attention_mask.bool()).long().cumprod(-1).sum(-1)
    columns = torch.arange(cut, width, device=input_ids.device)
    # a row that starts later than `first` has run tokens at or after `cut`: the cache holds them, mask them
    rest = attention_mask[:, cut:].long() * (columns[None] >= (starts + length)[:, None]).long()
    return int(starts[0]), length, torch.cat([rest.new_ones(rows, length), rest], dim=1)


def common_prefix_span(input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int) -> tuple[int, int]:
    """`(first, length)` of the longest run of tokens that every left-padded row of (B, T) begins with, where
    `first` is the earliest column any row starts at; the run stops short of the last `keep` columns of every
    row (their outputs are wanted from the second forward). `(0, 0)` when rows share nothing or B < 2."""
    mask = attention_mask.bool()
    rows, width = input_ids.shape
    if rows < 2:
        return 0, 0
    starts = (~mask).long().cumprod(-1).sum(-1)  # leading padding of each row
    limit = int((width - keep - starts).min())
    if limit <= 0:
        return 0, 0
    columns = starts[:, None] + torch.arange(limit, device=input_ids.device)
    aligned, real = input_ids.gather(1, columns), mask.gather(1, columns)
    same = (aligned == aligned[:1]).all(0) & real.all(0)
    return int(starts.min()), int(same.long().cumprod(0).sum())


def common_prefix_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int, plan,
                          kind: str = "hidden") -> torch.Tensor | None:
    """The outputs at the last `keep` columns of a forward over left-padded (B, T) rows, with the tokens that every
    row begins with computed once: `kind` "hidden" (B, keep, H), the hidden states the LM head reads
    (`decoder_outputs`); "logits" (B, keep, V); "scores" (B, keep), a scalar model's outputs (`token_scores`).

    Chat templates put the same system prompt and turn markers before every question (SmolLM2's are 27 of the 38
    tokens of "What is 3 + 4?"), so a rollout's rows often share most of their prompt. The shared run goes
    through the model once, as one row, filling the KV cache; the cache is broadcast to every row and the rest of
    each row runs against it, with the positions it has in the full row. Gradients flow through the broadcast
    into the prefix's forward, so values and gradients equal the full forward's (up to float rounding). Where the
    plan says so (`group_pack.group_packing`; "hidden" and "scores"), the run and every row's other real tokens are
    one packed row instead: one forward, no padding (`group_pack.common_prefix_packed`).

    None, and the caller runs its usual forward, where the model's plan does not say so (`plan.common_prefix`: off
    where a forward is a collective across ranks, ZeRO-3, since ranks would differ in how many forwards they run),
    when the rows share fewer than `MIN_COMMON_PREFIX` tokens or it would compute no fewer tokens than the rows'
    real ones, or when the model cannot take a cache here (`shares_prefixes`, `full_attention_cache`)."""
    if not plan.common_prefix:
        return None
    layout = common_prefix_layout(input_ids, attention_mask, keep) if shares_prefixes(model) else None
    if layout is None:
        return None
    start, length, full_mask = layout
    if kind != "logits" and group_packing(model, plan) and contiguous_rows(attention_mask):  # one forward, no cache
        return common_prefix_packed(model, input_ids, attention_mask, length, keep, kind)
    cache = full_attention_cache(model)
    if cache is None:
        return None
    rows, cut = input_ids.size(0), input_ids.size(1) - full_mask.size(1) + length
    cache.layers = [PrefixLayer() for _ in cache.layers]
    positions = torch.arange(length, device=input_ids.device)[None]
    kwargs = dict(input_ids=input_ids[:1, start:start + length], position_ids=positions, use_cache=True,
                  **cache_kwargs(model, cache))
    try:
        try:
            model(**kwargs, logits_to_keep=1)
        except TypeError as exc:  # a scalar model (no logits_to_keep) runs its head on the prefix: H -> 1, cheap
            if "logits_to_keep" not in str(exc):
                raise
            model(**kwargs)
    except TypeError as exc:  # a model class that takes no cache here
        if any(name in str(exc) for name in ("past_key_values", "'cache'", "use_cache")):
            return None
        raise
    for layer in cache.layers:  # one row for every row, by broadcast: the gradient sums over the rows
        layer.keys, layer.values = (x.expand(rows, *x.shape[1:]) for x in (layer.keys, layer.values))
    kwargs = dict(input_ids=input_ids[:, cut:], attention_mask=full_mask,
                  position_ids=position_ids(attention_mask)[:, cut:], use_cache=True, **cache_kwargs(model, cache))
    if kind == "hidden":
        out = hidden_states(model, **kwargs)
    elif kind == "scores":
        out = scalar_outputs(model, **kwargs)
    else:
        try:
            out = model(**kwargs, logits_to_keep=keep).logits
        except TypeError as exc:
            if "logits_to_keep" not in str(exc):
                raise
            out = model(**kwargs).logits
    return out[:, -keep:]
