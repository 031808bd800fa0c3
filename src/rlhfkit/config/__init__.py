"""Typed configs: YAML files + dotted overrides -> dataclasses, with `--help` generated from field docs."""

from rlhfkit.config.fields import dump_yaml, from_dict, help_text, load_config, parse_overrides, to_dict
from rlhfkit.errors import ConfigError
from rlhfkit.config.dpo_schema import DPOConfig, DPOSection
from rlhfkit.config.schema import (DataConfig, EngineConfig, LoadConfig, LogConfig, LoraConfig, RewardOptions,
                                   RMConfig, SFTConfig, TrainConfig)

__all__ = ["ConfigError", "dump_yaml", "from_dict", "help_text", "load_config", "parse_overrides", "to_dict",
           "DataConfig", "DPOConfig", "DPOSection", "EngineConfig", "LoadConfig", "LogConfig", "LoraConfig",
           "RewardOptions", "RMConfig", "SFTConfig", "TrainConfig"]
