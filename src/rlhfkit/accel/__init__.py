"""CPU kernels: the speed paths that only pay on a CPU (oneDNN linear layers, C kernels for RMSNorm, SwiGLU and
the rotary embedding, a streaming decode GEMM, lean activations, gradients added in place).

`install(model, plan)` is the one way in: it puts into a model the kernels its speed plan has on (`models.plan`,
decided by `speed.registry`, which never turns them on for a CUDA device), by swapping the classes of its modules
(same parameters, same state dict) and hooking its forward. The streaming decode GEMM is opened per rollout by
`rollout.generate` where the plan has it. `models/` (loading, LoRA, forwards) and `algos/` (pure math) do not
depend on anything here being installed: with `models.plan.REFERENCE` nothing is.
"""

from __future__ import annotations

import torch

from rlhfkit.accel import cpu_linear, grad_in_place, lean, rotary


def install(model: torch.nn.Module, plan) -> dict[str, int]:
    """Install into `model` (a transformers model, not a wrapper) the CPU kernels `plan` has on:
    `onednn_linear` (linear layers on oneDNN), `lean_activations` (with their element-wise work in C under
    `fused_kernels`), `fused_kernels` (the rotary embedding in C while the model's forward runs; not under gradient
    checkpointing, whose recomputation would take the other path), `grad_in_place` (the embedding's gradient added
    into its kept `.grad`). Returns how many modules each switched."""
    done = {}
    if plan.onednn_linear:
        done["onednn_linear"] = cpu_linear.use_fast_cpu_linear(model)
    if plan.lean_activations:
        done["lean_activations"] = lean.use_lean_activations(model, fused=plan.fused_kernels)
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # transformers < 5.x's name
    if plan.fused_kernels and not getattr(model, name, False):
        done["fused_rotary"] = rotary.use_fused_rotary(model)
    if plan.grad_in_place:
        done["grad_in_place"] = grad_in_place.enable(model)
    return done
