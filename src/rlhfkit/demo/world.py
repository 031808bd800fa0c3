"""The demo's world, built by code from one seed: a tiny language, prompts, demonstrations and a hidden gold reward.

A prompt asks about a topic ("describe the river"); a response names the topic and lists one to four adjectives
("the river is calm , old and warm ."). The **gold reward** plays the part of human judgement: how many different
adjectives of a hidden GOOD set the response uses, at most GOLD_CAP (saying one twice earns nothing). No model ever
sees it: demonstrations draw adjectives uniformly (the labeller writes fluent but unremarkable answers), the reward
model learns it only from noisy comparisons of the SFT model's own samples, and PPO optimises that learned proxy.
Because the SFT policy samples its adjectives, its responses differ in gold reward (the signal a reward model needs),
and the best achievable value is known exactly: BEST_GOLD.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhfkit.demo.tiny import build_tiny_llama, build_tokenizer, save_model_folder

TOPICS = ("river", "forest", "garden", "city", "ocean", "mountain", "village", "market", "castle", "bridge",
          "lake", "meadow", "desert", "island", "valley", "harbor", "school", "library", "kitchen", "station",
          "temple", "tower", "field", "road", "cave", "beach", "farm", "park", "hill", "house",
          "ship", "train", "storm", "night", "morning", "winter", "street", "chapel", "orchard", "canyon")
GOOD = frozenset({"bright", "calm", "gentle", "golden", "warm", "quiet"})  # the hidden preference
OTHER = ("old", "dark", "cold", "wet", "small", "large", "empty", "noisy", "busy", "grey", "long", "far",
         "tall", "wide", "deep", "dry", "thin", "rough")
ADJECTIVES = tuple(sorted(GOOD)) + OTHER
VERBS = ("describe", "tell me about", "write about", "talk about")
GOLD_CAP = 3
BEST_GOLD = float(GOLD_CAP)  # e.g. "the river is calm , warm and bright ."
HELD_OUT_TOPICS = 10  # topics whose prompts only evaluation sees


def gold_reward(response: str) -> float:
    """How many different GOOD words the response uses, at most GOLD_CAP. Hidden from every model."""
    words = response.replace(",", " , ").replace(".", " . ").lower().split()
    return float(min(len(GOOD.intersection(words)), GOLD_CAP))


def join_adjectives(adjs: list[str]) -> str:
    """["a"] -> "a"; ["a", "b"] -> "a and b"; ["a", "b", "c"] -> "a , b and c"."""
    return adjs[0] if len(adjs) == 1 else " , ".join(adjs[:-1]) + " and " + adjs[-1]


def demonstration(topic: str, rng: random.Random) -> str:
    """A labeller's answer: 1-4 different adjectives drawn uniformly (the labeller does not know GOOD)."""
    adjs = rng.sample(ADJECTIVES, rng.randint(1, 4))
    return f"the {topic} is {join_adjectives(adjs)} ."


def split_topics(seed: int) -> tuple[list[str], list[str]]:
    topics = list(TOPICS)
    random.Random(seed).shuffle(topics)
    return sorted(topics[HELD_OUT_TOPICS:]), sorted(topics[:HELD_OUT_TOPICS])


def prompts_for(topics: list[str]) -> list[str]:
    return [f"{verb} the {topic}" for topic in topics for verb in VERBS]


def corpus(n: int, rng: random.Random) -> list[str]:
    """Pretraining text: plain sentences about every topic (held-out ones too), in a few shapes."""
    shapes = (
        lambda t: demonstration(t, rng),
        lambda t: f"a {rng.choice(ADJECTIVES)} {t} is near the {rng.choice(TOPICS)} .",
        lambda t: f"i {rng.choice(('saw', 'like', 'know'))} the {t} .",
        lambda t: f"the {t} and the {rng.choice(TOPICS)} are {join_adjectives(rng.sample(ADJECTIVES, 2))} .",
    )
    return [rng.choice(shapes)(rng.choice(TOPICS)) for _ in range(n)]


@dataclass
class World:
    """Everything the demo generates before training: text, prompts, and where the base model was saved."""

    train_prompts: list[str]
    heldout_prompts: list[str]
    demonstrations: list[dict]  # {prompt, response}
    corpus: list[str]


def make_world(seed: int, n_demonstrations: int, n_corpus: int) -> World:
    rng = random.Random(seed)
    train_topics, heldout_topics = split_topics(seed)
    train_prompts, heldout_prompts = prompts_for(train_topics), prompts_for(heldout_topics)
    demos = []
    for _ in range(n_demonstrations):
        prompt = rng.choice(train_prompts)
        demos.append({"prompt": prompt, "response": demonstration(prompt.split()[-1], rng)})
    return World(train_prompts, heldout_prompts, demos, corpus(n_corpus, rng))


def pretrain(model, tokenizer, texts: list[str], steps: int, batch_size: int, lr: float, seed: int) -> list[dict]:
    """A short causal-LM loop on the corpus (each text ends with EOS); returns the logged losses.

    The base model only needs to know the words and sentence shapes, as a real pretrained model would; the
    chat format is what SFT then teaches.
    """
    g = torch.Generator().manual_seed(seed)
    encoded = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    model.train()
    log = []
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=g).tolist()
        width = max(len(encoded[i]) for i in idx)
        ids = torch.tensor([encoded[i] + [tokenizer.pad_token_id] * (width - len(encoded[i])) for i in idx])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(encoded[i]) for i in idx])[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        for group in optimizer.param_groups:  # cosine decay: a cleaner end point in few steps
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            log.append({"step": step + 1, "stage": "pretrain", "loss": loss.item(), "lr": group["lr"]})
    return log


def build_base_model(world: World, folder: Path, size: dict, steps: int, seed: int) -> tuple[Path, list[dict]]:
    """Train the tokenizer on the world's text, pretrain a tiny Llama on the corpus, save both to `folder`."""
    templated = [f"User: {d['prompt']}\n\nAssistant: {d['response']}" for d in world.demonstrations[:500]]
    tokenizer = build_tokenizer(world.corpus + templated + world.heldout_prompts, vocab_size=size["vocab"])
    model = build_tiny_llama(len(tokenizer), hidden=size["hidden"], layers=size["layers"], heads=size["heads"],
                             seed=seed)
    log = pretrain(model, tokenizer, world.corpus, steps, batch_size=32, lr=3e-3, seed=seed)
    return save_model_folder(model, tokenizer, folder), log
