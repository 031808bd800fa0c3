"""From a `data:` config section to tokenised train/eval sets for one stage.

1. resolve each source: a path, a hub name, or a seed-dataset preset with its local copy (presets.py);
2. read it and keep this step's share of its rows (`data.split_fractions`, DeepSpeed-Chat's data_split);
3. convert the rows to canonical examples in the source's format (the preset's, or detected); unusable rows
   (formats.ROW_SKIPS) are skipped and counted, or refused when `data.strict_rows`;
4. hold out eval rows per source (the dataset's own test split, else `data.eval_fraction`), then weight the rest
   (mixing: weight w keeps round(w * n) examples, w < 1 subsamples, w > 1 repeats, seeded);
5. tokenise with the shared template, dropping (or refusing, `data.on_long_prompt=error`) prompts that fill
   `data.max_length`, and skipping (or refusing, `data.strict_rows`) rows the chat template refuses.
A cache (cache.py) skips 2-5 when nothing they depend on changed. Every problem surfaces as a DataError before any
training starts, and a step left with no training rows says what removed them.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from dataclasses import dataclass, field

from rlhfkit.config.schema import DataConfig
from rlhfkit.data import cache
from rlhfkit.data.formats import ROW_SKIPS, to_preference_examples, to_prompt_examples, to_sft_examples
from rlhfkit.data.presets import Source, check_step, read_source, resolve_source
from rlhfkit.data.readers import has_split
from rlhfkit.data.templates import Template, encode_prompt
from rlhfkit.data.tokenize import tokenize_preferences, tokenize_prompts, tokenize_sft
from rlhfkit.errors import DataError, TemplateRefused, where

# The partition of data.split_fractions is shuffled with this fixed seed, not train.seed: every step must cut the
# same partition, whatever seed its own section sets, or the steps' shares would overlap.
PARTITION_SEED = 0
# options that do not change the rows: left out of the cache key (a source's location is keyed by its identity)
_NOT_KEYED = ("cache", "cache_dir", "local_dir")


@dataclass
class StageData:
    train: list
    eval: list
    info: dict = field(default_factory=dict)


def mix_sources(spec, key: str = "data.train") -> list[tuple[str, float]]:
    """`data.train` (`key`: the config key it came from, for errors) as [(path, weight)]: a string, or a list of
    strings / {path, weight} mappings."""
    if isinstance(spec, str):
        return [(spec, 1.0)]
    if isinstance(spec, list) and spec:
        out = []
        for i, item in enumerate(spec):
            if isinstance(item, str):
                out.append((item, 1.0))
            elif isinstance(item, dict) and isinstance(item.get("path"), str):
                unknown = sorted(set(item) - {"path", "weight"})
                if unknown:
                    raise DataError(f"config key '{key}[{i}].{unknown[0]}': unknown (a mix entry takes path and "
                                    f"weight)")
                weight = item.get("weight", 1.0)
                if not isinstance(weight, (int, float)) or weight <= 0:
                    raise DataError(f"config key '{key}[{i}].weight': must be a positive number, got {weight!r}")
                out.append((item["path"], float(weight)))
            else:
                raise DataError(f"config key '{key}[{i}]': expected a path or {{path, weight}}, got {item!r}")
        return out
    raise DataError(f"config key '{key}': expected a path or a list of {{path, weight}}, got {spec!r}")


def partition(n: int, fractions: list, index: int) -> list[int]:
    """Ascending indices of share `index` when n rows are cut by the relative `fractions` (e.g. [2, 4, 4]).

    DeepSpeed-Chat's data_split: SFT, the reward model and PPO each train on their own rows, so the RM is not
    fitted on responses to prompts SFT imitated and PPO rolls out on prompts neither has seen."""
    order = list(range(n))
    random.Random(PARTITION_SEED).shuffle(order)
    total = sum(fractions)
    bounds = [round(n * sum(fractions[:i]) / total) for i in range(len(fractions) + 1)]
    return sorted(order[bounds[index]:bounds[index + 1]])


def _check_split_options(cfg: DataConfig) -> None:
    shares = cfg.split_fractions
    if not shares:
        return
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in shares) or not sum(shares):
        raise DataError(f"config key 'data.split_fractions': expected relative shares >= 0 such as [2, 4, 4], "
                        f"got {shares!r}")
    if not 0 <= cfg.split_index < len(shares):
        raise DataError(f"config key 'data.split_index': {cfg.split_index} is not a share of data.split_fractions "
                        f"{shares} (0 to {len(shares) - 1})")
    if shares[cfg.split_index] == 0:
        raise DataError(f"config key 'data.split_index': share {cfg.split_index} of data.split_fractions {shares} "
                        f"is 0, so this step would read no rows")


def _read_share(src: Source, split: str, cfg: DataConfig) -> list:
    """The rows of one split of a source, cut to this step's share."""
    rows = read_source(src, split)
    if cfg.split_fractions:
        keep = partition(len(rows), cfg.split_fractions, cfg.split_index)
        if not keep:
            raise DataError(f"data '{src.name}': share {cfg.split_index} of data.split_fractions "
                            f"{cfg.split_fractions} gets none of its {len(rows)} rows")
        rows = [rows[i] for i in keep]
    return rows


# stage -> rows -> canonical examples; skipped rows are counted in `stats`
CONVERTERS = {"sft": to_sft_examples, "rm": to_preference_examples, "prompts": to_prompt_examples}


def format_and_fields(src: Source, fmt: str, fields: dict | None) -> tuple[str, dict]:
    """The row format and column renames to read `src` with: a preset fixes the format (so detection cannot pick
    wrongly) and adds its renames; an explicit format and the user's renames still win."""
    preset = src.preset
    return (fmt if fmt != "auto" else (preset.format if preset else "auto"),
            {**(preset.fields if preset else {}), **(fields or {})})


def _convert(stage: str, rows: list, src: Source, cfg: DataConfig, stats: dict) -> list:
    fmt, fields = format_and_fields(src, cfg.format, cfg.fields)
    stats["rows_read"] = stats.get("rows_read", 0) + len(rows)
    return CONVERTERS[stage](rows, fields or None, fmt, stats, strict=cfg.strict_rows)


# the eval splits a source without a preset may have, in the order looked for
EVAL_SPLITS = ("test", "validation")


def eval_split_of(src: Source, train_split: str) -> str | None:
    """The source's own eval split: its preset's (when the copy has it), else a `test` or `validation` split of a
    folder (test.jsonl, a DatasetDict, a hub snapshot's data/test-*.parquet) or hub dataset; never train's."""
    candidates = (src.preset.eval_split,) if src.preset else EVAL_SPLITS
    return next((split for split in candidates if split and split != train_split and has_split(src.location, split)),
                None)


def _own_eval_split(src: Source, cfg: DataConfig) -> str | None:
    """A training source's own eval split, unless data.eval names the eval rows."""
    return None if cfg.eval else eval_split_of(src, cfg.split)


def _hold_out(n: int, fraction: float, seed: int) -> list[int]:
    """The indices of a seeded `fraction` of n examples, held out for eval (in the seeded order)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_eval = int(round(fraction * n)) if fraction > 0 else 0
    if n and n_eval >= n:
        raise DataError(f"config key 'data.eval_fraction': {fraction} leaves no training rows")
    return order[:n_eval]


def weighted(examples: list, weight: float, rng: random.Random) -> list:
    """round(weight * n) examples: whole copies, then a seeded sample without replacement for the rest."""
    if weight == 1.0 or not examples:
        return list(examples)
    want = max(1, round(weight * len(examples)))
    whole, rest = divmod(want, len(examples))
    return examples * whole + rng.sample(examples, rest)


def resolve_sources(cfg: DataConfig, train_spec=None, key: str = "data.train") -> tuple[list[Source], Source | None]:
    """The step's training sources (`key`: the config key they came from) and its explicit eval source (None:
    held out per source)."""
    spec = cfg.train if train_spec is None else train_spec
    sources = [resolve_source(name, weight, cfg.preset, cfg.local_dir) for name, weight in mix_sources(spec, key)]
    evals = resolve_source(cfg.eval, 1.0, cfg.preset, cfg.local_dir) if cfg.eval else None
    return sources, evals


def read_examples(stage: str, cfg: DataConfig, seed: int, sources: list[Source], eval_source: Source | None):
    """Steps 2-4: (train examples, eval examples, {"train": stats, "eval": stats})."""
    _check_split_options(cfg)
    stats: dict = {"train": {}, "eval": {}}
    rng = random.Random(seed)
    # parts: (source, its examples); evals: (source index, example index) of a held-out row, (None, example) of
    # an eval split's
    parts, evals = [], []
    for i, src in enumerate(sources):
        if src.preset:
            check_step(src.preset, stage, src.name)
        examples = _convert(stage, _read_share(src, cfg.split, cfg), src, cfg, stats["train"])
        own = _own_eval_split(src, cfg)
        if own:
            evals += [(None, ex) for ex in _convert(stage, _read_share(src, own, cfg), src, cfg, stats["eval"])]
        elif eval_source is None and cfg.eval_max_rows > 0:  # eval_max_rows 0: no evaluation, nothing held out
            evals += [(i, k) for k in _hold_out(len(examples), cfg.eval_fraction, seed + i)]  # seed + 0: as unmixed
        parts.append((src, examples))
    if eval_source is not None:
        split = eval_split_of(eval_source, cfg.split) or cfg.split
        evals = [(None, ex) for ex in _convert(stage, _read_share(eval_source, split, cfg), eval_source, cfg,
                                               stats["eval"])]
    mixed = len(sources) > 1
    kept = at_most(list(range(len(evals))), cfg.eval_max_rows, mixed and eval_source is None, seed + 1) \
        if cfg.eval_max_rows > 0 else []
    # only the held-out rows the eval keeps leave training: those past eval_max_rows train (else they would be
    # neither trained nor evaluated)
    if 0 < len(kept) < len(evals):  # said in the log: the rows evaluated are fewer than the rows there are
        stats["eval"]["eval_capped_from"] = len(evals)
    held = {evals[j] for j in kept if evals[j][0] is not None}
    if held:
        stats["train"]["held_out"] = len(held)
    train = []
    for i, (src, examples) in enumerate(parts):
        rows = [ex for k, ex in enumerate(examples) if (i, k) not in held]  # the file order
        train += weighted(rows, src.weight, rng)  # held-out rows are never repeated into train
    train = at_most(train, cfg.max_rows, mixed, seed)
    return train, [parts[i][1][k] if i is not None else k for i, k in (evals[j] for j in kept)], stats


def at_most(rows: list, n: int, mixed: bool, seed: int) -> list:
    """At most n rows (n <= 0: all): a single source's first n, a mix's seeded sample of n in their order, so
    every source keeps its share (the first n of a mix would all be the first source's)."""
    if n <= 0 or len(rows) <= n:
        return rows
    if not mixed:
        return rows[:n]
    return [rows[i] for i in sorted(random.Random(seed).sample(range(len(rows)), n))]


# stage -> (canonical examples, tokenizer, template, cfg, skip counts) -> (tokenised rows, {"truncated", "dropped"})
TOKENIZERS = {
    "sft": lambda ex, tok, tpl, cfg, skipped: tokenize_sft(ex, tok, tpl, cfg.max_length, cfg.loss_on, skipped,
                                                           cfg.strict_rows),
    "rm": lambda ex, tok, tpl, cfg, skipped: tokenize_preferences(ex, tok, tpl, cfg.max_length, skipped,
                                                                  cfg.strict_rows),
    "prompts": lambda ex, tok, tpl, cfg, skipped: tokenize_prompts(ex, tok, tpl, cfg.max_length, skipped,
                                                                   cfg.strict_rows),
}
STAGES = TOKENIZERS  # the stage names load_stage_data accepts
# skip counts -> what a user reads in the log and in the "no training rows left" error
SKIP_REASONS = {"identical": "chosen identical to rejected", "dropped_ties": "ties (equal scores)",
                "no_shared_prompt": "chosen and rejected with different prompts", **ROW_SKIPS,
                "template_refused": "the chat template refuses the conversation"}


def skipped_rows(info: dict) -> str:
    """The rows skipped, by reason, for a stage's first log line: "2 identical, 1 empty_prompt" ("" if none)."""
    return ", ".join(f"{info[key]} {key}" for key in SKIP_REASONS if info.get(key))


def _first_long_prompt(examples: list, tokenizer, template: Template, cfg: DataConfig) -> DataError | None:
    for ex in examples:
        try:
            n = len(encode_prompt(tokenizer, template.prompt(ex.prompt)))
        except TemplateRefused:
            continue  # skipped and counted by tokenisation
        if n >= cfg.max_length:
            return DataError(f"{where(ex.source, ex.line)}: the prompt is {n} tokens once rendered, not shorter than "
                             f"data.max_length={cfg.max_length} (data.on_long_prompt=error: raise data.max_length, "
                             f"or set data.on_long_prompt=drop to skip and count such rows)")
    return None


def _nothing_left(stage: str, spec, stats: dict, dropped: int, cfg: DataConfig) -> DataError:
    names = spec if isinstance(spec, str) else ", ".join(name for name, _ in mix_sources(spec))
    reasons = [f"{stats[key]} skipped: {text}" for key, text in SKIP_REASONS.items() if stats.get(key)]
    if dropped:
        why = "prompt too long, or both sides equal once truncated" if stage == "rm" else "prompt too long"
        reasons.append(f"{dropped} dropped by data.max_length={cfg.max_length} ({why})")
    held = f" ({stats['held_out']} held out for evaluation)" if stats.get("held_out") else ""
    return DataError(f"data '{names}': no training rows left after filtering: {stats.get('rows_read', 0)} rows "
                     f"read{held}" + (f"; {'; '.join(reasons)}" if reasons else ""))


def _tokenize(stage: str, train_ex: list, eval_ex: list, stats: dict, tokenizer, template: Template,
              cfg: DataConfig, spec) -> StageData:
    """Step 5, and the checks that need token counts."""
    train, train_tok = TOKENIZERS[stage](train_ex, tokenizer, template, cfg, stats["train"])
    evals, eval_tok = TOKENIZERS[stage](eval_ex, tokenizer, template, cfg, stats["eval"])
    if cfg.on_long_prompt == "error" and stage != "prompts" and (train_tok["dropped"] or eval_tok["dropped"]):
        error = _first_long_prompt(train_ex + eval_ex, tokenizer, template, cfg)
        if error:  # else every drop was an rm pair whose sides became equal once truncated
            raise error
    if not train:
        raise _nothing_left(stage, spec, stats["train"], train_tok["dropped"], cfg)
    counts = {key: stats["train"].get(key, 0) + stats["eval"].get(key, 0)
              for key in {*stats["train"], *stats["eval"]}}
    info = {"template": template.name, "train_rows": len(train), "eval_rows": len(evals), "eval_read": len(eval_ex),
            "truncated": train_tok["truncated"] + eval_tok["truncated"],
            "dropped": train_tok["dropped"] + eval_tok["dropped"], **counts}
    return StageData(train, evals, info)


def _cache_entry(stage, cfg, seed, spec, sources, eval_source, tokenizer, template):
    """(path, key) of this data's cache entry, or (None, reason) when it cannot be keyed safely."""
    identities = [cache.source_identity(src.location) for src in sources + ([eval_source] if eval_source else [])]
    if any(identity is None for identity in identities):
        return None, "off (a hub dataset's revision is unknown)"
    options = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_KEYED}
    key = cache.make_key({"stage": stage, "seed": seed, "data": options, "train_spec": spec,
                          "sources": identities, "tokenizer": cache.tokenizer_fingerprint(tokenizer),
                          "template": template.name, "end_ids": list(template.end_ids)})
    return cache.entry_path(cache.default_cache_dir(cfg.cache_dir), stage, key), key


def load_stage_data(stage: str, cfg: DataConfig, tokenizer, seed: int, train_spec=None,
                    end_ids: list[int] | None = None, main: bool = True) -> StageData:
    """Tokenised train and eval rows for `stage` ("sft", "rm" or "prompts"), with counts in `.info`
    (`info["cache"]`: "hit", "miss" or "off ..."). `end_ids`: the ids a response ends with, as PPO rollouts stop
    at them (`templates.end_token_ids` of the model folder's generation config); default the tokenizer's EOS.
    `main`: this process is the main rank (`engine.is_main`): it alone prints notes and writes the cache file
    (every rank computes the same rows)."""

    def note(text: str) -> None:
        if main:
            print(f"data: {text}", file=sys.stderr)

    spec = cfg.train if train_spec is None else train_spec
    template = Template.for_tokenizer(tokenizer, cfg.template, end_ids, key="data.template")
    _note_system_prompt(template, note)
    sources, eval_source = resolve_sources(cfg, train_spec, "data.prompts" if stage == "prompts" else "data.train")
    path, key = _cache_entry(stage, cfg, seed, spec, sources, eval_source, tokenizer, template) if cfg.cache \
        else (None, "off")
    if path is not None:
        cached = cache.load(path, key, warn=note)
        if cached is not None:
            note(f"cache hit: {len(cached['train'])} train / {len(cached['eval'])} eval rows from {path}")
            data = StageData(cached["train"], cached["eval"], {**cached["info"], "cache": "hit"})
            _note_eval_rows(stage, data, cfg, eval_source, note)
            return data
    train_ex, eval_ex, stats = read_examples(stage, cfg, seed, sources, eval_source)
    data = _tokenize(stage, train_ex, eval_ex, stats, tokenizer, template, cfg, spec)
    if path is not None and main:  # one writer; other ranks computed the same
        if cache.save(path, key, data.train, data.eval, data.info, warn=note):
            note(f"tokenised rows cached at {path}")
    data.info["cache"] = "miss" if path is not None else key
    _note_eval_rows(stage, data, cfg, eval_source, note)
    return data


def _note_system_prompt(template: Template, note) -> None:
    """Say so when the chat template writes a system prompt of its own into every row that has none."""
    text = template.added_system_prompt()
    if text:
        shown = text if len(text) <= 80 else text[:77] + "..."
        note(f"the chat template adds its own system prompt to every row without a system turn: {shown!r}; to "
             f"use another, give the rows one (a first message {{\"role\": \"system\", \"content\": ...}} in "
             f"\"messages\", or a \"system\" field in alpaca and sharegpt rows), or data.template=plain for no chat "
             f"template")


# Fewer held-out rows than this make a metric that means little: one row moves an accuracy by more than 10 points,
# and the standard error of an accuracy near 0.5 over n rows, 0.5 / sqrt(n), is 0.16 or more.
MIN_EVAL_ROWS = 10


def _note_eval_rows(stage: str, data: StageData, cfg, eval_source, note) -> None:
    """Say so when data.eval_max_rows leaves evaluation rows out, when the rows held out by data.eval_fraction are
    too few to mean anything, or when evaluation rows
    were asked for but none are left (a held-out share of few rows rounds to none, or every eval row was too long):
    the run logs no eval metrics."""
    if data.info.get("eval_capped_from"):
        note(f"evaluation rows: {len(data.eval)} of {data.info['eval_capped_from']} (data.eval_max_rows="
             f"{cfg.eval_max_rows} keeps each evaluation quick; raise it to evaluate on all of them)")
    # (a data.eval_max_rows the user set below MIN_EVAL_ROWS is their choice)
    if data.eval and eval_source is None and data.info.get("held_out") \
            and len(data.eval) < min(MIN_EVAL_ROWS, cfg.eval_max_rows):
        key = "data.eval_prompts" if stage == "prompts" else "data.eval"
        total = data.info["train_rows"] + data.info["held_out"]
        share = math.ceil(MIN_EVAL_ROWS * 100 / total) / 100  # the share _hold_out rounds to MIN_EVAL_ROWS rows
        larger = f", data.eval_fraction={share:g} (holds out {round(share * total)} of {total})" if share <= 0.5 \
            else ""
        rows = f"{len(data.eval)} row{'s' if len(data.eval) > 1 else ''}"
        note(f"evaluation on {rows} only, held out by data.eval_fraction={cfg.eval_fraction:g} of {total}: eval "
             f"metrics over fewer than {MIN_EVAL_ROWS} rows mean little (one row is {1 / len(data.eval):.0%} of "
             f"every eval mean); set {key}=PATH (rows of your own){larger}, or data.eval_fraction=0 for no evaluation")
    if data.eval or cfg.eval_max_rows <= 0:
        return
    if data.info.get("eval_read"):  # there were some: tokenisation skipped or dropped every one
        note(f"no evaluation rows: all {data.info['eval_read']} were skipped or dropped (too long for "
             f"data.max_length={cfg.max_length}, or empty), so the run logs no eval metrics")
    elif eval_source is None and cfg.eval_fraction > 0:
        note(f"no evaluation rows: data.eval_fraction {cfg.eval_fraction} of {data.info['train_rows']} rows rounds "
             f"to none, so the run logs no eval metrics; pass data.eval (ppo: data.eval_prompts) or raise "
             f"data.eval_fraction")
