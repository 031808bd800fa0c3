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
import inspect

import torch

from rlhfkit.algos import last_valid_index
from rlhfkit.data.tokenize import pack_bins
from rlhfkit.accel.cpu_linear import FastCPULinear, layer_matmul
from rlhfkit.lora import base_model
from rlhfkit.models.segments import packed_attention, packed_row_tokens

HEAD_NAMES = ("score", "classifier", "v_head")


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counting only real tokens; pads get 0 (they are masked anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """`{keyword: cache}`: a KV cache passed to `model`'s forward under the name its class takes, `cache` since
    transformers 5.24 (`past_key_values` warns there and goes in 5.40), `past_key_values` before. An unknown
    keyword would vanish into the model's **kwargs and decode without the cache, so the name is read from the
    class's signature, not assumed."""
    return {_cache_keyword(type(base_model(model))): cache}


def returned_cache(output):
    """The KV cache a forward returned: `output.cache`, or `output.past_key_values` before transformers 5.24."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


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


def packed_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor, plan) -> torch.Tensor:
    """(N, T, V) logits of packed rows (`data.tokenize.collate_packed`): no attention mask, positions that
    restart at 0 for every sequence, from which transformers builds the block-diagonal causal mask (with
    `plan.segment_attention`: attention runs per sequence instead, `segments.packed_attention`)."""
    with packed_attention(model, plan, position_ids) as spans:
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False,
                     **spans).logits


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
                 positions: torch.Tensor, **extra) -> torch.Tensor:
    """(N, T, H) hidden states that `model`'s LM head would read at every position of a causal forward
    (`hidden_states`); `extra`: more keyword arguments of the forward (a packed forward's spans)."""
    return hidden_states(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         use_cache=False, **extra)


def head_logprobs_weight(model, plan) -> torch.Tensor | None:
    """The LM head's (V, H) weight where `model`'s plan runs the head in chunks on the hidden states
    (`plan.head_chunks`) and the head is a plain linear layer held here (`lm_head_weight`), else None: then
    log-probs come from the model's own logits."""
    return lm_head_weight(model) if plan.head_chunks else None


def mixed_precision(plan):
    """The autocast the model's forward runs under (`plan.autocast`: the local engine's `engine.precision=bf16`
    hooks), for the code that does part of the forward's work outside it: the LM head in chunks
    (`algos.linear_token_logprobs`, `linear_lm_loss_sum`) then multiplies in bf16 as the model's own head would,
    not in float32. A no-op context for a model without it (float32; DeepSpeed's bf16, whose weights are bf16)."""
    spec = plan.autocast
    return torch.autocast(spec[0], dtype=spec[1]) if spec else contextlib.nullcontext()


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


def scalar_outputs(model, **kwargs) -> torch.Tensor:
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
    return scalar_outputs(model, input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask) if positions is None else positions, use_cache=False)


def packed_sequence_scores(model, input_ids: torch.Tensor, positions: torch.Tensor, ends: torch.Tensor,
                           plan) -> torch.Tensor:
    """(S,) scores of packed sequences, each read at its last token: `ends` (S, 2) holds (row, column);
    attention per sequence where the plan says so (`segments.packed_attention`)."""
    with packed_attention(model, plan, positions) as spans:
        scores = scalar_outputs(model, input_ids=input_ids, attention_mask=None, position_ids=positions,
                                use_cache=False, **spans)
    return scores[ends[:, 0], ends[:, 1]]


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


def packed_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, plan,
                   scores: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token outputs of a padded batch from one padding-free forward (`pack_padded`, bins of
    `segments.packed_row_tokens` tokens, attention per sequence where the plan says so): `(flat, where)`, with
    `flat` (N * W, H) the hidden states the LM head reads (`hidden_states`) or, with `scores`, (N * W,) a scalar
    model's outputs (`token_scores`), and `where` (B, T) the row of `flat` for each padded position (-1 on
    padding). Equal to the padded forward's at every real token, to float rounding: positions, and the tokens
    each attends to, are the same; no compute is spent on padding."""
    ids, positions, where = pack_padded(input_ids, attention_mask, packed_row_tokens(model, plan))
    kwargs = dict(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=False)
    with packed_attention(model, plan, positions) as spans:
        if scores:
            flat = scalar_outputs(model, **kwargs, **spans).flatten()
        else:
            flat = hidden_states(model, **kwargs, **spans).flatten(0, 1)
    return flat, where


def read_packed(flat: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """`flat`'s rows at `where` (any shape, from `packed_outputs`): the padded layout, zeros where `where` is -1."""
    out = flat[where.clamp(min=0)]
    keep = (where >= 0).view(*where.shape, *([1] * (flat.dim() - 1)))
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading and trailing columns that are padding in every row: the same results (positions come
    from the mask) for less compute when the rows are shorter than the tensor."""
    real = attention_mask.bool().any(0)
    if not real.any():
        return input_ids, attention_mask
    columns = real.nonzero()
    first, last = int(columns[0]), int(columns[-1]) + 1
    return input_ids[:, first:last], attention_mask[:, first:last]


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, plan) -> torch.Tensor:
    """(B,) reward-model score read at each row's last real token (left or right padding); padding-free where
    the model's plan says so (`plan.padding_free`)."""
    if plan.padding_free:
        flat, where = packed_outputs(model, input_ids, attention_mask, plan, scores=True)
        return flat[where.gather(1, last_valid_index(attention_mask)[:, None]).squeeze(1)]
    input_ids, attention_mask = trim_padding(input_ids, attention_mask)
    scores = token_scores(model, input_ids, attention_mask)
    idx = last_valid_index(attention_mask)
    return scores.gather(1, idx[:, None]).squeeze(1)
