"""The rollout batch: every tensor PPO needs about a set of generated responses, with shapes written down.

Layout. B rows, P prompt columns, R response columns. Prompts are LEFT-padded (so generation appends to every
row at the same column) and responses RIGHT-padded, so `input_ids = [prompt_ids | response_ids]` is (B, P + R)
and response token j sits at column P + j for every row. Per-token quantities are (B, R) and aligned with the
response: index j is about response token j, predicted from everything before it (logits at column P - 1 + j).

Episodes (multi-turn, rollout/episodes.py): the response is the whole trajectory after the prompt, the model's
turns and the environment's messages in between, as ids. `response_mask` is 1 on the model's own tokens only (what
the losses, the KL, entropy, values and advantages cover); `response_attention` is 1 on every real token (what the
forwards attend to). A single-turn batch has no environment tokens and leaves `response_attention` None.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class RolloutBatch:
    # ---- generation (rollout/generate.py)
    prompt_ids: torch.Tensor  # (B, P) long, left-padded with pad_id
    prompt_mask: torch.Tensor  # (B, P) long, 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, R) long, sampled tokens; pad_id after the first EOS
    response_mask: torch.Tensor  # (B, R) float, 1 on tokens up to and including the first EOS
    prompt_texts: list  # B rendered prompts (what the actor saw)
    response_texts: list  # B decoded responses (special tokens skipped)
    messages: list = field(default_factory=list)  # B prompt message lists, to re-render for another tokenizer
    fields: list = field(default_factory=list)  # B dicts: each prompt row's dataset fields, for reward functions
    sample_logprobs: Optional[torch.Tensor] = None  # (B, R) log pi(token) recorded while sampling, at the
    #                                                 sampling temperature; 0 after EOS
    group: Optional[torch.Tensor] = None  # (B,) long: which prompt of the iteration a row answers (rows of one
    #                                       prompt, ppo.n_samples_per_prompt of them, share it; any row order)
    groups_share_prompts: bool = False  # the run samples groups (n_samples_per_prompt > 1): forwards compute a
    #                                     prompt once per group (models/prefix.py: shared_prefix_logits)
    judged: Optional[torch.Tensor] = None  # (B,) bool: the reward judged the row (None: every row); the group
    #                                        estimators' statistics count judged rows only
    # ---- experience (rollout/experience.py); None until filled
    old_logprobs: Optional[torch.Tensor] = None  # (B, R) log pi_old(token) under the sampling temperature
    ref_logprobs: Optional[torch.Tensor] = None  # (B, R) log pi_ref(token), same temperature
    values: Optional[torch.Tensor] = None  # (B, R) critic V(state before token j)
    scores: Optional[torch.Tensor] = None  # (B,) reward after normalisation/penalty, before clipping
    kl: Optional[torch.Tensor] = None  # (B, R) per-token KL estimate log pi_old - log pi_ref (k1 by default)
    rewards: Optional[torch.Tensor] = None  # (B, R) score on the last valid token minus kl_coef * kl
    advantages: Optional[torch.Tensor] = None  # (B, R) advantages of ppo.advantage_estimator
    returns: Optional[torch.Tensor] = None  # (B, R) returns (GAE: the critic's targets, advantages + values)
    tis_weights: Optional[torch.Tensor] = None  # (B, R) min(pi_old / pi_sampler, rollout.tis_cap) where another
    #                                             engine sampled (rollout/sync_check.py); None: no correction
    # ---- episodes (rollout/episodes.py); None for single-turn rollouts
    response_attention: Optional[torch.Tensor] = None  # (B, R) long: 1 on every real response-side token, the
    #                                                    environment's included (response_mask: the model's only)
    episode_rewards: Optional[torch.Tensor] = None  # (B,) the environment's return of each episode (NaN: unjudged)
    episodes: list = field(default_factory=list)  # B dicts: turns, tool calls, how each episode ended

    @property
    def size(self) -> int:
        return self.prompt_ids.size(0)

    @property
    def prompt_width(self) -> int:
        return self.prompt_ids.size(1)

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, P + R) prompt then response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def response_attended(self) -> torch.Tensor:
        """(B, R) long: 1 on every response-side token a forward attends to (an episode's environment tokens
        too, which `response_mask` leaves out)."""
        return self.response_mask.long() if self.response_attention is None else self.response_attention.long()

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, P + R) 1 on real prompt tokens and real response tokens (nothing after EOS; an episode's
        environment tokens included)."""
        return torch.cat([self.prompt_mask, self.response_attended], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) valid response tokens, EOS included (an episode's: the model's own tokens)."""
        return self.response_mask.sum(-1)

    def select(self, index, trim: bool = True) -> "RolloutBatch":
        """Rows `index` (a list or 1-D tensor) of every field. With `trim`, columns that are padding in all of
        them are dropped: a micro-batch of short rows runs a shorter forward with the same results (positions
        come from the mask); without it the (B, R) fields keep the full batch's columns."""
        index = torch.as_tensor(index, dtype=torch.long)
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                picked[f.name] = value.index_select(0, index.to(value.device))
            elif isinstance(value, list) and value:
                picked[f.name] = [value[i] for i in index.tolist()]
            else:
                picked[f.name] = value
        sub = replace(self, **picked)
        return sub._trimmed() if trim else sub

    def _trimmed(self) -> "RolloutBatch":
        first_prompt = int(self.prompt_mask.any(0).long().argmax()) if self.prompt_mask.any() else 0
        attended = self.response_attended
        resp_width = int(attended.any(0).nonzero().max()) + 1 if attended.any() else 1
        trims = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                continue
            trims[f.name] = value[:, first_prompt:] if f.name.startswith("prompt_") else value[:, :resp_width]
        return replace(self, **trims)

    def to(self, device) -> "RolloutBatch":
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


def cat_rollouts(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Join batches from several generate() calls: prompts re-padded on the left, responses on the right."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for f in fields(RolloutBatch):
        values = [getattr(p, f.name) for p in parts]
        if values[0] is None:
            out[f.name] = None
        elif isinstance(values[0], list):
            out[f.name] = [x for v in values for x in v]
        elif not isinstance(values[0], torch.Tensor):  # a flag of the whole batch
            out[f.name] = values[0]
        elif values[0].dim() == 1:
            out[f.name] = torch.cat(values)
        else:
            fill = pad_id if f.name in ("prompt_ids", "response_ids") else 0
            width = max(v.size(1) for v in values)
            # prompts stay left-padded, responses right-padded: (left, right) padding of the last dimension
            side = (lambda n: (n, 0)) if f.name.startswith("prompt_") else (lambda n: (0, n))
            out[f.name] = torch.cat([F.pad(v, side(width - v.size(1)), value=fill) for v in values])
    return RolloutBatch(**out)
