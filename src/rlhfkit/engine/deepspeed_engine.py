"""The DeepSpeed engine: ZeRO 0-3, optimizer / parameter offload, multi-rank and multi-node.

The only module that imports deepspeed. It implements `engine.protocol.Engine` beside the local engine (no
subclassing), so the training loops run unchanged. Its parts: the process group (`process_group.py`), the trained
model behind the `Trainable` interface (`deepspeed_trainable.py`), checkpoints across ranks and their resharding
(`deepspeed_checkpoints.py`). Decisions:
- DeepSpeed's config is generated from rlhfkit's (`engine.*`, `train.*`; `ds_config.py`); `engine.deepspeed_config`
  names a JSON merged over it for anything else, and a JSON contradicting an `engine.*` / `train.*` key is a
  ConfigError naming both (`ds_config.check_user_config`).
- Each trained role gets its ZeRO stage (`engine.critic_zero_stage` for the critic). Frozen models (reference,
  reward) are wrapped for inference and partitioned with ZeRO-3 when the trained models use it, as OpenRLHF does
  with separate train / eval configs.
- Generation under ZeRO-3 gathers the parameters once per rollout (`gathered`), not once per token, and
  runs the plain HF model without DeepSpeed's hooks.
- HF export gathers ZeRO-3 parameters one at a time (no device holds the whole model) and rank 0 writes the
  folder (LoRA merged); the other ranks wait for it over the process group's rank-0 side group.
"""

from __future__ import annotations

import contextlib
import json
import sys
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
from rlhfkit.engine.deepspeed_checkpoints import load_sharded, save_sharded
from rlhfkit.engine.deepspeed_trainable import DeepSpeedTrainable, FiniteAdamW
from rlhfkit.engine.local import float32_weights, lr_lambda, moved_to, param_groups
from rlhfkit.engine.process_group import await_rank0, init_process_group
from rlhfkit.engine.storage import write_hf_folder
from rlhfkit.errors import ConfigError
from rlhfkit.lora import clone_for_export


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


def _join_with_deepspeed(timeout: timedelta) -> None:
    """DeepSpeed's own init of the launcher's process group (its comm layer over torch.distributed), on the
    accelerator's backend (NCCL on GPUs, gloo on CPU)."""
    backend = get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)


def _partition(param: torch.nn.Parameter) -> torch.Tensor:
    """What this rank holds of `param`: its ZeRO-3 partition when partitioned, else the parameter."""
    part = getattr(param, "ds_tensor", None)
    return param if part is None else part


class DeepSpeedEngine:
    name = "deepspeed"
    in_process_group = True  # init_process_group below, a group of one for a plain run

    def __init__(self, cfg: EngineConfig, train: TrainConfig | None = None):
        init_process_group(_join_with_deepspeed, cfg.collective_timeout_s)
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

    def parameters_whole(self, params: list):
        """ZeRO-3 partitions gathered for the block (all ranks, same order); other parameters are whole already."""
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        if not partitioned:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)

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

    def reduce_max(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def barrier(self) -> None:
        dist.barrier()

    def _comm_device(self):
        return self.device if self.device.type != "cpu" else torch.device("cpu")

    # -- checkpoints -----------------------------------------------------------------------------------
    def checkpoint_info(self, step: int, trainables: dict) -> dict:
        """What a checkpoint's manifest records besides its files (and what `--resume` must match)."""
        critic = {"critic_zero_stage": ds_config.stage_of(self.cfg, "critic")} if "critic" in trainables else {}
        return {"step": step, "engine": self.name, "world_size": self.world_size, "zero_stage": self.cfg.zero_stage,
                **critic, "trainables": sorted(trainables)}

    def save_checkpoint(self, folder: Path, step: int, trainables: dict, state: dict, keep: int = 2) -> Path:
        """Every rank's shards in one folder all ranks share, sealed by rank 0 (`deepspeed_checkpoints.py`)."""
        return save_sharded(self, folder, step, trainables, state, self.checkpoint_info(step, trainables), keep)

    def load_checkpoint(self, folder: Path, trainables: dict) -> dict:
        """folder/latest, verified against its manifest; one saved at another number of ranks is resharded
        (`deepspeed_checkpoints.py`)."""
        return load_sharded(self, folder, trainables, self.checkpoint_info(0, trainables))

    # -- export ----------------------------------------------------------------------------------------
    def export_hf(self, model: torch.nn.Module, tokenizer, target: Path, in_place: bool = True) -> Path:
        """Rank 0 writes a plain transformers folder (LoRA merged); under ZeRO-3 from the gathered shards
        (`_gathered_state`) in a CPU twin of the model. The other ranks wait for it without a training
        collective's time limit (`process_group.await_rank0`)."""
        module = getattr(model, "module", model) if isinstance(model, deepspeed.DeepSpeedEngine) else model
        if not self._is_zero3(module):
            if self.is_main:
                write_hf_folder(module, tokenizer, target, in_place)
            await_rank0()
            return target
        state = self._gathered_state(module)
        if self.is_main:
            plain = clone_for_export(module, state)  # same class and adapters, ordinary CPU tensors
            del state
            write_hf_folder(plain, tokenizer, target, in_place=True)
        await_rank0()
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
