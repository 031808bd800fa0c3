"""oneDNN linear layers: the same outputs and gradients as nn.Linear, the same parameters and state dict."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhfkit.models.cpu_linear import FastCPULinear, _OneDNNLinearFunction, packed_weights, use_fast_cpu_linear

needs_onednn = pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise"), reason="no oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 20, 96), (60, 96)])
def test_onednn_linear_matches_nn_linear_forward_and_backward(bias, shape):
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
    assert torch.equal(fast.weight.grad, plain.weight.grad)  # the same MKL GEMM as nn.Linear's backward
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
    assert use_fast_cpu_linear(model, torch.device("cuda")) == 0  # a GPU keeps its own kernels
    switched = use_fast_cpu_linear(model, torch.device("cpu"))
    assert switched in (0, 1)  # 0 where MKL is as fast as oneDNN on this CPU
    assert [type(m) for m in model] == [FastCPULinear if switched else torch.nn.Linear, torch.nn.Linear,
                                        torch.nn.Linear]


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
