"""CPU engine details: glibc keeps freed memory (no page faults per step), the fused AdamW."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch

from rlhfkit.engine.local import adamw


# Run in a fresh interpreter: what earlier tests left on the heap must not decide the count. transformers is
# imported as in a real run (its import, through ssl, leaves blocks on the heap that split the first freed ones).
FAULTS_OF_FRESH_TENSORS = """
import resource, sys
import torch, transformers
from rlhfkit.engine.cpu_memory import keep_freed_memory

def faults_of_a_fresh_64_mib_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2**20)  # 64 MiB, written once, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "keep":
    assert keep_freed_memory() is True
print([faults_of_a_fresh_64_mib_tensor() for _ in range(8)])
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_reused_without_page_faults():
    def faults(mode: str) -> list[int]:
        done = subprocess.run([sys.executable, "-c", FAULTS_OF_FRESH_TENSORS, mode], capture_output=True, text=True,
                              check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    # 64 MiB is 16,384 pages: above glibc's mmap threshold, so without the switch every tensor is mapped afresh
    # and faulted in page by page
    assert min(faults("default")) > 16000
    # with it, the heap grows for the first few tensors (freed blocks split by small allocations made beside
    # them), then the freed blocks are reused and no page is faulted in again
    assert max(faults("keep")[-3:]) < 1000


def test_fused_adamw_gives_the_foreach_update():
    torch.manual_seed(0)
    weights = [torch.randn(64, 32), torch.randn(32)]
    grads = [torch.randn_like(w) for w in weights]
    results = []
    for make in (lambda groups: adamw(groups, lr=1e-2, betas=(0.9, 0.95)),
                 lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), foreach=True)):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = make([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}])
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        results.append((opt, params))
    (fused_opt, fused), (_, reference) = results
    assert fused_opt.defaults.get("fused") is True
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _trained(cfg, steps: int, folder=None, load=False):
    from rlhfkit.engine.local import Trainable

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    trainable = Trainable(model, cfg, total_steps=10)
    if load:
        trainable.load(folder, "m")
    for _ in range(steps):
        trainable.module(torch.randn(3, 4)).square().sum().backward()
        trainable.step()
    if folder is not None and not load:
        trainable.save(folder, "m")
    return trainable


def test_resume_takes_the_configured_rate_decay_and_betas_and_the_checkpoints_moments(tmp_path):
    """torch's load_state_dict brings back the checkpointed run's lr, weight decay and betas; a resumed run with
    other values in its config (`--resume train.lr=...`) uses its own, from the schedule's saved position."""
    from rlhfkit.config.schema import TrainConfig
    from rlhfkit.engine.local import lr_lambda

    old = TrainConfig(lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], warmup_steps=2, scheduler="cosine")
    saved = _trained(old, 3, tmp_path)
    new = TrainConfig(lr=1e-3, weight_decay=0.0, betas=[0.8, 0.9], warmup_steps=2, scheduler="cosine")
    resumed = _trained(new, 0, tmp_path, load=True)
    factor = lr_lambda(new, 10)
    groups = resumed.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0]
    assert all(tuple(g["betas"]) == (0.8, 0.9) for g in groups)
    assert [g["lr"] for g in groups] == pytest.approx([1e-3 * factor(3)] * 2)
    assert resumed.scheduler.get_last_lr() == pytest.approx([1e-3 * factor(3)] * 2)
    for p, q in zip(saved.module.parameters(), resumed.module.parameters()):  # the moments are the checkpoint's
        assert torch.equal(saved.optimizer.state[p]["exp_avg"], resumed.optimizer.state[q]["exp_avg"])
        assert int(resumed.optimizer.state[q]["step"]) == 3
    resumed.module(torch.randn(3, 4)).square().sum().backward()
    resumed.step()
    assert resumed.lr == pytest.approx(1e-3 * factor(4))
    # the same config again: exactly the checkpoint's values
    again = _trained(old, 0, tmp_path, load=True)
    rates = [g["lr"] for g in saved.optimizer.param_groups]
    assert [g["lr"] for g in again.optimizer.param_groups] == pytest.approx(rates)
    assert [g["weight_decay"] for g in again.optimizer.param_groups] == [0.1, 0.0]
