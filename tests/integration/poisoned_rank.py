"""`python -m rlhfkit` with one rank's gradient made non-finite at one step, recording every rank's weights and
optimizer state around each optimizer step: the fault injection of `test_ds_faults.py`, kept on the test side.

torchrun runs this file in place of `-m rlhfkit` (same arguments). Environment:
- POISON_RANK, POISON_FORWARD: on that rank, the POISON_FORWARD-th training forward of `sft` (1-based, counting
  micro-batches) returns its loss unchanged but with an infinite gradient;
- SNAPSHOT_DIR: where `rank{R}-step{N}.pt` go: {"before", "after"} (each {"weights", "optimizer"}), the step's
  stats and DeepSpeed's own skipped-step count.
"""

import os
import sys
from pathlib import Path

import torch

from rlhfkit.cli import main
from rlhfkit.engine.deepspeed_trainable import DeepSpeedTrainable
from rlhfkit.stages import sft

RANK = int(os.environ.get("RANK", "0"))
POISON_RANK, POISON_FORWARD = int(os.environ["POISON_RANK"]), int(os.environ["POISON_FORWARD"])
SNAPSHOTS = Path(os.environ["SNAPSHOT_DIR"])
real_forward, real_step = sft.lm_forward, DeepSpeedTrainable.step
counts = {"forward": 0, "step": 0}


def poisoned_forward(model, batch, device, *args, **kwargs):
    nll, n = real_forward(model, batch, device, *args, **kwargs)
    if not (torch.is_grad_enabled() and model.training):  # eval and the packing check are not training forwards
        return nll, n
    counts["forward"] += 1
    if RANK == POISON_RANK and counts["forward"] == POISON_FORWARD:
        nll = nll + torch.sqrt(nll - nll.detach())  # the same value; d sqrt(u)/du is infinite at u = 0
    return nll, n


def snapshot(engine) -> dict:
    """This rank's weights (its partition under ZeRO-3) and optimizer: master weights (fp32 partitions under ZeRO
    and bf16) and Adam's moments and step count."""
    weights = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    optimizer = engine.basic_optimizer
    # ZeRO-3 puts its fp32 partitions into the optimizer's groups only for the time of a step
    state = [p for group in optimizer.param_groups for p in group["params"]] or \
        list(engine.optimizer.fp32_partitioned_groups_flat)
    state += [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    return {name: torch.cat([t.detach().float().flatten() for t in tensors])
            for name, tensors in (("weights", weights), ("optimizer", state))}


def recorded_step(self) -> dict:
    before = snapshot(self.engine)
    stats = real_step(self)
    counts["step"] += 1
    record = {"before": before, "after": snapshot(self.engine), "stats": stats,
              "deepspeed_skipped_steps": self.engine.skipped_steps}
    torch.save(record, SNAPSHOTS / f"rank{RANK}-step{counts['step']}.pt")
    return stats


if __name__ == "__main__":
    sft.lm_forward = poisoned_forward
    DeepSpeedTrainable.step = recorded_step
    sys.exit(main())
