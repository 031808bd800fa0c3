"""The DeepSpeed engine's process group: joining the launcher's ranks, the gloo side group for waits on rank 0's file
work, the collectives the checkpoint code needs, teardown at exit, and the one line a lost rank becomes.

Faults: the process group is created with `engine.collective_timeout_s`, so a rank waiting in a collective for a
dead or hung one fails after that long (a killed peer over gloo/TCP is noticed at once), and `lost_rank_message`
turns that failure into one line. Waits for rank 0's file work alone (export, checkpoint conversion) run over a
gloo group of their own with a longer bound (`RANK0_WORK_TIMEOUT_S`).

The group is joined through DeepSpeed's own init, which `engine/deepspeed_engine.py` (the module that imports
deepspeed) passes in as `join`; only DeepSpeed's group handles are touched here.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import socket
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from rlhfkit.errors import ConfigError
from rlhfkit.run_files import latest_pointer

_timeout_s = None  # the process group's collective timeout, for the lost-rank message
# The ranks' waits for rank 0's file work alone (the HF export, converting a checkpoint to reshard it, clearing an
# old unfinished one): over a gloo group of their own with this bound (or collective_timeout_s, if longer), not the
# world group, whose collective_timeout_s is sized for training steps, and whose NCCL watchdog aborts a waiting
# process outright. A rank 0 that dies is noticed at once (gloo sees the connection drop); only one that hangs
# is waited for this long.
RANK0_WORK_TIMEOUT_S = 2 * 3600.0
_rank0_group = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def init_process_group(join: Callable[[timedelta], None], timeout_s: float = 300.0) -> None:
    """Join the launcher's process group (deepspeed / torchrun set RANK, WORLD_SIZE, MASTER_ADDR...) by calling
    `join(timeout)`, with `timeout_s` as the time a collective waits for the other ranks before it fails (gloo
    raises; NCCL's watchdog aborts the process), instead of DeepSpeed's 10 minutes or torch's 30.

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
    timeout = timedelta(seconds=timeout_s)
    join(timeout)
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


# -- collectives of the checkpoint and export code ----------------------------------------------------------
def gather_objects(items: list) -> list:
    """Every rank's `items`, concatenated in rank order (a collective)."""
    world_size = dist.get_world_size()
    if world_size == 1:
        return list(items)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, list(items))
    return [item for part in everyone for item in part]


def broadcast_from_rank0(value, after_rank0_work: bool = False):
    """Rank 0's `value` on every rank (a collective; `after_rank0_work`: rank 0 may come to it long after the
    others, see `RANK0_WORK_TIMEOUT_S`)."""
    if dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_rank0_group if after_rank0_work else None)
    return box[0]


def await_rank0() -> None:
    """The barrier after work rank 0 does alone, which may take longer than a training collective may wait
    (`RANK0_WORK_TIMEOUT_S`)."""
    if dist.get_world_size() > 1:
        dist.barrier(group=_rank0_group)


# -- lost ranks ------------------------------------------------------------------------------------------------
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
    latest = latest_pointer(output_dir) if output_dir else None
    saved = f"; the last checkpoint is {latest.read_text().strip()} in '{latest.parent}'" \
        if latest is not None and latest.is_file() else ""
    bound = f" (engine.collective_timeout_s={_timeout_s:g})" if _timeout_s else ""
    return (f"rank {dist.get_rank()} of {dist.get_world_size()} ({socket.gethostname()}): a collective with the "
            f"other ranks failed, so another rank died or stopped responding{bound}: {detail}{saved}. See the "
            f"other ranks' logs for the cause, then run the same command with --resume (on every node)")
