"""Run-time alarms end to end through `rlhfkit ppo` on the toy world (conftest.ppo_world): an over-optimising recipe
(a very high learning rate, no KL) raises an alarm, and with monitor.action=stop the run ends there cleanly (final/
exported, the alarm in metrics.jsonl, the log and the summary); the same run with a sane recipe stays quiet."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from conftest import read_metrics, run_cli

pytestmark = pytest.mark.slow

# GRPO, 8 prompts x 4 samples, no KL in the reward: 12 iterations, the drift rules watching from the 8th on (baseline
# 5 + window 3). The reward pays for 4 words, which can take 12 tokens: at gen.max_new_tokens=12 a learning policy's
# responses are cut more and more (truncation creep, a true alarm); 16 leaves its answers room.
RUN = ["ppo.advantage_estimator=grpo", "train.batch_size=8", "ppo.n_samples_per_prompt=4",
       "train.micro_batch_size=16", "gen.max_new_tokens=16", "train.eval_every=0", "ppo.kl_coef=0",
       "log.tensorboard=false", "ppo.sample_every=0", "train.save_every=0", "train.max_steps=12"]
SANE = ["train.lr=5e-4", "ppo.kl_loss_coef=0.05"]
BAD = ["train.lr=3e-2", "ppo.kl_loss_coef=0"]


def run(world, out, *overrides, code=0):
    proc = run_cli("ppo", f"actor={world / 'sft' / 'final'}", "reward=rewards.py:four_words",
                   "data.prompts=prompts.jsonl", f"output_dir={world / out}", *RUN, *overrides, cwd=world,
                   env={"RLHFKIT_NO_REPORT": "1"})
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc, read_metrics(world / out / "metrics.jsonl"), json.loads(proc.stdout.strip().splitlines()[-1])


def alarms(rows: list[dict]) -> list[tuple[int, str]]:
    return [(row["step"], key) for row in rows for key in row if key.startswith("alarm/")]


def test_a_bad_recipe_raises_an_alarm_and_stop_ends_the_run_cleanly(ppo_world):
    # a monitor's stop exits with its own code (3), not 0: a script sees that fewer iterations ran than it asked
    proc, rows, result = run(ppo_world, "monitor_bad", *BAD, "monitor.action=stop_best", code=3)
    raised = alarms(rows)
    assert raised, (proc.stderr[-3000:], rows[-1])
    step, key = raised[0]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("alarm: ")]
    assert len(lines) >= 1 and lines[0].endswith("see docs/monitors.md") and f"since step" in lines[0]
    # stopped at the alarm's step, the way a normal end does: final/ exported and loadable, the summary says why
    assert rows[-1]["step"] == step < 12
    assert f"ppo: stopped after step {step} of 12 on an alarm (monitor.action=stop_best); final/ is this step's " \
           f"model; best/ (step {result['best_step']}) is the run's model" in proc.stderr
    assert result["stopped_at_step"] == step and result["stopped_by"] == lines[0]
    assert (result["iterations"], result["iterations_planned"]) == (step, 12)
    AutoModelForCausalLM.from_pretrained(ppo_world / "monitor_bad" / "final")
    # stop_best: the run's model is best/, the policy of the best held-out reward (no judge here: the training
    # reward's, which the summary says), evaluated at the start and at the stop
    assert result["model"] == str(ppo_world / "monitor_bad" / "best") and result["best_step"] in (0, step)
    assert result["best_by"].startswith("eval/reward (no eval.judge")
    AutoModelForCausalLM.from_pretrained(ppo_world / "monitor_bad" / "best")
    # the log.txt the run keeps has the line too, where there is one
    log = ppo_world / "monitor_bad" / "log.txt"
    if log.is_file():
        assert lines[0] in log.read_text()


def test_the_same_run_with_a_sane_recipe_stays_quiet(ppo_world):
    proc, rows, result = run(ppo_world, "monitor_sane", *SANE, "monitor.action=stop")
    assert alarms(rows) == [] and "alarm: " not in proc.stderr, proc.stderr[-3000:]
    assert rows[-1]["step"] == 12 and "stopped_at_step" not in result and result["iterations"] == 12
    # the monitors' own signals are logged every iteration
    assert {"response_length/p90", "response/repeated_4grams", "kl/max"} <= rows[-1].keys()


def test_dpo_likelihood_displacement_raises_its_alarm(tiny_model_dir, tmp_path):
    """DPO at a learning rate that drives both the chosen and the rejected log-probs down (the margin grows by
    pushing the rejected down faster): the displacement alarm fires, naming both; the same data at the test_dpo
    learning rate stays quiet."""
    from test_dpo import dpo_args
    from test_rm import rule_rows
    from conftest import write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", rule_rows(256, 0)), write_jsonl(tmp_path / "eval.jsonl",
                                                                                 rule_rows(64, 1))
    results = {}
    for name, lr in (("displaced", "5e-2"), ("healthy", "1e-2")):
        proc = run_cli("dpo", *dpo_args(tiny_model_dir, data, tmp_path / name, f"train.lr={lr}", "train.save_every=0",
                                        "train.eval_every=0", "log.tensorboard=false"),
                       env={"RLHFKIT_NO_REPORT": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = proc, read_metrics(tmp_path / name / "metrics.jsonl")
    proc, rows = results["displaced"]
    assert ("alarm/likelihood_displacement" in {key for _, key in alarms(rows)}), proc.stderr[-2000:]
    line = next(line for line in proc.stderr.splitlines() if line.startswith("alarm: logps/chosen"))
    assert "logps/rejected" in line and "since step" in line
    first = next(r for r in rows if "logps/chosen" in r)
    last = [r for r in rows if "logps/chosen" in r][-1]
    assert last["logps/chosen"] < first["logps/chosen"] and last["logps/rejected"] < first["logps/rejected"]
    proc, rows = results["healthy"]
    assert "likelihood_displacement" not in {key for _, key in alarms(rows)}, proc.stderr[-2000:]
