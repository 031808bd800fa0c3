"""Engines own devices, optimizers, distributed state and checkpoints. Loops call only this interface:
`prepare` (trainable) / `prepare_frozen` (inference), `gathered` (full params for generate),
`reduce_mean`, `save_checkpoint` / `load_checkpoint`, `export_hf`, `is_main`."""

from __future__ import annotations

from rlhfkit.config.schema import EngineConfig
from rlhfkit.engine.cpu_memory import keep_freed_memory
from rlhfkit.engine.local import LocalEngine, atomic_folder, latest_checkpoint, write_json


def _deepspeed_engine(cfg: EngineConfig):
    from rlhfkit.engine.deepspeed_engine import DeepSpeedEngine  # imports deepspeed only when asked for

    return DeepSpeedEngine(cfg)


ENGINES = {"local": LocalEngine, "deepspeed": _deepspeed_engine}


def make_engine(cfg: EngineConfig):
    engine = ENGINES[cfg.backend](cfg)
    if engine.device.type == "cpu" and cfg.keep_freed_memory:
        keep_freed_memory()
    return engine


__all__ = ["ENGINES", "LocalEngine", "atomic_folder", "latest_checkpoint", "make_engine", "write_json"]
