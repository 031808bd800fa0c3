"""The training stages' forwards over their collated micro-batches: SFT's summed NLL (`lm_forward`) and the reward
model's pair scores (`pair_scores`), padded or packed, on the paths of the model's speed plan.

They live below the stages so that the speed plan's packing checks (`speed/checks.py`) run the very forwards the
stages train with (`stages/sft.py`, `stages/reward.py`, `rlhfkit score`).
"""

from __future__ import annotations

import torch

from rlhfkit.algos import linear_lm_loss_sum, lm_loss_sum
from rlhfkit.data.tokenize import collate_packed_pairs, collate_preferences
from rlhfkit.models.forward import (causal_logits, final_hidden, head_logprobs_weight, mixed_precision, packed_logits,
                                    packed_sequence_scores, position_ids, sequence_scores)
from rlhfkit.models.segments import packed_attention, packed_row_tokens


def lm_forward(model, batch: dict, device, plan) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over labelled tokens and their count, for one (micro-)batch, padded
    (`collate_sft`) or packed (`collate_packed`).

    Where the plan runs the LM head in chunks (`plan.head_chunks`), it runs on the labelled positions only and its
    cross-entropy in chunks (`algos.linear_lm_loss_sum`), never holding the (tokens x vocabulary) logits."""
    batch = {k: v.to(device) for k, v in batch.items()}
    labels = batch["labels"][:, 1:]  # position t predicts token t+1
    weight = head_logprobs_weight(model, plan)
    packed = "position_ids" in batch
    if weight is not None:
        mask = batch.get("attention_mask")
        positions = batch["position_ids"] if packed else position_ids(mask)
        if packed:
            with packed_attention(model, plan, positions) as spans:
                hidden = final_hidden(model, batch["input_ids"], mask, positions, **spans)[:, :-1]
        else:
            hidden = final_hidden(model, batch["input_ids"], mask, positions)[:, :-1]
        keep = labels != -100
        with mixed_precision(plan):  # the head at the forward's precision
            return linear_lm_loss_sum(hidden[keep], weight, labels[keep]), int(keep.sum().item())
    if packed:
        logits = packed_logits(model, batch["input_ids"], batch["position_ids"], plan)
    else:
        logits = causal_logits(model, batch["input_ids"], batch["attention_mask"])
    return lm_loss_sum(logits[:, :-1], labels)


def pair_scores(model, rows: list, pad_id: int, device, plan, packed: bool = False) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """Scores of the chosen and rejected sides of `rows`, each (B,), from ONE forward pass over the 2B
    sequences: padded (2B, T), or `packed` into bins without padding (`collate_packed_pairs`, rows as long as
    `segments.packed_row_tokens` allows for this model's plan)."""
    if packed:
        batch = {k: v.to(device) for k, v in collate_packed_pairs(rows, pad_id, packed_row_tokens(model, plan)).items()}
        scores = packed_sequence_scores(model, batch["input_ids"], batch["position_ids"], batch["ends"], plan)
    else:
        batch = collate_preferences(rows, pad_id)
        scores = sequence_scores(model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                 plan)  # (2B,)
    return scores[:len(rows)], scores[len(rows):]
