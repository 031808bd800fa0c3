"""`rlhfkit ppo` end to end on tiny models: it learns, the KL term holds it back, every option exports.

The world: prompts "say NAME"; the SFT policy answers "NAME" repeated 1-4 times (uniformly, as in its data).
The reward is a Python function of the text, 1 - |words - 4| / 4, so the SFT policy scores ~0.63 and the best
policy (always four words) scores 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from conftest import ALPACA, HH, NAMES, STORIES, needs_shared, read_metrics, run_cli, write_jsonl

KL_BUDGET = 8.0  # nats per sequence, for every iteration: with kl_coef 0.05 the final policy ends at 1-4
# (seeds 0-3), single iterations of 16 samples reach ~6; a policy running away from the reference goes far past
PPO_KEYS = ("reward/mean", "reward/std", "kl", "kl_coef", "policy_loss", "value_loss", "clip_fraction", "approx_kl",
            "entropy", "response_length", "return/mean", "value/mean", "advantage/mean")
TINY_RUN = ["train.batch_size=16", "train.micro_batch_size=8", "train.lr=5e-4", "gen.max_new_tokens=20",
            "train.eval_every=10", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def world(ppo_world) -> Path:
    return ppo_world


def ppo(world: Path, out: str, *overrides: str) -> tuple[dict, str]:
    proc = run_cli("ppo", f"actor={world / 'sft' / 'final'}", "reward=rewards.py:four_words",
                   "data.prompts=prompts.jsonl", "data.eval_prompts=eval.jsonl", f"output_dir={world / out}",
                   *TINY_RUN, *overrides, cwd=world)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_ppo_raises_held_out_reward_within_kl_budget_and_kl_coef_holds_it_back(world):
    low, _ = ppo(world, "low_kl", "train.max_steps=40", "ppo.kl_coef=0.05", "ppo.sample_every=10")
    high, _ = ppo(world, "high_kl", "train.max_steps=40", "ppo.kl_coef=1.0")

    gain = low["eval/reward_end"] - low["eval/reward_start"]
    assert low["eval/reward_start"] < 0.75  # the SFT policy: ~0.63
    assert gain > 0.2, low
    assert low["eval/kl_end"] < 5.0, low
    rows = read_metrics(world / "low_kl" / "metrics.jsonl")
    train_rows = [r for r in rows if "reward/mean" in r]
    assert len(train_rows) == 40 and all(r["kl"] < KL_BUDGET for r in train_rows)
    assert all(key in train_rows[-1] for key in PPO_KEYS), sorted(train_rows[-1])
    assert rows[0]["step"] == 0 and "eval/reward" in rows[0]
    samples = [json.loads(line) for line in (world / "low_kl" / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "response", "reward"} <= set(samples[0])

    # beta = 1: the KL term dominates a 0.25-per-word reward, so the policy stays near the reference
    assert high["eval/kl_end"] < 0.5 * low["eval/kl_end"], (high, low)
    assert high["eval/reward_end"] - high["eval/reward_start"] < gain - 0.15, (high, low)

    actor = AutoModelForCausalLM.from_pretrained(world / "low_kl" / "final")
    critic = AutoModelForSequenceClassification.from_pretrained(world / "low_kl" / "final-critic")
    assert critic.config.num_labels == 1 and actor.config.vocab_size == critic.config.vocab_size


def test_ppo_learns_in_bf16_mixed_precision_and_exports_float32(world):
    result, _ = ppo(world, "bf16", "train.max_steps=40", "ppo.kl_coef=0.05", "engine.precision=bf16")
    assert yaml.safe_load((world / "bf16" / "config.yaml").read_text())["engine"]["precision"] == "bf16"
    assert result["eval/reward_end"] > result["eval/reward_start"] + 0.2, result
    assert result["eval/kl_end"] < 5.0, result
    actor = AutoModelForCausalLM.from_pretrained(world / "bf16" / "final")
    assert all(p.dtype == torch.float32 for p in actor.parameters())  # the float32 master weights


def test_ppo_with_lora_ptx_ema_adaptive_kl_and_critic_warmup_exports_loadable_folders(world):
    result, stderr = ppo(world, "lora", "train.max_steps=6", "train.lr=3e-3", "lora.rank=8", "data.ptx=ptx.txt",
                         "ptx.coef=0.5", "ema.enabled=true", "gen.generation_batch_size=8", "ppo.mini_batch_size=8",
                         "ppo.epochs=2", "ppo.adaptive_kl=true", "ppo.kl_target=0.5", "ppo.kl_horizon=100",
                         "ppo.critic_warmup_iters=2", "train.save_every=3")
    assert "reference: the actor with its LoRA adapter disabled" in stderr
    rows = [r for r in read_metrics(world / "lora" / "metrics.jsonl") if "reward/mean" in r]
    assert [("policy_loss" in r) for r in rows] == [False, False, True, True, True, True]  # critic warm-up
    assert all("ptx_loss" in r for r in rows[2:]) and all(r["value_loss"] >= 0 for r in rows)
    assert len({round(r["kl_coef"], 8) for r in rows}) > 1  # the adaptive controller moved the coefficient
    assert (world / "lora" / "checkpoints" / "latest").is_file()

    out = world / "lora"
    for folder in ("final", "final-ema", "final-critic"):
        keys = load_file(str(out / folder / "model.safetensors"))
        assert not any("lora" in k or "base_model" in k for k in keys), folder  # merged, plain names
    sft = AutoModelForCausalLM.from_pretrained(world / "sft" / "final").state_dict()
    final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    ema = AutoModelForCausalLM.from_pretrained(out / "final-ema").state_dict()
    AutoModelForSequenceClassification.from_pretrained(out / "final-critic")

    def distance(a, b):
        return sum((a[k] - b[k]).pow(2).sum().item() for k in a) ** 0.5

    # the EMA (beta 0.992 over 8 actor steps) trails the trained actor: between it and the start
    assert 0 < distance(ema, sft) < distance(final, sft)


def test_ppo_resume_continues_exactly_where_it_stopped(world, tmp_path):
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.stages.ppo import run_ppo

    args = [f"actor={world / 'sft' / 'final'}", f"reward={world / 'rewards.py'}:four_words",
            f"data.prompts={world / 'prompts.jsonl'}", f"data.eval_prompts={world / 'eval.jsonl'}",
            f"output_dir={tmp_path / 'run'}", *TINY_RUN, "train.max_steps=4", "train.save_every=2",
            "ppo.adaptive_kl=true", "ppo.kl_target=0.5", "ppo.kl_horizon=100"]
    cfg = load_config(PPOConfig, None, args)
    run_ppo(cfg)
    uninterrupted = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    shutil.rmtree(tmp_path / "run" / "final")
    run_ppo(cfg, resume=True)  # restarts from checkpoints/step-2
    resumed = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    for key, value in uninterrupted.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=1e-6)
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4]  # rows after the checkpoint were dropped on resume and logged once again


def test_ppo_bad_reward_is_one_clear_error(world, capsys):
    from rlhfkit.cli import main

    code = main(["ppo", f"actor={world / 'sft' / 'final'}", f"reward={world / 'missing.py'}:score",
                 f"data.prompts={world / 'prompts.jsonl'}", f"output_dir={world / 'bad'}", "train.max_steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and "missing.py' does not exist" in err and "Traceback" not in err
    assert not (world / "bad").exists()  # nothing written for a run that could not start


@needs_shared
def test_ppo_end_to_end_on_stories260k_with_sft_and_reward_model_outputs(tmp_path):
    """The real chain: SFT of stories260K -> `rlhfkit rm` on Anthropic HH -> PPO with that RM (normalised)."""
    common = ["log.tensorboard=false", "train.batch_size=8", "train.micro_batch_size=8"]
    sft = run_cli("sft", f"model={STORIES}", f"data.train={ALPACA}", "data.max_rows=64",
                  "data.max_length=128", "train.max_steps=3", "train.lr=1e-3", f"output_dir={tmp_path / 'sft'}",
                  *common)
    assert sft.returncode == 0, sft.stderr[-3000:]
    sft_eval = [m["eval/loss"] for m in read_metrics(tmp_path / "sft" / "metrics.jsonl") if "eval/loss" in m]
    assert sft_eval[-1] < sft_eval[0] - 0.2  # it learned Alpaca's answers: measured 4.17 -> 3.67
    rm = run_cli("rm", f"model={tmp_path / 'sft' / 'final'}", f"data.train={HH}", "data.max_rows=64",
                 "data.max_length=128", "data.eval_max_rows=8", "train.max_steps=3", "rm.norm_samples=16",
                 f"output_dir={tmp_path / 'rm'}", *common)
    assert rm.returncode == 0, rm.stderr[-3000:]
    proc = run_cli("ppo", f"actor={tmp_path / 'sft' / 'final'}", f"reward={tmp_path / 'rm' / 'final'}",
                   f"data.prompts={HH}", "data.max_rows=48", "data.eval_max_rows=8", "data.max_prompt_length=64",
                   "gen.max_new_tokens=16", "train.max_steps=3", "train.micro_batch_size=4",
                   "ppo.normalize_reward=true", "ppo.sample_every=1", f"output_dir={tmp_path / 'ppo'}",
                   "log.tensorboard=false", "train.batch_size=8", f"eval.judge={tmp_path / 'rm' / 'final'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"critic: {tmp_path / 'rm' / 'final'}" in proc.stderr  # critic starts from the RM
    # an RM folder as the held-out judge, here the reward model itself: its eval/gold is the raw eval/reward of the
    # same responses at every evaluation, and best/ follows it
    evals = [r for r in read_metrics(tmp_path / "ppo" / "metrics.jsonl") if "eval/gold" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert all(r["eval/gold"] == pytest.approx(r["eval/reward"], abs=1e-6) for r in evals), evals
    assert json.loads((tmp_path / "ppo" / "best.json").read_text())["metric"] == "eval/gold"
    rows = [r for r in read_metrics(tmp_path / "ppo" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 3 and all(key in rows[-1] for key in PPO_KEYS)
    assert all(abs(r["kl"]) < KL_BUDGET for r in rows)
    # HH prompts are longer than data.max_prompt_length=64 here: samples show the prompt the actor read (the
    # template's opening, BOS included, and the end)
    samples = [json.loads(line) for line in (tmp_path / "ppo" / "samples.jsonl").read_text().splitlines()]
    cut = [s for s in samples if s.get("prompt_truncated")]
    assert cut, samples[0]
    tok = AutoTokenizer.from_pretrained(STORIES)
    for s in cut:
        assert s["prompt"].startswith(tok.bos_token + " User:") and s["prompt"].rstrip().endswith("Assistant:")
        assert len(tok(s["prompt"], add_special_tokens=False)["input_ids"]) <= 66
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ppo" / "final").config.vocab_size == 512
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "ppo" / "final-critic").config.num_labels == 1
