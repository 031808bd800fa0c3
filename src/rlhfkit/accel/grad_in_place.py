"""Gradients of a model's vocabulary matrices added straight into the parameter's kept `.grad`.

The input embedding's backward and the chunked LM-head log-probs' backward (`algos.linear_token_logprobs`) each
build a whole (vocabulary x hidden) gradient, zeros plus a few rows (the embedding) or one GEMM (the head), that
autograd then adds into `.grad` and frees. (The SFT loss's head, `algos.linear_lm_loss_sum`, forms its gradient in
the forward, before the scale its backward brings is known: it keeps autograd's accumulation.) On SmolLM2
(49,152 x 576) that is a 113 MB temporary per backward, up to eight per PPO iteration (actor and critic, every
micro-batch), and memory that large comes fresh from the system each time: zero-filling one costs many times what
the same fill into memory written shortly before does (measured: docs/performance.md).

Where the engine keeps a model's gradients between steps and nothing else watches their accumulation (the local
engine with `keep_grads` on a CPU; DeepSpeed's hooks on accumulation rule it out there), the model's speed plan has
`grad_in_place` (`speed.registry`): `accel.install` calls `enable`, which routes its plain embeddings with such a
weight through `embedding`, and the chunked head's callers pass `target` as its `grad_target`. Only trainable
float32 CPU matrices of at least `MIN_ELEMENTS` elements take it (GPUs reuse their memory through the caching
allocator, and CUDA's `index_add_` adds with atomics, in no fixed order): the backwards above add their gradient
into `.grad` in place and hand autograd none for it. The sum is the same; only the order of its float additions
differs (the rows of one backward are added to `.grad` one by one rather than to a zeroed temporary first), a
rounding difference. Smaller matrices (the tests' tiny models) keep autograd's own accumulation.

A model with this path on has `.grad` as its large matrices' accumulator: their gradients are for
`loss.backward()`; `torch.autograd.grad` through it would write into `.grad` instead of returning them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ELEMENTS = 1 << 22  # 4M elements (16 MiB of float32): smaller temporaries are cheap enough


def takes(p: torch.Tensor) -> bool:
    """Whether a gradient of `p` may be added in place: a trainable float32 CPU leaf of at least `MIN_ELEMENTS`."""
    return (p.requires_grad and p.grad_fn is None and p.dtype == torch.float32 and p.device.type == "cpu"
            and p.numel() >= MIN_ELEMENTS)


def enable(module: torch.nn.Module) -> int:
    """Route `module`'s plain `nn.Embedding`s whose weight `takes` it through `embedding`. Returns how many of its
    parameters take it (its embedding and LM-head matrices, where large enough)."""
    for m in module.modules():
        if type(m) is torch.nn.Embedding and takes(m.weight) and m.max_norm is None and not m.scale_grad_by_freq \
                and not m.sparse:
            m.__class__ = InPlaceEmbedding
    return sum(takes(p) for p in module.parameters())


def target(weight: torch.Tensor) -> torch.Tensor | None:
    """The tensor a gradient of `weight` is to be added into in place, or None (autograd's accumulation): the
    kept float32 `.grad` of a leaf parameter that `takes` it (callers pass this only where the plan says so)."""
    if not takes(weight):
        return None
    grad = weight.grad
    if grad is None or grad.shape != weight.shape or grad.dtype != torch.float32 or not grad.is_contiguous() \
            or grad.device != weight.device:
        return None
    return grad


class _Embedding(torch.autograd.Function):
    """`F.embedding` whose backward adds the used rows' gradients into the weight's kept `.grad`."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        into = target(ctx.weight)
        padding = -1 if ctx.padding_idx is None else ctx.padding_idx
        if into is None:  # what F.embedding's own backward computes
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.weight.size(0), padding, False), None
        flat_ids, rows = ids.reshape(-1), grad.reshape(-1, grad.size(-1)).to(into.dtype)
        if ctx.padding_idx is not None:  # the padding row gets no gradient, as in nn.Embedding
            keep = flat_ids != ctx.padding_idx
            flat_ids, rows = flat_ids[keep], rows[keep]
        into.index_add_(0, flat_ids, rows)
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """`F.embedding(ids, weight, padding_idx)`; with a gradient into a tagged weight, accumulated in place."""
    if torch.is_grad_enabled() and target(weight) is not None:
        return _Embedding.apply(ids, weight, padding_idx)
    return F.embedding(ids, weight, padding_idx)


class InPlaceEmbedding(torch.nn.Embedding):
    """An `nn.Embedding` (same parameters and state dict) whose weight gradient goes through `embedding`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return embedding(input, self.weight, self.padding_idx)
