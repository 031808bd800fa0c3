"""Tokenise canonical examples for each stage, and collate them into padded batches.

SFT labels are -100 on prompt tokens (loss on the response only) unless `loss_on="all"`. Rows longer than
`max_length` keep their prompt and lose the end of the response; rows whose prompt alone fills
`max_length` are dropped. Both are counted and reported, never hidden. A row the chat template refuses
(`TemplateRefused`) is skipped and counted in `skipped["template_refused"]`, or is a DataError naming its
`file:line` when `strict`.
"""

from __future__ import annotations

import torch

from rlhfkit.data.templates import Template, encode_prompt, encode_response
from rlhfkit.errors import DataError, TemplateRefused, where

IGNORE = -100


def _rendered(render, template: Template, ex, skipped: dict | None, strict: bool):
    """`render(template, ex)`, or None when the chat template refuses the example's conversation (counted in
    `skipped`)."""
    try:
        return render(template, ex)
    except TemplateRefused as exc:
        if strict:
            raise DataError(f"{where(ex.source, ex.line)}: {exc} (data.strict_rows=false skips and counts such "
                            f"rows)") from None
        if skipped is not None:
            skipped["template_refused"] = skipped.get("template_refused", 0) + 1
        return None


def _prompt_text(template: Template, ex) -> str:
    return template.prompt(ex.prompt)


def _sft_texts(template: Template, ex) -> tuple[str, str]:
    return template.prompt(ex.prompt), template.response(ex.prompt, ex.response)


def _pair_texts(template: Template, ex) -> tuple[str, str, str]:
    return (template.prompt(ex.prompt), template.response(ex.prompt, ex.chosen),
            template.response(ex.prompt, ex.rejected))


def tokenize_sft(examples, tokenizer, template: Template, max_length: int, loss_on: str = "response",
                 skipped: dict | None = None, strict: bool = False):
    """-> (list of {"input_ids", "labels"}, stats {"rows", "truncated", "dropped"})."""
    out, truncated, dropped = [], 0, 0
    for ex in examples:
        texts = _rendered(_sft_texts, template, ex, skipped, strict)
        if texts is None:
            continue
        prompt = encode_prompt(tokenizer, texts[0])
        response = encode_response(tokenizer, texts[1], template.end_ids, after=(texts[0], prompt))
        if len(prompt) >= max_length:
            dropped += 1
            continue
        ids = prompt + response
        if len(ids) > max_length:
            truncated += 1
            ids = ids[:max_length]
        labels = list(ids) if loss_on == "all" else [IGNORE] * len(prompt) + ids[len(prompt):]
        out.append({"input_ids": ids, "labels": labels})
    return out, {"rows": len(out), "truncated": truncated, "dropped": dropped}


def tokenize_preferences(examples, tokenizer, template: Template, max_length: int, skipped: dict | None = None,
                         strict: bool = False):
    """-> (list of {"chosen_ids", "rejected_ids", "prompt_len"}, stats). Both sides share the prompt tokens."""
    out, truncated, dropped = [], 0, 0
    for ex in examples:
        texts = _rendered(_pair_texts, template, ex, skipped, strict)
        if texts is None:
            continue
        prompt = encode_prompt(tokenizer, texts[0])
        if len(prompt) >= max_length:
            dropped += 1
            continue
        sides = []
        for text in texts[1:]:
            ids = prompt + encode_response(tokenizer, text, template.end_ids, after=(texts[0], prompt))
            if len(ids) > max_length:
                truncated += 1
                ids = ids[:max_length]
            sides.append(ids)
        if sides[0] == sides[1]:
            # identical after truncation: the pair carries no signal, only noise for the loss
            dropped += 1
            continue
        out.append({"chosen_ids": sides[0], "rejected_ids": sides[1], "prompt_len": len(prompt)})
    return out, {"rows": len(out), "truncated": truncated, "dropped": dropped}


def opening_length(tokenizer, template: Template, messages: list[dict], ids: list[int]) -> int:
    """How many of a rendered prompt's `ids` come before the conversation's first user (non-system) content: BOS,
    the system turn, the first turn's header. They are the ids it shares with the same prompt whose first such
    content differs."""
    return shared_opening(messages, ids, lambda other: encode_prompt(tokenizer, template.prompt(other)))


def shared_opening(messages: list[dict], ids: list[int], render) -> int:
    """How many of `ids` (`messages` rendered by `render`, messages -> ids) come before the first non-system
    content: the ids they share with the rendering of the same conversation whose first such content differs."""
    first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), 0)
    other = [dict(m) for m in messages]
    other[first]["content"] = "\u2063" + str(messages[first].get("content", ""))[::-1]
    try:
        ids_other = render(other)
    except TemplateRefused:
        return 0
    n = 0
    while n < min(len(ids), len(ids_other)) and ids[n] == ids_other[n]:
        n += 1
    return n


def cut_prompt(ids: list[int], opening: int, budget: int) -> list[int]:
    """A prompt longer than `budget` tokens: its opening (the template's start) and its end (the last turn and the
    assistant header), the middle cut out, so the model still sees the layout it was trained on. An opening
    longer than half the budget is not kept (the end matters more)."""
    opening = opening if opening <= budget // 2 else 0
    return ids[:opening] + ids[len(ids) - (budget - opening):]


def tokenize_prompts(examples, tokenizer, template: Template, max_prompt_length: int, skipped: dict | None = None,
                     strict: bool = False):
    """-> (list of {"prompt_ids", "prompt_text", "messages", "fields"}, stats). Long prompts keep the template's
    opening and their end (the question; `cut_prompt`). `messages` are kept so PPO can re-render a prompt for a
    reward model with another tokenizer/template; `fields` (the row's own fields) so a reward function can check
    against them."""
    out, truncated = [], 0
    for ex in examples:
        text = _rendered(_prompt_text, template, ex, skipped, strict)
        if text is None:
            continue
        ids = encode_prompt(tokenizer, text)
        if len(ids) > max_prompt_length:
            truncated += 1
            ids = cut_prompt(ids, opening_length(tokenizer, template, ex.prompt, ids), max_prompt_length)
        out.append({"prompt_ids": ids, "prompt_text": text, "messages": ex.prompt, "fields": ex.fields})
    return out, {"rows": len(out), "truncated": truncated, "dropped": 0}


def pad_sequences(seqs: list[list[int]], pad_value: int, side: str = "right") -> torch.Tensor:
    """(B, T_max) long tensor."""
    width = max(len(s) for s in seqs)
    rows = []
    for s in seqs:
        fill = [pad_value] * (width - len(s))
        rows.append(s + fill if side == "right" else fill + s)
    return torch.tensor(rows, dtype=torch.long)


def collate_sft(rows: list[dict], pad_id: int) -> dict:
    """Right-padded batch: input_ids, attention_mask, labels, each (B, T)."""
    ids = [r["input_ids"] for r in rows]
    return {
        "input_ids": pad_sequences(ids, pad_id),
        "attention_mask": pad_sequences([[1] * len(s) for s in ids], 0),
        "labels": pad_sequences([r["labels"] for r in rows], IGNORE),
    }


def pack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices in bins of at most `capacity` tokens (a longer row gets a bin of its own), first fit in
    order of decreasing length: few bins, little room left over."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, left in enumerate(room):
            if lengths[i] <= left:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def micro_batches(rows: list, size: int, lengths: list[int] | None, packed: bool) -> list[list]:
    """A step's `rows` in micro-batches of `size` rows (the last one holds the rest, as a plain split would),
    arranged by `lengths` (each row's tokens; None: in order, the plain split): a row's loss enters the step's sum
    once whichever micro-batch holds it, so only the cost changes. `packed` (padding-free micro-batches): the token
    totals balanced, longest row first into the micro-batch with the fewest tokens, since the largest micro-batch
    sets the step's peak activation memory; padded ones: rows of similar length together, so little padding is
    computed. Within a micro-batch the rows keep their order in `rows`."""
    starts = range(0, len(rows), size)
    if lengths is None:
        return [rows[start:start + size] for start in starts]
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    if not packed:
        members = [order[start:start + size] for start in starts]
    else:
        counts = [min(size, len(rows) - start) for start in starts]
        members, totals = [[] for _ in counts], [0] * len(counts)
        for i in order:
            b = min((b for b in range(len(counts)) if len(members[b]) < counts[b]), key=lambda b: totals[b])
            members[b].append(i)
            totals[b] += lengths[i]
    return [[rows[i] for i in sorted(m)] for m in members]


def collate_packed(rows: list[dict], pad_id: int, capacity: int | None = None) -> dict:
    """Padding-free batch: the rows concatenated into bins as long as the longest row (or of `capacity` tokens
    where that is longer), (N, T) input_ids, position_ids and labels, no attention mask.

    Positions restart at 0 with every row, which is how transformers recognises packed sequences: its mask
    then keeps each token's attention inside its own row (a block-diagonal causal mask), so a row's logits are
    those of the row alone. Each row's first label is IGNORE: the previous row's last token must not learn to
    predict it (in a padded batch nothing predicts a first token either). A bin's unused tail is padding that
    forms a segment of its own, with IGNORE labels. Bins no longer than the longest row keep the cost of attention
    under a mask at or below the padded batch's; a model whose attention runs per sequence
    (`models.segments.packed_row_tokens`) takes longer bins, a micro-batch in one row without any padding.
    """
    lengths = [len(r["input_ids"]) for r in rows]
    ids, positions, labels = [], [], []
    for members in pack_bins(lengths, max(max(lengths), capacity or 0)):
        ids.append([t for i in members for t in rows[i]["input_ids"]])
        positions.append([p for i in members for p in range(lengths[i])])
        labels.append([t for i in members for t in [IGNORE] + list(rows[i]["labels"][1:])])
    width = max(len(x) for x in ids)
    tails = [width - len(x) for x in ids]
    return {
        "input_ids": torch.tensor([x + [pad_id] * n for x, n in zip(ids, tails)]),
        "position_ids": torch.tensor([x + list(range(n)) for x, n in zip(positions, tails)]),
        "labels": torch.tensor([x + [IGNORE] * n for x, n in zip(labels, tails)]),
    }


def collate_packed_pairs(rows: list[dict], pad_id: int, capacity: int | None = None) -> dict:
    """Chosen then rejected sequences packed without padding (as `collate_packed`, `capacity` too): (N, T)
    input_ids and position_ids, and `ends` (2B, 2): the (bin, column) of each sequence's last token, chosen rows
    first."""
    seqs = [r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows]
    lengths = [len(x) for x in seqs]
    ids, positions, ends = [], [], [None] * len(seqs)
    for b, members in enumerate(pack_bins(lengths, max(max(lengths), capacity or 0))):
        ids.append([t for i in members for t in seqs[i]])
        positions.append([p for i in members for p in range(lengths[i])])
        column = 0
        for i in members:
            column += lengths[i]
            ends[i] = (b, column - 1)
    width = max(len(x) for x in ids)
    tails = [width - len(x) for x in ids]
    return {"input_ids": torch.tensor([x + [pad_id] * n for x, n in zip(ids, tails)]),
            "position_ids": torch.tensor([x + list(range(n)) for x, n in zip(positions, tails)]),
            "ends": torch.tensor(ends)}


def collate_preferences(rows: list[dict], pad_id: int) -> dict:
    """Chosen rows then rejected rows in ONE right-padded batch (one forward for both): (2B, T)."""
    ids = [r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows]
    return {"input_ids": pad_sequences(ids, pad_id), "attention_mask": pad_sequences([[1] * len(s) for s in ids], 0)}


def collate_prompt_sharing_pairs(rows: list[dict], pad_id: int) -> dict:
    """Each pair once as `[prompt | chosen response | rejected response]`, pairs packed into bins without padding
    (as `collate_packed`), with the attention mask that makes every token see what it sees in its own sequence.

    Positions restart at 0 with each pair's prompt and both responses continue from the prompt's length, so the
    rejected response has the positions it has after the prompt alone. The mask (a custom 4D one, which
    transformers passes through unchanged) lets a prompt token see the earlier tokens of its prompt, and a
    response token its pair's prompt and the earlier tokens of its own response: never the other response, never
    another pair. A bin's unused tail is padding that sees only itself.

    Returns (N, W) input_ids and position_ids, (N, 1, W, W) bool `allowed` (query, key), and the tokens to score:
    (N, W) bool `scored` (the positions whose logits predict a response token: the prompt's last token predicts
    both responses' first tokens), and per scored prediction, in `scored`'s row-major order, flattened, (K,)
    `source` (its index among the scored positions), `target` (the token predicted) and `owner` (the sequence:
    0..B-1 chosen, B..2B-1 rejected).
    """
    prompts = [r["chosen_ids"][:r["prompt_len"]] for r in rows]
    answers = [(r["chosen_ids"][r["prompt_len"]:], r["rejected_ids"][r["prompt_len"]:]) for r in rows]
    lengths = [len(p) + len(c) + len(x) for p, (c, x) in zip(prompts, answers)]
    width = max(lengths)
    bins = pack_bins(lengths, width)
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(bins), width), dtype=torch.long)
    segment = torch.full((len(bins), width), -1, dtype=torch.long)  # the pair a column belongs to (-1: padding)
    branch = torch.zeros((len(bins), width), dtype=torch.long)  # 0 prompt, 1 chosen, 2 rejected
    predictions = []  # (flat index of the predicting position, target token, owner)
    for b, members in enumerate(bins):
        column = 0
        for i in members:
            prompt, (chosen, rejected) = prompts[i], answers[i]
            last = b * width + column + len(prompt) - 1  # the prompt's last token predicts both first tokens
            for part, (tokens, start) in enumerate(((prompt, 0), (chosen, len(prompt)), (rejected, len(prompt)))):
                span = slice(column, column + len(tokens))
                ids[b, span] = torch.tensor(tokens, dtype=torch.long)
                positions[b, span] = torch.arange(start, start + len(tokens))
                segment[b, span], branch[b, span] = i, part
                if part:
                    owner = i if part == 1 else len(rows) + i
                    sources = [last] + [b * width + column + j for j in range(len(tokens) - 1)]
                    predictions += [(s, t, owner) for s, t in zip(sources, tokens)]
                column += len(tokens)
        positions[b, column:] = torch.arange(width - column)
    index = torch.arange(width)
    same_pair = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    causal = index[None, :, None] >= index[None, None, :]
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])  # the key is prompt or own side
    itself = (index[:, None] == index[None, :])[None]  # padding: only itself, so no row of the mask is empty
    allowed = (same_pair & causal & visible) | ((segment < 0)[:, :, None] & itself)
    scored = torch.zeros(len(bins) * width, dtype=torch.bool)
    flat = torch.tensor([p[0] for p in predictions], dtype=torch.long)
    scored[flat] = True
    rank = torch.cumsum(scored.long(), 0) - 1  # flat position -> its index among the scored positions
    return {"input_ids": ids, "position_ids": positions, "allowed": allowed[:, None],
            "scored": scored.view(len(bins), width), "source": rank[flat],
            "target": torch.tensor([p[1] for p in predictions], dtype=torch.long),
            "owner": torch.tensor([p[2] for p in predictions], dtype=torch.long)}
