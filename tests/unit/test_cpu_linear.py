"""oneDNN linear layers: the same outputs and gradients as nn.Linear, the same parameters and state dict."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhfkit.accel.cpu_linear import FastCPULinear, _OneDNNLinearFunction, packed_weights, use_fast_cpu_linear

needs_onednn = pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise"), reason="no oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 20, 96), (60, 96)])
@pytest.mark.parametrize("weight_grads", ["mkl", "onednn"])
def test_onednn_linear_matches_nn_linear_forward_and_backward(bias, shape, weight_grads, monkeypatch):
    """Both weight-gradient routes (`onednn_weight_grads`: oneDNN on Zen 5, MKL elsewhere), whatever this CPU."""
    from rlhfkit.accel import cpu_linear

    monkeypatch.setattr(cpu_linear, "onednn_weight_grads", lambda: weight_grads == "onednn")
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 80, bias=bias)
    fast = copy.deepcopy(plain)
    fast.__class__ = FastCPULinear
    x = torch.randn(*shape)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = plain(xa), fast(xb)
    grad = torch.randn_like(ya)
    ya.backward(grad)
    yb.backward(grad)
    torch.testing.assert_close(yb, ya, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-5, rtol=1e-5)
    if weight_grads == "mkl":
        assert torch.equal(fast.weight.grad, plain.weight.grad)  # the same MKL GEMM as nn.Linear's backward
    else:  # oneDNN's GEMM on the transposed views: the same values to float rounding
        torch.testing.assert_close(fast.weight.grad, plain.weight.grad, atol=1e-5, rtol=1e-5)
    if bias:
        torch.testing.assert_close(fast.bias.grad, plain.bias.grad, atol=1e-5, rtol=1e-5)
    assert isinstance(fast, torch.nn.Linear) and fast.state_dict().keys() == plain.state_dict().keys()


@needs_onednn
def test_weight_gradient_of_the_onednn_function_against_float64():
    torch.manual_seed(0)
    x, w = torch.randn(40, 64, requires_grad=True), torch.randn(72, 64, requires_grad=True)
    grad = torch.randn(40, 72)
    _OneDNNLinearFunction.apply(x, w, None).backward(grad)
    torch.testing.assert_close(w.grad.double(), grad.double().t() @ x.detach().double(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), grad.double() @ w.detach().double(), atol=1e-4, rtol=1e-5)


def test_only_large_float32_cpu_linears_switch():
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 1), torch.nn.Linear(8, 128))
    assert use_fast_cpu_linear(model) == 1  # where it goes is the speed plan's (`onednn_linear`: AMD CPUs only)
    assert [type(m) for m in model] == [FastCPULinear, torch.nn.Linear, torch.nn.Linear]


@needs_onednn
def test_packed_weights_give_identical_outputs_and_leave_training_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 64, bias=False))
    for layer in (model[0], model[2]):
        layer.__class__ = FastCPULinear
    x = torch.randn(5, 16, 64)
    with torch.no_grad():
        plain = model(x)
        with packed_weights(model):
            assert model[0].packed is not None and model[0].packed.layout != torch.strided
            packed = model(x)
            one_row = model(x[:1, :1])  # below MIN_ROWS the packed layout serves too
            # grad mode ignores the packed copy: gradients reach the real parameters
            with torch.enable_grad():
                model(x).sum().backward()
    torch.testing.assert_close(packed, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(one_row, plain[:1, :1], atol=1e-5, rtol=1e-5)
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0
    assert model[0].packed is None and model[2].packed is None  # dropped on exit


def test_packed_weights_is_a_no_op_for_plain_linears():
    model = torch.nn.Linear(64, 64)
    with packed_weights(model):
        assert not hasattr(model, "packed")


class _Block(torch.nn.Module):
    """An attention-like and an MLP-like set of sibling projections, named as Llama's are."""

    def __init__(self, width=64, bias=False):
        super().__init__()
        self.q_proj = torch.nn.Linear(width, 96, bias=bias)
        self.k_proj = torch.nn.Linear(width, 32, bias=bias)
        self.v_proj = torch.nn.Linear(width, 32, bias=bias)
        self.gate_proj = torch.nn.Linear(width, 80, bias=False)
        self.up_proj = torch.nn.Linear(width, 80, bias=False)
        self.down_proj = torch.nn.Linear(80, width, bias=False)  # another input: never fused

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        h = x + q[..., :64] * torch.sigmoid(k.sum(-1, keepdim=True)) + v.mean(-1, keepdim=True)
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def _fast(model):
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = FastCPULinear
    return model


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_sibling_projections_run_as_one_gemm_with_the_same_outputs(bias, monkeypatch):
    import rlhfkit.accel.cpu_linear as cpu_linear

    torch.manual_seed(0)
    model = _fast(_Block(bias=bias))
    x = torch.randn(4, 3, 64)
    with torch.no_grad():
        plain = model(x)
        calls = []
        real = cpu_linear._onednn
        monkeypatch.setattr(cpu_linear, "_onednn", lambda *a: calls.append(a[1].shape) or real(*a))
        with packed_weights(model):
            assert model.q_proj.fused is model.v_proj.fused is not None and model.q_proj.packed is None
            assert model.gate_proj.fused is model.up_proj.fused is not model.q_proj.fused
            assert model.down_proj.fused is None and model.down_proj.packed is not None
            fused = model(x)
        # three GEMMs for six layers: q/k/v as one, gate/up as one, down alone
        assert len(calls) == 3
        assert not any(m.fused is not None or m.packed is not None for m in model.modules()
                       if isinstance(m, FastCPULinear))
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_fused_projections_serve_any_call_order_and_other_inputs():
    torch.manual_seed(0)
    model = _fast(_Block())
    x, y = torch.randn(5, 64), torch.randn(5, 64)
    with torch.no_grad():
        expected = {name: getattr(model, name)(t) for name, t in (("q_proj", x), ("k_proj", x), ("v_proj", y))}
        with packed_weights(model):
            k = model.k_proj(x)  # a member other than the first computes the group's GEMM
            q = model.q_proj(x)
            q_again = model.q_proj(x)  # twice with one input: computed again, not a stale or missing part
            v_other = model.v_proj(y)  # another input: its own values, not the columns computed for x
            x.add_(1.0)  # changed in place: a member's pending columns are not served for it
            v_changed = model.v_proj(x)
    torch.testing.assert_close(k, expected["k_proj"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, expected["q_proj"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q_again, expected["q_proj"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_other, expected["v_proj"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_changed, torch.nn.functional.linear(x, model.v_proj.weight), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_lora_base_layers_are_fused_and_the_adapter_still_applies():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = _Block()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    _fast(model)
    x = torch.randn(4, 3, 64)
    with torch.no_grad():
        plain = model(x)
        with packed_weights(model):
            inner = model.base_model.model
            assert inner.q_proj.base_layer.fused is not None and inner.q_proj.base_layer.fused is inner.k_proj.fused
            fused = model(x)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


def test_the_gemm_policy_follows_the_cpu(monkeypatch):
    """MKL everywhere off AMD; oneDNN's forward and input gradients on AMD; its weight gradients and the training
    steps' linears too on Zen 5 (family 26) with AVX-512 only: the speed plan's `onednn_linear` for PPO's models and
    for the training stages' (SFT, RM, DPO), and never on a GPU."""
    from rlhfkit.accel import cpu_linear
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.speed.registry import BY_NAME, Target, _decide

    def on(stage: str, device: str = "cpu") -> bool:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        target = Target(model, {"sft": "policy", "ppo": "actor"}[stage], stage, None, LocalEngine(), device=device)
        return _decide(BY_NAME["onednn_linear"], target, {}) is None

    cases = [("GenuineIntel", 6, "AVX512", ""), ("AuthenticAMD", 25, "AVX512", "onednn"),
             ("AuthenticAMD", 26, "AVX2", "onednn"), ("AuthenticAMD", 26, "AVX512", "onednn-all")]
    for vendor, family, capability, want in cases:
        cpu_linear.onednn_is_faster.cache_clear()
        cpu_linear.onednn_weight_grads.cache_clear()
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: vendor)
        monkeypatch.setattr(cpu_linear, "cpu_family", lambda: family)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        assert cpu_linear.gemm_policy() == (want if hasattr(torch.ops.mkldnn, "_linear_pointwise") else "")
        assert on("sft") == (cpu_linear.gemm_policy() == "onednn-all")
        assert on("ppo") == (cpu_linear.gemm_policy() != "")
        assert not on("ppo", device="cuda")
    cpu_linear.onednn_is_faster.cache_clear()
    cpu_linear.onednn_weight_grads.cache_clear()
