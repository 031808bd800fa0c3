"""Rollout: response masks, padding-safe generation and forwards, reward placement, reward functions."""

from __future__ import annotations

import re

import pytest
import torch

from rlhfkit.engine.local import LocalEngine

from rlhfkit.config.ppo_schema import GenConfig, PPOSection
from rlhfkit.data.templates import Template, encode_prompt, encode_response
from rlhfkit.models import ModelError, load_causal_lm, load_scalar_model, load_tokenizer
from rlhfkit.config.ppo_schema import is_function_spec
from rlhfkit.models.reward_fn import FunctionReward, ModelReward
from rlhfkit.user_code import load_user_object
from rlhfkit.rollout import (RolloutBatch, add_advantages, add_model_outputs, adjust_scores, cat_rollouts,
                             ended_with_eos, generate_rollout, response_mask)
from rlhfkit.rollout.experience import response_logprobs, response_values
from rlhfkit.rollout.generate import ignored_generation_settings
from rlhfkit.models.plan import REFERENCE, ModelPlan


CPU = LocalEngine  # the real single-process engine
# what a PPO actor's plan has for sampling and for its log-probs of groups: each distinct prompt once, group decode
ACTOR = ModelPlan(shared_prompt=True, group_decode=True)
PLANS = {"actor": ACTOR, "critic": REFERENCE, "reference": ACTOR}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    return tok, load_causal_lm(str(tiny_model_dir), tokenizer=tok).eval()


def prompt_rows(tok, prompts: list[str]) -> list[dict]:
    template = Template.for_tokenizer(tok)
    rows = []
    for p in prompts:
        messages = [{"role": "user", "content": p}]
        text = template.prompt(messages)
        rows.append({"prompt_ids": encode_prompt(tok, text), "prompt_text": text, "messages": messages})
    return rows


# ---------------------------------------------------------------- masks and batch plumbing


def test_response_mask_keeps_tokens_up_to_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert response_mask(ids, [2]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    # any of several EOS ids ends a response (e.g. a chat model's end-of-turn token)
    assert response_mask(torch.tensor([[5, 9, 2, 3]]), [2, 9]).tolist() == [[1, 1, 0, 0]]


def make_batch(prompts, responses, masks, pad=0) -> RolloutBatch:
    width = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=torch.tensor(responses),
                        response_mask=torch.tensor(masks, dtype=torch.float), prompt_texts=["a"] * len(prompts),
                        response_texts=["b"] * len(prompts))


def test_cat_rollouts_pads_prompts_left_and_responses_right():
    a = make_batch([[1, 5]], [[7, 2]], [[1, 1]])
    b = make_batch([[1, 5, 6, 7]], [[8, 9, 4, 2]], [[1, 1, 1, 1]])
    a.values, b.values = torch.tensor([[0.5, 0.25]]), torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    both = cat_rollouts([a, b], pad_id=0)
    assert both.prompt_ids.tolist() == [[0, 0, 1, 5], [1, 5, 6, 7]]
    assert both.prompt_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert both.response_ids.tolist() == [[7, 2, 0, 0], [8, 9, 4, 2]]
    assert both.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert both.values.tolist() == [[0.5, 0.25, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]
    assert both.prompt_texts == ["a", "a"]


def test_select_trims_columns_that_are_padding_in_every_selected_row():
    batch = make_batch([[1, 5], [1, 5, 6, 7]], [[7, 2, 0, 0], [8, 9, 4, 2]], [[1, 1, 0, 0], [1, 1, 1, 1]])
    batch.values = torch.arange(8.0).view(2, 4)
    short = batch.select([0])
    assert short.prompt_ids.tolist() == [[1, 5]] and short.response_ids.tolist() == [[7, 2]]
    assert short.values.tolist() == [[0.0, 1.0]]
    assert batch.select([0], trim=False).response_ids.shape == (1, 4)


# ---------------------------------------------------------------- generation and forwards with left padding


def test_batched_generation_equals_one_prompt_at_a_time(tiny):
    tok, model = tiny
    rows = prompt_rows(tok, ["say apple", "say a very long river stone cloud green", "say honey"])
    cfg = GenConfig(max_new_tokens=6)
    batch = generate_rollout(model, CPU(), tok, rows, cfg, ACTOR, greedy=True)
    assert batch.prompt_mask.sum(-1).tolist() == [len(r["prompt_ids"]) for r in rows]
    for i, row in enumerate(rows):
        alone = generate_rollout(model, CPU(), tok, [row], cfg, ACTOR, greedy=True)
        n = int(alone.response_mask.sum())
        assert int(batch.response_mask[i].sum()) == n
        assert batch.response_ids[i, :n].tolist() == alone.response_ids[0, :n].tolist()
        assert (batch.response_ids[i, n:] == tok.pad_token_id).all()


def test_logprobs_and_values_ignore_padding_and_post_eos_tokens(tiny, tiny_model_dir):
    tok, model = tiny
    critic = load_scalar_model(str(tiny_model_dir), tokenizer=tok).eval()
    rows = prompt_rows(tok, ["say apple", "say a very long river stone cloud green"])
    torch.manual_seed(0)
    batch = generate_rollout(model, CPU(), tok, rows, GenConfig(max_new_tokens=5), ACTOR)
    batch.response_mask[0, 2:] = 0  # pretend row 0 stopped early: everything after must be ignored
    batch.response_ids[0, 2:] = 17
    full = add_model_outputs(batch, model, critic, model, PLANS, temperature=0.7, micro_batch_size=2)
    assert (full.old_logprobs[0, 2:] == 0).all() and (full.values[0, 2:] == 0).all()
    assert torch.equal(full.old_logprobs, full.ref_logprobs)  # reference = same weights -> KL 0
    for i in range(2):
        alone = batch.select([i])  # no padding at all
        n = int(alone.response_mask.sum())
        expected = response_logprobs(model, alone, REFERENCE, temperature=0.7)[0, :n]
        torch.testing.assert_close(full.old_logprobs[i, :n], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(full.values[i, :n], response_values(critic, alone, REFERENCE)[0, :n], atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 0.8)])
def test_sampled_logprobs_are_the_old_logprobs_of_a_full_forward(tiny, top_k, top_p):
    """The log-probs recorded while sampling (KV cache, left padding) equal a forward over prompt + response,
    taken over the full softmax(z / T) even when top-k/top-p decide what is drawn."""
    tok, model = tiny
    rows = prompt_rows(tok, ["say apple", "say a very long river stone cloud green", "say honey"])
    torch.manual_seed(0)
    batch = generate_rollout(model, CPU(), tok, rows, GenConfig(max_new_tokens=6, temperature=0.7, top_k=top_k,
                                                                top_p=top_p), ACTOR)
    forward = add_model_outputs(batch, model, None, model, PLANS, temperature=0.7, micro_batch_size=2)
    sampled = add_model_outputs(batch, model, None, model, PLANS, temperature=0.7, micro_batch_size=2,
                                old_from_sampling=True)
    assert sampled.values is None and (sampled.old_logprobs[batch.response_mask == 0] == 0).all()
    torch.testing.assert_close(sampled.old_logprobs, forward.old_logprobs, atol=1e-5, rtol=1e-5)


def test_reward_on_last_valid_token_with_left_padded_prompts():
    batch = make_batch([[1, 5], [1, 5, 6]], [[7, 2, 0, 0], [8, 9, 4, 6]], [[1, 1, 0, 0], [1, 1, 1, 1]])
    batch.old_logprobs = torch.tensor([[-1.0, -1.0, 99.0, 99.0], [-1.0, -2.0, -1.0, -1.0]])
    batch.ref_logprobs = torch.tensor([[-1.5, -1.0, -99.0, 5.0], [-1.0, -1.0, -1.0, -1.0]])
    batch.values = torch.tensor([[0.0, 0.0, 7.0, 7.0], [0.0, 0.0, 0.0, 0.0]])  # garbage after EOS
    cfg = PPOSection(kl_coef=0.5, gamma=1.0, lam=1.0, whiten_advantages=False, score_clip=None)
    out, metrics = add_advantages(batch, torch.tensor([1.0, 2.0]), kl_coef=0.5, cfg=cfg)
    # row 0: k1 = [0.5, 0]; score on its EOS (index 1); row 1: k1 = [0, -1, 0, 0], score on index 3
    torch.testing.assert_close(out.rewards, torch.tensor([[-0.25, 1.0, 0.0, 0.0], [0.0, 0.5, 0.0, 2.0]]))
    # gamma = lambda = 1 and V = 0: advantages are rewards-to-go, 0 after EOS
    torch.testing.assert_close(out.advantages, torch.tensor([[0.75, 1.0, 0.0, 0.0], [2.5, 2.5, 2.0, 2.0]]))
    assert metrics["kl"] == pytest.approx((0.5 + -1.0) / 2)


def test_scores_normalised_and_missing_eos_penalised():
    batch = make_batch([[1]], [[5, 2, 0]], [[1, 1, 0]])
    two = cat_rollouts([batch, make_batch([[1]], [[5, 6, 7]], [[1, 1, 1]])], pad_id=0)
    finished = ended_with_eos(two, [2])
    assert finished.tolist() == [True, False]
    cfg = PPOSection(normalize_reward=True, missing_eos_penalty=1.0)
    scores = adjust_scores(torch.tensor([3.0, 3.0]), finished, cfg, {"mean": 1.0, "std": 2.0})
    assert scores.tolist() == [1.0, 0.0]


# ---------------------------------------------------------------- rewards: Python functions and RMs


def test_reward_function_from_file_and_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def count_a(prompts, responses):\n"
                                            "    return [r.count('a') for r in responses]\n"
                                            "def broken(prompts, responses):\n    return [1.0]\n"
                                            "def raises(prompts, responses):\n    return {}['answer']\n")
    spec = f"{tmp_path / 'my_rewards.py'}:count_a"
    assert is_function_spec(spec) and is_function_spec("pkg.mod:fn") and not is_function_spec(str(tmp_path))
    batch = make_batch([[1], [1]], [[5], [6]], [[1], [1]])
    batch.response_texts = ["banana", "kiwi"]
    assert FunctionReward(load_user_object(spec), spec)(batch).tolist() == [3.0, 0.0]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_user_object("my_rewards:count_a") is not None
    with pytest.raises(ModelError, match="returned 1 values for 2"):
        FunctionReward(load_user_object("my_rewards:broken"), "my_rewards:broken")(batch)
    with pytest.raises(ModelError) as err:  # where in the user's file it raised
        FunctionReward(load_user_object("my_rewards:raises"), "my_rewards:raises")(batch)
    assert str(err.value) == (f"reward 'my_rewards:raises' raised KeyError: 'answer' (at "
                              f"{tmp_path / 'my_rewards.py'}:6 in raises)")
    with pytest.raises(ModelError, match="no function 'nope'"):
        load_user_object("my_rewards:nope")
    with pytest.raises(ModelError, match="does not exist"):
        load_user_object(f"{tmp_path / 'missing.py'}:f")


def test_reward_modules_that_fail_to_import_say_where_and_dataclasses_load(tmp_path, monkeypatch):
    """An error while importing a reward module is one line naming its file and line, in both spec forms (the
    module form let anything but an ImportError out as a traceback); a reward file with dataclasses under
    `from __future__ import annotations` loads (it failed in dataclasses, its module missing from sys.modules)."""
    checks = tmp_path / "checks.py"
    checks.write_text("from __future__ import annotations\nimport dataclasses\n\n\n@dataclasses.dataclass\n"
                      "class Rule:\n    word: str\n\n\ndef has_a(prompts, responses):\n"
                      "    return [float(Rule('a').word in r) for r in responses]\n")
    assert load_user_object(f"{checks}:has_a")(["p"], ["banana"]) == [1.0]
    broken = tmp_path / "broken_rewards.py"
    broken.write_text("import math\n\nSCALE = math.sqrt(undefined_name)\n\n\ndef f(prompts, responses):\n"
                      "    return [0.0] * len(prompts)\n")
    with pytest.raises(ModelError) as err:
        load_user_object(f"{broken}:f")
    assert str(err.value) == (f"reward '{broken}:f': importing '{broken}' failed: NameError: name 'undefined_name' "
                              f"is not defined (at {broken}:3)")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelError) as err:
        load_user_object("broken_rewards:f")
    assert str(err.value) == ("reward 'broken_rewards:f': importing module 'broken_rewards' failed: NameError: name "
                              f"'undefined_name' is not defined (at {broken}:3)")
    (tmp_path / "syntax_rewards.py").write_text("def f(prompts, responses):\n    return [0.0 for]\n")
    where = re.escape(str(tmp_path / "syntax_rewards.py"))
    with pytest.raises(ModelError, match=rf"^reward 'syntax_rewards:f': importing module 'syntax_rewards' failed: "
                                         rf"SyntaxError: .* \(at {where}:2\)$"):
        load_user_object("syntax_rewards:f")
    with pytest.raises(ModelError, match="^reward 'no_such_rewards:f': cannot import module 'no_such_rewards': "):
        load_user_object("no_such_rewards:f")


def test_reward_model_with_another_tokenizer_gets_retokenised_text(tiny, tmp_path):
    from rlhfkit.demo.tiny import build_tiny_llama, build_tokenizer, save_model_folder

    tok, _ = tiny
    rm_tok = build_tokenizer(["Human: something else entirely, with other merges"] * 3, vocab_size=290)
    save_model_folder(build_tiny_llama(len(rm_tok), hidden=16, layers=1, heads=2), rm_tok, tmp_path / "rm")
    rm_tok = load_tokenizer(str(tmp_path / "rm"))
    rm = load_scalar_model(str(tmp_path / "rm"), tokenizer=rm_tok).eval()
    reward = ModelReward(rm, rm_tok, Template.for_tokenizer(tok), "auto", 4, torch.device("cpu"))
    assert reward.retokenize
    same = ModelReward(rm, rm_tok, Template.for_tokenizer(rm_tok), "auto", 4, torch.device("cpu"))
    assert not same.retokenize

    batch = make_batch([[1], [1]], [[5], [6]], [[1], [1]])
    batch.messages = [[{"role": "user", "content": "say apple"}]] * 2
    batch.response_texts = ["apple apple", "apple"]
    ids, mask, _ = reward._rm_inputs(batch, finished=[True, False])
    template = Template.for_tokenizer(rm_tok)
    prompt = encode_prompt(rm_tok, template.prompt(batch.messages[0]))
    finished_ids = prompt + encode_response(rm_tok, template.response(batch.messages[0], "apple apple"))
    truncated_ids = prompt + rm_tok(" apple", add_special_tokens=False)["input_ids"]  # no EOS: it never ended
    assert ids[0, : len(finished_ids)].tolist() == finished_ids and mask[0].sum() == len(finished_ids)
    assert ids[1, : len(truncated_ids)].tolist() == truncated_ids and mask[1].sum() == len(truncated_ids)
    assert reward(batch, torch.tensor([True, False])).shape == (2,)


def test_draw_tokens_samples_the_given_distribution_and_never_a_zero_probability_token():
    from rlhfkit.rollout.generate import draw_tokens

    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    torch.manual_seed(0)
    draws = draw_tokens(probs.expand(200_000, 5))[:, 0]
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    # 4 standard errors of a 200k-draw frequency (at most 0.0011) around the probabilities
    torch.testing.assert_close(freq, probs.double(), atol=0.0045, rtol=0)
    assert freq[1] == 0 and freq[4] == 0
    # unnormalised rows (what is left after EOS is forbidden) and a uniform draw at the very top of the range
    rows = torch.tensor([[0.0, 2.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0]])
    torch.manual_seed(1)
    assert draw_tokens(rows)[:, 0].tolist() == [1, 0, 2]
    original = torch.rand_like
    try:
        torch.rand_like = lambda t: torch.full_like(t, 1.0 - 2 ** -53)
        assert draw_tokens(rows)[:, 0].tolist() == [1, 0, 2]
    finally:
        torch.rand_like = original


def test_generation_config_settings_the_rollout_ignores_are_named(tiny, tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), tokenizer=tiny[0])  # its own copy: the config is changed
    cfg = GenConfig(temperature=1.0, top_p=0.95)
    config = model.generation_config
    config.do_sample, config.temperature, config.top_p, config.top_k = False, 0.6, 0.9, 50
    assert ignored_generation_settings(model, cfg) == []  # greedy defaults: no sampling values to speak of
    config.do_sample = True
    assert ignored_generation_settings(model, cfg) == ["temperature=0.6", "top_p=0.9"]
    config.temperature, config.top_p = 1.0, 0.95  # the same values as gen.*: nothing ignored
    config.repetition_penalty, config.no_repeat_ngram_size = 1.3, 3
    assert ignored_generation_settings(model, cfg) == ["repetition_penalty=1.3", "no_repeat_ngram_size=3"]


# ---------------------------------------------------------------- prompts shared by a group of samples

def grouped_batch(tok, model, n: int = 3) -> RolloutBatch:
    """Two prompts of different lengths (so one is left-padded), n samples each, one response cut short."""
    rows = prompt_rows(tok, ["say apple", "say a very long river stone cloud green"])
    torch.manual_seed(0)
    batch = generate_rollout(model, CPU(), tok, [r for r in rows for _ in range(n)], GenConfig(max_new_tokens=6),
                             ACTOR)
    batch.response_mask[1, 3:] = 0
    batch.response_ids[1, 3:] = tok.pad_token_id
    return RolloutBatch(**{**batch.__dict__, "group": torch.arange(2).repeat_interleave(n),
                           "groups_share_prompts": True})


def test_prompt_shared_by_a_group_is_computed_once_with_the_same_logprobs_and_gradients(tiny, tiny_model_dir):
    """shared_prefix_logits (each distinct prompt once, its KV cache broadcast to the group's block of rows, or
    indexed out to rows in any order) gives the full forward's logits on every valid response token, and the
    same parameter gradients."""
    from rlhfkit.models.forward import causal_logits
    from rlhfkit.models.prefix import shared_prefix_logits, unique_rows

    tok, _ = tiny
    model = load_causal_lm(str(tiny_model_dir), tokenizer=tok).train()
    batch = grouped_batch(tok, model)
    first, inverse = unique_rows(batch.prompt_ids, batch.prompt_mask)
    assert first.tolist() == [0, 3] and inverse.tolist() == [0, 0, 0, 1, 1, 1]
    width = batch.response_ids.size(1)
    valid = batch.response_mask.bool()[..., None]
    weights = torch.randn(*batch.response_ids.shape, len(tok), generator=torch.Generator().manual_seed(1)) * valid

    def run(fn, row_weights=weights):
        model.zero_grad()
        logits = fn()
        (logits * row_weights).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    full, full_grads = run(lambda: causal_logits(model, batch.input_ids, batch.attention_mask,
                                                 keep=width + 1)[:, -(width + 1):-1])
    shared, shared_grads = run(lambda: shared_prefix_logits(model, batch.prompt_ids, batch.prompt_mask,
                                                            batch.response_ids, batch.response_mask, ACTOR))
    torch.testing.assert_close(shared * valid, full * valid, atol=1e-5, rtol=1e-5)
    for a, b in zip(shared_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # rows of a prompt not next to each other: the cache is indexed out (not broadcast by blocks), same result
    mixed = [0, 3, 1, 4, 2, 5]
    interleaved, interleaved_grads = run(lambda: shared_prefix_logits(
        model, batch.prompt_ids[mixed], batch.prompt_mask[mixed], batch.response_ids[mixed],
        batch.response_mask[mixed], ACTOR), weights[mixed])
    torch.testing.assert_close(interleaved * valid[mixed], full[mixed] * valid[mixed], atol=1e-5, rtol=1e-5)
    for a, b in zip(interleaved_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # distinct prompts: nothing to share, the caller runs the plain forward; unless `always` (ZeRO-3: every
    # rank makes the same two calls), which gives the same logits
    two = [0, 3]
    assert shared_prefix_logits(model, batch.prompt_ids[two], batch.prompt_mask[two], batch.response_ids[two],
                                batch.response_mask[two], ACTOR) is None
    with torch.no_grad():
        forced = shared_prefix_logits(model, batch.prompt_ids[two], batch.prompt_mask[two], batch.response_ids[two],
                                      batch.response_mask[two], ACTOR, always=True)
        # a plan without the shared prompt: the caller's plain forward
        assert shared_prefix_logits(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                    batch.response_mask, REFERENCE, always=True) is None
    torch.testing.assert_close(forced * valid[two], full[two] * valid[two], atol=1e-5, rtol=1e-5)
    # under gradient checkpointing transformers drops the cache in every layer of a model in training mode,
    # with or without autograd: no sharing then (a no-grad forward of the training actor included)
    model.gradient_checkpointing_enable()
    assert shared_prefix_logits(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                batch.response_mask, ACTOR) is None
    with torch.no_grad():
        assert shared_prefix_logits(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                    batch.response_mask, ACTOR) is None
        model.eval()
        evaluated = shared_prefix_logits(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                         batch.response_mask, ACTOR)
    torch.testing.assert_close(evaluated * valid, full * valid, atol=1e-5, rtol=1e-5)


def test_group_rows_share_micro_batches_and_give_the_same_experience(tiny):
    """With groups, micro-batches hold whole groups (their prompt computed once); the log-probs equal
    those of the ungrouped, length-sorted micro-batches."""
    from dataclasses import replace

    from rlhfkit.rollout.experience import length_sorted_chunks

    tok, model = tiny
    batch = grouped_batch(tok, model, n=2)
    chunks = length_sorted_chunks(batch, 2)
    assert sorted(sorted(batch.group[c].tolist()) for c in chunks) == [[0, 0], [1, 1]]
    grouped = add_model_outputs(batch, model, None, model, PLANS, temperature=0.7, micro_batch_size=2)
    plain = add_model_outputs(replace(batch, group=None, groups_share_prompts=False), model, None, model, PLANS,
                              temperature=0.7, micro_batch_size=2)
    torch.testing.assert_close(grouped.old_logprobs, plain.old_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grouped.ref_logprobs, plain.ref_logprobs, atol=1e-5, rtol=1e-5)
    whole = add_model_outputs(batch, model, None, model, PLANS, temperature=0.7, micro_batch_size=batch.size)
    torch.testing.assert_close(whole.ref_logprobs, plain.ref_logprobs, atol=1e-5, rtol=1e-5)


def test_old_logprobs_of_a_checkpointed_actor_in_training_mode_see_the_prompt(tiny, tiny_model_dir):
    """The actor trains with gradient checkpointing (train mode), and its old log-probs are a no-grad forward:
    transformers drops the KV cache there, so the group's shared-prompt forward must not be used; the values
    equal the eval-mode ones (before the fix they were computed without the prompt)."""
    from conftest import sharpened

    tok, _ = tiny
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok))
    batch = grouped_batch(tok, model.eval())
    expected = add_model_outputs(batch, model, None, model, PLANS, temperature=1.0, micro_batch_size=6)
    model.gradient_checkpointing_enable()
    model.train()
    got = add_model_outputs(batch, model, None, model, PLANS, temperature=1.0, micro_batch_size=6)
    torch.testing.assert_close(got.old_logprobs, expected.old_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.ref_logprobs, expected.ref_logprobs, atol=1e-5, rtol=1e-5)


def test_generation_prefills_a_shared_prompt_once_and_samples_the_same(tiny, monkeypatch):
    """Prefilling each distinct prompt once and indexing its KV cache out to the group samples exactly what
    prefilling every row does (the draws come after the prefill, from the same generator state)."""
    import rlhfkit.rollout.generate as generate

    tok, model = tiny
    rows = prompt_rows(tok, ["say apple", "say a very long river stone cloud green"])
    rows = [r for r in rows for _ in range(3)]
    cfg = GenConfig(max_new_tokens=6)
    calls = []
    real_unique = generate.unique_rows
    monkeypatch.setattr(generate, "unique_rows", lambda *a: calls.append(real_unique(*a)) or calls[-1])
    torch.manual_seed(0)
    shared = generate_rollout(model, CPU(), tok, rows, cfg, ACTOR)
    assert calls and calls[0][0].tolist() == [0, 3]  # two prompts prefilled, not six
    monkeypatch.setattr(generate, "unique_rows", lambda *a: None)
    torch.manual_seed(0)
    every_row = generate_rollout(model, CPU(), tok, rows, cfg, ACTOR)
    assert torch.equal(shared.response_ids, every_row.response_ids)
    torch.testing.assert_close(shared.sample_logprobs, every_row.sample_logprobs, atol=1e-5, rtol=1e-5)


def test_one_prompts_samples_in_a_call_decode_in_a_group_as_every_row_does(tiny, monkeypatch):
    """A generate() call whose rows are all one prompt's samples (one prompt per rank, or the last call of
    gen.generation_batch_size) takes the group path too, and samples what prefilling every row does."""
    import rlhfkit.rollout.generate as generate

    tok, model = tiny
    rows = [r for r in prompt_rows(tok, ["say a very long river stone cloud green"]) for _ in range(4)]
    cfg = GenConfig(max_new_tokens=6)
    torch.manual_seed(0)
    shared = generate_rollout(model, CPU(), tok, rows, cfg, ACTOR)
    monkeypatch.setattr(generate, "unique_rows", lambda *a: None)
    torch.manual_seed(0)
    every_row = generate_rollout(model, CPU(), tok, rows, cfg, ACTOR)
    assert torch.equal(shared.response_ids, every_row.response_ids)
    torch.testing.assert_close(shared.sample_logprobs, every_row.sample_logprobs, atol=1e-5, rtol=1e-5)


def test_the_kv_cache_goes_by_the_keyword_the_model_class_takes(tiny, tiny_model_dir):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns and goes in 5.40; a
    name the class does not take would vanish into its **kwargs, and the model would decode without its cache).
    The keyword is read from the class, also through a LoRA wrapper; greedy rollouts, plain and in groups, give
    the tokens of decoding by full forwards without any cache, and no deprecation warning names the old keyword."""
    import inspect
    import warnings

    from rlhfkit.config.schema import LoraConfig
    from rlhfkit.models.forward import cache_kwargs
    from rlhfkit.lora import apply_lora

    tok, model = tiny
    keyword = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert cache_kwargs(model, "the cache") == {keyword: "the cache"}
    wrapped = apply_lora(load_causal_lm(str(tiny_model_dir), tokenizer=tok), LoraConfig(rank=4))
    assert cache_kwargs(wrapped, "the cache") == {keyword: "the cache"}

    rows = prompt_rows(tok, ["say apple", "say a very long river stone cloud green"])
    cfg = GenConfig(max_new_tokens=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = generate_rollout(model, CPU(), tok, rows, cfg, ACTOR, greedy=True)
        grouped = generate_rollout(model, CPU(), tok, [r for r in rows for _ in range(2)], cfg, ACTOR, greedy=True)
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(grouped.response_ids[::2], plain.response_ids)
    with torch.no_grad():
        for i, row in enumerate(rows):
            ids, want = torch.tensor([row["prompt_ids"]]), []
            for _ in range(int(plain.response_mask[i].sum())):
                token = model(input_ids=ids, use_cache=False).logits[0, -1].argmax()
                want.append(int(token))
                ids = torch.cat([ids, token.view(1, 1)], dim=1)
            assert plain.response_ids[i, :len(want)].tolist() == want


def test_generation_batch_size_counts_prompts_and_keeps_each_prompts_samples_in_one_call(tiny, monkeypatch):
    """gen.generation_batch_size=2 with 3 samples per prompt: generate() calls of 2 prompts' 6 rows (a group
    split over two calls would prefill its prompt twice)."""
    import rlhfkit.rollout.evaluate as evaluate
    from rlhfkit.rollout import generate_all

    tok, model = tiny
    rows = [r for r in prompt_rows(tok, ["say apple", "say honey", "say tiger", "say stone", "say cloud"])
            for _ in range(3)]
    sizes = []
    real = evaluate.generate_rollout
    monkeypatch.setattr(evaluate, "generate_rollout", lambda m, e, t, part, *a: sizes.append(
        [r["prompt_text"] for r in part]) or real(m, e, t, part, *a))
    batch = generate_all(model, CPU(), tok, rows, GenConfig(max_new_tokens=3, generation_batch_size=2), ACTOR,
                         group_size=3)
    assert [len(s) for s in sizes] == [6, 6, 3] and batch.size == 15
    assert all(len(set(s)) == len(s) // 3 for s in sizes)  # whole groups in each call


@pytest.mark.parametrize("padding_free", [True, False])
def test_a_reward_model_gives_identical_sequences_the_very_same_score(tiny, tmp_path, padding_free):
    """A group's identical samples (greedy decoding, a converged policy) get their first copy's score: in other
    rows of a batch their scores differed in the last bits (measured 0.2678722143 vs 0.2678722441 padding-free),
    which GRPO turned into advantages of +-0.015 and DAPO's equal-group filter missed. Distinct rows score as
    alone."""
    from rlhfkit.demo.tiny import build_tiny_llama, save_model_folder

    tok, _ = tiny
    torch.manual_seed(0)
    folder = tmp_path / "rm"  # 256 wide: the CPU's fast GEMMs, whose sums depend on the rows around
    save_model_folder(build_tiny_llama(len(tok), hidden=256, layers=2, heads=4), tok, folder)
    rm = load_scalar_model(str(folder), tokenizer=tok).eval()
    plan = ModelPlan(segment_attention=padding_free, padding_free=padding_free)
    reward = ModelReward(rm, tok, Template.for_tokenizer(tok), "auto", 2, torch.device("cpu"), plan=plan)
    prompts = [[1, 5, 6], [1, 7], [1, 5, 6, 8, 9, 10], [1, 7], [1, 11, 12]]
    responses = [[20, 21, 2, 0], [22, 23, 24, 2], [25, 2, 0, 0], [22, 23, 24, 2], [26, 27, 28, 29]]
    masks = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    batch = make_batch(prompts, responses, masks)
    scores = reward(batch)
    assert scores[1].item() == scores[3].item()  # bit for bit
    for i in range(5):
        alone = reward(make_batch([prompts[i]], [responses[i]], [masks[i]]))
        assert scores[i].item() == pytest.approx(alone.item(), abs=1e-5)
