"""The Llama family's rotary embedding as one fused loop per tensor (`kernels.rotary`), forward and backward.

transformers' attention rotates queries and keys with `apply_rotary_pos_emb`: `x * cos + rotate_half(x) * sin`,
where `rotate_half` slices, negates and concatenates. Per tensor that is five element-wise kernels and three fresh
tensors forward, and in backward two products, a negation, two slice backwards (each a zero-filled tensor and a
copy) and a sum: a noticeable share of an SFT step of the benchmark's 20M model (docs/performance.md). With
x = [x1 | x2] split at half the head size,

    forward   y1 = x1 * cos1 - x2 * sin1,   y2 = x2 * cos2 + x1 * sin2
    backward  g1 = d1 * cos1 + d2 * sin2,   g2 = d2 * cos2 - d1 * sin1   (the rotation's transpose)

is one pass each way (`kernels.rotary`, in C); the forward rounds exactly as transformers' does (each product,
then the sum). Only where the fused kernels are on and take the tensors (`kernels.usable`: float32 on CPU, heads x
head size at least `kernels.MIN_WIDTH`); everywhere else transformers' own function runs.

How it is switched on without copying transformers' attention: `use_fused_rotary(model)` (through `accel.install`,
where the model's speed plan has `fused_kernels`) puts a forward pre-hook and a forward hook on `model` that swap the
modeling module's `apply_rotary_pos_emb` for a dispatching function while `model`'s forward runs, and put
transformers' own back when it returns (also when it raises). Outside those forwards, and for every other model,
transformers' function is the one there. Not under gradient checkpointing: its recomputation in backward runs after
the forward has returned, with transformers' function, and would save other tensors than the forward did.
"""

from __future__ import annotations

import inspect
import sys

import torch

from rlhfkit.accel import kernels

# attention classes whose modeling module rotates with apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
ATTENTION_CLASSES = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention", "SmolLM3Attention")


class _RotaryFunction(torch.autograd.Function):
    """The rotation of one tensor; keeps only cos and sin (shared by every layer) for backward."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return kernels.rotary(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return kernels.rotary(grad, cos, sin, transpose=True), None, None


def fused_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` for q, k (B, H, T, D), cos and sin (B or 1, T, D)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RotaryFunction.apply(q, cos, sin), _RotaryFunction.apply(k, cos, sin)
    return kernels.rotary(q, cos, sin), kernels.rotary(k, cos, sin)


def _takes(q, k, cos, sin, unsqueeze_dim) -> bool:
    return (unsqueeze_dim == 1 and not (cos.requires_grad or sin.requires_grad) and q.dim() == k.dim() == 4
            and cos.dim() == 3
            and cos.shape == sin.shape and q.shape[-1] == k.shape[-1] == cos.shape[-1]
            and q.shape[-1] % 2 == 0 and q.shape[2] == k.shape[2] == cos.shape[1]
            and cos.shape[0] in (1, q.shape[0]) and q.shape[0] == k.shape[0]
            and kernels.usable(q, k, cos, sin, width=q.shape[1] * q.shape[-1]))  # heads x head size


def _dispatching(original):
    """`original` (a modeling module's apply_rotary_pos_emb) taking the fused path for the tensors it takes."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _takes(q, k, cos, sin, unsqueeze_dim):
            return fused_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _standard(function) -> bool:
    """Whether `function` has the signature of the Llama family's apply_rotary_pos_emb. Where the `kernels` package
    is installed, transformers (5.25 on) wraps the function in a module (`use_kernel_forward_from_hub`) whose
    forward is the function: its forward's signature is the one read."""
    if isinstance(function, torch.nn.Module):
        function = function.forward
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False
    return names == ["q", "k", "cos", "sin", "unsqueeze_dim"]


def _same_values(original, head_dim: int) -> bool:
    """Whether the rotation of `kernels.rotary` gives `original`'s values and gradients on a random input, float
    rounding aside (a modeling module whose function is not the standard rotation keeps its own). True where the
    kernels are off or unavailable: then `original` runs anyway."""
    g = torch.Generator().manual_seed(0)
    heads, rows = -(-kernels.MIN_WIDTH // head_dim), 5
    q, k = (torch.randn(1, heads, rows, head_dim, generator=g).requires_grad_(True) for _ in range(2))
    angles = torch.rand(1, rows, head_dim, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    if not _takes(q, k, cos, sin, 1):
        return True
    probe = torch.randn(1, heads, rows, head_dim, generator=g)
    results = []
    with torch.enable_grad():
        for fn in (original, fused_rotary):
            out = fn(q, k, cos, sin)
            grads = torch.autograd.grad(sum((o * probe).sum() for o in out), (q, k))
            results.append([t.detach() for t in (*out, *grads)])
    return all(float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()) + 1e-12 for a, b in zip(*results))


def use_fused_rotary(model: torch.nn.Module) -> int:
    """Route `model`'s Llama-family attention layers' rotation to `fused_rotary` while its forward runs, where the
    kernels take it (see the module docstring). Returns how many attention layers may take it: 0 for unknown
    attention classes, another rotation function, or a model without exactly one rotary-embedding module."""
    attention = [m for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES]
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not attention or len(rotary) != 1:
        return 0
    modules = [sys.modules.get(name) for name in sorted({type(m).__module__ for m in attention})]
    head_dim = getattr(attention[0], "head_dim", 0)
    if not head_dim or head_dim % 2:
        return 0
    for module in modules:
        function = getattr(module, "apply_rotary_pos_emb", None)
        if function is None or not _standard(function) or not _same_values(function, head_dim):
            return 0
    swapped = []  # per forward running now (a model may be called inside its own forward): what to put back

    def enter(_module, _args):
        originals = [module.apply_rotary_pos_emb for module in modules]
        for module, original in zip(modules, originals):
            module.apply_rotary_pos_emb = _dispatching(original)
        swapped.append(originals)

    def leave(_module, _args, _output):
        if swapped:
            for module, original in zip(modules, swapped.pop()):
                module.apply_rotary_pos_emb = original

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return len(attention)
