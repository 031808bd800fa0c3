"""Faults of a DeepSpeed step: a gradient that is not finite on one rank only (its loss finite), on CPU ranks
over gloo, with the real CLI.

The local engine skips such a step (no update, no schedule step) and counts it; under DeepSpeed every rank must
skip it together, whatever the ZeRO stage (gradients partitioned or whole) and precision. The fault is injected
by `poisoned_rank.py`, which also records each rank's weights and optimizer state around every step.
"""

import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, read_metrics, sft_rows, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ranks")]  # one multi-rank launch at a time under xdist

ENTRY = ROOT / "tests" / "integration" / "poisoned_rank.py"
STEPS, BAD_STEP, LR, WARMUP = 5, 3, 1e-2, 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("nproc, stage, precision", [(2, 2, "fp32"), (2, 3, "fp32"), (2, 0, "fp32"),
                                                     (1, 1, "bf16")])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path, tiny_model_dir, nproc, stage,
                                                                         precision):
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    micro, batch = 2, 8
    accum = batch // nproc // micro
    bad_rank = nproc - 1  # rank 1 of 2: rank 0, which logs, sees only the other's fault
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "POISON_RANK": str(bad_rank),
           # the last micro-batch of step BAD_STEP: the step's other micro-batches were finite
           "POISON_FORWARD": str(BAD_STEP * accum), "SNAPSHOT_DIR": str(tmp_path)}
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(ENTRY), "sft", f"model={tiny_model_dir}", f"data.train={data}",
           f"output_dir={out}", "engine.backend=deepspeed", f"engine.zero_stage={stage}",
           f"engine.precision={precision}", f"train.max_steps={STEPS}", f"train.batch_size={batch}",
           f"train.micro_batch_size={micro}", f"train.lr={LR}", f"train.warmup_steps={WARMUP}",
           "train.eval_every=0", "train.save_every=0", "data.eval_fraction=0", "log.tensorboard=false"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]

    # metrics.jsonl: that step alone is skipped and counted, its loss finite; the run goes on to the end
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if r.get("skipped")] == [BAD_STEP]
    assert sum(r.get("skipped", 0) for r in rows) == 1
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert f"sft: step {BAD_STEP}: non-finite loss or gradient, update skipped (1 in a row, 1 in all)" in res.stderr
    assert (out / "final" / "model.safetensors").is_file()
    # the schedule did not advance on the skipped step: the step after it uses the same learning rate (warmup)
    updates_before = [step - 1 - (step > BAD_STEP) for step in range(1, STEPS + 1)]
    assert [r["lr"] for r in rows] == pytest.approx([LR * (k + 1) / WARMUP for k in updates_before])

    for rank in range(nproc):
        steps = {n: torch.load(tmp_path / f"rank{rank}-step{n}.pt") for n in range(1, STEPS + 1)}
        for n, record in steps.items():
            skipped = n == BAD_STEP
            assert bool(record["stats"].get("skipped")) == skipped, (rank, n, record["stats"])
            for part in ("weights", "optimizer"):
                # the skipped step leaves this rank's weights, master weights, moments and step count as they were
                assert torch.equal(record["before"][part], record["after"][part]) == skipped, (rank, n, part)
                assert torch.isfinite(record["after"][part]).all(), (rank, n, part)
        assert steps[STEPS]["deepspeed_skipped_steps"] == 1  # DeepSpeed's own count agrees
