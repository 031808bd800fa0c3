"""One packed forward for rows that share a prompt or a prefix: each shared part once, then the rest of every row.

GRPO, RLOO and the other group estimators score G responses of each prompt. `prefix.shared_prefix_logits` computes
each prompt once with two forwards: the distinct prompts fill a KV cache, then the responses run against it, every
layer twice (its per-call overhead twice, a prompts' forward of only a few dozen rows), the responses left-padded
and their keys concatenated to a copy of their prompt's. Here the prompts' real tokens and the responses' tokens are
concatenated into one row, so every linear layer runs once per micro-batch over all of them, with no padding, and
only the attention sees the structure (`group_packed_attention`, registered with transformers' `AttentionInterface`
and switched in for the forward): each prompt attends causally within itself (one `scaled_dot_product_attention`
per prompt, as `segments.segment_attention` runs packed sequences), and the responses, gathered into a
(B, heads, L, D) batch, attend to their own prompt's keys (gathered, left-padded to the longest prompt) and causally
to their own, under one mask. Measured on bench_grpo's work (5M Llama, 8 prompts x 4 samples, 32-token responses,
micro-batches of 8, 1 thread): the actor update's forwards and backwards 593 -> 518 ms, the reference's no-grad
forward of the whole batch 155 -> 126 ms.

The same packed row serves `prefix.common_prefix_outputs`: the run of template tokens every rollout row begins with
(a chat template's system prompt) as the one prefix, each row's other real tokens as its tail
(`common_prefix_packed`; the actor's and reference's hidden states, the critic's values). There the two-forward
path ran the rows left-padded against a KV cache of the run: SmolLM2 PPO (16 x 64, micro-batches of 8, 2 threads)
actor update 7.1 -> 5.9 s, critic update 6.0 -> 5.2 s, reference 2.1 -> 1.8 s.

Positions go on from the prefix's real-token count, as `forward.position_ids` numbers the padded rows; padding (the
prompts' left padding, the responses' after EOS) is not in the row at all. Values equal the two-forward path's to float
rounding (the same tokens attended, the same positions). A model's speed plan says whether its forwards use it
(`plan.group_packing`, decided by `speed.registry` after `speed.checks.group_packing_gives_prefix_values` finds the
two-forward paths' values); `prefix.shared_prefix_logits(hidden=True)` and `prefix.common_prefix_outputs` then take it
where the model can run it now (`group_packing`: not in training with gradient checkpointing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface

from rlhfkit.models.forward import hidden_states, scalar_outputs
from rlhfkit.lora import attention_implementation, base_model
from rlhfkit.models.segments import packed_row_tokens

NAME = "rlhfkit_group_packed"
_UNSUPPORTED = ("softcap", "sliding_window", "s_aux", "sinks")  # attention-function options it does not apply


class GroupPacking:
    """Where each token of the packed row comes from and what it attends to: U prefixes (`prefixes`, each its real
    tokens), then B rows' tails (`tails` (B, L) left-aligned, `lengths` (B,) real tokens each; `owner[i]`: the prefix
    row i continues). Each prefix attends causally within itself; a row's tail attends to its whole prefix and
    causally to itself, at positions that go on from the prefix's length.

    Attributes: the row (`input_ids`, `position_ids`, (1, T)); each prefix's (start, end) in it (`prompt_spans`),
    each tail's start (`tail_start` (B,)); for the tails' attention, (B x L) query indices into the row, (B x W) key
    indices (the row's prefix left-padded to the longest one, then its own L), the (B, 1, L, W) mask `allowed` and
    the (B, L) real tail slots `slots`."""

    def __init__(self, prefixes: list[torch.Tensor], tails: torch.Tensor, lengths: torch.Tensor, owner: torch.Tensor):
        device = tails.device
        prompt_len = torch.tensor([p.numel() for p in prefixes], device=device)
        prompt_start = prompt_len.cumsum(0) - prompt_len
        self.tail_start = int(prompt_len.sum()) + lengths.cumsum(0) - lengths
        self.prompt_spans = list(zip(prompt_start.tolist(), (prompt_start + prompt_len).tolist()))
        self.prompt_start, self.prompt_len, self.owner = prompt_start, prompt_len, owner
        self.rows, self.width = owner.numel(), tails.size(1)
        longest = int(prompt_len.max())
        columns = torch.arange(self.width, device=device)
        self.slots = columns[None] < lengths[:, None]  # (B, L)
        where = self.tail_start[:, None] + columns[None]
        own_len = prompt_len[owner]
        ids = torch.cat([*prefixes, tails[self.slots]])
        positions = torch.cat([*(torch.arange(n, device=device) for n in prompt_len.tolist()),
                               (own_len[:, None] + columns[None]).expand_as(where)[self.slots]])
        self.input_ids, self.position_ids = ids[None], positions[None]
        last = (prompt_start + prompt_len - 1)[owner]  # (B,) each row's prefix's last token
        self.queries = torch.where(self.slots, where, last[:, None]).flatten()
        lead = longest - own_len  # left padding of each row's prefix keys
        prompt_cols = torch.arange(longest, device=device)
        prompt_real = prompt_cols[None] >= lead[:, None]
        prompt_keys = (prompt_start[owner][:, None] + prompt_cols[None] - lead[:, None]).masked_fill(~prompt_real, 0)
        self.keys = torch.cat([prompt_keys, where.masked_fill(~self.slots, 0)], dim=1).flatten()
        self.key_width = longest + self.width
        causal = (columns[:, None] >= columns[None, :])[None] & self.slots[:, None, :]  # (B, L, L)
        self.allowed = torch.cat([prompt_real[:, None, :].expand(-1, self.width, -1), causal], dim=2)[:, None]

    def position(self, row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """The row position of token `token` (its index among row `row`'s real tokens, its prefix's first) of row
        `row`; broadcast shapes."""
        prefix_len = self.prompt_len[self.owner][row]
        return torch.where(token < prefix_len, self.prompt_start[self.owner][row] + token,
                           self.tail_start[row] + token - prefix_len)


def group_packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                           dropout: float = 0.0, scaling: float | None = None,
                           rlhfkit_group_packing: GroupPacking | None = None, **kwargs):
    """The packed row's attention (`GroupPacking`): query (1, H, T, D), key and value (1, Hk, T, D); returns
    (1, T, H, D) as transformers' attention functions do. `attention_mask` is not used."""
    layout = rlhfkit_group_packing
    if layout is None or query.size(0) != 1:
        raise RuntimeError("group_packed_attention serves a forward of one GroupPacking row only")
    unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported:
        raise NotImplementedError(f"group_packed_attention does not apply {', '.join(unsupported)}")
    rep = query.size(1) // key.size(1)
    q, k, v = query[0], key[0], value[0]  # (H, T, D)
    parts = []
    for start, end in layout.prompt_spans:  # each prompt causally within itself
        out = F.scaled_dot_product_attention(q[None, :, start:end], repeat_kv(k[None, :, start:end], rep),
                                             repeat_kv(v[None, :, start:end], rep), dropout_p=dropout,
                                             is_causal=True, scale=scaling)
        parts.append(out[0].transpose(0, 1))  # (l, H, D)
    if layout.width:  # the responses: their prompt's keys, then their own, causally
        heads, _, dim = q.shape
        rows, width, keys = layout.rows, layout.width, layout.key_width
        qr = q.index_select(1, layout.queries).view(heads, rows, width, dim).transpose(0, 1)
        kr, vr = (x.index_select(1, layout.keys).view(x.size(0), rows, keys, dim).transpose(0, 1) for x in (k, v))
        out = F.scaled_dot_product_attention(qr, repeat_kv(kr, rep), repeat_kv(vr, rep), attn_mask=layout.allowed,
                                             dropout_p=dropout, scale=scaling)
        parts.append(out.transpose(1, 2)[layout.slots])  # (tokens, H, D) in the row's order
    return torch.cat(parts, dim=0)[None], None


AttentionInterface.register(NAME, group_packed_attention)
AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)  # the attention builds its own mask


def group_packing(model, plan) -> bool:
    """Whether `model`'s forwards over rows that share a prompt (`group_packed_hidden`) or a template's run
    (`common_prefix_packed`) take one packed row now: its plan says so (`plan.group_packing`, which needs
    `plan.segment_attention`'s conditions) and it is not training with gradient checkpointing (the recomputation
    would run after the attention switch is gone)."""
    return plan.group_packing and packed_row_tokens(model, plan, inference=not base_model(model).training) is not None


def packed_forward(model, layout: GroupPacking, kind: str = "hidden") -> torch.Tensor:
    """(T, H) hidden states the LM head reads at every position of the packed row (`kind` "hidden"), or (T,) a scalar
    model's outputs ("scores")."""
    kwargs = dict(input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=None, use_cache=False,
                  rlhfkit_group_packing=layout)
    with attention_implementation(model, NAME):
        return (scalar_outputs(model, **kwargs) if kind == "scores" else hidden_states(model, **kwargs))[0]


def group_packed_hidden(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                        response_mask: torch.Tensor, first: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor | None:
    """(B, R, H) hidden states the LM head reads to predict each response token, from one forward of the packed
    row: the distinct prompts (rows `first`) as prefixes, each row's response but its last valid token as its tail
    (token 0 is predicted at its prompt's last token). None where the rows do not fit it (an empty prompt, a
    response mask with holes)."""
    prompt_real = prompt_mask.bool()[first]
    valid = response_mask.bool()
    count = valid.long().sum(-1)
    steps = torch.arange(valid.size(1), device=valid.device)[None]
    if not bool(prompt_real.any(-1).all()) or not torch.equal(valid, steps < count[:, None]):
        return None
    fed = (count - 1).clamp(min=0)
    width = int(fed.max()) if fed.numel() else 0
    prefixes = [ids[real] for ids, real in zip(prompt_ids[first], prompt_real)]
    layout = GroupPacking(prefixes, response_ids[:, :width], fed, inverse)
    flat = packed_forward(model, layout)
    # response token j is predicted at the row's real token P_i - 1 + j, where it has one (else at its prompt's last)
    prompt_len = layout.prompt_len[inverse][:, None]
    token = prompt_len - 1 + torch.where(steps <= fed[:, None], steps, torch.zeros_like(steps))
    return flat[layout.position(torch.arange(layout.rows, device=steps.device)[:, None], token)]


def contiguous_rows(attention_mask: torch.Tensor) -> bool:
    """Whether every row's real tokens are one run (left padding, tokens, right padding), as rollout rows are."""
    real = attention_mask.bool()
    starts = (~real).long().cumprod(-1).sum(-1)
    columns = torch.arange(real.size(1), device=real.device)[None]
    return torch.equal(real, (columns >= starts[:, None]) & (columns < (starts + real.long().sum(-1))[:, None]))


def common_prefix_packed(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, length: int, keep: int,
                         kind: str) -> torch.Tensor:
    """`prefix.common_prefix_outputs`' result from one forward of the packed row: the `length` tokens every row
    begins with once as the prefix, each row's other real tokens as its tail. (B, keep, H) hidden states or
    (B, keep) scores at the last `keep` columns of the left-padded (B, T) rows; padding columns there hold the
    output at the row's first token (finite; the callers mask them)."""
    real = attention_mask.bool()
    counts = real.long().sum(-1)
    starts = (~real).long().cumprod(-1).sum(-1)  # left padding of each row
    run = input_ids[0, int(starts[0]):int(starts[0]) + length]
    lengths = counts - length
    width = int(lengths.max())
    columns = torch.arange(width, device=input_ids.device)[None]
    tails = input_ids.gather(1, (starts[:, None] + length + columns).clamp(max=input_ids.size(1) - 1))
    layout = GroupPacking([run], tails, lengths, torch.zeros_like(counts))
    flat = packed_forward(model, layout, kind)
    column = torch.arange(input_ids.size(1) - keep, input_ids.size(1), device=input_ids.device)[None]
    token = torch.where(real[:, -keep:], column - starts[:, None], torch.zeros_like(column))
    return flat[layout.position(torch.arange(layout.rows, device=column.device)[:, None], token)]
