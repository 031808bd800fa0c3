"""The embedded default, reduced (`rlhfkit demo --quick`), through the CLI: it must LEARN, not only run."""

import json
import os

import torch
from transformers import AutoModelForCausalLM

from conftest import assert_bars_passed, read_metrics, run_cli

from rlhfkit.demo.run import MAX_THREADS

GAP = "generalisation gap: PPO gold, training - held-out prompts"
EXPLOIT = "exploit rate: PPO held-out samples with an exploit"


def test_quick_demo_learns_what_the_gold_reward_stands_for(tmp_path):
    out = tmp_path / "demo"
    res = run_cli("demo", "--quick", "--output", str(out), timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    # every bar but its time, the demo's own wall-time bar (<= 600 s), which is not a bound here: 150 s measured
    # on 2 cores of an AVX-512 host, 298 s on an AVX2 one
    assert_bars_passed(res, summary)
    # the threads the environment gives (OMP_NUM_THREADS: 1 unless set, tests/conftest.py), capped
    assert summary["threads"] == min(int(os.environ["OMP_NUM_THREADS"]), MAX_THREADS)
    rows = {r["name"]: r for r in summary["rows"]}
    # the reward model generalises to unseen (topic, mood) combinations, on pairs labelled by the gold without noise
    assert rows["RM accuracy, held-out gold-labelled pairs"]["value"] >= 0.8  # measured 0.81
    gold = json.loads((out / "gold.json").read_text())
    sft, ppo, best = gold["policies"]["sft"], gold["policies"]["ppo"], gold["best"]
    # PPO raised the hidden gold reward by far more than noise and than the bar's third of the way to the best
    assert ppo["mean"] - sft["mean"] >= 5 * (ppo["stderr"] ** 2 + sft["stderr"] ** 2) ** 0.5  # measured 8.3
    assert ppo["mean"] - sft["mean"] >= (best - sft["mean"]) / 3  # measured 0.67 of 1.73
    assert rows["KL(PPO || SFT), nats per response"]["value"] <= summary["kl_budget"]
    # it learned to read the prompt: on held-out combinations it says a word of another mood far less often
    flaws = summary["flaws"]
    assert flaws["ppo"]["adjective of another mood"] < 0.6 * flaws["sft"]["adjective of another mood"]
    # held-out gold is not far below training-prompt gold; the exploits are counted and capped
    assert rows[GAP]["passed"] and abs(summary["train_gold"]["mean"] - ppo["mean"]) < 0.3
    assert rows[EXPLOIT]["value"] == flaws["ppo"]["exploit"] <= 0.4
    assert "proxy exploits found (flaws PPO made more frequent)" in rows
    # the noise really was in the RM's training labels
    assert 0.05 < summary["pairs"]["train"]["flipped"] / (summary["pairs"]["train"]["pairs"]) < 0.15

    # the pipeline's own curves agree: SFT loss fell, RM eval accuracy rose, PPO's eval reward (RM score) rose
    sft_eval = [m["eval/loss"] for m in read_metrics(out / "sft" / "metrics.jsonl") if "eval/loss" in m]
    rm_eval = [m["eval/accuracy"] for m in read_metrics(out / "rm" / "metrics.jsonl") if "eval/accuracy" in m]
    ppo_eval = [m["eval/reward"] for m in read_metrics(out / "ppo" / "metrics.jsonl") if "eval/reward" in m]
    assert sft_eval[-1] < 0.5 * sft_eval[0] and rm_eval[-1] > rm_eval[0] + 0.2 and ppo_eval[-1] > ppo_eval[0] + 0.4

    # over-optimisation in view: the SFT start, every checkpoint and the final policy, proxy and gold against KL
    curve = json.loads((out / "overoptimisation.json").read_text())
    points = curve["points"]
    assert [p["step"] for p in points] == [0, 20, 40, 60, 80, 100] and points[0]["kl"] == 0.0
    assert points[-1]["proxy"] > points[0]["proxy"] + 0.5 and points[-1]["gold"] > points[0]["gold"] + 0.4
    assert curve["split"] == "validation" and not curve["early_stop"] and curve["chosen_step"] == 100

    # the report: summary, gold chart, the over-optimisation curve, curves of every step, before/after samples
    html = (out / "report.html").read_text()
    for needle in ("Summary", "Gold reward", "plots/gold_reward.png", "Over-optimisation", "plots/overoptimisation.png",
                   "plots/curves_ppo.png", "Samples", "PASS"):
        assert needle in html, needle
    assert all((out / "plots" / f"curves_{s}.png").is_file() for s in ("base", "sft", "rm", "ppo"))
    assert (out / "plots" / "overoptimisation.png").is_file()
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and set(samples[0]) == {"prompt", "before", "after", "before_reward", "after_reward"}

    # reward hacking in view (docs/monitors.md): the healthy default raises no alarm; PPO's held-out judge is the
    # hidden gold (eval/gold beside eval/reward), and best/ is the policy of the best validation gold
    ppo_rows = read_metrics(out / "ppo" / "metrics.jsonl")
    assert not [k for r in ppo_rows for k in r if k.startswith("alarm/")] and "alarm: " not in res.stderr
    golds = {r["step"]: r["eval/gold"] for r in ppo_rows if "eval/gold" in r}
    best_record = json.loads((out / "ppo" / "best.json").read_text())
    assert sorted(golds) == [0, 20, 40, 60, 80, 100] and best_record["value"] == max(golds.values())
    assert golds[best_record["step"]] == best_record["value"] and best_record["metric"] == "eval/gold"
    AutoModelForCausalLM.from_pretrained(out / "ppo" / "best")
    assert "Proxy and truth: ppo" in html and (out / "plots" / "proxy_truth_ppo.png").is_file()

    overoptimising_recipe_alarms_and_best_beats_final(out)
    the_pages_run_as_printed_after_the_demo(out, tmp_path / "user")

    # a second run reuses every complete step and re-measures (seeded: the same curve); with --early-stop the bar
    # evaluates the checkpoint of best validation gold, and says the wall time was not measured
    # ... and with --algos the arena trains GRPO (against the same RM, PPO's sample budget) and DPO (on the RM's
    # noisy pairs) from the same SFT model, each of which must beat SFT's gold by 3 standard errors
    again = run_cli("demo", "--quick", "--early-stop", "--algos", "grpo,dpo", "--output", str(out), timeout=900)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    arena = json.loads((out / "arena.json").read_text())
    assert list(arena["algos"]) == ["ppo", "grpo", "dpo"] and arena["samples"] == len(samples) * 2
    for algo, r in arena["algos"].items():
        assert r["gain_se"] >= 3 and r["gold"]["mean"] > arena["sft"]["mean"], (algo, r)
    assert arena["algos"]["grpo"]["used"] == arena["algos"]["ppo"]["used"]  # the same samples
    assert (out / "arena" / "grpo" / "final" / "config.json").is_file()
    assert (out / "ppo" / "final-critic").is_dir() and not (out / "arena" / "grpo" / "final-critic").exists()
    assert "the arena: every algorithm from the same SFT model" in again.stdout
    assert "plots/arena.png" in (out / "report.html").read_text()
    rerun = json.loads((out / "overoptimisation.json").read_text())
    assert rerun["points"] == points and rerun["early_stop"] and rerun["chosen_step"] == rerun["best_step"]
    assert rerun["best_step"] == max(points, key=lambda p: (p["gold"], -p["step"]))["step"]
    rows = {r["name"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert rows["wall time, seconds"]["passed"] is None and "reused" in rows["wall time, seconds"]["target"]
    assert rows["early stopping: PPO iteration kept (best validation gold)"]["value"] == rerun["best_step"]
    # a checkpoint is exported as a plain model folder; the SFT start and the final policy have folders already
    assert (out / "early-stop" / "config.json").is_file() == (rerun["best_step"] not in (0, 100))
    # (whichever the seed picked) a checkpoint's export holds that iteration's actor, neither SFT's nor the final's
    from safetensors.torch import load_file

    from rlhfkit.demo.overoptimisation import export_policy

    folder = export_policy(out / "sft" / "final", out / "ppo", 40, 100, tmp_path / "step40")
    weights = [load_file(f / "model.safetensors") for f in (folder, out / "sft" / "final", out / "ppo" / "final")]
    AutoModelForCausalLM.from_pretrained(folder)
    for other in weights[1:]:
        assert any(not torch.equal(weights[0][k], other[k]) for k in weights[0])


# (page, the section whose bash blocks run in order, a file or folder they must leave): pages whose commands read the
# demo's runs/demo, run as printed from an empty folder where runs/demo is the quick demo's output
AFTER_THE_DEMO = [("remote.md", "## Quick start", "runs/ppo-remote/final/config.json"),
                  ("agents.md", "## Writing an environment", "runs/agent/final/config.json")]


def the_pages_run_as_printed_after_the_demo(out, folder):
    import re
    import socket
    import subprocess
    import sys

    from conftest import ROOT

    folder.mkdir()
    (folder / "runs").mkdir()
    (folder / "runs" / "demo").symlink_to(out)
    with socket.socket() as free:  # the page's port 8000 may be taken on a shared machine: another, free one
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    for page, section, leaves in AFTER_THE_DEMO:
        text = (ROOT / "docs" / page).read_text()
        part = text[text.index(section):]
        part = part[:part.find("\n## ", len(section))]
        script = "\n".join(re.findall(r"```bash\n(.*?)```", part, re.S)).replace("8000", port)
        env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               "RLHFKIT_NO_REPORT": "1"}
        proc = subprocess.run(["bash", "-e", "-c", script], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0 and (folder / leaves).is_file(), (page, proc.stdout[-2000:], proc.stderr[-3000:])


def overoptimising_recipe_alarms_and_best_beats_final(out):
    """The demo world with an over-optimising recipe: four times the default lr and no KL penalty, 40 iterations. The
    proxy (the RM) keeps rising while the validation gold peaks early and falls: the proxy-truth gap alarm fires, and
    best/ (kept by validation gold) beats final/ on the untouched test prompts by standard errors. Measured
    (transformers 5.25): gold 0.58 at iteration 5 -> -0.69 at 40 on validation, the alarm at 15; test gold best/
    0.68 ± 0.07, final/ -0.38 ± 0.10. (Twice the lr, 4e-4, over-optimised as clearly under transformers 5.24 and
    not under 5.25: the gold wandered 0.4-0.7 for 40 iterations.)"""
    from rlhfkit.config.ppo_schema import GenConfig
    from rlhfkit.demo import world as W
    from rlhfkit.demo.evaluate import gold_of_policies

    data, run = out / "data", out / "overoptimised"
    proc = run_cli("ppo", f"actor={out / 'sft' / 'final'}", f"reward={out / 'rm' / 'final'}",
                   f"data.prompts={data / 'ppo_prompts.jsonl'}", f"data.eval_prompts={data / 'validation_prompts.jsonl'}",
                   "data.max_prompt_length=32", "eval.judge=rlhfkit.demo.world:gold_scores", "gen.max_new_tokens=24",
                   "train.batch_size=32", "train.micro_batch_size=16", "ppo.mini_batch_size=16",
                   "ppo.normalize_reward=true", "ppo.kl_coef=0", "train.lr=8e-4", "train.max_steps=40",
                   "train.eval_every=5", "train.save_every=0", "log.tensorboard=false", "ppo.sample_every=0",
                   f"output_dir={run}", env={"RLHFKIT_NO_REPORT": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = read_metrics(run / "metrics.jsonl")
    gaps = [r["step"] for r in rows if "alarm/proxy_truth_gap" in r]
    assert gaps and gaps[0] < 40, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("alarm: eval/gold"))
    assert "while eval/reward rose" in line and "SE)" in line
    evals = [r for r in rows if "eval/gold" in r]
    assert evals[-1]["eval/reward"] > evals[0]["eval/reward"] and evals[-1]["eval/gold"] < max(r["eval/gold"]
                                                                                              for r in evals)
    assert result["best_by"] == "eval/gold" and result["best_step"] < 40
    assert f"best/ is step {result['best_step']}" in proc.stderr and "final/ is step 40" in proc.stderr
    prompts = [json.loads(x)["prompt"] for x in (data / "heldout_prompts.jsonl").read_text().splitlines()] * 2
    gold, _, _ = gold_of_policies({"best": run / "best", "final": run / "final"}, prompts,
                                  GenConfig(max_new_tokens=24, generation_batch_size=256), W.gold_reward, 2)
    best, final = gold["best"], gold["final"]
    assert best["mean"] - final["mean"] >= 3 * (best["stderr"] ** 2 + final["stderr"] ** 2) ** 0.5, gold


def test_a_stopped_demo_says_one_line_and_that_rerunning_it_continues(tmp_path):
    import signal

    from test_reliability import start, wait_for_step

    out = tmp_path / "demo"
    proc = start(["demo", "--quick", "--output", str(out)])
    wait_for_step(proc, out / "sft" / "metrics.jsonl", 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("rlhfkit demo: sft: stopped by SIGINT after step ")
    assert line.endswith(f"; checkpoint saved in '{out / 'sft' / 'checkpoints'}'. Resume with: rlhfkit demo "
                         f"--quick --output {out} (the demo continues the stopped step)")
