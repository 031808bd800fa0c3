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
