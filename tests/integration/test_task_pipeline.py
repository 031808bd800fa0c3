"""A reasoning-gym task by name through `rlhfkit pipeline` [sft, ppo] from one config, on a tiny model: sft learns
the task's answers, ppo samples its questions and is rewarded by the task's own scorer, both evaluate on the
held-out questions. (That RL raises the held-out exact rate is measured on SmolLM2: tests/real, docs/tasks.md.)"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import read_metrics, run_cli

reasoning_gym = pytest.importorskip("reasoning_gym")

ARGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.fixture(scope="module")
def task_model(tmp_path_factory):
    """A tiny Llama whose tokenizer was trained on the task's text."""
    from rlhfkit.config.task_schema import TaskConfig
    from rlhfkit.demo.tiny import build_tiny_llama, build_tokenizer, save_model_folder
    from rlhfkit.tasks.reasoning_gym import rows

    train, _ = rows(TaskConfig(name="chain_sum", args=ARGS, size=200, eval_size=20))
    tok = build_tokenizer([f"User: {r['prompt']}\n\nAssistant: {r['answer']}" for r in train], vocab_size=200)
    model = build_tiny_llama(len(tok), hidden=64, layers=2, heads=4)
    return save_model_folder(model, tok, tmp_path_factory.mktemp("task") / "model")


def test_one_config_trains_a_reasoning_gym_task_sft_then_grpo(task_model, tmp_path):
    config = {
        "model": str(task_model), "output_dir": str(tmp_path / "run"), "steps": ["sft", "ppo"],
        "task": {"name": "chain_sum", "args": ARGS, "size": 200, "eval_size": 20, "dir": str(tmp_path / "rows")},
        "log": {"tensorboard": False},
        "sft": {"train": {"max_steps": 150, "batch_size": 16, "micro_batch_size": 16, "lr": 3.0e-3,
                          "eval_every": 50}},
        "ppo": {"train": {"max_steps": 4, "batch_size": 8, "micro_batch_size": 32, "lr": 1.0e-4, "eval_every": 2},
                "gen": {"max_new_tokens": 6}, "ppo": {"advantage_estimator": "grpo", "n_samples_per_prompt": 4,
                                                     "kl_coef": 0.0, "kl_loss_coef": 0.05, "sample_every": 1}},
    }
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(config))
    res = run_cli("pipeline", "--config", str(path), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "run"

    # sft learned the task's question -> answer rows, evaluated on its held-out questions
    sft = [m["eval/loss"] for m in read_metrics(run / "sft" / "metrics.jsonl") if "eval/loss" in m]
    assert sft[-1] < 0.3 * sft[0], sft
    assert "sft: 200 train / 20 eval rows" in res.stderr
    # ppo: the task's questions, no reward model; the held-out questions are the eval prompts
    assert "ppo: 200 prompts / 20 eval" in res.stderr and "reward: rlhfkit.tasks.reasoning_gym:score" in res.stderr
    saved = yaml.safe_load((run / "ppo" / "config.yaml").read_text())
    assert saved["reward"] is None and saved["task"]["name"] == "chain_sum"
    assert not (run / "rm").exists()

    # every sampled response's reward is what reasoning-gym's own scorer gives its stripped text
    entries = {}
    for name in ("train", "test"):
        for line in open(tmp_path / "rows" / f"{name}.jsonl"):
            row = json.loads(line)
            entries[row["prompt"]] = row
    library = reasoning_gym.create_dataset("chain_sum", **ARGS, seed=0, size=200)
    samples = [json.loads(line) for line in open(run / "ppo" / "samples.jsonl")]
    assert len(samples) >= 4
    for sample in samples:
        # the sample carries its row's fields (the task entry, the reference answer), as the scorer saw them
        entry = library[sample["fields"]["task"]["index"]]
        assert entry["question"] in sample["prompt"] and entry["question"] in entries
        assert sample["fields"]["answer"] == entry["answer"]
        assert sample["reward"] == pytest.approx(library.score_answer(sample["response"].strip(), entry))
    ppo = read_metrics(run / "ppo" / "metrics.jsonl")
    assert [m["step"] for m in ppo if "eval/reward" in m] == [0, 2, 4]
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in ppo if "reward/mean" in m)
