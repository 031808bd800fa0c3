"""The report of a real run says what ran (issue 51, point 6): a GRPO run's page names GRPO, its models, reward,
settings and duration, and a DPO run's names its loss; the report the run writes at its end and the one
`rlhfkit report RUN_DIR` writes later say the same."""

from __future__ import annotations

import json
import re
from html import unescape

import pytest

from conftest import run_cli, write_jsonl
from test_rm import rule_rows  # the labellers prefer responses that contain "honey"

pytestmark = pytest.mark.slow

WITH_REPORT = {"RLHFKIT_NO_REPORT": "0"}  # the tests' default skips the end-of-run report
# a conditional rule where this run's value belongs ("the reward model if it reads the actor's tokens, else ...")
RULE = re.compile(r"\b(if|else|unless|otherwise|when|whether|either)\b|\bnull\b", re.I)


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
    assert ran["rollout"] == "rollout.engine=native (rlhfkit's decoder on the actor)"
    assert ran["engine"] == "engine.backend=local · engine.precision=fp32"
    assert not {row: text for row, text in ran.items() if RULE.search(text)}
    # one update per iteration: the ratio to the sampling policy is 1, so clip fraction and approx. KL are 0 and
    # are left out of the plots, with the reason
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert {r["clip_fraction"] for r in metrics if "clip_fraction" in r} == {0.0}
    assert ("clip_fraction and approx_kl are 0 at every step: one update per iteration (ppo.epochs=1, one "
            "mini-batch) never moves the policy away from the one that sampled") in html


ASK = '''
from rlhfkit.envs import Environment, Step


class AskTwice(Environment):
    """Asks the row's prompt, then once more; rewards answers of four words."""

    def reset(self, row):
        self.prompt, self.scores = row["prompt"], []
        return self.prompt

    def step(self, text):
        self.scores.append(1 - abs(len(text.split()) - 4) / 4)
        return Step(done=True) if len(self.scores) == 2 else self.prompt

    def reward(self):
        return sum(self.scores) / len(self.scores)
'''


def test_an_agent_runs_report_names_its_environment_and_draws_its_episodes(ppo_world):
    """`rlhfkit ppo env=...`: the table names the environment, its tools and turn limits (its reward row once said
    null), and the episodes' metrics have panels of their own. (The tiny model's 256 positions leave no room for a
    tool's description: the table's tools row with tools listed is checked in tests/unit/test_report_run_info.py.)"""
    from rlhfkit.report.metrics import StageRun, load_metrics
    from rlhfkit.report.plots import stage_figure

    (ppo_world / "ask_twice.py").write_text(ASK)
    out = ppo_world / "report_agent"
    proc = run_cli("ppo", f"actor={ppo_world / 'sft' / 'final'}", "env=ask_twice.py:AskTwice",
                   "episode.max_turns=2", "episode.max_tokens=40",
                   "data.prompts=prompts.jsonl", "data.eval_prompts=eval.jsonl", f"output_dir={out}",
                   "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4", "train.batch_size=4",
                   "train.micro_batch_size=16", "gen.max_new_tokens=8", "ppo.kl_coef=0", "ppo.kl_loss_coef=0.05",
                   "train.max_steps=2", "train.eval_every=0", "log.tensorboard=false", "ppo.sample_every=0",
                   cwd=ppo_world, env=WITH_REPORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = (out / "report.html").read_text()
    ran = ran_table(html)
    assert ran["reward"] == "the episode's return, from the environment (below)"
    assert ran["environment"] == "env=ask_twice.py:AskTwice"
    assert ran["tools"] == "none listed (episode.tools=[])"
    assert ran["turns"] == "episode.max_turns=2 · episode.max_tokens=40"
    assert not {row: text for row, text in ran.items() if RULE.search(text)}

    rows = load_metrics(out / "metrics.jsonl")
    fig = stage_figure(StageRun("ppo", "ppo", out / "metrics.jsonl", rows))
    drawn = {line.get_label().split(" (avg")[0] for ax in fig.axes for line in ax.get_lines()}
    assert {"episode/turns", "episode/env_tokens", "episode/ended_done"} <= drawn, drawn
    assert all(ax.get_lines() for ax in fig.axes if ax.get_visible() and ax.get_title())  # none drawn empty
    # a panel left with one of the curves its title names says which one it is
    shares = next(ax for ax in fig.axes if ax.get_title() == "Share of episodes: how they ended, tool use")
    assert [t.get_text() for t in shares.get_legend().get_texts()] == ["episode/ended_done"]
    # no tools, no failures: what is 0 at every step is named once on the page, not drawn as a flat line
    logged = {k for r in rows for k in r if k.startswith("episode/")}
    flat = sorted(k for k in logged if all(r[k] == 0 for r in rows if k in r))
    note = re.search(r'<p class="meta">Not drawn: (.*?)</p>', html).group(1)
    assert flat and all(k in note and k not in drawn for k in flat), (flat, note)


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
    assert ran["data"] == f"train: {data} · eval: data.eval_fraction=0.25 of it, held out"
    assert "in the 2 steps" in ran["duration"]
