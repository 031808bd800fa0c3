"""The config of `rlhfkit pipeline`: shared keys once, then one section per step.

```yaml
model: facebook/opt-1.3b        # SFT's start (and the RM's, unless rm.model is set)
output_dir: runs/opt
dataset: Dahoas/rm-static       # optional: one dataset cut across the steps ...
data_split: [2, 4, 4]           # ... by these fractions (DeepSpeed-Chat's 2,4,4)
engine: {backend: deepspeed, zero_stage: 2}
sft: {train: {lr: 1.0e-5}}      # each section holds that step's own keys (`rlhfkit sft --help`)
rm:  {model: facebook/opt-350m}
ppo: {train: {max_steps: 200}}
```

A section is merged over the shared keys (its values win), then over the chained outputs, and validated as that
step's config, so a wrong key is reported as `rm.train.lrr`. Chaining (unless the section sets the key itself):
output_dir/sft/final is PPO's actor (and, by PPO's default, its reference) and the RM's starting model; output_dir/
rm/final is PPO's reward (and, by PPO's default, its critic). The optional `dpo` step (`steps: [sft, dpo]`) starts
from output_dir/sft/final (its policy and reference) and reads the preference share of `dataset`, the RM's (index 1).
With `task` (a reasoning-gym task by name) instead of `dataset`, steps [sft, ppo] need no RM: sft trains on the
task's question -> answer rows and ppo on its questions, scored by the task's own scorer (docs/tasks.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlhfkit.config.dpo_schema import DPOConfig
from rlhfkit.config.fields import deep_merge, from_dict, option, to_dict
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.errors import ConfigError
from rlhfkit.config.task_schema import TaskConfig
from rlhfkit.config.schema import EngineConfig, LoadConfig, LogConfig, LoraConfig, RMConfig, SFTConfig, TrainConfig
from rlhfkit.run_files import final_dir

STEPS = ("sft", "rm", "ppo", "dpo")
DEFAULT_STEPS = ("sft", "rm", "ppo")
STEP_CONFIGS = {"sft": SFTConfig, "rm": RMConfig, "ppo": PPOConfig, "dpo": DPOConfig}
# which share of data_split each step reads: DPO trains on preference pairs, the RM's share
SPLIT_INDEX = {"sft": 0, "rm": 1, "ppo": 2, "dpo": 1}


@dataclass
class PipelineConfig:
    model: Optional[str] = option(None, "the base model SFT starts from (the RM starts from the SFT output unless "
                                        "rm.model is set)")
    output_dir: str = option("runs/pipeline", "each step writes output_dir/STEP/; summary.json goes here")
    dataset: Any = option(None, "one data source for all three steps (any form data.train takes; preference rows "
                                "serve all three), cut by data_split; a section's own data source wins")
    data_split: list = option([2, 4, 4], "relative shares of `dataset` for sft, rm, ppo (DeepSpeed-Chat's 2,4,4), "
                                         "passed to each step as data.split_fractions / data.split_index (dpo "
                                         "reads the rm share; with steps [sft, dpo], e.g. [2, 8, 0] gives it the "
                                         "ppo share too)")
    task: TaskConfig = option(TaskConfig(), "a reasoning-gym task for sft (its question -> answer rows) and ppo (its "
                                            "questions, scored by its own scorer): steps [sft, ppo] train on it "
                                            "from this one key (docs/tasks.md); a section's own data or reward "
                                            "wins")
    steps: list = option(list(DEFAULT_STEPS), "the steps to run, in order, of sft, rm, ppo, dpo (a complete step is "
                                              "skipped unless --force or --rerun STEP, or a step it is built on "
                                              "runs again); [sft, dpo]: DPO instead of RM + PPO")
    train: TrainConfig = option(TrainConfig(), "optimisation keys shared by every step (a section overrides them)")
    load: LoadConfig = option(LoadConfig(), "model loading, shared by every step")
    lora: LoraConfig = option(LoraConfig(), "LoRA, shared by every step")
    engine: EngineConfig = option(EngineConfig(), "backend, shared by every step")
    log: LogConfig = option(LogConfig(), "logging, shared by every step")
    sft: dict = option({}, "step 1's own keys (see `rlhfkit sft --help`), merged over the shared ones")
    rm: dict = option({}, "step 2's own keys (see `rlhfkit rm --help`), merged over the shared ones")
    ppo: dict = option({}, "step 3's own keys (see `rlhfkit ppo --help`); train.max_steps is required")
    dpo: dict = option({}, "the dpo step's own keys (see `rlhfkit dpo --help`), merged over the shared ones")

    def validate(self, prefix: str = "") -> None:
        if len(self.data_split) != 3 or not all(isinstance(x, (int, float)) and x >= 0 for x in self.data_split) \
                or sum(self.data_split) <= 0:
            raise ConfigError(f"config key '{prefix}data_split': expected three shares >= 0 for sft, rm, ppo, "
                              f"got {self.data_split!r}")
        if self.task.name and self.dataset is not None:
            raise ConfigError(f"config key '{prefix}task': the steps read the task's rows; unset `dataset` (or give "
                              f"a step its own data in its section and leave the task out)")
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown or not self.steps:
            raise ConfigError(f"config key '{prefix}steps': expected a non-empty list of {list(STEPS)}, "
                              f"got {self.steps!r}")
        for index, step in enumerate(self.steps):  # checked now, so a typo in `ppo` fails before SFT trains an hour
            step_cfg = step_config(self, step)
            for key in ("model", "actor", "reward"):  # an input chained from a step that will not run before it
                value = getattr(step_cfg, key, None)
                for producer in ("sft", "rm"):
                    made = str(final_dir(Path(self.output_dir) / producer))
                    if value == made and producer not in self.steps[:index] and not Path(made).exists():
                        raise ConfigError(f"config key '{prefix}{step}.{key}': '{made}' is the {producer} step's "
                                          f"output, but steps {self.steps} run no {producer} before {step} and it "
                                          f"does not exist: add {producer} to steps, or set {step}.{key}")


def _section_sets(section: dict, dotted: str) -> bool:
    node = section
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return node is not None


def _chained(cfg: PipelineConfig, step: str) -> dict:
    """The keys one step gets from the shared ones and from the steps before it (its section overrides them)."""
    out = Path(cfg.output_dir)
    shared = {key: to_dict(getattr(cfg, key)) for key in ("train", "load", "lora", "engine", "log")}
    chained: dict = {"output_dir": str(out / step)}
    source_key = "prompts" if step == "ppo" else "train"
    if cfg.dataset is not None and not _section_sets(getattr(cfg, step), f"data.{source_key}"):
        # the loader cuts the same seeded partition in every step and keeps share `split_index`
        chained["data"] = {source_key: cfg.dataset, "split_fractions": list(cfg.data_split),
                           "split_index": SPLIT_INDEX[step]}
    if cfg.task.name and step in ("sft", "ppo"):  # one task for both: the same rows (one folder)
        chained["task"] = to_dict(cfg.task)
    if step == "sft":
        chained["model"] = cfg.model
    elif step in ("rm", "dpo"):
        chained["model"] = str(final_dir(out / "sft"))
    else:
        chained.update(actor=str(final_dir(out / "sft")))
        if not cfg.task.name:  # a task's own scorer judges (PPOConfig.reward_parts)
            chained["reward"] = str(final_dir(out / "rm"))
    return deep_merge(shared, chained)


def step_config(cfg: PipelineConfig, step: str):
    """The typed config of one step: shared keys, then chained outputs, then the step's own section."""
    merged = deep_merge(_chained(cfg, step), copy.deepcopy(getattr(cfg, step)))
    return from_dict(STEP_CONFIGS[step], merged, prefix=f"{step}.")
