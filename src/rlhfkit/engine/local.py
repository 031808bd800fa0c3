"""The plain single-process engine: one device, torch AdamW, atomic checkpoints, HF export.

It implements `engine.protocol.Engine` (and its `Trainable`), as the DeepSpeed engine does beside it; with one
rank, sharding is the identity and reductions return their input.
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_model, save_model

from rlhfkit.config.schema import TrainConfig
from rlhfkit.engine.manifest import seal, verified_latest
from rlhfkit.engine.storage import atomic_folder, publish_checkpoint, rng_state, set_rng_state, write_hf_folder


def lr_lambda(cfg: TrainConfig, total_steps: int):
    """Linear warmup, then cosine / linear decay to `min_lr_ratio` of the peak, or constant."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.scheduler == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return factor


# the optimizer settings a run's config gives (train.lr / ppo.critic_lr as `initial_lr`, the schedule's peak;
# train.weight_decay, train.betas): what a resumed run takes from its own config, not from the checkpoint
CONFIGURED = ("initial_lr", "weight_decay", "betas")


@contextlib.contextmanager
def configured_hyperparameters(scheduler: torch.optim.lr_scheduler.LambdaLR):
    """Load a checkpoint's optimizer and schedule state inside this block and the configured learning rate, weight
    decay and betas stay: torch's `load_state_dict` brings back the checkpointed run's (its param groups' values and
    the schedule's `base_lrs`), so `--resume train.lr=...` would continue at the old rate while saying it uses the
    new one. The moments, the step count and the schedule's position come from the checkpoint; this step's rate is
    the configured peak times the schedule's factor at that position (the factor of the current config too: its
    warmup and decay are a closure, not saved)."""
    optimizer = scheduler.optimizer
    configured = [{k: group[k] for k in CONFIGURED if k in group} for group in optimizer.param_groups]
    yield
    for group, values in zip(optimizer.param_groups, configured):
        group.update(values)
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm gains are not regularised (as in GPT-2/3 training)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(groups: list[dict], **kwargs) -> torch.optim.AdamW:
    """torch's AdamW with its fused kernel where the parameters' device and dtypes have one (CPU and CUDA
    float types): one pass over each tensor instead of the foreach path's dozen (CPU, 5M parameters: 4.7 vs
    16.9 ms a step; 20M: 11 vs 72 ms). The same update up to float rounding."""
    params = [p for g in groups for p in g["params"]]
    if params and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params):
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):  # a torch build or dtype without the fused kernel
            pass
    return torch.optim.AdamW(groups, **kwargs)


def allocate_training_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the gradients and AdamW's moments now, before the first forward, rather than inside the first
    step (the gradients in its backward, the moments in its update). Long-lived tensors made in the middle of
    a step land in the holes its activations leave, and every later step's activations then need fresh heap
    above them; made first, they sit below all of it (SmolLM2 SFT on a CPU, peak RSS of 3 steps: 5385 MiB against
    5745 with the moments made in the first step).

    The moments go in through `load_state_dict`, as a resumed run's do: zeros and step 0, which is exactly the
    state AdamW creates itself on its first step, so the updates are the same. Only for torch's Adam/AdamW."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or optimizer.state:
        return
    state, index = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                state[index] = {"step": torch.zeros((), dtype=torch.float32),
                                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                if group.get("amsgrad"):
                    state[index]["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            index += 1
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


class Trainable:
    """A model with its optimizer and schedule (`protocol.Trainable`). The loop calls forward on `.module`, then
    backward / step."""

    def __init__(self, module: torch.nn.Module, cfg: TrainConfig, total_steps: int, lr: float | None = None,
                 keep_grads: bool = False):
        self.module = module
        self.keep_grads = keep_grads  # zero the gradients after a step instead of freeing them (see `prepare`)
        self.max_grad_norm = cfg.max_grad_norm
        self.optimizer = adamw(param_groups(module, cfg.weight_decay), lr=cfg.lr if lr is None else lr,
                               betas=tuple(cfg.betas))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_steps))
        self.bad = False  # a non-finite loss was seen since the last step
        if keep_grads:  # the kept .grad is the accumulator and no hook watches it: the speed plan's `grad_in_place`
            allocate_training_state(self.optimizer)

    def backward(self, loss_sum: torch.Tensor, total: float) -> None:
        """Accumulate the gradient of `loss_sum / total`: `loss_sum` summed over this micro-batch, `total` the
        count of the whole step (`engine.total`). A non-finite loss is not back-propagated; the whole step is
        then skipped (see `step`)."""
        if not torch.isfinite(loss_sum.detach()).all():
            self.bad = True
            return
        (loss_sum * 1 / total).backward()  # one rank: the world size is 1 (the DeepSpeed engine's form)

    def step(self) -> dict:
        """Clip, update, advance the schedule. A step with a non-finite loss or gradient changes nothing
        (no update, no schedule step, gradients dropped) and reports `skipped`."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm if self.max_grad_norm > 0 else float("inf"))
        if self.bad or not torch.isfinite(norm):
            self.bad = False
            self.optimizer.zero_grad(set_to_none=not self.keep_grads)
            return {"grad_norm": float("nan"), "skipped": 1.0}
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        return {"grad_norm": float(norm)}

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    # checkpoint pieces
    def save(self, folder: Path, name: str) -> None:
        save_model(self.module, str(folder / f"{name}.safetensors"))
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   folder / f"{name}.optim.pt")

    def load(self, folder: Path, name: str) -> None:
        load_model(self.module, str(folder / f"{name}.safetensors"))
        state = torch.load(folder / f"{name}.optim.pt", weights_only=True, map_location="cpu")
        with configured_hyperparameters(self.scheduler):
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])


class AutocastHooks:
    """Runs a module's forward under `torch.autocast(device, dtype)`: a forward pre-hook enters it and a forward
    hook (called on errors too) leaves it. The parameters, their gradients and the optimizer stay float32;
    matmuls run in `dtype`. Hooks rather than a wrapped `forward`, so a copy of the module (an export twin,
    a deep copy) holds no reference back to the original."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type, self.dtype = device_type, dtype
        self.open = []  # the contexts entered by calls still running (a model may call another inside)

    def enter(self, _module, _args):
        context = torch.autocast(self.device_type, dtype=self.dtype)
        context.__enter__()
        self.open.append(context)

    def leave(self, _module, _args, _output):
        if self.open:
            self.open.pop().__exit__(None, None, None)

    def attach(self, module: torch.nn.Module) -> torch.nn.Module:
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.leave, always_call=True)
        return module

    def spec(self) -> tuple[str, torch.dtype]:
        """(device type, dtype): what a speed plan records (`plan.autocast`), so that code standing in for part of
        the forward outside it (the LM head in chunks, `models.forward.mixed_precision`) runs under the same."""
        return self.device_type, self.dtype


@contextlib.contextmanager
def _inside(context, value):
    with context:
        yield value


class LocalEngine:
    """One process, one device (a GPU when there is one, else the CPU). `engine.precision=bf16` runs every
    prepared model's forward under bfloat16 autocast (float32 weights and optimizer): on a GPU the usual mixed
    precision, on a CPU with AVX-512 bf16 (or AMX) oneDNN's bf16 matmuls."""

    name = "local"
    in_process_group = False

    def __init__(self, cfg=None, train: TrainConfig | None = None):
        self.cfg = cfg
        self.rank, self.world_size = 0, 1
        self.is_main = True
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.autocast = None
        if cfg is not None and cfg.precision == "bf16":
            self.autocast = AutocastHooks(self.device.type, torch.bfloat16)

    # -- ranks: one ---------------------------------------------------------------------------------------
    def shard(self, items: Sequence) -> list:
        return list(items)

    def total(self, local: float) -> float:
        return max(1, local)

    def reduce_mean(self, metrics: dict) -> dict:
        return metrics

    def reduce_sum(self, value: float) -> float:
        return value

    def reduce_max(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        pass

    def say(self, text: str) -> None:
        print(text, file=sys.stderr)

    # -- models --------------------------------------------------------------------------------------------
    def _mixed(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.autocast.attach(model) if self.autocast is not None else model

    def prepare(self, model: torch.nn.Module, train: TrainConfig, total_steps: int, role: str = "policy",
                lr: float | None = None, keep_grads: bool = False) -> Trainable:
        """A trainable model: AdamW + warmup/decay schedule (every role alike on one device). `keep_grads`:
        the gradient tensors stay allocated between steps (zeroed, not freed; see the protocol)."""
        float32_weights(model, self.say)
        model.to(self.device)
        model.train()
        return Trainable(self._mixed(model), train, total_steps, lr, keep_grads=keep_grads)

    def prepare_frozen(self, model: torch.nn.Module, role: str = "reference") -> torch.nn.Module:
        model.to("cpu" if self._offload() else self.device)
        model.eval()
        model.requires_grad_(False)
        return self._mixed(model)

    def _offload(self) -> bool:
        return self.cfg is not None and self.cfg.offload_reference_model

    def held_parameters(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """{name: parameter} of the trainable parameters: one process holds them whole."""
        return {name: p for name, p in module.named_parameters() if p.requires_grad}

    def holds_whole(self, module: torch.nn.Module) -> bool:
        """Always: one process holds every parameter."""
        return True

    def parameters_written(self, module: torch.nn.Module) -> None:
        """Nothing to do: the module computes with the parameters written."""

    def gathered(self, module: torch.nn.Module):
        """A context giving the module to generate with: the module itself. Under bf16 autocast the whole
        rollout runs inside one autocast context, so the trained weights are cast once per rollout instead of at
        every token step (autocast keeps its casts of trainable weights until its outermost context ends)."""
        if self.autocast is None:
            return contextlib.nullcontext(module)
        return _inside(torch.autocast(self.autocast.device_type, dtype=self.autocast.dtype), module)

    def parameters_whole(self, params: list):
        """Every parameter is held whole here: nothing to gather."""
        return contextlib.nullcontext()

    def generation_kwargs(self, module: torch.nn.Module) -> dict:
        return {}

    def on_device(self, module):
        """Context holding a frozen model on the compute device; with `offload_reference_model` it goes back
        to CPU afterwards, so four models need not share accelerator memory at once."""
        if module is None or not self._offload() or self.device.type == "cpu":
            return contextlib.nullcontext()
        return moved_to(module, self.device)

    # -- checkpoints: folder/step-N/{name}.safetensors, {name}.optim.pt, state.pt, manifest.json (written last);
    # folder/latest names the newest
    def checkpoint_info(self, step: int, trainables: dict) -> dict:
        """What a checkpoint's manifest records besides its files (and what `--resume` must match)."""
        return {"step": step, "engine": self.name, "world_size": 1, "zero_stage": None,
                "trainables": sorted(trainables)}

    def save_checkpoint(self, folder: Path, step: int, trainables: dict, state: dict, keep: int = 2) -> Path:
        target = folder / f"step-{step:08d}"
        with atomic_folder(target) as tmp:
            for name, trainable in trainables.items():
                trainable.save(tmp, name)
            torch.save({"step": step, "rng": rng_state(), **state}, tmp / "state.pt")
            seal(tmp, self.checkpoint_info(step, trainables))
        publish_checkpoint(folder, target, keep)
        return target

    def load_checkpoint(self, folder: Path, trainables: dict) -> dict:
        """folder/latest, verified against its manifest (a damaged one is refused, naming the previous good one)."""
        target = verified_latest(folder, self.checkpoint_info(0, trainables), self.say)
        for name, trainable in trainables.items():
            trainable.load(target, name)
        state = torch.load(target / "state.pt", weights_only=True, map_location="cpu")
        set_rng_state(state.pop("rng"))
        return state

    def export_hf(self, model: torch.nn.Module, tokenizer, target: Path, in_place: bool = True) -> Path:
        """A plain transformers folder (safetensors, tokenizer, LoRA merged) that from_pretrained loads."""
        return write_hf_folder(model, tokenizer, target, in_place)


def float32_weights(model: torch.nn.Module, say) -> None:
    """A model trained in full keeps float32 weights, whatever `load.dtype` loaded it in: a bfloat16 or float16
    weight loses every update below its precision (measured: 15% of a tiny model's weights never moved in 6
    steps). `engine.precision` sets the compute precision; frozen models and a LoRA base stay as loaded (LoRA's
    adapters are float32 already)."""
    from rlhfkit.lora import is_lora

    half = (torch.float16, torch.bfloat16)
    if not is_lora(model) and any(p.dtype in half for p in model.parameters() if p.requires_grad):
        model.float()
        say(f"load.dtype: the trained {type(model).__name__}'s weights are kept in float32 (engine.precision sets "
            f"the compute precision)")


@contextlib.contextmanager
def moved_to(module: torch.nn.Module, device: torch.device):
    """`module` on `device` for the block, back on the CPU after it."""
    module.to(device)
    try:
        yield
    finally:
        module.to("cpu")
