"""RMSNorm and SwiGLU that keep fewer activations for backward: the same values, less activation memory.

A Llama-style decoder layer's autograd graph keeps, per token, besides what the linear layers need:
- in each RMSNorm, its input, the normalised input and the output (the next linear keeps the output);
- in the MLP, the gate output, SiLU(gate), the up output and their product (the down projection keeps it).

`LeanRMSNorm` keeps the input and one number per token (1 / rms) and recomputes the normalised input in backward;
`LeanSwiGLU` keeps the gate and up outputs and recomputes SiLU(gate) in backward. Both are element-wise
recomputations (no matmul), so the time hardly moves, while the memory a micro-batch's activations take falls by
~2,700 floats per token and layer out of ~11,000 on SmolLM2 (hidden 576, MLP 1536).

Two more tensors are not kept but computed again when backward needs them: each RMSNorm's output, which the
linear layers after it (q/k/v, gate/up) would keep as their input, and the SwiGLU product, which the down
projection would keep. Both are one element-wise pass over tensors kept anyway (the norm's input and 1 / rms;
the gate and up outputs), recomputed bit for bit. This is done with autograd's saved-tensor hooks
(`recompute_saved`), open while the model's forward runs, so the linear layers stay the modules they are (LoRA,
oneDNN linears and hooks see them unchanged); a tensor saved by a layer is replaced by its recipe only when it
is, storage and version, the output the lean module registered. SmolLM2: another ~2,700 floats per token and layer.

With `fused` (the speed plan's `fused_kernels`), rows at least `kernels.MIN_WIDTH` wide run these forwards,
backwards and recomputations as fused C loops (`accel/kernels.py`), with and without autograd alike: the same values
to float rounding.

`use_lean_activations(model, fused)` (through `accel.install`, where the plan has `lean_activations`) switches the
modules of the known Llama-family classes (by class swap, like `cpu_linear.FastCPULinear`: same parameters, same
state dict) after checking on a random input that the lean forward gives the module's own values; ZeRO-3
partitioned weights and anything unusual keep the original forward.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F

from rlhfkit.engine.partition import is_partitioned
from rlhfkit.accel import kernels


class _Recipe:
    """How to compute a tensor again: fn(*args), from tensors autograd keeps anyway; the value is made once on
    the first unpack and shared by every layer that saved the tensor (it goes when their saved copies go)."""

    __slots__ = ("fn", "args", "versions", "value")

    def __init__(self, fn, args):
        self.fn, self.args, self.versions, self.value = fn, args, [a._version for a in args], None

    def compute(self) -> torch.Tensor:
        if self.value is None:
            if [a._version for a in self.args] != self.versions:
                raise RuntimeError("rlhfkit.accel.lean: a tensor needed to recompute an activation for backward "
                                   "was modified in place after the forward")
            with torch.no_grad():
                self.value = self.fn(*self.args)
        return self.value


class _Saved:
    """What autograd keeps instead of a registered output (or of a view of it): its recipe and the view."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, t: torch.Tensor):
        self.recipe, self.size, self.stride, self.offset = recipe, t.size(), t.stride(), t.storage_offset()


_OPEN = threading.local()  # .stack: the registries of the open `recompute_saved` contexts, innermost last


class recompute_saved(torch.autograd.graph.saved_tensors_hooks):
    """While open, tensors registered by `register_recomputable` are not kept for backward but recomputed."""

    def __init__(self):
        self.registry: dict[int, tuple[weakref.ref, int, _Recipe]] = {}
        super().__init__(self._pack, _unpack)

    def __enter__(self):
        super().__enter__()
        _stack().append(self.registry)
        return self

    def __exit__(self, *exc):
        _stack().pop()
        self.registry.clear()
        return super().__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        try:
            entry = self.registry.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        if entry is None:
            return t
        ref, version, recipe = entry
        output = ref()
        if output is None or output._version != version or output.dtype != t.dtype or t._version != version:
            return t
        return _Saved(recipe, t)


def _unpack(saved):
    if isinstance(saved, _Saved):
        return saved.recipe.compute().as_strided(saved.size, saved.stride, saved.offset)
    return saved


def _stack() -> list:
    if not hasattr(_OPEN, "stack"):
        _OPEN.stack = []
    return _OPEN.stack


def register_recomputable(output: torch.Tensor, fn, *args: torch.Tensor) -> torch.Tensor:
    """Mark `output` (a fresh tensor equal to fn(*args), bit for bit) as one to recompute rather than keep, in
    the innermost open `recompute_saved` context; nothing happens outside one."""
    stack = _stack()
    if stack and output.is_contiguous() and output.storage_offset() == 0:
        stack[-1][output.untyped_storage().data_ptr()] = (weakref.ref(output), output._version, _Recipe(fn, args))
    return output


def _norm_output(x: torch.Tensor, weight: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
    return weight * (x.float() * inv_rms).to(x.dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up

# Llama-style RMSNorm (weight * normalised, computed in float32) and gate/up/down SwiGLU MLP classes
RMSNORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "SmolLM3RMSNorm")
MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "SmolLM3MLP")


class _RMSNormFunction(torch.autograd.Function):
    """y = w * (x / rms(x)), rms over the last dim in float32; keeps x and 1 / rms for backward."""

    @staticmethod
    def forward(ctx, x, weight, eps, fused):
        ctx.fused = fused
        if fused and kernels.usable(x, weight):  # one fused loop for 1 / rms and the output
            out, inv_rms = kernels.rms_norm_forward(x, weight, eps)
            ctx.save_for_backward(x, weight, inv_rms)
            return register_recomputable(out, kernels.norm_output, x, weight, inv_rms)
        inv_rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return register_recomputable(_norm_output(x, weight, inv_rms), _norm_output, x, weight, inv_rms)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, inv_rms = ctx.saved_tensors
        if ctx.fused and kernels.usable(x, weight, grad, inv_rms) and grad.shape == x.shape:
            grad_x, grad_weight = kernels.rms_norm_backward(grad, x, weight, inv_rms)
            return (grad_x if ctx.needs_input_grad[0] else None,
                    grad_weight if ctx.needs_input_grad[1] else None, None, None)
        normed = x.float() * inv_rms  # recomputed: the one tensor not kept
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, grad.size(-1)).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * r(x), r = 1 / rms: r * (g - normed * mean(g * normed)), g = grad * weight; one fused
            # multiply-subtract and one in-place scaling instead of three fresh tensors
            g = (grad * weight).float()
            mean = (g * normed).mean(-1, keepdim=True)
            grad_x = torch.addcmul(g, normed, mean, value=-1).mul_(inv_rms).to(x.dtype)
        return grad_x, grad_weight, None, None


class _SiluMulFunction(torch.autograd.Function):
    """SiLU(gate) * up; keeps gate and up, recomputes SiLU(gate) in backward."""

    @staticmethod
    def forward(ctx, gate, up, fused):
        ctx.save_for_backward(gate, up)
        ctx.fused = fused
        if fused and kernels.usable(gate, up) and gate.shape == up.shape:
            return register_recomputable(kernels.silu_mul(gate, up), kernels.silu_mul, gate, up)
        return register_recomputable(_silu_mul(gate, up), _silu_mul, gate, up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        if ctx.fused and kernels.usable(gate, up, grad) and gate.shape == up.shape == grad.shape:
            grad_gate, grad_up = kernels.silu_mul_backward(grad, gate, up)
            return (grad_gate if ctx.needs_input_grad[0] else None, grad_up if ctx.needs_input_grad[1] else None,
                    None)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_up = grad * silu if ctx.needs_input_grad[1] else None
        grad_gate = None
        if ctx.needs_input_grad[0]:
            # SiLU'(g) = s * (1 + g * (1 - s)) = s + silu - silu * s, s = sigmoid(g): formed in place in `sig`'s
            # buffer (seven passes over the (tokens, MLP) tensors and three of them fresh, where the plain
            # expression takes nine passes and nine fresh tensors; measured: docs/performance.md)
            grad_gate = sig.addcmul_(silu, sig, value=-1).add_(silu).mul_(up).mul_(grad)
        return grad_gate, grad_up, None


class LeanRMSNorm(torch.nn.Module):
    """Stands in for a Llama-style RMSNorm (`weight`, `variance_epsilon`); see the module docstring."""

    fused = False  # the element-wise work in C (`kernels`), set per switched class (`_lean_class`)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and hidden_states.requires_grad) or is_partitioned(self.weight):
            if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32 \
                    and not is_partitioned(self.weight):
                # no autograd (decoding, frozen models): the fused kernel where the training forward takes it (the
                # same bits: a reference computed by the policy gives it exactly its own log-probs), else torch's
                # one-kernel RMSNorm, the same float32 formula, where the class's own forward takes six passes
                if self.fused and kernels.usable(hidden_states, self.weight):
                    return kernels.rms_norm_forward(hidden_states, self.weight, self.variance_epsilon)[0]
                return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)
            return type(self).__mro__[1].forward(self, hidden_states)  # the original class's forward
        return _RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, self.fused)


class LeanSwiGLU(torch.nn.Module):
    """Stands in for a gate/up/down SiLU MLP; the three projections stay modules (LoRA and hooks see them)."""

    fused = False  # the element-wise work in C (`kernels`), set per switched class (`_lean_class`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            gate, up = self.gate_proj(x), self.up_proj(x)
            if self.fused and kernels.usable(gate, up) and gate.shape == up.shape:  # the training forward's arithmetic
                return self.down_proj(kernels.silu_mul(gate, up))
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # the same product, in the gate's buffer
        return self.down_proj(_SiluMulFunction.apply(self.gate_proj(x), self.up_proj(x), self.fused))


_LEAN_CLASSES: dict[tuple, type] = {}  # one class per (original, lean, fused), made once: every switched module of
#                                         a kind shares it, as modules of one transformers class share theirs


def _lean_class(original: type, lean: type, fused: bool) -> type:
    """A subclass of `original` (and of `lean`, for isinstance) whose forward is `lean`'s, falling back to
    `original.forward` (the first class after it in the MRO); `fused`: its element-wise work in C."""
    key = (original, lean, fused)
    if key not in _LEAN_CLASSES:
        _LEAN_CLASSES[key] = type(f"Lean{'Fused' if fused else ''}{original.__name__}", (original, lean),
                                  {"forward": lean.forward, "fused": fused})
    return _LEAN_CLASSES[key]


def _same_values(module: torch.nn.Module, lean: type, width: int, fused: bool) -> bool:
    """Whether `lean`'s forward and gradients equal the module's own on a random input (float rounding aside),
    and its forward without autograd too (a path of its own)."""
    dtype = next(module.parameters()).dtype
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, width, dtype=torch.float32, generator=generator).to(dtype)
    x.requires_grad_(True)
    # a loss whose gradient is not ~0: the squared sum of a unit-weight RMSNorm's output is the same for every
    # input (the width), so its gradient would be float noise and the check would refuse a correct module
    probe = torch.randn(3, 5, width, generator=generator)
    original = type(module)
    with torch.enable_grad():
        expected = original.forward(module, x)
        (expected_grad,) = torch.autograd.grad((expected.float() * probe[..., :expected.shape[-1]]).sum(), x)
        module.__class__ = _lean_class(original, lean, fused)  # its forward reads `fused` and its fallback the class
        try:
            got = module.forward(x)
        finally:
            module.__class__ = original
        (got_grad,) = torch.autograd.grad((got.float() * probe[..., :got.shape[-1]]).sum(), x)
    module.__class__ = _lean_class(original, lean, fused)
    try:
        with torch.no_grad():
            inference = module.forward(x.detach())
    finally:
        module.__class__ = original
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:  # relative to the largest value: rounding, not a bug
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).abs().max()) <= tol * float(b.abs().max()) + 1e-12

    return close(got, expected) and close(got_grad, expected_grad) and close(inference, expected)


def use_lean_activations(model: torch.nn.Module, fused: bool = False) -> int:
    """Switch `model`'s Llama-style RMSNorm and SwiGLU MLP modules to their lean forwards (see the module
    docstring; `fused`: their element-wise work in C), and open `recompute_saved` around each of its forwards with
    autograd. Returns how many modules were switched; unknown classes, partitioned weights and modules switched
    before keep theirs."""
    hooked = any(isinstance(m, (LeanRMSNorm, LeanSwiGLU)) for m in model.modules())  # switched before: hooks too
    switched = 0
    for module in model.modules():
        name = type(module).__name__
        if name in RMSNORM_CLASSES and hasattr(module, "variance_epsilon") and not is_partitioned(module.weight):
            lean, width = LeanRMSNorm, module.weight.numel()
        elif name in MLP_CLASSES and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")) and \
                (isinstance(module.act_fn, torch.nn.SiLU) or type(module.act_fn).__name__ == "SiLUActivation") and \
                not any(is_partitioned(p) for p in module.parameters()):
            lean, width = LeanSwiGLU, module.gate_proj.in_features
        else:
            continue
        if _same_values(module, lean, width, fused):
            module.__class__ = _lean_class(type(module), lean, fused)
            switched += 1
    if switched and not hooked:
        opened = []  # the contexts of the forwards running now (a model may be called inside its own forward)

        def enter(_module, _args):
            context = recompute_saved() if torch.is_grad_enabled() else None
            if context is not None:
                context.__enter__()
            opened.append(context)

        def leave(_module, _args, _output):
            context = opened.pop() if opened else None
            if context is not None:
                context.__exit__(None, None, None)

        model.register_forward_pre_hook(enter)
        model.register_forward_hook(leave, always_call=True)
    return switched
