"""The seed datasets by name: which format they are in, their splits, which steps they fit, where a local copy goes.

`data.train: Dahoas/rm-static` picks the preset of that name: its rows are parsed with the preset's format (so
detection can never pick wrongly), `data.eval` defaults to its test split, and the rows come from a local copy
when there is one, else from the hub when online:

    <local_dir>/Dahoas/rm-static/            a save_to_disk folder, or a folder of split files
                                              (train.jsonl, test.parquet, data/train-00000-of-00001.parquet)
    <local_dir>/Dahoas/rm-static.jsonl       or a single file (.jsonl/.json/.parquet/.csv, optionally .gz): train only

`local_dir` is `data.local_dir`, else the environment variable RLHFKIT_DATA_DIR. The local copy wins over the hub
so that an offline cluster and a laptop read the same rows (DeepSpeed-Chat forced a download, #511). Any hub name
(not only a preset's) is looked up there too. A local path takes a preset explicitly: `data.preset=Dahoas/rm-static`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rlhfkit.data.readers import FILE_TYPES, Row, hub_offline, looks_like_hub_id, read_rows
from rlhfkit.errors import DataError, OfflineError

LOCAL_DIR_ENV = "RLHFKIT_DATA_DIR"
# The steps a dataset can feed: SFT demonstrations, RM preference pairs, PPO prompts.
STEPS = ("sft", "rm", "prompts")


@dataclass(frozen=True)
class Preset:
    """How to read one seed dataset. `format` names an entry of formats.FORMATS; `fields` renames columns
    (canonical -> the dataset's) when its layout differs from the format's; `eval_split` is None when the
    dataset has a train split only (then data.eval_fraction of it is held out)."""

    name: str
    format: str
    layout: str  # the row's fields, for the README table and errors
    train_split: str = "train"
    eval_split: str | None = "test"
    steps: tuple[str, ...] = STEPS
    fields: dict = field(default_factory=dict)


# Every seed set is a preference set: RM reads its pairs, SFT its chosen side, PPO its prompts (as in
# DeepSpeed-Chat, which trains all three steps on them).
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("Dahoas/rm-static", "prompt_chosen_rejected", "{prompt, response, chosen, rejected}"),
    Preset("Dahoas/full-hh-rlhf", "prompt_chosen_rejected", "{prompt, response, chosen, rejected}"),
    Preset("Dahoas/synthetic-instruct-gptj-pairwise", "prompt_chosen_rejected", "{prompt, chosen, rejected}",
           eval_split=None),
    Preset("yitingxie/rlhf-reward-datasets", "prompt_chosen_rejected", "{prompt, chosen, rejected}"),
    Preset("openai/webgpt_comparisons", "webgpt", "{question, answer_0, answer_1, score_0, score_1, ...}",
           eval_split=None),
    # SHP's test split is kept for final evaluation; DeepSpeed-Chat evaluates on validation too
    Preset("stanfordnlp/SHP", "shp", "{history, human_ref_A, human_ref_B, labels, ...}", eval_split="validation"),
    Preset("Anthropic/hh-rlhf", "hh_dialogue", "{chosen, rejected} (full dialogues)"),
)}
_BY_LOWER = {name.lower(): preset for name, preset in PRESETS.items()}


def find_preset(name: str | None) -> Preset | None:
    """The preset called `name` (hub names are case-insensitive), or None."""
    return _BY_LOWER.get(str(name).strip().strip("/").lower()) if name else None


def preset_named(name: str) -> Preset:
    """The preset for `data.preset`; an unknown name is an error listing the known ones."""
    preset = find_preset(name)
    if preset is None:
        raise DataError(f"config key 'data.preset': unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return preset


def check_step(preset: Preset, stage: str, source: str) -> None:
    if stage not in preset.steps:
        raise DataError(f"data '{source}': preset {preset.name} fits {', '.join(preset.steps)}, not {stage}")


def resolve_local_dir(configured: str | None) -> Path | None:
    value = configured or os.environ.get(LOCAL_DIR_ENV) or None
    return Path(value).expanduser() if value else None


def local_copy(name: str, local_dir: Path | None) -> Path | None:
    """`<local_dir>/<owner>/<name>` (a folder) or `<local_dir>/<owner>/<name>.<ext>` (a file), if present."""
    if local_dir is None:
        return None
    base = local_dir / name
    if base.is_dir():
        return base
    for suffix in FILE_TYPES:
        for ending in (suffix, suffix + ".gz"):
            candidate = base.with_name(base.name + ending)
            if candidate.is_file():
                return candidate
    return None


def missing_copy_message(name: str, local_dir: Path | None) -> str:
    """The error for a hub name that cannot be fetched and has no local copy: exactly where to put one."""
    preset = find_preset(name)
    splits = [preset.train_split, preset.eval_split] if preset else ["train", "test"]
    files = ", ".join(f"{split}.jsonl" for split in splits if split)
    root = str(local_dir) if local_dir else "DIR"
    lead = (f"dataset '{name}' is not available offline and has no local copy in {local_dir}" if local_dir else
            f"dataset '{name}' is not available offline and no local copy folder is set: set data.local_dir (or "
            f"{LOCAL_DIR_ENV}) to a folder DIR and")
    also = "" if preset else f" (and '{name}' is no local file or folder either)"
    return (f"{lead}: put it at {root}/{name}/ (a save_to_disk folder, or its split files: {files}, or the hub's "
            f"data/*.parquet) or at {root}/{name}.jsonl (one file: the train split){also}")


@dataclass
class Source:
    """One data source of a step, resolved: what the user wrote, what to read, and its preset."""

    name: str  # as written in the config
    location: str  # what readers.read_rows reads: a local path, or the hub name
    weight: float = 1.0
    preset: Preset | None = None
    local_dir: Path | None = None


def resolve_source(name: str, weight: float, preset_name: str | None, local_dir: str | None) -> Source:
    """Where to read `name` and with which preset: an existing path is read as is (with `data.preset` if set); a
    hub name is read from its local copy when present, else from the hub (read_rows fetches it when online)."""
    folder = resolve_local_dir(local_dir)
    preset = preset_named(preset_name) if preset_name else None
    path = Path(name).expanduser()
    if path.exists() or not looks_like_hub_id(name):
        return Source(name, str(path) if path.exists() else name, weight, preset, folder)
    named = find_preset(name)
    spellings = [name] + ([named.name] if named and named.name != name else [])  # as written, then canonical
    copy = next((found for found in (local_copy(n, folder) for n in spellings) if found), None)
    return Source(name, str(copy) if copy else name, weight, preset or named, folder)


def unreadable_source(name: str, preset_name: str | None, local_dir: str | None) -> str | None:
    """Why `name` cannot be read, said without reading it (a path that does not exist; a hub name with no local
    copy while offline), or None. For checks before anything runs, such as the pipeline's of its later steps."""
    src = resolve_source(name, 1.0, preset_name, local_dir)
    if Path(src.location).exists():
        return None
    if looks_like_hub_id(name):
        return missing_copy_message(name, src.local_dir) if hub_offline() else None
    return f"{name}: no such file or folder"


def read_source(src: Source, split: str = "train") -> list[Row]:
    """The rows of one split of a resolved source; a hub name that cannot be fetched says where its copy goes."""
    try:
        return read_rows(src.location, split=split)
    except OfflineError:
        raise DataError(missing_copy_message(src.name, src.local_dir)) from None


def read_named(name: str, split: str = "train", local_dir: str | None = None) -> list[Row]:
    """read_rows for a path, hub name or preset name, local copies included (for callers outside a stage's
    data loading, such as `rlhfkit score --data` or the pipeline's dataset)."""
    return read_source(resolve_source(name, 1.0, None, local_dir), split)
