"""Lean RMSNorm and SwiGLU (`models/lean.py`): the module's own values and gradients, fewer saved tensors."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhfkit.models.lean import LeanRMSNorm, LeanSwiGLU, use_lean_activations


def saved_floats(module, x) -> int:
    """Elements of the distinct tensors the autograd graph of module(x) keeps for backward, its parameters aside."""
    params = {p.data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), t.numel())] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=112, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norm weights, so their gradient and scale are exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_hand_computed_rmsnorm_and_silu_mul():
    from rlhfkit.models.lean import _RMSNormFunction, _SiluMulFunction

    # x = (3, 4): rms = sqrt((9 + 16) / 2) = 5 / sqrt 2; y = w * x / rms = (2 * 3, 1 * 4) * sqrt 2 / 5
    x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    w = torch.tensor([2.0, 1.0], requires_grad=True)
    y = _RMSNormFunction.apply(x, w, 0.0)
    torch.testing.assert_close(y, torch.tensor([[6.0, 4.0]]) * 2 ** 0.5 / 5)
    g, u = torch.tensor([0.0, 2.0], requires_grad=True), torch.tensor([3.0, -1.0], requires_grad=True)
    out = _SiluMulFunction.apply(g, u)
    s2 = torch.sigmoid(torch.tensor(2.0))
    torch.testing.assert_close(out, torch.stack([torch.tensor(0.0), -2 * s2]))
    out.sum().backward()
    # d/dg: u * SiLU'(g); SiLU'(0) = 1/2, SiLU'(2) = s (1 + 2 (1 - s)); d/du = SiLU(g)
    torch.testing.assert_close(g.grad, torch.stack([torch.tensor(1.5), -(s2 * (1 + 2 * (1 - s2)))]))
    torch.testing.assert_close(u.grad, torch.stack([torch.tensor(0.0), 2 * s2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_model_gives_the_same_loss_and_gradients(dtype):
    plain, lean = tiny_llama().to(dtype), tiny_llama().to(dtype)
    assert use_lean_activations(lean) == 2 * 2 + 1 + 2  # two norms per layer, the final norm, one MLP per layer
    assert isinstance(lean.model.norm, LeanRMSNorm) and isinstance(lean.model.layers[0].mlp, LeanSwiGLU)
    ids = torch.randint(97, (3, 11), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (plain, lean):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[1][0], results[0][0], **tol)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, msg=name, **tol)
    # inference (no grad): the original forwards, the same logits
    with torch.no_grad():
        torch.testing.assert_close(lean(input_ids=ids).logits, plain(input_ids=ids).logits, **tol)


def test_lean_modules_keep_fewer_tensors():
    model = tiny_llama()
    layer = model.model.layers[0]
    x = torch.randn(2, 7, 48, requires_grad=True)
    norm_plain, mlp_plain = saved_floats(layer.input_layernorm, x), saved_floats(layer.mlp, x)
    use_lean_activations(model)
    norm_lean, mlp_lean = saved_floats(layer.input_layernorm, x), saved_floats(layer.mlp, x)
    tokens = 14
    # RMSNorm: x, x / rms, 1 / rms -> x, 1 / rms; MLP: x, gate, SiLU(gate), up, product -> x, gate, up, product
    assert (norm_plain, norm_lean) == (tokens * (48 + 48 + 1), tokens * (48 + 1))
    assert (mlp_plain, mlp_lean) == (tokens * (48 + 4 * 112), tokens * (48 + 3 * 112))


def test_an_unknown_activation_or_norm_is_left_alone():
    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # not SiLU: the MLP keeps its own forward
    model.model.layers[1].mlp.act_fn = torch.nn.SiLU()  # torch's own SiLU module: switched like transformers' one
    switched = use_lean_activations(model)
    assert not isinstance(model.model.layers[0].mlp, LeanSwiGLU)
    assert isinstance(model.model.layers[1].mlp, LeanSwiGLU)
    assert switched == 5 + 1
