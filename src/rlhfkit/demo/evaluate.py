"""The demo's held-out evaluation: gold reward of each policy, the RM's accuracy on gold-labelled pairs, KL, and the
proxy (the RM's score) of a policy's own samples.

Every number is measured by sampling at temperature 1 (the policy PPO optimises and the one the KL penalty is
about), with the same seed for every policy, on prompts whose (topic, mood) combination no training step saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.config.schema import LoadConfig
from rlhfkit.data.formats import to_preference_examples
from rlhfkit.data.readers import read_rows
from rlhfkit.data.templates import Template
from rlhfkit.demo.sampling import load_policy, sample
from rlhfkit.models import load_scalar_model, load_tokenizer
from rlhfkit.rollout.evaluate import sequence_kl
from rlhfkit.models.plan import REFERENCE


def mean_stderr(values: list[float]) -> dict:
    """{"mean", "stderr", "n"}: the standard error of the mean, std / sqrt(n) (sample std, n - 1)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {"mean": mean, "stderr": math.sqrt(var / n), "n": n}


def gold_of_policies(folders: dict, prompts: list[str], gen: GenConfig, gold, seed: int, micro: int = 32,
                     policy: str = "ppo", reference: str = "sft", fast: bool = False):
    """Sample every policy on `prompts` with the same seed; gold reward per policy, and the texts.

    `gold(prompt, response) -> float` judges one response. Also the KL of the `policy` folder to the `reference`
    folder: the sum over response tokens of log pi - log pi_ref on the policy's own samples, a Monte-Carlo
    estimate of KL(pi || pi_ref) in nats per response, the quantity PPO's penalty holds down.

    With `fast`, each model takes the speed paths a PPO actor takes (`sampling_plan`), the same for every policy;
    else plain transformers forwards.
    """
    results, texts, kl = {}, {}, None
    models = {}
    for name, folder in folders.items():
        model, tokenizer = load_policy(folder)
        plan = sampling_plan(model) if fast else REFERENCE
        batch = sample(model, tokenizer, prompts, gen, seed, plan)
        texts[name] = batch.response_texts
        results[name] = mean_stderr([gold(p, t) for p, t in zip(prompts, batch.response_texts)])
        models[name] = (model, batch, plan)
    if policy in models and reference in models:
        policy_model, policy_batch, policy_plan = models[policy]
        plans = {"actor": policy_plan, "reference": models[reference][2]}
        kls = sequence_kl(policy_model, models[reference][0], plans, policy_batch, gen.temperature, micro)
        kl = mean_stderr(kls.tolist())
    return results, texts, kl


def sampling_plan(model):
    """The speed plan `rlhfkit ppo` gives its actor, decided for an evaluated model with every setting at its
    default, on the CPU (its CPU kernels installed). Same values up to float rounding."""
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.speed.registry import Target, plan_model

    return plan_model(Target(model, "actor", "ppo", None, LocalEngine()))


class ProxyScorer:
    """The reward model as PPO sees it: its raw score of prompt + response, read from a rollout batch's token ids
    (the demo's RM shares the actor's tokenizer), with a response cut at the token limit scored as unfinished."""

    def __init__(self, rm_dir, eos_id: int, micro: int = 32):
        from rlhfkit.models.reward_fn import ModelReward

        tokenizer = load_tokenizer(str(rm_dir))
        model = load_scalar_model(str(rm_dir), LoadConfig(), tokenizer).eval()
        actor_template = Template.for_tokenizer(tokenizer, "auto", [eos_id])
        self.reward = ModelReward(model, tokenizer, actor_template, "auto", micro, torch.device("cpu"))
        self.eos_id = eos_id

    def __call__(self, batch) -> list[float]:
        from rlhfkit.rollout.experience import ended_with_eos

        return self.reward(batch, ended_with_eos(batch, [self.eos_id])).tolist()


@dataclass
class PolicyEval:
    """One policy's samples on a list of prompts, and what they are worth."""

    prompts: list[str]
    texts: list[str]
    gold: list[float]
    kl: list[float] | None = None  # nats per response to the reference, on these samples
    proxy: list[float] | None = None  # the reward model's raw score of each sample

    def summary(self) -> dict:
        """{"gold": mean_stderr, "kl": ..., "proxy": ...} of what was measured."""
        parts = {"gold": self.gold, "kl": self.kl, "proxy": self.proxy}
        return {name: mean_stderr(values) for name, values in parts.items() if values is not None}


@torch.no_grad()
def gold_of_policy(model, tokenizer, prompts: list[str], gen: GenConfig, gold, seed: int, reference=None,
                   proxy: ProxyScorer | None = None, micro: int = 32) -> PolicyEval:
    """Sample `model` once per prompt (fixed seed); gold of each sample, and when given its KL to `reference`
    (a model) and its `proxy` score."""
    batch = sample(model, tokenizer, prompts, gen, seed)
    texts = batch.response_texts
    result = PolicyEval(prompts, texts, [gold(p, t) for p, t in zip(prompts, texts)])
    if reference is not None:
        plans = {"actor": REFERENCE, "reference": REFERENCE}
        result.kl = sequence_kl(model, reference, plans, batch, gen.temperature, micro).tolist()
    if proxy is not None:
        result.proxy = proxy(batch)
    return result


@torch.no_grad()
def rm_accuracy(rm_dir, pairs_file: str, batch_size: int = 32) -> dict:
    """The RM's accuracy on gold-labelled pairs, through `rlhfkit score`'s scorer and the RM's recorded template."""
    from rlhfkit.stages.reward import MAX_LENGTH_KEY, TEMPLATE_KEY
    from rlhfkit.score import score_pairs

    tokenizer = load_tokenizer(str(rm_dir))
    model = load_scalar_model(str(rm_dir), LoadConfig(), tokenizer).eval()
    template = Template.for_tokenizer(tokenizer, getattr(model.config, TEMPLATE_KEY, "auto"))
    examples = to_preference_examples(read_rows(pairs_file))
    max_length = getattr(model.config, MAX_LENGTH_KEY, None) or 512
    _, summary = score_pairs(model, tokenizer, template, examples, max_length, batch_size, torch.device("cpu"))
    return summary
