"""rlhfkit.report: metrics.jsonl -> PNG plots + report.html, on synthetic runs."""

import json
import math
import re

import numpy as np
import pytest
from PIL import Image

from rlhfkit.cli import main as cli_main
from rlhfkit.report import load_metrics, write_report
from rlhfkit.report.metrics import moving_average, series


def main(argv: list[str]) -> int:
    """`rlhfkit report ARGV`, as typed."""
    return cli_main(["report", *argv])


def _write_metrics(path, rows, truncated_tail=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if truncated_tail is not None:
        text += truncated_tail  # a killed run: half a line, no newline
    path.write_text(text)


def _sft_rows(n=40):
    rows = [{"step": s, "stage": "sft", "loss": 3.0 * math.exp(-s / 15) + 0.1 * (s % 3), "lr": 1e-4} for s in range(n)]
    for s in range(0, n, 10):
        rows[s].update({"eval/loss": 2.5 * math.exp(-s / 15), "eval/perplexity": math.exp(2.5 * math.exp(-s / 15))})
    rows[1]["lr"] = "warmup"  # non-numeric values are ignored
    return rows


def _rm_rows(n=30):
    rows = [{"step": s, "stage": "rm", "loss": 0.7 - 0.01 * s, "accuracy": 0.5 + 0.01 * s} for s in range(n)]
    rows += [{"step": s, "stage": "rm", "eval/loss": 0.6, "eval/accuracy": 0.7, "eval/chosen": 1.0,
              "eval/rejected": -0.5, "eval/margin": 1.5} for s in (10, 20)]
    return rows


def _ppo_rows(n=30):
    keys = ["kl", "kl_coef", "policy_loss", "value_loss", "response_length", "entropy", "clip_fraction",
            "approx_kl", "return/mean", "value/mean", "advantage/mean"]
    return [{"step": s, "stage": "ppo", "reward/mean": 0.1 * s, "reward/std": 0.5, **{k: 0.01 * s + 0.1 for k in keys}}
            for s in range(n)]


def _png_refs(html):
    return re.findall(r'<img src="([^"]+)"', html)


def _assert_valid_png(path):
    assert path.is_file() and path.stat().st_size > 5_000
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width > 300 and img.height > 200


def test_load_metrics_skips_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_metrics(path, _sft_rows(5), truncated_tail='{"step": 5, "stage": "sft", "lo')
    rows = load_metrics(path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]


def test_load_metrics_rejects_corrupt_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo\n{"step": 2, "loss": 0.5}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        load_metrics(path)


def test_series_ignores_non_numeric_and_missing_values():
    rows = [{"step": 0, "loss": 1.0}, {"step": 1, "loss": "nan?"}, {"step": 2}, {"step": 3, "loss": True},
            {"step": 4, "loss": float("nan")}, {"step": 5, "loss": 0.5}]
    steps, values = series(rows, "loss")
    assert steps.tolist() == [0, 5] and values.tolist() == [1.0, 0.5]


def test_series_sorts_by_step_and_keeps_the_resumed_value():
    rows = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}, {"step": 3, "loss": 0.8},
            {"step": 2, "loss": 0.7}, {"step": 3, "loss": 0.6}, {"step": 0, "loss": 1.1}]
    steps, values = series(rows, "loss")
    assert steps.tolist() == [0, 1, 2, 3] and values.tolist() == [1.1, 1.0, 0.7, 0.6]


def test_moving_average_keeps_length_and_averages_edges_over_existing_points():
    out = moving_average(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), 3)
    assert out.tolist() == pytest.approx([1.5, 2.0, 3.0, 4.0, 4.5])


def test_single_stage_run(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl", _sft_rows(), truncated_tail='{"step": 40, "sta')
    out = write_report(tmp_path)
    html = out.read_text()
    assert out == tmp_path / "report.html"
    refs = _png_refs(html)
    assert refs == ["plots/curves_sft.png"]
    _assert_valid_png(tmp_path / refs[0])
    assert "40 logged rows" in html and "eval/perplexity" in html
    assert "<script" not in html.lower() and "http" not in html  # self-contained, no JS


def test_pipeline_layout_with_extras(tmp_path):
    _write_metrics(tmp_path / "sft" / "metrics.jsonl", _sft_rows())
    _write_metrics(tmp_path / "rm" / "metrics.jsonl", _rm_rows(), truncated_tail="{")
    _write_metrics(tmp_path / "ppo" / "metrics.jsonl", _ppo_rows())
    (tmp_path / "notes").mkdir()  # a subfolder without metrics is ignored
    (tmp_path / "summary.json").write_text(json.dumps({"title": "Demo & results", "rows": [
        {"name": "RM accuracy", "value": 0.8123456, "target": ">= 0.7", "passed": True},
        {"name": "Gold reward gain", "value": -0.25, "target": "> 0", "passed": False},
        {"name": "KL", "value": 1.5},
    ]}))
    (tmp_path / "gold.json").write_text(json.dumps({"policies": {
        "base": {"mean": -0.5, "stderr": 0.1}, "sft": {"mean": 0.2, "stderr": 0.08},
        "ppo": {"mean": 0.9, "stderr": 0.05}}, "best": 1.2}))
    samples = [{"prompt": "Say <script>alert(1)</script>", "before": "a & b", "after": "x < y",
                "before_reward": 0.1, "after_reward": 0.9}, {"prompt": "p2", "before": "b2", "after": "a2"}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))

    html = write_report(tmp_path).read_text()

    refs = _png_refs(html)
    assert refs == ["plots/gold_reward.png", "plots/curves_sft.png", "plots/curves_rm.png", "plots/curves_ppo.png"]
    for ref in refs:
        _assert_valid_png(tmp_path / ref)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(r.split("/")[1] for r in refs)
    # the stages come in pipeline order, the summary title becomes the page title (escaped)
    assert html.index("SFT — sft") < html.index("RM — rm") < html.index("PPO — ppo")
    assert "<title>Demo &amp; results</title>" in html
    # pass/fail colouring on the right rows
    assert re.search(r'<tr class="pass"><td>RM accuracy</td><td class="num">0.8123</td>.*?PASS', html)
    assert re.search(r'<tr class="fail"><td>Gold reward gain</td>.*?FAIL', html)
    assert re.search(r'<tr class=""><td>KL</td>', html)
    # sample text is escaped, rewards shown
    assert "<script>" not in html
    assert "Say &lt;script&gt;alert(1)&lt;/script&gt;" in html and "a &amp; b" in html and "x &lt; y" in html
    assert "reward 0.9" in html


def test_ppo_eval_metrics_are_drawn_beside_the_rollouts(tmp_path):
    from rlhfkit.report.metrics import StageRun
    from rlhfkit.report.plots import stage_figure

    rows = _ppo_rows(30)
    for row in rows[::10]:  # train.eval_every=10
        row.update({"eval/reward": 0.2, "eval/kl": 0.05, "eval/response_length": 7.0})
    fig = stage_figure(StageRun("ppo", "ppo", tmp_path / "metrics.jsonl", rows))
    drawn = {ax.get_title(): [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
             for ax in fig.axes}
    assert "eval/reward" in drawn["Reward (mean ± std)"] and "eval/kl" in drawn["KL to reference"]
    assert "eval/response_length" in drawn["Response length (tokens)"]
    eval_line = next(line for line in fig.axes[0].get_lines() if line.get_label() == "eval/reward")
    assert list(eval_line.get_xdata()) == [0, 10, 20]  # its own sparse steps, unsmoothed


def test_a_training_runs_samples_show_their_response_and_score_first_and_last(tmp_path):
    """PPO's samples.jsonl rows ({step, prompt, response, reward}) are a table of what was sampled, not the demo's
    before/after columns (which showed them empty)."""
    from rlhfkit.report.page import MAX_SAMPLES

    _write_metrics(tmp_path / "metrics.jsonl", _ppo_rows())
    samples = [{"step": s, "prompt": f"prompt {s}", "response": f"answer <{s}>", "reward": s / 10 if s > 1 else None}
               for s in range(1, MAX_SAMPLES + 21)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    html = write_report(tmp_path).read_text()
    half = MAX_SAMPLES // 2
    assert f"(the first {half} and the last {MAX_SAMPLES - half} of {MAX_SAMPLES + 20})" in html
    assert "answer &lt;1&gt;" in html and f"answer &lt;{MAX_SAMPLES + 20}&gt;" in html
    assert f"answer &lt;{half + 1}&gt;" not in html  # the middle is left out
    assert "reward 0.2</div>" in html and "<th>before</th>" not in html
    # an unjudged response says so (it was once shown as "reward 0")
    assert '<pre>answer &lt;1&gt;</pre><div class="meta">unjudged</div>' in html


def test_title_argument_and_unknown_stage(tmp_path):
    rows = [{"step": s, "stage": "dpo", "loss": 1.0 / (s + 1), "eval/loss": 1.2 / (s + 1)} for s in range(20)]
    _write_metrics(tmp_path / "metrics.jsonl", rows)
    html = write_report(tmp_path, title="My <run>").read_text()
    assert "<h1>My &lt;run&gt;</h1>" in html
    _assert_valid_png(tmp_path / "plots" / "curves_dpo.png")
    from rlhfkit.cli import main as cli_main  # the command line takes it too

    assert cli_main(["report", str(tmp_path), "--title", "From the CLI"]) == 0
    assert "<h1>From the CLI</h1>" in (tmp_path / "report.html").read_text()


def test_empty_metrics_file_gives_a_section_without_plot(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    html = write_report(tmp_path).read_text()
    assert "No numeric metrics logged yet." in html and _png_refs(html) == []


def test_malformed_gold_json_is_a_clear_error(tmp_path, capsys):
    _write_metrics(tmp_path / "metrics.jsonl", _ppo_rows(5))
    (tmp_path / "gold.json").write_text(json.dumps({"policies": {"base": {"stderr": 0.1}}}))
    with pytest.raises(ValueError, match="gold.json"):
        write_report(tmp_path)
    assert main([str(tmp_path)]) == 2
    assert "gold.json" in capsys.readouterr().err


def test_main_prints_report_path(tmp_path, capsys):
    _write_metrics(tmp_path / "rm" / "metrics.jsonl", _rm_rows())
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "report.html")
    assert (tmp_path / "report.html").is_file()


def test_main_on_folder_without_metrics_returns_2(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and len(err.strip().splitlines()) == 1
    assert main([str(tmp_path / "missing")]) == 2


def _data_lines(fig):
    """(axes title, line) of every drawn metric line (legend-labelled), over all axes including twins."""
    return [(ax.get_title(), line) for ax in fig.axes for line in ax.get_lines()
            if not line.get_label().startswith("_")]


def test_a_two_step_run_draws_markers_not_a_joined_line(tmp_path):
    """Two logged steps are two measurements: a line joining them suggests a trend between them that nothing
    measured, so a short curve is drawn as points only (and its band as error bars)."""
    from rlhfkit.report.metrics import StageRun
    from rlhfkit.report.plots import stage_figure

    rows = _ppo_rows(3)[1:]  # steps 1 and 2, as `train.max_steps=2` logs them
    fig = stage_figure(StageRun("ppo", "ppo", tmp_path / "metrics.jsonl", rows))
    lines = _data_lines(fig)
    assert {title for title, _ in lines} >= {"Reward (mean ± std)", "KL to reference", "Policy loss"}
    for title, line in lines:
        assert len(line.get_xdata()) == 2, title
        assert line.get_marker() not in (None, "", "None", " "), (title, line.get_label())
        assert line.get_linestyle() in ("None", "", " "), (title, line.get_label(), line.get_linestyle())
    reward_ax = next(ax for ax in fig.axes if ax.get_title() == "Reward (mean ± std)")
    assert reward_ax.containers, "the ± std band of 2 points is drawn as error bars"


def test_a_single_point_is_a_visible_marker(tmp_path):
    from rlhfkit.report.metrics import StageRun
    from rlhfkit.report.plots import stage_figure

    rows = [{"step": 1, "stage": "sft", "loss": 2.5, "lr": 1e-5}]
    fig = stage_figure(StageRun("sft", "sft", tmp_path / "metrics.jsonl", rows))
    lines = _data_lines(fig)
    assert len(lines) == 2
    for title, line in lines:
        assert list(line.get_xdata()) == [1] and line.get_marker() not in (None, "", "None", " "), title
        assert line.get_markersize() >= 5, title  # a point one can see, not a 3-pixel dot on an empty plot


def test_a_long_run_keeps_its_line(tmp_path):
    from rlhfkit.report.metrics import StageRun
    from rlhfkit.report.plots import stage_figure

    fig = stage_figure(StageRun("sft", "sft", tmp_path / "metrics.jsonl", _sft_rows(40)))
    loss = next(line for title, line in _data_lines(fig) if title == "Loss" and line.get_label().startswith("loss"))
    assert loss.get_linestyle() == "-"


def _titles(fig):
    return [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title()]


def _agent_rows(n=12):
    """An env run's rows as `episode_metrics` logs them: turns, tool calls and environment tokens per episode, the
    share that called a tool and of each way an episode ended (none timed out or raised; a few hit bad values)."""
    rows = []
    for s in range(1, n + 1):
        done = min(0.9, 0.3 + 0.05 * s)
        rows.append({"step": s, "stage": "ppo", "reward/mean": 0.05 * s, "reward/std": 0.2, "kl": 0.01 * s,
                     "kl_coef": 0.0, "policy_loss": 0.1 / s, "entropy": 1.0 - 0.02 * s, "response_length": 40.0,
                     "clip_fraction": 0.0, "approx_kl": 7e-14 * (s % 3),  # a ratio of 1 from two forwards
                     "episode/turns": 1.5 + 0.1 * s, "episode/tool_calls": 0.2 * s,
                     "episode/used_tool": min(1.0, 0.04 * s),
                     "episode/env_tokens": 12.0 + s, "episode/ended_done": done, "episode/ended_max_turns": 1 - done,
                     "episode/ended_max_tokens": 0.0, "episode/ended_raised": 0.0, "episode/ended_timeout": 0.0,
                     "episode/ended_bad_value": 0.05 if s % 4 == 0 else 0.0, "episode/opening_cut": 0.0})
    return rows


def test_an_agent_runs_episodes_get_their_own_panels(tmp_path):
    from rlhfkit.report.metrics import StageRun
    from rlhfkit.report.plots import stage_figure

    fig = stage_figure(StageRun("ppo", "ppo", tmp_path / "metrics.jsonl", _agent_rows()))
    drawn = {}
    for title, line in _data_lines(fig):
        drawn.setdefault(title, []).append(line.get_label().split(" (avg")[0])
    assert drawn["Turns and tool calls per episode"] == ["episode/turns", "episode/tool_calls"]
    assert drawn["Environment tokens per episode"] == ["episode/env_tokens"]
    # every way an episode ended that happened, in the run's order; the ways none ended are not drawn at 0
    assert drawn["Share of episodes: how they ended, tool use"] == [
        "episode/ended_done", "episode/ended_max_turns", "episode/ended_bad_value", "episode/used_tool"]
    # a panel none of whose metrics the run logs (a critic-free run's value loss) is not drawn empty
    assert "Value loss" not in _titles(fig) and "Returns, values, advantages" not in _titles(fig)
    assert all(ax.get_lines() for ax in fig.axes if ax.get_visible() and ax.get_title())


def test_constant_zero_clip_fraction_and_approx_kl_are_left_out_and_the_page_says_why(tmp_path):
    """With one update per iteration the ratio to the sampling policy is 1 (approx. KL ~1e-13: float rounding of two
    forwards): clip fraction and approx. KL are 0 at every step, two flat lines that tell nothing. They are not
    drawn; the page says so, and why, once."""
    from rlhfkit.config.fields import dump_yaml, load_config
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.report.metrics import StageRun
    from rlhfkit.report.plots import stage_figure

    rows = _agent_rows()
    _write_metrics(tmp_path / "metrics.jsonl", rows)
    dump_yaml(load_config(PPOConfig, None, ["actor=a", "env=my_env.py:MyEnv", "data.prompts=p.jsonl",
                                            "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4",
                                            "ppo.kl_coef=0", "ppo.kl_loss_coef=0.05", "train.max_steps=12"]),
              tmp_path / "config.yaml")
    titles = _titles(stage_figure(StageRun("ppo", "ppo", tmp_path / "metrics.jsonl", rows)))
    assert "Clip fraction" not in titles and "Approx. KL (old -> new policy)" not in titles
    assert "KL to reference" in titles  # kl is drawn; its kl_coef (0 at every step: no penalty in the reward) not
    html = write_report(tmp_path).read_text()
    note = re.findall(r'<p class="meta">Not drawn: (.*?)</p>', html)
    assert note == ["kl_coef is 0 at every step: ppo.kl_coef=0 (no KL penalty in the reward); clip_fraction and "
                    "approx_kl are 0 at every step: one update per iteration (ppo.epochs=1, one mini-batch) never "
                    "moves the policy away from the one that sampled; episode/ended_max_tokens, episode/ended_raised, "
                    "episode/ended_timeout and episode/opening_cut are 0 at every step."]

    # two epochs over each rollout do move the policy: a 0 there is not explained by the config, only stated
    config = (tmp_path / "config.yaml").read_text().replace("epochs: 1", "epochs: 2")
    (tmp_path / "config.yaml").write_text(config)
    note = re.findall(r'<p class="meta">Not drawn: (.*?)</p>', write_report(tmp_path).read_text())[0]
    assert note.startswith("kl_coef is 0 at every step: ppo.kl_coef=0") and \
        "clip_fraction, approx_kl, episode/ended_max_tokens, episode/ended_raised, episode/ended_timeout and " \
        "episode/opening_cut are 0 at every step." in note


def test_a_run_without_a_judge_has_no_proxy_gold_panel(tmp_path):
    """No eval.judge, no eval/gold: the held-out proxy is drawn on its own, not beside an empty gold axis."""
    from rlhfkit.report.plots import proxy_truth_figure

    points = [{"step": s, "kl": 0.1 * s, "proxy": 0.2 * s} for s in range(0, 40, 10)]
    fig = proxy_truth_figure(points, alarms=[(20, "kl_rise")])
    words = " ".join(ax.get_title() + ax.get_ylabel() + " ".join(t.get_text() for t in ax.get_legend().get_texts())
                     for ax in fig.axes if ax.get_legend())
    assert "gold" not in words.lower() and "proxy" in words
    assert len(fig.axes) == 2 and all(ax.get_lines() for ax in fig.axes)  # no empty twin axis

    judged = proxy_truth_figure([{**p, "gold": 0.1 * p["step"], "gold_stderr": 0.01} for p in points])
    assert any(ax.get_ylabel() == "gold reward" for ax in judged.axes)

    # the page of such a run keeps its held-out evaluations (proxy, KL, alarms), drawn as above
    rows = _ppo_rows(40)
    for p in points:
        rows[p["step"]].update({"eval/reward": p["proxy"], "eval/kl": p["kl"]})
    _write_metrics(tmp_path / "metrics.jsonl", rows)
    html = write_report(tmp_path).read_text()
    _assert_valid_png(tmp_path / "plots" / "proxy_truth_ppo.png")
    assert "plots/proxy_truth_ppo.png" in _png_refs(html) and "<th>gold</th>" not in html
