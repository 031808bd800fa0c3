"""PPO update: micro-batch x accumulation invariance, LoRA reference, EMA, config validation."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace

import pytest
import torch

from rlhfkit.config.fields import ConfigError, from_dict, help_text
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.data.templates import Template, encode_prompt
from rlhfkit.engine.local import LocalEngine
from rlhfkit.errors import DataError
from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer
from rlhfkit.models.ema import EMA
from rlhfkit.rollout import add_advantages, add_model_outputs, generate_all
from rlhfkit.rollout.experience import add_rewards
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.rollout.experience import response_logprobs
from rlhfkit.stages.ppo_setup import load_ppo_models
from rlhfkit.models.plan import REFERENCE
from rlhfkit.stages.ppo_update import PtxText, critic_update_with_values, ppo_update, single_step

PLANS = {"actor": REFERENCE, "critic": REFERENCE, "reference": REFERENCE}  # plain transformers forwards throughout


def prompt_rows(tok, prompts: list[str]) -> list[dict]:
    template = Template.for_tokenizer(tok)
    return [{"prompt_ids": encode_prompt(tok, template.prompt([{"role": "user", "content": p}])),
             "prompt_text": p, "messages": [{"role": "user", "content": p}]} for p in prompts]


def ppo_config(**sections) -> PPOConfig:
    base = {"actor": "unused", "reward": "unused.py:f", "data": {"prompts": "unused"},
            "train": {"max_steps": 1, "batch_size": 4, "micro_batch_size": 4, "lr": 1.0, "warmup_steps": 0,
                      "scheduler": "constant"},
            "gen": {"max_new_tokens": 6, "temperature": 0.8}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return from_dict(PPOConfig, base)


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    """A scored rollout of 4 prompts with different lengths (left padding) and different response lengths."""
    engine = LocalEngine()  # a GPU when there is one: models, rollout and updates all live on engine.device
    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    actor = load_causal_lm(str(tiny_model_dir), tokenizer=tok).to(engine.device)
    torch.manual_seed(0)
    critic = load_scalar_model(str(tiny_model_dir), tokenizer=tok).to(engine.device)
    cfg = ppo_config()
    rows = prompt_rows(tok, ["say apple", "say a river stone cloud", "say honey honey", "say tiger"])
    torch.manual_seed(1)
    batch = generate_all(actor, engine, tok, rows, cfg.gen, REFERENCE)
    batch.response_mask[0, 3:] = 0  # make the response lengths differ for sure
    batch = add_model_outputs(batch, actor, critic, actor, PLANS, cfg.gen.temperature, 4)
    batch.ref_logprobs = batch.ref_logprobs - 0.1 * torch.rand_like(batch.ref_logprobs) * batch.response_mask
    scores = torch.tensor([1.0, -0.5, 0.3, 2.0], device=engine.device)
    batch, _ = add_advantages(batch, scores, 0.1, cfg.ppo)
    return tok, actor, critic, batch


def one_update(tmp_path, rollout, micro: int, **sections) -> tuple[dict, list, list]:
    tok, actor, critic, batch = rollout
    cfg = ppo_config(**{**sections, "train": {"micro_batch_size": micro, **sections.get("train", {})}})
    engine = LocalEngine()
    a = engine.prepare(copy.deepcopy(actor), cfg.train, 10)
    c = engine.prepare(copy.deepcopy(critic), cfg.train, 10)
    # Adam's first step is ~lr * sign(g), blind to how the gradient is weighted; with eps = 1 it is ~lr * g,
    # so comparing parameters after one step compares the accumulated gradients themselves
    for group in a.optimizer.param_groups + c.optimizer.param_groups:
        group["eps"] = 1.0
    ptx = None
    if cfg.ptx.coef > 0:
        source = tmp_path / cfg.data.ptx
        source.write_text("say apple apple\n\nsay a river stone cloud green\n\nhoney\n\ntiger tiger")
        ptx = PtxText(str(source), tok, 32, seed=0)
    metrics = ppo_update(batch, a, c, cfg, engine, iteration=0, plans=PLANS, ptx=ptx, pad_id=tok.pad_token_id)
    return metrics, [p.detach().clone() for p in a.module.parameters()], [p.detach().clone() for p in
                                                                          c.module.parameters()]


@pytest.mark.parametrize("sections", [
    {},
    {"ppo": {"kl_loss_coef": 0.5, "epochs": 2, "mini_batch_size": 2}, "ptx": {"coef": 0.5, "batch_size": 4},
     "data": {"ptx": "ptx.txt"}},
    {"ppo": {"loss_aggregation": "seq-mean-token-mean", "clip_eps_high": 0.3, "dual_clip": 3.0}},
    {"ppo": {"loss_aggregation": "seq-mean-token-sum-norm", "ratio_level": "sequence"}},
    {"ppo": {"loss_aggregation": "seq-mean-token-sum"}},
    # the KL loss and the entropy bonus average like the policy loss, so they add up over micro-batches too
    {"ppo": {"loss_aggregation": "seq-mean-token-mean", "kl_loss_coef": 0.5, "entropy_coef": 0.1}},
    {"ppo": {"loss_aggregation": "seq-mean-token-sum", "kl_loss_coef": 0.5, "entropy_coef": 0.1}},
    {"ppo": {"loss_aggregation": "seq-mean-token-sum-norm", "kl_loss_coef": 0.5, "entropy_coef": 0.1}},
], ids=["plain", "kl_loss+epochs+minibatches+ptx", "seq-mean-token-mean+clip-higher+dual-clip", "dr-grpo-norm+gspo",
        "seq-mean-token-sum", "seq-mean-token-mean+kl+entropy", "seq-mean-token-sum+kl+entropy",
        "dr-grpo-norm+kl+entropy"])
def test_micro_batch_times_accumulation_invariance(tmp_path, rollout, sections):
    m1, actor1, critic1 = one_update(tmp_path, rollout, 1, **sections)  # micro 1 x accumulation 4 (or 2)
    m4, actor4, critic4 = one_update(tmp_path, rollout, sections.get("ppo", {}).get("mini_batch_size", 4), **sections)
    before = [p.detach() for p in rollout[1].parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(actor1, before)) > 1e-3  # the update did something
    for a, b in zip(actor1 + critic1, actor4 + critic4):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    for key in ("policy_loss", "value_loss", "entropy", "clip_fraction"):
        assert m1[key] == pytest.approx(m4[key], abs=1e-5)
    if "ptx" in sections:
        assert m1["ptx_loss"] == pytest.approx(m4["ptx_loss"], rel=1e-5)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                         "seq-mean-token-sum-norm"])
def test_a_row_left_out_of_the_update_counts_as_if_it_were_not_there(tmp_path, rollout, aggregation):
    """A row whose mask is all 0 (a filtered group, a masked truncated response) changes no loss and no count:
    the step equals the step on the batch without it, in every aggregation."""
    tok, actor, critic, batch = rollout
    mask = batch.response_mask.clone()
    mask[1] = 0
    masked = (tok, actor, critic, replace(batch, response_mask=mask))
    without = (tok, actor, critic, batch.select([0, 2, 3]))
    ppo = {"loss_aggregation": aggregation, "kl_loss_coef": 0.5, "entropy_coef": 0.1}
    m4, actor4, critic4 = one_update(tmp_path, masked, 2, ppo=ppo)
    m3, actor3, critic3 = one_update(tmp_path, without, 3, ppo=ppo, train={"batch_size": 3})
    for a, b in zip(actor4 + critic4, actor3 + critic3):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    for key in ("policy_loss", "value_loss", "kl_loss", "entropy"):
        assert m4[key] == pytest.approx(m3[key], abs=1e-5), key


def test_a_mini_batch_with_every_row_left_out_takes_no_step(rollout):
    """Every row masked (all groups filtered, every response truncated): no optimizer step, so neither Adam's
    momentum from an earlier step nor weight decay moves the weights; the fused critic path does the same."""
    tok, actor, critic, batch = rollout
    cfg = ppo_config(train={"micro_batch_size": 2, "weight_decay": 0.1})
    engine = LocalEngine()
    a, c = engine.prepare(copy.deepcopy(actor), cfg.train, 10), engine.prepare(copy.deepcopy(critic), cfg.train, 10)
    ppo_update(batch, a, c, cfg, engine, iteration=0, plans=PLANS)  # a real step first: Adam now has momentum
    before = [p.detach().clone() for p in list(a.module.parameters()) + list(c.module.parameters())]
    empty = replace(batch, response_mask=torch.zeros_like(batch.response_mask))
    metrics = ppo_update(empty, a, c, cfg, engine, iteration=1, plans=PLANS)
    after = list(a.module.parameters()) + list(c.module.parameters())
    assert all(torch.equal(x, y) for x, y in zip(before, after)) and metrics["empty_steps"] == 1.0
    _, _, critic_metrics = critic_update_with_values(add_rewards(empty, batch.scores, 0.1, cfg.ppo), c, cfg, engine,
                                                     REFERENCE)
    assert all(torch.equal(x, y) for x, y in zip(before[-len(list(c.module.parameters())):], c.module.parameters()))
    assert critic_metrics["empty_steps"] == 1.0


def test_critic_update_with_values_equals_values_then_update(rollout):
    """One optimizer step per rollout: one critic forward per micro-batch gives the values, advantages and the
    critic's step that a values pass followed by ppo_update's critic step give."""
    tok, actor, critic, batch = rollout
    cfg = ppo_config(train={"micro_batch_size": 2})
    engine = LocalEngine()
    assert single_step(cfg)
    separate_critic, fused_critic = (engine.prepare(copy.deepcopy(critic), cfg.train, 10) for _ in range(2))
    for group in separate_critic.optimizer.param_groups + fused_critic.optimizer.param_groups:
        group["eps"] = 1.0  # as in one_update: parameters after one Adam step then compare the gradients
    frozen_actor = engine.prepare(copy.deepcopy(actor), cfg.train, 10)

    with_values = replace(batch, values=add_model_outputs(batch, actor, separate_critic.module, actor, PLANS, 0.8,
                                                          2).values)
    separate, separate_adv = add_advantages(with_values, batch.scores, 0.1, cfg.ppo)
    separate_metrics = ppo_update(separate, frozen_actor, separate_critic, cfg, engine, 0, PLANS, update_actor=False)
    fused, fused_adv, fused_metrics = critic_update_with_values(add_rewards(batch, batch.scores, 0.1, cfg.ppo),
                                                                fused_critic, cfg, engine, REFERENCE)

    for key in ("values", "advantages", "returns"):
        torch.testing.assert_close(getattr(fused, key), getattr(separate, key), atol=1e-5, rtol=1e-5)
    for a, b in zip(fused_critic.module.parameters(), separate_critic.module.parameters()):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(fused_critic.module.parameters(), critic.parameters())) > 0
    for key in ("value_loss", "critic_grad_norm"):
        assert fused_metrics[key] == pytest.approx(separate_metrics[key], rel=1e-4)
    separate_adv.pop("kl")  # the rollout's KL: measured before either path (experience step 3)
    assert fused_adv == pytest.approx(separate_adv, rel=1e-4, abs=1e-6)


def test_lora_reference_is_the_actor_with_its_adapter_disabled(tmp_path, tiny_model_dir, rollout):
    (tmp_path / "r.py").write_text("def f(prompts, responses):\n    return [0.0] * len(responses)\n")
    cfg = ppo_config(actor=str(tiny_model_dir), reward=f"{tmp_path / 'r.py'}:f",
                     lora={"rank": 4, "alpha": 8.0})
    tok, plain_actor, _, batch = rollout
    models = load_ppo_models(cfg, tok, LocalEngine(), 10)
    assert models.reference is None and any("adapter disabled" in n for n in models.notes)
    # make the adapter non-zero (a fresh LoRA B is 0), as training would
    with torch.no_grad():
        for name, p in models.actor.module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    with_ref = add_model_outputs(batch, models.actor.module, models.critic.module, None, models.plans, 0.8, 4)
    base = response_logprobs(plain_actor, batch, REFERENCE, 0.8) * batch.response_mask
    torch.testing.assert_close(with_ref.ref_logprobs, base, atol=1e-5, rtol=1e-5)
    assert (with_ref.old_logprobs - base).abs().max() > 1e-2  # the adapted actor itself differs


def test_rl_models_on_a_cpu_keep_zeroed_gradients_of_their_trainable_parameters(tmp_path, tiny_model_dir, rollout):
    (tmp_path / "r.py").write_text("def f(prompts, responses):\n    return [0.0] * len(responses)\n")
    cfg = ppo_config(actor=str(tiny_model_dir), reward=f"{tmp_path / 'r.py'}:f", lora={"rank": 4, "alpha": 8.0})
    models = load_ppo_models(cfg, rollout[0], LocalEngine(), 10)
    for trainable in (models.actor, models.critic):
        params = dict(trainable.module.named_parameters())
        kept = {n for n, p in params.items() if p.grad is not None}
        assert kept == {n for n, p in params.items() if p.requires_grad} and kept  # the adapters (and value head)
        assert all(not params[n].grad.any() for n in kept)
        grads = {n: params[n].grad for n in kept}
        trainable.module(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
        trainable.step()  # zeroed in place, not freed: the same tensors for the next iteration
        assert all(params[n].grad is grads[n] and not grads[n].any() for n in kept)


def test_ema_averages_and_swaps_back():
    layer = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    ema = EMA(layer, LocalEngine(), beta=0.9)
    with torch.no_grad():
        layer.weight.fill_(3.0)
    ema.update(layer)
    torch.testing.assert_close(ema.shadow["weight"], torch.full((1, 2), 1.2))  # 0.9 * 1 + 0.1 * 3
    with ema.swapped_in(layer):
        assert torch.allclose(layer.weight, torch.tensor(1.2))
    assert torch.allclose(layer.weight, torch.tensor(3.0))
    resumed = EMA(layer, LocalEngine(), beta=0.5)  # a resume with another ema.beta: the shadow, the new beta
    resumed.load_state_dict(ema.state_dict())
    assert resumed.beta == 0.5
    with torch.no_grad():
        layer.weight.fill_(2.0)
    resumed.update(layer)
    torch.testing.assert_close(resumed.shadow["weight"], torch.full((1, 2), 1.6))  # 0.5 * 1.2 + 0.5 * 2


def test_config_errors_name_the_key_and_help_lists_fields(tmp_path):
    with pytest.raises(ConfigError, match="'actor'"):
        from_dict(PPOConfig, {"reward": "x:f", "data": {"prompts": "p"}, "train": {"max_steps": 1}})
    with pytest.raises(ConfigError, match="'data.ptx'"):
        ppo_config(ptx={"coef": 0.1})
    with pytest.raises(ConfigError, match="'ppo.mini_batch_size'"):
        ppo_config(ppo={"mini_batch_size": 3})
    # without ppo.mini_batch_size the error names the key the user set, not the one they never touched
    with pytest.raises(ConfigError) as err:
        ppo_config(train={"batch_size": 6, "micro_batch_size": 4})
    assert str(err.value) == ("config key 'train.micro_batch_size': 4 must divide the iteration's 6 samples "
                              "(train.batch_size x ppo.n_samples_per_prompt)")
    with pytest.raises(ConfigError, match="unknown config key 'ppo.kl_coeff'"):
        ppo_config(ppo={"kl_coeff": 0.1})
    with pytest.raises(ConfigError, match="'gen.temperature'"):
        ppo_config(gen={"temperature": 0.0})
    fields = help_text(PPOConfig)
    for key in ("ppo.kl_coef", "ppo.critic_lr", "gen.top_p", "ptx.coef", "ema.beta", "data.max_prompt_length"):
        assert key in fields


def test_advantage_estimators_are_a_table_the_config_names():
    """`ppo.advantage_estimator` offers exactly the table's entries; GAE's entry is compute_gae on the batch."""
    import dataclasses

    from rlhfkit.algos import compute_gae
    from rlhfkit.config.ppo_schema import PPOSection
    from rlhfkit.registry.estimators import ESTIMATORS

    field = {f.name: f for f in dataclasses.fields(PPOSection)}["advantage_estimator"]
    assert tuple(field.metadata["choices"]) == tuple(ESTIMATORS)
    torch.manual_seed(0)
    batch = RolloutBatch(prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1),
                         response_ids=torch.ones(2, 3, dtype=torch.long),
                         response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
                         prompt_texts=["a", "b"], response_texts=["c", "d"], messages=[None, None],
                         rewards=torch.randn(2, 3), values=torch.randn(2, 3))
    cfg = PPOSection(gamma=0.9, lam=0.8)
    got = ESTIMATORS["gae"].advantages(batch, cfg)
    want = compute_gae(batch.rewards, batch.values, batch.response_mask, 0.9, 0.8)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert ESTIMATORS["gae"].critic and ESTIMATORS["gae"].row_local


def test_entropy_bonus_and_kl_clamp_enter_the_actor_loss_as_written(rollout):
    from rlhfkit.algos import entropy_from_logits, kl_penalty, masked_mean
    from rlhfkit.rollout.experience import response_logits
    from rlhfkit.stages.ppo_update import actor_loss

    tok, actor, _, batch = rollout
    plain, stats = actor_loss(actor, batch, ppo_config().ppo, 0.8, 6, REFERENCE)
    bonus, _ = actor_loss(actor, batch, ppo_config(ppo={"entropy_coef": 0.3}).ppo, 0.8, 6, REFERENCE)
    entropy = masked_mean(entropy_from_logits(response_logits(actor, batch, REFERENCE, 0.8)), batch.response_mask)
    assert bonus.item() == pytest.approx(plain.item() - 0.3 * entropy.item(), abs=1e-6)
    assert stats["entropy"] == pytest.approx(entropy.item(), abs=1e-6)
    # the k3 loss term with its estimate clamped at 0.01 per token
    clamped, cstats = actor_loss(actor, batch, ppo_config(ppo={"kl_loss_coef": 2.0, "kl_clamp": 0.01}).ppo, 0.8, 6,
                                 REFERENCE)
    logp = token_logprobs_of(actor, batch)
    want = masked_mean(kl_penalty(logp, batch.ref_logprobs, "k3").clamp(-0.01, 0.01), batch.response_mask)
    assert cstats["kl_loss"] == pytest.approx(want.item(), abs=1e-6) and cstats["kl_loss"] <= 0.01
    assert clamped.item() == pytest.approx(plain.item() + 2.0 * want.item(), abs=1e-6)


def token_logprobs_of(actor, batch):
    from rlhfkit.rollout.experience import response_logprobs

    return response_logprobs(actor, batch, REFERENCE, 0.8)


def test_a_zero_value_head_starts_every_value_at_zero_and_bf16_recomputes_old_logprobs(tmp_path, tiny_model_dir,
                                                                                      rollout):
    from rlhfkit.rollout.experience import response_values
    from rlhfkit.stages.ppo_steps import PPOSteps

    (tmp_path / "r.py").write_text("def f(prompts, responses):\n    return [0.0] * len(responses)\n")
    tok, _, _, batch = rollout
    cfg = ppo_config(actor=str(tiny_model_dir), reward=f"{tmp_path / 'r.py'}:f", ppo={"value_head_init": "zero"})
    models = load_ppo_models(cfg, tok, LocalEngine(), 10)
    assert any("fresh value head" in n for n in models.notes)
    with torch.no_grad():
        assert response_values(models.critic.module, batch, models.plans["critic"]).abs().max().item() == 0.0
    assert not PPOSteps(cfg, models, tok, LocalEngine()).recompute_old  # float32: the sampling log-probs
    bf16 = ppo_config(actor=str(tiny_model_dir), reward=f"{tmp_path / 'r.py'}:f", engine={"precision": "bf16"})
    assert PPOSteps(bf16, models, tok, LocalEngine()).recompute_old
    forced = ppo_config(actor=str(tiny_model_dir), reward=f"{tmp_path / 'r.py'}:f", ppo={"old_logprobs": "sampling"},
                        engine={"precision": "bf16"})
    assert not PPOSteps(forced, models, tok, LocalEngine()).recompute_old


def test_a_zero_value_head_is_zero_however_critic_names_the_causal_lm_folder(tmp_path, tiny_model_dir, rollout):
    """critic=./actor, an absolute path, or another causal LM's folder: the critic gets a fresh head, which
    value_head_init=zero must zero (before, only the exact actor string did, and the others kept a random one)."""
    import os
    import shutil

    from rlhfkit.rollout.experience import response_values

    (tmp_path / "r.py").write_text("def f(prompts, responses):\n    return [0.0] * len(responses)\n")
    tok, _, _, batch = rollout
    other = shutil.copytree(tiny_model_dir, tmp_path / "other")
    for critic in (os.path.relpath(tiny_model_dir), str(other)):
        cfg = ppo_config(actor=str(tiny_model_dir), critic=critic, reward=f"{tmp_path / 'r.py'}:f",
                         ppo={"value_head_init": "zero"})
        models = load_ppo_models(cfg, tok, LocalEngine(), 10)
        assert f"critic: {critic} (fresh value head)" in models.notes
        with torch.no_grad():
            assert response_values(models.critic.module, batch, models.plans["critic"]).abs().max().item() == 0.0


@pytest.mark.parametrize("second,expected", [
    ({"text": None}, ":2: field 'text': expected a string, got null"),
    ({"text": 7}, ":2: field 'text': expected a string, got int"),
    ({"body": "a b c"}, ":2: PPO-ptx text needs a `text` field (found ['body']); a .txt file works as it is"),
])
def test_ptx_rows_without_a_text_string_name_their_line(tmp_path, rollout, second, expected):
    """Every PPO-ptx row is checked (a null text was trained on as the word "None", later rows without one were
    dropped silently)."""
    tok = rollout[0]
    source = tmp_path / "ptx.jsonl"
    source.write_text(json.dumps({"text": "say apple apple"}) + "\n" + json.dumps(second) + "\n")
    with pytest.raises(DataError) as err:
        PtxText(str(source), tok, 32, seed=0)
    assert str(err.value) == f"{source}{expected}"


@pytest.mark.parametrize("sections,ranks,key", [
    ({"train": {"batch_size": 10, "micro_batch_size": 2}}, 4, "train.batch_size"),  # 2 prompts would be dropped
    ({"train": {"batch_size": 2, "micro_batch_size": 1}}, 4, "train.batch_size"),  # 2 ranks with no prompt
    ({"train": {"batch_size": 12, "micro_batch_size": 2}, "ppo": {"mini_batch_size": 6}}, 4, "ppo.mini_batch_size"),
    ({"train": {"batch_size": 8, "micro_batch_size": 2}, "ppo": {"mini_batch_size": 2}}, 4, "ppo.mini_batch_size"),
    ({"train": {"batch_size": 8, "micro_batch_size": 2}, "ptx": {"coef": 0.1, "batch_size": 6},
      "data": {"ptx": "t.txt"}}, 4, "ptx.batch_size"),
])
def test_ppo_batches_must_split_evenly_over_the_ranks(sections, ranks, key):
    from rlhfkit.stages.ppo_steps import check_ranks

    cfg = ppo_config(**sections)
    check_ranks(cfg, 1)  # one rank: the config is valid
    with pytest.raises(ConfigError, match=f"^config key '{re.escape(key)}': .* {ranks} ranks"):
        check_ranks(cfg, ranks)
    check_ranks(ppo_config(train={"batch_size": 8, "micro_batch_size": 2}, ppo={"mini_batch_size": 8}), 4)
    check_ranks(ppo_config(train={"batch_size": 4, "micro_batch_size": 4}), 2)  # 2 samples a rank: a smaller micro


def test_rows_left_out_of_the_update_do_not_dilute_kl_or_lengths():
    """A masked row (unjudged, filtered, truncated under ppo.mask_truncated) has an all-zero mask: its length is
    still the one sampled, and the KL per sequence (what the adaptive controller follows) averages the kept rows."""
    from types import SimpleNamespace

    from rlhfkit.algos import FixedKLController
    from rlhfkit.rollout.experience import kl_per_sequence
    from rlhfkit.stages.ppo_steps import PPOSteps, Scored

    mask = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])  # row 0: masked out
    batch = SimpleNamespace(kl=torch.full((3, 4), 0.5), response_mask=mask)
    kept = torch.tensor([False, True, True])
    assert kl_per_sequence(batch, kept) == pytest.approx((1.0 + 1.5) / 2)  # not (0 + 1.0 + 1.5) / 3
    assert kl_per_sequence(batch, torch.zeros(3, dtype=torch.bool)) == 0.0
    scored = Scored(SimpleNamespace(response_mask=mask), raw=torch.tensor([1.0, 0.0, 1.0]),
                    scores=torch.tensor([1.0, 0.0, 1.0]), finished=torch.tensor([False, True, True]),
                    judged=torch.ones(3, dtype=torch.bool), dropped={"response/masked_truncated": 1.0}, kept=kept,
                    lengths=torch.tensor([4, 2, 3]))
    steps = SimpleNamespace(models=SimpleNamespace(reward=None), cfg=ppo_config(), kl_ctl=FixedKLController(0.05),
                            context=None)
    metrics = PPOSteps.rollout_metrics(steps, scored)
    assert metrics["response_length"] == 3.0 and metrics["response/masked_truncated"] == 1.0


def test_past_the_models_positions_counts_prompt_and_response_as_sampled():
    """A row past the model's positions: its prompt and its response as sampled (a masked row's too), or an
    episode's whole trajectory (the environment's tokens count: the model read them)."""
    from types import SimpleNamespace

    from rlhfkit.stages.ppo_steps import Scored, past_context

    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])  # 2, 3, 3 prompt tokens (left-padded)
    lengths = torch.tensor([6, 5, 6])  # as sampled; row 2 was masked out of the update afterwards
    single = Scored(SimpleNamespace(prompt_mask=prompt_mask, response_attention=None), raw=None, scores=None,
                    finished=None, judged=None, dropped={}, kept=None, lengths=lengths)
    assert past_context(single, 8).tolist() == [False, False, True]  # 8, 8, 9 tokens
    assert past_context(single, None).tolist() == [False, False, False]  # positions unknown: nothing said
    episode = Scored(SimpleNamespace(prompt_mask=prompt_mask, response_attention=torch.tensor(
        [[1] * 7, [1] * 4 + [0] * 3, [1] * 5 + [0] * 2])), raw=None, scores=None, finished=None, judged=None,
        dropped={}, kept=None, lengths=torch.tensor([3, 2, 2]))  # the model's own tokens: fewer
    assert past_context(episode, 8).tolist() == [True, False, False]  # 9, 7, 8


def test_reward_and_kl_statistics_pool_every_ranks_values():
    """reward/mean, reward/std and kl are the statistics of all ranks' judged (kept) rows, not the mean over ranks
    of each rank's: two ranks that judged 1 and 3 responses give the 4 values' mean and unbiased std."""
    from rlhfkit.stages.ppo_steps import moments, pool_moments

    ranks = [torch.tensor([4.0]), torch.tensor([0.0, 1.0, 2.0])]
    kls = [torch.tensor([2.0, 2.0, 2.0]), torch.tensor([8.0])]
    local = [{**moments("reward", r, squares=True), **moments("kl", k), "score/mean": 1.0} for r, k in zip(ranks, kls)]
    averaged = {key: sum(m[key] for m in local) / 2 for key in local[0]}  # what engine.reduce_mean returns
    pooled = pool_moments(averaged, world_size=2)
    everything = torch.cat(ranks)
    assert pooled["reward/mean"] == pytest.approx(everything.mean().item())  # 1.75, not (4 + 1) / 2
    assert pooled["reward/std"] == pytest.approx(everything.std().item())  # 1.708, not the mean of 0 and 1
    assert pooled["kl"] == pytest.approx(3.5)  # (2 + 2 + 2 + 8) / 4, not (2 + 8) / 2
    assert pooled["score/mean"] == 1.0 and not any("/_" in key for key in pooled)
    one = pool_moments({**moments("reward", ranks[1], squares=True), **moments("kl", kls[0])}, world_size=1)
    assert one["reward/mean"] == pytest.approx(1.0) and one["reward/std"] == pytest.approx(1.0)
    none = pool_moments({**moments("reward", torch.zeros(0), squares=True), **moments("kl", torch.zeros(0))}, 1)
    assert none["reward/mean"] == none["reward/std"] == none["kl"] == 0.0
    single = pool_moments(moments("reward", torch.tensor([3.0]), squares=True), 1)
    assert single["reward/mean"] == 3.0 and single["reward/std"] == 0.0
