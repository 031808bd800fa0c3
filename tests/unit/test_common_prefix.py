"""The tokens every rollout row begins with, computed once (`prefix.common_prefix_outputs`): the span by hand, and
the response log-probs, entropies, critic values and every gradient against the plain forward's, with rows that
start at different columns (left padding) and responses cut short; when it declines; the one-off check."""

import pytest
import torch

from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.models.group_pack import group_packing
from rlhfkit.models.prefix import MIN_COMMON_PREFIX, common_prefix_outputs, common_prefix_span
from rlhfkit.lora import base_model
from rlhfkit.rollout import RolloutBatch
from rlhfkit.rollout.experience import response_logprobs_and_entropy, response_values
from rlhfkit.speed.checks import common_prefix_gives_full_values, group_packing_gives_prefix_values
from rlhfkit.models.plan import REFERENCE, ModelPlan

SHARED = ModelPlan(common_prefix=True)  # the common prefix once, through a KV cache

from conftest import sharpened
from test_padding_free import _assert_grads_close, _grads, _scalar_model


def test_common_prefix_span_by_hand():
    ids = torch.tensor([[0, 0, 7, 8, 9, 4, 5],
                        [7, 8, 9, 3, 3, 5, 6],
                        [0, 7, 8, 9, 2, 5, 6]])
    mask = (ids != 0).long()
    # rows start at columns 2, 0, 1 and share 7 8 9; the earliest start is column 0
    assert common_prefix_span(ids, mask, keep=2) == (0, 3)
    # the last `keep` columns stay out of the run: row 0 has 5 - 2 = 3 tokens before them, so keep=3 leaves 2
    assert common_prefix_span(ids, mask, keep=3) == (0, 2)
    assert common_prefix_span(ids, mask, keep=5) == (0, 0)
    assert common_prefix_span(ids[:1], mask[:1], keep=1) == (0, 0)  # one row shares with nobody
    other = ids.clone()
    other[1, 0] = 6  # the first tokens differ: nothing shared
    assert common_prefix_span(other, mask, keep=1) == (0, 0)


def _shared_batch(vocab: int, pad: int = 0) -> RolloutBatch:
    """Four rows whose prompts begin with the same 12 tokens, then 1-4 tokens of their own (left padding), and
    responses of 5 tokens, two of them cut short."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(1, vocab, (12,), generator=g)
    prompts, width = [], 16
    for own in (1, 4, 2, 3):
        row = torch.cat([shared, torch.randint(1, vocab, (own,), generator=g)])
        prompts.append(torch.cat([torch.full((width - row.numel(),), pad), row]))
    prompt_ids = torch.stack(prompts)
    prompt_mask = (torch.arange(width)[None] >= torch.tensor([3, 0, 2, 1])[:, None]).long()
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]],
                                 dtype=torch.float)
    response_ids = torch.randint(1, vocab, (4, 5), generator=g).masked_fill(response_mask == 0, pad)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, prompt_texts=[""] * 4, response_texts=[""] * 4)


@pytest.mark.parametrize("chunked, packed", [(True, False), (False, False), (True, True)])
def test_response_logprobs_with_the_shared_prefix_once_equal_the_plain_forward(tiny_model_dir, chunked, packed):
    """Log-probs (LM head in chunks on the hidden states, or the model's own logits), entropies and every gradient
    of the actor's loss, with the 12 shared tokens through the model once instead of four times: by a KV cache
    (two forwards), or in one packed row with each row's other real tokens (`packed`: one forward)."""
    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok)).train()
    batch = _shared_batch(base_model(model).config.vocab_size, tok.pad_token_id)
    valid = batch.response_mask.bool()
    upstream = torch.randn(valid.shape, generator=torch.Generator().manual_seed(3))
    calls = []
    hook = base_model(model).get_decoder().register_forward_hook(lambda m, a, k, o: calls.append(k["input_ids"].shape),
                                                                 with_kwargs=True)

    def run(shared: bool):
        plan = ModelPlan(head_chunks=chunked, segment_attention=packed, group_packing=packed, common_prefix=shared)
        model.zero_grad(set_to_none=True)
        calls.clear()
        logp, ent = response_logprobs_and_entropy(model, batch, plan, temperature=0.7)
        torch.where(valid, logp * upstream, 0).sum().backward()
        return logp.detach(), ent, _grads(model), list(calls)

    plain, shared = run(False), run(True)
    hook.remove()
    # the shared run as one row of 12 tokens, then each row from its own tokens on: the 16 + 5 - 1 columns (the
    # last response token predicts nothing) less the 12 of the row that starts earliest (row 1)
    assert plain[3] == [torch.Size([4, 21])]
    # packed: the run once, then each row's other real tokens: 1 + 4 + 2 + 3 of the prompts and 4 + 2 + 4 + 3 of
    # the responses (their real ones among the first 4 columns: the last column predicts nothing)
    assert shared[3] == ([torch.Size([1, 12 + 10 + 13])] if packed else [torch.Size([1, 12]), torch.Size([4, 8])])
    torch.testing.assert_close(shared[0][valid], plain[0][valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1][valid], plain[1][valid], atol=1e-5, rtol=1e-5)
    _assert_grads_close(shared[2], plain[2])


@pytest.mark.parametrize("packed", [False, True])
def test_critic_values_with_the_shared_prefix_once_equal_the_plain_forward(packed):
    critic = _scalar_model().train()
    batch = _shared_batch(97)
    packing = ModelPlan(segment_attention=True, group_packing=True)
    assert group_packing_gives_prefix_values(critic, packing) is True  # the one-off check on a scalar model
    assert group_packing(critic, ModelPlan(segment_attention=packed, group_packing=packed)) == packed
    valid = batch.response_mask.bool()
    upstream = torch.randn(valid.shape, generator=torch.Generator().manual_seed(4))

    def run(shared: bool):
        plan = ModelPlan(segment_attention=packed, group_packing=packed, common_prefix=shared)
        critic.zero_grad(set_to_none=True)
        values = response_values(critic, batch, plan)
        torch.where(valid, values * upstream, 0).sum().backward()
        return values.detach(), _grads(critic)

    plain, shared = run(False), run(True)
    torch.testing.assert_close(shared[0][valid], plain[0][valid], atol=1e-5, rtol=1e-5)
    _assert_grads_close(shared[1], plain[1])


def test_it_declines_where_it_would_not_save_or_the_plan_says_no(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model = load_causal_lm(str(tiny_model_dir), tokenizer=tok).eval()
    batch = _shared_batch(base_model(model).config.vocab_size, tok.pad_token_id)
    ids, mask = batch.input_ids[:, :-1], batch.attention_mask[:, :-1]
    assert common_prefix_outputs(model, ids, mask, 5, REFERENCE) is None  # not in this model's plan
    out = common_prefix_outputs(model, ids, mask, 5, SHARED)
    assert out is not None and out.shape == (4, 5, base_model(model).config.hidden_size)
    short = ids.clone()
    cut = mask.long().argmax(-1) + MIN_COMMON_PREFIX - 1  # each row's run broken before MIN tokens
    short[torch.arange(4), cut] = torch.arange(4) + 1
    assert common_prefix_outputs(model, short, mask, 5, SHARED) is None
    assert common_prefix_outputs(model, ids[:1], mask[:1], 5, SHARED) is None  # a single row
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers drops the cache inside checkpointed layers: no shared forward
    assert common_prefix_outputs(model, ids, mask, 5, SHARED) is None


def test_the_check_passes_plain_models_and_refuses_one_that_ignores_positions(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok)).train()
    assert common_prefix_gives_full_values(model, SHARED)
    assert model.training  # the check leaves the mode as it found it
    assert common_prefix_gives_full_values(_scalar_model(), SHARED)
    inner = base_model(model).model
    plain_forward = inner.forward

    def positions_ignored(*args, **kwargs):  # a model numbering positions its own way (0..T-1 along the call)
        kwargs["position_ids"] = None
        return plain_forward(*args, **kwargs)

    inner.forward = positions_ignored
    assert not common_prefix_gives_full_values(model, SHARED)


def test_sampling_after_a_shared_prefill_draws_what_the_plain_prefill_draws(tiny_model_dir):
    """The prefill with the shared run computed once (one row of 12 tokens, then each prompt's own tokens against
    its cache): the same tokens, greedy and sampled from the same random numbers, with the same log-probs."""
    from rlhfkit.config.ppo_schema import GenConfig
    from rlhfkit.rollout import generate

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok)).eval()
    batch = _shared_batch(base_model(model).config.vocab_size, tok.pad_token_id)
    calls = []
    hook = base_model(model).get_decoder().register_forward_hook(lambda m, a, k, o: calls.append(k["input_ids"].shape),
                                                                 with_kwargs=True)

    def sample(shared: bool, greedy: bool):
        calls.clear()
        torch.manual_seed(0)
        with torch.no_grad():
            out = generate.sample_tokens(model, batch.prompt_ids, batch.prompt_mask,
                                         GenConfig(max_new_tokens=6, min_new_tokens=6), [tok.eos_token_id],
                                         tok.pad_token_id, SHARED if shared else REFERENCE, greedy=greedy)
        return out, list(calls)

    try:
        for greedy in (True, False):
            (tokens, logprobs), shared_calls = sample(True, greedy)
            (plain_tokens, plain_logprobs), plain_calls = sample(False, greedy)
            assert shared_calls[:2] == [torch.Size([1, 12]), torch.Size([4, 4])] and plain_calls[0] == (4, 16)
            assert len(shared_calls) == len(plain_calls) + 1  # then the same 5 decode steps
            assert torch.equal(tokens, plain_tokens)
            torch.testing.assert_close(logprobs, plain_logprobs, atol=1e-5, rtol=1e-5)
    finally:
        hook.remove()
