"""The demo's held-out evaluation: gold reward of each policy, the RM's accuracy on gold-labelled pairs, KL.

Every number is measured on prompts whose topics no training step saw, by sampling at temperature 1 (the policy
PPO optimises and the one the KL penalty is about), with the same seed for every policy.
"""

from __future__ import annotations

import math

import torch

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.config.schema import LoadConfig
from rlhfkit.data.formats import to_preference_examples
from rlhfkit.data.readers import read_rows
from rlhfkit.data.templates import Template
from rlhfkit.demo.sampling import load_policy, sample
from rlhfkit.models import load_scalar_model, load_tokenizer
from rlhfkit.rollout.evaluate import sequence_kl


def mean_stderr(values: list[float]) -> dict:
    """{"mean", "stderr", "n"}: the standard error of the mean, std / sqrt(n) (sample std, n - 1)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {"mean": mean, "stderr": math.sqrt(var / n), "n": n}


def gold_of_policies(folders: dict, prompts: list[str], gen: GenConfig, gold, seed: int, micro: int = 32,
                     policy: str = "ppo", reference: str = "sft"):
    """Sample every policy on `prompts` with the same seed; gold reward per policy, and the texts.

    `gold(prompt, response) -> float` judges one response. Also the KL of the `policy` folder to the `reference`
    folder: the sum over response tokens of log pi - log pi_ref on the policy's own samples, a Monte-Carlo
    estimate of KL(pi || pi_ref) in nats per response, the quantity PPO's penalty holds down.
    """
    results, texts, kl = {}, {}, None
    models = {}
    for name, folder in folders.items():
        model, tokenizer = load_policy(folder)
        batch = sample(model, tokenizer, prompts, gen, seed)
        texts[name] = batch.response_texts
        results[name] = mean_stderr([gold(p, t) for p, t in zip(prompts, batch.response_texts)])
        models[name] = (model, batch)
    if policy in models and reference in models:
        policy_model, policy_batch = models[policy]
        kls = sequence_kl(policy_model, models[reference][0], policy_batch, gen.temperature, micro)
        kl = mean_stderr(kls.tolist())
    return results, texts, kl


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
