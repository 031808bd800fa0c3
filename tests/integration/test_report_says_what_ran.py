"""The report of a real run says what ran (issue 51, point 6): a GRPO run's page names GRPO, its models, reward,
settings and duration, and a DPO run's names its loss; the report the run writes at its end and the one
`rlhfkit report RUN_DIR` writes later say the same."""

from __future__ import annotations

import re
from html import unescape

import pytest

from conftest import run_cli, write_jsonl
from test_rm import rule_rows  # the labellers prefer responses that contain "honey"

pytestmark = pytest.mark.slow

WITH_REPORT = {"RLHFKIT_NO_REPORT": "0"}  # the tests' default skips the end-of-run report


def ran_table(html: str) -> dict[str, str]:
    """{row: text} of the first "what ran" table."""
    table = re.search(r'<table class="ran">(.*?)</table>', html, re.S).group(1)
    cells = re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", table)
    return {k: unescape(re.sub(r"<[^>]+>", "", v)) for k, v in cells}


def test_a_grpo_runs_report_names_grpo_its_settings_and_duration(ppo_world):
    out = ppo_world / "report_grpo"
    proc = run_cli("ppo", f"actor={ppo_world / 'sft' / 'final'}", "reward=rewards.py:four_words",
                   "data.prompts=prompts.jsonl", "data.eval_prompts=eval.jsonl", f"output_dir={out}",
                   "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4", "train.batch_size=4",
                   "train.micro_batch_size=16", "train.lr=5e-4", "gen.max_new_tokens=8", "ppo.kl_coef=0",
                   "ppo.kl_loss_coef=0.05", "train.max_steps=2", "log.tensorboard=false", "ppo.sample_every=0",
                   cwd=ppo_world, env=WITH_REPORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written_by_run = (out / "report.html").read_text()

    assert run_cli("report", str(out)).returncode == 0
    html = (out / "report.html").read_text()
    assert html == written_by_run  # the run's own report and a later `rlhfkit report` agree

    assert "<h2>GRPO — rlhfkit ppo</h2>" in html and "PPO — ppo" not in html
    ran = ran_table(html)
    assert ran["estimator"].startswith("ppo.advantage_estimator=grpo — GRPO (Shao et al. 2024)")
    assert ran["actor"] == str(ppo_world / "sft" / "final")
    assert ran["reward"] == "rewards.py:four_words (a Python function)"
    assert ran["critic"] == "none (grpo needs no critic)" and ran["reference"] == "the actor (default)"
    assert ran["data"] == "prompts: prompts.jsonl · eval: eval.jsonl"
    assert "train.lr=0.0005" in ran["training"] and "ppo.n_samples_per_prompt=4" in ran["training"]
    assert "train.max_steps=2" in ran["training"] and ran["generation"].startswith("gen.max_new_tokens=8")
    assert ran["KL"] == "ppo.kl_loss_coef=0.05 (a k3 term in the loss)"
    seconds = float(re.match(r"([\d.]+) s: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d → ", ran["duration"]).group(1))
    assert 0 < seconds < 300 and "in the 2 iterations" in ran["duration"], ran["duration"]
    assert "<script" not in html.lower() and "http" not in html  # still plain: no scripts, no network


def test_a_dpo_runs_report_names_its_loss(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", rule_rows(32, 0))
    out = tmp_path / "dpo"
    proc = run_cli("dpo", f"model={tiny_model_dir}", f"data.train={data}", "data.eval_fraction=0.25",
                   f"output_dir={out}", "dpo.loss=ipo", "dpo.beta=0.2", "train.max_steps=2", "train.batch_size=8",
                   "train.micro_batch_size=8", "log.tensorboard=false", env=WITH_REPORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = (out / "report.html").read_text()
    assert "<h2>IPO — rlhfkit dpo</h2>" in html
    ran = ran_table(html)
    assert ran["loss"].startswith("dpo.loss=ipo — IPO: ") and ran["loss"].endswith("dpo.beta=0.2")
    assert ran["model"] == str(tiny_model_dir) and ran["reference"] == "the model (default)"
    assert ran["data"] == f"train: {data} · eval: the source's eval split, or data.eval_fraction=0.25 of it"
    assert "in the 2 steps" in ran["duration"]
