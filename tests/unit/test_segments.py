"""Packed rows' attention run per sequence (models/segments.py): spans, values and gradients against the masked
kernel and against each sequence alone, the fallbacks, and the SFT / RM packed forwards going through it."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from rlhfkit.data.tokenize import collate_packed, collate_packed_pairs
from rlhfkit.models.forward import cache_kwargs, packed_logits, packed_sequence_scores, returned_cache
from rlhfkit.models.segments import NAME, SPANS, packed_attention, sequence_spans
from rlhfkit.models.plan import REFERENCE, ModelPlan

PER_SEQUENCE = ModelPlan(segment_attention=True)  # the plan that attends packed rows one sequence at a time


def tiny_config(**kw):
    return LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=112, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                       attn_implementation="sdpa", **kw)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config())


SEQS = [[5, 9, 11, 3, 7, 2, 8], [4, 6], [13, 14, 15, 16, 17], [21, 22, 23], [30]]


def packed_batch():
    rows = [{"input_ids": s, "labels": s} for s in SEQS]
    return collate_packed(rows, pad_id=0)


class CountingSDPA:
    """The real scaled_dot_product_attention, counting its calls and whether they carried a mask."""

    def __init__(self, monkeypatch):
        self.real = torch.nn.functional.scaled_dot_product_attention
        self.calls, self.masked = 0, 0
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.masked += kwargs.get("attn_mask") is not None
        return self.real(*args, **kwargs)


def test_sequence_spans_by_hand():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1], [3, 4, 5, 6, 7, 8]])
    assert sequence_spans(positions) == [[(0, 3), (3, 5), (5, 6)], [(0, 4), (4, 6)], [(0, 6)]]


def test_per_sequence_attention_equals_the_masked_kernel_and_each_sequence_alone(monkeypatch):
    model = tiny_llama()
    batch = packed_batch()
    spans = sequence_spans(batch["position_ids"])
    assert sum(len(s) for s in spans) > len(spans)  # at least one row holds several sequences

    def run(per_sequence: bool):
        model.zero_grad(set_to_none=True)
        with packed_attention(model, PER_SEQUENCE if per_sequence else REFERENCE, batch["position_ids"]) as extra:
            assert (model.config._attn_implementation == NAME) is per_sequence
            assert bool(extra) is per_sequence
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                           **extra).logits
        assert model.config._attn_implementation == "sdpa"  # restored
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    counter = CountingSDPA(monkeypatch)
    masked_logits, masked_grads = run(False)
    assert counter.masked == counter.calls == model.config.num_hidden_layers  # one masked call per layer
    counter.calls = counter.masked = 0
    logits, grads = run(True)
    n_pieces = sum(len(s) for s in spans)
    assert counter.calls == n_pieces * model.config.num_hidden_layers and counter.masked == 0

    torch.testing.assert_close(logits, masked_logits, rtol=1e-5, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], masked_grads[name], rtol=1e-4, atol=1e-6)
    # and each real sequence's logits equal the sequence run alone
    with torch.no_grad():
        for row, row_spans in enumerate(spans):
            for s, e in row_spans:
                ids = batch["input_ids"][row, s:e]
                if ids.tolist() not in SEQS:
                    continue  # the bin's tail padding
                alone = model(input_ids=ids[None]).logits[0]
                torch.testing.assert_close(logits[row, s:e], alone, rtol=1e-5, atol=1e-5)


def test_reward_model_packed_scores_and_lora(monkeypatch):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = LlamaForSequenceClassification(tiny_config(num_labels=1))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             modules_to_save=["score"]))
    rows = [{"chosen_ids": [5, 9, 11, 3], "rejected_ids": [5, 9, 12], "prompt_len": 2},
            {"chosen_ids": [7, 8, 9, 10, 11, 12], "rejected_ids": [7, 8, 30, 31, 32, 33, 34, 35], "prompt_len": 2}]
    batch = collate_packed_pairs(rows, pad_id=0)
    counter = CountingSDPA(monkeypatch)
    scores = packed_sequence_scores(model, batch["input_ids"], batch["position_ids"], batch["ends"], PER_SEQUENCE)
    assert counter.masked == 0 and counter.calls > 0
    scores.sum().backward()
    lora_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # each sequence alone
        alone = [model(input_ids=torch.tensor([s])).logits[0, 0] for s in
                 [r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows]]
    torch.testing.assert_close(scores.detach(), torch.stack(alone), rtol=1e-5, atol=1e-5)
    # the masked kernel's gradients (the reference plan)
    packed_sequence_scores(model, batch["input_ids"], batch["position_ids"], batch["ends"], REFERENCE).sum().backward()
    for name, grad in lora_grads.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)


def test_not_used_under_checkpointing_or_another_attention(monkeypatch):
    model = tiny_llama()
    positions = packed_batch()["position_ids"]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with packed_attention(model, PER_SEQUENCE, positions) as extra:
        assert model.config._attn_implementation == "sdpa" and extra == {}
    model.eval()  # no recomputation without training mode: the per-sequence path again
    with packed_attention(model, PER_SEQUENCE, positions) as extra:
        assert model.config._attn_implementation == NAME and extra
    eager = LlamaForCausalLM(LlamaConfig(**{**tiny_config().to_dict(), "attn_implementation": "eager"}))
    with packed_attention(eager, PER_SEQUENCE, positions) as extra:
        assert eager.config._attn_implementation == "eager" and extra == {}


def test_a_cached_or_unpacked_forward_inside_falls_back_to_the_mask():
    model = tiny_llama().eval()
    ids = torch.tensor([[5, 9, 11, 3, 7, 2]])
    positions = torch.arange(6)[None]
    with torch.no_grad():
        full = model(input_ids=ids).logits
        with packed_attention(model, PER_SEQUENCE, positions) as extra:
            plain = model(input_ids=ids, position_ids=positions, **extra).logits  # one sequence: causal
            unmarked = model(input_ids=ids).logits  # a forward the caller did not mark packed: the mask
            first = model(input_ids=ids[:, :4], use_cache=True)  # decoding with a cache: query shorter than keys
            step = model(input_ids=ids[:, 4:5], position_ids=positions[:, 4:5], use_cache=True,
                         **{SPANS: sequence_spans(positions[:, 4:5])},
                         **cache_kwargs(model, returned_cache(first))).logits
    torch.testing.assert_close(unmarked, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step[:, -1], full[:, 4], rtol=1e-5, atol=1e-5)


def test_packed_logits_go_through_it(monkeypatch):
    model = tiny_llama()
    batch = packed_batch()
    counter = CountingSDPA(monkeypatch)
    with torch.no_grad():
        packed_logits(model, batch["input_ids"], batch["position_ids"], PER_SEQUENCE)
    assert counter.calls > model.config.num_hidden_layers and counter.masked == 0


@pytest.mark.parametrize("fused", [False, True])
def test_sft_packed_loss_and_gradients_equal_the_padded_batch(fused):
    from rlhfkit.data.tokenize import collate_sft
    from rlhfkit.models.stage_forward import lm_forward

    model = tiny_llama(seed=3)
    plan = ModelPlan(segment_attention=True, head_chunks=fused)
    rows = [{"input_ids": s, "labels": [-100] + s[1:]} for s in SEQS]

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        nll, n = lm_forward(model, batch, torch.device("cpu"), plan)
        nll.backward()
        return nll.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters()}

    padded = loss_and_grads(collate_sft(rows, 0))
    for capacity in (None, 4096):  # bins as long as the longest row; one row
        packed = loss_and_grads(collate_packed(rows, 0, capacity))
        assert packed[1] == padded[1]
        torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-5)
        for name in packed[2]:
            torch.testing.assert_close(packed[2][name], padded[2][name], rtol=1e-4, atol=1e-6)


def test_a_forward_with_a_padding_mask_keeps_the_mask(monkeypatch):
    """Packed-looking positions with a 2D attention mask: transformers builds a padding mask (no packing), and so
    must the attention inside the context: only the caller of a packed forward passes the spans."""
    model = tiny_llama().eval()
    batch = packed_batch()
    kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                  attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False)
    counter = CountingSDPA(monkeypatch)
    with torch.no_grad():
        outside = model(**kwargs).logits
        with packed_attention(model, PER_SEQUENCE, batch["position_ids"]):
            inside = model(**kwargs).logits
    assert counter.calls == 2 * model.config.num_hidden_layers  # one call per layer both times: no split
    torch.testing.assert_close(inside, outside)


def test_spans_of_other_rows_fall_back_to_the_mask():
    """Spans that do not describe the query's rows (another batch's) are not trusted: transformers' masked path."""
    model = tiny_llama().eval()
    batch = packed_batch()
    with torch.no_grad(), packed_attention(model, PER_SEQUENCE, batch["position_ids"]) as extra:
        wrong = {SPANS: extra[SPANS][:1]}  # one row's spans for three rows
        got = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **wrong).logits
    expected = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_per_sequence_model_packs_a_micro_batch_into_one_row():
    from rlhfkit.models.segments import ROW_TOKENS, packed_row_tokens

    model = tiny_llama()
    assert packed_row_tokens(model, PER_SEQUENCE) == ROW_TOKENS
    assert packed_row_tokens(model, REFERENCE) is None  # the masked path: bins as long as the longest row
    rows = [{"input_ids": s, "labels": s} for s in SEQS]
    one = collate_packed(rows, 0, ROW_TOKENS)
    assert one["input_ids"].shape == (1, sum(map(len, SEQS)))  # no padding at all
    assert sequence_spans(one["position_ids"]) == [[(0, 7), (7, 12), (12, 15), (15, 17), (17, 18)]]
    assert collate_packed(rows, 0)["input_ids"].shape == (3, 7)  # bins as long as the longest row
    pairs = collate_packed_pairs([{"chosen_ids": [1, 2, 3], "rejected_ids": [1, 4]}], 0, 8)
    assert pairs["input_ids"].tolist() == [[1, 2, 3, 1, 4]] and pairs["ends"].tolist() == [[0, 2], [0, 4]]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert packed_row_tokens(model, PER_SEQUENCE) is None  # training recomputes: the masked path, bins stay short
    assert packed_row_tokens(model, PER_SEQUENCE, inference=True) == ROW_TOKENS
