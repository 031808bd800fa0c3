"""What a user should expect on SmolLM2-135M-Instruct: seconds per SFT step, RM step and PPO iteration, and peak
memory, in float32 and in bf16 autocast (`engine.precision=bf16`), on this machine.

    python benchmarks/bench_real_model.py            # every row (about 12 minutes on 2 cores)
    python benchmarks/bench_real_model.py --only sft --steps 4

Each row is one `rlhfkit` run in its own process (the CLI, as a user runs it) on the real data of ../shared/data;
seconds per step are the median of the logged `time/step` (`time/iteration` for PPO) without the first step,
peak memory the process's peak resident set. The model is materialised by `rlhfkit fetch` first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
MARK = "@@PEAK_RSS_KIB "
# run rlhfkit's CLI and report the process's peak resident memory on the way out
RUNNER = ("import resource, sys\nfrom rlhfkit.cli import main\nrc = main(sys.argv[1:])\n"
          f"print({MARK!r} + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), file=sys.stderr)\n"
          "sys.exit(rc)\n")


def rows(model: Path, steps: int, prompts: Path, rewards: Path) -> dict:
    """name -> (what it measures, CLI arguments). Batch sizes and lengths are in the names."""
    common = [f"train.max_steps={steps}", "train.save_every=0", "train.eval_every=0", "log.tensorboard=false",
              "data.cache=false"]
    hh = DATA / "preference" / "hh-rlhf-helpful-online.test.jsonl.gz"
    ppo = ["ppo", f"actor={model}", "train.lr=1e-5", "ppo.kl_coef=0.05", "ppo.sample_every=0", *common]
    return {
        "sft: 8 Alpaca rows <= 256 tokens, micro 4": (
            "time/step", ["sft", f"model={model}", f"data.train={DATA / 'sft' / 'alpaca_en_demo.json'}",
                          "data.max_length=256", "data.eval_fraction=0", "train.batch_size=8",
                          "train.micro_batch_size=4", "train.lr=2e-5", *common]),
        "rm: 8 HH pairs <= 256 tokens, micro 4": (
            "time/step", ["rm", f"model={model}", f"data.train={hh}",
                          "data.max_length=256", "data.eval_fraction=0", "train.batch_size=8",
                          "train.micro_batch_size=4", "train.lr=2e-5", *common]),
        "ppo: 16 prompts x 12 new tokens (task demo), micro 8": (
            "time/iteration", [*ppo, "reward=rlhfkit.demo.tasks:arithmetic_reward", f"data.prompts={prompts}",
                               "train.batch_size=16", "train.micro_batch_size=8", "gen.max_new_tokens=12",
                               "data.eval_fraction=0"]),
        "grpo: 4 prompts x 4 samples x 12 new tokens (task demo), micro 8, no critic": (
            "time/iteration", [*ppo, "reward=rlhfkit.demo.tasks:arithmetic_reward", f"data.prompts={prompts}",
                               "train.batch_size=4", "ppo.n_samples_per_prompt=4", "ppo.advantage_estimator=grpo",
                               "ppo.kl_coef=0", "ppo.kl_loss_coef=0.05", "train.micro_batch_size=8",
                               "gen.max_new_tokens=12", "data.eval_fraction=0"]),
        "ppo: 8 HH prompts <= 128 tokens x 64 new tokens, micro 4": (
            "time/iteration", [*ppo, f"reward={rewards}:length", f"data.prompts={hh}",
                               "data.max_prompt_length=128", "train.batch_size=8", "train.micro_batch_size=4",
                               "gen.max_new_tokens=64", "gen.min_new_tokens=64", "data.eval_fraction=0"]),
        # memory at length: 512 new tokens per response
        **{f"ppo: 4 HH prompts <= 128 tokens x 512 new tokens, micro 2{label}": (
            "time/iteration", [*ppo, f"reward={rewards}:length", f"data.prompts={hh}",
                               "data.max_prompt_length=128", "train.batch_size=4", "train.micro_batch_size=2",
                               "gen.max_new_tokens=512", "gen.min_new_tokens=512", "data.eval_fraction=0", *extra])
           for label, extra in (("", []), (", checkpointing", ["load.gradient_checkpointing=true"]),
                                (", log-probs from full logits", ["ppo.chunked_logprobs=false"]))},
    }


def run(args: list[str], out: Path, key: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "RLHFKIT_NO_BAR": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", RUNNER, *args, f"output_dir={out}"], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(args[:1])}\n{proc.stderr[-3000:]}")
    peak = next(int(line[len(MARK):]) for line in proc.stderr.splitlines() if line.startswith(MARK))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [m[key] for m in metrics if key in m][1:]  # the first step pays one-off costs (allocation, packing)
    return {"seconds": statistics.median(times), "steps": len(times), "peak_gib": peak / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first is not counted)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run (default 2)")
    parser.add_argument("--only", help="only the rows whose name contains this text, e.g. 'sft' or 'HH prompts'")
    parser.add_argument("--precision", choices=("fp32", "bf16"), action="append", help="default: both")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from rlhfkit.demo.tasks import arithmetic_prompts
    from rlhfkit.models.fetch import fetch

    model = fetch("smollm2-135m-instruct", log=lambda line: print(line, file=sys.stderr))
    print(f"SmolLM2-135M-Instruct on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"OMP_NUM_THREADS={args.threads}; medians of {args.steps - 1} steps")
    print(f"{'run':<58} {'precision':>9} {'s/step':>8} {'peak GiB':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in arithmetic_prompts(0)[0]))
        rewards = Path(tmp) / "rewards.py"  # for open-ended prompts: any cheap function will do for timing
        rewards.write_text("def length(prompts, responses):\n    return [len(r) / 100 for r in responses]\n")
        for name, (key, cli) in rows(model, args.steps, prompts, rewards).items():
            if args.only and args.only not in name:
                continue
            for precision in args.precision or ("fp32", "bf16"):
                extra = ["engine.precision=bf16"] if precision == "bf16" else []
                out = Path(tmp) / f"run-{len(os.listdir(tmp))}"
                result = run([*cli, *extra], out, key, args.threads)
                print(f"{name:<58} {precision:>9} {result['seconds']:>8.2f} {result['peak_gib']:>9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
