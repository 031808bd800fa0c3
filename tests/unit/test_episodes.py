"""Multi-turn episodes (rollout/episodes.py) on a tiny model: the trajectory holds the sampled ids exactly, the
trainer's log-probs of every sampled token equal the sampler's, the environment's tokens carry no loss, KL or
advantage, their ids are the chat template's own rendering, and a failing environment fails its episode alone."""

from __future__ import annotations

import math
import time

import pytest
import torch

from conftest import NAMES, sharpened
from rlhfkit.config.ppo_schema import EpisodeSection, GenConfig, PPOSection
from rlhfkit.data.templates import Template, encode_prompt
from rlhfkit.engine.local import LocalEngine
from rlhfkit.envs import Environment, Step
from rlhfkit.errors import RunError
from rlhfkit.rollout.engines import NativeRollout
from rlhfkit.rollout.episodes import EpisodeRollout, EnvironmentReward, episode_metrics
from rlhfkit.rollout.turns import TurnRenderer
from rlhfkit.rollout.experience import add_rewards, response_logprobs
from rlhfkit.speed.registry import Target, plan_model


class TwoTurns(Environment):
    """Opens with 'say NAME'; answers the first turn with 'again'; done after the second with reward 1."""

    def reset(self, row):
        self.turn = 0
        return "say " + row["name"]

    def step(self, text):
        self.turn += 1
        self.seen = getattr(self, "seen", []) + [text]
        return "again" if self.turn == 1 else Step(done=True, reward=1.0)


@pytest.fixture(scope="module")
def world(tiny_model_dir):
    from rlhfkit.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    engine = LocalEngine()  # the machine's device (a GPU where there is one)
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok)).to(engine.device).eval()
    plan = plan_model(Target(model, "actor", "ppo", None, engine))  # every fast path the actor would take
    template = Template.for_tokenizer(tok, "auto", [tok.eos_token_id])
    return tok, model, engine, plan, template


def rows_for(tok, template, names):
    prompt = template.prompt([{"role": "user", "content": "placeholder"}])
    return [{"prompt_ids": encode_prompt(tok, prompt), "prompt_text": prompt, "messages": None,
             "fields": {"name": n}} for n in names]


def episodes(world, env_class, names, seed=0, group_size=1, **limits):
    tok, model, engine, plan, template = world
    runner = EpisodeRollout(NativeRollout(model, engine, tok, plan), env_class,
                            EpisodeSection(**{"max_turns": 3, "max_tokens": 64, **limits}), template, engine)
    torch.manual_seed(seed)
    return runner.generate(rows_for(tok, template, names), GenConfig(max_new_tokens=6), group_size=group_size)


def test_a_two_turn_episode_is_trained_on_exactly_the_tokens_sampled(world):
    tok, model, engine, plan, template = world
    batch = episodes(world, TwoTurns, NAMES[:4])
    # the environment's turn, as the plain template writes it after a model turn cut at the limit (no EOS sampled)
    env_ids = tok("</s>\n\nUser: again\n\nAssistant:", add_special_tokens=False)["input_ids"]
    for row in range(batch.size):
        model_at = batch.response_mask[row].bool()
        ids = batch.response_ids[row][batch.response_attention[row].bool()].tolist()
        turn = ids[:int(model_at[:len(ids)].long().argmin())]  # the first model turn
        assert batch.episodes[row]["turns"] == 2 and batch.episodes[row]["ended"] == "done"
        if tok.eos_token_id not in turn:  # cut at 6 tokens: the environment closes the turn with EOS itself
            assert ids[len(turn):len(turn) + len(env_ids)] == env_ids
        assert batch.episodes[row]["env_tokens"] == int((~model_at & batch.response_attention[row].bool()).sum())
        assert model_at.sum() == len(ids) - batch.episodes[row]["env_tokens"]
    assert torch.equal(batch.episode_rewards.cpu(), torch.ones(4))
    # the trainer's forward over prompt + trajectory (attending to the environment's tokens), on the actor's fast
    # paths, gives the sampler's log-prob for every token the model sampled
    trainer = response_logprobs(model, batch, plan)
    batch, trainer = batch.to("cpu"), trainer.cpu()
    valid = batch.response_mask.bool()
    assert valid.sum() >= 4 * 7
    assert torch.allclose(trainer[valid], batch.sample_logprobs[valid], atol=1e-4)
    assert torch.all(trainer[~valid] == 0)  # the environment's and the padding's positions hold nothing


def test_environment_tokens_carry_no_loss_kl_or_advantage(world):
    from rlhfkit.algos import policy_loss
    from rlhfkit.registry.estimators import ESTIMATORS

    tok, model, engine, plan, template = world
    batch = episodes(world, TwoTurns, NAMES[:4]).to("cpu")
    env_at = batch.response_attention.bool() & ~batch.response_mask.bool()
    assert env_at.any()
    cfg = PPOSection(kl_coef=0.1)
    old = torch.where(batch.response_mask.bool(), batch.sample_logprobs, torch.zeros_like(batch.sample_logprobs))
    ref = old - 0.3 * batch.response_attention  # a reference that differs everywhere, env tokens included
    batch.old_logprobs, batch.ref_logprobs = old, ref
    batch.values = torch.randn(batch.response_mask.shape) * batch.response_mask
    shaped = add_rewards(batch, EnvironmentReward()(batch), 0.1, cfg)
    assert torch.all(shaped.kl[env_at] == 0) and torch.all(shaped.rewards[env_at] == 0)
    for name in ("gae", "reinforce_pp"):
        advantages, returns = ESTIMATORS[name].advantages(shaped, PPOSection(advantage_estimator=name))
        assert torch.all(advantages[env_at] == 0) and torch.all(returns[env_at] == 0)
    # the policy loss's gradient reaches the model's tokens only
    logp = old.clone().requires_grad_(True)
    advantages = torch.randn(old.shape)
    loss, _ = policy_loss(logp, old, advantages, batch.response_mask, clip_eps=0.2)
    loss.backward()
    assert torch.all(logp.grad[env_at] == 0) and logp.grad[batch.response_mask.bool()].abs().sum() > 0


def test_gae_passes_through_environment_tokens_as_holes():
    from rlhfkit.algos import compute_gae

    # a model turn of 2 tokens, 3 environment tokens, a model turn of 1: as if the environment's were not there
    mask = torch.tensor([[1.0, 1, 0, 0, 0, 1]])
    rewards = torch.tensor([[0.0, 0, 9, 9, 9, 1.0]])  # garbage where the environment spoke
    values = torch.tensor([[0.5, 0.25, 7, 7, 7, 0.75]])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    compact_adv, compact_ret = compute_gae(torch.tensor([[0.0, 0, 1]]), torch.tensor([[0.5, 0.25, 0.75]]),
                                           torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert torch.allclose(adv[mask.bool()], compact_adv.flatten()) and torch.all(adv[~mask.bool()] == 0)
    assert torch.allclose(ret[mask.bool()], torch.tensor([1.0, 1.0, 1.0]))


def test_one_turn_episodes_are_the_engines_own_batch(world):
    """The single-turn task is the one-turn case of the loop: the same samples as the engine alone."""
    tok, model, engine, plan, template = world

    class OneTurn(Environment):
        def step(self, text):
            return Step(done=True, reward=float(len(text)))

    rows = rows_for(tok, template, NAMES[:4])
    torch.manual_seed(3)
    plain = NativeRollout(model, engine, tok, plan).generate(rows, GenConfig(max_new_tokens=6)).to("cpu")
    batch = episodes(world, OneTurn, NAMES[:4], seed=3).to("cpu")
    width = plain.response_ids.size(1)
    assert torch.equal(batch.response_ids[:, :width], plain.response_ids)
    assert torch.equal(batch.response_mask[:, :width], plain.response_mask)
    assert torch.allclose(batch.sample_logprobs[:, :width], plain.sample_logprobs)
    assert torch.equal(batch.episode_rewards, torch.tensor([float(len(t)) for t in plain.response_texts]))
    assert all(e["turns"] == 1 and e["env_tokens"] == 0 for e in batch.episodes)


def test_limits_end_episodes_by_turns_and_tokens(world):
    class Chatty(Environment):
        def step(self, text):
            return Step(["go on"], reward=0.5)

    batch = episodes(world, Chatty, NAMES[:2], max_turns=3).to("cpu")
    assert [e["turns"] for e in batch.episodes] == [3, 3]
    assert [e["ended"] for e in batch.episodes] == ["max_turns"] * 2
    assert torch.equal(batch.episode_rewards, torch.tensor([1.5, 1.5]))  # per-turn rewards add up
    short = episodes(world, Chatty, NAMES[:2], max_turns=5, max_tokens=20).to("cpu")
    for e, row in zip(short.episodes, range(2)):
        assert e["ended"] == "max_tokens" and int(short.response_attention[row].sum()) <= 20
    metrics = episode_metrics(short)
    assert metrics["episode/ended_max_tokens"] == 1.0 and metrics["episode/used_tool"] == 0.0


class Flaky(Environment):
    """The first name raises in step, the second hangs, the third returns a bad value; the rest are judged."""

    def reset(self, row):
        self.name = row["name"]
        return "say " + self.name

    def step(self, text):
        if self.name == NAMES[0]:
            raise KeyError("boom")
        if self.name == NAMES[1]:
            time.sleep(3)
        if self.name == NAMES[2]:
            return 42
        return Step(done=True, reward=1.0)


def test_a_failing_environment_leaves_its_episode_unjudged_and_the_rest_go_on(world):
    start = time.monotonic()
    batch = episodes(world, Flaky, NAMES[:6], timeout=0.5, max_failed=0.6).to("cpu")
    assert time.monotonic() - start < 2.5  # the hung call was given up on, not waited for
    ended = [e["ended"] for e in batch.episodes]
    assert ended == ["raised", "timeout", "bad_value", "done", "done", "done"]
    assert "KeyError: 'boom'" in batch.episodes[0]["detail"] and "test_episodes.py" in batch.episodes[0]["detail"]
    assert "returned int (42)" in batch.episodes[2]["detail"]
    rewards = batch.episode_rewards
    assert torch.isnan(rewards[:3]).all() and torch.equal(rewards[3:], torch.ones(3))


def test_too_many_failed_episodes_stop_the_run_with_the_first_failure(world):
    with pytest.raises(RunError) as raised:
        episodes(world, Flaky, NAMES[:6], timeout=0.5, max_failed=0.25)
    text = str(raised.value)
    assert "3 of 6 episodes failed (1 raised, 1 timeout, 1 bad_value)" in text
    assert "episode.max_failed=0.25" in text and "KeyError: 'boom'" in text


def test_an_episode_that_earned_no_reward_is_unjudged(world):
    class Silent(Environment):
        def step(self, text):
            return None  # done, no reward anywhere

    batch = episodes(world, Silent, NAMES[:2]).to("cpu")
    assert torch.isnan(batch.episode_rewards).all()
    assert [e["unjudged"] for e in batch.episodes] == [True, True] and batch.episodes[0]["failure"] is None


def test_environment_calls_run_concurrently_within_the_bound():
    from rlhfkit.envs.calls import run_calls

    start = time.monotonic()
    outcomes = run_calls([lambda i=i: (time.sleep(0.3), i)[1] for i in range(8)], workers=4, timeout=5)
    took = time.monotonic() - start
    assert [o.value for o in outcomes] == list(range(8))
    assert 0.55 < took < 1.2  # two waves of four, not eight in a row (2.4 s) nor all at once (0.3 s)


def test_bad_values_are_named():
    from rlhfkit.envs.base import BadValue, as_reward, as_step

    assert as_step("more", "E.step").messages == [{"role": "user", "content": "more"}]
    assert as_step(None, "E.step").done
    assert as_step(Step(done=True, reward=2), "E.step").reward == 2.0
    for value, words in [(Step(), "no message and done=False"), ([{"role": "robot", "content": "x"}], "message 0"),
                         (Step(["x"], reward=math.inf), "finite"), (Step(["x"], reward="1"), "a number")]:
        with pytest.raises(BadValue, match=words):
            as_step(value, "E.step")
    assert as_reward(None, "E.reward") is None
    with pytest.raises(BadValue):
        as_reward(True, "E.reward")


def test_environment_turns_are_the_chat_templates_own_ids(smollm2):
    """SmolLM2's ChatML: the opening, the model's turns as sampled, and the environment's turns rendered by the
    renderer make exactly the ids of the whole conversation rendered by the template at once."""
    from rlhfkit.models import load_tokenizer
    from rlhfkit.rollout.turns import TurnRenderer

    tok = load_tokenizer(str(smollm2))
    template = Template.for_tokenizer(tok, "auto", [tok.eos_token_id])
    renderer = TurnRenderer(template)
    question = [{"role": "user", "content": "What is 347 * 829?"}]
    tool = [{"role": "tool", "name": "calculator", "content": "287663"}]
    turns = ['<tool_call>{"name": "calculator", "arguments": {"expression": "347*829"}}</tool_call>', "287663"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end == tok.eos_token_id
    ids, _ = renderer.opening(question)
    first = tok(turns[0], add_special_tokens=False)["input_ids"] + [end]  # as if sampled, ending with <|im_end|>
    ids += first + renderer.followup(tool, end)
    ids += tok(turns[1], add_special_tokens=False)["input_ids"] + [end]
    whole = question + [{"role": "assistant", "content": turns[0]}, *tool, {"role": "assistant", "content": turns[1]}]
    expected = encode_prompt(tok, tok.apply_chat_template(whole, tokenize=False)).copy()
    assert expected[-1] == tok.convert_tokens_to_ids("\u010a") or tok.decode(expected[-1:]) == "\n"
    assert ids == expected[:-1]  # the template's "\n" after the last <|im_end|> is not the model's to write
    # a turn cut at the token limit gets the closing <|im_end|> from the environment's side
    cut = renderer.followup(tool, tok("x", add_special_tokens=False)["input_ids"][0])
    assert cut[0] == end and cut[1:] == renderer.followup(tool, end)


def test_a_template_that_takes_tools_describes_them_in_its_own_words(tiny_model_dir):
    """Where the chat template reads `tools`, the opening is its rendering of the tool schemas, not rlhfkit's
    fallback instructions; where it does not, the fallback instructions join the system turn."""
    from rlhfkit.demo.tiny import build_tokenizer
    from rlhfkit.rollout.turns import TurnRenderer
    from rlhfkit.tools import resolve_tools

    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with_tools = "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}" + chatml
    question = [{"role": "user", "content": "What is 2 * 3?"}]
    texts = {}
    for name, source in (("own", with_tools), ("fallback", chatml)):
        tok = build_tokenizer(["What is 2 * 3?"] * 4, vocab_size=300, chat_template=source)
        renderer = TurnRenderer(Template.for_tokenizer(tok, "auto"), resolve_tools(["calculator"]))
        texts[name] = (renderer.native_tools, renderer.opening(question)[1])
    native, text = texts["own"]
    assert native and text.startswith('<|im_start|>tools\n[{"type": "function", "function": {"name": "calculator"')
    assert "<tool_call>" not in text and text.endswith("What is 2 * 3?<|im_end|>\n<|im_start|>assistant\n")
    native, text = texts["fallback"]
    assert not native and text.startswith("<|im_start|>system\nYou can call these tools:")
    assert '<tool_call>{"name": "TOOL_NAME"' in text


class WithTools(Environment):
    """Opens with the row's own prompt (None), so the tools are described in it; done after one turn."""

    tools = ["calculator"]

    def step(self, text):
        return Step(done=True, reward=1.0)


def test_an_opening_past_data_max_prompt_length_is_cut_and_counted(world):
    """The tools' description made a 413-token opening for a 256-position model while the summary said nothing was
    truncated: an opening past data.max_prompt_length is cut like a long prompt row (its start and end kept) and
    counted in episode/opening_cut."""
    from rlhfkit.tools import resolve_tools

    tok, model, engine, plan, template = world
    rows = [{**row, "messages": [{"role": "user", "content": "say " + row["fields"]["name"]}]}
            for row in rows_for(tok, template, NAMES[:4])]
    renderer = TurnRenderer(template, resolve_tools(["calculator"]))
    full = [renderer.opening(row["messages"])[0] for row in rows]
    longest = max(map(len, full))
    for budget, cut in ((longest + 5, 0.0), (longest - 20, 1.0)):
        runner = EpisodeRollout(NativeRollout(model, engine, tok, plan), WithTools,
                                EpisodeSection(max_turns=2, max_tokens=32), template, engine,
                                resolve_tools(WithTools.tools), max_prompt_length=budget)
        batch = runner.generate(rows, GenConfig(max_new_tokens=4))
        assert episode_metrics(batch)["episode/opening_cut"] == cut
        lengths = batch.prompt_mask.sum(-1).tolist()
        assert lengths == [min(len(ids), budget) for ids in full], (lengths, budget)
    ids = batch.prompt_ids[0][batch.prompt_mask[0].bool()].tolist()
    assert ids[-6:] == full[0][-6:]  # the question's end kept (the tools' part, over half the budget, is not)


def test_a_tools_description_that_fills_the_prompt_budget_is_refused_before_models_load(tiny_model_dir):
    from rlhfkit.config.ppo_schema import PPODataConfig
    from rlhfkit.errors import ConfigError
    from rlhfkit.models import load_tokenizer
    from rlhfkit.rollout.episodes import check_opening
    from rlhfkit.tools import resolve_tools

    tok, tools = load_tokenizer(str(tiny_model_dir)), resolve_tools(["calculator"])
    positions = type("Config", (), {"max_position_embeddings": 4096})()
    length = TurnRenderer(Template.for_tokenizer(tok, "auto"), tools).tools_length()
    assert length > 50
    check_opening(PPODataConfig(max_prompt_length=length + 20), tok, tools, positions)  # room left for a question
    with pytest.raises(ConfigError, match=f"data.max_prompt_length': the tools' description alone takes {length} "
                                          f"tokens of every episode's opening, and data.max_prompt_length={length}"):
        check_opening(PPODataConfig(max_prompt_length=length), tok, tools, positions)
    with pytest.raises(ConfigError, match=f"past the model's 40 positions"):
        check_opening(PPODataConfig(max_prompt_length=4096), tok, tools, type("Config", (), {"max_position_embeddings": 40})())
