"""Prompts once and their samples' responses in one packed forward (models/group_pack.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhfkit.engine.local import LocalEngine
from rlhfkit.models import group_pack
from rlhfkit.models.forward import final_hidden, position_ids
from rlhfkit.models.group_pack import GroupPacking, group_packed_hidden
from rlhfkit.models.prefix import shared_prefix_logits
from rlhfkit.speed.checks import group_packing_gives_prefix_values
from rlhfkit.models.plan import ModelPlan
from rlhfkit.speed.registry import Target, plan_model

GROUP_PACKED = ModelPlan(segment_attention=True, shared_prompt=True, group_packing=True)
TWO_FORWARDS = ModelPlan(segment_attention=True, shared_prompt=True)

from conftest import sharpened


def _llama(attention: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         attn_implementation=attention)
    return sharpened(LlamaForCausalLM(config), 3.0)


def _hand_batch():
    """2 prompts (3 tokens; 2 after left padding) x 2 rows each; responses of 3, 2, 3 and 1 valid tokens."""
    prompt_ids = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 8, 9], [0, 8, 9]])
    prompt_mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]])
    response_ids = torch.tensor([[11, 12, 13], [21, 22, 0], [31, 32, 33], [41, 0, 0]])
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    return prompt_ids, prompt_mask, response_ids, response_mask


def _hand_layout() -> GroupPacking:
    """`_hand_batch` as group_packed_hidden lays it out: the 2 prompts' real tokens, then each response but its last
    valid token."""
    _, _, response_ids, _ = _hand_batch()
    return GroupPacking([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], response_ids[:, :2],
                        torch.tensor([2, 1, 2, 0]), torch.tensor([0, 0, 1, 1]))


def test_the_packed_row_holds_each_prompt_once_then_each_response_but_its_last_token():
    """Hand-made layout: tokens, positions (a tail goes on from its prefix's real length), where each row's real
    tokens sit in the row, and what each tail token attends to."""
    layout = _hand_layout()
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9, 11, 12, 21, 31, 32]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1, 3, 4, 3, 2, 3]]
    assert layout.prompt_spans == [(0, 3), (3, 5)] and layout.tail_start.tolist() == [5, 7, 8, 10]
    # response token j of a row is predicted at its real token P - 1 + j: the prompt's last (2 or 4), then its own
    rows, tokens = torch.arange(4)[:, None], torch.tensor([[2, 3, 4], [2, 3, 2], [1, 2, 3], [1, 1, 1]])
    assert layout.position(rows, tokens).tolist() == [[2, 5, 6], [2, 7, 2], [4, 8, 9], [4, 4, 4]]
    assert layout.width == 2 and layout.slots.tolist() == [[True, True], [True, False], [True, True],
                                                            [False, False]]
    keys = layout.keys.view(4, 5).tolist()  # the prompt left-padded to 3, then the row's own 2 slots
    allowed = layout.allowed[:, 0].int().tolist()
    assert keys[0] == [0, 1, 2, 5, 6] and allowed[0] == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert keys[2][1:4] == [3, 4, 8] and allowed[2] == [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert allowed[1] == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]  # its one real token: no key past it


def _batch(interleaved: bool = False, distinct: bool = False):
    """3 prompts of 3, 5 and 7 tokens, left-padded, 3 rows each (blocks, interleaved, or every row its own prompt);
    responses of 5 tokens, some cut short by EOS."""
    torch.manual_seed(1)
    prompts = [[5 + i + 7 * p for i in range(3 + 2 * p)] for p in range(3)]
    rows = [prompts[j % 3] if interleaved else prompts[j // 3] for j in range(9)]
    if distinct:
        rows = [r[:-1] + [60 + j] for j, r in enumerate(rows)]
    width = max(len(r) for r in rows)
    prompt_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    prompt_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    response_ids = torch.randint(3, 96, (9, 5))
    response_mask = torch.ones(9, 5, dtype=torch.long)
    for j, n in ((1, 2), (4, 1), (5, 4), (8, 3)):
        response_mask[j, n:] = 0
        response_ids[j, n:] = 0
    return prompt_ids, prompt_mask, response_ids, response_mask


def _full_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """The plain forward over prompt + response: hidden states predicting each response token."""
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    width = response_ids.size(1)
    return final_hidden(model, ids, mask, position_ids(mask))[:, -(width + 1):-1]


@pytest.mark.parametrize("rows", ["blocks", "interleaved", "distinct"])
def test_packed_hidden_states_and_gradients_equal_the_plain_forward(rows, monkeypatch):
    """With group packing in its plan, a GQA Llama's `shared_prefix_logits(hidden=True)` takes the packed row (one
    forward: the two-forward path would call the model twice) and gives the plain forward's hidden states at every
    valid position, and the same parameter gradients, for groups in blocks, interleaved, and rows that share
    nothing."""
    model = _llama().train()
    batch = _batch(interleaved=rows == "interleaved", distinct=rows == "distinct")
    valid = batch[3].bool()
    weights = torch.randn(*valid.shape, 64)

    def run(fn):
        model.zero_grad(set_to_none=True)
        hidden = fn()
        (hidden * weights)[valid].sum().backward()
        return hidden.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]

    expected, expected_grads = run(lambda: _full_hidden(model, *batch))
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        got, grads = run(lambda: shared_prefix_logits(model, *batch, GROUP_PACKED, always=True, hidden=True))
    finally:
        handle.remove()
    assert len(calls) == 1
    torch.testing.assert_close(got[valid], expected[valid], atol=2e-5, rtol=1e-4)
    for g, e in zip(grads, expected_grads):  # float rounding of sums in another order, relative to the tensor's size
        assert float((g - e).norm()) <= 1e-5 * float(e.norm()) + 1e-7


def test_single_token_responses_and_gradient_checkpointing():
    """Responses of one token: the row holds the prompts only and each response is predicted at its prompt's last
    token. A model training with gradient checkpointing does not take the packed row (two forwards)."""
    model = _llama().eval()
    prompt_ids, prompt_mask, response_ids, response_mask = _batch()
    response_ids, response_mask = response_ids[:, :1], response_mask[:, :1]
    first, inverse = torch.tensor([0, 3, 6]), torch.arange(3).repeat_interleave(3)
    with torch.no_grad():
        got = group_packed_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, first, inverse)
        expected = _full_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert group_pack.group_packing(model, GROUP_PACKED)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    assert not group_pack.group_packing(model, GROUP_PACKED)
    model.eval()
    assert group_pack.group_packing(model, GROUP_PACKED)  # no recomputation without training mode


def test_the_check_accepts_sdpa_llama_and_refuses_what_it_cannot_run():
    """group_packing_gives_prefix_values: True for an sdpa Llama; False where attention is not per sequence (eager);
    the attention refuses options it does not apply and a forward without its layout; the speed plan takes the
    verdict, or the setting."""
    model = _llama()
    assert group_packing_gives_prefix_values(model, GROUP_PACKED) is True
    assert group_packing_gives_prefix_values(_llama("eager"), ModelPlan(group_packing=True)) is False
    layout = _hand_layout()
    q = k = v = torch.randn(1, 2, 10, 8)
    with pytest.raises(NotImplementedError, match="softcap"):  # an option it does not apply: the check says False
        group_pack.group_packed_attention(None, q, k, v, None, rlhfkit_group_packing=layout, softcap=30.0)
    with pytest.raises(RuntimeError):  # a forward without the layout (a model that drops the keyword)
        group_pack.group_packed_attention(None, q, k, v, None)
    from rlhfkit.config.ppo_schema import PPOConfig

    cfg = lambda packing: dataclasses.replace(PPOConfig(), ppo=dataclasses.replace(PPOConfig().ppo,  # noqa: E731
                                                                                   packing=packing))
    engine = LocalEngine()
    critic = lambda m, packing: plan_model(Target(m, "critic", "ppo", cfg(packing), engine))  # noqa: E731
    assert critic(model, None).group_packing and not critic(model, False).group_packing
    assert dict(critic(model, False).off)["group_packing"] == "ppo.packing=false"
    assert not critic(_llama("eager"), None).group_packing


def test_rows_that_do_not_fit_the_packed_row_are_refused():
    """A response mask with a hole, or an empty prompt: None (the caller takes the two forwards)."""
    model = _llama().eval()
    prompt_ids, prompt_mask, response_ids, response_mask = _hand_batch()
    first, inverse = torch.tensor([0, 2]), torch.tensor([0, 0, 1, 1])
    holed = response_mask.clone()
    holed[0, 1] = 0
    assert group_packed_hidden(model, prompt_ids, prompt_mask, response_ids, holed, first, inverse) is None
    empty = prompt_mask.clone()
    empty[2:] = 0
    assert group_packed_hidden(model, prompt_ids, empty, response_ids, response_mask, first, inverse) is None


def test_a_lora_actor_and_its_adapter_off_reference_take_the_packed_row():
    """Under LoRA (peft's wrapper around the model) the packed row gives the plain forward's hidden states and LoRA
    gradients, and with the adapter switched off (the reference) the base model's."""
    from rlhfkit.config.schema import LoraConfig
    from rlhfkit.lora import adapter_disabled, apply_lora

    model = apply_lora(_llama(), LoraConfig(rank=4)).train()
    with torch.no_grad():  # peft starts B at zero: give the adapters an effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    assert group_packing_gives_prefix_values(model, GROUP_PACKED) is True
    batch = _batch()
    valid = batch[3].bool()
    weights = torch.randn(*valid.shape, 64)
    trained = [p for p in model.parameters() if p.requires_grad]

    def run(fn):
        model.zero_grad(set_to_none=True)
        hidden = fn()
        (hidden * weights)[valid].sum().backward()
        return hidden.detach(), [p.grad.clone() for p in trained]

    expected, expected_grads = run(lambda: _full_hidden(model, *batch))
    got, grads = run(lambda: shared_prefix_logits(model, *batch, GROUP_PACKED, always=True, hidden=True))
    with torch.no_grad(), adapter_disabled(model):
        base = shared_prefix_logits(model, *batch, GROUP_PACKED, always=True, hidden=True)
    torch.testing.assert_close(got[valid], expected[valid], atol=2e-5, rtol=1e-4)
    for g, e in zip(grads, expected_grads):
        assert float((g - e).norm()) <= 1e-5 * float(e.norm()) + 1e-7
    with torch.no_grad(), adapter_disabled(model):
        plain = _full_hidden(model, *batch)
    torch.testing.assert_close(base[valid], plain[valid], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(base[valid], got[valid], atol=1e-3)  # the adapters do change the values
