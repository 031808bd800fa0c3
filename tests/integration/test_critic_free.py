"""Critic-free estimators end to end through `rlhfkit ppo` on the toy world: each learns, loads no critic and
saves none, keeps its groups together, and resumes mid-run.

The world (conftest.ppo_world): prompts "say NAME", the SFT policy answers NAME 1-4 times, the reward is
1 - |words - 4| / 4 (SFT policy ~0.63, best 1).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from conftest import read_metrics, run_cli, speed_plan

pytestmark = pytest.mark.slow

# 8 prompts x 4 samples: 32 responses per iteration; KL as a k3 loss (GRPO's default), none in the reward
GROUP_RUN = ["train.batch_size=8", "ppo.n_samples_per_prompt=4", "train.micro_batch_size=16", "train.lr=5e-4",
             "gen.max_new_tokens=12", "train.eval_every=0", "ppo.kl_coef=0", "ppo.kl_loss_coef=0.05",
             "log.tensorboard=false", "ppo.sample_every=0", "train.save_every=0"]


def run(world, out, *overrides):
    proc = run_cli("ppo", f"actor={world / 'sft' / 'final'}", "reward=rewards.py:four_words",
                   "data.prompts=prompts.jsonl", "data.eval_prompts=eval.jsonl", f"output_dir={world / out}",
                   *GROUP_RUN, *overrides, cwd=world)
    return proc


@pytest.mark.parametrize("estimator, extra", [
    ("grpo", []),
    ("rloo", []),
    ("reinforce_pp", ["ppo.n_samples_per_prompt=1", "train.batch_size=32", "ppo.kl_coef=0.01"]),
    # with an adaptive reward-KL coefficient: kl_horizon counts samples (8 prompts x 4 each per iteration)
    ("reinforce_pp_baseline", ["ppo.kl_coef=0.01", "ppo.adaptive_kl=true", "ppo.kl_target=0.5",
                               "ppo.kl_horizon=1000"]),
])
def test_each_critic_free_estimator_learns_without_a_critic(ppo_world, estimator, extra):
    proc = run(ppo_world, f"cf_{estimator}", f"ppo.advantage_estimator={estimator}", "train.max_steps=15", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["eval/reward_end"] > result["eval/reward_start"] + 0.15, result
    out = ppo_world / f"cf_{estimator}"
    assert f"no critic ({estimator}" in proc.stderr
    # the policies' log-prob forwards run a group's prompt (or a shared prefix) once in one packed row
    on, _ = speed_plan(proc.stderr)
    assert on["one packed row per group"] == "actor, reference", on
    assert not (out / "final-critic").exists()
    AutoModelForCausalLM.from_pretrained(out / "final")
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 15 and "value_loss" not in rows[-1] and "critic_lr" not in rows[-1]
    if estimator != "reinforce_pp":
        assert 0.0 <= rows[0]["group/all_equal"] <= 1.0
    # the reward's KL coefficient is logged where it applies; grpo and rloo have KL as a loss, and say so
    assert ("kl_coef" in rows[0]) == (estimator not in ("grpo", "rloo"))
    if estimator in ("grpo", "rloo"):
        assert "KL to the reference: a k3 loss x 0.05" in proc.stderr
    if estimator == "reinforce_pp_baseline":  # Ziegler et al.: beta *= 1 + clip(KL / target - 1, +-0.2) x n / H
        for row, after in zip(rows, rows[1:]):
            step = min(max(row["kl"] / 0.5 - 1, -0.2), 0.2) * 32 / 1000
            assert after["kl_coef"] == pytest.approx(row["kl_coef"] * (1 + step), rel=1e-9)


def test_grpo_with_dr_grpo_dapo_and_gspo_loss_options_learns(ppo_world):
    """Dr.GRPO (no std, constant-length normaliser), DAPO's clip-higher, dual-clip, GSPO's sequence ratio and a
    clamped log-ratio, over 2 epochs of 2 mini-batches: the options run together and still learn."""
    proc = run(ppo_world, "cf_options", "ppo.advantage_estimator=grpo", "ppo.grpo_scale_by_std=false",
               "ppo.loss_aggregation=seq-mean-token-sum-norm", "ppo.clip_eps_high=0.28", "ppo.dual_clip=3.0",
               "ppo.ratio_level=sequence", "ppo.log_ratio_clamp=20", "ppo.epochs=2", "ppo.mini_batch_size=16",
               "train.max_steps=15", "train.lr=1e-3", "ppo.gamma=0.99")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no effect with grpo: ppo.gamma=0.99" in proc.stderr  # GAE's discount: named, not silently ignored
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["eval/reward_end"] > result["eval/reward_start"] + 0.1, result


def test_grpo_resume_continues_exactly_where_it_stopped(ppo_world, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file

    from rlhfkit.config.fields import load_config
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.stages.ppo import run_ppo

    args = [f"actor={ppo_world / 'sft' / 'final'}", f"reward={ppo_world / 'rewards.py'}:four_words",
            f"data.prompts={ppo_world / 'prompts.jsonl'}", f"data.eval_prompts={ppo_world / 'eval.jsonl'}",
            f"output_dir={tmp_path / 'run'}", *GROUP_RUN, "ppo.advantage_estimator=grpo", "train.max_steps=4",
            "train.save_every=2"]
    cfg = load_config(PPOConfig, None, args)
    run_ppo(cfg)
    uninterrupted = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step-00000002").iterdir()) == \
        ["actor.optim.pt", "actor.safetensors", "manifest.json", "state.pt"]  # no critic in the checkpoint either
    shutil.rmtree(tmp_path / "run" / "final")
    run_ppo(cfg, resume=True)  # restarts from checkpoints/step-2
    resumed = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    for key, value in uninterrupted.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=1"],
     "config key 'ppo.n_samples_per_prompt': grpo compares the samples of one prompt, so it needs at least 2"),
    (["ppo.advantage_estimator=rloo", "critic=somewhere"], "config key 'critic': rloo needs no critic"),
    (["ppo.advantage_estimator=grpo", "ppo.mini_batch_size=24"], "config key 'ppo.mini_batch_size': 24 must divide "
                                                                  "the iteration's 32 samples"),
])
def test_group_settings_that_cannot_work_are_one_clear_error(ppo_world, overrides, message):
    proc = run(ppo_world, "cf_bad", *overrides, "train.max_steps=1")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (ppo_world / "cf_bad").exists()


def test_a_verifiable_reward_reads_the_answer_column_of_each_prompt_row(ppo_world, tmp_path):
    """The reward is exact match against the row's own `answer` field (four repetitions of the name): the SFT
    policy says the name 1-4 times, so about a quarter of its answers match at first; GRPO raises that."""
    from conftest import NAMES, write_jsonl

    def rows(names, repeat):
        return [{"prompt": f"say {n}", "answer": " ".join([n] * 4)} for n in names] * repeat

    write_jsonl(tmp_path / "prompts.jsonl", rows(NAMES[:16], 2))
    write_jsonl(tmp_path / "eval.jsonl", rows(NAMES[16:], 8))
    (tmp_path / "exact.py").write_text("def exact(prompts, responses, answer):\n"
                                      "    return [float(r.split() == a.split()) for r, a in zip(responses, answer)]\n")
    proc = run_cli("ppo", f"actor={ppo_world / 'sft' / 'final'}", f"reward={tmp_path / 'exact.py'}:exact",
                   f"data.prompts={tmp_path / 'prompts.jsonl'}", f"data.eval_prompts={tmp_path / 'eval.jsonl'}",
                   f"output_dir={tmp_path / 'run'}", *GROUP_RUN, "ppo.advantage_estimator=grpo", "train.max_steps=15")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["eval/reward_start"] < 0.5 and result["eval/reward_end"] > result["eval/reward_start"] + 0.2, result


def test_weighted_rewards_are_logged_by_name_and_unjudged_responses_are_left_out(ppo_world, tmp_path):
    """Two reward functions summed with weights; the second cannot judge one-word answers (None): those are
    counted, masked out of the update, and the run still learns."""
    (tmp_path / "picky.py").write_text("def picky(prompts, responses):\n"
                                      "    return [None if len(r.split()) == 1 else 1.0 for r in responses]\n")
    config = tmp_path / "rewards.yaml"
    config.write_text(f"reward:\n  - {{reward: '{ppo_world / 'rewards.py'}:four_words', weight: 1.0}}\n"
                      f"  - {{reward: '{tmp_path / 'picky.py'}:picky', weight: 0.5, name: picky}}\n")
    proc = run_cli("ppo", "--config", str(config), f"actor={ppo_world / 'sft' / 'final'}",
                   f"data.prompts={ppo_world / 'prompts.jsonl'}", f"data.eval_prompts={ppo_world / 'eval.jsonl'}",
                   f"output_dir={tmp_path / 'run'}", *GROUP_RUN, "ppo.advantage_estimator=grpo", "train.max_steps=12",
                   "ppo.sample_every=1", "ppo.num_samples=16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x 0.5 as picky" in proc.stderr
    # said once, and written as null (never as a number) in samples.jsonl
    assert proc.stderr.count("were left unjudged (the reward returned None") == 1
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert any(s["reward"] is None for s in samples) and any(s["reward"] is not None for s in samples)
    assert all((s["reward"] is None) == (len(s["response"].split()) == 1) for s in samples), samples
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert rows[0]["reward/unjudged"] > 0  # the SFT policy answers with one word about a quarter of the time
    assert rows[0]["reward/picky"] == 1.0 and 0.0 < rows[0]["reward/four_words"] < 1.0
    words = [r["reward/four_words"] for r in rows]
    assert sum(words[-3:]) / 3 > sum(words[:3]) / 3 + 0.1, words  # it learned what the summed reward favours


def test_dapo_dynamic_sampling_and_overlong_masking_are_counted_and_still_learn(ppo_world):
    proc = run(ppo_world, "cf_dapo", "ppo.advantage_estimator=grpo", "ppo.filter_equal_groups=true",
               "ppo.mask_truncated=true", "gen.max_new_tokens=8", "ppo.clip_eps_high=0.28", "train.max_steps=15")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(ppo_world / "cf_dapo" / "metrics.jsonl") if "reward/mean" in r]
    # 8 tokens: "NAME NAME NAME NAME" (8 tokens with spaces) and its end cannot both fit, so truncated answers are
    # common (at 4 tokens nothing could finish and nothing was learned: 0.46 -> 0.49 in 15 iterations)
    assert sum(r["response/masked_truncated"] for r in rows) > 0
    # groups whose rewards are all alike are filtered out and counted (8 prompts a batch)
    assert any(r["group/filtered"] > 0 for r in rows)
    assert all(r["group/filtered"] == int(r["group/filtered"]) and 0 <= r["group/filtered"] <= 8 for r in rows)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["eval/reward_end"] > result["eval/reward_start"] + 0.1, result  # measured 0.68 -> 0.85
