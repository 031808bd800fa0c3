"""The DeepSpeed engine on 2 CPU ranks over gloo: ZeRO-2/3 match the local engine, export, resume, launchers."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import PLAIN_SPLIT, ROOT, check_pinned, read_metrics, run_cli, series_of, sft_rows, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ranks")]  # one multi-rank launch at a time under xdist


def launch(*args, nproc=2, launcher="torchrun", timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(29500 + os.getpid() % 1000), "-m", "rlhfkit", *args]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(nproc), "--master_port",
               str(30500 + os.getpid() % 1000), "--module", "rlhfkit", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sft_args(tmp_path_factory, tiny_model_dir):
    data = write_jsonl(tmp_path_factory.mktemp("ds") / "train.jsonl", sft_rows())
    return [f"model={tiny_model_dir}", f"data.train={data}", "train.max_steps=12", "train.batch_size=8",
            "train.micro_batch_size=2", "train.lr=1e-2", "train.eval_every=6", "data.eval_fraction=0.1",
            PLAIN_SPLIT]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, sft_args):
    out = tmp_path_factory.mktemp("local") / "run"
    res = run_cli("sft", *sft_args, f"output_dir={out}")
    assert res.returncode == 0, res.stderr
    return out


def weights(folder):
    return load_file(str(folder / "final" / "model.safetensors"))


def assert_same_weights(a, b, atol=5e-5):
    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=atol, rtol=1e-4)


def test_length_balanced_micro_batches_on_two_ranks_match_one_process(tmp_path, sft_args):
    """The default split (train.balance_micro_batches): each rank arranges its own share of the batch, so the
    micro-batches differ from one process's; the step's gradient, summed over micro-batches and ranks, does not."""
    balanced = [a for a in sft_args if a != PLAIN_SPLIT]
    local, ranks = tmp_path / "local", tmp_path / "ranks"
    res = run_cli("sft", *balanced, f"output_dir={local}")
    assert res.returncode == 0, res.stderr
    res = launch("sft", *balanced, f"output_dir={ranks}", "engine.backend=deepspeed", "engine.zero_stage=2")
    assert res.returncode == 0, res.stderr[-3000:]
    curves = [[m["eval/loss"] for m in read_metrics(out / "metrics.jsonl") if "eval/loss" in m]
              for out in (ranks, local)]
    assert curves[0][-1] < curves[0][0] - 1.0  # it learned
    assert curves[0] == pytest.approx(curves[1], abs=1e-4)
    assert_same_weights(ranks, local)


@pytest.mark.parametrize("stage, launcher", [(2, "torchrun"), (3, "deepspeed")])
def test_two_ranks_match_the_local_engine(tmp_path, sft_args, local_run, stage, launcher):
    out = tmp_path / "run"
    res = launch("sft", *sft_args, f"output_dir={out}", "engine.backend=deepspeed", f"engine.zero_stage={stage}",
                 launcher=launcher)
    assert res.returncode == 0, res.stderr[-3000:]
    evals = [m["eval/loss"] for m in read_metrics(out / "metrics.jsonl") if "eval/loss" in m]
    local = [m["eval/loss"] for m in read_metrics(local_run / "metrics.jsonl") if "eval/loss" in m]
    assert evals[-1] < evals[0] - 1.0  # it learned
    assert evals == pytest.approx(local, abs=1e-4)  # the same curve as one process with the same global batch
    check_pinned(f"zero{stage}/sft", series_of(read_metrics(out / "metrics.jsonl"), "loss", "eval/loss"))
    # ZeRO-3 export gathers the shards: the folder equals the local run's weights and loads in transformers
    assert_same_weights(out, local_run)
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_one_rank_zero0_matches_local(tmp_path, sft_args, local_run):
    out = tmp_path / "run"
    res = run_cli("sft", *sft_args, f"output_dir={out}", "engine.backend=deepspeed", "engine.zero_stage=0")
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
    local = [m["loss"] for m in read_metrics(local_run / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 12 and losses == pytest.approx(local, abs=1e-5)
    # ZeRO-0 fp32 steps a bare optimizer, which records no norm: the engine measures it, before clipping
    norms = [m.get("grad_norm") for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
    assert norms == pytest.approx([m["grad_norm"] for m in read_metrics(local_run / "metrics.jsonl") if "loss" in m],
                                  rel=1e-4)


def test_ppo_on_two_ranks_with_a_zero0_actor_and_a_zero2_critic(tmp_path, ppo_world):
    """engine.backend=deepspeed's default stage 0 (fp32): the actor's steps report their gradient norm as every
    other stage does (PPO's update read it and stopped with a KeyError)."""
    out = tmp_path / "ppo"
    res = launch("ppo", f"actor={ppo_world / 'sft' / 'final'}", f"reward={ppo_world / 'rewards.py'}:four_words",
                 f"data.prompts={ppo_world / 'prompts.jsonl'}", f"output_dir={out}", "train.batch_size=16",
                 "train.micro_batch_size=8", "train.lr=5e-4", "gen.max_new_tokens=12", "train.eval_every=0",
                 "train.max_steps=3", "engine.backend=deepspeed", "engine.zero_stage=0", "engine.critic_zero_stage=2")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "policy_loss" in r]
    assert len(rows) == 3 and all(r["actor_grad_norm"] > 0 and r["critic_grad_norm"] > 0 for r in rows)


def test_a_deepspeed_json_contradicting_engine_keys_fails_before_anything_is_written(tmp_path, sft_args):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}))
    out = tmp_path / "run"
    res = run_cli("sft", *sft_args, f"output_dir={out}", "engine.backend=deepspeed", "engine.zero_stage=2",
                  f"engine.deepspeed_config={user}")
    assert res.returncode == 2, res.stderr[-2000:]
    error = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and error[0].startswith("rlhfkit sft: error: config key 'engine.deepspeed_config': ")
    assert "zero_optimization.stage = 3, but engine.zero_stage gives 2" in error[0]
    assert not out.exists()


def test_resume_from_deepspeed_checkpoint_continues_the_curve(tmp_path, sft_args):
    out = tmp_path / "run"
    args = [*sft_args, f"output_dir={out}", "engine.backend=deepspeed", "engine.zero_stage=2", "train.save_every=6"]
    assert launch("sft", *args).returncode == 0
    full = read_metrics(out / "metrics.jsonl")
    # pretend the run died after its step-6 checkpoint: drop what came later, then --resume
    shutil.rmtree(out / "final")
    (out / "metrics.jsonl").write_text("".join(
        __import__("json").dumps(m) + "\n" for m in full if m["step"] <= 6))
    assert (out / "checkpoints" / "latest").read_text() == "step-00000006"
    res = launch("sft", *args, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [m["step"] for m in full]
    after = {m["step"]: m.get("loss") for m in resumed if m["step"] > 6}
    before = {m["step"]: m.get("loss") for m in full if m["step"] > 6}
    assert after == pytest.approx(before, abs=1e-5)


def test_resume_uses_the_learning_rate_of_its_own_config(tmp_path, sft_args):
    """DeepSpeed's load_checkpoint brings back the checkpointed optimizer's and schedule's rate; `--resume
    train.lr=...` continues at the new one (and says so), from the schedule's position."""
    out = tmp_path / "run"
    args = [*sft_args, f"output_dir={out}", "engine.backend=deepspeed", "engine.zero_stage=2", "train.save_every=2",
            "train.max_steps=4", "train.scheduler=constant", "train.warmup_steps=0", "train.eval_every=0"]
    assert launch("sft", *args).returncode == 0
    full = read_metrics(out / "metrics.jsonl")
    rates = lambda rows: {m["step"]: m["lr"] for m in rows if "lr" in m}  # noqa: E731
    assert rates(full) == pytest.approx({1: 1e-2, 2: 1e-2, 3: 1e-2, 4: 1e-2})
    shutil.rmtree(out / "final")  # as if the run died after its step-2 checkpoint
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in full if m["step"] <= 2))
    res = launch("sft", *args, "train.lr=2e-3", "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "train.lr: 0.01 -> 0.002" in res.stderr
    assert rates(read_metrics(out / "metrics.jsonl")) == pytest.approx({1: 1e-2, 2: 1e-2, 3: 2e-3, 4: 2e-3})


def test_optimizer_offload_trains(tmp_path, sft_args):
    out = tmp_path / "run"
    res = launch("sft", *sft_args, f"output_dir={out}", "engine.backend=deepspeed", "engine.zero_stage=2",
                 "engine.offload_optimizer=true")
    assert res.returncode == 0, res.stderr[-3000:]
    evals = [m["eval/loss"] for m in read_metrics(out / "metrics.jsonl") if "eval/loss" in m]
    assert evals[-1] < evals[0] - 1.0


def _pairs(path):
    """Chosen answers say the name four times, rejected ones 1-3 times: a rule a tiny RM learns quickly."""
    import random

    from conftest import NAMES

    rng = random.Random(0)
    rows = []
    for _ in range(160):
        name, k = rng.choice(NAMES), rng.randint(1, 3)
        rows.append({"prompt": f"say {name}", "chosen": " ".join([name] * 4), "rejected": " ".join([name] * k)})
    return write_jsonl(path, rows)


@pytest.fixture(scope="module")
def ds_reward_model(tmp_path_factory, ppo_world):
    """A reward model trained with ZeRO-3 on 2 ranks; the PPO tests below use it as reward and critic."""
    root = tmp_path_factory.mktemp("ds_rm")
    out = root / "rm"
    res = launch("rm", f"model={ppo_world / 'sft' / 'final'}", f"data.train={_pairs(root / 'pairs.jsonl')}",
                 f"output_dir={out}", "train.batch_size=16", "train.micro_batch_size=4", "train.lr=5e-3",
                 "train.max_steps=15", "train.eval_every=5", "data.eval_fraction=0.2", "engine.backend=deepspeed",
                 "engine.zero_stage=3", PLAIN_SPLIT,
                 # the reward and critic of the pinned LoRA PPO curve: padded, as when it was recorded (packing
                 # rounds differently, ~1e-6, and 15 sampled PPO iterations amplify it)
                 "packing=false")
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_reward_model_learns_under_zero3_and_exports_its_head(ds_reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    accuracy = [m["eval/accuracy"] for m in read_metrics(ds_reward_model / "metrics.jsonl") if "eval/accuracy" in m]
    assert accuracy[0] < 0.8 and accuracy[-1] >= 0.95, accuracy
    check_pinned("zero3/rm", series_of(read_metrics(ds_reward_model / "metrics.jsonl"), "loss", "eval/loss"))
    tok = AutoTokenizer.from_pretrained(ds_reward_model / "final")
    rm = AutoModelForSequenceClassification.from_pretrained(ds_reward_model / "final")
    texts = ["User: say river\n\nAssistant: river river river river</s>", "User: say river\n\nAssistant: river</s>"]
    with torch.no_grad():
        good, bad = (rm(**tok(t, return_tensors="pt")).logits.item() for t in texts)
    assert good > bad + 1.0  # the gathered head was exported, not a random one


def test_reward_model_under_zero2_gives_the_pinned_losses(tmp_path, ppo_world):
    out = tmp_path / "rm"
    res = launch("rm", f"model={ppo_world / 'sft' / 'final'}", f"data.train={_pairs(tmp_path / 'pairs.jsonl')}",
                 f"output_dir={out}", "train.batch_size=16", "train.micro_batch_size=4", "train.lr=5e-3",
                 "train.max_steps=6", "train.eval_every=3", "data.eval_fraction=0.2", "rm.norm_samples=16",
                 "engine.backend=deepspeed", "engine.zero_stage=2", PLAIN_SPLIT)
    assert res.returncode == 0, res.stderr[-3000:]
    check_pinned("zero2/rm", series_of(read_metrics(out / "metrics.jsonl"), "loss", "eval/loss", "accuracy"))


@pytest.mark.parametrize("stage", [2, 3])
def test_ppo_learns_on_two_ranks(tmp_path, ppo_world, stage):
    out = tmp_path / "ppo"
    # under ZeRO-3 a user JSON's tuning reaches the frozen reference too (the curve is pinned: the same numbers)
    tuning = tmp_path / "ds.json"
    tuning.write_text(json.dumps({"zero_optimization": {"stage3_max_live_parameters": 1000000,
                                                        "stage3_prefetch_bucket_size": 100000}}))
    res = launch("ppo", f"actor={ppo_world / 'sft' / 'final'}", f"reward={ppo_world / 'rewards.py'}:four_words",
                 f"data.prompts={ppo_world / 'prompts.jsonl'}", f"data.eval_prompts={ppo_world / 'eval.jsonl'}",
                 f"output_dir={out}", "train.batch_size=16", "train.micro_batch_size=8", "train.lr=5e-4",
                 "gen.max_new_tokens=20", "train.eval_every=0", "train.max_steps=20", "engine.backend=deepspeed",
                 f"engine.zero_stage={stage}", "engine.critic_zero_stage=2",
                 *([f"engine.deepspeed_config={tuning}"] if stage == 3 else []))
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["eval/reward_end"] > summary["eval/reward_start"] + 0.1, summary  # measured 0.625 -> 0.80
    check_pinned(f"zero{stage}/ppo", series_of(read_metrics(out / "metrics.jsonl"), "reward/mean", "kl", "policy_loss",
                                               "value_loss"))
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_lora_ppo_with_reward_model_under_zero3(tmp_path, ppo_world, ds_reward_model):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "ppo"
    res = launch("ppo", f"actor={ppo_world / 'sft' / 'final'}", f"reward={ds_reward_model / 'final'}",
                 f"data.prompts={ppo_world / 'prompts.jsonl'}", f"data.eval_prompts={ppo_world / 'eval.jsonl'}",
                 f"output_dir={out}", "train.batch_size=16", "train.micro_batch_size=8", "train.lr=5e-3",
                 "gen.max_new_tokens=20", "train.eval_every=0", "train.max_steps=15", "lora.rank=8",
                 "engine.backend=deepspeed", "engine.zero_stage=3")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["eval/reward_end"] > summary["eval/reward_start"] + 1.0, summary  # measured -2.0 -> 3.2
    check_pinned("zero3/ppo-lora-rm", series_of(read_metrics(out / "metrics.jsonl"), "reward/mean", "kl",
                                                "policy_loss", "value_loss"))
    actor = AutoModelForCausalLM.from_pretrained(out / "final")
    assert not any("lora" in k for k in actor.state_dict())
    AutoModelForSequenceClassification.from_pretrained(out / "final-critic")


def test_group_estimator_learns_on_two_ranks(tmp_path, ppo_world):
    """REINFORCE++ with the group baseline under ZeRO-2: each rank keeps its prompts' groups whole, and the
    returns are whitened over both ranks' tokens; groups that scored alike are filtered, counted over both."""
    out = tmp_path / "grpo"
    res = launch("ppo", f"actor={ppo_world / 'sft' / 'final'}", f"reward={ppo_world / 'rewards.py'}:four_words",
                 f"data.prompts={ppo_world / 'prompts.jsonl'}", f"data.eval_prompts={ppo_world / 'eval.jsonl'}",
                 f"output_dir={out}", "train.batch_size=8", "ppo.n_samples_per_prompt=4", "train.micro_batch_size=8",
                 "train.lr=5e-4", "gen.max_new_tokens=12", "train.eval_every=0", "train.max_steps=15",
                 "ppo.advantage_estimator=reinforce_pp_baseline", "ppo.kl_coef=0.01", "engine.backend=deepspeed",
                 "engine.zero_stage=2", "ppo.filter_equal_groups=true")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["eval/reward_end"] > summary["eval/reward_start"] + 0.15, summary
    assert not (out / "final-critic").exists()
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    # the filtered groups of both ranks (a count) are the 8 prompts x the fraction of rows in all-alike groups
    assert [r["group/filtered"] for r in rows] == pytest.approx([8 * r["group/all_equal"] for r in rows])
    assert any(r["group/filtered"] > 0 for r in rows)


def test_dpo_under_zero3_matches_the_local_engine(tmp_path, tiny_model_dir):
    """DPO on 2 ranks under ZeRO-3: both ranks compute the reference log-probs of every pair before training (each
    forward is a collective), rank 0 caches them; loss curve, held-out eval and weights are the local engine's."""
    from rlhfkit.config import DPOConfig, load_config
    from rlhfkit.stages.dpo import run_dpo
    from test_rm import rule_rows

    args = [f"model={tiny_model_dir}", f"data.train={write_jsonl(tmp_path / 'train.jsonl', rule_rows(128, 0))}",
            f"data.eval={write_jsonl(tmp_path / 'eval.jsonl', rule_rows(32, 1))}", "train.batch_size=16",
            "train.micro_batch_size=4", "train.lr=1e-2", "train.max_steps=8", "train.eval_every=4",
            "train.save_every=0", "log.tensorboard=false", f"data.cache_dir={tmp_path / 'cache'}"]
    res = launch("dpo", *args, f"output_dir={tmp_path / 'ds'}", "engine.backend=deepspeed", "engine.zero_stage=3")
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    note = result["reference"]
    assert "precomputed by the policy before its first step" in note and "cached at" in note
    run_dpo(load_config(DPOConfig, None, [*args, f"output_dir={tmp_path / 'local'}", "log.progress=false"]))
    keys = ("loss", "margin", "eval/loss", "eval/accuracy", "eval/margin")
    ds, local = (series_of(read_metrics(tmp_path / run / "metrics.jsonl"), *keys) for run in ("ds", "local"))
    # the same arithmetic but for the order of ZeRO-3's reductions: ~1e-7 apart after the first step; lr 1e-2
    # then grows that about tenfold a step (measured 1e-7, 2e-7, 1e-6, 5e-5 .. 1e-4 on the margin by step 8)
    for key in keys:
        early = 1 if key.startswith("eval/") else 3  # evaluations at steps 0, 4, 8; training steps 1, 2, 3
        assert ds[key][:early] == pytest.approx(local[key][:early], abs=1e-5), key
        assert ds[key] == pytest.approx(local[key], abs=5e-4, rel=5e-4), key
    assert ds["eval/accuracy"][0] == 0.0 and ds["eval/accuracy"][-1] >= 0.9
    assert_same_weights(tmp_path / "ds", tmp_path / "local", atol=5e-4)


def test_bf16_reference_is_the_actor_before_any_update(tmp_path, ppo_world):
    """Below ZeRO-3 DeepSpeed's bf16 engine holds the actor in bf16: the frozen reference is cast to it, so the
    first rollout's KL is 0 (it was 0.16 with a float32 reference)."""
    out = tmp_path / "ppo"
    res = run_cli("ppo", f"actor={ppo_world / 'sft' / 'final'}", f"reward={ppo_world / 'rewards.py'}:four_words",
                  f"data.prompts={ppo_world / 'prompts.jsonl'}", f"data.eval_prompts={ppo_world / 'eval.jsonl'}",
                  f"output_dir={out}", "train.batch_size=8", "train.micro_batch_size=8", "gen.max_new_tokens=12",
                  "train.eval_every=1", "train.max_steps=1", "engine.backend=deepspeed", "engine.zero_stage=2",
                  "engine.precision=bf16")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    first = next(r for r in rows if "kl" in r)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6), first
    assert [r["eval/kl"] for r in rows if "eval/kl" in r][0] == pytest.approx(0.0, abs=1e-6)


def test_a_reward_model_under_zero3_normalises_with_its_stored_statistics(tmp_path, ppo_world, ds_reward_model):
    """Under ZeRO-3 the frozen RM is DeepSpeed's engine (whose `.config` is its dict): its mean/std and template
    are still read from the transformers config (ppo.normalize_reward failed with 'has no rlhfkit_reward_mean')."""
    out = tmp_path / "ppo"
    res = run_cli("ppo", f"actor={ppo_world / 'sft' / 'final'}", f"reward={ds_reward_model / 'final'}",
                  f"data.prompts={ppo_world / 'prompts.jsonl'}", f"output_dir={out}", "train.batch_size=8",
                  "train.micro_batch_size=8", "gen.max_new_tokens=12", "train.eval_every=0", "train.max_steps=1",
                  "ppo.normalize_reward=true", "engine.backend=deepspeed", "engine.zero_stage=3")
    assert res.returncode == 0, res.stderr[-3000:]
    stored = json.loads((ds_reward_model / "final" / "config.json").read_text())
    row = next(r for r in read_metrics(out / "metrics.jsonl") if "score/mean" in r)
    want = (row["reward/mean"] - stored["rlhfkit_reward_mean"]) / stored["rlhfkit_reward_std"]
    assert row["score/mean"] == pytest.approx(want, abs=1e-4), row
