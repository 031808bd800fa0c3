"""Sampling a policy on prompts (the rollout code PPO uses), and labelling pairs of its samples like a human would.

Preference pairs are two samples of the SFT model for one prompt, so the reward model learns on the
distribution PPO starts from (InstructGPT's set-up), labelled by the hidden gold reward with each label flipped
independently with probability `noise`. Two such labellers disagree on 2 noise (1 - noise) of the pairs: 18% for the
demo's noise of 0.1, fewer than the ~27% that InstructGPT's labellers disagreed on (72.6% agreement, Ouyang et al.
2022), so the demo's labels are cleaner than human ones, not perfect: a demo whose labels were perfect would
overstate what a reward model learns.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.config.schema import LoadConfig
from rlhfkit.data.templates import Template, encode_prompt
from rlhfkit.engine.local import LocalEngine
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.rollout.evaluate import generate_all
from rlhfkit.models.plan import REFERENCE, ModelPlan


def load_policy(folder, opts: LoadConfig | None = None):
    """(model in eval mode, left-padding tokenizer) from a causal-LM folder."""
    tokenizer = load_tokenizer(str(folder), opts, padding_side="left")
    model = load_causal_lm(str(folder), opts, tokenizer)
    model.eval()
    return model, tokenizer


def prompt_rows(tokenizer, prompts: list[str]) -> list[dict]:
    """Single-turn prompts as the rows `generate_all` takes, rendered with the tokenizer's template."""
    template = Template.for_tokenizer(tokenizer, "auto")
    rows = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        text = template.prompt(messages)
        rows.append({"prompt_ids": encode_prompt(tokenizer, text), "prompt_text": text, "messages": messages})
    return rows


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], gen: GenConfig, seed: int,
           plan: ModelPlan = REFERENCE) -> RolloutBatch:
    """One sampled response per prompt (repeat a prompt to get several), with a fixed seed, on the paths of the
    model's speed plan (default: plain transformers)."""
    torch.manual_seed(seed)
    return generate_all(model, LocalEngine(), tokenizer, prompt_rows(tokenizer, prompts), gen, plan)


def label_pairs(prompts: list[str], first: list[str], second: list[str], gold: Callable[[str, str], float],
                noise: float, seed: int) -> tuple[list[dict], dict]:
    """{prompt, chosen, rejected} rows from two responses per prompt, chosen by `gold(prompt, response)`, each label
    flipped with probability `noise`.

    Ties carry no preference and are dropped (as rlhfkit's readers drop tied WebGPT rows). Returns (rows,
    counts of pairs, ties and flipped labels).
    """
    rng = random.Random(seed)
    rows, ties, flipped = [], 0, 0
    for prompt, a, b in zip(prompts, first, second):
        ga, gb = gold(prompt, a), gold(prompt, b)
        if ga == gb:
            ties += 1
            continue
        chosen, rejected = (a, b) if ga > gb else (b, a)
        if rng.random() < noise:
            chosen, rejected = rejected, chosen
            flipped += 1
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows, {"pairs": len(rows), "ties_dropped": ties, "flipped": flipped}


def sample_pairs(model, tokenizer, prompts: list[str], gen: GenConfig, gold, noise: float, seed: int):
    """Two samples per prompt from `model`, labelled by `label_pairs`."""
    batch = sample(model, tokenizer, prompts + prompts, gen, seed)
    texts = batch.response_texts
    return label_pairs(prompts, texts[:len(prompts)], texts[len(prompts):], gold, noise, seed)
