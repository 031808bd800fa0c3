"""DeepSpeed checkpoints across ranks: one folder holding every rank's shards, sealed with a manifest, and loaded
at any number of ranks.

Checkpoints carry a manifest (`manifest.py`), written by rank 0 from every rank's hashes, in a folder all ranks
must share (`_check_shared`). A checkpoint saved at another number of ranks is resharded through DeepSpeed's
universal checkpoint (`to_universal`, `_load_resharded`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import socket
import time
import uuid
from pathlib import Path

import torch

from rlhfkit.engine.manifest import seal, verified_latest
from rlhfkit.engine.process_group import await_rank0, broadcast_from_rank0, gather_objects
from rlhfkit.engine.protocol import Engine
from rlhfkit.engine.storage import publish_checkpoint, rank_state, replace_folder, rng_state, saved_world_size
from rlhfkit.errors import RunError


def save_sharded(engine: Engine, folder: Path, step: int, trainables: dict, state: dict, info: dict,
                 keep: int) -> Path:
    """Every rank writes its shards into step-N.tmp (a folder all ranks share); the ranks hash its files between
    them and rank 0 writes manifest.json (with `info`), renames the folder into place and points `latest` at it."""
    target = folder / f"step-{step:08d}"
    tmp = target.with_name(target.name + ".tmp")
    if engine.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _check_shared(engine, tmp)  # a collective: also the barrier before the shards are written
    for name, trainable in trainables.items():
        trainable.save(tmp, name)
    torch.save({"step": step, "rng": rng_state(), **state}, tmp / f"state-rank{engine.rank}.pt")
    engine.barrier()
    seal(tmp, info, (engine.rank, engine.world_size), gather_objects, write=engine.is_main)
    if engine.is_main:  # may delete older checkpoints (large folders) as well
        replace_folder(tmp, target)
        publish_checkpoint(folder, target, keep)
    await_rank0()
    return target


def _check_shared(engine: Engine, tmp: Path) -> None:
    """Every rank must see the folder rank 0 just created: a checkpoint is one folder holding every rank's
    shards, on a filesystem all nodes share (else no node could resume). A RunError on all ranks if not."""
    marker = tmp / ".shared-by-all-ranks"
    token = uuid.uuid4().hex if engine.is_main else None
    if engine.is_main:
        marker.write_text(token)
    token = broadcast_from_rank0(token, after_rank0_work=True)  # rank 0 may have cleared a large unfinished save
    sees = False
    for _ in range(10):  # a network filesystem may show a new file a moment late
        with contextlib.suppress(OSError):
            sees = marker.read_text() == token
        if sees:
            break
        time.sleep(0.5)
    everyone = gather_objects([(engine.rank, socket.gethostname(), sees)])
    blind = [f"rank {rank} ({host})" for rank, host, saw in everyone if not saw]
    if engine.is_main:
        marker.unlink()
    if blind:
        if engine.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunError(f"checkpoints need output_dir on a filesystem every node shares: {', '.join(blind)} "
                       f"cannot see '{tmp}', which rank 0 created. Put output_dir on a shared filesystem, or "
                       f"run without checkpoints (train.save_every=0; no --resume then)")


def load_sharded(engine: Engine, folder: Path, trainables: dict, info: dict) -> dict:
    """folder/latest, verified against its manifest and `info` (each rank hashes its share of the files); a
    damaged one is refused on every rank, naming the previous good one. A checkpoint saved at another number of
    ranks is resharded (`_load_resharded`). Returns this rank's loop state."""
    target = verified_latest(folder, info, engine.say, (engine.rank, engine.world_size), gather_objects,
                             any_world_size=True)
    saved = saved_world_size(target)
    if saved == engine.world_size:
        for name, trainable in trainables.items():
            trainable.load(target, name)
    else:
        _refuse_sharded_state(engine, target, saved, info["zero_stage"])
        _load_resharded(engine, folder, target, trainables, saved)
    return rank_state(target, engine.rank, saved)


def _refuse_sharded_state(engine: Engine, target: Path, saved: int, zero_stage: int) -> None:
    """The loop state rlhfkit can carry to another number of ranks is global; PPO's EMA under ZeRO-3 is not
    (each rank averages its own parameter partition, `models/ema.py`), so that resume is refused."""
    state = torch.load(target / "state-rank0.pt", weights_only=True, map_location="cpu")
    if zero_stage == 3 and state.get("ema") is not None:
        raise RunError(f"--resume: checkpoint '{target}' was saved at {saved} rank(s) and this run has "
                       f"{engine.world_size}: its EMA weights (ema.enabled) are per-rank ZeRO-3 partitions, which "
                       f"cannot be resharded. Resume with {saved} rank(s)")


def _load_resharded(engine: Engine, folder: Path, target: Path, trainables: dict, saved: int) -> None:
    """Load a checkpoint saved at `saved` ranks on this run's number. Models whose optimizer states are ZeRO
    partitions are converted by rank 0 into a universal checkpoint (DeepSpeed's converter) beside the
    checkpoints, which every rank then loads and partitions its own way; the converted copy is removed after.
    Step, data position and schedule are global, so they carry over as they are; RNG: `rank_state`."""
    universal = folder / f"universal-{target.name}"
    convert = [name for name in trainables if has_zero_partitions(target / name)]
    if convert:
        engine.say(f"--resume: {target.name} was saved at {saved} rank(s) and this run has {engine.world_size}: "
                   f"converting its ZeRO states to a universal checkpoint ({universal}) to reshard them")
    failure = None
    if engine.is_main and convert:
        try:
            shutil.rmtree(universal, ignore_errors=True)
            for name in convert:
                to_universal(target / name, universal / name)
        except Exception as exc:  # every rank must hear of it, or the others wait at the barrier
            failure = f"{type(exc).__name__}: {exc}"
    failure = broadcast_from_rank0(failure, after_rank0_work=True)
    if failure:
        raise RunError(f"--resume: checkpoint '{target}' was saved at {saved} rank(s) and this run has "
                       f"{engine.world_size}; converting it to a universal checkpoint to reshard it failed "
                       f"({failure}). Resume with {saved} rank(s)")
    try:
        for name, trainable in trainables.items():
            if name in convert:
                trainable.load_universal(universal, name)
            else:
                trainable.load(target, name)
    finally:
        engine.barrier()
        if engine.is_main:
            shutil.rmtree(universal, ignore_errors=True)
        await_rank0()


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
