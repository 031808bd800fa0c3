"""How every stage starts (sft, rm, dpo, ppo): the output folder's and the model settings' checks, the engine, the
seed, the tokenizer, the template the model was trained with, the ids a response ends with, and the data, in that
order, so that bad input fails before a model loads or a folder is written. The checks come first because they
read no more than a folder and one hub answer: a finished run in output_dir or a model name that is no folder is
said within a second, not after the data was tokenised.

The stage then loads its models and only after them prepares its output folder (`run_dir.prepare_output_dir`):
a model that fails to load leaves no folder behind either.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional

from rlhfkit.data.cache import default_cache_dir
from rlhfkit.data.loader import StageData, load_stage_data
from rlhfkit.data.templates import end_token_ids
from rlhfkit.engine.backends import make_engine
from rlhfkit.engine.protocol import Engine
from rlhfkit.models import load_tokenizer
from rlhfkit.models.loading import check_model_source, load_generation_config
from rlhfkit.config.ppo_schema import reward_kind
from rlhfkit.stages.common import set_seed, with_trained_template
from rlhfkit.stages.run_dir import check_output_dir
from rlhfkit.tasks import task_rows

# the config keys that name a model folder or hub id, in any stage's config (PPO's `reward` parts: `model_settings`)
MODEL_KEYS = ("model", "actor", "critic", "reference")


@dataclass
class StageStart:
    engine: Engine  # the backend `engine.backend` names
    cfg: object  # the stage's config, its data.template following how the model was trained (`with_trained_template`)
    tokenizer: object  # the model's tokenizer, padding on the side the stage asked for
    end_ids: Optional[list[int]]  # the ids a response ends with: the tokenizer's EOS and the model folder's
    #                               generation_config ones (where PPO rollouts stop); None for PPO's prompts
    data: StageData  # tokenised train / eval rows and their counts (`info`)


def model_settings(cfg) -> list[tuple[str, str]]:
    """(config key, folder or hub id) of every model the stage's config names: its models, PPO's reward models
    (not its Python functions or reward servers) and `load.tokenizer`."""
    named = [(key, getattr(cfg, key, None)) for key in MODEL_KEYS]
    if hasattr(cfg, "reward_parts"):
        named += [("reward", part.spec) for part in cfg.reward_parts() if reward_kind(part.spec) == "model"]
    return [(key, name) for key, name in named + [("load.tokenizer", cfg.load.tokenizer)] if name]


def start_stage(cfg, model: str, data_kind: str, padding_side: str = "right",
                check_ranks: Callable[[int], None] | None = None, *, resume: bool, force: bool) -> StageStart:
    """The engine, seed, tokenizer, template, end ids and data a stage starts from.

    `model`: the folder or hub id the stage starts from (`model`; PPO: `actor`). `data_kind`: what the rows are,
    "sft" (demonstrations), "rm" (preference pairs, DPO's too) or "prompts" (PPO's: `data.as_prompt_data()`).
    `check_ranks(world_size)`: the stage's check of its batch sizes against the ranks, before anything loads.
    `resume`, `force`: the command's --resume and --force, checked against output_dir first.
    """
    check_output_dir(cfg, resume, force)
    for key, name in model_settings(cfg):
        check_model_source(key, name)
    engine = make_engine(cfg.engine, cfg.train)
    if check_ranks is not None:
        check_ranks(engine.world_size)
    set_seed(cfg.train.seed)
    tokenizer = load_tokenizer(model, cfg.load, padding_side=padding_side)
    cfg = with_trained_template(cfg, model, tokenizer)
    if data_kind == "prompts":  # prompts alone: no response to end (rollouts stop at the loaded actor's end ids)
        end_ids, data_cfg = None, cfg.data.as_prompt_data()
    else:  # responses end where PPO rollouts will stop: EOS or the folder's generation_config end-of-turn ids
        end_ids, data_cfg = end_token_ids(tokenizer, load_generation_config(model, cfg.load)), cfg.data
    rows = task_rows(cfg, data_kind, lambda line: print(f"data: {line}", file=sys.stderr) if engine.is_main else None,
                     default_cache_dir(cfg.data.cache_dir))
    data = load_stage_data(data_kind, data_cfg, tokenizer, cfg.train.seed, train_spec=rows, end_ids=end_ids,
                           main=engine.is_main)
    return StageStart(engine, cfg, tokenizer, end_ids, data)
