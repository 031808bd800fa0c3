"""reasoning-gym tasks by name (`task` in a config): rows, the held-out split, the scorer, the config's checks."""

from __future__ import annotations

import json
import sys

import pytest

from rlhfkit.config.fields import from_dict
from rlhfkit.config.pipeline_schema import PipelineConfig, step_config
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.config.schema import RMConfig, SFTConfig
from rlhfkit.config.task_schema import TaskConfig
from rlhfkit.errors import ConfigError, DataError
from rlhfkit.tasks import reasoning_gym as rgt
from rlhfkit.tasks import task_rows

reasoning_gym = pytest.importorskip("reasoning_gym")

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 100 distinct questions at most


def test_rows_are_the_library_questions_and_the_heldout_split_never_overlaps():
    task = TaskConfig(name="chain_sum", args={"min_terms": 2, "max_terms": 3}, size=300, eval_size=50, seed=3)
    train, heldout = rgt.rows(task)
    assert len(train) == 300 and len(heldout) == 50
    library = reasoning_gym.create_dataset("chain_sum", min_terms=2, max_terms=3, seed=3, size=300)
    assert [r["prompt"] for r in train] == [e["question"] for e in library]
    assert [r["response"] for r in train] == [e["answer"] for e in library]
    train_questions = {r["prompt"] for r in train}
    held = [r["prompt"] for r in heldout]
    assert not train_questions & set(held) and len(set(held)) == len(held)
    assert rgt.rows(task) == (train, heldout)  # the same settings, the same rows


def test_a_small_question_space_still_gives_a_disjoint_heldout_set_or_says_why():
    train, heldout = rgt.rows(TaskConfig(name="chain_sum", args=SMALL, size=60, eval_size=10))
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    with pytest.raises(DataError, match=r"task.eval_size=30.*lower task.size"):
        rgt.rows(TaskConfig(name="chain_sum", args=SMALL, size=2000, eval_size=30))


def test_the_score_is_the_task_own_scorer_on_the_stripped_response():
    train, _ = rgt.rows(TaskConfig(name="chain_sum", size=4))
    rows = [json.loads(json.dumps(r)) for r in train]  # as read back from train.jsonl
    sources = [r["task"] for r in rows]
    gold = [r["answer"] for r in rows]
    assert rgt.score(None, [f" {a}\n" for a in gold], sources) == [1.0] * 4
    library = reasoning_gym.create_dataset("chain_sum", seed=0, size=4)
    said = [f"The answer is {a}." for a in gold]
    assert rgt.score(None, said, sources) == [library.score_answer(s, e) for s, e in zip(said, library)]
    assert all(0 < s < 1 for s in rgt.score(None, said, sources))  # reasoning-gym's partial credit


def test_entries_come_back_exactly_where_json_would_change_them():
    # arc_agi's metadata holds tuples: read back from JSON they are lists, which its scorer finds unequal
    train, _ = rgt.rows(TaskConfig(name="arc_agi", size=2, eval_size=1))
    rows = [json.loads(json.dumps(r)) for r in train]
    assert rgt.score(None, [r["answer"] for r in rows], [r["task"] for r in rows]) == [1.0, 1.0]


def test_config_errors_name_the_key_before_anything_runs():
    with pytest.raises(ConfigError, match=r"'task.name': reasoning-gym has no task 'chain_sums'; did you mean chain_sum"):
        from_dict(SFTConfig, {"model": "m", "task": {"name": "chain_sums"}})
    with pytest.raises(ConfigError, match=r"'task.args.terms': reasoning-gym's chain_sum has no parameter 'terms' "
                                          r"\(its parameters: .*min_terms"):
        from_dict(PPOConfig, {"actor": "m", "task": {"name": "chain_sum", "args": {"terms": 2}}})
    with pytest.raises(ConfigError, match=r"'task.args': reasoning-gym's chain_sum refused"):
        from_dict(PPOConfig, {"actor": "m", "task": {"name": "chain_sum", "args": {"min_terms": 5, "max_terms": 2}}})
    with pytest.raises(ConfigError, match=r"'ppo.task.eval_size': must be >= 1"):
        from_dict(PipelineConfig, {"model": "m", "steps": ["sft", "ppo"], "task": {"name": "chain_sum"},
                                   "ppo": {"train": {"max_steps": 1}, "task": {"eval_size": 0}}})


def test_a_missing_library_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(ConfigError, match=r"'task.name': reasoning-gym is not installed; pip install 'rlhfkit\[tasks\]'"):
        from_dict(SFTConfig, {"model": "m", "task": {"name": "chain_sum"}})


def test_a_task_fills_the_data_and_reward_a_step_leaves_unset(tmp_path):
    ppo = from_dict(PPOConfig, {"actor": "m", "task": {"name": "chain_sum", "size": 20, "eval_size": 5},
                                "data": {"cache_dir": str(tmp_path)}, "train": {"max_steps": 1}})
    assert [(p.spec, p.name) for p in ppo.reward_parts()] == [(rgt.SCORE, "chain_sum")]
    said = []
    folder = task_rows(ppo, "prompts", said.append, tmp_path)
    assert folder.startswith(str(tmp_path / "tasks" / "chain_sum-")) and "20 training and 5 held-out" in said[0]
    lines = [json.loads(x) for x in open(f"{folder}/train.jsonl")]
    assert len(lines) == 20 and len(open(f"{folder}/test.jsonl").readlines()) == 5
    # the step's own data and reward win
    own = from_dict(PPOConfig, {"actor": "m", "reward": "x.py:f", "task": {"name": "chain_sum"},
                                "data": {"prompts": "p.jsonl"}, "train": {"max_steps": 1}})
    assert task_rows(own, "prompts", said.append, tmp_path) is None and own.reward_parts()[0].spec == "x.py:f"
    sft = from_dict(SFTConfig, {"model": "m", "task": {"name": "chain_sum", "size": 20, "eval_size": 5},
                                "data": {"cache_dir": str(tmp_path)}})
    assert task_rows(sft, "sft", said.append, tmp_path) == folder  # the same settings: the same folder, shared by the steps


def test_the_pipeline_gives_the_task_to_sft_and_ppo_and_needs_no_reward_model():
    cfg = from_dict(PipelineConfig, {"model": "m", "output_dir": "out", "steps": ["sft", "ppo"],
                                     "task": {"name": "chain_sum", "args": {"max_terms": 3}},
                                     "ppo": {"train": {"max_steps": 2}}})
    sft, ppo = step_config(cfg, "sft"), step_config(cfg, "ppo")
    assert sft.task == ppo.task == cfg.task and ppo.reward is None and ppo.actor.endswith("sft/final")
    with pytest.raises(ConfigError, match="'task': the steps read the task's rows; unset `dataset`"):
        from_dict(PipelineConfig, {"model": "m", "dataset": "d.jsonl", "task": {"name": "chain_sum"},
                                   "steps": ["sft", "ppo"], "ppo": {"train": {"max_steps": 2}}})
    assert not hasattr(RMConfig(), "task")  # rm and dpo read preference pairs: no task key
