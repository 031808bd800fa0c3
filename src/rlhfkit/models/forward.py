"""Padding-safe forward passes shared by every stage.

Two rules make results independent of padding side and of pad == EOS:
- position ids come from the attention mask (cumsum - 1), so a left-padded row sees the same positions as
  the same row unpadded (HF's default positions would start at the pad count);
- a sequence's score is read at the last position whose attention mask is 1, never by searching for the
  first pad id (which breaks for left padding and when pad == EOS: TRL #2778 #3750, OpenRLHF #238).
"""

from __future__ import annotations

import torch

from rlhfkit.algos import last_valid_index
from rlhfkit.models.lora import base_model

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


def _head(model) -> torch.nn.Module:
    plain = base_model(model)
    for name in HEAD_NAMES:
        head = getattr(plain, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise TypeError(f"{type(plain).__name__} has no scalar head named one of {HEAD_NAMES}")


def token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) scalar output of a sequence-classification model at every position (critic values).

    HF's forward pools internally by pad id; we capture the head's per-token output with a hook instead,
    so the same model class serves as reward model (one score) and critic (a value per token).
    """
    captured = {}

    def grab(_module, _inputs, output):
        captured["out"] = output

    handle = _head(model).register_forward_hook(grab)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
              use_cache=False)
    finally:
        handle.remove()
    return captured["out"].squeeze(-1).float()


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
    """(B,) reward-model score read at each row's last real token (left or right padding)."""
    input_ids, attention_mask = trim_padding(input_ids, attention_mask)
    scores = token_scores(model, input_ids, attention_mask)
    idx = last_valid_index(attention_mask)
    return scores.gather(1, idx[:, None]).squeeze(1)
