"""The engine a run asks for by name (`engine.backend`): `LocalEngine` (one process) or `DeepSpeedEngine` (ZeRO,
many ranks), both implementing the `Engine` protocol (`engine/protocol.py`)."""

from __future__ import annotations

import os

from rlhfkit.config.schema import EngineConfig, TrainConfig
from rlhfkit.engine.cpu_memory import keep_freed_memory
from rlhfkit.engine.local import LocalEngine
from rlhfkit.engine.protocol import Engine


def _deepspeed_engine(cfg: EngineConfig, train: TrainConfig | None = None):
    from rlhfkit.engine.deepspeed_engine import DeepSpeedEngine  # imports deepspeed only when asked for

    return DeepSpeedEngine(cfg, train)


ENGINES = {"local": LocalEngine, "deepspeed": _deepspeed_engine}


def make_engine(cfg: EngineConfig, train: TrainConfig | None = None) -> Engine:
    """The engine `engine.backend` names. `train`, when given, lets the DeepSpeed engine check a user's
    `engine.deepspeed_config` against `train.*` before anything is written."""
    engine = ENGINES[cfg.backend](cfg, train)
    if engine.device.type == "cpu" and cfg.keep_freed_memory:
        keep_freed_memory()
    if cfg.backend == "local" and engine.device.type == "cpu":
        # transformers' save_pretrained imports deepspeed (through accelerate) where it is installed, and DeepSpeed
        # then warns that it found no GPU ("Setting accelerator to CPU ... unable to detect it"): nothing of
        # DeepSpeed runs on the local engine, and the CPU is what it chose. DS_ACCELERATOR is DeepSpeed's own
        # switch; a value the user set stays.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return engine
