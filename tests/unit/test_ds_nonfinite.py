"""The DeepSpeed engine's handling of a step whose gradient is not finite, without launching DeepSpeed: the
optimizer it gives DeepSpeed at ZeRO-0 fp32, and how a step DeepSpeed took is reported; and which failed
collectives it reports as a lost rank. The multi-rank runs are in tests/integration/test_ds_faults.py."""

from types import SimpleNamespace

import pytest
import torch

from rlhfkit.engine.deepspeed_trainable import DeepSpeedTrainable, FiniteAdamW
from rlhfkit.errors import RunError


def test_finite_adamw_skips_a_non_finite_step_flags_it_and_otherwise_is_adamw():
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    finite = FiniteAdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    plain = torch.optim.AdamW(twin.parameters(), lr=0.1, weight_decay=0.01)
    x = torch.randn(4, 3)
    for m in (model, twin):
        m(x).pow(2).sum().backward()
    good = model.weight.grad[0, 0].item()
    model.weight.grad[0, 0] = float("inf")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    finite.step()
    assert finite.overflow  # DeepSpeed reads it: no schedule step, the step counted as skipped
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not finite.state  # no moments, no step count: as if the step had not been taken

    model.weight.grad[0, 0] = good
    finite.step()
    plain.step()
    assert not finite.overflow
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in model.state_dict().items())


def after_step(applied: bool, norm, fp16: bool = False) -> DeepSpeedTrainable:
    """A trainable (one rank) whose DeepSpeed engine has just taken a step with this outcome."""
    engine = SimpleNamespace(step=lambda: None, was_step_applied=lambda: applied, get_global_grad_norm=lambda: norm,
                             fp16_enabled=lambda: fp16, zero_optimization_stage=lambda: 2, device=torch.device("cpu"))
    trainable = DeepSpeedTrainable(engine, max_grad_norm=1.0, world_size=1)
    trainable.good = 1
    return trainable


def test_a_step_deepspeed_skipped_is_reported_skipped_and_an_fp16_overflow_is_not():
    assert after_step(True, 0.5).step() == {"grad_norm": 0.5}
    skipped = after_step(False, float("inf")).step()
    assert skipped["skipped"] == 1.0 and skipped["grad_norm"] != skipped["grad_norm"]  # NaN, logged as null
    # fp16's loss scaler skips overflowing steps while it lowers its scale: not a non-finite step of the run's
    overflow = after_step(False, float("inf"), fp16=True).step()
    assert overflow["fp16_overflow"] == 1.0 and "skipped" not in overflow


def test_an_update_with_a_non_finite_gradient_stops_the_run():
    for norm in (float("nan"), float("inf"), -1.0):  # -1: DeepSpeed's mark of a non-finite norm
        with pytest.raises(RunError, match=r"updated the weights with a non-finite gradient \(ZeRO-2\), so the "
                                           r"weights can no longer be trusted. Resume from the last checkpoint"):
            after_step(True, norm).step()


def test_a_local_nccl_fault_is_not_reported_as_a_dead_rank(monkeypatch):
    """On a multi-rank run, a collective error that names a peer's loss (gloo's transport, NCCL's remote error or
    watchdog timeout) becomes the one-line "another rank died ... --resume" message; NCCL errors of this rank's
    own making (a CUDA fault, two ranks on one GPU, a network set-up problem) do not: resuming would meet them
    again, and their traceback says more."""
    import torch.distributed as dist

    from rlhfkit.engine import process_group as D

    monkeypatch.setattr(D.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(D.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(D.dist, "get_rank", lambda group=None: 1)
    lost = [RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1234"),
            dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a "
                                  "network error, NCCL version 2.21.5 ncclRemoteError"),
            RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)")]
    for exc in lost:
        assert "another rank died or stopped responding" in D.lost_rank_message(exc), exc
    local = [dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                                   "NCCL_DEBUG=INFO for details), NCCL version 2.21.5"),
             dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN "
                                   "for details), NCCL version 2.21.5 ncclInvalidUsage: Duplicate GPU detected"),
             dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with "
                                   "NCCL_DEBUG=INFO for details)")]
    for exc in local:
        assert D.lost_rank_message(exc) is None, exc
    assert D.lost_rank_message(ValueError("a bug of ours")) is None
