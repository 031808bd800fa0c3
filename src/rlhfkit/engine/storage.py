"""What both engines write the same way: atomic folders, the `latest` checkpoint pointer, RNG states and the
plain transformers folder of an export."""

from __future__ import annotations

import contextlib
import copy
import os
import random
import shutil
from pathlib import Path

import torch

from rlhfkit.lora import base_model, is_lora, merged
from rlhfkit.run_files import LATEST_POINTER


def rng_state() -> dict:
    """The RNG states a checkpoint keeps: torch's CPU generator, Python's, and this rank's own GPU's (only the
    current device's: a rank resumed on a node with fewer GPUs has no generator for another's)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # saved by an older version: every visible GPU's state
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def saved_world_size(target: Path) -> int:
    """The number of ranks that saved a checkpoint: one `state-rankR.pt` each."""
    return max(1, len(list(target.glob("state-rank*.pt"))))


def rank_state(target: Path, rank: int, saved: int) -> dict:
    """This rank's loop state (step, data position, ...) from a checkpoint saved at `saved` ranks, with its RNG
    states set. At the same number of ranks each rank gets back its own. At another number, rank R < `saved`
    still gets rank R's; a rank beyond those saved takes rank 0's loop state (global: the same on every rank)
    and seeds its RNGs from rank 0's saved torch seed, the step and its rank, so a resume is reproducible; the
    states of saved ranks beyond this run's are dropped. (Rows move between ranks when their number changes, so
    sampling that draws per row, as PPO's rollouts do, takes other draws than the run that was not resized.)"""
    own = rank < saved
    state = torch.load(target / f"state-rank{rank if own else 0}.pt", weights_only=True, map_location="cpu")
    rng = state.pop("rng")
    set_rng_state(rng)
    if not own:
        base = torch.Generator().set_state(rng["torch"]).initial_seed()
        seed = (base * 1_000_003 + state.get("step", 0) * 1_009 + rank) % 2**63
        torch.manual_seed(seed)
        random.seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)
    return state


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_folder(tmp: Path, target: Path) -> None:
    """Rename the complete folder `tmp` to `target`. An existing `target` is renamed aside first and removed only
    after the new one is in place, so at no moment is there neither (deleting it first left a window, as long as
    the deletion, in which a kill lost the checkpoint `latest` named)."""
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def atomic_folder(target: Path):
    """Write a folder under a temporary name and rename it into place, so a crash never leaves it half-written."""

    @contextlib.contextmanager
    def writer():
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            yield tmp
            for f in tmp.iterdir():
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            replace_folder(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    return writer()


def publish_checkpoint(folder: Path, target: Path, keep: int) -> None:
    """Point `latest` at a complete checkpoint (atomically, after it was written), then drop all but the
    last `keep` ones: a crash at any moment leaves `latest` naming a loadable checkpoint. Checkpoints of later
    steps than `target` are dropped too: they belong to a run that was resumed from an earlier checkpoint
    (`rlhfkit checkpoints RUN_DIR --use step-N`) or started again, and `keep` counts back from `target`."""
    pointer = folder / f"{LATEST_POINTER}.tmp"
    pointer.write_text(target.name)
    os.replace(pointer, folder / LATEST_POINTER)
    done = sorted(p for p in folder.glob("step-*") if p.is_dir() and not p.name.endswith((".tmp", ".old")))
    older, newer = [p for p in done if p.name <= target.name], [p for p in done if p.name > target.name]
    for stale in newer + (older[:-keep] if keep > 0 else []):
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(folder: Path) -> Path:
    pointer = folder / LATEST_POINTER
    if not pointer.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from in '{folder}' (no 'latest' file)")
    target = folder / pointer.read_text().strip()
    if not target.is_dir():
        raise FileNotFoundError(f"checkpoint '{target}' named by '{pointer}' is missing")
    return target


# the config values a run changes for training only (dropout off, no KV cache under gradient checkpointing), with
# what the folder had: exported folders get the folder's values back (`as_loaded`)
LOADED_VALUES = "_rlhfkit_training_only"  # the attribute of a config that holds them while the run trains


def set_for_training(config, key: str, value) -> None:
    """`config.key = value` for this run, remembering the loaded value for the export."""
    originals = config.__dict__.setdefault(LOADED_VALUES, {})
    originals.setdefault(key, getattr(config, key, None))
    setattr(config, key, value)


@contextlib.contextmanager
def as_loaded(config):
    """Within the block `config` holds the values it was loaded with where the run changed them for training
    (`set_for_training`), and not their record: what `save_pretrained` writes to config.json. A fine-tuned folder
    keeps the dropout and cache settings it came with (a model trained on later keeps its dropout)."""
    originals = config.__dict__.pop(LOADED_VALUES, None) or {}
    current = {key: getattr(config, key, None) for key in originals}
    for key, value in originals.items():
        setattr(config, key, value)
    try:
        yield config
    finally:
        for key, value in current.items():
            setattr(config, key, value)
        if originals:
            config.__dict__[LOADED_VALUES] = originals


def write_hf_folder(model: torch.nn.Module, tokenizer, target: Path, in_place: bool = True) -> Path:
    """A plain transformers folder (safetensors, tokenizer, LoRA merged) that from_pretrained loads. LoRA is
    merged into `model` itself unless `in_place=False` (then into a copy)."""
    if is_lora(model) and not in_place:
        model = copy.deepcopy(model)
    plain = merged(model)
    with atomic_folder(target) as tmp:
        with as_loaded(base_model(plain).config):
            base_model(plain).save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return target
