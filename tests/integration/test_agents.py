"""Multi-turn episodes end to end through `rlhfkit ppo env=...` on the toy world: every estimator learns from
two-turn episodes, LoRA and ZeRO-3 train them, a run resumes exactly, and environment errors are one clear line.

The world (conftest.ppo_world): the SFT policy answers "say NAME" with NAME 1-4 times. The environment asks twice
(the row's name, then the next one) and rewards each answer 1 - |words - 4| / 4, averaged over the two turns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from conftest import NAMES, ROOT, read_metrics, run_cli, write_jsonl

pytestmark = pytest.mark.slow

ENV = '''
from rlhfkit.envs import Environment, Step

NAMES = {names!r}


class TwoAsks(Environment):
    def reset(self, row):
        self.name, self.scores = row["name"], []
        return "say " + self.name

    def step(self, text):
        self.scores.append(1 - abs(len(text.split()) - 4) / 4)
        if len(self.scores) == 2:
            return Step(done=True)
        return "say " + NAMES[(NAMES.index(self.name) + 1) % len(NAMES)]

    def reward(self):
        return sum(self.scores) / len(self.scores)


class Broken(TwoAsks):
    def step(self, text):
        return {{"not": "a message"}}
'''

RUN = ["train.batch_size=8", "ppo.n_samples_per_prompt=4", "train.micro_batch_size=16", "train.lr=1e-3",
       "gen.max_new_tokens=8", "train.eval_every=0", "ppo.kl_coef=0", "ppo.kl_loss_coef=0.05",
       "log.tensorboard=false", "ppo.sample_every=0", "train.save_every=0", "episode.max_turns=3",
       "episode.max_tokens=48"]


@pytest.fixture(scope="module")
def agent_world(ppo_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    (root / "asks.py").write_text(ENV.format(names=NAMES))
    write_jsonl(root / "prompts.jsonl", [{"prompt": f"say {n}", "name": n} for n in NAMES[:16]] * 2)
    write_jsonl(root / "eval.jsonl", [{"prompt": f"say {n}", "name": n} for n in NAMES[16:]] * 8)
    return root


def args(ppo_world, world, out, *overrides):
    return [f"actor={ppo_world / 'sft' / 'final'}", f"env={world / 'asks.py'}:TwoAsks",
            f"data.prompts={world / 'prompts.jsonl'}", f"data.eval_prompts={world / 'eval.jsonl'}",
            f"output_dir={world / out}", *RUN, *overrides]


@pytest.mark.parametrize("estimator, extra", [
    ("grpo", []),
    ("gae", ["ppo.n_samples_per_prompt=1", "train.batch_size=32", "ppo.kl_coef=0.01", "ppo.kl_loss_coef=0",
             "ppo.critic_lr=1e-3"]),
    ("rloo", []),
    ("reinforce_pp", ["ppo.n_samples_per_prompt=1", "train.batch_size=32", "ppo.kl_coef=0.01", "ppo.kl_loss_coef=0"]),
])
def test_each_estimator_learns_from_two_turn_episodes(ppo_world, agent_world, estimator, extra):
    proc = run_cli("ppo", *args(ppo_world, agent_world, f"run_{estimator}", f"ppo.advantage_estimator={estimator}",
                                "train.max_steps=20", *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["eval/reward_end"] > result["eval/reward_start"] + 0.15, result
    assert "episodes against env" in proc.stderr and "reward: the environment's" in proc.stderr
    rows = [r for r in read_metrics(agent_world / f"run_{estimator}" / "metrics.jsonl") if "reward/mean" in r]
    assert rows[0]["episode/turns"] == pytest.approx(2.0) and rows[0]["episode/env_tokens"] > 0
    assert rows[-1]["episode/ended_done"] == pytest.approx(1.0) and rows[-1]["reward/unjudged"] == 0
    AutoModelForCausalLM.from_pretrained(agent_world / f"run_{estimator}" / "final")


def test_lora_episodes_train_and_export_merged(ppo_world, agent_world):
    proc = run_cli("ppo", *args(ppo_world, agent_world, "run_lora", "ppo.advantage_estimator=grpo",
                                "train.max_steps=3", "lora.rank=8", "train.lr=5e-3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    actor = AutoModelForCausalLM.from_pretrained(agent_world / "run_lora" / "final")
    assert not any("lora" in k for k in actor.state_dict())


def test_an_episode_run_resumes_exactly(ppo_world, agent_world):
    import shutil

    import torch
    from safetensors.torch import load_file

    from rlhfkit.config.fields import load_config
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.stages.ppo import run_ppo

    out = agent_world / "run_resume"
    cfg = load_config(PPOConfig, None, args(ppo_world, agent_world, "run_resume", "ppo.advantage_estimator=grpo",
                                            "train.max_steps=4", "train.save_every=2"))
    run_ppo(cfg)
    uninterrupted = load_file(str(out / "final" / "model.safetensors"))
    shutil.rmtree(out / "final")
    run_ppo(cfg, resume=True)  # from checkpoints/step-2: the episodes of iterations 3 and 4 are drawn again alike
    resumed = load_file(str(out / "final" / "model.safetensors"))
    for key, value in uninterrupted.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=1e-6)


@pytest.mark.xdist_group("ranks")  # one multi-rank launch at a time under xdist
def test_episodes_train_under_zero3_on_two_ranks(ppo_world, agent_world):
    """Every rank samples each turn with the others (ZeRO-3's forwards are collective), even when its own
    episodes ended sooner."""
    out = agent_world / "run_zero3"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29500 + os.getpid() % 1000), "-m", "rlhfkit", "ppo",
           *args(ppo_world, agent_world, "run_zero3", "ppo.advantage_estimator=grpo", "train.max_steps=3",
                 "engine.backend=deepspeed", "engine.zero_stage=3")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 3 and all(r["episode/turns"] == pytest.approx(2.0) for r in rows)
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_a_broken_environment_is_one_clear_error(ppo_world, agent_world):
    proc = run_cli("ppo", *args(ppo_world, agent_world, "run_broken", "ppo.advantage_estimator=grpo",
                                "train.max_steps=2", f"env={agent_world / 'asks.py'}:Broken"))
    assert proc.returncode != 0
    assert "episodes failed (" in proc.stderr and "bad_value), more than episode.max_failed=0.25" in proc.stderr, \
        proc.stderr[-2000:]
    assert "asks.py:Broken.step returned dict ({'not': 'a message'})" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("overrides, message", [
    (["reward=rewards.py:four_words"], "config key 'reward': the environment (env="),
    ([f"env=nowhere.py:TwoAsks"], "env 'nowhere.py:TwoAsks': file 'nowhere.py' does not exist"),
    (["episode.env_args={colour: red}"], "config key 'episode.env_args': TwoAsks(colour) cannot be called"),
    (["episode.tools=[abacus]"], "config key 'episode.tools'"),
])
def test_environment_mistakes_are_caught_before_models_load(ppo_world, agent_world, overrides, message):
    proc = run_cli("ppo", *args(ppo_world, agent_world, "run_bad", "ppo.advantage_estimator=grpo",
                                "train.max_steps=1", *overrides))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Loading weights" not in proc.stderr
