"""The SFT loss with the LM head in chunks (`algos.linear_lm_loss_sum`, `models.stage_forward.lm_forward` under a
speed plan with `head_chunks`)."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.algos import linear_lm_loss_sum
from rlhfkit.data.tokenize import IGNORE, collate_packed, collate_sft
from rlhfkit.models import load_causal_lm, load_tokenizer

from conftest import sharpened


def test_hand_computed_value_and_gradients():
    # H = 1, V = 2: logits (ln 3, 0), softmax (3/4, 1/4); label 0 -> loss ln(4/3)
    hidden = torch.tensor([[math.log(3.0)]], requires_grad=True)
    weight = torch.tensor([[1.0], [0.0]], requires_grad=True)
    loss = linear_lm_loss_sum(hidden, weight, torch.tensor([0]))
    assert loss.item() == pytest.approx(math.log(4 / 3), rel=1e-6)
    (2 * loss).backward()  # the upstream gradient scales both
    # dL/dz = softmax - onehot = (-1/4, 1/4); dL/dh = dz @ W = -1/4; dL/dW = dz^T h = (-ln3/4, ln3/4)
    assert hidden.grad.item() == pytest.approx(2 * -0.25, rel=1e-6)
    torch.testing.assert_close(weight.grad, 2 * torch.tensor([[-math.log(3) / 4], [math.log(3) / 4]]))


@pytest.mark.parametrize("chunk", [1, 3, 0])  # several chunks, a ragged last one, and the automatic size
def test_equals_logits_and_cross_entropy(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    labels = torch.randint(50, (10,), generator=g)
    upstream = 0.37

    loss = linear_lm_loss_sum(hidden, weight, labels, chunk=chunk)
    (upstream * loss).backward()
    got = loss.detach(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    expected = F.cross_entropy(hidden @ weight.T, labels, reduction="sum")
    (upstream * expected).backward()
    torch.testing.assert_close(got[0], expected.detach())
    torch.testing.assert_close(got[1], hidden.grad)
    torch.testing.assert_close(got[2], weight.grad)


def test_frozen_weight_and_no_grad():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, generator=g, requires_grad=True)
    weight = torch.randn(9, 4, generator=g)  # frozen head (LoRA): only the hidden states get a gradient
    labels = torch.randint(9, (6,), generator=g)
    linear_lm_loss_sum(hidden, weight, labels, chunk=4).backward()
    expected = torch.autograd.grad(F.cross_entropy(hidden @ weight.T, labels, reduction="sum"), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected)
    assert weight.grad is None
    with torch.no_grad():
        value = linear_lm_loss_sum(hidden, weight, labels)
    assert not value.requires_grad
    torch.testing.assert_close(value, F.cross_entropy(hidden @ weight.T, labels, reduction="sum").detach())
    with pytest.raises(ValueError, match="labels"):
        linear_lm_loss_sum(hidden, weight, labels[:3])


def test_bf16_matches_the_upcast_logits_loss():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(12, 16, generator=g).bfloat16()
    weight = torch.randn(40, 16, generator=g).bfloat16()
    labels = torch.randint(40, (12,), generator=g)
    expected = F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")
    assert linear_lm_loss_sum(hidden, weight, labels, chunk=5).item() == pytest.approx(expected.item(), rel=1e-5)


def _rows(tok, lengths, prompt=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, len(tok), (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return rows


@pytest.mark.parametrize("collate,fast_linear", [(collate_sft, False), (collate_packed, False), (collate_packed, True)])
def test_sft_forward_in_chunks_gives_the_logits_loss_and_gradients(tiny_model_dir, collate, fast_linear):
    """On a real (tiny, tied-embedding) Llama: the same summed NLL, token count and every parameter's gradient
    as the model's own logits, padded and packed, also with the linear layers on oneDNN (where it is faster)."""
    from rlhfkit.accel.cpu_linear import use_fast_cpu_linear
    from rlhfkit.models.forward import lm_head_weight
    from rlhfkit.models.stage_forward import lm_forward
    from rlhfkit.speed.checks import head_gives_logits, sft_packing_is_exact
    from rlhfkit.models.plan import ModelPlan

    tok = load_tokenizer(str(tiny_model_dir))
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok))
    if fast_linear:
        use_fast_cpu_linear(model)
    assert lm_head_weight(model) is model.lm_head.weight  # the head's own weight, also as a FastCPULinear
    rows = _rows(tok, (9, 4, 6, 3, 8))
    batch = collate(rows, tok.pad_token_id)

    def loss_and_grads(fused):
        model.zero_grad()
        nll, count = lm_forward(model, batch, torch.device("cpu"), ModelPlan(segment_attention=True, head_chunks=fused))
        nll.backward()
        return nll.detach(), count, {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, fused = loss_and_grads(False), loss_and_grads(True)
    assert fused[1] == plain[1] == sum(n - 2 for n in (9, 4, 6, 3, 8))
    torch.testing.assert_close(fused[0], plain[0], atol=1e-4, rtol=1e-5)
    assert fused[2].keys() == plain[2].keys()
    for name, expected in plain[2].items():  # sharpened weights: gradients up to ~250, float32 rounding ~1e-6 of that
        scale = float(expected.abs().max())
        torch.testing.assert_close(fused[2][name], expected, atol=1e-5 * scale, rtol=1e-4, msg=name)
    assert head_gives_logits(model)
    packed = ModelPlan(segment_attention=True, head_chunks=True, packing=True)
    assert sft_packing_is_exact(model, packed, rows, tok.pad_token_id, torch.device("cpu"))


def test_a_model_that_changes_its_logits_after_the_head_is_refused(tiny_model_dir):
    """A soft cap or scale after the LM head (Gemma 2, Cohere, Granite) is not in the decoder's output: the check
    sees the head's output differ from the model's own logits and SFT keeps the plain logits."""
    from rlhfkit.speed.checks import head_gives_logits

    tok = load_tokenizer(str(tiny_model_dir))
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok))
    assert head_gives_logits(model)
    plain_forward = model.forward

    def capped(**kw):
        out = plain_forward(**kw)
        out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out

    model.forward = capped
    assert not head_gives_logits(model)


def test_lora_model_trains_its_adapters_through_the_chunked_loss(tiny_model_dir):
    """Under LoRA the head is frozen: the adapters' gradients equal the plain logits' ones."""
    from rlhfkit.config.schema import LoraConfig
    from rlhfkit.lora import apply_lora
    from rlhfkit.models.stage_forward import lm_forward
    from rlhfkit.models.plan import ModelPlan

    tok = load_tokenizer(str(tiny_model_dir))
    model = apply_lora(sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok)), LoraConfig(rank=4))
    with torch.no_grad():  # non-zero B so the adapters are in the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = collate_packed(_rows(tok, (8, 5, 7)), tok.pad_token_id)
    grads = []
    for fused in (False, True):
        model.zero_grad()
        lm_forward(model, batch, torch.device("cpu"), ModelPlan(head_chunks=fused))[0].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name, expected in grads[0].items():
        torch.testing.assert_close(grads[1][name], expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-4,
                                   msg=name)
