"""From a `data:` config section to tokenised train/eval sets for one stage.

read rows (any source, optionally several mixed by weight) -> canonical examples (format detected) ->
train/eval split (seeded) -> tokenised with the shared template. Every problem surfaces as a DataError
before any training starts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from rlhfkit.config.schema import DataConfig
from rlhfkit.data.errors import DataError
from rlhfkit.data.formats import to_preference_examples, to_prompt_examples, to_sft_examples
from rlhfkit.data.readers import read_rows
from rlhfkit.data.templates import Template
from rlhfkit.data.tokenize import tokenize_preferences, tokenize_prompts, tokenize_sft


@dataclass
class StageData:
    train: list
    eval: list
    info: dict = field(default_factory=dict)


def _sources(spec) -> list[tuple[str, float]]:
    """`data.train` as [(path, weight)]: a string, or a list of strings / {path, weight} mappings."""
    if isinstance(spec, str):
        return [(spec, 1.0)]
    if isinstance(spec, list) and spec:
        out = []
        for i, item in enumerate(spec):
            if isinstance(item, str):
                out.append((item, 1.0))
            elif isinstance(item, dict) and isinstance(item.get("path"), str):
                weight = item.get("weight", 1.0)
                if not isinstance(weight, (int, float)) or weight <= 0:
                    raise DataError(f"config key 'data.train[{i}].weight': must be a positive number, got {weight!r}")
                out.append((item["path"], float(weight)))
            else:
                raise DataError(f"config key 'data.train[{i}]': expected a path or {{path, weight}}, got {item!r}")
        return out
    raise DataError(f"config key 'data.train': expected a path or a list of {{path, weight}}, got {spec!r}")


def read_mixed(spec, convert, split: str, seed: int) -> list:
    """Read every source, convert its rows, and mix: weight w keeps round(w * n) examples of a source
    (w < 1 subsamples, w > 1 repeats), drawn with a seeded generator so mixing is reproducible."""
    rng = random.Random(seed)
    mixed = []
    for path, weight in _sources(spec):
        examples = convert(read_rows(path, split=split))
        if weight == 1.0:
            mixed.extend(examples)
            continue
        want = max(1, round(weight * len(examples)))
        whole, rest = divmod(want, len(examples))
        mixed.extend(examples * whole + rng.sample(examples, rest))
    return mixed


def _split(examples: list, cfg: DataConfig, convert, seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    if cfg.eval:
        evals = convert(read_rows(cfg.eval, split=cfg.split))
        train = list(examples)
    else:
        order = list(range(len(examples)))
        rng.shuffle(order)
        n_eval = int(round(cfg.eval_fraction * len(examples))) if cfg.eval_fraction > 0 else 0
        if n_eval >= len(examples):
            raise DataError(f"config key 'data.eval_fraction': {cfg.eval_fraction} leaves no training rows")
        evals = [examples[i] for i in order[:n_eval]]
        train = [examples[i] for i in sorted(order[n_eval:])]
    if cfg.max_rows > 0:
        train = train[: cfg.max_rows]
    return train, evals[: cfg.eval_max_rows]


# stage -> (rows -> canonical examples, canonical examples -> tokenised rows)
STAGES = {
    "sft": (to_sft_examples, lambda ex, tok, tpl, cfg: tokenize_sft(ex, tok, tpl, cfg.max_length, cfg.loss_on)),
    "rm": (to_preference_examples, lambda ex, tok, tpl, cfg: tokenize_preferences(ex, tok, tpl, cfg.max_length)),
    "prompts": (to_prompt_examples, lambda ex, tok, tpl, cfg: tokenize_prompts(ex, tok, tpl, cfg.max_length)),
}


def load_stage_data(stage: str, cfg: DataConfig, tokenizer, seed: int, train_spec=None) -> StageData:
    """Tokenised train and eval rows for `stage` ("sft", "rm" or "prompts"), with counts in `.info`."""
    to_examples, tokenize = STAGES[stage]
    stats: dict = {}

    def convert(rows):
        if stage == "rm":
            return to_preference_examples(rows, fields=cfg.fields or None, format=cfg.format, stats=stats)
        return to_examples(rows, fields=cfg.fields or None, format=cfg.format)

    examples = read_mixed(train_spec if train_spec is not None else cfg.train, convert, cfg.split, seed)
    train_ex, eval_ex = _split(examples, cfg, convert, seed)
    template = Template.for_tokenizer(tokenizer, cfg.template)
    train, train_stats = tokenize(train_ex, tokenizer, template, cfg)
    evals, eval_stats = tokenize(eval_ex, tokenizer, template, cfg)
    if not train:
        raise DataError(f"data '{cfg.train}': no training rows left after filtering "
                        f"({train_stats['dropped']} dropped: prompt longer than data.max_length={cfg.max_length})")
    info = {"template": template.name, "train_rows": len(train), "eval_rows": len(evals),
            "truncated": train_stats["truncated"] + eval_stats["truncated"],
            "dropped": train_stats["dropped"] + eval_stats["dropped"], **stats}
    return StageData(train, evals, info)
