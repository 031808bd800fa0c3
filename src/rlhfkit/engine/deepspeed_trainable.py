"""DeepSpeed's engine (model + ZeRO optimizer + schedule) behind the `Trainable` interface, and the optimizer it is
given at ZeRO-0 fp32. The engine comes from `deepspeed.initialize` in `deepspeed_engine.py`, the module that imports
deepspeed; this one only calls its methods.

- Gradient accumulation is owned by the loop (`managed_gradient_accumulation: false`): the loop calls
  `backward(loss_sum, total)` once per micro-batch and `step` once per optimizer step, exactly as with the
  local engine. DeepSpeed averages gradients over ranks; `backward` multiplies by the world size to undo it.
- Non-finite steps: a step whose loss or gradient is not finite on any rank is skipped on every rank (no update,
  no schedule step) and reported as `skipped`, as the local engine does. The gradient check is DeepSpeed's
  own: its ZeRO, bf16 and fp16 optimizers look at the reduced gradients in each rank's partitions (a flag or
  global norm all-reduced over the ranks) and skip the step; at ZeRO-0 fp32 DeepSpeed steps a plain torch
  optimizer, which checks nothing, so rlhfkit gives it `FiniteAdamW`, which does the same after DeepSpeed's
  all-reduce. Each step then checks that all ranks agree (`DeepSpeedTrainable.step`).
"""

from __future__ import annotations

import math
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist

from rlhfkit.engine.local import configured_hyperparameters
from rlhfkit.errors import RunError


class FiniteAdamW(torch.optim.AdamW):
    """torch's AdamW that skips a step whose gradients are not all finite and says so in `overflow`, the flag
    DeepSpeed reads after `optimizer.step()` to skip the schedule step and count the step as skipped (as with its
    own fp16 / bf16 / ZeRO optimizers). Given to DeepSpeed at ZeRO-0 fp32 only, where it steps the optimizer it
    was given: its gradients are whole and all-reduced by then, so every rank takes the same decision."""

    overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.overflow = bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        if self.overflow:
            return None  # DeepSpeed drops the gradients next (engine.zero_grad)
        return super().step(closure)


class DeepSpeedTrainable:
    """A DeepSpeed engine (model + ZeRO optimizer + schedule) behind the Trainable interface."""

    def __init__(self, engine, max_grad_norm: float, world_size: int):
        self.engine = engine
        self.module = engine  # calling it runs the wrapped model's forward (ZeRO-3 fetches parameters)
        self.max_grad_norm = max_grad_norm
        self.world_size = world_size
        self.good, self.bad = 0, 0  # micro-batches back-propagated / dropped since the last step

    def backward(self, loss_sum: torch.Tensor, total: float) -> None:
        """The gradient of `loss_sum / total` (`total` counts over all ranks). DeepSpeed averages gradients
        over ranks, so the loss is multiplied by the world size first."""
        # ranks agree whether any of them saw a non-finite loss: all skip that backward together, since
        # ZeRO's gradient reduction inside backward is a collective
        flag = torch.tensor([0.0 if torch.isfinite(loss_sum.detach()).all() else 1.0], device=loss_sum.device)
        dist.all_reduce(flag)
        if flag.item() > 0:
            self.bad += 1
            return
        self.good += 1
        self.engine.backward(loss_sum * self.world_size / total, scale_wrt_gas=False)

    def step(self) -> dict:
        """The optimizer step over the micro-batches back-propagated since the last one.

        A step whose gradient is not finite on any rank is skipped on every rank, as with the local engine: no
        update (optimizer states untouched), no schedule step, gradients dropped; it reports `skipped` and the
        loop still counts it as a step (its batch is not retried). Unlike the local engine, a step keeps its
        finite micro-batches when others had a non-finite loss (ZeRO has already reduced their gradients into
        its partitions); a step with none left is skipped. Under fp16 DeepSpeed's loss scaler skips a step that
        overflowed and lowers its scale, its normal way of finding the scale: reported as `fp16_overflow`, not
        `skipped`, so it does not count towards the run's stop after consecutive non-finite steps.
        """
        good, bad = self.good, self.bad
        self.good = self.bad = 0
        if good == 0 and bad > 0:
            return {"grad_norm": float("nan"), "skipped": 1.0}
        # ZeRO-0 fp32 steps the bare optimizer (FiniteAdamW) and records no norm: the whole, reduced gradients'
        # norm before DeepSpeed clips them, as the other stages and the local engine report it
        own_norm = self._norm() if isinstance(getattr(self.engine, "optimizer", None), FiniteAdamW) else None
        self.engine.step()  # DeepSpeed's optimizer (or FiniteAdamW) skips a non-finite step itself
        stats = self._step_outcome()
        if "grad_norm" not in stats and own_norm is not None:
            stats["grad_norm"] = own_norm
        if bad:
            stats["dropped_micro_batches"] = float(bad)
        return stats

    def _norm(self) -> float:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item() \
            if grads else 0.0

    def _step_outcome(self) -> dict:
        """grad_norm and whether DeepSpeed skipped the step it just took, checked to be the same on all ranks."""
        applied = self.engine.was_step_applied()
        norm = self.engine.get_global_grad_norm()
        norm = None if norm is None else float(norm)
        # DeepSpeed's norm helpers mark a non-finite norm as -1
        applied_non_finite = applied and norm is not None and not (math.isfinite(norm) and norm >= 0)
        skipped_on, corrupted_on = self._ranks_with(not applied, applied_non_finite)
        if corrupted_on or 0 < skipped_on < self.world_size:
            what = "updated the weights with a non-finite gradient" if corrupted_on else \
                f"skipped a step on {skipped_on} of {self.world_size} ranks only"
            raise RunError(f"DeepSpeed {version('deepspeed')} {what} (ZeRO-{self.engine.zero_optimization_stage()}"
                           f"), so the weights can no longer be trusted. Resume from the last checkpoint, with the "
                           f"DeepSpeed version rlhfkit is tested with (docs/contributing.md: Tested versions) and its gradient "
                           f"overflow check left on (no bf16.check_grad_overflow=false in engine.deepspeed_config)")
        if skipped_on:
            return {"grad_norm": float("nan"), "fp16_overflow" if self.engine.fp16_enabled() else "skipped": 1.0}
        return {"grad_norm": norm} if norm is not None else {}

    def _ranks_with(self, *flags: bool) -> list[int]:
        """For each flag, how many ranks raise it (a collective: every rank calls it at the same point)."""
        counts = torch.tensor([float(f) for f in flags], device=self.engine.device)
        if self.world_size > 1:
            dist.all_reduce(counts)
        return [int(c) for c in counts.tolist()]

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def train(self, mode: bool = True):
        self.engine.train(mode)
        return self

    def save(self, folder: Path, name: str) -> None:
        self.engine.save_checkpoint(str(folder), tag=name, save_latest=False)

    def load(self, folder: Path, name: str) -> None:
        self._load(folder, name, universal=False)

    def load_universal(self, folder: Path, name: str) -> None:
        """Load `folder/name`, a universal checkpoint (`to_universal`), which DeepSpeed reads at any world size."""
        self._load(folder, name, universal=True)

    def _load(self, folder: Path, name: str, universal: bool) -> None:
        """DeepSpeed takes `universal` from its config's `checkpoint.load_universal`, read at load time only, so it
        is switched on for this call instead of for the whole run."""
        config = self.engine._config
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = universal
        try:
            with configured_hyperparameters(self.engine.lr_scheduler):
                path, _ = self.engine.load_checkpoint(str(folder), tag=name)
        finally:
            config.load_universal_checkpoint = before
        if path is None:
            raise FileNotFoundError(f"DeepSpeed checkpoint '{folder / name}' could not be loaded")
        if universal:
            _unshare_adam_steps(self.engine.optimizer)


def _unshare_adam_steps(zero_optimizer) -> None:
    """Give each parameter group's Adam state its own `step` tensor. DeepSpeed 0.19's ZeRO-3 universal load
    puts one tensor object in every group's state, and torch's Adam increments it in place once per group, so
    after a resume with two groups (decayed / not) the bias correction ran two steps per step (measured: losses
    off by 4e-3 three steps later, 1e-7 with this)."""
    inner = getattr(zero_optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
