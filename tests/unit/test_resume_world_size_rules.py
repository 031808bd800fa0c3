"""The world-size rules of a resume, without DeepSpeed: which manifests a resharding engine accepts, and which
loop state and RNG each rank gets from a checkpoint saved at another number of ranks."""

import json
import random

import pytest
import torch

from rlhfkit.engine.manifest import MANIFEST, seal, verified_latest
from rlhfkit.engine.storage import rank_state, rng_state, saved_world_size
from rlhfkit.errors import RunError

THIS_RUN = {"engine": "deepspeed", "world_size": 1, "zero_stage": 2}


def checkpoint(tmp_path, ranks: int, zero_stage: int = 2):
    """checkpoints/step-00000004 saved by `ranks` ranks: each one's state file with its own RNG draws."""
    folder = tmp_path / "checkpoints"
    target = folder / "step-00000004"
    target.mkdir(parents=True)
    for rank in range(ranks):
        torch.manual_seed(7 + rank)  # every rank seeded apart, as sampling ranks are
        random.seed(7 + rank)
        torch.save({"step": 4, "rng": rng_state(), "kl_coef": 0.1}, target / f"state-rank{rank}.pt")
    seal(target, {"step": 4, "engine": "deepspeed", "world_size": ranks, "zero_stage": zero_stage})
    (folder / "latest").write_text(target.name)
    return folder, target


def test_a_resharding_engine_accepts_another_world_size_but_not_another_zero_stage(tmp_path):
    folder, target = checkpoint(tmp_path, ranks=2)
    with pytest.raises(RunError, match="on 2 rank"):
        verified_latest(folder, THIS_RUN, print)
    assert verified_latest(folder, THIS_RUN, print, any_world_size=True) == target
    with pytest.raises(RunError, match=r"deepspeed engine on 2 rank\(s\), ZeRO stage 2 and this run is the "
                                       r"deepspeed engine on 1 rank\(s\), ZeRO stage 3: resume with the same "
                                       r"engine.backend and engine.zero_stage$"):
        verified_latest(folder, {**THIS_RUN, "zero_stage": 3}, print, any_world_size=True)
    assert json.loads((target / MANIFEST).read_text())["world_size"] == saved_world_size(target) == 2


def test_saved_ranks_get_their_own_state_and_new_ranks_a_reproducible_seed(tmp_path):
    _, target = checkpoint(tmp_path, ranks=1)
    draws = {}
    for rank in (0, 1, 2):
        state = rank_state(target, rank, saved=1)
        assert state == {"step": 4, "kl_coef": 0.1}  # the loop state is global: rank 0's on every rank
        draws[rank] = (torch.rand(3), random.random())
    torch.manual_seed(7)
    assert torch.equal(draws[0][0], torch.rand(3))  # rank 0 continues its own stream
    assert not torch.equal(draws[1][0], draws[2][0]) and not torch.equal(draws[0][0], draws[1][0])
    rank_state(target, 1, saved=1)
    assert torch.equal(torch.rand(3), draws[1][0])  # a new rank's seed is the same at every resume


def test_ranks_beyond_this_run_are_dropped(tmp_path):
    _, target = checkpoint(tmp_path, ranks=2)
    rank_state(target, 0, saved=2)
    torch.manual_seed(7)
    expected = torch.rand(3)
    rank_state(target, 0, saved=2)
    assert torch.equal(torch.rand(3), expected)  # rank 0 of a 1-rank run gets rank 0's, rank 1's goes unused
