"""best/ (stages/best.py): kept by the held-out judge's score, or the training reward's without one, exported only
when an evaluation beats the best so far, read back on --resume; and the report's proxy-against-truth section
(report/proxy_truth.py) on a hand-built run folder."""

from __future__ import annotations

import json

from rlhfkit.engine.local import LocalEngine
from rlhfkit.report.metrics import StageRun
from rlhfkit.report.proxy_truth import alarm_events, disagreements, eval_points, points_table, proxy_truth_section
from rlhfkit.stages.best import BestKeeper


def keeper(out, judged=True, resume=False):
    exported = []

    def export(target):  # what the stage's export does, in miniature: a folder that says which step it holds
        target.mkdir(exist_ok=True)
        (target / "step.txt").write_text(str(exported[-1] if exported else "?"))
    return BestKeeper(out, judged, lambda t: (exported.append(len(exported)), export(t)), LocalEngine(), resume), exported


def test_best_follows_the_judge_exports_only_on_improvement_and_says_which_step(tmp_path):
    best, exported = keeper(tmp_path)
    evals = [(0, 0.2), (10, 0.5), (20, 0.45), (30, 0.5), (40, 0.7), (50, 0.1)]
    kept = [best.consider(step, {"eval/gold": gold, "eval/gold_se": 0.05, "eval/reward": step}) for step, gold in evals]
    assert kept == [True, True, False, False, True, False]  # equal is not better: the earlier one stays
    assert len(exported) == 3 and (tmp_path / "best").is_dir()
    record = json.loads((tmp_path / "best.json").read_text())
    assert record == {"step": 40, "metric": "eval/gold", "value": 0.7, "se": 0.05}
    assert best.summary() == {"best_step": 40, "best_by": "eval/gold", "best_value": 0.7}
    assert best.line(50, {"eval/gold": 0.1, "eval/gold_se": 0.04}) == \
        "best/ is step 40 (eval/gold 0.7 ± 0.05); final/ is step 50 (eval/gold 0.1 ± 0.04)"
    # a resumed run reads the record back: only a better evaluation replaces best/
    again, exported = keeper(tmp_path, resume=True)
    assert again.consider(60, {"eval/gold": 0.6}) is False and exported == []
    assert again.consider(70, {"eval/gold": 0.8}) is True and again.record["step"] == 70
    # a fresh run (or one that now has no judge) starts afresh
    assert keeper(tmp_path)[0].record is None and keeper(tmp_path, judged=False, resume=True)[0].record is None


def test_without_a_judge_best_follows_the_held_out_training_reward_and_says_so(tmp_path):
    best, _ = keeper(tmp_path, judged=False)
    assert best.consider(0, {"eval/reward": 1.0}) and not best.consider(5, {"eval/reward": float("nan")})
    assert best.summary()["best_by"].startswith("eval/reward (no eval.judge")
    assert best.line(5, {}).endswith("final/ is step 5 (not evaluated) (no eval.judge: best by the training reward, "
                                     "which the policy can game)")


def write_run(folder):
    """A PPO run folder: evaluations at 0, 10, 20 (gold peaks at 10 while the proxy climbs), an alarm at 20, and the
    held-out samples of each evaluation."""
    rows = [{"stage": "ppo", "step": 0, "eval/reward": 0.0, "eval/reward_se": 0.1, "eval/kl": 0.0, "eval/gold": 0.1,
             "eval/gold_se": 0.05},
            {"stage": "ppo", "step": 5, "reward/mean": 0.5, "kl": 1.0},
            {"stage": "ppo", "step": 10, "eval/reward": 1.0, "eval/kl": 2.0, "eval/gold": 0.6, "eval/gold_se": 0.05},
            {"stage": "ppo", "step": 20, "eval/reward": 2.0, "eval/kl": 5.0, "eval/gold": 0.2, "eval/gold_se": 0.05,
             "alarm/proxy_truth_gap": 1}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = []
    for step, answers in ((0, [("a", 0.0, 0.0), ("b", 1.0, 1.0), ("c", -1.0, -1.0)]),
                          (20, [("a-hacked", 3.0, -1.0), ("b", 1.0, 1.0), ("c-better", 1.0, 1.0)])):
        for prompt, (response, reward, gold) in zip(("pa", "pb", "pc"), answers):
            samples.append({"step": step, "prompt": prompt, "response": response, "reward": reward, "gold": gold})
    (folder / "eval_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return StageRun("ppo", "ppo", folder / "metrics.jsonl", rows)


def test_the_proxy_truth_section_shows_the_evaluations_the_alarms_and_the_most_disagreeing_samples(tmp_path):
    run = write_run(tmp_path)
    points = eval_points(run.rows)
    assert [(p["step"], p["kl"], p["proxy"], p.get("gold")) for p in points] == \
        [(0, 0.0, 0.0, 0.1), (10, 2.0, 1.0, 0.6), (20, 5.0, 2.0, 0.2)]
    assert alarm_events(run.rows) == [(20, "proxy_truth_gap")]
    step, worst = disagreements([json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()],
                                k=2)
    # start spread: proxy and gold both sd 1 around 0; "a-hacked" is 3 - (-1) = 4 spreads apart, the others 0
    assert step == 20 and worst[0]["response"] == "a-hacked" and worst[0]["gap"] == 4.0
    assert worst[0]["start"]["response"] == "a"
    table = points_table(points, alarm_events(run.rows))
    assert "proxy_truth_gap (20)" in table and table.count("<tr>") == 4
    html = proxy_truth_section(run, tmp_path / "plots")
    assert (tmp_path / "plots" / "proxy_truth_ppo.png").stat().st_size > 10_000
    assert "a-hacked" in html and "starting policy" in html and "eval.judge" in html
    assert "<h3>Proxy and truth: ppo</h3>" in html
    # without a judge there is no truth to name: the section is the held-out reward alone
    proxy_only = StageRun("ppo", "ppo", run.path, [{k: v for k, v in r.items() if not k.startswith("eval/gold")}
                                                   for r in run.rows])
    assert "<h3>Held-out reward: ppo</h3>" in proxy_truth_section(proxy_only, tmp_path / "plots")
    # a run with a single evaluation (or none) has no section
    assert proxy_truth_section(StageRun("ppo", "ppo", run.path, run.rows[:2]), tmp_path / "plots") == ""
