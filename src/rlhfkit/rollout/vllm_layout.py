"""The RolloutBatch of responses an outside engine sampled, laid out as the native engine lays out its own."""

from __future__ import annotations

import torch

from rlhfkit.data.tokenize import pad_sequences
from rlhfkit.rollout.batch import RolloutBatch


def rollout_batch(rows: list[dict], responses: list[list[int]], logprobs: list[list[float]], eos_ids: list[int],
                  tokenizer, device) -> RolloutBatch:
    """`rows` (prompt_ids, prompt_text, messages, fields) with the sampled ids of each and the engine's log-probs of
    them: prompts left-padded, each response cut after its first end id (an engine that stops there keeps it as the
    last token) and right-padded, the mask 1 on its tokens, log-probs 0 after them."""
    pad_id = tokenizer.pad_token_id
    ends = set(eos_ids)
    lengths = [max(next((j + 1 for j, token in enumerate(ids) if token in ends), len(ids)), 1) for ids in responses]
    width = max(lengths)
    response_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    sample_logprobs = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for i, (ids, lps, n) in enumerate(zip(responses, logprobs, lengths)):
        ids = ids[:n] or [pad_id]  # an empty response (none sampled) is one padding token, masked in
        response_ids[i, :len(ids)] = torch.tensor(ids)
        sample_logprobs[i, :len(lps[:n])] = torch.tensor(lps[:n], dtype=torch.float32)
        mask[i, :n] = 1.0
    prompt_ids = pad_sequences([r["prompt_ids"] for r in rows], pad_id, side="left")
    prompt_mask = pad_sequences([[1] * len(r["prompt_ids"]) for r in rows], 0, side="left")
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return RolloutBatch(prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
                        response_ids=response_ids.to(device), response_mask=mask.to(device),
                        prompt_texts=[r["prompt_text"] for r in rows], response_texts=texts,
                        messages=[r.get("messages") for r in rows], fields=[r.get("fields", {}) for r in rows],
                        sample_logprobs=sample_logprobs.to(device))
