"""Attention of packed rows computed per sequence instead of under a block-diagonal mask.

Packed SFT and RM micro-batches (`data.tokenize.collate_packed`, `collate_packed_pairs`) put several sequences in
one row with positions that restart at 0 for each; transformers then builds a (rows, 1, T, T) block-diagonal
causal mask and PyTorch's CPU flash kernel, given a mask, computes every (query, key) block of the row, across
sequences and above the diagonal, only to mask it. With `packed_attention(model)` open, the model's attention is
`segment_attention` (registered with transformers' `AttentionInterface`): it reads the sequence boundaries from
the `position_ids` the model passes to every attention layer (a position that is not its predecessor's + 1 starts
a sequence, as `transformers.masking_utils.find_packed_sequence_indices` has it) and runs the same
`scaled_dot_product_attention` once per sequence with `is_causal=True`, which skips the blocks above the diagonal.
The arithmetic per row falls from T^2 to the sum of its sequences' l^2 / 2 (profiled on SmolLM2's RM micro-batches
of 4 pairs: attention 4.3 -> 2.9 s of a 28 s forward and backward of three of them), so a row may be long: such a
model packs a micro-batch into one row without padding (`packed_row_tokens`). Values equal the masked kernel's
to float rounding (tested; the packing checks of SFT and RM run through it).

Used by the packed forwards (`forward.packed_logits`, `packed_sequence_scores`, `packed_outputs`, SFT's loss, the
rollout's packed prefill) where the model's speed plan has `segment_attention` (a CPU, `sdpa` attention, every layer
plain full attention: `speed.registry`), and not while a model trains with gradient checkpointing (the
recomputation in backward runs after the context has closed and would take the masked path). The caller passes the
sequences' spans to the attention as a keyword argument of the forward (`packed_attention` yields it): only a forward
of packed rows without a padding mask has them, and every layer reads the same list. A layer with anything else
(a sliding window, a soft cap, a query shorter than the keys) runs transformers' own `sdpa_attention_forward` with
the block-diagonal mask transformers built from the positions.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlhfkit.lora import attention_implementation, base_model, checkpointed

NAME = "rlhfkit_segments"
SPANS = "rlhfkit_spans"  # the forward's keyword argument that carries the spans to every layer


def sequence_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) column spans of the sequences packed in it: a new one starts wherever a position
    is not the previous position + 1 (the first column always starts one)."""
    rows, width = position_ids.shape
    if width == 0:
        return [[] for _ in range(rows)]
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    spans = []
    for row in starts.tolist():
        begin = [c for c, s in enumerate(row) if s]
        spans.append(list(zip(begin, begin[1:] + [width])))
    return spans


def segment_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (B, H, T, D) query, (B, H_kv, T, D) key and value; returns (B, T, H, D)."""
    positions = kwargs.get("position_ids")
    spans = kwargs.pop(SPANS, None)  # given by the caller of a packed forward without a padding mask only
    plain = (spans is None or positions is None or len(spans) != query.shape[0]
             or positions.dim() != 2 or positions.shape[-1] != query.shape[2] or query.shape[2] != key.shape[2]
             or not getattr(module, "is_causal", True) or kwargs.get("sliding_window") is not None
             or kwargs.get("softcap") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = query.shape[1] // key.shape[1]
    # the projections' (B, T, heads, D) layout, cut along T with unbind and split (not slicing): each piece's
    # gradient lands in one contiguous buffer laid out as the projection's output, as the masked kernel's does
    rows = []
    for q, k, v, row in zip(query.transpose(1, 2).unbind(0), key.transpose(1, 2).unbind(0),
                            value.transpose(1, 2).unbind(0), spans):
        lengths = [e - s for s, e in row]
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
            out = torch.nn.functional.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0), repeat_kv(ks.transpose(0, 1).unsqueeze(0), groups),
                repeat_kv(vs.transpose(0, 1).unsqueeze(0), groups), dropout_p=dropout, is_causal=True, scale=scaling)
            rows.append(out.transpose(1, 2))  # (1, l, heads, D)
    return torch.cat(rows, dim=1).view(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None


AttentionInterface.register(NAME, segment_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the fallback path reads transformers' own mask


def full_attention_cache(model) -> DynamicCache | None:
    """An empty transformers DynamicCache for `model` when every layer of it is plain full attention (a cache
    whose rows can be indexed and extended freely); None for sliding windows, hybrids and unusual configs."""
    try:
        cache = DynamicCache(config=base_model(model).config)
    except Exception:  # noqa: BLE001 - an unusual config: let the model choose its cache
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    return cache


ROW_TOKENS = 4096  # a packed row's length where attention runs per sequence: one row for most micro-batches


def packed_row_tokens(model, plan, inference: bool = False) -> int | None:
    """How many tokens a packed row may hold for `model` (`data.tokenize.collate_packed`'s `capacity`):
    `ROW_TOKENS` where its attention runs per sequence (`plan.segment_attention`; a long row then costs no attention
    across sequences, and a micro-batch in one row has no padding at all), else None, bins as long as the longest
    sequence (under a mask, attention costs the square of the row's length). `inference`: for a forward without
    autograd (the rollout's prefill), where gradient checkpointing recomputes nothing."""
    return ROW_TOKENS if plan.segment_attention and (inference or not checkpointed(model)) else None


def _usable(model) -> bool:
    inner = base_model(model)
    return (getattr(inner.config, "_attn_implementation", None) == "sdpa"
            and not (inner.training and checkpointed(inner)))


@contextlib.contextmanager
def packed_attention(model, plan, position_ids: torch.Tensor):
    """While open, `model`'s attention runs per packed sequence (see the module doc) where its plan says so
    (`plan.segment_attention`) and it can now (not training with gradient checkpointing); the configured
    implementation is restored on exit. Yields the keyword arguments the packed forward passes to the model: the
    sequences' spans of each row of `position_ids` (N, T), or {} (transformers' masked attention)."""
    if not (plan.segment_attention and _usable(model)):
        yield {}
        return
    with attention_implementation(model, NAME):
        yield {SPANS: sequence_spans(position_ids)}
