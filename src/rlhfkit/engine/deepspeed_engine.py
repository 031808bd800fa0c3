"""The DeepSpeed engine: ZeRO 0-3, optimizer / parameter offload, multi-rank and multi-node.

The only module that imports deepspeed. It implements `engine.protocol.Engine` beside the local engine (no
subclassing), so the training loops run unchanged. Decisions:
- DeepSpeed's config is generated from rlhfkit's (`engine.*`, `train.*`; `ds_config.py`); `engine.deepspeed_config`
  names a JSON merged over it for anything else, and a JSON contradicting an `engine.*` / `train.*` key is a
  ConfigError naming both (`ds_config.check_user_config`).
- Gradient accumulation is owned by the loop (`managed_gradient_accumulation: false`): the loop calls
  `backward(loss_sum, total)` once per micro-batch and `step` once per optimizer step, exactly as with the
  local engine. DeepSpeed averages gradients over ranks; `backward` multiplies by the world size to undo it.
- Each trained role gets its ZeRO stage (`engine.critic_zero_stage` for the critic). Frozen models (reference,
  reward) are wrapped for inference and partitioned with ZeRO-3 when the trained models use it, as OpenRLHF does
  with separate train / eval configs.
- Generation under ZeRO-3 gathers the parameters once per rollout (`gathered`), not once per token, and
  runs the plain HF model without DeepSpeed's hooks.
- HF export gathers ZeRO-3 parameters one at a time (no device holds the whole model) and rank 0 writes the
  folder (LoRA merged).
- Faults: the process group is created with `engine.collective_timeout_s`, so a rank waiting in a collective
  for a dead or hung one fails after that long (a killed peer over gloo/TCP is noticed at once), and
  `lost_rank_message` turns that failure into one line. Waits for rank 0's file work alone (export, checkpoint
  conversion) run over a gloo group of their own with a longer bound (`RANK0_WORK_TIMEOUT_S`). Checkpoints
  carry a manifest (`manifest.py`), written by rank 0 from every rank's hashes, in a folder all ranks must
  share. A checkpoint saved at another number of ranks is resharded through DeepSpeed's universal checkpoint
  (`to_universal`, `_load_resharded`).
- Non-finite steps: a step whose loss or gradient is not finite on any rank is skipped on every rank (no update,
  no schedule step) and reported as `skipped`, as the local engine does. The gradient check is DeepSpeed's
  own: its ZeRO, bf16 and fp16 optimizers look at the reduced gradients in each rank's partitions (a flag or
  global norm all-reduced over the ranks) and skip the step; at ZeRO-0 fp32 DeepSpeed steps a plain torch
  optimizer, which checks nothing, so rlhfkit gives it `FiniteAdamW`, which does the same after DeepSpeed's
  all-reduce. Each step then checks that all ranks agree (`DeepSpeedTrainable.step`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import math
import os
import re
import shutil
import socket
import sys
import time
import uuid
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from rlhfkit.config.schema import EngineConfig, TrainConfig
from rlhfkit.engine import ds_config
from rlhfkit.engine.local import configured_hyperparameters, float32_weights, lr_lambda, moved_to, param_groups
from rlhfkit.engine.manifest import seal, verified_latest
from rlhfkit.engine.storage import (publish_checkpoint, rank_state, replace_folder, rng_state, saved_world_size,
                                    write_hf_folder)
from rlhfkit.errors import ConfigError, RunError
from rlhfkit.models.lora import clone_for_export


@contextlib.contextmanager
def _unwrapped_for_generation(engine):
    """The wrapped HF model with its ZeRO-3 parameters gathered and DeepSpeed's module hooks removed; the
    hooks are registered again on exit (DeepSpeed's own context)."""
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    with unwrap_model_for_generation(engine):
        yield engine.module


@contextlib.contextmanager
def _gathered_module(module):
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield module


# DeepSpeed still calls the torch.distributed collectives that torch 2.13 renamed; one warning per call
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_timeout_s = None  # the process group's collective timeout, for the lost-rank message
# The ranks' waits for rank 0's file work alone (the HF export, converting a checkpoint to reshard it, clearing an
# old unfinished one): over a gloo group of their own with this bound (or collective_timeout_s, if longer), not the
# world group, whose collective_timeout_s is sized for training steps, and whose NCCL watchdog aborts a waiting
# process outright. A rank 0 that dies is noticed at once (gloo sees the connection drop); only one that hangs
# is waited for this long.
RANK0_WORK_TIMEOUT_S = 2 * 3600.0
_rank0_group = None


def _destroy_process_group() -> None:
    """At exit, while the interpreter is still whole: a gloo group left alive until the interpreter is finalized
    can abort the process from one of its worker threads ("terminate called without an active exception",
    SIGABRT, after the run's work is done and saved; PyTorch issue 190489)."""
    global _rank0_group
    if dist.is_initialized():
        import gc

        from deepspeed.utils import groups

        _rank0_group = None
        gc.collect()  # engines and optimizers left in reference cycles hold process groups of their own
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        # DeepSpeed's module-level handles would keep the groups' C++ objects (and their gloo threads) alive
        # until the interpreter is finalized, the moment the abort happens: drop them while it is whole
        for name in dir(groups):
            if name.startswith("_") and name.endswith("_GROUP"):
                setattr(groups, name, None)
        gc.collect()


def init_process_group(timeout_s: float = 300.0) -> None:
    """Join the launcher's process group (deepspeed / torchrun set RANK, WORLD_SIZE, MASTER_ADDR...), with
    `timeout_s` as the time a collective waits for the other ranks before it fails (gloo raises; NCCL's
    watchdog aborts the process), instead of DeepSpeed's 10 minutes or torch's 30.

    A plain `python -m rlhfkit` run becomes a group of one, so the same code path is used everywhere.
    """
    global _timeout_s, _rank0_group
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
    if torch.cuda.is_available():  # this rank's GPU before anything touches CUDA (NCCL binds to it at init)
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK {local} but this process sees {torch.cuda.device_count()} GPU(s): launch "
                              f"with one process per visible GPU (deepspeed --num_gpus N, torchrun "
                              f"--nproc_per_node N), not one GPU per process with node-wide ranks")
        torch.cuda.set_device(local)
    backend = get_accelerator().communication_backend_name()
    timeout = timedelta(seconds=timeout_s)
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
    atexit.register(_destroy_process_group)
    _timeout_s = timeout_s
    # ZeRO's collectives run on DeepSpeed's clone of the world group, which it would create with torch's
    # default timeout (gloo 30 min, NCCL 10 min), not the world group's: create the clone with the same bound
    from deepspeed.utils import groups

    if dist.get_world_size() > 1 and getattr(groups, "_WORLD_GROUP", "gone") is None:
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout)
    if dist.get_world_size() > 1:
        _rank0_group = dist.new_group(ranks=list(range(dist.get_world_size())), backend="gloo",
                                      timeout=timedelta(seconds=max(timeout_s, RANK0_WORK_TIMEOUT_S)))


def _partition(param: torch.nn.Parameter) -> torch.Tensor:
    """What this rank holds of `param`: its ZeRO-3 partition when partitioned, else the parameter."""
    part = getattr(param, "ds_tensor", None)
    return param if part is None else part


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
            raise RunError(f"DeepSpeed {deepspeed.__version__} {what} (ZeRO-{self.engine.zero_optimization_stage()}"
                           f"), so the weights can no longer be trusted. Resume from the last checkpoint, with the "
                           f"DeepSpeed version rlhfkit is tested with (README: Tested versions) and its gradient "
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


def has_zero_partitions(folder: Path) -> bool:
    """Whether a DeepSpeed checkpoint folder holds ZeRO optimizer partitions (one file per rank), which only the
    same number of ranks can load as they are (ZeRO-0 keeps whole optimizer states, loadable at any size)."""
    return any(folder.glob("*zero_pp_rank_*optim_states.pt"))


def to_universal(source: Path, target: Path) -> None:
    """Convert the ZeRO checkpoint folder `source` into a universal checkpoint in `target` with DeepSpeed's own
    converter (`deepspeed.checkpoint.ds_to_universal`): each parameter's fp32 weights and Adam moments whole, in
    one file per state, which ZeRO at any world size partitions again on load. rlhfkit's checkpoints do not
    record the Megatron-style `universal_checkpoint_info` the converter asks for; plain data parallelism needs
    none of it, so the converter injects its empty default (`inject_missing_state`)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(source), output_folder=str(target), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    chatter = io.StringIO()  # its progress lines and bars; an error raises
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        ds_to_universal.main(args)


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, cfg: EngineConfig, train: TrainConfig | None = None):
        init_process_group(cfg.collective_timeout_s)
        self.cfg = cfg
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.device = torch.device(get_accelerator().current_device_name())
        self.extra = {}
        if cfg.deepspeed_config:
            try:
                self.extra = json.loads(Path(cfg.deepspeed_config).read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"config key 'engine.deepspeed_config': cannot read '{cfg.deepspeed_config}' as "
                                  f"JSON ({exc})") from None
            if not isinstance(self.extra, dict):
                raise ConfigError(f"config key 'engine.deepspeed_config': '{cfg.deepspeed_config}' must hold a "
                                  f"JSON object")
            ds_config.check_user_config(self.extra, cfg.deepspeed_config, cfg, train, self.world_size)

    # -- ranks -----------------------------------------------------------------------------------------
    def shard(self, items: Sequence) -> list:
        per_rank = len(items) // self.world_size
        return list(items[self.rank * per_rank:(self.rank + 1) * per_rank])

    def total(self, local: float) -> float:
        return max(1, self.reduce_sum(local))

    def say(self, text: str) -> None:
        if self.is_main:
            print(text, file=sys.stderr)

    # -- configs ---------------------------------------------------------------------------------------
    def train_config(self, train: TrainConfig, stage: int) -> dict:
        generated = ds_config.train_config(self.cfg, train, stage, self.world_size, torch.cuda.is_available())
        return ds_config.merged_config(generated, self.extra)

    def eval_config(self, stage: int) -> dict:
        return ds_config.eval_config(self.cfg, stage, self.world_size, self.extra)

    # -- models ----------------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, train: TrainConfig, total_steps: int, role: str = "policy",
                lr: float | None = None, keep_grads: bool = False) -> DeepSpeedTrainable:
        # keep_grads: DeepSpeed owns the gradient buffers (ZeRO-1/2 keep flat ones anyway)
        stage = ds_config.stage_of(self.cfg, role)
        if self.cfg.precision not in ("bf16", "fp16"):  # a half load.dtype trained in float32: upcast (under bf16 /
            float32_weights(model, self.say)  # fp16 DeepSpeed casts the module to 16 bits and keeps float32 masters)
        groups = param_groups(model, train.weight_decay)
        peak = train.lr if lr is None else lr
        if self.cfg.offload_optimizer and stage > 0:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, lr=peak, betas=tuple(train.betas), adamw_mode=True)
        else:
            # DeepSpeed's ZeRO and bf16 / fp16 wrappers skip non-finite steps; a bare optimizer (ZeRO-0 fp32) must
            plain = stage == 0 and self.cfg.precision == "fp32"
            optimizer = (FiniteAdamW if plain else torch.optim.AdamW)(groups, lr=peak, betas=tuple(train.betas))
        factor = lr_lambda(train, total_steps)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.train_config(train, stage),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor))
        engine.train()
        return DeepSpeedTrainable(engine, train.max_grad_norm, self.world_size)

    def prepare_frozen(self, model: torch.nn.Module, role: str = "reference") -> torch.nn.Module:
        stage = ds_config.stage_of(self.cfg, role)
        model.requires_grad_(False)
        model.eval()
        if stage != 3:
            model.to("cpu" if self.cfg.offload_reference_model else self.device)
            # in the trained models' precision, as DeepSpeed's bf16 / fp16 engines hold theirs: the parameters
            # cast, the buffers (rotary frequencies) kept. A float32 reference would differ from the actor it
            # started as (KL > 0 before any update)
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.precision)
            if dtype is not None:
                for param in model.parameters():
                    param.data = param.data.to(dtype)
            return model
        engine, *_ = deepspeed.initialize(model=model, config=self.eval_config(stage))
        engine.eval()
        return engine

    @staticmethod
    def _is_zero3(module) -> bool:
        return any(hasattr(p, "ds_id") for p in module.parameters())

    def held_parameters(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """{name: this rank's values} of the trainable parameters: under ZeRO-3 the rank's flat partition
        (`ds_tensor`, which the optimizer updates; `param.data` is empty, or a gathered copy for the small
        parameters ZeRO-3 keeps whole), else the parameter itself."""
        return {name: _partition(p) for name, p in module.named_parameters() if p.requires_grad}

    def holds_whole(self, module: torch.nn.Module) -> bool:
        """Not under ZeRO-3, where each rank holds a partition of every parameter between forwards."""
        return not self._is_zero3(module)

    def parameters_written(self, module: torch.nn.Module) -> None:
        """After partitions were written: the parameters ZeRO-3 keeps gathered (its persistent ones) still hold
        the old values, so release them and gather them again from the partitions, as ZeRO-3 does after a
        step. A collective under ZeRO-3; nothing to do otherwise."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        kept = [p for p in module.parameters()
                if getattr(p, "ds_tensor", None) is not None and p.ds_status == ZeroParamStatus.AVAILABLE]
        if kept:
            kept[0].partition(param_list=kept)  # the partitions are current: only the whole copies are freed
            kept[0].all_gather(param_list=kept)

    def gathered(self, module: torch.nn.Module):
        """A context giving the module to generate with: under ZeRO-3 its parameters are gathered once for the
        whole rollout instead of once per generated token (else the module as it is).

        Without this, ZeRO-3 all-gathers every layer for every generated token (DeepSpeedExamples #718,
        TRL #1051); gathering once is ~10x faster on GPUs at the cost of holding the full model during rollout.
        For a trained model (the actor) DeepSpeed's per-module hooks are taken off for the call as well
        (DeepSpeed's `unwrap_model_for_generation`, what TRL does) and the plain HF model is returned: the
        hooks' bookkeeping no longer runs at every layer of every decode step, and with the whole weights on
        every rank a forward is no collective, so a rank whose rows have ended stops (`generation_kwargs`).
        """
        if not self._is_zero3(module) or not self.cfg.gather_for_generation:
            return contextlib.nullcontext(module)
        if self._unwraps(module):
            return _unwrapped_for_generation(module)
        return _gathered_module(module)

    @staticmethod
    def _unwraps(module) -> bool:
        """A DeepSpeed ZeRO-3 engine with an optimizer, whose hooks `unwrap_model_for_generation` removes."""
        return isinstance(module, deepspeed.DeepSpeedEngine) and getattr(module, "optimizer", None) is not None

    def generation_kwargs(self, module: torch.nn.Module) -> dict:
        # under ZeRO-3 every forward is a collective: a rank whose rows all ended must keep stepping until
        # every rank is done, or the others wait for it forever. Not so for a gathered, unwrapped actor.
        if not (self._is_zero3(module) and self.world_size > 1):
            return {}
        if self.cfg.gather_for_generation and self._unwraps(module):
            return {}
        return {"synced_gpus": True}

    def on_device(self, module):
        """A frozen model kept on the CPU (`offload_reference_model`, not partitioned) on the compute device for
        the block; ZeRO-3 models are DeepSpeed's to place."""
        offload = self.cfg.offload_reference_model and self.device.type != "cpu"
        if module is None or not offload or isinstance(module, deepspeed.DeepSpeedEngine) or self._is_zero3(module):
            return contextlib.nullcontext()
        return moved_to(module, self.device)

    # -- collectives -----------------------------------------------------------------------------------
    def reduce_mean(self, metrics: dict) -> dict:
        keys = [k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not keys or self.world_size == 1:
            return metrics
        t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        out = dict(metrics)
        out.update({k: v / self.world_size for k, v in zip(keys, t.tolist())})
        return out

    def reduce_sum(self, value: float):
        if self.world_size == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return type(value)(t.item()) if isinstance(value, int) else t.item()

    def barrier(self) -> None:
        dist.barrier()

    def _await_rank0(self) -> None:
        """The barrier after work rank 0 does alone, which may take longer than a training collective may wait
        (`RANK0_WORK_TIMEOUT_S`)."""
        if self.world_size > 1:
            dist.barrier(group=_rank0_group)

    def _comm_device(self):
        return self.device if self.device.type != "cpu" else torch.device("cpu")

    def _gather(self, items: list) -> list:
        """Every rank's `items`, concatenated in rank order (a collective)."""
        if self.world_size == 1:
            return list(items)
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, list(items))
        return [item for part in everyone for item in part]

    # -- checkpoints -----------------------------------------------------------------------------------
    def checkpoint_info(self, step: int, trainables: dict) -> dict:
        """What a checkpoint's manifest records besides its files (and what `--resume` must match)."""
        critic = {"critic_zero_stage": ds_config.stage_of(self.cfg, "critic")} if "critic" in trainables else {}
        return {"step": step, "engine": self.name, "world_size": self.world_size, "zero_stage": self.cfg.zero_stage,
                **critic, "trainables": sorted(trainables)}

    def save_checkpoint(self, folder: Path, step: int, trainables: dict, state: dict, keep: int = 2) -> Path:
        """Every rank writes its shards into step-N.tmp (a folder all ranks share); the ranks hash its files
        between them and rank 0 writes manifest.json, renames the folder into place and points `latest` at it."""
        target = folder / f"step-{step:08d}"
        tmp = target.with_name(target.name + ".tmp")
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._check_shared(tmp)  # a collective: also the barrier before the shards are written
        for name, trainable in trainables.items():
            trainable.save(tmp, name)
        torch.save({"step": step, "rng": rng_state(), **state}, tmp / f"state-rank{self.rank}.pt")
        self.barrier()
        seal(tmp, self.checkpoint_info(step, trainables), (self.rank, self.world_size), self._gather,
             write=self.is_main)
        if self.is_main:  # may delete older checkpoints (large folders) as well
            replace_folder(tmp, target)
            publish_checkpoint(folder, target, keep)
        self._await_rank0()
        return target

    def _check_shared(self, tmp: Path) -> None:
        """Every rank must see the folder rank 0 just created: a checkpoint is one folder holding every rank's
        shards, on a filesystem all nodes share (else no node could resume). A RunError on all ranks if not."""
        token = [uuid.uuid4().hex if self.is_main else None]
        marker = tmp / ".shared-by-all-ranks"
        if self.is_main:
            marker.write_text(token[0])
        if self.world_size > 1:  # rank 0 may have cleared a large unfinished save first
            dist.broadcast_object_list(token, src=0, group=_rank0_group)
        sees = False
        for _ in range(10):  # a network filesystem may show a new file a moment late
            with contextlib.suppress(OSError):
                sees = marker.read_text() == token[0]
            if sees:
                break
            time.sleep(0.5)
        everyone = self._gather([(self.rank, socket.gethostname(), sees)])
        blind = [f"rank {rank} ({host})" for rank, host, saw in everyone if not saw]
        if self.is_main:
            marker.unlink()
        if blind:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise RunError(f"checkpoints need output_dir on a filesystem every node shares: {', '.join(blind)} "
                           f"cannot see '{tmp}', which rank 0 created. Put output_dir on a shared filesystem, or "
                           f"run without checkpoints (train.save_every=0; no --resume then)")

    def load_checkpoint(self, folder: Path, trainables: dict) -> dict:
        """folder/latest, verified against its manifest (each rank hashes its share of the files); a damaged
        one is refused on every rank, naming the previous good one. A checkpoint saved at another number of
        ranks is resharded (`_load_resharded`)."""
        target = verified_latest(folder, self.checkpoint_info(0, trainables), self.say,
                                 (self.rank, self.world_size), self._gather, any_world_size=True)
        saved = saved_world_size(target)
        if saved == self.world_size:
            for name, trainable in trainables.items():
                trainable.load(target, name)
        else:
            self._refuse_sharded_state(target, saved)
            self._load_resharded(folder, target, trainables, saved)
        return rank_state(target, self.rank, saved)

    def _refuse_sharded_state(self, target: Path, saved: int) -> None:
        """The loop state rlhfkit can carry to another number of ranks is global; PPO's EMA under ZeRO-3 is not
        (each rank averages its own parameter partition, `models/ema.py`), so that resume is refused."""
        state = torch.load(target / "state-rank0.pt", weights_only=True, map_location="cpu")
        if self.cfg.zero_stage == 3 and state.get("ema") is not None:
            raise RunError(f"--resume: checkpoint '{target}' was saved at {saved} rank(s) and this run has "
                           f"{self.world_size}: its EMA weights (ema.enabled) are per-rank ZeRO-3 partitions, which "
                           f"cannot be resharded. Resume with {saved} rank(s)")

    def _load_resharded(self, folder: Path, target: Path, trainables: dict, saved: int) -> None:
        """Load a checkpoint saved at `saved` ranks on this run's number. Models whose optimizer states are ZeRO
        partitions are converted by rank 0 into a universal checkpoint (DeepSpeed's converter) beside the
        checkpoints, which every rank then loads and partitions its own way; the converted copy is removed after.
        Step, data position and schedule are global, so they carry over as they are; RNG: `rank_state`."""
        universal = folder / f"universal-{target.name}"
        convert = [name for name in trainables if has_zero_partitions(target / name)]
        if convert:
            self.say(f"--resume: {target.name} was saved at {saved} rank(s) and this run has {self.world_size}: "
                     f"converting its ZeRO states to a universal checkpoint ({universal}) to reshard them")
        failure = None
        if self.is_main and convert:
            try:
                shutil.rmtree(universal, ignore_errors=True)
                for name in convert:
                    to_universal(target / name, universal / name)
            except Exception as exc:  # every rank must hear of it, or the others wait at the barrier
                failure = f"{type(exc).__name__}: {exc}"
        failure = self._broadcast(failure, after_rank0_work=True)
        if failure:
            raise RunError(f"--resume: checkpoint '{target}' was saved at {saved} rank(s) and this run has "
                           f"{self.world_size}; converting it to a universal checkpoint to reshard it failed "
                           f"({failure}). Resume with {saved} rank(s)")
        try:
            for name, trainable in trainables.items():
                if name in convert:
                    trainable.load_universal(universal, name)
                else:
                    trainable.load(target, name)
        finally:
            self.barrier()
            if self.is_main:
                shutil.rmtree(universal, ignore_errors=True)
            self._await_rank0()

    def _broadcast(self, value, after_rank0_work: bool = False):
        """Rank 0's `value` on every rank (a collective; `after_rank0_work`: rank 0 may come to it long after
        the others, see `RANK0_WORK_TIMEOUT_S`)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=_rank0_group if after_rank0_work else None)
        return box[0]

    # -- export ----------------------------------------------------------------------------------------
    def export_hf(self, model: torch.nn.Module, tokenizer, target: Path, in_place: bool = True) -> Path:
        """Rank 0 writes a plain transformers folder (LoRA merged); under ZeRO-3 from the gathered shards
        (`_gathered_state`) in a CPU twin of the model. The other ranks wait for it without a training
        collective's time limit (`_await_rank0`)."""
        module = getattr(model, "module", model) if isinstance(model, deepspeed.DeepSpeedEngine) else model
        if not self._is_zero3(module):
            if self.is_main:
                write_hf_folder(module, tokenizer, target, in_place)
            self._await_rank0()
            return target
        state = self._gathered_state(module)
        if self.is_main:
            plain = clone_for_export(module, state)  # same class and adapters, ordinary CPU tensors
            del state
            write_hf_folder(plain, tokenizer, target, in_place=True)
        self._await_rank0()
        return target

    def _gathered_state(self, module: torch.nn.Module) -> dict | None:
        """`module`'s state dict as CPU tensors on rank 0 (None on the others), its ZeRO-3 parameters gathered
        one at a time (a collective): no device ever holds the whole model, which under ZeRO-3 may not fit on
        one, and rank 0's memory holds one copy of it. Names tied to one parameter share one tensor."""
        copies, state = {}, {}
        for name, value in module.state_dict(keep_vars=True).items():
            if id(value) not in copies:
                whole = deepspeed.zero.GatheredParameters([value], modifier_rank=None) if hasattr(value, "ds_id") \
                    else contextlib.nullcontext()
                with whole:
                    copies[id(value)] = value.detach().to("cpu", copy=True) if self.is_main else None
            state[name] = copies[id(value)]
        return state if self.is_main else None


# what gloo / NCCL / the TCP store say when a peer died or a collective timed out
_LOST_PEER = re.compile(r"gloo/transport|Connection (reset|closed) by peer|Broken pipe|Timed out waiting|"
                        r"NCCL (error|communicator)|Watchdog caught collective|Socket Timeout", re.IGNORECASE)
# NCCL errors of this rank's own making (a CUDA fault, two ranks on one GPU, a network set-up problem): no peer
# died, and resuming would meet them again; unless NCCL also names a remote failure
_LOCAL_NCCL = re.compile(r"unhandled cuda error|invalid usage|invalid argument|unhandled system error|"
                         r"ncclInternalError|out of memory", re.IGNORECASE)
_REMOTE_NCCL = re.compile(r"ncclRemoteError|remote process exited|Watchdog caught collective", re.IGNORECASE)


def lost_rank_message(exc: BaseException, output_dir: str | None = None) -> str | None:
    """One line for a collective that failed because another rank died or stopped responding (None when
    `exc` is something else): which rank saw it, the bound it waited, the last checkpoint and how to resume."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    if not (isinstance(exc, dist.DistError) or _LOST_PEER.search(str(exc))):
        return None
    text = str(exc)
    if "nccl" in text.lower() and _LOCAL_NCCL.search(text) and not _REMOTE_NCCL.search(text):
        return None  # this rank's own fault: its traceback says more than "another rank died"
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = re.sub(r"^\[[^\]]*\] ", "", detail).split(". ")[0][:200]  # no gloo source path, first sentence
    latest = Path(output_dir) / "checkpoints" / "latest" if output_dir else None
    saved = f"; the last checkpoint is {latest.read_text().strip()} in '{latest.parent}'" \
        if latest is not None and latest.is_file() else ""
    bound = f" (engine.collective_timeout_s={_timeout_s:g})" if _timeout_s else ""
    return (f"rank {dist.get_rank()} of {dist.get_world_size()} ({socket.gethostname()}): a collective with the "
            f"other ranks failed, so another rank died or stopped responding{bound}: {detail}{saved}. See the "
            f"other ranks' logs for the cause, then run the same command with --resume (on every node)")
