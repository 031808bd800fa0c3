"""Decoding G samples per prompt with each prompt's KV cache held once (rollout.group_decode)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import rlhfkit.rollout.generate as generate
from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.rollout.group_decode import GroupCache, GroupCacheLayer, group_attention
from rlhfkit.speed.checks import group_decode_is_exact
from rlhfkit.models.plan import ModelPlan

from conftest import sharpened


def test_group_attention_equals_attention_over_every_rows_copy_of_the_cache():
    """Prompt part once per group, response part per row, merged by log-sum-exp = softmax attention over the
    concatenated [prompt, response] keys of every row (GQA: 4 query heads on 2 key/value heads; one prompt
    left-padded)."""
    torch.manual_seed(0)
    prompts, group, heads, kv_heads, prompt_len, dim, steps = 3, 4, 4, 2, 7, 8, 5
    rows = prompts * group
    layer = GroupCacheLayer(capacity=steps)
    prompt_k, prompt_v = (torch.randn(prompts, kv_heads, prompt_len, dim) for _ in range(2))
    layer.update(prompt_k, prompt_v)
    mask = torch.ones(prompts, prompt_len, dtype=torch.long)
    mask[1, :3] = 0  # left padding of prompt 1
    groups = GroupCache(types.SimpleNamespace(layers=[layer]), mask, group)
    module = types.SimpleNamespace(layer_idx=0)
    response_k, response_v = torch.randn(rows, kv_heads, steps, dim), torch.randn(rows, kv_heads, steps, dim)
    for t in range(steps):
        key, value = layer.update(response_k[:, :, t:t + 1], response_v[:, :, t:t + 1])
        assert layer.get_seq_length() == prompt_len + t + 1
        query = torch.randn(rows, heads, 1, dim)
        out, _ = group_attention(module, query, key, value, None, scaling=0.3, rlhfkit_groups=groups)
        # reference: every row's own copy of its prompt's cache, then plain attention
        full_k = torch.cat([prompt_k.repeat_interleave(group, 0), response_k[:, :, :t + 1]], dim=2)
        full_v = torch.cat([prompt_v.repeat_interleave(group, 0), response_v[:, :, :t + 1]], dim=2)
        allowed = torch.cat([mask.repeat_interleave(group, 0), torch.ones(rows, t + 1, dtype=torch.long)], 1).bool()
        expected = F.scaled_dot_product_attention(query, full_k.repeat_interleave(2, 1), full_v.repeat_interleave(2, 1),
                                                  attn_mask=allowed[:, None, None, :], scale=0.3)
        torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError):  # a prefill-shaped call is not a decode step
        group_attention(module, torch.randn(rows, heads, 2, dim), key, value, None, rlhfkit_groups=groups)
    with pytest.raises(NotImplementedError, match="softcap"):
        group_attention(module, query, key, value, None, rlhfkit_groups=groups, softcap=30.0)


def _gqa_llama(vocab: int = 320) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return sharpened(LlamaForCausalLM(config).eval(), 3.0)


def _rows(n_prompts: int, group: int, interleaved: bool = False):
    """Left-padded prompts of different lengths, `group` rows of each (consecutive, or interleaved)."""
    prompts = [[5 + i + 7 * p for i in range(3 + 2 * p)] for p in range(n_prompts)]
    rows = [p for _ in range(group) for p in prompts] if interleaved else [p for p in prompts for _ in range(group)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _sample(model, ids, mask, grouped_ok: bool, greedy: bool = False):
    plan = ModelPlan(shared_prompt=True, group_decode=grouped_ok)  # the plain path where the plan says no
    torch.manual_seed(0)
    with torch.no_grad():
        return generate.sample_tokens(model, ids, mask, GenConfig(max_new_tokens=8, min_new_tokens=8), [2], 0, plan,
                                      greedy=greedy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_in_groups_draws_what_every_rows_copy_of_the_cache_draws(dtype, monkeypatch):
    """Blocks of G samples per prompt decode with each prompt's cache held once (U rows in the cache, not B)
    and give the plain path's tokens and log-probs; interleaved rows decode the plain way, with the same
    result."""
    model = _gqa_llama().to(dtype)
    ids, mask = _rows(3, 4)
    seen = []
    real_prefill = generate.prefill
    monkeypatch.setattr(generate, "prefill", lambda *a, **k: seen.append(real_prefill(*a, **k)) or seen[-1])
    tokens, logprobs = _sample(model, ids, mask, True)
    cache, _, groups, _ = seen[-1]
    assert groups is not None and groups.group == 4
    assert cache.layers[0].prompt_keys_t.shape[:2] == (3, 2)  # 3 prompts x 2 key/value heads, held once
    assert cache.layers[0].key_buffer.shape[:3] == (3, 2, 4)  # 4 rows' own responses per prompt and head
    plain_tokens, plain_logprobs = _sample(model, ids, mask, False)
    assert seen[-1][2] is None
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    if dtype == torch.float32:  # bf16 rounding may draw another token from the same point
        assert torch.equal(tokens, plain_tokens)
        torch.testing.assert_close(logprobs, plain_logprobs, atol=tolerance, rtol=tolerance)
    greedy, greedy_logprobs = _sample(model, ids, mask, True, greedy=True)
    plain_greedy, plain_greedy_logprobs = _sample(model, ids, mask, False, greedy=True)
    assert torch.equal(greedy, plain_greedy)
    torch.testing.assert_close(greedy_logprobs, plain_greedy_logprobs, atol=tolerance, rtol=tolerance)
    # interleaved rows (prompt 0, 1, 2, 0, 1, 2, ...): no blocks, the plain path, the same draws as it
    ids_i, mask_i = _rows(3, 4, interleaved=True)
    tokens_i, _ = _sample(model, ids_i, mask_i, True, greedy=True)
    assert seen[-1][2] is None
    order = torch.arange(12).view(3, 4).t().flatten()  # interleaved row j holds prompt j % 3
    assert torch.equal(tokens_i, greedy[order])


def test_the_check_accepts_llama_and_gpt2_and_refuses_attention_it_does_not_apply():
    """group_decode_is_exact: True for Llama (GQA) and GPT-2 (learned positions); False for Gemma 2 with attention
    logit soft-capping, which group_attention does not apply."""
    llama = _gqa_llama()
    assert group_decode_is_exact(llama) is True
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                                      eos_token_id=2)).eval()
    assert group_decode_is_exact(gpt2) is True

    def gemma(softcap):
        torch.manual_seed(0)
        config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              layer_types=["full_attention"] * 2, sliding_window=512, attn_logit_softcapping=softcap,
                              final_logit_softcapping=None, attn_implementation="eager")
        return Gemma2ForCausalLM(config).eval()

    assert group_decode_is_exact(gemma(None)) is True
    assert group_decode_is_exact(gemma(5.0)) is False


def test_contiguous_groups_finds_blocks_of_rows_with_one_prompt():
    """The largest G >= 2 with every block of G consecutive rows on one prompt; 0 otherwise."""
    from rlhfkit.models.prefix import contiguous_groups

    cases = {(7, 7, 2, 2, 5, 5): 2, (3, 3, 3, 3): 4, (0, 0, 1, 1, 0, 0): 2,  # a prompt repeated in two blocks
             (0, 0, 0, 0, 1, 1): 2, (0, 0, 0, 1, 1, 1): 3, (7, 2, 7, 2): 0, (0, 1, 2): 0, (0, 0, 0, 1): 0}
    for inverse, group in cases.items():
        assert contiguous_groups(torch.tensor(inverse)) == group, inverse


def test_a_prompt_repeated_in_two_blocks_decodes_in_groups_with_the_same_draws(monkeypatch):
    """Rows [p0 x 2, p1 x 2, p0 x 2]: three blocks of 2 (p0's computed twice), the plain path's tokens."""
    model = _gqa_llama()
    ids, mask = _rows(2, 2)
    ids, mask = torch.cat([ids, ids[:2]]), torch.cat([mask, mask[:2]])
    seen = []
    real_prefill = generate.prefill
    monkeypatch.setattr(generate, "prefill", lambda *a, **k: seen.append(real_prefill(*a, **k)) or seen[-1])
    tokens, logprobs = _sample(model, ids, mask, True, greedy=True)
    assert seen[-1][2] is not None and seen[-1][2].group == 2
    plain, plain_logprobs = _sample(model, ids, mask, False, greedy=True)
    assert torch.equal(tokens, plain) and torch.equal(tokens[:2], tokens[4:])
    torch.testing.assert_close(logprobs, plain_logprobs, atol=1e-5, rtol=1e-5)
