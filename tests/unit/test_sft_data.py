"""Rendering, label masking, truncation and collation of SFT rows."""

import pytest
import torch

from rlhfkit.data.formats import SFTExample
from rlhfkit.data.templates import Template
from rlhfkit.data.tokenize import IGNORE, collate_sft, tokenize_sft
from rlhfkit.models import load_tokenizer

from conftest import STORIES, needs_shared, sharpened


def ex(prompt, response):
    return SFTExample(prompt=[{"role": "user", "content": prompt}], response=response, source="x.jsonl", line=1)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def test_plain_template_text(tok):
    tpl = Template.for_tokenizer(tok, "auto")
    assert tpl.name == "plain"  # the tiny tokenizer has no chat template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say apple"}]
    assert tpl.prompt(msgs) == "System: Be brief.\n\nUser: say apple\n\nAssistant:"
    assert tpl.response(msgs, "apple apple apple ") == " apple apple apple</s>"


def test_chat_template_requested_but_missing(tok):
    with pytest.raises(ValueError, match=r"^'chat' needs a chat template and the tokenizer has none"):
        Template.for_tokenizer(tok, "chat")
    with pytest.raises(ValueError, match=r"^config key 'data.template': 'chat' needs a chat template"):
        Template.for_tokenizer(tok, "chat", key="data.template")


@needs_shared
def test_chat_template_used_when_present():
    tok = load_tokenizer(str(STORIES))
    tpl = Template.for_tokenizer(tok, "auto")
    msgs = [{"role": "user", "content": "Hi"}]
    assert tpl.name == "chat"
    assert tpl.prompt(msgs) == "<s>User: Hi\nAssistant:"
    assert tpl.response(msgs, "Hello") == " Hello</s>"
    rows, _ = tokenize_sft([ex("Hi", "Hello")], tok, tpl, 64)
    assert rows[0]["input_ids"].count(tok.bos_token_id) == 1  # BOS written by the template, not added twice


def test_labels_cover_only_the_response_and_end_with_eos(tok):
    tpl = Template.for_tokenizer(tok)
    rows, stats = tokenize_sft([ex("say apple", "apple apple apple")], tok, tpl, 128)
    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    n_prompt = len(tok(tpl.prompt([{"role": "user", "content": "say apple"}]))["input_ids"])
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert labels[:n_prompt] == [IGNORE] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:]
    assert tok.decode(ids[n_prompt:], skip_special_tokens=True) == " apple apple apple"
    assert stats == {"rows": 1, "truncated": 0, "dropped": 0}
    rows_all, _ = tokenize_sft([ex("say apple", "apple apple apple")], tok, tpl, 128, loss_on="all")
    assert rows_all[0]["labels"] == ids


def test_truncation_keeps_prompt_and_counts(tok):
    tpl = Template.for_tokenizer(tok)
    prompt_len = len(tok(tpl.prompt([{"role": "user", "content": "say apple"}]))["input_ids"])
    rows, stats = tokenize_sft([ex("say apple", "apple " * 50), ex("say apple " * 40, "x")], tok, tpl,
                               prompt_len + 3)
    assert stats == {"rows": 1, "truncated": 1, "dropped": 1}
    assert len(rows[0]["input_ids"]) == prompt_len + 3
    assert sum(t != IGNORE for t in rows[0]["labels"]) == 3


def test_collate_right_pads(tok):
    batch = collate_sft([{"input_ids": [1, 5, 6], "labels": [IGNORE, 5, 6]}, {"input_ids": [1, 7], "labels": [IGNORE, 7]}],
                        pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 5, 6], [IGNORE, 7, IGNORE]]
    assert batch["input_ids"].dtype == torch.long


# ---------------------------------------------------------------- padding-free packing

def test_pack_bins_first_fit_decreasing_within_the_longest_row():
    from rlhfkit.data.tokenize import pack_bins

    assert pack_bins([5, 2, 3, 1, 4], 5) == [[0], [4, 3], [2, 1]]
    assert sum(len(b) for b in pack_bins([7, 7, 7], 7)) == 3


def test_micro_batches_balance_packed_tokens_and_group_padded_lengths():
    from rlhfkit.data.tokenize import micro_batches

    rows, lengths = list("abcdef"), [5, 1, 4, 2, 3, 3]
    # packed: longest first into the emptiest micro-batch with room: a(5) | c(4) | e(3); f(3) -> e's; d(2) -> c's;
    # b(1) -> a's: 6 tokens each, where the plain split [a, b] [c, d] [e, f] has 6, 6, 6 by luck of the order
    assert micro_batches(rows, 2, lengths, packed=True) == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert micro_batches(rows, 2, [5, 4, 3, 3, 2, 1], packed=True) == [["a", "f"], ["b", "e"], ["c", "d"]]
    # padded: sorted by length, so a micro-batch pads to a length near its own rows' (each keeps the rows' order)
    assert micro_batches(rows, 2, lengths, packed=False) == [["a", "c"], ["e", "f"], ["b", "d"]]
    # no lengths: the plain split
    assert micro_batches(rows, 4, None, packed=True) == [["a", "b", "c", "d"], ["e", "f"]]
    # the plain split's sizes (the last micro-batch holds the rest), every row exactly once
    for packed in (True, False):
        out = micro_batches(rows[:5], 2, lengths[:5], packed)
        assert [len(m) for m in out] == [2, 2, 1] and sorted(sum(out, [])) == list("abcde")


def test_prompt_sharing_pairs_layout_positions_mask_and_scored_tokens():
    """Two pairs by hand: A = prompt [10, 11], chosen [12, 13], rejected [14]; B = prompt [20], chosen [21],
    rejected [22, 23]. Segment lengths 5 and 4: one bin of width 5 each (first fit in the longest's width)."""
    from rlhfkit.data.tokenize import collate_prompt_sharing_pairs

    rows = [{"chosen_ids": [10, 11, 12, 13], "rejected_ids": [10, 11, 14], "prompt_len": 2},
            {"chosen_ids": [20, 21], "rejected_ids": [20, 22, 23], "prompt_len": 1}]
    out = collate_prompt_sharing_pairs(rows, pad_id=0)
    assert out["input_ids"].tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 23, 0]]
    # the rejected response continues from the prompt's length, not from the chosen one; the pad restarts at 0
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 2], [0, 1, 1, 2, 0]]
    allowed = out["allowed"][:, 0].int().tolist()  # (query, key)
    assert allowed[0] == [[1, 0, 0, 0, 0],   # prompt 10
                          [1, 1, 0, 0, 0],   # prompt 11
                          [1, 1, 1, 0, 0],   # chosen 12: prompt and itself
                          [1, 1, 1, 1, 0],   # chosen 13
                          [1, 1, 0, 0, 1]]   # rejected 14: the prompt and itself, not the chosen response
    assert allowed[1] == [[1, 0, 0, 0, 0],   # prompt 20
                          [1, 1, 0, 0, 0],   # chosen 21
                          [1, 0, 1, 0, 0],   # rejected 22
                          [1, 0, 1, 1, 0],   # rejected 23
                          [0, 0, 0, 0, 1]]   # padding: itself only
    # predictions (row-major over the scored positions): the prompt's last token predicts both first tokens
    assert out["scored"].int().tolist() == [[0, 1, 1, 0, 0], [1, 0, 1, 0, 0]]
    flat = [[0, 1], [0, 2], [1, 0], [1, 2]]  # (bin, column) of the scored positions, in order
    got = sorted((tuple(flat[s]), t, o) for s, t, o in zip(*(out[k].tolist() for k in ("source", "target", "owner"))))
    # owners: 0 A chosen, 1 B chosen, 2 A rejected, 3 B rejected
    assert got == sorted([((0, 1), 12, 0), ((0, 2), 13, 0), ((0, 1), 14, 2),
                          ((1, 0), 21, 1), ((1, 0), 22, 3), ((1, 2), 23, 3)])


def test_packed_rows_give_the_padded_loss_and_gradients(tiny_model_dir):
    """collate_packed (positions restarting per row, no attention mask): attention stays inside each row (per
    sequence, or transformers' block-diagonal mask), so the summed NLL, its token count and every gradient equal the padded batch's."""
    from rlhfkit.data.tokenize import collate_packed
    from rlhfkit.models import load_causal_lm
    from rlhfkit.models.stage_forward import lm_forward
    from rlhfkit.speed.checks import sft_packing_is_exact
    from rlhfkit.models.plan import ModelPlan

    per_sequence = ModelPlan(segment_attention=True, packing=True)
    masked = ModelPlan(packing=True)  # transformers' block-diagonal mask, no per-sequence attention

    tok = load_tokenizer(str(tiny_model_dir))
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok))
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (9, 4, 6, 3, 8):  # response labels only, as SFT rows have them
        ids = torch.randint(3, len(tok), (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * 2 + ids[2:]})
    packed = collate_packed(rows, tok.pad_token_id)
    assert packed["input_ids"].shape == (4, 9)  # bins of the longest row's 9 tokens: [9], [8], [6, 3], [4]
    assert int((packed["labels"] != IGNORE).sum()) == sum(n - 2 for n in (9, 4, 6, 3, 8))

    def loss_and_grads(batch):
        model.zero_grad()
        nll, count = lm_forward(model, batch, torch.device("cpu"), per_sequence)
        nll.backward()
        return nll.detach(), count, [p.grad.clone() for p in model.parameters()]

    nll_pad, n_pad, grads_pad = loss_and_grads(collate_sft(rows, tok.pad_token_id))
    nll_packed, n_packed, grads_packed = loss_and_grads(packed)
    assert n_packed == n_pad
    torch.testing.assert_close(nll_packed, nll_pad, atol=1e-4, rtol=1e-5)
    for a, b in zip(grads_packed, grads_pad):
        # the per-sequence attention (models/segments.py) sums in another order than the padded batch's masked
        # kernel: the sharpened model's gradients (up to ~250) then differ by float rounding of their scale
        # (up to 1.6e-6 of it measured on an AVX2 host)
        torch.testing.assert_close(a, b, atol=5e-6 * float(b.abs().max()) + 1e-6, rtol=1e-4)
    for plan in (per_sequence, masked):
        assert sft_packing_is_exact(model, plan, rows, tok.pad_token_id, torch.device("cpu"))
    # a model whose mask ignores the packed positions (here: every row attends across the whole bin) is caught
    plain_forward = model.forward
    model.forward = lambda **kw: plain_forward(**{**kw, "attention_mask": torch.ones_like(kw["input_ids"])})
    assert not sft_packing_is_exact(model, masked, rows, tok.pad_token_id, torch.device("cpu"))


@pytest.mark.parametrize("chat", [False, True])
def test_a_long_prompt_keeps_the_templates_opening_and_its_end(tok, chat):
    """A PPO prompt over data.max_prompt_length loses its middle, not its start: BOS, the system turn and the first
    header stay (the actor was trained on prompts laid out so), and so do the question's end and the assistant
    header it answers after."""
    import copy

    from rlhfkit.data.formats import PromptExample
    from rlhfkit.data.templates import encode_prompt
    from rlhfkit.data.tokenize import tokenize_prompts

    tokenizer = copy.deepcopy(tok)
    if chat:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    template = Template.for_tokenizer(tokenizer, "auto")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "say apple " * 80 + "and then say tiger"}]
    full = encode_prompt(tokenizer, template.prompt(messages))
    rows, stats = tokenize_prompts([PromptExample(messages, "p.jsonl", 1)], tokenizer, template, 64)
    ids = rows[0]["prompt_ids"]
    assert stats["truncated"] == 1 and len(ids) == 64 < len(full)
    opening = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" if chat else "System: Be brief.\n\nUser:"
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith(tokenizer.bos_token + opening)
    ending = "tiger<|im_end|>\n<|im_start|>assistant\n" if chat else "tiger\n\nAssistant:"
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith(ending)
    head = next(i for i in range(len(ids)) if ids[i] != full[i])
    assert ids == full[:head] + full[len(full) - (64 - head):]  # the opening, then the end: only the middle cut


def test_cut_prompt_keeps_an_opening_of_at_most_half_the_budget():
    from rlhfkit.data.tokenize import cut_prompt

    assert cut_prompt(list(range(10)), 3, 8) == [0, 1, 2, 5, 6, 7, 8, 9]
    assert cut_prompt(list(range(10)), 5, 8) == [2, 3, 4, 5, 6, 7, 8, 9]  # a long opening: the end matters more
    assert cut_prompt(list(range(10)), 0, 1) == [9]
