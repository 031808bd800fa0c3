"""The embedded default, reduced (`rlhfkit demo --quick`), through the CLI: it must LEARN, not only run."""

import json
import time

from conftest import read_metrics, run_cli


def test_quick_demo_learns_what_the_gold_reward_stands_for(tmp_path):
    out = tmp_path / "demo"
    tick = time.perf_counter()
    res = run_cli("demo", "--quick", "--output", str(out), timeout=600)
    seconds = time.perf_counter() - tick
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "every bar passed" in res.stdout and seconds < 180

    summary = json.loads((out / "summary.json").read_text())
    rows = {r["name"]: r for r in summary["rows"]}
    assert all(r["passed"] for r in summary["rows"] if r["passed"] is not None)
    # the reward model generalises to held-out topics, on pairs labelled by the gold reward without noise
    assert rows["RM accuracy, held-out gold-labelled pairs"]["value"] >= 0.9  # measured 1.0
    gold = json.loads((out / "gold.json").read_text())
    sft, ppo, best = gold["policies"]["sft"], gold["policies"]["ppo"], gold["best"]
    # PPO raised the hidden gold reward by far more than noise and than the bar's third of the way to the best
    assert ppo["mean"] - sft["mean"] >= 5 * (ppo["stderr"] ** 2 + sft["stderr"] ** 2) ** 0.5  # measured 22
    assert ppo["mean"] - sft["mean"] >= 0.5 * (best - sft["mean"])  # measured 1.56 of 2.37
    assert rows["KL(PPO || SFT), nats per response"]["value"] <= summary["kl_budget"]
    # the noise really was in the RM's training labels
    assert 0.05 < summary["pairs"]["train"]["flipped"] / (summary["pairs"]["train"]["pairs"]) < 0.15

    # the pipeline's own curves agree: SFT loss fell, RM eval accuracy rose, PPO's eval reward (RM score) rose
    sft_eval = [m["eval/loss"] for m in read_metrics(out / "sft" / "metrics.jsonl") if "eval/loss" in m]
    rm_eval = [m["eval/accuracy"] for m in read_metrics(out / "rm" / "metrics.jsonl") if "eval/accuracy" in m]
    ppo_eval = [m["eval/reward"] for m in read_metrics(out / "ppo" / "metrics.jsonl") if "eval/reward" in m]
    assert sft_eval[-1] < 0.5 * sft_eval[0] and rm_eval[-1] > rm_eval[0] + 0.3 and ppo_eval[-1] > ppo_eval[0] + 1

    # the report: summary, gold chart, curves of every step, before/after samples
    html = (out / "report.html").read_text()
    for needle in ("Summary", "Gold reward", "plots/gold_reward.png", "plots/curves_ppo.png", "Samples", "PASS"):
        assert needle in html, needle
    assert all((out / "plots" / f"curves_{s}.png").is_file() for s in ("base", "sft", "rm", "ppo"))
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and set(samples[0]) == {"prompt", "before", "after", "before_reward", "after_reward"}

    # a second run reuses every complete step, re-evaluates, and says the wall time was not measured
    again = run_cli("demo", "--quick", "--output", str(out))
    assert again.returncode == 0, again.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert rows["wall time, seconds"]["passed"] is None and "reused" in rows["wall time, seconds"]["target"]
    assert json.loads((out / "gold.json").read_text())["policies"] == gold["policies"]  # seeded: same numbers
