"""Engines own devices, ranks, optimizers, distributed state, checkpoints and export: the `Engine` protocol
(`engine/protocol.py`), implemented by `LocalEngine` (`engine/local.py`, one process) and `DeepSpeedEngine`
(`engine/deepspeed_engine.py`, ZeRO, many ranks); `engine/backends.py` picks one by `engine.backend`.

This file imports nothing: `engine/partition.py` (whether DeepSpeed holds a weight in shards) is read by the CPU
kernels below the engine (`accel/`), and importing it must not pull the engines, which sit above them.
"""
