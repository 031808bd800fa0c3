"""The engine protocol: the one owner of devices, ranks, sharding, loss normalisation, ZeRO and checkpoints.

Loops, data and models talk to an `Engine` and the `Trainable`s it prepares, and to nothing else that knows
about processes or backends: no loop reads `RANK`, checks a ZeRO-3 parameter or names a DeepSpeed class. Two
engines implement it side by side (`LocalEngine`: one process, one device; `DeepSpeedEngine`: ZeRO 0-3,
offload, many ranks and nodes); `make_engine(cfg.engine)` picks one.

The contract a loop relies on:
- **Sharding.** A step's global batch is the same list on every rank; `engine.shard(rows)` is this rank's
  contiguous share (the local engine: all of it).
- **Loss normalisation.** `trainable.backward(loss_sum, total)` back-propagates `loss_sum / total`, where
  `loss_sum` is this rank's summed loss over a micro-batch and `total` the count it is averaged over across
  all ranks and micro-batches (`engine.total(local_count)`): the gradient of one optimizer step is the global
  mean, whatever the micro-batch size, accumulation and number of ranks.
- **Reductions.** `reduce_sum` (a number over ranks), `reduce_mean` (a metrics dict averaged over ranks).
- **Main-rank output.** `is_main` says whether this process writes files and logs; `say(text)` prints a line
  on the main rank only.
- **Models per role.** `prepare(model, train, total_steps, role)` returns a `Trainable` (optimizer, schedule,
  the role's ZeRO stage); `prepare_frozen(model, role)` an inference model (partitioned like the trained ones
  under ZeRO-3). `gathered(module)` gives a module to generate with (ZeRO-3: parameters gathered once per
  rollout) and `generation_kwargs(module)` what generate() needs on this backend; `on_device(module)` holds an
  offloaded frozen model on the compute device for a block. `held_parameters(module)` are this rank's values
  of the trainable parameters (a per-rank EMA averages them), `parameters_written(module)` follows a write.
- **Checkpoints and export.** `save_checkpoint` / `load_checkpoint` (atomic, `latest` pointer, a manifest of
  every file's size and sha256 written last and verified on load: `manifest.py`) and `export_hf` (a plain
  transformers folder, LoRA merged, ZeRO-3 gathered, written by the main rank).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol, Sequence, TypeVar, runtime_checkable

import torch

from rlhfkit.config.schema import TrainConfig

T = TypeVar("T")

ROLES = ("policy", "critic", "reward_model")  # trained roles; frozen ones: "reference", "reward"


@runtime_checkable
class Trainable(Protocol):
    """A model with its optimizer and schedule, prepared by an engine. Call `.module` for forward passes."""

    module: torch.nn.Module

    @property
    def lr(self) -> float:
        """The learning rate the next step uses."""

    def backward(self, loss_sum: torch.Tensor, total: float) -> None:
        """Accumulate the gradient of `loss_sum / total` (`total`: the global count, see the module doc).
        A non-finite loss is not back-propagated and its step is skipped."""

    def step(self) -> dict:
        """Clip, update, advance the schedule, zero the gradients; returns {"grad_norm"} (+ "skipped": 1.0
        when the step changed nothing because a loss or gradient was not finite)."""

    def train(self, mode: bool = True) -> "Trainable":
        """Train / eval mode of the module."""

    def save(self, folder: Path, name: str) -> None:
        """Weights, optimizer and schedule into `folder` under `name` (part of a checkpoint)."""

    def load(self, folder: Path, name: str) -> None:
        """The inverse of `save`."""


@runtime_checkable
class Engine(Protocol):
    name: str
    rank: int
    world_size: int
    is_main: bool
    device: torch.device
    # this process is in a launcher's torch.distributed process group (also a group of one): what a library that
    # would start its own (vLLM's colocated engine) joins instead
    in_process_group: bool

    # -- ranks -----------------------------------------------------------------------------------------
    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of a global batch (its length divides evenly over the ranks)."""

    def total(self, local: float) -> float:
        """A count summed over ranks, at least 1: what a summed loss is divided by in `Trainable.backward`."""

    def reduce_sum(self, value: float) -> float:
        """`value` summed over ranks."""

    def reduce_mean(self, metrics: dict) -> dict:
        """The numeric entries of `metrics` averaged over ranks (others unchanged)."""

    def reduce_max(self, value: float) -> float:
        """The largest of every rank's `value` (a collective)."""

    def barrier(self) -> None:
        """Wait for every rank."""

    def say(self, text: str) -> None:
        """Print a line to stderr on the main rank."""

    # -- models ----------------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, train: TrainConfig, total_steps: int, role: str = "policy",
                lr: float | None = None, keep_grads: bool = False) -> Trainable:
        """A trainable model for `role` (its ZeRO stage), AdamW and the warmup/decay schedule of `train`.

        `keep_grads`: the gradients and the optimizer's moments are allocated here, before any forward, and
        the gradients stay between steps, zeroed instead of freed, for a stage whose peak memory is its update
        (SFT, RM): made once and first, they do not fragment the heap around the steps' activations, which lowers
        the peak. RL stages ask for it on CPUs only: there the gradients sit through generation, but the
        iteration's peak is in the update, which holds them anyway, and the update saves the page faults of
        getting them afresh; on a GPU that memory would be taken from generation. Not DPO (its reference forward
        comes between steps; measured no better). The measurements: docs/performance.md (Memory). A backend
        that owns the accumulation into the kept gradients (the local one) may let the vocabulary matrices'
        backwards add into them directly (`accel/grad_in_place.py`). Backends that own their gradient buffers
        (DeepSpeed) ignore it."""

    def prepare_frozen(self, model: torch.nn.Module, role: str = "reference") -> torch.nn.Module:
        """An inference model (no gradients, eval mode) placed and partitioned for this backend."""

    def held_parameters(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """{name: this rank's values of each trainable parameter}, tensors an optimizer step updates in place
        (ZeRO-3: the rank's partition, flat): what a per-rank average such as the EMA keeps."""
        ...

    def holds_whole(self, module: torch.nn.Module) -> bool:
        """Whether every parameter of `module` is held whole on this rank outside its forward (ZeRO-3: no, each
        rank keeps a partition), so that a loss may use a weight directly, as the chunked LM-head loss does."""
        ...

    def parameters_written(self, module: torch.nn.Module) -> None:
        """After writing into `held_parameters(module)`: make the module compute with the new values (ZeRO-3:
        gathers again the parameters it keeps whole). Every rank calls it at the same point."""
        ...

    def gathered(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A context giving the module to generate with, its full parameters at hand."""

    def parameters_whole(self, params: list) -> contextlib.AbstractContextManager:
        """A context in which each of `params` holds its full value on this rank (ZeRO-3: gathered for the block,
        a collective that every rank enters with the same parameters in the same order; else nothing to do).
        For handing weights to a rollout engine one module at a time, never the whole model at once."""

    def generation_kwargs(self, module: torch.nn.Module) -> dict:
        """Extra generate() arguments this backend needs (ZeRO-3 ranks must keep stepping together)."""

    def on_device(self, module: torch.nn.Module | None) -> contextlib.AbstractContextManager:
        """A context holding an offloaded frozen model on the compute device."""

    # -- checkpoints and export --------------------------------------------------------------------------
    def save_checkpoint(self, folder: Path, step: int, trainables: dict, state: dict, keep: int = 2) -> Path:
        """folder/step-N with every trainable, `state`, the RNG states and manifest.json (last); `latest` names it
        once complete."""

    def load_checkpoint(self, folder: Path, trainables: dict) -> dict:
        """Load folder/latest into `trainables` and the RNG states, after checking it against its manifest (a
        RunError naming the damage and the previous good checkpoint); returns `state` (with "step")."""

    def export_hf(self, model: torch.nn.Module, tokenizer, target: Path, in_place: bool = True) -> Path:
        """A plain transformers folder that `from_pretrained` loads (LoRA merged, ZeRO-3 gathered)."""
