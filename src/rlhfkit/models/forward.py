"""Padding-safe forward passes shared by every stage.

Two rules make results independent of padding side and of pad == EOS:
- position ids come from the attention mask (cumsum - 1), so a left-padded row sees the same positions as
  the same row unpadded (HF's default positions would start at the pad count);
- a sequence's score is read at the last position whose attention mask is 1, never by searching for the
  first pad id (which breaks for left padding and when pad == EOS: TRL #2778 #3750, OpenRLHF #238).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from rlhfkit.algos import last_valid_index
from rlhfkit.data.tokenize import pack_bins
from rlhfkit.models.cpu_linear import FastCPULinear, layer_matmul
from rlhfkit.models.lora import base_model, checkpointed
from rlhfkit.models.segments import packed_attention, packed_row_tokens

HEAD_NAMES = ("score", "classifier", "v_head")


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counting only real tokens; pads get 0 (they are masked anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def causal_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """(B, T, V) next-token logits of a causal LM, for any padding side.

    With `keep` > 0 only the last `keep` positions, (B, keep, V): the LM head skips the others
    (transformers' `logits_to_keep`), which saves its matmul and a (B, T, V) tensor, forward and backward.
    """
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                  use_cache=False)
    if keep <= 0 or keep >= input_ids.size(1):
        return model(**kwargs).logits
    try:
        return model(**kwargs, logits_to_keep=keep).logits
    except TypeError as exc:  # a model class without logits_to_keep: full logits, then the last `keep`
        if "logits_to_keep" not in str(exc):
            raise
        return model(**kwargs).logits[:, -keep:]


def packed_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """(N, T, V) logits of packed rows (`data.tokenize.collate_packed`): no attention mask, positions that
    restart at 0 for every sequence, from which transformers builds the block-diagonal causal mask (with
    `segments.packed_attention`: attention runs per sequence instead, where the model allows it)."""
    with packed_attention(model):
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False).logits


def lm_head_weight(model) -> torch.Tensor | None:
    """The (V, H) weight of `model`'s LM head when it is a plain bias-free linear layer whose weight is held here
    (not a ZeRO-3 shard, not a LoRA or quantised wrapper), else None: then only the model's own head will do."""
    head = base_model(model).get_output_embeddings()
    if type(head) not in (torch.nn.Linear, FastCPULinear) or head.bias is not None or head.weight.numel() == 0:
        return None
    return head.weight


@contextlib.contextmanager
def decoder_outputs(model):
    """Collects, in call order, the (N, T, H) hidden states that `model`'s LM head reads: its decoder's output,
    captured by a hook on the model's own forward (engine hooks, autocast and checkpointing all apply)."""
    captured = []

    def grab(_module, _inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = base_model(model).get_decoder().register_forward_hook(grab)
    try:
        yield captured
    finally:
        handle.remove()


def hidden_states(model, **kwargs) -> torch.Tensor:
    """(N, T, H) hidden states that `model`'s LM head would read, from the model's own forward with `kwargs`
    (`decoder_outputs`); the head runs on one position per row only."""
    with decoder_outputs(model) as captured:
        try:
            model(**kwargs, logits_to_keep=1)
        except TypeError as exc:  # a model class without logits_to_keep
            if "logits_to_keep" not in str(exc):
                raise
            model(**kwargs)
    return captured[-1]


def final_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 positions: torch.Tensor) -> torch.Tensor:
    """(N, T, H) hidden states that `model`'s LM head would read at every position of a causal forward
    (`hidden_states`)."""
    return hidden_states(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         use_cache=False)


# config attributes of models whose logits are not the head's output (a soft cap or a scale after the head)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling",
                     "output_logits_scaling")
_HEAD_LOGPROBS: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


@torch.no_grad()
def head_gives_logits(model, rtol: float = 1e-4) -> bool:
    """Whether `model`'s logits are its LM head applied to its decoder's output (`lm_head_weight`, then
    `decoder_outputs`), checked once on a few tokens: a model that changes its logits after the head (Gemma 2's
    soft cap, Cohere's or Granite's scale) is refused by its config and, for anything else, by the values."""
    weight = lm_head_weight(model)
    if weight is None:
        return False
    config = base_model(model).config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and not ("scal" in name and value == 1):  # a scale of 1 changes nothing
            return False
    ids = (torch.arange(8, device=weight.device) * 7 + 3).remainder(weight.size(0))[None]
    was_training = base_model(model).training
    model.eval()
    try:
        with decoder_outputs(model) as captured:
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        model.train(was_training)
    hidden = captured[-1]
    expected = (hidden.to(weight.dtype) @ weight.T).float()
    return bool(torch.allclose(logits.float(), expected, rtol=rtol, atol=rtol))


def use_head_logprobs(model, on: bool) -> None:
    """Record for `model` whether its response log-probs may run its LM head in chunks on the hidden states
    (`head_logprobs_weight`); decided once per run (`stages.common.choose_head_logprobs`)."""
    _HEAD_LOGPROBS[base_model(model)] = on


def head_logprobs_weight(model) -> torch.Tensor | None:
    """The LM head's (V, H) weight when `use_head_logprobs(model, True)` was recorded and the head is a plain
    linear layer held here (`lm_head_weight`), else None: then log-probs come from the model's own logits."""
    if not _HEAD_LOGPROBS.get(base_model(model), False):
        return None
    return lm_head_weight(model)


def head_matmul(model):
    """The GEMM for `model`'s LM head weight used outside the head (`cpu_linear.layer_matmul`), or None."""
    return layer_matmul(base_model(model).get_output_embeddings())


def custom_mask_kind(model) -> str | None:
    """How `model` takes a custom (N, 1, T, T) attention mask: "bool" (sdpa: True = attend), "additive" (eager: 0 or
    the dtype's minimum, added to the scores), or None (flash and other kernels take none)."""
    kind = getattr(base_model(model).config, "_attn_implementation", None)
    return {"sdpa": "bool", "eager": "additive"}.get(kind)


@functools.lru_cache(maxsize=None)
def _keeps_flagged_positions() -> bool:
    """Whether this transformers' `logits_to_keep` takes a (N, T) bool tensor (the flagged positions' logits,
    flattened); older versions take an int or a 1D index only."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep

        flags = torch.tensor([[True, False, True], [False, True, False]])
        return tuple(slice_logits_to_keep(torch.zeros(2, 3, 1), flags).shape) == (3, 1)
    except Exception:  # noqa: BLE001 - no such helper, or it refuses the tensor
        return False


def masked_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor,
                  keep: torch.Tensor, hidden: bool = False) -> torch.Tensor | None:
    """(K, V) logits at the K True positions of `keep` (N, T), in row-major order, of a forward of (N, T) rows under
    the custom attention mask `allowed` (N, 1, T, T) bool (query, key). The LM head runs on those positions only
    where transformers can say so. None when the model takes no custom mask (`custom_mask_kind`).

    With `hidden`, (K, H): the hidden states the LM head would read there (`decoder_outputs`), the head itself run
    on one position per row."""
    kind = custom_mask_kind(model)
    if kind is None:
        return None
    mask = allowed
    if kind == "additive":
        dtype = next(base_model(model).parameters()).dtype
        blocked = torch.finfo(dtype).min
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, blocked)
    kwargs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
    if hidden:
        return hidden_states(model, **kwargs)[keep]
    if _keeps_flagged_positions():
        try:
            logits = model(**kwargs, logits_to_keep=keep).logits
            return logits.reshape(-1, logits.size(-1))  # (K, V), whatever leading shape the model gave
        except TypeError as exc:  # a model class without logits_to_keep
            if "logits_to_keep" not in str(exc):
                raise
    return model(**kwargs).logits[keep]


def shares_prefixes(model) -> bool:
    """Whether a forward may compute a prompt shared by several rows once and reuse its KV cache: not while
    a model with gradient checkpointing is in training mode. transformers then drops the cache inside every
    layer, with or without autograd (so a no-grad forward of the training actor, its old log-probs or the
    reference with the LoRA adapter off, would run the responses without their prompt)."""
    return not (base_model(model).training and checkpointed(model))


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
                         response_mask: torch.Tensor, always: bool = False,
                         hidden: bool = False) -> torch.Tensor | None:
    """(B, R, V) logits predicting each response token, with every distinct prompt computed once.

    GRPO and RLOO sample several responses of one prompt, and the prompt is often the longer part. The distinct
    prompts (left-padded, identical rows merged) run one forward that fills the KV cache and gives the logits of
    each response's first token; the cache is then indexed out to every row, and the responses run against it.
    Gradients flow through the shared cache into the prompt's forward, so the result and its gradient equal
    the full forward's (up to float rounding). None when no two rows share a prompt, or when the model cannot
    take a cache here (`shares_prefixes`, or a model class without `past_key_values` / `logits_to_keep`).

    With `always`, the two forwards run even when no prompt repeats: under ZeRO-3 every forward is a
    collective, so each rank must make the same number of calls whatever its rows (callers pass a setting
    that holds for every rank: the run samples groups).

    With `hidden`, (B, R, H): the hidden states the LM head would read at those positions (`decoder_outputs`),
    the head itself run on one position per forward.
    """
    if not shares_prefixes(model):
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
    mask = prompt_mask.long()[first]
    capture = decoder_outputs(model) if hidden else contextlib.nullcontext([])
    try:
        with capture as captured:
            out = model(input_ids=prompt_ids[first], attention_mask=mask, position_ids=position_ids(mask),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
    except TypeError as exc:  # a model class without these arguments
        if any(name in str(exc) for name in ("logits_to_keep", "past_key_values", "use_cache")):
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
                  position_ids=position_ids(full_mask)[:, width:-1], past_key_values=cache, use_cache=True)
    if hidden:
        rest = hidden_states(model, **kwargs)
    else:
        rest = model(**kwargs).logits
    return torch.cat([head.to(rest.dtype), rest], dim=1)


def scalar_head(model) -> torch.nn.Module | None:
    """The scalar head of a reward model or critic (one of `HEAD_NAMES`), or None (a causal LM)."""
    plain = base_model(model)
    return next((head for head in (getattr(plain, name, None) for name in HEAD_NAMES)
                 if isinstance(head, torch.nn.Module)), None)


def _head(model) -> torch.nn.Module:
    head = scalar_head(model)
    if head is None:
        raise TypeError(f"{type(base_model(model)).__name__} has no scalar head named one of {HEAD_NAMES}")
    return head


MIN_COMMON_PREFIX = 8  # tokens: a shorter shared run saves less than the second forward costs
_COMMON_PREFIX: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def use_common_prefix(model, on: bool) -> None:
    """Record for `model` whether its forwards over rollout rows may compute the tokens every row begins with once
    (`common_prefix_outputs`); decided once per run (`stages.common.choose_common_prefix`)."""
    _COMMON_PREFIX[base_model(model)] = on


def shares_common_prefix(model) -> bool:
    """Whether `use_common_prefix(model, True)` was recorded."""
    return _COMMON_PREFIX.get(base_model(model), False)


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


def _common_prefix_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int,
                           kind: str) -> torch.Tensor | None:
    """`common_prefix_outputs` without the per-run record (the check `common_prefix_gives_full_values` uses it)."""
    layout = common_prefix_layout(input_ids, attention_mask, keep) if shares_prefixes(model) else None
    cache = full_attention_cache(model) if layout is not None else None
    if cache is None:
        return None
    start, length, full_mask = layout
    rows, cut = input_ids.size(0), input_ids.size(1) - full_mask.size(1) + length
    cache.layers = [PrefixLayer() for _ in cache.layers]
    positions = torch.arange(length, device=input_ids.device)[None]
    kwargs = dict(input_ids=input_ids[:1, start:start + length], position_ids=positions, past_key_values=cache,
                  use_cache=True)
    try:
        try:
            model(**kwargs, logits_to_keep=1)
        except TypeError as exc:  # a scalar model (no logits_to_keep) runs its head on the prefix: H -> 1, cheap
            if "logits_to_keep" not in str(exc):
                raise
            model(**kwargs)
    except TypeError as exc:  # a model class that takes no cache here
        if any(name in str(exc) for name in ("past_key_values", "use_cache")):
            return None
        raise
    for layer in cache.layers:  # one row for every row, by broadcast: the gradient sums over the rows
        layer.keys, layer.values = (x.expand(rows, *x.shape[1:]) for x in (layer.keys, layer.values))
    kwargs = dict(input_ids=input_ids[:, cut:], attention_mask=full_mask,
                  position_ids=position_ids(attention_mask)[:, cut:], past_key_values=cache, use_cache=True)
    if kind == "hidden":
        out = hidden_states(model, **kwargs)
    elif kind == "scores":
        out = _scores(model, **kwargs)
    else:
        try:
            out = model(**kwargs, logits_to_keep=keep).logits
        except TypeError as exc:
            if "logits_to_keep" not in str(exc):
                raise
            out = model(**kwargs).logits
    return out[:, -keep:]


def common_prefix_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int,
                          kind: str = "hidden") -> torch.Tensor | None:
    """The outputs at the last `keep` columns of a forward over left-padded (B, T) rows, with the tokens that every
    row begins with computed once: `kind` "hidden" (B, keep, H), the hidden states the LM head reads
    (`decoder_outputs`); "logits" (B, keep, V); "scores" (B, keep), a scalar model's outputs (`token_scores`).

    Chat templates put the same system prompt and turn markers before every question (SmolLM2's are 27 of the 38
    tokens of "What is 3 + 4?"), so a rollout's rows often share most of their prompt. The shared run goes
    through the model once, as one row, filling the KV cache; the cache is broadcast to every row and the rest of
    each row runs against it, with the positions it has in the full row. Gradients flow through the broadcast
    into the prefix's forward, so values and gradients equal the full forward's (up to float rounding).

    None, and the caller runs its usual forward, when not recorded for `model` (`use_common_prefix`: off where a
    forward is a collective across ranks, ZeRO-3, since ranks would differ in how many forwards they run), when
    the rows share fewer than `MIN_COMMON_PREFIX` tokens or it would compute no fewer tokens than the rows' real
    ones, or when the model cannot take a cache here (`shares_prefixes`, `full_attention_cache`)."""
    if not shares_common_prefix(model):
        return None
    return _common_prefix_outputs(model, input_ids, attention_mask, keep, kind)


@torch.no_grad()
def common_prefix_gives_full_values(model, rtol: float = 1e-4) -> bool:
    """Whether `common_prefix_outputs` matches `model`'s plain forward, checked once on three rows that share
    `MIN_COMMON_PREFIX` + 2 tokens, two of them left-padded: a model that reads the cache or positions its own
    way is refused by the values."""
    scalar = scalar_head(model) is not None
    device = next(base_model(model).parameters()).device
    vocab = getattr(base_model(model).config, "vocab_size", None) or 2
    shared = MIN_COMMON_PREFIX + 2
    ids = (torch.arange(3 * 16, device=device).view(3, 16) * 7 + 3).remainder(vocab)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 3)):
        ids[row, pad:pad + shared] = (torch.arange(shared, device=device) * 5 + 1).remainder(vocab)
        mask[row, :pad] = 0
    keep = 3
    was_training = base_model(model).training
    model.eval()
    try:
        kind = "scores" if scalar else "hidden"
        got = _common_prefix_outputs(model, ids, mask, keep, kind)
        if got is None:
            return False
        if scalar:
            full = token_scores(model, ids, mask)[:, -keep:]
        else:
            full = final_hidden(model, ids, mask, position_ids(mask))[:, -keep:]
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    finally:
        model.train(was_training)
    return bool(torch.allclose(got.float(), full.float(), rtol=rtol, atol=rtol))


def _scores(model, **kwargs) -> torch.Tensor:
    """(B, T) scalar output of a sequence-classification model at every position of its forward with `kwargs`."""
    captured = {}

    def grab(_module, _inputs, output):
        captured["out"] = output

    handle = _head(model).register_forward_hook(grab)
    try:
        model(**kwargs)
    finally:
        handle.remove()
    return captured["out"].squeeze(-1).float()


def token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) scalar output of a sequence-classification model at every position (critic values).

    HF's forward pools internally by pad id; we capture the head's per-token output with a hook instead,
    so the same model class serves as reward model (one score) and critic (a value per token). Packed rows
    (`data.tokenize.collate_packed_pairs`) pass `positions` and no attention mask.
    """
    return _scores(model, input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask) if positions is None else positions, use_cache=False)


def packed_sequence_scores(model, input_ids: torch.Tensor, positions: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(S,) scores of packed sequences, each read at its last token: `ends` (S, 2) holds (row, column);
    attention per sequence where the model allows it (`segments.packed_attention`)."""
    with packed_attention(model):
        scores = token_scores(model, input_ids, None, positions)
    return scores[ends[:, 0], ends[:, 1]]


_PADDING_FREE: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def use_padding_free(model, on: bool) -> None:
    """Record for `model` whether its forwards over padded rollout rows (response hidden states, values, reward
    scores) run padding-free (`packed_outputs`); decided once per run (`stages.common.choose_padding_free`)."""
    _PADDING_FREE[base_model(model)] = on


def padding_free(model) -> bool:
    """Whether `use_padding_free(model, True)` was recorded."""
    return _PADDING_FREE.get(base_model(model), False)


def pack_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                capacity: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The real tokens of a padded batch (any padding side; the tokens whose mask is 1) packed without padding:
    `(ids, positions, where)`. `ids` and `positions` are (N, W): rows concatenated into bins of at most
    `capacity` tokens (`data.tokenize.pack_bins`; None = as long as the longest row), positions restarting at 0
    for every row as `position_ids(attention_mask)` numbers them, a bin's unused tail a segment of its own.
    `where` (B, T) is the index into the flattened (N * W) packed tokens of each padded position, -1 on padding.
    """
    mask = attention_mask.bool()
    lengths = mask.sum(-1).tolist()
    rows = [i for i, n in enumerate(lengths) if n > 0]
    bins = pack_bins([lengths[i] for i in rows], max(max(lengths), capacity or 0))
    width = max(sum(lengths[rows[j]] for j in members) for members in bins)
    starts = [0] * len(lengths)
    flat_positions = torch.zeros(len(bins) * width, dtype=torch.long)
    for b, members in enumerate(bins):
        column = b * width
        for j in members:
            starts[rows[j]] = column
            column += lengths[rows[j]]
        flat_positions[column:(b + 1) * width] = torch.arange((b + 1) * width - column)  # the tail's segment
    positions = position_ids(attention_mask)
    where = (torch.tensor(starts, device=mask.device)[:, None] + positions).masked_fill(~mask, -1)
    real = where[mask]
    flat_ids = input_ids.new_zeros(len(bins) * width)
    flat_ids[real] = input_ids[mask]
    flat_positions = flat_positions.to(mask.device)
    flat_positions[real] = positions[mask]
    return flat_ids.view(len(bins), width), flat_positions.view(len(bins), width), where


def unpack_states(states: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """(B, heads, P, D) keys or values in the left-padded layout from (N, heads, W, D) ones computed on the packed
    rows of `pack_padded` (`where` (B, P): each padded position's index into the N x W packed tokens,
    -1 on padding, which gets zeros: the attention mask hides it)."""
    rows, heads, width, dim = states.shape
    flat = states.transpose(1, 2).reshape(rows * width, heads, dim)
    padded = flat[where.clamp(min=0)].masked_fill((where < 0)[..., None, None], 0)  # (B, P, heads, D)
    return padded.transpose(1, 2)


def packed_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   scores: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token outputs of a padded batch from one padding-free forward (`pack_padded`, bins of
    `segments.packed_row_tokens` tokens, attention per sequence where the model allows it): `(flat, where)`, with
    `flat` (N * W, H) the hidden states the LM head reads (`hidden_states`) or, with `scores`, (N * W,) a scalar
    model's outputs (`token_scores`), and `where` (B, T) the row of `flat` for each padded position (-1 on
    padding). Equal to the padded forward's at every real token, to float rounding: positions, and the tokens
    each attends to, are the same; no compute is spent on padding."""
    ids, positions, where = pack_padded(input_ids, attention_mask, packed_row_tokens(model))
    with packed_attention(model):
        if scores:
            flat = token_scores(model, ids, None, positions).flatten()
        else:
            flat = hidden_states(model, input_ids=ids, attention_mask=None, position_ids=positions, use_cache=False)
            flat = flat.flatten(0, 1)
    return flat, where


def read_packed(flat: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """`flat`'s rows at `where` (any shape, from `packed_outputs`): the padded layout, zeros where `where` is -1."""
    out = flat[where.clamp(min=0)]
    keep = (where >= 0).view(*where.shape, *([1] * (flat.dim() - 1)))
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


@torch.no_grad()
def packing_gives_padded_values(model, rtol: float = 1e-4) -> bool:
    """Whether `model`'s padding-free forward (`packed_outputs`) matches its padded one, checked once on two short
    rows, left-padded: a model whose attention ignores packed positions (it would attend across sequences) or
    that reads positions its own way is refused by the values."""
    scalar = scalar_head(model) is not None
    device = next(base_model(model).parameters()).device
    vocab = getattr(base_model(model).config, "vocab_size", None) or 2
    ids = (torch.arange(12, device=device).view(2, 6) * 7 + 3).remainder(vocab)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row: 3 tokens after left padding
    was_training = base_model(model).training
    model.eval()
    try:
        if scalar:
            padded = token_scores(model, ids, mask)
        else:
            padded = final_hidden(model, ids, mask, position_ids(mask)).float()
        flat, where = packed_outputs(model, ids, mask, scores=scalar)
    finally:
        model.train(was_training)
    real = mask.bool()
    return bool(torch.allclose(flat.float()[where[real]], padded[real], rtol=rtol, atol=rtol))


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading and trailing columns that are padding in every row: the same results (positions come
    from the mask) for less compute when the rows are shorter than the tensor."""
    real = attention_mask.bool().any(0)
    if not real.any():
        return input_ids, attention_mask
    columns = real.nonzero()
    first, last = int(columns[0]), int(columns[-1]) + 1
    return input_ids[:, first:last], attention_mask[:, first:last]


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) reward-model score read at each row's last real token (left or right padding); padding-free where
    recorded for `model` (`use_padding_free`)."""
    if padding_free(model):
        flat, where = packed_outputs(model, input_ids, attention_mask, scores=True)
        return flat[where.gather(1, last_valid_index(attention_mask)[:, None]).squeeze(1)]
    input_ids, attention_mask = trim_padding(input_ids, attention_mask)
    scores = token_scores(model, input_ids, attention_mask)
    idx = last_valid_index(attention_mask)
    return scores.gather(1, idx[:, None]).squeeze(1)
