"""Faster float32 linear layers on CPUs where oneDNN beats PyTorch's default GEMM.

PyTorch sends a float32 `nn.Linear` on CPU to MKL's sgemm. On AMD CPUs MKL takes a generic code path: on the
AMD EPYC of the benchmarks oneDNN (also inside PyTorch, the library behind its bf16 and inductor CPU kernels) runs
the same float32 arithmetic far faster per core. Linear layers are most of a PPO iteration on CPU, forward and
backward (the measurements: docs/performance.md).

`use_fast_cpu_linear(model)` (through `accel.install`, where the model's speed plan has `onednn_linear`) switches the
model's linear layers to a subclass whose forward and input-gradient GEMMs call oneDNN (the weight gradient's too
on Zen 5, `onednn_weight_grads`; on Zen 4 MKL is faster for its transposed operands). The plan has it on AMD CPUs
only (`onednn_is_faster`; on Intel CPUs MKL is fast already): for all four PPO models on every AMD CPU (its rollouts
and frozen forwards gain), for SFT, RM and DPO, which only train, on Zen 5 and later (`onednn_weight_grads`).
Everything else falls back to `F.linear`: other dtypes and devices, ZeRO-3 partitioned weights (DeepSpeed owns
those linears), and small matmuls (decode steps of a few rows, LoRA's rank-r factors), where oneDNN's per-call
overhead loses.
"""

from __future__ import annotations

import contextlib
import functools
import platform

import torch
import torch.nn.functional as F

from rlhfkit.engine.partition import is_partitioned, is_whole

MIN_ROWS = 16  # below this many input rows (a few sequences decoding one token) MKL's lower overhead wins
MIN_DIM = 64  # LoRA factors and scalar heads stay on F.linear


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias by oneDNN; `weight` may be a transposed view (no copy needed)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinearFunction(torch.autograd.Function):
    """y = x W^T + b with the forward and input-gradient GEMMs in oneDNN (the weight gradient's GEMM, whose
    operands come transposed, is faster in MKL)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        flat_grad = grad.reshape(-1, grad.size(-1))  # (M, out)
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None)  # (..., in) = grad @ W
        if ctx.needs_input_grad[1]:
            # (out, in) = grad^T @ x. Both operands are transposed views here, which MKL reads as they are
            # (torch.mm, as F.linear's backward does): faster on Zen 4 (measured on SmolLM2's weight gradients);
            # on Zen 5 oneDNN's is faster than MKL's (`onednn_weight_grads`; the numbers: docs/performance.md)
            x2d = x.reshape(-1, x.size(-1))
            if onednn_weight_grads():
                grad_weight = _onednn(flat_grad.t(), x2d.t(), None)
            else:
                grad_weight = torch.mm(flat_grad.t(), x2d)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_x, grad_weight, grad_bias


class FastCPULinear(torch.nn.Linear):
    """An `nn.Linear` (same parameters, same state dict, same class checks) computing float32 CPU matmuls of
    at least MIN_ROWS rows with oneDNN."""

    packed = None  # the weight in oneDNN's own layout while `packed_weights` is active (decoding)
    fused = None  # the `_FusedProjections` this layer belongs to while `packed_weights` is active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (self.packed is not None or self.fused is not None) and x.dtype == torch.float32 \
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type):
            if self.fused is not None:
                return self.fused.output(self, x)
            return _onednn(x, self.packed, self.bias)
        if torch.is_autocast_enabled(x.device.type):  # mixed precision: F.linear casts (bf16 goes to oneDNN)
            return F.linear(x, weight, self.bias)
        if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
                or is_partitioned(weight) or x.numel() < MIN_ROWS * x.size(-1)):
            return F.linear(x, weight, self.bias)
        bias_grad = self.bias is not None and self.bias.requires_grad
        if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias_grad)):
            return _onednn(x, weight, self.bias)  # inference (rollout, reference, reward): no autograd node
        return _OneDNNLinearFunction.apply(x, weight, self.bias)


def fast_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (no autograd node of its own) as a `FastCPULinear` computes it: by oneDNN for float32 CPU
    tensors of at least MIN_ROWS rows, else `F.linear`. `weight` may be a transposed view. For the GEMMs of a
    layer's weight used outside the layer (the LM head's chunked log-probs)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.numel() < MIN_ROWS * x.size(-1)):
        return F.linear(x, weight)
    return _onednn(x, weight, None)


def layer_matmul(layer: torch.nn.Module):
    """`linear(x, w) = x @ w.T` for GEMMs with `layer`'s weight outside its forward (the LM head's chunked
    log-probs): the layer's own oneDNN path when it is a `FastCPULinear` (its packed copy of the weight while
    `packed_weights` holds one, `fast_linear` otherwise), else None (the caller's `F.linear`)."""
    if not isinstance(layer, FastCPULinear):
        return None
    packed = layer.packed

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if packed is not None and w is layer.weight and x.dtype == torch.float32:
            return _onednn(x, packed, None)
        return fast_linear(x, w)

    return linear


def cpu_vendor() -> str:
    """The CPU's vendor string as /proc/cpuinfo gives it (`AuthenticAMD`, `GenuineIntel`), else the platform's."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@functools.lru_cache(maxsize=None)
def onednn_is_faster() -> bool:
    """True on AMD CPUs, where MKL's float32 GEMM takes its generic path (measured there: oneDNN's is far faster
    per core; docs/performance.md), when this PyTorch build has oneDNN's linear. Decided by the CPU's vendor, not by
    timing, so the same machine always computes the same way; on Intel CPUs MKL is already fast."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if "AMD" not in cpu_vendor().upper():
        return False
    try:
        _onednn(torch.ones(MIN_ROWS, MIN_DIM), torch.ones(MIN_DIM, MIN_DIM), None)
    except RuntimeError:
        return False
    return True


def cpu_family() -> int | None:
    """The CPU's family number from /proc/cpuinfo (AMD: 25 Zen 3/4, 26 Zen 5), None when unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("cpu family"):
                    return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return None


@functools.lru_cache(maxsize=None)
def onednn_weight_grads() -> bool:
    """Whether the weight gradients' GEMMs go to oneDNN too, and training steps (SFT, RM, DPO) use oneDNN linear
    layers: on AMD CPUs of family 26 (Zen 5, full-width AVX-512) and later. Measured on a Zen 5 core: oneDNN's
    weight-gradient GEMMs well ahead of MKL's, and an SFT step much faster with every GEMM in oneDNN (the numbers:
    docs/performance.md). On Zen 4 (family 25) MKL's weight gradients were faster and
    SFT / RM steps no faster with oneDNN's forward (RESULTS.md, Hosts and software), so they keep MKL there. Decided
    by the CPU, not by timing, so the same machine always computes the same way."""
    return (onednn_is_faster() and (cpu_family() or 0) >= 26
            and torch.backends.cpu.get_cpu_capability() == "AVX512")


def gemm_policy() -> str:
    """Which float32 CPU GEMMs go to oneDNN here, as a name ('' for none: MKL everywhere): the pinned losses of
    the tests are kept per policy, since each rounds differently."""
    if not onednn_is_faster():
        return ""
    return "onednn-all" if onednn_weight_grads() else "onednn"


def use_fast_cpu_linear(model: torch.nn.Module) -> int:
    """Switch `model`'s linear layers of at least `MIN_DIM` inputs and outputs to `FastCPULinear` (each call still
    takes oneDNN only for float32 CPU tensors of at least `MIN_ROWS` rows). Returns the number of layers switched."""
    switched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and min(module.in_features, module.out_features) >= MIN_DIM:
            module.__class__ = FastCPULinear
            switched += 1
    return switched


# sibling projections that a Llama-family layer applies to one input, one after another (attention, MLP)
FUSABLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _FusedProjections:
    """Sibling linear layers that read the same input (q/k/v, gate/up) as one GEMM by a weight concatenated and
    reordered once (`packed_weights`): the first member called with an input computes every member's output,
    and each other member called with that same tensor (unchanged since) takes its columns. Any other call
    (another input, a member called twice) computes the whole group's again for it. Decoding runs the group's
    2-3 small GEMMs of a few rows as one: fewer calls, the same values up to the GEMM's float rounding."""

    def __init__(self, members: list[FastCPULinear]):
        self.members = members
        self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([m.weight.detach() for m in members]))
        biases = [m.bias for m in members]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.sizes = [m.out_features for m in members]
        self.input, self.version, self.pending = None, None, {}

    def output(self, layer: FastCPULinear, x: torch.Tensor) -> torch.Tensor:
        if self.input is x and self.version == x._version and layer in self.pending:
            out = self.pending.pop(layer)
            if not self.pending:
                self.input = None
            return out
        parts = _onednn(x, self.packed, self.bias).split(self.sizes, dim=-1)
        self.input, self.version = x, x._version
        self.pending = {m: part for m, part in zip(self.members, parts) if m is not layer}
        return parts[self.members.index(layer)]

    def release(self) -> None:
        self.input, self.pending = None, {}
        for m in self.members:
            m.fused = None


def _fusable_groups(model: torch.nn.Module, layers: list[FastCPULinear]) -> list[list[FastCPULinear]]:
    """The `FUSABLE` sibling sets among `layers`: named `<parent>.<role>` (or `<parent>.<role>.base_layer` under
    a LoRA wrapper, whose base layers read the wrapper's input), all present, the same input width and all with
    a bias or none."""
    eligible = {id(m) for m in layers}
    by_role: dict[tuple[str, str], FastCPULinear] = {}
    for name, module in model.named_modules():
        if id(module) not in eligible:
            continue
        parts = name.split(".")
        if parts[-1] == "base_layer":
            parts = parts[:-1]
        by_role[(".".join(parts[:-1]), parts[-1])] = module
    groups = []
    for parent in {p for p, _ in by_role}:
        for roles in FUSABLE:
            members = [by_role.get((parent, role)) for role in roles]
            if any(m is None for m in members):
                continue
            if len({m.in_features for m in members}) == 1 and len({m.bias is None for m in members}) == 1:
                groups.append(members)
    return groups


@contextlib.contextmanager
def packed_weights(model: torch.nn.Module, enabled: bool = True):
    """While active, `model`'s oneDNN linear layers multiply by a copy of their weight reordered once into
    oneDNN's blocked layout, instead of reordering the plain weight inside every call. For the many small
    matmuls of decoding (a few rows per token step) that is markedly less time per linear layer (measured:
    docs/performance.md) with bit-identical results; it costs one copy of the weights
    for the duration. The weights must not change meanwhile (no-grad generation); grad-mode calls ignore the
    copy. A no-op for models without such layers (GPUs, Intel CPUs) and for ZeRO-3 weights not gathered in
    full (with `engine.gather_for_generation` they are, and decoding runs on oneDNN too).

    Sibling projections of one input (`FUSABLE`: q/k/v, gate/up) share one copy of their weights concatenated and
    run as one GEMM (`_FusedProjections`): 4 instead of 7 GEMMs per Llama layer and decode step (a small gain per
    rollout, measured with the no-grad RMSNorm and SwiGLU of `accel/lean.py`: docs/performance.md). `enabled`:
    the model's speed plan's `onednn_linear` (off: a no-op)."""
    layers = [m for m in model.modules() if isinstance(m, FastCPULinear) and m.weight.device.type == "cpu"
              and m.weight.dtype == torch.float32 and is_whole(m.weight)] if enabled else []
    groups: list[_FusedProjections] = []
    try:
        with torch.no_grad():
            for members in _fusable_groups(model, layers):
                group = _FusedProjections(members)
                groups.append(group)
                for m in members:
                    m.fused = group
            for layer in layers:
                if layer.fused is None:
                    layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
        yield
    finally:
        for group in groups:
            group.release()
        for layer in layers:
            layer.packed = None
