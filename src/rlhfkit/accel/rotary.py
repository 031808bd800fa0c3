"""The Llama family's rotary embedding as one fused loop per tensor (`kernels.rotary`), forward and backward.

transformers' attention rotates queries and keys with `apply_rotary_pos_emb`: `x * cos + rotate_half(x) * sin`,
where `rotate_half` slices, negates and concatenates. Per tensor that is five element-wise kernels and three fresh
tensors forward, and in backward two products, a negation, two slice backwards (each a zero-filled tensor and a
copy) and a sum: ~4% of an SFT step of the benchmark's 20M model. With x = [x1 | x2] split at half the head size,

    forward   y1 = x1 * cos1 - x2 * sin1,   y2 = x2 * cos2 + x1 * sin2
    backward  g1 = d1 * cos1 + d2 * sin2,   g2 = d2 * cos2 - d1 * sin1   (the rotation's transpose)

is one pass each way (`kernels.rotary`, in C); the forward rounds exactly as transformers' does (each product,
then the sum). Only where the fused kernels are on and take the tensors (`kernels.usable`: float32 on CPU, heads x
head size at least `kernels.MIN_WIDTH`); everywhere else transformers' own function runs.

How it is switched on without copying transformers' attention: `use_fused_rotary(model)` wraps the modeling
module's `apply_rotary_pos_emb` (once per module; the wrapper calls the original for every tensor it does not
know) and tags the cos and sin that `model`'s own rotary-embedding module returns, with a forward hook. So other
models in the process keep transformers' function, and a recomputation under gradient checkpointing passes the
same tagged tensors, taking the same path as the forward it repeats.
"""

from __future__ import annotations

import inspect
import sys

import torch

from rlhfkit.accel import kernels

TAG = "_rlhfkit_fused_rotary"
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
    return (unsqueeze_dim == 1 and getattr(cos, TAG, False) and getattr(sin, TAG, False)
            and not (cos.requires_grad or sin.requires_grad) and q.dim() == k.dim() == 4 and cos.dim() == 3
            and cos.shape == sin.shape and q.shape[-1] == k.shape[-1] == cos.shape[-1]
            and q.shape[-1] % 2 == 0 and q.shape[2] == k.shape[2] == cos.shape[1]
            and cos.shape[0] in (1, q.shape[0]) and q.shape[0] == k.shape[0]
            and kernels.usable(q, k, cos, sin, width=q.shape[1] * q.shape[-1]))  # heads x head size


def _dispatching(original):
    """`original` (a modeling module's apply_rotary_pos_emb) taking the fused path for tagged cos/sin."""
    if getattr(original, "_rlhfkit_original", None) is not None:
        return original

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _takes(q, k, cos, sin, unsqueeze_dim):
            return fused_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._rlhfkit_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _standard(function) -> bool:
    """Whether `function` has the signature of the Llama family's apply_rotary_pos_emb."""
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
    setattr(cos, TAG, True)
    setattr(sin, TAG, True)
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


def _tag(_module, _args, output):
    if isinstance(output, tuple) and len(output) == 2 and all(isinstance(t, torch.Tensor) for t in output):
        for t in output:
            setattr(t, TAG, True)
    return output


def use_fused_rotary(model: torch.nn.Module) -> int:
    """Route `model`'s Llama-family attention layers' rotation to `fused_rotary` where the kernels take it (see
    the module docstring). Returns how many attention layers may take it: 0 for unknown attention classes,
    another rotation function, or a model without exactly one rotary-embedding module."""
    attention = [m for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES]
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not attention or len(rotary) != 1:
        return 0
    modules = {type(m).__module__ for m in attention}
    head_dim = getattr(attention[0], "head_dim", 0)
    if not head_dim or head_dim % 2:
        return 0
    for name in modules:
        function = getattr(sys.modules.get(name), "apply_rotary_pos_emb", None)
        original = getattr(function, "_rlhfkit_original", function)
        if original is None or not _standard(original) or not _same_values(original, head_dim):
            return 0
    for name in modules:
        module = sys.modules[name]
        module.apply_rotary_pos_emb = _dispatching(module.apply_rotary_pos_emb)
    if not getattr(rotary[0], "_rlhfkit_tagging", False):
        rotary[0].register_forward_hook(_tag)
        rotary[0]._rlhfkit_tagging = True
    return len(attention)
