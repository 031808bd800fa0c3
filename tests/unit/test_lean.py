"""Lean RMSNorm and SwiGLU (`accel/lean.py`): the module's own values and gradients, fewer saved tensors."""

import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhfkit.accel.lean import LeanRMSNorm, LeanSwiGLU, recompute_saved, register_recomputable, use_lean_activations


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
    from rlhfkit.accel.lean import _RMSNormFunction, _SiluMulFunction

    # x = (3, 4): rms = sqrt((9 + 16) / 2) = 5 / sqrt 2; y = w * x / rms = (2 * 3, 1 * 4) * sqrt 2 / 5
    x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    w = torch.tensor([2.0, 1.0], requires_grad=True)
    y = _RMSNormFunction.apply(x, w, 0.0, False)  # PyTorch's operators (fused=False)
    torch.testing.assert_close(y, torch.tensor([[6.0, 4.0]]) * 2 ** 0.5 / 5)
    g, u = torch.tensor([0.0, 2.0], requires_grad=True), torch.tensor([3.0, -1.0], requires_grad=True)
    out = _SiluMulFunction.apply(g, u, False)
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
    # inference (no grad): torch's RMSNorm kernel and the in-place SwiGLU product, the same logits
    with torch.no_grad():
        torch.testing.assert_close(lean(input_ids=ids).logits, plain(input_ids=ids).logits, **tol)


def test_a_fresh_model_with_unit_norm_weights_is_switched_too():
    """A freshly initialised model's norms have weight 1, where the squared sum of a norm's output is the same for
    every input: a check on that loss saw a zero gradient's rounding noise and refused every such norm."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=112, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    assert all(bool((p == 1).all()) for n, p in model.named_parameters() if "norm" in n)
    assert use_lean_activations(model) == 2 * 2 + 1 + 2
    assert isinstance(model.model.layers[1].input_layernorm, LeanRMSNorm)


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


def norm_and_product_outputs(model) -> list:
    """Weak references to the last layer's first RMSNorm output and its SwiGLU product in the next forward
    (the last layer's: under LoRA the first layer's input needs no gradient, and its norm runs the plain way)."""
    refs, layer = [], model.model.layers[-1]
    layer.input_layernorm.register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
    layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: refs.append(weakref.ref(args[0])))
    return refs


@pytest.mark.parametrize("variant", ["plain", "lora", "checkpointed"])
def test_recomputed_activations_give_the_same_gradients_and_are_not_kept(variant):
    """With the recompute hooks (the default) the norm outputs and the SwiGLU product are freed after the
    forward, and the loss and every gradient are bit for bit those of the lean model that keeps them."""
    results = []
    for recompute in (False, True):
        model = tiny_llama()
        use_lean_activations(model)
        if not recompute:  # the lean modules without the hooks that open `recompute_saved` around the forward
            model._forward_pre_hooks.clear()
            model._forward_hooks.clear()
        if variant == "lora":
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                     target_modules=["q_proj", "down_proj"]))
            torch.manual_seed(3)
            for name, p in model.named_parameters():
                if "lora_B" in name:  # not zero, so the adapters' own gradients flow back to the inputs
                    torch.nn.init.normal_(p, std=0.1)
        if variant == "checkpointed":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        base = model.base_model.model if variant == "lora" else model
        refs = norm_and_product_outputs(base)
        ids = torch.randint(97, (3, 11), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, labels=ids).loss
        kept = [r() is not None for r in refs]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, kept))
    (loss_kept, grads_kept, alive_kept), (loss_rc, grads_rc, alive_rc) = results
    # checkpointed layers keep neither either way
    assert alive_kept == ([True, True] if variant != "checkpointed" else [False, False])
    assert alive_rc == [False, False]
    assert torch.equal(loss_rc, loss_kept) and grads_rc.keys() == grads_kept.keys()
    assert all(torch.equal(grads_rc[n], grads_kept[n]) for n in grads_kept)


def test_recompute_saved_hand_made_graph():
    """y = 2x is registered, y @ w keeps y for w's gradient: y itself is not held, the gradient is 2x^T 1; a
    registered tensor changed in place before it is saved is kept as it is; an input of the recipe changed in
    place after the forward stops the backward with an error."""
    x = torch.arange(6.0).reshape(2, 3)
    w = torch.ones(3, 2, requires_grad=True)
    with recompute_saved():
        y = register_recomputable(x * 2, lambda t: t * 2, x)
        out = (y.t().t() @ w).sum()  # a view of y is what the matmul saves
    ref = weakref.ref(y)
    del y
    assert ref() is None
    out.backward()
    torch.testing.assert_close(w.grad, (2 * x).t() @ torch.ones(2, 2), rtol=0, atol=0)

    w.grad = None
    with recompute_saved():
        y = register_recomputable(x * 2, lambda t: t * 2, x)
        y.add_(1)  # no longer what the recipe computes: kept
        out = (y @ w).sum()
    out.backward()
    torch.testing.assert_close(w.grad, (2 * x + 1).t() @ torch.ones(2, 2), rtol=0, atol=0)

    source = x.clone()
    with recompute_saved():
        y = register_recomputable(source * 2, lambda t: t * 2, source)
        out = (y @ w).sum()
    source.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.backward()
