"""The exactness checks of the speed paths: each runs a path against the plain forward on a few tokens (or the
run's first rows) and says whether they agree within a tolerance. `speed.registry` runs them once per model at
load, on every rank, for paths whose setting is null (auto); a path on by force skips its check.

Each takes the plan the path would run under (`trial`: the plan decided so far with the path on) and compares it
with the same forward without the path, in eval mode (dropout off), without gradients.
"""

from __future__ import annotations

import dataclasses

import torch

from rlhfkit.data.tokenize import collate_packed, collate_sft
from rlhfkit.models.forward import (cache_kwargs, decoder_outputs, final_hidden, lm_head_weight, packed_outputs,
                                    position_ids, scalar_head, token_scores)
from rlhfkit.models.group_pack import common_prefix_packed, group_packed_hidden
from rlhfkit.lora import base_model
from rlhfkit.models.prefix import MIN_COMMON_PREFIX, common_prefix_outputs, shared_prefix_logits
from rlhfkit.models.segments import packed_row_tokens
from rlhfkit.models.stage_forward import lm_forward, pair_scores
from rlhfkit.rollout.generate import kv_cache, prefill
from rlhfkit.rollout.group_decode import GroupCache, decoding_in_groups, group_cache
from rlhfkit.models.plan import REFERENCE, ModelPlan

# config attributes of models whose logits are not the head's output (a soft cap or a scale after the head)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling",
                     "output_logits_scaling")
# what a path that a model cannot run raises inside a check: the check then says no
FAILURES = (RuntimeError, TypeError, ValueError, NotImplementedError)


class _eval:
    """`model` in eval mode for the block (dropout off), its mode restored after."""

    def __init__(self, model):
        self.model, self.was_training = model, base_model(model).training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


def _close(got: torch.Tensor, expected: torch.Tensor, rtol: float) -> bool:
    return bool(torch.allclose(got.float(), expected.float(), rtol=rtol, atol=rtol))


def _relative_max(plain: torch.Tensor, fast: torch.Tensor) -> float:
    return float((plain - fast).abs().max() / plain.abs().max().clamp(min=1e-6))


def _vocab(model) -> int:
    return getattr(base_model(model).config, "vocab_size", None) or 2


def _ids(model, rows: int, width: int) -> torch.Tensor:
    """(rows, width) deterministic token ids within the model's vocabulary, on its device."""
    device = next(base_model(model).parameters()).device
    return (torch.arange(rows * width, device=device).view(rows, width) * 7 + 3).remainder(_vocab(model))


@torch.no_grad()
def head_gives_logits(model, rtol: float = 1e-4) -> bool:
    """LM head in chunks: whether `model`'s logits are its LM head applied to its decoder's output
    (`forward.lm_head_weight`, then `decoder_outputs`), on 8 tokens. A model that changes its logits after the head
    (Gemma 2's soft cap, Cohere's or Granite's scale) is refused by its config and, for anything else, by the values."""
    weight = lm_head_weight(model)
    if weight is None:
        return False
    config = base_model(model).config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and not ("scal" in name and value == 1):  # a scale of 1 changes nothing
            return False
    ids = (torch.arange(8, device=weight.device) * 7 + 3).remainder(weight.size(0))[None]
    with _eval(model), decoder_outputs(model) as captured:
        logits = model(input_ids=ids, use_cache=False).logits
    expected = (captured[-1].to(weight.dtype) @ weight.T).float()
    return _close(logits, expected, rtol)


@torch.no_grad()
def packing_gives_padded_values(model, trial: ModelPlan, rtol: float = 1e-4) -> bool:
    """Padding-free forwards: whether `forward.packed_outputs` matches the padded forward, on two short rows, one
    left-padded. A model whose attention ignores packed positions (it would attend across sequences) or that reads
    positions its own way is refused by the values."""
    scalar = scalar_head(model) is not None
    ids = _ids(model, 2, 6)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row: 3 tokens after left padding
    with _eval(model):
        padded = token_scores(model, ids, mask) if scalar else final_hidden(model, ids, mask, position_ids(mask))
        flat, where = packed_outputs(model, ids, mask, trial, scores=scalar)
    real = mask.bool()
    return _close(flat[where[real]], padded[real], rtol)


@torch.no_grad()
def common_prefix_gives_full_values(model, trial: ModelPlan, rtol: float = 1e-4) -> bool:
    """The common prefix once: whether `prefix.common_prefix_outputs` (with the plan's group packing, where on)
    matches the plain forward, on three rows that share `MIN_COMMON_PREFIX` + 2 tokens, two of them left-padded."""
    scalar = scalar_head(model) is not None
    shared = MIN_COMMON_PREFIX + 2
    ids = _ids(model, 3, 16)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 3)):
        ids[row, pad:pad + shared] = (torch.arange(shared, device=ids.device) * 5 + 1).remainder(_vocab(model))
        mask[row, :pad] = 0
    keep = 3
    try:
        with _eval(model):
            kind = "scores" if scalar else "hidden"
            got = common_prefix_outputs(model, ids, mask, keep, trial, kind)
            if got is None:
                return False
            full = token_scores(model, ids, mask) if scalar else final_hidden(model, ids, mask, position_ids(mask))
    except FAILURES:
        return False
    return _close(got, full[:, -keep:], rtol)


@torch.no_grad()
def group_packing_gives_prefix_values(model, trial: ModelPlan, rtol: float = 1e-4) -> bool:
    """Prompts and responses in one packed row: whether it gives what the two-forward paths give. For a causal LM,
    `group_pack.group_packed_hidden` against `prefix.shared_prefix_logits`' hidden states (2 prompts, one
    left-padded, x 2 samples, one response cut short by EOS) and `common_prefix_packed` against the plain forward's
    hidden states; for a scalar model (a critic), `common_prefix_packed`'s scores against the plain forward's (3 rows
    sharing a run, two left-padded, one ending in padding). False where its attention takes options this path does
    not apply or does not receive the forward's keyword arguments."""
    if packed_row_tokens(model, trial, inference=not base_model(model).training) is None:  # as it would run now
        return False
    device = next(base_model(model).parameters()).device
    vocab = _vocab(model)
    two_forwards = dataclasses.replace(trial, group_packing=False, shared_prompt=True)
    ids = _ids(model, 3, 12)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 3)):  # a 6-token run every row begins with, after its left padding
        ids[row, pad:pad + 6] = (torch.arange(6, device=device) * 5 + 1).remainder(vocab)
        mask[row, :pad] = 0
    mask[0, -2:] = 0  # the first row ends early
    keep = 4
    try:
        with _eval(model):
            real = mask[:, -keep:].bool()
            if scalar_head(model) is not None:
                got = common_prefix_packed(model, ids, mask, 6, keep, "scores")[real]
                expected = token_scores(model, ids, mask)[:, -keep:][real]
            else:
                got = common_prefix_packed(model, ids, mask, 6, keep, "hidden")[real]
                expected = final_hidden(model, ids, mask, position_ids(mask))[:, -keep:][real]
                prompt_ids = (torch.arange(10, device=device).view(2, 5) * 5 + 3).remainder(vocab).repeat_interleave(
                    2, 0)
                prompt_mask = torch.ones_like(prompt_ids)
                prompt_mask[2:, :2] = 0  # the second prompt: 3 tokens after left padding
                response_ids = (torch.arange(16, device=device).view(4, 4) * 11 + 7).remainder(vocab)
                response_mask = torch.ones_like(response_ids)
                response_mask[1, 2:] = 0
                shared = shared_prefix_logits(model, prompt_ids, prompt_mask, response_ids, response_mask,
                                              two_forwards, hidden=True)
                first, inverse = torch.tensor([0, 2], device=device), torch.tensor([0, 0, 1, 1], device=device)
                packed = group_packed_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, first,
                                             inverse)
                if shared is None or packed is None:
                    return False
                valid = response_mask.bool()
                got, expected = torch.cat([got, packed[valid]]), torch.cat([expected, shared[valid]])
    except FAILURES:
        return False
    return _close(got, expected, rtol)


def _half(model) -> bool:
    """bf16 weights, or bf16 autocast over float32 weights: rounding ~1e-2 where float32's is ~1e-6."""
    weight = next(model.parameters())
    return weight.dtype != torch.float32 or torch.is_autocast_enabled(weight.device.type)


@torch.no_grad()
def packed_prefill_is_exact(model, trial: ModelPlan) -> bool:
    """The packed prefill: whether `rollout.generate.prefill` gives `model`'s own values packed, on 2 prompts of
    random ids (one left-padded): the logits after the prefill and after one decode step that reads the cache it
    left, within 1e-4 of the largest (5e-2 in half precision). False where the model's attention does not run per
    packed sequence over a cache."""
    if packed_row_tokens(model, trial, inference=True) is None or kv_cache(model, 1) is None:
        return False
    vocab = base_model(model).get_input_embeddings().weight.size(0)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(vocab, (2, 6), generator=generator).to(device)
    token = torch.randint(vocab, (2, 1), generator=generator).to(device)
    mask = torch.ones(2, 6, dtype=torch.long, device=device)
    mask[1, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    results = []
    try:
        with _eval(model):
            for packed in (False, True):
                plan = dataclasses.replace(REFERENCE, segment_attention=trial.segment_attention, packed_prefill=packed)
                cache, logits, _, _ = prefill(model, prompt_ids, mask, positions, 8, plan, groups_allowed=False)
                step = model(input_ids=token, attention_mask=torch.cat([mask, mask.new_ones(2, 1)], dim=1),
                             position_ids=positions[:, -1:] + 1, use_cache=True, **cache_kwargs(model, cache))
                results.append(torch.stack([logits, step.logits[:, -1]]).float())
    except FAILURES:
        return False
    return _relative_max(*results) < (5e-2 if _half(model) else 1e-4)


def _decode(model, prompt_ids, mask, tokens, grouped: bool) -> torch.Tensor:
    """Logits of every step of teacher-forced decoding, by the plain cache or the group path."""
    rows, steps = tokens.shape
    group = rows // prompt_ids.size(0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if grouped:
        cache = group_cache(model, steps)
        out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **cache_kwargs(model, cache))
        groups = GroupCache(cache, mask, group)
    else:
        cache = kv_cache(model, prompt_ids.size(1) + steps)
        repeat = torch.arange(prompt_ids.size(0), device=prompt_ids.device).repeat_interleave(group)
        prompt_ids, mask, positions = prompt_ids[repeat], mask[repeat], positions[repeat]
        out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **cache_kwargs(model, cache))
    logits = [out.logits[:, -1].repeat_interleave(group, 0) if grouped else out.logits[:, -1]]
    position = positions[:, -1:].repeat_interleave(group, 0) if grouped else positions[:, -1:]
    for step in range(steps - 1):
        position = position + 1
        if grouped:
            with decoding_in_groups(model):
                out = model(input_ids=tokens[:, step:step + 1], position_ids=position, use_cache=True,
                            rlhfkit_groups=groups, **cache_kwargs(model, cache))
        else:
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            out = model(input_ids=tokens[:, step:step + 1], attention_mask=mask, position_ids=position,
                        use_cache=True, **cache_kwargs(model, cache))
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1).float()


@torch.no_grad()
def group_decode_is_exact(model) -> bool:
    """Group decode: whether decoding through `group_decode.group_attention` gives the model's own logits, on 2
    prompts (one left-padded) x 2 samples x 3 tokens of random ids, within 1e-4 of the largest (5e-2 in half
    precision). False for architectures whose attention takes options this path does not apply, or that do not
    pass the call's keyword arguments down to the attention function."""
    if group_cache(model, 1) is None:
        return False
    vocab = base_model(model).get_input_embeddings().weight.size(0)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(vocab, (2, 6), generator=generator).to(device)
    mask = torch.ones(2, 6, dtype=torch.long, device=device)
    mask[1, :2] = 0
    tokens = torch.randint(vocab, (4, 3), generator=generator).to(device)
    try:
        plain = _decode(model, prompt_ids, mask, tokens, grouped=False)
        grouped = _decode(model, prompt_ids, mask, tokens, grouped=True)
    except FAILURES:
        return False
    return _relative_max(plain, grouped) < (5e-2 if _half(model) else 1e-4)


@torch.no_grad()
def sft_packing_is_exact(model, trial: ModelPlan, rows: list, pad_id: int, device, rtol: float = 1e-4) -> bool:
    """Packed SFT micro-batches: whether packed rows give the padded batch's loss on `rows` (the run's first rows,
    `speed.registry.Probe`). A model whose attention does not read packed positions (transformers builds the
    block-diagonal mask for most architectures, not all) would let rows see each other. float32 rounds the two
    ways apart by ~1e-6 relative; a leak across rows moves the loss by far more."""
    if len(rows) < 2:
        return False
    with _eval(model):
        padded, _ = lm_forward(model, collate_sft(rows, pad_id), device, trial)
        packed, _ = lm_forward(model, collate_packed(rows, pad_id, packed_row_tokens(model, trial)), device, trial)
    return bool(torch.isclose(packed.float(), padded.float(), rtol=rtol, atol=1e-4))


@torch.no_grad()
def rm_packing_is_exact(model, trial: ModelPlan, rows: list, pad_id: int, device, rtol: float = 1e-4) -> bool:
    """Packed RM micro-batches: whether packed sequences score as padded ones on `rows` (see `sft_packing_is_exact`)."""
    if not rows:
        return False
    with _eval(model):
        padded = torch.cat(pair_scores(model, rows, pad_id, device, trial))
        packed = torch.cat(pair_scores(model, rows, pad_id, device, trial, packed=True))
    return bool(torch.allclose(packed, padded, rtol=rtol, atol=1e-4 if rtol <= 1e-4 else 1e-2))
