"""Cost curves: seconds per PPO iteration and per SFT step, rlhfkit and TRL, across model size and length.

    python benchmarks/bench_curves.py                        # 5M, 20M, SmolLM2 x 32, 128, 512 tokens, PPO and SFT
    python benchmarks/bench_curves.py --sizes 5M,20M --lengths 32,128 --stages sft
    python benchmarks/bench_curves.py --plot curves.json     # redraw the figure from a saved --json

Each point is one lock-step comparison of the two systems on identical work, run by the benchmark that owns it:
  PPO   bench_ppo.compare (TRL 1.12.0's PPOTrainer, benchmarks/.venv-trl): PPO_BATCH prompts, responses of exactly
        L tokens, micro-batches of PPO_MICRO, one epoch, float32; the policy folder is actor and reference, its
        scalar-head twin reward model and critic (see bench_ppo's docstring for every detail);
  SFT   bench_sft.compare (TRL 1.16.0's SFTTrainer, padding-free, benchmarks/.venv-trl-grpo): SFT_ROWS rows per
        step in micro-batches of 4, each a short prompt and a response of L tokens (its tokenizer's count, the loss
        on the response), float32 (see bench_sft's docstring).
Sizes: the harness's random-init 5M and 20M Llamas (2048-token vocabulary) and SmolLM2-135M-Instruct (49,152);
L = the response length. Both systems get the same threads (--threads, default 2), one computing at a time.

Printed: a table per stage (seconds, ratio, peak memory, and for rlhfkit's PPO the share of each phase), and how
each system's time grows from the shortest to the longest length per size. --png writes the figure (log-log:
seconds against L, a line per size and system), --json the raw rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

HERE = Path(__file__).resolve().parent
PPO_BATCH, PPO_MICRO = 4, 2  # SmolLM2 at 512 tokens: both systems' processes must fit in memory at once
SFT_ROWS = 8
PHASES = ("generate", "reward", "reference", "values", "actor_update", "critic_update")


def ppo_point(world: Path, size: str, length: int, args, tmp: Path) -> dict:
    import bench_ppo

    run = argparse.Namespace(warmup=args.warmup, iters=args.iters, threads=args.threads, bf16=False,
                             micro=PPO_MICRO, gflops=args.gflops, gbps=args.gbps)
    row = bench_ppo.compare(world, args.trl_ppo, size, PPO_BATCH, length, run, tmp)
    return {"stage": "ppo", "size": size, "length": length, "work": f"{PPO_BATCH} prompts x {length} tokens",
            "rlhfkit": row["rlhfkit"], "trl": row["trl"], "time_ratio": row["time_ratio"],
            "memory_ratio": row["memory_ratio"], "floor_ratio": row["floor_ratio"], "trl_version": "1.12.0"}


def sft_point(world: Path, size: str, length: int, args, tmp: Path) -> dict:
    import bench_sft

    run = argparse.Namespace(warmup=args.warmup, iters=args.iters, threads=args.threads, rows=SFT_ROWS,
                             length=length, trl_batches="padding_free")
    row = bench_sft.compare(world, args.trl_sft, size, "sft", run, tmp)
    return {"stage": "sft", "size": size, "length": length, "work": f"{SFT_ROWS} rows, {row['tokens']} tokens",
            "rlhfkit": row["rlhfkit"], "trl": row["trl"], "time_ratio": row["rlhfkit"]["seconds"] /
            row["trl"]["seconds"], "memory_ratio": row["memory_ratio"], "trl_version": bench_sft.TRL_VERSION}


def print_tables(rows: list[dict]) -> None:
    for stage in ("ppo", "sft"):
        mine = [r for r in rows if r["stage"] == stage]
        if not mine:
            continue
        unit = "iteration" if stage == "ppo" else "step"
        phases = [p for p in PHASES if any(p in r["rlhfkit"]["phases"] for r in mine)]
        print(f"\n| {stage.upper()} model | length | work | rlhfkit s/{unit} | TRL s/{unit} | time ratio | "
              f"rlhfkit peak MiB | TRL peak MiB |" + "".join(f" {p} |" for p in phases))
        print("|---" * (8 + len(phases)) + "|")
        for r in mine:
            a, t = r["rlhfkit"], r["trl"]
            shares = "".join(f" {a['phases'].get(p, 0) / a['seconds']:.0%} |" for p in phases)
            print(f"| {r['size']} | {r['length']} | {r['work']} | {a['seconds']:.2f} | {t['seconds']:.2f} | "
                  f"**{r['time_ratio']:.2f}x** | {a['peak_mb']:.0f} | {t['peak_mb']:.0f} |{shares}")
        print()
        for size in dict.fromkeys(r["size"] for r in mine):
            points = sorted((r for r in mine if r["size"] == size), key=lambda r: r["length"])
            if len(points) < 2:
                continue
            first, last = points[0], points[-1]
            growth = last["length"] / first["length"]
            print(f"{stage} {size}: {first['length']} -> {last['length']} tokens ({growth:.0f}x): rlhfkit "
                  f"{last['rlhfkit']['seconds'] / first['rlhfkit']['seconds']:.1f}x the time, TRL "
                  f"{last['trl']['seconds'] / first['trl']['seconds']:.1f}x; log-log slope rlhfkit "
                  f"{slope(points, 'rlhfkit'):.2f}, TRL {slope(points, 'trl'):.2f}")


def slope(points: list[dict], system: str) -> float:
    """d log(seconds) / d log(length) from the shortest to the longest length (1 = linear growth)."""
    first, last = points[0], points[-1]
    return math.log(last[system]["seconds"] / first[system]["seconds"]) / math.log(last["length"] / first["length"])


def plot(rows: list[dict], target: Path, title: str) -> None:
    from matplotlib.figure import Figure

    stages = [s for s in ("ppo", "sft") if any(r["stage"] == s for r in rows)]
    fig = Figure(figsize=(6.5 * len(stages), 4.8))
    colours = {}
    for i, stage in enumerate(stages):
        ax = fig.add_subplot(1, len(stages), i + 1)
        mine = [r for r in rows if r["stage"] == stage]
        for size in dict.fromkeys(r["size"] for r in mine):
            points = sorted((r for r in mine if r["size"] == size), key=lambda r: r["length"])
            lengths = [r["length"] for r in points]
            colour = colours.setdefault(size, f"C{len(colours)}")
            ax.plot(lengths, [r["rlhfkit"]["seconds"] for r in points], "o-", color=colour, label=f"rlhfkit {size}")
            ax.plot(lengths, [r["trl"]["seconds"] for r in points], "s--", color=colour,
                    label=f"TRL {points[0]['trl_version']} {size}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("response length (tokens)")
        ax.set_ylabel("seconds per PPO iteration" if stage == "ppo" else "seconds per SFT step")
        ax.set_title(f"PPO, {PPO_BATCH} prompts per iteration" if stage == "ppo" else f"SFT, {SFT_ROWS} rows per step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=f"5M,20M,{harness.REAL_SIZE}")
    p.add_argument("--lengths", default="32,128,512")
    p.add_argument("--stages", default="ppo,sft")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2, help="measured iterations per system and point (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--png", default=str(HERE / "cost_curves.png"), help="the figure")
    p.add_argument("--plot", help="only redraw the figure and tables from this --json file")
    args = p.parse_args()
    if args.plot:
        rows = json.loads(Path(args.plot).read_text())
        print_tables(rows)
        plot(rows, Path(args.png), f"{args.plot}")
        return
    harness.reexec_in_project_venv()
    import bench_sft

    stages, sizes = args.stages.split(","), args.sizes.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    args.trl_ppo = harness.ensure_trl_venv() if "ppo" in stages else None
    args.trl_sft = harness.ensure_trl_venv(venv=bench_sft.TRL_VENV, version=bench_sft.TRL_VERSION) \
        if "sft" in stages else None
    world = harness.build_world()
    if harness.REAL_SIZE in sizes:
        harness.add_real_model(world)
    machine = harness.machine_line(args.threads)
    print(machine, flush=True)
    args.gflops = harness.peak_matmul_gflops(args.threads)
    args.gbps = harness.peak_read_gbps(args.threads)
    for size in sizes:
        harness.tokenized_prompts(world, PPO_BATCH, size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_curves_") as tmp:
        for stage in stages:
            for size in sizes:
                for length in lengths:
                    folder = Path(tmp) / f"{stage}-{size}-{length}"
                    folder.mkdir()
                    point = (ppo_point if stage == "ppo" else sft_point)(world, size, length, args, folder)
                    rows.append(point)
                    if args.json:  # after every point: a long run that stops keeps what it measured
                        Path(args.json).write_text(json.dumps(rows, indent=2))
    print_tables(rows)
    plot(rows, Path(args.png), machine)


if __name__ == "__main__":
    main()
