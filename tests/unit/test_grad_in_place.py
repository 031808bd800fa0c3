"""Vocabulary-matrix gradients added into the kept `.grad` in place (`accel/grad_in_place.py`): autograd's sums,
the padding row, which matrices take it, when the speed plan has it, and the local engine's training with it."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhfkit.algos import linear_token_logprobs
from rlhfkit.config.schema import TrainConfig
from rlhfkit.engine.local import LocalEngine
from rlhfkit.accel import grad_in_place


@pytest.fixture
def small_threshold(monkeypatch):
    """Tiny models' vocabulary matrices count as big (the real threshold is SmolLM2-sized)."""
    monkeypatch.setattr(grad_in_place, "MIN_ELEMENTS", 300 * 32)


def tiny(tied=True):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=0)
    return LlamaForCausalLM(cfg)


IDS = torch.tensor([[0, 0, 0, 5, 9, 5, 7, 11], [3, 5, 5, 5, 250, 299, 1, 2]])  # repeated tokens and padding (0)
WEIGHTS = torch.linspace(-1.0, 1.0, IDS[:, 1:].numel())


def loss(model, in_place: bool = True):
    """A PPO-like objective through the fused head: weighted log-probs of the next tokens (the head's gradient
    added in place where `in_place`, as the callers do where the model's plan has `grad_in_place`)."""
    hidden = model.model(input_ids=IDS).last_hidden_state[:, :-1].reshape(-1, 32)
    logp, _ = linear_token_logprobs(hidden, model.lm_head.weight, IDS[:, 1:].reshape(-1),
                                    grad_target=grad_in_place.target if in_place else None)
    return (logp * WEIGHTS).sum()


@pytest.mark.parametrize("tied", [True, False])
def test_accumulating_in_place_gives_autograds_gradients(small_threshold, tied):
    plain = tiny(tied)
    in_place = copy.deepcopy(plain)
    for model in (plain, in_place):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # kept gradients, as `keep_grads` allocates them
    tagged = grad_in_place.enable(in_place)
    assert tagged == (1 if tied else 2)  # the embedding (and the untied head); nothing else is that big
    assert type(in_place.model.embed_tokens) is grad_in_place.InPlaceEmbedding
    delivered = []  # what autograd hands the embedding: no gradient when it went into .grad directly
    in_place.model.embed_tokens.weight.register_hook(lambda g: delivered.append(g))
    grad_tensor = in_place.model.embed_tokens.weight.grad
    for _ in range(2):  # two micro-batches accumulate
        loss(plain, in_place=False).backward()
        loss(in_place).backward()
    assert delivered and all(g is None for g in delivered)  # autograd calls the hook with no gradient
    assert in_place.model.embed_tokens.weight.grad is grad_tensor
    for (name, p), q in zip(plain.named_parameters(), in_place.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6 * float(p.grad.abs().max()), msg=name)
    if not tied:  # nn.Embedding gives its padding row no gradient; nor does the in-place backward
        assert not in_place.model.embed_tokens.weight.grad[0].any()
        assert in_place.model.embed_tokens.weight.grad[5].any()


def test_hand_computed_embedding_gradient(small_threshold):
    weight = torch.nn.Parameter(torch.zeros(400, 24))
    weight.grad = torch.full((400, 24), 0.5)  # what earlier micro-batches left
    embedding = torch.nn.Embedding(400, 24, padding_idx=3)
    embedding.weight = weight
    grad_in_place.enable(embedding)
    ids = torch.tensor([[7, 3, 7], [1, 7, 3]])
    out = embedding(ids)
    upstream = torch.arange(6, dtype=torch.float32).reshape(2, 3, 1).expand(2, 3, 24)
    (out * upstream).sum().backward()
    expected = torch.full((400, 24), 0.5)
    expected[7] += 0 + 2 + 4  # row 7 is used at positions 0, 2 and 4
    expected[1] += 3
    assert torch.equal(weight.grad, expected)  # row 3 (padding) gets nothing


def test_only_big_trainable_float32_matrices_take_it(small_threshold):
    model = tiny(tied=False)
    model.lm_head.weight.requires_grad_(False)
    assert grad_in_place.enable(model) == 1  # the embedding: the frozen head and the small matrices are not
    assert grad_in_place.target(model.model.embed_tokens.weight) is None  # no kept .grad yet: autograd's way
    model.model.embed_tokens.weight.grad = torch.zeros_like(model.model.embed_tokens.weight)
    assert grad_in_place.target(model.model.embed_tokens.weight) is model.model.embed_tokens.weight.grad
    assert grad_in_place.target(model.lm_head.weight) is None
    assert grad_in_place.target(model.model.layers[0].mlp.up_proj.weight) is None
    before = model.model.embed_tokens.weight.grad.clone()
    with torch.no_grad():  # a forward without autograd is a plain lookup
        model(input_ids=IDS)
    assert torch.equal(model.model.embed_tokens.weight.grad, before)


def test_a_model_without_kept_gradients_uses_autograds_accumulation(small_threshold):
    model = tiny()
    grad_in_place.enable(model)  # switched, but no .grad kept: the first backward creates it as autograd does
    reference = copy.deepcopy(model)
    loss(model).backward()
    loss(reference, in_place=False).backward()
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad)


@pytest.mark.parametrize("keep_grads", [True, False])
def test_the_speed_plan_switches_it_on_with_kept_gradients(small_threshold, keep_grads):
    from rlhfkit.speed.registry import Target, plan_model

    train = TrainConfig(lr=1e-3, warmup_steps=0, max_grad_norm=1.0)
    engine = LocalEngine()
    model = engine.prepare(tiny(), train, total_steps=4, keep_grads=keep_grads).module
    plan = plan_model(Target(model, "policy", "sft", None, engine, keep_grads=keep_grads))
    assert plan.grad_in_place == keep_grads
    assert (type(model.model.embed_tokens) is grad_in_place.InPlaceEmbedding) == keep_grads
    assert keep_grads or dict(plan.off)["grad_in_place"] == "gradients freed between steps"


def test_training_with_it_follows_autograds_updates(small_threshold):
    train = TrainConfig(lr=1e-2, warmup_steps=0, max_grad_norm=1.0)
    plain = LocalEngine().prepare(tiny(), train, total_steps=4)
    in_place = LocalEngine().prepare(tiny(), train, total_steps=4, keep_grads=True)
    grad_in_place.enable(in_place.module)  # as `accel.install` does for a plan with it
    assert type(in_place.module.model.embed_tokens) is grad_in_place.InPlaceEmbedding
    for _ in range(3):
        for trainable in (plain, in_place):
            trainable.backward(loss(trainable.module, trainable is in_place), 2.0)
            trainable.backward(loss(trainable.module, trainable is in_place), 2.0)
            trainable.step()
    moved = (in_place.module.model.embed_tokens.weight - tiny().model.embed_tokens.weight).abs().max()
    assert moved > 1e-3
    for (name, p), q in zip(plain.module.named_parameters(), in_place.module.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=name)


def test_a_gradient_dropped_between_forward_and_backward_goes_back_to_autograd(small_threshold):
    model, reference = tiny(tied=False), tiny(tied=False)
    weight = model.model.embed_tokens.weight
    weight.grad = torch.zeros_like(weight)
    grad_in_place.enable(model)
    out = model.model.embed_tokens(IDS)  # recorded for in-place accumulation
    weight.grad = None  # e.g. zero_grad(set_to_none=True) in between: the backward hands autograd the gradient
    (out * 2.0).sum().backward()
    (reference.model.embed_tokens(IDS) * 2.0).sum().backward()
    assert torch.equal(weight.grad, reference.model.embed_tokens.weight.grad)
