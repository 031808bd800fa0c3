"""Padding-free forwards over padded rollout rows (`forward.pack_padded`, `packed_outputs`): the packing by hand,
and the response log-probs, critic values and reward scores of the PPO loops, values and gradients, against the
padded forward's; the one-off check that decides them (`speed.checks.packing_gives_padded_values`)."""

import pytest
import torch
from transformers import LlamaForSequenceClassification

from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.models.forward import pack_padded, read_packed, sequence_scores
from rlhfkit.lora import base_model
from rlhfkit.models.segments import SPANS
from rlhfkit.rollout.experience import response_logprobs_and_entropy, response_values
from rlhfkit.speed.checks import packing_gives_padded_values
from rlhfkit.models.plan import ModelPlan

PACKED = ModelPlan(segment_attention=True, padding_free=True)  # padding-free forwards, attention per sequence

from conftest import sharpened
from test_chunked_logprobs import _batch


def test_pack_padded_by_hand():
    ids = torch.tensor([[0, 0, 5, 6, 7],    # left padding: 3 tokens
                        [8, 9, 0, 0, 0],    # right padding: 2 tokens
                        [0, 0, 0, 0, 0],    # no tokens: left out
                        [1, 2, 3, 4, 11]])  # 5 tokens
    mask = (ids != 0).long()
    packed, positions, where = pack_padded(ids, mask, capacity=None)  # bins as long as the longest row (5)
    # first fit by decreasing length: [row 3], [row 0 (3), row 1 (2)]
    assert packed.tolist() == [[1, 2, 3, 4, 11], [5, 6, 7, 8, 9]]
    assert positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert where.tolist() == [[-1, -1, 5, 6, 7], [8, 9, -1, -1, -1], [-1] * 5, [0, 1, 2, 3, 4]]
    # a longer bin takes every row; its unused tail is a segment of its own, positions from 0
    packed, positions, where = pack_padded(ids, mask, capacity=12)
    assert packed.tolist() == [[1, 2, 3, 4, 11, 5, 6, 7, 8, 9]]
    assert positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    packed, positions, _ = pack_padded(ids[:2], mask[:2], capacity=None)
    assert packed.tolist() == [[5, 6, 7], [8, 9, 0]] and positions.tolist() == [[0, 1, 2], [0, 1, 0]]
    flat = torch.arange(10.0)[:, None].expand(10, 2)  # read back into the padded layout, zeros on padding
    assert read_packed(flat, where[:1])[..., 0].tolist() == [[0, 0, 5, 6, 7]]


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys() and expected
    for name, value in expected.items():  # sharpened weights: large gradients, float32 rounding relative to them
        torch.testing.assert_close(got[name], value, atol=1e-5 * float(value.abs().max()), rtol=1e-4, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_response_logprobs_padding_free_equal_the_padded_forward(tiny_model_dir, checkpointing):
    """Log-probs (LM head in chunks), entropies and every gradient, with rows of different prompt lengths and a
    response cut short: per-sequence attention, or under gradient checkpointing transformers' packed mask."""
    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok))
    batch = _batch(tok, model.eval(), groups=False)
    assert (batch.prompt_mask == 0).any() and (batch.response_mask == 0).any()  # padding on both sides
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    valid = batch.response_mask.bool()
    upstream = torch.randn(valid.shape, generator=torch.Generator().manual_seed(3))

    def run(packing: bool):
        plan = ModelPlan(head_chunks=True, segment_attention=packing, padding_free=packing)
        model.zero_grad(set_to_none=True)
        logp, ent = response_logprobs_and_entropy(model, batch, plan, temperature=0.7)
        torch.where(valid, logp * upstream, 0).sum().backward()
        return logp.detach(), ent, _grads(model)

    padded, packed = run(False), run(True)
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1][valid], padded[1][valid], atol=1e-5, rtol=1e-5)
    _assert_grads_close(packed[2], padded[2])


def _scalar_model(seed: int = 0):
    from transformers import LlamaConfig
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=112, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
                         attn_implementation="sdpa")
    return sharpened(LlamaForSequenceClassification(config), 3.0)


def test_critic_values_and_reward_scores_padding_free_equal_the_padded_forward():
    from rlhfkit.rollout import RolloutBatch

    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float)
    batch = RolloutBatch(prompt_ids=torch.randint(1, 97, (3, 5), generator=g) * prompt_mask, prompt_mask=prompt_mask,
                         response_ids=torch.randint(1, 97, (3, 4), generator=g) * response_mask.long(),
                         response_mask=response_mask, prompt_texts=[""] * 3, response_texts=[""] * 3)
    critic = _scalar_model().train()
    valid = response_mask.bool()
    upstream = torch.randn(valid.shape, generator=g)

    def run(packing: bool):
        plan = PACKED if packing else ModelPlan()
        critic.zero_grad(set_to_none=True)
        values = response_values(critic, batch, plan)
        torch.where(valid, values * upstream, 0).sum().backward()
        with torch.no_grad():
            scores = sequence_scores(critic, batch.input_ids, batch.attention_mask, plan)
        return values.detach(), scores, _grads(critic)

    padded, packed = run(False), run(True)
    real = batch.attention_mask[:, batch.prompt_width - 1:-1].bool()  # the states that are real tokens
    assert (valid & ~real).sum() == 0 and (real & ~valid).any()
    torch.testing.assert_close(packed[0][real], padded[0][real], atol=1e-5, rtol=1e-5)
    assert torch.equal(packed[0][~real], torch.zeros(int((~real).sum())))  # padding states: 0
    torch.testing.assert_close(packed[1], padded[1], atol=1e-5, rtol=1e-5)
    _assert_grads_close(packed[2], padded[2])


def test_the_check_passes_plain_models_and_refuses_one_that_ignores_packed_positions(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok)).train()
    assert packing_gives_padded_values(model, PACKED)
    assert packing_gives_padded_values(_scalar_model(), PACKED)
    inner = base_model(model).model
    plain_forward = inner.forward

    def positions_ignored(*args, **kwargs):  # a model numbering positions its own way (0..T-1 along the row) that
        kwargs["position_ids"] = None     # does not pass the call's keyword arguments (the spans) on to its attention
        kwargs.pop(SPANS, None)
        return plain_forward(*args, **kwargs)

    inner.forward = positions_ignored
    assert not packing_gives_padded_values(model, PACKED)
    assert model.training  # the check restores the mode
