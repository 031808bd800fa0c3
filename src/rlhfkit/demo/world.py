"""The demo's world, built by code from one seed: a tiny language, prompts, demonstrations and a hidden gold reward.

A prompt asks about a topic in a mood: "describe the river in a scary way". A response names a topic and lists
adjectives: "the river is dark , wild and cold .". The **gold reward** plays the part of human judgement, and it
depends on the prompt:

    gold = -2 if the response does not name the asked topic, names another one too, or does not end its
              sentence (".");
    else   min(fitting, 2) - clashing - repeats, at least -2, where
           fitting  = different adjectives that fit the asked mood (MOODS[mood]),
           clashing = different adjectives that fit another mood (a happy word in a scary answer),
           repeats  = adjective uses beyond the first of each ("dark , dark and wild" repeats once).

Adjectives of no mood (PLAIN) earn and cost nothing. The best value, BEST_GOLD = 2, needs two different fitting
adjectives and no clashing or repeated one ("the river is dark and wild ."). The best answer for another mood
scores -2 ("the river is bright and warm ." asked for a scary one), the best answer that ignores the mood scores
0 (plain words only), one about another topic -2: a policy scores well only by reading both words of the prompt.

No model sees this function. The labeller who writes the SFT demonstrations reads the mood but is no poet: each
adjective fits the mood with probability P_FIT = 0.4, is plain with P_PLAIN = 0.45 and fits another mood with 0.15
(`labeller_adjectives`); 1-4 adjectives, never repeated. So the SFT policy is mediocre (gold ~0.3 of 2) and its
samples differ in gold, the signal a reward model needs. The reward model learns the gold only from noisy
comparisons of SFT samples; PPO optimises that learned proxy. What SFT's samples rarely show (a repeat, another
topic), the reward model cannot learn: those are the exploits the demo watches for (FLAWS, EXPLOITS).

Held out are **combinations**: every topic and every mood occurs in training, in the corpus and in demonstrations,
but each topic is held out with one mood for the test split and 20 topics with another mood for the validation
split (`split_combinations`); no SFT, RM or PPO step sees those (topic, mood) pairs.
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
MOODS = {  # which adjectives fit which mood
    "happy": frozenset({"bright", "warm", "golden", "sunny", "lively"}),
    "sad": frozenset({"grey", "cold", "empty", "lonely", "pale"}),
    "scary": frozenset({"dark", "strange", "wild", "hollow", "grim"}),
    "peaceful": frozenset({"calm", "gentle", "quiet", "soft", "still"}),
}
PLAIN = ("old", "small", "large", "wet", "long", "tall", "wide", "dry", "busy")
ADJECTIVES = tuple(sorted(set().union(*MOODS.values()))) + PLAIN
MOOD_NAMES = tuple(MOODS)
VERBS = ("describe", "tell me about", "write about", "talk about")
GOLD_CAP = 2
BEST_GOLD = float(GOLD_CAP)
# the labeller: each adjective of a demonstration fits the asked mood with P_FIT, is plain with P_PLAIN, else it
# fits another mood
P_FIT, P_PLAIN = 0.4, 0.45
VALIDATION_TOPICS = 20  # topics held out with a second mood for the validation split (early stopping)


def words_of(text: str) -> list[str]:
    """Lower-case words with "," and "." as words of their own: "Calm,warm." -> ["calm", ",", "warm", "."]."""
    return text.replace(",", " , ").replace(".", " . ").lower().split()


def make_prompt(verb: str, topic: str, mood: str) -> str:
    return f"{verb} the {topic} in a {mood} way"


def parse_prompt(prompt: str) -> tuple[str, str]:
    """(topic, mood) of a prompt: its first topic word and its first mood word."""
    words = words_of(prompt)
    topic = next(w for w in words if w in TOPICS)
    mood = next(w for w in words if w in MOODS)
    return topic, mood


@dataclass(frozen=True)
class Judgement:
    """What the gold reward sees in one response to one prompt."""

    on_topic: bool  # names the asked topic and no other
    finished: bool  # ends its sentence with "."
    fitting: int  # different adjectives of the asked mood
    clashing: int  # different adjectives of another mood
    repeats: int  # adjective uses beyond the first of each
    gold: float


def judge(prompt: str, response: str) -> Judgement:
    topic, mood = parse_prompt(prompt)
    words = words_of(response)
    topics = {w for w in words if w in TOPICS}
    adjectives = [w for w in words if w in ADJECTIVES]
    used = set(adjectives)
    fitting = len(used & MOODS[mood])
    clashing = sum(len(used & good) for name, good in MOODS.items() if name != mood)
    repeats = len(adjectives) - len(used)
    on_topic, finished = topics == {topic}, bool(words) and words[-1] == "."
    score = max(-GOLD_CAP, min(fitting, GOLD_CAP) - clashing - repeats) if on_topic and finished else -GOLD_CAP
    return Judgement(on_topic, finished, fitting, clashing, repeats, float(score))


def gold_reward(prompt: str, response: str) -> float:
    """The hidden judgement of `response` to `prompt` (module docstring), in [-GOLD_CAP, BEST_GOLD]."""
    return judge(prompt, response).gold


def gold_scores(prompts: list[str], responses: list[str]) -> list[float]:
    """The gold reward as a reward function (`eval.judge: rlhfkit.demo.world:gold_scores`): PPO's held-out judge in
    the demo, never trained on. A rendered prompt reads as its text: the template adds no topic or mood word."""
    return [gold_reward(p, r) for p, r in zip(prompts, responses)]


# Flaws the gold reward punishes, each a predicate on a Judgement. The demo counts them in SFT's and PPO's samples:
# one that PPO makes more frequent is a proxy exploit (the reward model pays for something the gold does not).
FLAWS = {
    "repeated adjective": lambda j: j.repeats > 0,
    "off topic": lambda j: not j.on_topic,
    "unfinished": lambda j: not j.finished,
    "adjective of another mood": lambda j: j.clashing > 0,
}
EXPLOITS = ("repeated adjective", "off topic", "unfinished")  # flaws SFT's samples show rarely: the RM's blind spots


def flaw_rates(prompts: list[str], responses: list[str]) -> dict:
    """{flaw: fraction of responses showing it} for every FLAWS entry, and "exploit": showing any of EXPLOITS."""
    judgements = [judge(p, r) for p, r in zip(prompts, responses)]
    n = max(1, len(judgements))
    rates = {name: sum(map(flaw, judgements)) / n for name, flaw in FLAWS.items()}
    rates["exploit"] = sum(any(FLAWS[name](j) for name in EXPLOITS) for j in judgements) / n
    return rates


def join_adjectives(adjs: list[str]) -> str:
    """["a"] -> "a"; ["a", "b"] -> "a and b"; ["a", "b", "c"] -> "a , b and c"."""
    return adjs[0] if len(adjs) == 1 else " , ".join(adjs[:-1]) + " and " + adjs[-1]


def labeller_adjectives(mood: str, n: int, rng: random.Random) -> list[str]:
    """`n` different adjectives as the labeller picks them for `mood` (P_FIT / P_PLAIN / the rest clashing)."""
    fitting = sorted(MOODS[mood])
    clashing = sorted(set().union(*(good for name, good in MOODS.items() if name != mood)))
    chosen: list[str] = []
    while len(chosen) < n:
        r = rng.random()
        pool = fitting if r < P_FIT else PLAIN if r < P_FIT + P_PLAIN else clashing
        word = rng.choice(pool)
        if word not in chosen:
            chosen.append(word)
    return chosen


def demonstration(prompt: str, rng: random.Random) -> str:
    """A labeller's answer to `prompt`: its topic and 1-4 different adjectives (`labeller_adjectives`)."""
    topic, mood = parse_prompt(prompt)
    return f"the {topic} is {join_adjectives(labeller_adjectives(mood, rng.randint(1, 4), rng))} ."


@dataclass
class Split:
    """(topic, mood) combinations of each split; every topic and every mood occurs in `train`."""

    train: list[tuple[str, str]]
    validation: list[tuple[str, str]]
    test: list[tuple[str, str]]


def split_combinations(seed: int) -> Split:
    """Topics in a seeded order; topic i is held out for test with mood i mod 4 (a Latin square: each mood with 10
    topics), and the first VALIDATION_TOPICS topics for validation with mood i + 1 mod 4; the rest is training."""
    topics = list(TOPICS)
    random.Random(seed).shuffle(topics)
    test, validation = [], []
    for i, topic in enumerate(topics):
        test.append((topic, MOOD_NAMES[i % len(MOOD_NAMES)]))
        if i < VALIDATION_TOPICS:
            validation.append((topic, MOOD_NAMES[(i + 1) % len(MOOD_NAMES)]))
    held = set(test) | set(validation)
    train = [(t, m) for t in TOPICS for m in MOOD_NAMES if (t, m) not in held]
    return Split(train, sorted(validation), sorted(test))


def prompts_for(combinations: list[tuple[str, str]]) -> list[str]:
    return [make_prompt(verb, topic, mood) for topic, mood in combinations for verb in VERBS]


def corpus(n: int, rng: random.Random) -> list[str]:
    """Pretraining text: sentences using every topic, adjective and mood word, as real text would:
    - three shapes in eight name a topic twice ("i saw the cave . the cave is old ."), so the base model learns to
      repeat a word it has read, which answering about the asked topic needs;
    - three in eight pair a mood with adjectives that fit it ("it was a scary day and the cave was dark ."): the
      knowledge of words a pretrained model brings. Nothing in the corpus tells the gold reward's rules: how many
      adjectives, that a clashing or repeated one costs, that an answer must name the asked topic.
    """
    anything = lambda: join_adjectives(rng.sample(ADJECTIVES, rng.randint(1, 4)))  # noqa: E731
    fitting = lambda m: join_adjectives(rng.sample(sorted(MOODS[m]), rng.randint(1, 3)))  # noqa: E731
    other = lambda: rng.choice(TOPICS)  # noqa: E731
    shapes = (
        lambda t, m: f"the {t} is {anything()} .",
        lambda t, m: f"a {rng.choice(ADJECTIVES)} {t} is near the {other()} .",
        lambda t, m: f"i saw the {t} . the {t} is {anything()} .",
        lambda t, m: f"i {rng.choice(('like', 'know'))} the {other()} and the {t} . the {t} is {anything()} .",
        lambda t, m: f"the {other()} is far from the {t} . i like the {t} .",
        lambda t, m: f"it was a {m} day and the {t} was {fitting(m)} .",
        lambda t, m: f"a {m} {t} : {fitting(m)} .",
        lambda t, m: f"the {t} in a {m} way is {fitting(m)} .",
    )
    return [rng.choice(shapes)(rng.choice(TOPICS), rng.choice(MOOD_NAMES)) for _ in range(n)]


@dataclass
class World:
    """Everything the demo generates before training: prompts of each split, demonstrations and the corpus."""

    train_prompts: list[str]
    validation_prompts: list[str]
    heldout_prompts: list[str]  # the test split
    demonstrations: list[dict]  # {prompt, response}, training prompts only
    corpus: list[str]


def make_world(seed: int, n_demonstrations: int, n_corpus: int) -> World:
    rng = random.Random(seed)
    split = split_combinations(seed)
    train = prompts_for(split.train)
    demos = []
    for _ in range(n_demonstrations):
        prompt = rng.choice(train)
        demos.append({"prompt": prompt, "response": demonstration(prompt, rng)})
    return World(train, prompts_for(split.validation), prompts_for(split.test), demos, corpus(n_corpus, rng))


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
    tokenizer = build_tokenizer(world.corpus + templated + world.validation_prompts + world.heldout_prompts,
                                vocab_size=size["vocab"])
    model = build_tiny_llama(len(tokenizer), hidden=size["hidden"], layers=size["layers"], heads=size["heads"],
                             seed=seed)
    log = pretrain(model, tokenizer, world.corpus, steps, batch_size=32, lr=3e-3, seed=seed)
    return save_model_folder(model, tokenizer, folder), log
