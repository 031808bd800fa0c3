"""CPU engine details: glibc keeps freed memory (no page faults per step), the fused AdamW."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from rlhfkit.engine.cpu_memory import keep_freed_memory
from rlhfkit.engine.local import adamw


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_reused_without_page_faults():
    def faults_of_a_fresh_64_mib_tensor() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 * 2**20)  # 64 MiB, written once, freed at once
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults_of_a_fresh_64_mib_tensor()
    assert keep_freed_memory() is True
    faults_of_a_fresh_64_mib_tensor()  # the first one after the switch may still grow the heap
    # 64 MiB is 16,384 pages: handed back and mapped again each time without the switch, reused with it
    assert faults_of_a_fresh_64_mib_tensor() < 1000


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
