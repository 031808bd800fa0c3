"""The loss curves of SFT, the reward model and PPO (both update paths, LoRA, PPO-ptx, the k3 KL loss) on the
local engine equal the ones pinned before the engine refactor (issue 15): moving code must not move numbers.
The 2-rank ZeRO-2/3 runs in test_deepspeed.py check their curves against the same file."""

from __future__ import annotations

import random

import pytest

from rlhfkit.config.fields import load_config
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.config.schema import RMConfig, SFTConfig
from rlhfkit.stages.ppo import run_ppo
from rlhfkit.stages.reward import run_rm
from rlhfkit.stages.sft import run_sft

from conftest import NAMES, PLAIN_SPLIT, check_pinned, read_metrics, series_of, sft_rows, speed_plan, write_jsonl

pytestmark = pytest.mark.slow

QUIET = ["log.tensorboard=false", "train.save_every=0", "data.cache=false", PLAIN_SPLIT]


def pairs(n: int = 96) -> list[dict]:
    """Chosen answers say the name four times, rejected ones 1-3 times."""
    rng = random.Random(0)
    return [{"prompt": f"say {name}", "chosen": " ".join([name] * 4), "rejected": " ".join([name] * rng.randint(1, 3))}
            for name in (rng.choice(NAMES) for _ in range(n))]


def test_sft_losses_are_the_pinned_ones(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    run_sft(load_config(SFTConfig, None, [f"model={tiny_model_dir}", f"data.train={data}", f"output_dir={tmp_path / 'o'}",
                                          "train.max_steps=12", "train.batch_size=8", "train.micro_batch_size=2",
                                          "train.lr=1e-2", "train.eval_every=6", "data.eval_fraction=0.1", *QUIET]))
    check_pinned("local/sft", series_of(read_metrics(tmp_path / "o" / "metrics.jsonl"), "loss", "eval/loss",
                                        "grad_norm"))


@pytest.fixture(scope="module")
def pinned_rm(tmp_path_factory, ppo_world):
    root = tmp_path_factory.mktemp("pinned_rm")
    data = write_jsonl(root / "pairs.jsonl", pairs())
    run_rm(load_config(RMConfig, None, [f"model={ppo_world / 'sft' / 'final'}", f"data.train={data}",
                                        f"output_dir={root / 'rm'}", "train.max_steps=10", "train.batch_size=8",
                                        "train.micro_batch_size=4", "train.lr=5e-3", "train.eval_every=5",
                                        "data.eval_fraction=0.2", "rm.norm_samples=16", *QUIET]))
    return root / "rm"


def test_reward_model_losses_are_the_pinned_ones(pinned_rm):
    check_pinned("local/rm", series_of(read_metrics(pinned_rm / "metrics.jsonl"), "loss", "accuracy", "eval/loss",
                                       "grad_norm"))


def ppo_run(world, out, *extra) -> list[dict]:
    run_ppo(load_config(PPOConfig, None, [f"actor={world / 'sft' / 'final'}", f"data.prompts={world / 'prompts.jsonl'}",
                                          f"data.eval_prompts={world / 'eval.jsonl'}", f"output_dir={out}",
                                          "train.batch_size=16", "train.micro_batch_size=4", "gen.max_new_tokens=12",
                                          "train.eval_every=0", "train.max_steps=4", "ppo.sample_every=0", *QUIET,
                                          *extra]))
    return read_metrics(out / "metrics.jsonl")


PPO_SERIES = ("reward/mean", "kl", "policy_loss", "value_loss", "advantage/mean", "return/mean", "entropy")


@pytest.mark.parametrize("chunked", ["null", "false"])
def test_ppo_single_step_losses_are_the_pinned_ones(tmp_path, ppo_world, capsys, chunked):
    """The pinned curves were made with log-probs from the model's full logits; the LM head in chunks (on by
    default after its check) gives the same ones."""
    rows = ppo_run(ppo_world, tmp_path / "ppo", f"reward={ppo_world / 'rewards.py'}:four_words", "train.lr=5e-4",
                   f"ppo.chunked_logprobs={chunked}")
    check_pinned("local/ppo-single-step", series_of(rows, *PPO_SERIES, "actor_grad_norm", "critic_grad_norm",
                                                    "eval/reward"))
    on, off = speed_plan(capsys.readouterr().err)
    assert on.get("LM head in chunks") == ("actor, reference" if chunked == "null" else None), (on, off)
    # on by default after its check; the actor's and the reference's only where they read hidden states (the head
    # in chunks); the actor's rollout prefill packed either way
    assert on["padding-free"] == ("actor, critic, reference" if chunked == "null" else "critic"), (on, off)
    assert on["packed prefill"] == "actor"
    # on for all three after its check (the toy prompts share too little for it to run: the curves are unchanged)
    assert on["common prefix once"] == "actor, critic, reference"


def test_ppo_epochs_lora_ptx_kl_loss_losses_are_the_pinned_ones(tmp_path, ppo_world, pinned_rm, capsys):
    rows = ppo_run(ppo_world, tmp_path / "ppo", f"reward={pinned_rm / 'final'}", "train.lr=3e-3", "lora.rank=4",
                   "ppo.epochs=2", "ppo.mini_batch_size=8", f"data.ptx={ppo_world / 'ptx.txt'}", "ptx.coef=0.5",
                   "ppo.kl_loss_coef=0.1", "gen.generation_batch_size=8", "ppo.critic_warmup_iters=1")
    check_pinned("local/ppo-epochs-lora-ptx", series_of(rows, *PPO_SERIES, "ptx_loss", "kl_loss", "eval/reward"))
    on, _ = speed_plan(capsys.readouterr().err)
    assert on["padding-free"] == "actor, critic, reward"  # the reference is the actor with its adapter off


def test_ppo_padded_forwards_give_the_pinned_losses(tmp_path, ppo_world, pinned_rm, capsys):
    """The pinned curves were made with padded forwards; `ppo.packing=false` still gives them (the default packs, and
    the tests above compare it with the same curves), with a reward model scoring."""
    rows = ppo_run(ppo_world, tmp_path / "ppo", f"reward={pinned_rm / 'final'}", "train.lr=3e-3", "lora.rank=4",
                   "ppo.epochs=2", "ppo.mini_batch_size=8", f"data.ptx={ppo_world / 'ptx.txt'}", "ptx.coef=0.5",
                   "ppo.kl_loss_coef=0.1", "gen.generation_batch_size=8", "ppo.critic_warmup_iters=1",
                   "ppo.packing=false")
    check_pinned("local/ppo-epochs-lora-ptx", series_of(rows, *PPO_SERIES, "ptx_loss", "kl_loss", "eval/reward"))
    on, off = speed_plan(capsys.readouterr().err)
    assert "padding-free" not in on and off["padding-free"] == "ppo.packing=false"
