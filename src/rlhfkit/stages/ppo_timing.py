"""Where a PPO iteration's time goes: seconds per phase, logged as time/<phase> next to time/iteration."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

# the phases of one iteration, in loop order (time/iteration covers them all plus the small steps between)
PHASES = ("generate", "reward", "reference", "values", "actor_update", "critic_update")


class PhaseTimer:
    """`with timer("reference"): ...` adds the block's wall-clock seconds to that phase; a phase can be entered
    many times (once per micro-batch in the update). On a GPU each block ends with a synchronize, so kernels
    still running are charged to the phase that launched them, not to the next one."""

    def __init__(self, device: torch.device | None = None):
        self.seconds = defaultdict(float)
        self.sync = device is not None and device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict:
        return {f"time/{phase}": seconds for phase, seconds in self.seconds.items()}


def untimed(_phase: str):
    """The timer to use when nobody is measuring."""
    return contextlib.nullcontext()
