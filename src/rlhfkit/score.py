"""A reward model's scores over examples, what `rlhfkit score` (commands/score.py) and the demo's evaluation read:
`score_pairs` gives each pair's chosen and rejected scores with the accuracy (r_c > r_r, a tie counts as wrong),
mean scores and margin over them; `score_responses` one score per prompt/response example.

Examples are tokenised with the caller's template and max_length (the ones the RM was trained with); each score is
read at the last real token (`sequence_scores`), in right-padded batches through the model's own forward. torch is
imported inside the functions.
"""

from __future__ import annotations

import os
import sys


def _bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True,
                disable=os.environ.get("RLHFKIT_NO_BAR") == "1")


def score_pairs(model, tokenizer, template, examples, max_length: int, batch_size: int, device):
    """(per-pair (chosen, rejected) scores or None when tokenisation dropped the pair, summary dict)."""
    import torch

    from rlhfkit.data.tokenize import tokenize_preferences
    from rlhfkit.models.stage_forward import pair_scores
    from rlhfkit.models.plan import REFERENCE
    from rlhfkit.stages.reward import SUM_KEYS, pair_sums

    tokenised = [tokenize_preferences([ex], tokenizer, template, max_length)[0] for ex in examples]
    kept = [i for i, rows in enumerate(tokenised) if rows]
    scores: list = [None] * len(examples)
    sums = dict.fromkeys(SUM_KEYS, 0.0)
    with torch.no_grad(), _bar(len(kept), "score") as bar:
        for start in range(0, len(kept), batch_size):
            index = kept[start:start + batch_size]
            chosen, rejected = pair_scores(model, [tokenised[i][0] for i in index], tokenizer.pad_token_id, device,
                                           REFERENCE)  # padded, the model's own forward
            for key, value in pair_sums(chosen, rejected, None).items():
                sums[key] += value
            for i, c, r in zip(index, chosen.tolist(), rejected.tolist()):
                scores[i] = (c, r)
            bar.update(len(index))
    n = max(1, len(kept))
    summary = {"pairs": len(kept), "dropped": len(examples) - len(kept),
               **{key: value / n for key, value in sums.items() if key != "loss"}}
    return scores, summary


def score_responses(model, tokenizer, template, examples, max_length: int, batch_size: int, device) -> list:
    """One score per prompt/response example (None when its prompt alone exceeds max_length)."""
    import torch

    from rlhfkit.data.tokenize import pad_sequences, tokenize_sft
    from rlhfkit.models.forward import sequence_scores
    from rlhfkit.models.plan import REFERENCE

    ids = [tokenize_sft([ex], tokenizer, template, max_length, "all")[0] for ex in examples]
    kept = [i for i, rows in enumerate(ids) if rows]
    scores: list = [None] * len(examples)
    with torch.no_grad(), _bar(len(kept), "score") as bar:
        for start in range(0, len(kept), batch_size):
            index = kept[start:start + batch_size]
            seqs = [ids[i][0]["input_ids"] for i in index]
            batch = pad_sequences(seqs, tokenizer.pad_token_id).to(device)  # (B, T), right-padded
            mask = pad_sequences([[1] * len(s) for s in seqs], 0).to(device)
            for i, value in zip(index, sequence_scores(model, batch, mask, REFERENCE).tolist()):
                scores[i] = value
            bar.update(len(index))
    return scores
