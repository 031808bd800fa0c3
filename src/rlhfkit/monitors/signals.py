"""Cheap per-iteration statistics for the monitors, from what a rollout step already holds."""

from __future__ import annotations

from typing import Sequence


def repeated_ngram_share(sequences: Sequence[Sequence[int]], n: int = 4) -> float:
    """The share of the n-grams of `sequences` (token-id lists, one per response) that repeat an earlier n-gram
    of the same response, pooled over the responses: 0 for text that never repeats itself, towards 1 for a loop
    ("the the the ..."). Token ids rather than words: no tokenizer, and text without spaces counts too. 0 when no
    response has n tokens."""
    repeats = total = 0
    for seq in sequences:
        grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
        total += len(grams)
        repeats += len(grams) - len(set(grams))
    return repeats / total if total else 0.0
