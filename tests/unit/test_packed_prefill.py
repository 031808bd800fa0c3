"""The rollout's padding-free prefill (rollout.generate._packed_prefill, the speed plan's `packed_prefill`):
left-padded prompts go through the model packed, and the KV cache they leave is the padded prefill's."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rlhfkit.models.segments as segments
import rlhfkit.rollout.generate as generate
from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.models.forward import pack_padded, unpack_states
from rlhfkit.speed.checks import group_decode_is_exact, packed_prefill_is_exact
from rlhfkit.models.plan import REFERENCE, ModelPlan

PACKED = ModelPlan(segment_attention=True, packed_prefill=True)

from conftest import sharpened


def _llama(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         attn_implementation=attn)
    return sharpened(LlamaForCausalLM(config).eval(), 3.0)


def _prompts(lengths: list[int], group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of the given lengths (distinct ids), `group` consecutive rows of each."""
    rows = [[5 + i + 11 * p for i in range(n)] for p, n in enumerate(lengths) for _ in range(group)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_unpack_states_puts_packed_keys_back_into_the_left_padded_layout():
    """By hand: rows of 2 and 3 real tokens (width 3, left-padded) packed into one row of 5, or into bins of 3;
    each real token's (heads, D) slice goes back to its padded column, the padding gets zeros."""
    ids = torch.tensor([[0, 7, 8], [4, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    for capacity, width in ((None, 3), (4096, 5)):
        packed_ids, _, where = pack_padded(ids, mask, capacity)
        assert packed_ids.size(1) == width
        # keys (N, heads=2, W, D=1) whose value at a packed token is its id, and -id on the second head
        states = torch.stack([packed_ids, -packed_ids], dim=1)[..., None].float()
        out = unpack_states(states, where)
        assert out.shape == (2, 2, 3, 1)
        expected = (ids * mask).float()
        assert torch.equal(out[:, 0, :, 0], expected) and torch.equal(out[:, 1, :, 0], -expected)


def _prefill(model, ids, mask, packed: bool):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return generate.prefill(model, ids, mask, positions, ids.size(1) + 4, PACKED if packed else REFERENCE)


@pytest.mark.parametrize("row_tokens", [4096, 9])  # one packed row; bins of at most 9 tokens (several rows)
def test_packed_prefill_leaves_the_padded_prefills_cache_and_logits(row_tokens, monkeypatch):
    """Every layer's keys and values at the prompts' real positions and the last tokens' logits equal the
    padded prefill's; the padding's slots hold zeros (the decode steps' mask hides them either way)."""
    monkeypatch.setattr(segments, "ROW_TOKENS", row_tokens)
    model = _llama()
    ids, mask = _prompts([3, 7, 1, 5])
    calls = []
    real_packed = generate._packed_prefill
    monkeypatch.setattr(generate, "_packed_prefill", lambda *a: calls.append(a) or real_packed(*a))
    plain_cache, plain_logits, _, _ = _prefill(model, ids, mask, packed=False)
    assert not calls
    cache, logits, groups, _ = _prefill(model, ids, mask, packed=True)
    assert len(calls) == 1 and groups is None
    torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=1e-5)
    real = mask.bool()[:, None, :, None]  # (B, 1, P, 1) over (B, heads, P, D)
    for layer, plain in zip(cache.layers, plain_cache.layers):
        assert layer.keys.shape == plain.keys.shape == (4, 2, 7, 16) and layer.length == 7
        for mine, theirs in ((layer.keys, plain.keys), (layer.values, plain.values)):
            torch.testing.assert_close(mine * real, theirs * real, atol=1e-5, rtol=1e-5)
            assert not mine.masked_select(~real.expand_as(mine)).any()
        assert layer.packed_where is None


def _sample(model, ids, mask, packed: bool, greedy: bool):
    # each distinct prompt once and decoded in groups (as a PPO actor's plan has them), prefilled packed or not
    plan = ModelPlan(segment_attention=True, packed_prefill=packed, shared_prompt=True, group_decode=True)
    torch.manual_seed(0)
    with torch.no_grad():
        return generate.sample_tokens(model, ids, mask, GenConfig(max_new_tokens=6, min_new_tokens=6), [2], 0, plan,
                                      greedy=greedy)


@pytest.mark.parametrize("group", [1, 3])  # distinct prompts (plain cache); 3 samples per prompt (group decode)
def test_sampling_after_a_packed_prefill_draws_what_the_padded_prefill_draws(group, monkeypatch):
    """A plan with the packed prefill prefills packed: the same tokens, greedy and sampled from the same random
    numbers, with the same log-probs, as the padded prefill; with groups too."""
    model = _llama()
    ids, mask = _prompts([4, 1, 6], group)
    calls = []
    real_packed = generate._packed_prefill
    monkeypatch.setattr(generate, "_packed_prefill", lambda *a: calls.append(a[1].shape) or real_packed(*a))
    for greedy in (True, False):
        tokens, logprobs = _sample(model, ids, mask, True, greedy)
        assert calls[-1] == (3, 6)  # the three distinct prompts, packed
        calls.clear()
        plain_tokens, plain_logprobs = _sample(model, ids, mask, False, greedy)
        assert not calls
        assert torch.equal(tokens, plain_tokens)
        torch.testing.assert_close(logprobs, plain_logprobs, atol=1e-5, rtol=1e-5)


def test_the_check_refuses_attention_that_does_not_run_per_packed_sequence(monkeypatch):
    """packed_prefill_is_exact: True for a Llama with sdpa, also one that trains with gradient checkpointing (the
    prefill runs without autograd); False without attention per sequence (eager: none) and where the attention
    ignores the call's spans (it would attend from one prompt into another: the values differ)."""
    assert packed_prefill_is_exact(_llama(), PACKED) is True
    checkpointed = _llama()
    checkpointed.gradient_checkpointing_enable()
    checkpointed.train()
    assert packed_prefill_is_exact(checkpointed, PACKED) is True and checkpointed.training
    assert packed_prefill_is_exact(_llama("eager"), PACKED) is False
    assert packed_prefill_is_exact(_llama(), ModelPlan(packed_prefill=True)) is False  # no per-sequence attention
    ignoring = _llama()
    for layer in ignoring.model.layers:  # an attention that drops the call's keyword arguments (the spans)
        forward = layer.self_attn.forward
        layer.self_attn.forward = lambda *a, _f=forward, **k: _f(*a, **{n: v for n, v in k.items()
                                                                       if n != segments.SPANS})
    assert packed_prefill_is_exact(ignoring, PACKED) is False


def test_both_exactness_checks_pass_under_bf16_autocast_over_float32_weights():
    """engine.precision=bf16 on the local engine runs the rollout (and these checks in it) under bf16 autocast
    with float32 weights: the checks allow bf16's rounding there, as for bf16 weights, rather than demanding
    float32's 1e-4 and turning the packed prefill and the group decode off under bf16."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed_prefill_is_exact(_llama(), PACKED) is True
        assert group_decode_is_exact(_llama()) is True
