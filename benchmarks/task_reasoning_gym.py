"""A reasoning-gym task through `rlhfkit pipeline` [sft, ppo (GRPO)], measured by the task's own scorer.

    python benchmarks/task_reasoning_gym.py [--config configs/task-chain-sum.yaml] [--output runs/task-chain-sum]
                                            [--samples 4] [OVERRIDES ...]

1. runs the pipeline of the config exactly as a user does (`rlhfkit pipeline --config ...`, in a subprocess; a
   complete step is reused);
2. samples the starting model, sft/final and ppo/final on every held-out question of the task (the test.jsonl the
   steps evaluated on, none of them a training question), `--samples` times each at temperature 1, the same
   sampling seed for every policy;
3. the exact rate of each (the share of samples the task's own scorer gives 1.0) and its mean score, each with its
   standard error over the samples, and the KL of ppo/final to sft/final; written to OUTPUT/measured.json and
   printed as a table;
4. with `--remote N`: the ppo step again for N iterations twice from the same seed, once with the task's scorer
   as a local function and once served by `rlhfkit serve-reward` on this machine (`reward=http://...`): the two
   reward curves side by side, and their largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "task-chain-sum.yaml"))
    parser.add_argument("--output", help="the pipeline's output_dir (default: the config's)")
    parser.add_argument("--samples", type=int, default=4, help="samples per held-out question (default 4)")
    parser.add_argument("--remote", type=int, default=0, metavar="N",
                        help="also N ppo iterations with the scorer local and served over HTTP (default 0: not)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides for the pipeline config")
    args = parser.parse_args()

    from rlhfkit.config.fields import load_config
    from rlhfkit.config.pipeline_schema import PipelineConfig, step_config
    from rlhfkit.config.ppo_schema import GenConfig
    from rlhfkit.demo.evaluate import gold_of_policies
    from rlhfkit.tasks import task_rows
    from rlhfkit.tasks.reasoning_gym import score

    overrides = list(args.overrides) + ([f"output_dir={args.output}"] if args.output else [])
    cfg = load_config(PipelineConfig, args.config, overrides)
    out = Path(cfg.output_dir)
    tick = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "rlhfkit", "pipeline", "--config", args.config, *overrides],
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if run.returncode:
        return run.returncode
    seconds = time.perf_counter() - tick

    ppo = step_config(cfg, "ppo")
    folder = Path(task_rows(ppo, "prompts", lambda line: None))
    heldout = [json.loads(line) for line in open(folder / "test.jsonl", encoding="utf-8")]
    source = {row["prompt"]: row["task"] for row in heldout}
    prompts = [row["prompt"] for row in heldout] * args.samples

    def exact(prompt: str, response: str) -> float:
        return float(score(None, [response], [source[prompt]])[0] == 1.0)

    def partial(prompt: str, response: str) -> float:
        return float(score(None, [response], [source[prompt]])[0] or 0.0)

    gen = GenConfig(max_new_tokens=ppo.gen.max_new_tokens, generation_batch_size=64)
    policies = {"start": Path(cfg.model), "sft": out / "sft" / "final", "grpo": out / "ppo" / "final"}
    rates, texts, kl = gold_of_policies(policies, prompts, gen, exact, cfg.train.seed + 2, micro=16,
                                        policy="grpo", reference="sft", fast=True)
    from rlhfkit.demo.evaluate import mean_stderr

    scores = {name: mean_stderr([partial(p, t) for p, t in zip(prompts, texts[name])]) for name in policies}
    result = {"config": args.config, "overrides": overrides, "task": ppo.task.name, "args": ppo.task.args,
              "heldout_questions": len(heldout), "samples_per_question": args.samples,
              "pipeline_seconds": round(seconds, 1), "exact": rates, "score": scores, "kl_grpo_to_sft": kl,
              "examples": [{"question": p, **{name: texts[name][i] for name in policies}}
                           for i, p in enumerate(prompts[:8])]}
    if args.remote:
        result["remote"] = local_against_served(out, args.remote)
    (out / "measured.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"{ppo.task.name} {ppo.task.args}: {len(heldout)} held-out questions x {args.samples} samples "
          f"(pipeline {seconds:.0f} s)")
    for name in policies:
        print(f"  {name:6s} exact {rates[name]['mean']:.3f} ± {rates[name]['stderr']:.3f}   "
              f"score {scores[name]['mean']:.3f} ± {scores[name]['stderr']:.3f}")
    print(f"  KL(grpo || sft) {kl['mean']:.3f} ± {kl['stderr']:.3f} nats per response")
    if args.remote:
        remote = result["remote"]
        print(f"  reward, local vs served, {args.remote} iterations: {remote['local']} vs {remote['served']} "
              f"(largest difference {remote['largest_difference']:.2g}; {remote['seconds']})")
    return 0


def local_against_served(out: Path, iterations: int) -> dict:
    """The ppo step's first `iterations` iterations from its own config.yaml twice: the task's scorer as a local
    function, then served by `rlhfkit serve-reward` on a free port; both reward curves."""
    from rlhfkit.tasks.reasoning_gym import SCORE

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    base = ["--config", str(out / "ppo" / "config.yaml"), f"train.max_steps={iterations}", "train.save_every=0",
            "train.eval_every=0", "ppo.sample_every=0", "--force"]
    server = subprocess.Popen([sys.executable, "-m", "rlhfkit", "serve-reward", SCORE, "--port", "0"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()  # the ready line: the URL it serves
        curves, seconds = {}, {}
        for name, reward in (("local", SCORE), ("served", url)):
            tick = time.perf_counter()
            subprocess.run([sys.executable, "-m", "rlhfkit", "ppo", *base, f"reward={reward}",
                            f"output_dir={out / ('ppo-' + name)}"], env=env, check=True)
            seconds[name] = round(time.perf_counter() - tick, 1)
            rows = [json.loads(line) for line in open(out / f"ppo-{name}" / "metrics.jsonl", encoding="utf-8")]
            curves[name] = [round(r["reward/mean"], 6) for r in rows if "reward/mean" in r]
    finally:
        server.terminate()
        server.wait(timeout=30)
    gap = max(abs(a - b) for a, b in zip(curves["local"], curves["served"]))
    return {**curves, "largest_difference": gap, "seconds": seconds, "url": url}


if __name__ == "__main__":
    sys.exit(main())
