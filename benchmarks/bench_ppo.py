"""rlhfkit's PPO against TRL 1.12.0's PPOTrainer on identical work, side by side, with rlhfkit's per-phase times.

    python benchmarks/bench_ppo.py            # both sizes x (batch 16, response 32) and (batch 64, response 64)
    python benchmarks/bench_ppo.py --quick    # one config, fewer iterations
    python benchmarks/bench_ppo.py --full     # batch {16, 64} x response {32, 64} for both sizes
    python benchmarks/bench_ppo.py --zero3    # 2 ranks, ZeRO-3: gather-once vs per-token generation (and TRL)
    python benchmarks/bench_ppo.py --bf16     # both in bf16 mixed precision instead of float32: rlhfkit's
                                              # engine.precision=bf16; TRL bf16=True, which its PPOTrainer
                                              # ignores, so bf16 autocast around each of its models' forwards
    python benchmarks/bench_ppo.py --sizes SmolLM2 --shapes 8:64,16:64 --threads 2
                                              # SmolLM2-135M-Instruct (rlhfkit fetch) and its scalar-head twin
    python benchmarks/bench_ppo.py --gpu --sizes 1B --shapes 16:128,64:128 --trl-python PY
                                              # on a CUDA GPU: a ~1B random-init Llama built there, both systems
                                              # in bf16 mixed precision, one after the other (not in lock-step),
                                              # peak GPU memory; PY imports TRL 1.12.0 (no venv is made)
    --threads N sets torch's threads for both systems (default 1: steadier on a shared machine); --shapes
    batch:response pairs instead of the default ones; --micro the update's micro-batch size (default 8)

Identical work: the same model folders (a ~5M and a ~20M Llama built locally, or SmolLM2-135M-Instruct; the
policy folder is actor and reference, its scalar-head twin is reward model and critic), the same prompts (token
ids from rlhfkit's data layer with the model's own tokenizer) (the dataset is exactly one
batch, so every iteration of both systems rolls out the same prompt set), responses of exactly R tokens (EOS
forbidden until R in rlhfkit, no stop token in TRL), float32, no gradient checkpointing, one PPO epoch over one
mini-batch (the whole batch) in micro-batches of 8 (--micro), KL coefficient 0.05, temperature 1. TRL generates the whole
batch in one generate() call and runs its reference, reward and value forwards on the whole batch at once
(local_rollout_forward_batch_size = batch); rlhfkit does the same (one generation call, ppo.forward_batch_size =
batch for its no-grad forwards: reference and reward model; its values come from the critic update's forward).

Each system runs in its own subprocess; the two advance one iteration at a time in turn (harness.Lockstep),
the first iterations are warm-up, and the medians of the rest are compared. rlhfkit runs its real loop
(stages.ppo.run_ppo) with a timing hook on its metrics logger; TRL runs PPOTrainer.train() with a callback.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

MICRO = 8
KL_COEF = 0.05
LR = 1e-6
PHASES = ("generate", "reward", "reference", "values", "actor_update", "critic_update")
ZERO3_BATCH, ZERO3_RESPONSE = 16, 32


# ------------------------------------------------------------------------------------------ workers


def rlhfkit_worker(args) -> None:
    """rlhfkit's real PPO loop, in lock-step with the parent (harness.rlhfkit_lockstep)."""
    overrides = rlhfkit_overrides(Path(args.world), args.size, args.batch, args.response, args.out, 100000, args.micro)
    harness.rlhfkit_lockstep(overrides + args.extra, args.threads)


def rlhfkit_overrides(world: Path, size: str, batch: int, response: int, out, steps: int,
                      micro: int = MICRO) -> list[str]:
    """The `rlhfkit ppo` settings of the identical work (see the module docstring)."""
    return [f"actor={world / size / 'policy'}", f"reward={world / size / 'reward'}",
            f"data.prompts={harness.prompt_rows(world, batch)}", "data.eval_fraction=0", f"output_dir={out}",
            f"train.batch_size={batch}", f"train.micro_batch_size={micro}", f"train.max_steps={steps}",
            f"train.lr={LR}", "train.warmup_steps=0", "train.scheduler=constant", "train.save_every=0",
            "train.eval_every=0", "train.log_every=1", f"gen.max_new_tokens={response}",
            f"gen.min_new_tokens={response}", "gen.temperature=1.0", f"ppo.kl_coef={KL_COEF}", "ppo.epochs=1",
            f"ppo.forward_batch_size={batch}",
            "ppo.sample_every=0", "log.tensorboard=false", "log.progress=false"]


def trl_worker(args) -> None:
    """TRL 1.12.0's PPOTrainer.train(); a callback waits for "go" at train begin and after each step."""
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    step = harness.Lockstep()
    ticks = []

    class Timing(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            if args.free_run:
                ticks.append(time.perf_counter())
            else:
                step.wait()

        def on_step_end(self, *a, **kw):
            if args.free_run:
                ticks.append(time.perf_counter())
            else:
                step.report()
                step.wait()

    world = Path(args.world)
    policy, reward = world / args.size / "policy", world / args.size / "reward"
    tok = AutoTokenizer.from_pretrained(policy, padding_side="left")
    prompt_ids = json.loads(harness.tokenized_prompts(world, args.batch, args.size).read_text())
    data = Dataset.from_dict({"input_ids": prompt_ids})
    local = args.batch // int(os.environ.get("WORLD_SIZE", "1"))  # prompts per rank (accelerate launch)
    config = PPOConfig(output_dir=args.out, per_device_train_batch_size=args.micro,
                       gradient_accumulation_steps=local // args.micro, num_mini_batches=1, num_ppo_epochs=1,
                       local_rollout_forward_batch_size=local, response_length=args.response,
                       stop_token=None, temperature=1.0, kl_coef=KL_COEF, learning_rate=LR,
                       lr_scheduler_type="constant", total_episodes=args.batch * (args.free_run or 100000),
                       num_sample_generations=0,
                       bf16=args.bf16, gradient_checkpointing=False, report_to=[], save_strategy="no",
                       logging_steps=1, disable_tqdm=True, seed=1234, use_cpu=not harness.on_gpu(),
                       dataloader_num_workers=0)
    models = {"model": AutoModelForCausalLM.from_pretrained(policy),
              "ref_model": AutoModelForCausalLM.from_pretrained(policy),
              "reward_model": AutoModelForSequenceClassification.from_pretrained(reward, num_labels=1),
              "value_model": AutoModelForSequenceClassification.from_pretrained(reward, num_labels=1)}
    if args.bf16:  # PPOTrainer ignores bf16=True (harness.autocast_forwards): every forward under bf16 autocast,
        harness.autocast_forwards(models.values())  # as rlhfkit's engine.precision=bf16 runs its models
    trainer = PPOTrainer(args=config, processing_class=tok, **models, train_dataset=data, eval_dataset=data,
                         callbacks=[Timing()])
    trainer.train()
    if args.free_run and trainer.accelerator.is_main_process:
        seconds = [b - a for a, b in zip(ticks, ticks[1:])]
        step.out.write(harness.MARK + json.dumps({"seconds": seconds, "peak_mb": harness.peak_rss_mb()}) + "\n")


# ------------------------------------------------------------------------------------------ parent


def worker_cmd(system: str, python: Path, world: Path, size: str, batch: int, response: int, threads: int,
               out: Path, extra: list[str] = (), bf16: bool = False, micro: int = MICRO) -> list[str]:
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", system, "--world", str(world), "--size", size,
           "--batch", str(batch), "--response", str(response), "--threads", str(threads), "--out", str(out),
           "--micro", str(micro)]
    if bf16:
        cmd += ["--bf16", "--extra=engine.precision=bf16"]
    return cmd + [f"--extra={e}" for e in extra]


def thread_env(threads: int) -> dict:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "RLHFKIT_NO_BAR": "1", "PYTHONWARNINGS": "ignore"}


def compare(world: Path, trl_python: Path, size: str, batch: int, response: int, args, tmp: Path) -> dict:
    print(f"\n== {size} model, batch {batch}, response {response} "
          f"({args.warmup} warm-up + {args.iters} measured iterations each, {args.threads} thread(s)"
          f"{', bf16 mixed precision' if args.bf16 else ''})", flush=True)
    env = thread_env(args.threads)
    harness.uncache_libraries(Path(sys.prefix), trl_python.parent.parent)  # the same start for both (peak RSS)
    def starter(name: str, py: Path):
        return lambda: harness.Worker(name, worker_cmd(name, py, world, size, batch, response, args.threads,
                                                       tmp / f"{name}-{size}-{batch}-{response}", bf16=args.bf16,
                                                       micro=min(args.micro, batch),
                                                       extra=args.rlhfkit_set if name == "rlhfkit" else ()),
                                      tmp / f"{name}-{size}-{batch}-{response}.log", env)

    results = harness.run_workers({"rlhfkit": starter("rlhfkit", Path(sys.executable)),
                                   "trl": starter("trl", trl_python)}, args.warmup, args.iters)
    mine, theirs = harness.summarise(results["rlhfkit"]), harness.summarise(results["trl"])
    row = {"size": size, "batch": batch, "response": response, "threads": args.threads, "rlhfkit": mine,
           "trl": theirs, "time_ratio": mine["seconds"] / theirs["seconds"],
           "memory_ratio": mine["peak_mb"] / theirs["peak_mb"]}
    row["floor"] = floor(world, size, batch, response, args.gflops, mine["phases"], args.gbps, args.bf16)
    row["floor_ratio"] = mine["seconds"] / row["floor"]["iteration"]
    print_row(row)
    return row


def floor(world: Path, size: str, batch: int, response: int, gflops: float, phases: dict, gbps: float,
          bf16: bool = False) -> dict:
    """The iteration's floor (harness.ppo_floor) for the phases rlhfkit ran: the policy folder is actor and
    reference, its scalar twin reward model and critic; the prompts are the benchmark's own. With it, under
    `generate_memory`, generation's bound when its decode steps' memory reads count too
    (`harness.generate_memory_bound` at `gbps`)."""
    prompts = json.loads(harness.tokenized_prompts(world, batch, size).read_text())
    policy, scalar = harness.linear_sizes(world / size / "policy"), harness.linear_sizes(world / size / "reward")
    prompt = sum(map(len, prompts)) / len(prompts)
    row = harness.ppo_floor(policy, scalar, scalar, batch, prompt, response, gflops,
                            phases=[k for k in PHASES if k in phases])
    if "generate" in row:
        row["generate_memory"] = harness.generate_memory_bound(
            policy, harness.kv_floats_per_position(world / size / "policy"), batch, prompt, response, gflops, gbps,
            element_bytes=2 if bf16 else 4)  # bf16: the rollout reads bf16 copies of the weights and a bf16 cache
        row["gbps"] = gbps
    return row


def targets(size: str) -> tuple[float, float]:
    """(time ratio to TRL, ratio to the floor) the issues set: 0.6x TRL on the real model (0.4x at the random
    sizes, the first PPO issue's), and 1.5x the floor at 5M, 1.3x at 20M and on the real model."""
    return (0.6 if size == harness.REAL_SIZE else 0.4), (1.5 if size == "5M" else 1.3)


def print_row(row: dict) -> None:
    b = row["batch"]
    for name in ("rlhfkit", "trl"):
        s = row[name]
        print(f"  {name:8s} {s['seconds']:7.3f} s/iter  {b / s['seconds']:7.1f} samples/s  "
              f"peak {'GPU memory' if harness.on_gpu() else 'RSS'} {s['peak_mb']:7.0f} MiB")
    time_target, floor_target = targets(row["size"])
    print(f"  ratio rlhfkit/TRL: time {row['time_ratio']:.2f}x (target <= {time_target:.2f}), "
          f"peak memory {row['memory_ratio']:.2f}x (target <= 0.80)")
    rate = f"{row['floor']['gflops']:.0f} GFLOP/s" + (" bf16" if harness.on_gpu() else "")
    print(f"  floor (linear-layer FLOPs at {rate}): {row['floor']['iteration']:.3f} s; "
          f"rlhfkit's iteration is {row['floor_ratio']:.2f}x its floor (target <= {floor_target:.1f})")
    phases = row["rlhfkit"]["phases"]
    if phases:
        print("  rlhfkit phases, median s (x floor): " + ", ".join(
            f"{k} {phases[k]:.3f} ({phases[k] / row['floor'][k]:.1f}x)" if row["floor"].get(k) else
            f"{k} {phases[k]:.3f}" for k in PHASES if k in phases)
            + ("" if "values" in phases else "; values: computed by critic_update's forward"))
    f = row["floor"]
    if "generate_memory" in f and "generate" in phases:
        # the lowest floor ratio this host allows: generation at its memory bound, every other phase at its floor
        best = (f["iteration"] - f["generate"] + f["generate_memory"]) / f["iteration"]
        print(f"  generation bound by memory (weights and KV cache read once per decode step at {f['gbps']:.1f} "
              f"GB/s): {f['generate_memory']:.3f} s, {f['generate_memory'] / f['generate']:.1f}x its FLOP floor; "
              f"rlhfkit's generate is {phases['generate'] / f['generate_memory']:.1f}x that bound. With generation "
              f"at it and every other phase at its FLOP floor the iteration would be {best:.2f}x the floor")


def print_table(rows: list[dict]) -> None:
    print("\n| model | batch | response | rlhfkit s/iter | TRL s/iter | time ratio | floor s/iter | rlhfkit / floor "
          "| rlhfkit samples/s | TRL samples/s | rlhfkit peak MiB | TRL peak MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, t, b = r["rlhfkit"], r["trl"], r["batch"]
        print(f"| {r['size']} | {b} | {r['response']} | {a['seconds']:.3f} | {t['seconds']:.3f} | "
              f"**{r['time_ratio']:.2f}x** | {r['floor']['iteration']:.3f} | **{r['floor_ratio']:.2f}x** | "
              f"{b / a['seconds']:.1f} | {b / t['seconds']:.1f} | {a['peak_mb']:.0f} | "
              f"{t['peak_mb']:.0f} | **{r['memory_ratio']:.2f}x** |")


# ------------------------------------------------------------------------------------------ ZeRO-3, 2 ranks


def run_rlhfkit_zero3(world: Path, gather: bool, args, out: Path) -> list[dict]:
    """`torchrun --nproc_per_node 2 -m rlhfkit ppo ... engine.zero_stage=3`; per-iteration time/* from rank 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29400 + os.getpid() % 500), "-m", "rlhfkit", "ppo",
           *rlhfkit_overrides(world, "5M", ZERO3_BATCH, ZERO3_RESPONSE, out, args.warmup + args.iters),
           "engine.backend=deepspeed", "engine.zero_stage=3", f"engine.gather_for_generation={str(gather).lower()}"]
    done = subprocess.run(cmd, env={**os.environ, **thread_env(1)}, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"rlhfkit ZeRO-3 run failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/iteration" in r][args.warmup:]
    return [{"seconds": r["time/iteration"], "peak_mb": float("nan"),
             "phases": {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("time/")}} for r in rows]


def run_trl_zero3(world: Path, trl_python: Path, args, out: Path) -> dict:
    """TRL's PPOTrainer under `accelerate launch` with DeepSpeed ZeRO-3 on 2 CPU ranks, when that works."""
    accelerate = trl_python.parent / "accelerate"
    cmd = [str(accelerate), "launch", "--num_processes", "2", "--num_machines", "1", "--use_deepspeed",
           "--zero_stage", "3", "--zero3_init_flag", "false", "--mixed_precision", "no",
           "--main_process_port", str(29900 + os.getpid() % 500), str(Path(__file__).resolve()), "--worker", "trl",
           "--world", str(world), "--size", "5M", "--batch", str(ZERO3_BATCH), "--response", str(ZERO3_RESPONSE),
           "--threads", "1", "--out", str(out), "--free-run", str(args.warmup + args.iters)]
    done = subprocess.run(cmd, env={**os.environ, **thread_env(1)}, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith(harness.MARK):
            report = json.loads(line[len(harness.MARK):])
            return {"ok": True, "reports": [{"seconds": s, "peak_mb": report["peak_mb"]}
                                            for s in report["seconds"][args.warmup:]]}
    return {"ok": False, "error": (done.stderr or done.stdout)[-2500:]}


def zero3(args) -> None:
    """rlhfkit on 2 ranks under ZeRO-3, the actor gathered once per rollout vs gathered per token, and TRL
    under accelerate + DeepSpeed ZeRO-3 when it runs on CPU; runs alternate, medians after warm-up."""
    world = harness.build_world()
    harness.tokenized_prompts(world, ZERO3_BATCH)
    trl_python = harness.ensure_trl_venv()
    harness.ensure_trl_deepspeed()
    results = {"gather once": [], "gather per token": []}
    print(f"== ZeRO-3, 2 ranks x 1 thread, 5M model, batch {ZERO3_BATCH}, response {ZERO3_RESPONSE} "
          f"({args.warmup} warm-up + {args.iters} measured iterations per run, {args.rounds} rounds)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_zero3_") as tmp:
        for r in range(args.rounds):
            for gather in (True, False) if r % 2 == 0 else (False, True):
                name = "gather once" if gather else "gather per token"
                reports = run_rlhfkit_zero3(world, gather, args, Path(tmp) / f"rlhfkit-{r}-{gather}")
                results[name] += reports
                print(f"  round {r + 1}, rlhfkit {name}: " + ", ".join(f"{x['seconds']:.2f}s" for x in reports),
                      flush=True)
        trl = run_trl_zero3(world, trl_python, args, Path(tmp) / "trl")
    rows = {name: harness.summarise(reports) for name, reports in results.items()}
    print("\n| system (2 ranks, ZeRO-3) | s/iter | samples/s | generate s |")
    print("|---|---|---|---|")
    for name, s in rows.items():
        print(f"| rlhfkit, {name} | {s['seconds']:.2f} | {ZERO3_BATCH / s['seconds']:.1f} | "
              f"{s['phases'].get('generate', float('nan')):.2f} |")
    if trl["ok"]:
        s = harness.summarise(trl["reports"])
        print(f"| TRL 1.12.0, accelerate + DeepSpeed ZeRO-3 | {s['seconds']:.2f} | "
              f"{ZERO3_BATCH / s['seconds']:.1f} | - |")
    else:
        print("\nTRL under accelerate + DeepSpeed ZeRO-3 did not run on CPU; its error:\n" + trl["error"])
    once, per_token = rows["gather once"]["seconds"], rows["gather per token"]["seconds"]
    print(f"\ngather once / per token: {once / per_token:.2f}x the time")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one config (5M, batch 16, response 32), 1+5 iterations")
    p.add_argument("--full", action="store_true", help="batch {16,64} x response {32,64} for both sizes")
    p.add_argument("--sizes", default="5M,20M", help=f"comma-separated model sizes (5M, 20M, {harness.REAL_SIZE})")
    p.add_argument("--shapes", help="comma-separated batch:response pairs instead of the defaults, e.g. 8:64,16:64")
    p.add_argument("--micro", type=int, default=MICRO, help="micro-batch size of both systems' updates (at most the "
                                                          "batch)")
    p.add_argument("--iters", type=int, default=5, help="measured iterations per system (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, the same for both systems (1: steadier on a shared machine)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--zero3", action="store_true", help="the 2-rank ZeRO-3 comparison instead")
    p.add_argument("--bf16", action="store_true", help="both systems in bf16 mixed precision (TRL bf16=True, rlhfkit "
                                                        "engine.precision=bf16): float32 weights, bf16 matmuls")
    p.add_argument("--rounds", type=int, default=2, help="--zero3: alternating rounds of the two rlhfkit runs")
    p.add_argument("--gpu", action="store_true", help="on the machine's CUDA GPU, bf16 mixed precision, sizes "
                                                       f"from {sorted(harness.GPU_SIZES)} built there")
    p.add_argument("--trl-python", help="an interpreter that imports TRL 1.12.0 (instead of benchmarks/.venv-trl)")
    p.add_argument("--rlhfkit-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an rlhfkit override for its side only, e.g. rollout.engine=vllm (repeatable)")
    # worker mode (internal)
    p.add_argument("--worker", choices=("rlhfkit", "trl"))
    p.add_argument("--world"), p.add_argument("--size"), p.add_argument("--out")
    p.add_argument("--batch", type=int), p.add_argument("--response", type=int)
    p.add_argument("--extra", action="append", default=[])
    p.add_argument("--free-run", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        (rlhfkit_worker if args.worker == "rlhfkit" else trl_worker)(args)
        return
    harness.reexec_in_project_venv()
    if args.zero3:
        zero3(args)
        return

    if args.gpu:
        harness.enter_gpu_mode()
        args.bf16 = True
    trl_python = harness.ensure_trl_venv(python=args.trl_python)
    world = harness.build_world()
    print(harness.machine_line(args.threads), flush=True)
    args.gflops = harness.peak_matmul_gflops(args.threads)
    args.gbps = harness.peak_read_gbps(args.threads)
    if args.quick:
        configs, args.iters, args.warmup = [("5M", 16, 32)], min(args.iters, 5), 1
    else:
        shapes = [(16, 32), (16, 64), (64, 32), (64, 64)] if args.full else [(16, 32), (64, 64)]
        if args.shapes:
            shapes = [tuple(int(x) for x in shape.split(":")) for shape in args.shapes.split(",")]
        configs = [(s, b, r) for s in args.sizes.split(",") for b, r in shapes]
    if any(size == harness.REAL_SIZE for size, _, _ in configs):
        harness.add_real_model(world)
    for size in {size for size, _, _ in configs if size in harness.GPU_SIZES}:
        if not args.gpu:
            raise SystemExit(f"size {size} is built on a GPU: add --gpu")
        harness.add_gpu_model(world, size)
    for size, batch, _ in configs:
        harness.tokenized_prompts(world, batch, size)
        if batch % min(args.micro, batch):
            raise SystemExit(f"batch {batch} is not a multiple of --micro {args.micro}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_ppo_") as tmp:
        for size, batch, response in configs:
            rows.append(compare(world, trl_python, size, batch, response, args, Path(tmp)))
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
