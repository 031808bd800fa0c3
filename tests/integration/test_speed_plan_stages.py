"""Each stage run both ways on the tiny models through the real stage code: with its speed plan (`engine.speed=auto`,
the default) and on plain transformers forwards (`engine.speed=reference`). The losses, log-probs, rewards and values
they log agree within the paths' tolerance (float rounding, over a few steps), and each run's first log line is its
speed plan: the fast paths on, or every path off because of `engine.speed=reference`."""

from __future__ import annotations

import random

import pytest

from rlhfkit.config.dpo_schema import DPOConfig
from rlhfkit.config.fields import load_config
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.config.schema import RMConfig, SFTConfig
from rlhfkit.stages.dpo import run_dpo
from rlhfkit.stages.ppo import run_ppo
from rlhfkit.stages.reward import run_rm
from rlhfkit.stages.sft import run_sft

from conftest import NAMES, read_metrics, sft_rows, speed_plan, write_jsonl

QUIET = ["log.tensorboard=false", "log.progress=false", "train.save_every=0", "data.cache=false"]
TOLERANCE = 2e-4  # float rounding of the fast paths, relative and absolute, carried over a few optimizer steps


def pairs(n: int = 48) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt": f"say {name}", "chosen": " ".join([name] * 4), "rejected": " ".join([name] * rng.randint(1, 3))}
            for name in (rng.choice(NAMES) for _ in range(n))]


def both_ways(run, config_cls, args: list[str], out, capsys) -> dict:
    """{speed: (metrics rows, the run's (on, off) plan)} for engine.speed auto and reference."""
    results = {}
    for speed in ("auto", "reference"):
        folder = out / speed
        run(load_config(config_cls, None, [*args, f"output_dir={folder}", f"engine.speed={speed}", *QUIET]))
        results[speed] = read_metrics(folder / "metrics.jsonl"), speed_plan(capsys.readouterr().err)
    on, off = results["reference"][1]
    assert on == {} and off and set(off.values()) == {"engine.speed=reference"}, off
    return results


def assert_same_series(results: dict, *keys: str) -> None:
    fast, plain = results["auto"][0], results["reference"][0]
    assert [r["step"] for r in fast] == [r["step"] for r in plain]
    for key in keys:
        got, want = [r[key] for r in fast if key in r], [r[key] for r in plain if key in r]
        assert want and len(got) == len(want), key
        assert got == pytest.approx(want, rel=TOLERANCE, abs=TOLERANCE), key


def test_sft_both_ways(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    results = both_ways(run_sft, SFTConfig, [f"model={tiny_model_dir}", f"data.train={data}", "train.max_steps=6",
                                             "train.batch_size=8", "train.micro_batch_size=2", "train.lr=1e-2",
                                             "train.eval_every=3", "data.eval_fraction=0.1"], tmp_path, capsys)
    on, _ = results["auto"][1]
    assert {"per-sequence attention", "LM head in chunks", "packed micro-batches"} <= set(on), on
    assert_same_series(results, "loss", "eval/loss", "grad_norm")


def test_reward_model_both_ways(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs())
    results = both_ways(run_rm, RMConfig, [f"model={tiny_model_dir}", f"data.train={data}", "train.max_steps=5",
                                           "train.batch_size=8", "train.micro_batch_size=4", "train.lr=5e-3",
                                           "train.eval_every=5", "data.eval_fraction=0.2", "rm.norm_samples=16"],
                        tmp_path, capsys)
    assert "packed micro-batches" in results["auto"][1][0]
    assert_same_series(results, "loss", "accuracy", "chosen", "rejected", "eval/loss", "grad_norm")


def test_dpo_both_ways(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs())
    results = both_ways(run_dpo, DPOConfig, [f"model={tiny_model_dir}", f"data.train={data}", "train.max_steps=4",
                                             "train.batch_size=8", "train.micro_batch_size=4", "train.lr=1e-2",
                                             "train.eval_every=2", "data.eval_fraction=0.2"], tmp_path, capsys)
    on, _ = results["auto"][1]
    assert {"LM head in chunks", "prompt-sharing pairs"} <= set(on), on
    assert_same_series(results, "loss", "logps/chosen", "logps/rejected", "reward/chosen", "eval/loss",
                       "eval/logps/chosen", "grad_norm")


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_ppo_both_ways(tmp_path, ppo_world, capsys, estimator):
    """GAE (actor, critic from the actor with a fresh value head, reference) and GRPO (no critic, groups of 4
    samples of each prompt, each group's prompt once): sampled tokens, log-probs, values and losses agree."""
    extra = ["ppo.n_samples_per_prompt=4", "train.batch_size=4", "ppo.advantage_estimator=grpo"] \
        if estimator == "grpo" else ["train.batch_size=16"]
    args = [f"actor={ppo_world / 'sft' / 'final'}", f"data.prompts={ppo_world / 'prompts.jsonl'}",
            f"data.eval_prompts={ppo_world / 'eval.jsonl'}", f"reward={ppo_world / 'rewards.py'}:four_words",
            "train.micro_batch_size=4", "gen.max_new_tokens=10", "train.eval_every=0", "train.max_steps=3",
            "ppo.sample_every=0", "train.lr=5e-4", *extra]
    results = both_ways(run_ppo, PPOConfig, args, tmp_path, capsys)
    on, _ = results["auto"][1]
    assert {"LM head in chunks", "padding-free", "packed prefill", "group decode"} <= set(on), on
    if estimator == "grpo":
        assert on["one packed row per group"] == "actor, reference" and "critic" not in on["padding-free"]
    keys = ["reward/mean", "kl", "policy_loss", "entropy", "response_length", "advantage/mean", "eval/reward"]
    assert_same_series(results, *keys, *(["value_loss", "return/mean"] if estimator == "gae" else []))
