"""`rlhfkit demo`: the embedded default. Builds a world, runs SFT -> RM -> PPO through `rlhfkit pipeline`, and
checks on held-out prompts that PPO improved what the reward stands for (the hidden gold reward), not only the
reward model's score, without exploiting the reward model and without losing it on unseen prompts.

Steps: 1 world and base model, 2 SFT (pipeline), 3 preference pairs from the SFT model's own samples labelled by
the gold reward with noise, 4 RM and PPO (pipeline; PPO saves a checkpoint every few iterations), 5 over-optimisation
in view: proxy and gold against KL for every checkpoint, on validation prompts (early stopping picks one there),
6 held-out evaluation on test prompts, 7 summary, gold.json, overoptimisation.json, samples and report. Everything
is seeded; each step reuses a complete output, so a second run only re-evaluates.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.demo import world as W
from rlhfkit.run_files import (ARENA_FILE, GOLD_FILE, METRICS_FILE, OVEROPTIMISATION_FILE, PLOTS_DIR, RESULT_FILE,
                               SAMPLES_FILE, SUMMARY_FILE, final_dir)

# The two sizes. "full" is what `rlhfkit demo` runs (configs/demo.yaml is its pipeline config): a 4-layer Llama of
# width 128 (0.7M parameters), 6-9 minutes on 2 cores. "quick" (`--quick`, the test's reduced run) is the same
# recipe at width 64 (4 layers, 0.2M) with fewer steps, about 2.5 minutes; it clears the same bar. `track_every`: PPO
# iterations between the checkpoints that the over-optimisation curve measures; `eval_samples` / `validation_samples`:
# samples per test / validation prompt.
SIZES = {
    "full": {"vocab": 512, "hidden": 128, "layers": 4, "heads": 4, "corpus": 6000, "pretrain_steps": 600,
             "demonstrations": 4000, "sft_steps": 400, "pair_prompts": 6000, "heldout_pair_repeats": 3,
             "rm_epochs": 5, "ppo_steps": 120, "track_every": 10, "eval_samples": 2, "validation_samples": 2,
             "dpo_epochs": 1},
    "quick": {"vocab": 512, "hidden": 64, "layers": 4, "heads": 4, "corpus": 4000, "pretrain_steps": 800,
              "demonstrations": 3000, "sft_steps": 300, "pair_prompts": 5000, "heldout_pair_repeats": 2,
              "rm_epochs": 4, "ppo_steps": 100, "track_every": 20, "eval_samples": 2, "validation_samples": 2,
              "dpo_epochs": 1},
}
LABEL_NOISE = 0.1  # each preference label flipped with this probability (sampling.py: 18% labeller disagreement)
KL_BUDGET = 4.0  # nats per response: how far PPO may move from the SFT policy and still count as a pass
RM_ACCURACY_TARGET = 0.8
WALL_TIME_TARGET = 600.0  # seconds on 2 CPU cores: docs/demo.md's table holds the demo to it
MAX_NEW_TOKENS = 24
# The demo's matrices are 128 wide: past a few threads, a thread's share of a decode step's GEMM takes less time
# than waking the thread. Measured only up to 2 cores, where 2 threads beat 1 in every step (demo_threads).
MAX_THREADS = 4
STEP_FOLDERS = ("base", "sft", "rm", "ppo", "data", PLOTS_DIR, "early-stop", "arena")


@dataclass
class Demo:
    """Where the demo writes, how big it is, and the seed everything derives from."""

    out: Path
    size: dict
    seed: int
    overrides: list
    early_stop: bool = False  # evaluate the checkpoint of best validation gold instead of PPO's last policy
    algos: list = field(default_factory=list)  # the arena's algorithms (arena.py); empty: no arena
    gen: GenConfig = field(default_factory=lambda: GenConfig(max_new_tokens=MAX_NEW_TOKENS, generation_batch_size=256))
    reused: list = field(default_factory=list)  # steps taken from an earlier run instead of recomputed


def pipeline_dict(out: Path, size: dict, seed: int) -> dict:
    """The pipeline config the demo runs (written to OUT/pipeline.yaml; configs/demo.yaml is the full one)."""
    data = out / "data"
    every = {"micro_batch_size": 32, "log_every": 1, "save_every": 0}
    checkpoints = size["ppo_steps"] // size["track_every"] + 1  # keep them all: the curve measures each
    return {
        "model": str(final_dir(out / "base")),
        "output_dir": str(out),
        "train": {"seed": seed},
        "log": {"tensorboard": False},
        "sft": {"data": {"train": str(data / "sft.jsonl"), "max_length": 64, "eval_fraction": 0.05},
                "train": {**every, "max_steps": size["sft_steps"], "batch_size": 32, "lr": 1.0e-3,
                          "warmup_steps": 10, "eval_every": 25}},
        "rm": {"data": {"train": str(data / "pairs.jsonl"), "eval": str(data / "heldout_pairs.jsonl"),
                        "max_length": 64},
               "train": {**every, "epochs": size["rm_epochs"], "batch_size": 32, "lr": 1.0e-3, "warmup_steps": 10,
                         "eval_every": 20}},
        "ppo": {"data": {"prompts": str(data / "ppo_prompts.jsonl"),
                         "eval_prompts": str(data / "validation_prompts.jsonl"), "max_prompt_length": 32},
                "train": {**every, "save_every": size["track_every"], "keep_checkpoints": checkpoints,
                          "max_steps": size["ppo_steps"], "batch_size": 32, "micro_batch_size": 16,
                          "lr": 2.0e-4, "eval_every": 20},
                "gen": {"max_new_tokens": MAX_NEW_TOKENS},
                # the hidden gold as the held-out judge: eval/gold beside eval/reward, and best/ by it
                "eval": {"judge": "rlhfkit.demo.world:gold_scores"},
                # normalised RM scores: kl_coef then means the same whatever scale the RM happened to learn
                "ppo": {"kl_coef": 0.2, "normalize_reward": True, "mini_batch_size": 16, "sample_every": 20}},
    }


def demo_threads() -> int:
    """Intra-op threads for the demo: torch's own count (OMP_NUM_THREADS when set, else the physical cores), at most
    MAX_THREADS. Measured on a quiet 2-core Zen 1 EPYC: the whole demo 536 s with 2 threads against 725 s with 1
    (SFT 71 s against 102, RM and PPO 349 against 456). Where other work shares the cores (parallel test workers),
    set OMP_NUM_THREADS=1: a thread that waits for a busy core slows every step."""
    import torch

    return min(torch.get_num_threads(), MAX_THREADS)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def build_world(demo: Demo) -> W.World:
    """Step 1: the world's data files and the pretrained base model (reused when base/final exists)."""
    out, size = demo.out, demo.size
    world = W.make_world(demo.seed, size["demonstrations"], size["corpus"])
    data = out / "data"
    write_jsonl(data / "sft.jsonl", world.demonstrations)
    write_jsonl(data / "ppo_prompts.jsonl", [{"prompt": p} for p in world.train_prompts])
    write_jsonl(data / "validation_prompts.jsonl", [{"prompt": p} for p in world.validation_prompts])
    write_jsonl(data / "heldout_prompts.jsonl", [{"prompt": p} for p in world.heldout_prompts])
    (data / "corpus.txt").write_text("\n\n".join(world.corpus) + "\n", encoding="utf-8")
    if final_dir(out / "base").is_dir():
        demo.reused.append("base")
    else:
        print(f"demo: pretraining the base model on {len(world.corpus)} sentences", file=sys.stderr)
        _, log = W.build_base_model(world, final_dir(out / "base"), size, size["pretrain_steps"], demo.seed)
        write_jsonl(out / "base" / METRICS_FILE, log)
    return world


def build_pairs(demo: Demo, world: W.World) -> dict:
    """Step 3: pairs of the SFT model's own samples, gold-labelled: noisy on training prompts (the RM's data),
    clean on the test prompts (the RM's held-out accuracy)."""
    from rlhfkit.demo.sampling import load_policy, sample_pairs

    data, size, seed = demo.out / "data", demo.size, demo.seed
    if final_dir(demo.out / "rm").is_dir() and (data / "pairs.json").is_file():
        demo.reused.append("pairs")  # the RM that learned from them is complete: same seed, same pairs
        return json.loads((data / "pairs.json").read_text())
    model, tokenizer = load_policy(final_dir(demo.out / "sft"))
    rng = random.Random(seed)
    prompts = [rng.choice(world.train_prompts) for _ in range(size["pair_prompts"])]
    train, train_stats = sample_pairs(model, tokenizer, prompts, demo.gen, W.gold_reward, LABEL_NOISE, seed)
    heldout = world.heldout_prompts * size["heldout_pair_repeats"]
    evals, eval_stats = sample_pairs(model, tokenizer, heldout, demo.gen, W.gold_reward, 0.0, seed + 1)
    write_jsonl(data / "pairs.jsonl", train)
    write_jsonl(data / "heldout_pairs.jsonl", evals)
    stats = {"train": train_stats, "heldout": eval_stats, "label_noise": LABEL_NOISE}
    (data / "pairs.json").write_text(json.dumps(stats, indent=2), encoding="utf-8")
    print(f"demo: {train_stats['pairs']} training pairs from {len(prompts)} prompts ({train_stats['ties_dropped']} "
          f"ties dropped, {train_stats['flipped']} labels flipped); {eval_stats['pairs']} held-out pairs",
          file=sys.stderr)
    return stats


def run_pipeline_steps(demo: Demo, steps: list[str]) -> None:
    """Write OUT/pipeline.yaml and run `steps` of it exactly as `rlhfkit pipeline --config` would."""
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.pipeline_schema import PipelineConfig
    from rlhfkit.stages.pipeline import run_pipeline

    path = demo.out / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline_dict(demo.out, demo.size, demo.seed), sort_keys=False), encoding="utf-8")
    cfg = load_config(PipelineConfig, str(path), [*demo.overrides, f"steps={json.dumps(steps)}"])
    # complete steps are reused; a step a killed demo left unfinished continues from its last checkpoint
    result = run_pipeline(cfg, resume=True)
    demo.reused += [step for step in steps if result[step] != "ran"]


def merged_pipeline(demo: Demo) -> dict:
    """The pipeline config as a dict with the user's dotted overrides applied."""
    from rlhfkit.config.fields import deep_merge, parse_overrides

    return deep_merge(pipeline_dict(demo.out, demo.size, demo.seed), parse_overrides(demo.overrides))


def check_config(demo: Demo) -> None:
    """Validate the whole pipeline config with the user's overrides, and the arena's configs, before step 1, so a
    typo in a later section fails now rather than after SFT trained."""
    from rlhfkit.config.fields import from_dict
    from rlhfkit.config.pipeline_schema import PipelineConfig

    merged = merged_pipeline(demo)
    from_dict(PipelineConfig, merged)
    if demo.algos:
        from rlhfkit.demo.arena import check_arena

        check_arena(demo, merged)


def ppo_iterations(demo: Demo) -> int:
    """The iterations PPO ran (the user may have overridden ppo.train.max_steps)."""
    result = demo.out / "ppo" / RESULT_FILE
    iterations = json.loads(result.read_text()).get("iterations") if result.is_file() else None
    return int(iterations or demo.size["ppo_steps"])


def track_overoptimisation(demo: Demo, world: W.World) -> dict:
    """Step 5: proxy, gold, KL and flaws of every saved PPO policy on the validation prompts; with early stopping,
    the policy of best validation gold becomes the one step 6 evaluates (exported to OUT/early-stop)."""
    from rlhfkit.demo import overoptimisation as O

    out, last = demo.out, ppo_iterations(demo)
    prompts = world.validation_prompts * demo.size["validation_samples"]
    points = O.track(final_dir(out / "sft"), final_dir(out / "rm"), out / "ppo", last, prompts, demo.gen,
                     demo.seed + 4)
    best = O.best_point(points)
    chosen = best["step"] if demo.early_stop else last
    policy = O.export_policy(final_dir(out / "sft"), out / "ppo", chosen, last, out / "early-stop")
    return {"split": "validation", "samples": len(prompts), "points": points, "best_step": best["step"],
            "final_step": last, "early_stop": demo.early_stop, "chosen_step": chosen, "policy": str(policy)}


def evaluate(demo: Demo, world: W.World, policy: Path) -> dict:
    """Step 6: RM accuracy on clean held-out pairs; gold of base / SFT / PPO (`policy`) and the flaws of their
    samples on the test prompts; KL of PPO to SFT; PPO's gold on training prompts (the generalisation gap)."""
    from rlhfkit.demo.evaluate import gold_of_policies, gold_of_policy, mean_stderr, rm_accuracy
    from rlhfkit.demo.overoptimisation import proxy_exploits
    from rlhfkit.demo.sampling import load_policy

    out = demo.out
    acc = rm_accuracy(final_dir(out / "rm"), str(out / "data" / "heldout_pairs.jsonl"))
    folders = {"base": final_dir(out / "base"), "sft": final_dir(out / "sft"), "ppo": policy}
    prompts = world.heldout_prompts * demo.size["eval_samples"]
    gold, texts, kl = gold_of_policies(folders, prompts, demo.gen, W.gold_reward, demo.seed + 2)
    flaws = {name: W.flaw_rates(prompts, texts[name]) for name in ("sft", "ppo")}
    seen = random.Random(demo.seed + 3).sample(world.train_prompts, min(len(prompts), len(world.train_prompts)))
    model, tokenizer = load_policy(policy)
    train = gold_of_policy(model, tokenizer, seen, demo.gen, W.gold_reward, demo.seed + 3)
    samples = [{"prompt": p, "before": b, "after": a, "before_reward": W.gold_reward(p, b),
                "after_reward": W.gold_reward(p, a)}
               for p, b, a in zip(prompts, texts["sft"], texts["ppo"])][:len(world.heldout_prompts)]
    return {"rm_accuracy": acc["accuracy"], "rm_pairs": acc["pairs"], "gold": gold, "kl": kl, "samples": samples,
            "train_gold": mean_stderr(train.gold), "flaws": flaws,
            "exploits": proxy_exploits(flaws["sft"], flaws["ppo"])}


def write_outputs(demo: Demo, results: dict, rows: list[dict], title: str) -> Path:
    """Step 7: summary.json, gold.json, overoptimisation.json, samples.jsonl and report.html."""
    from rlhfkit.report import write_report

    out = demo.out
    summary = {"title": title, "rows": rows, "seed": demo.seed, "size": demo.size, "reused": demo.reused,
               "kl_budget": KL_BUDGET, "label_noise": LABEL_NOISE,
               **{k: results[k] for k in ("pairs", "rm_pairs", "kl", "train_gold", "flaws", "exploits", "timings",
                                 "threads")},
               "policy": {k: results["tracking"][k] for k in ("early_stop", "chosen_step", "best_step", "final_step",
                                                             "policy")}}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    gold = {"policies": {k: {"mean": v["mean"], "stderr": v["stderr"]} for k, v in results["gold"].items()},
            "best": W.BEST_GOLD, "moods": {m: sorted(words) for m, words in W.MOODS.items()}, "cap": W.GOLD_CAP}
    (out / GOLD_FILE).write_text(json.dumps(gold, indent=2), encoding="utf-8")
    (out / OVEROPTIMISATION_FILE).write_text(json.dumps(results["tracking"], indent=2), encoding="utf-8")
    arena = out / ARENA_FILE
    if "arena" in results:
        arena.write_text(json.dumps(results["arena"], indent=2), encoding="utf-8")
    elif arena.is_file():  # from an earlier run with --algos: the report must not show a stale table
        arena.unlink()
    write_jsonl(out / SAMPLES_FILE, results["samples"])
    return write_report(out)


def run_demo(output: str, quick: bool = False, overrides: list[str] | None = None, force: bool = False,
             seed: int = 0, early_stop: bool = False, algos: list[str] | None = None) -> int:
    """The whole demo; returns the exit code (0 when every bar passes, 1 otherwise)."""
    import torch

    from rlhfkit.demo.bar import bar_rows, context_rows, verdict
    from rlhfkit.stages.pipeline import print_table

    torch.set_num_threads(demo_threads())
    print(f"demo: {torch.get_num_threads()} compute thread(s) (OMP_NUM_THREADS sets them)", file=sys.stderr)
    tick = time.perf_counter()
    demo = Demo(Path(output), SIZES["quick" if quick else "full"], seed, list(overrides or []), early_stop,
                algos=list(algos or []))
    check_config(demo)  # before anything is written or removed
    if force:
        for name in STEP_FOLDERS:
            shutil.rmtree(demo.out / name, ignore_errors=True)
    demo.out.mkdir(parents=True, exist_ok=True)
    timings: dict = {}

    def timed(name: str, fn, *args):
        start = time.perf_counter()
        value = fn(demo, *args)
        timings[name] = round(time.perf_counter() - start, 1)
        print(f"demo: {name} took {timings[name]} s", file=sys.stderr)
        return value

    world = timed("world and base model", build_world)  # 1
    timed("sft", run_pipeline_steps, ["sft"])  # 2
    pairs = timed("preference pairs", build_pairs, world)  # 3
    timed("rm and ppo", run_pipeline_steps, ["rm", "ppo"])  # 4
    tracking = timed("over-optimisation curve", track_overoptimisation, world)  # 5
    results = {**timed("evaluation", evaluate, world, Path(tracking["policy"])), "pairs": pairs,  # 6
               "tracking": tracking, "timings": timings, "threads": torch.get_num_threads()}
    wall = time.perf_counter() - tick

    rows = bar_rows(results["rm_accuracy"], results["gold"], W.BEST_GOLD, results["kl"], KL_BUDGET, wall,
                    results["train_gold"], results["flaws"]["ppo"]["exploit"], RM_ACCURACY_TARGET,
                    WALL_TIME_TARGET)  # 7
    if demo.reused:  # a rerun's wall time says nothing about the demo's
        wall_row = next(r for r in rows if r["name"].startswith("wall time"))
        wall_row.update(target=f"not measured: reused {', '.join(demo.reused)} (--force reruns)", passed=None)
    rows += context_rows(results["gold"], W.BEST_GOLD, results["train_gold"], results["flaws"], results["exploits"])
    if early_stop:
        rows.append({"name": "early stopping: PPO iteration kept (best validation gold)",
                     "value": tracking["chosen_step"], "target": f"of {tracking['final_step']}", "passed": None})
    if demo.algos:  # after the wall time: the arena is extra work, timed per algorithm
        from rlhfkit.demo.arena import arena_rows, run_arena

        results["arena"] = timed("arena", run_arena, world, merged_pipeline(demo))
        rows += arena_rows(results["arena"])
    title = f"rlhfkit demo{' (quick)' if quick else ''} — does PPO improve the hidden gold reward?"
    report = write_outputs(demo, results, rows, title)
    print_table(title, rows)
    if demo.algos:
        from rlhfkit.demo.arena import arena_table

        print(f"\nthe arena: every algorithm from the same SFT model, on the test prompts "
              f"({results['arena']['samples']} samples each)\n{arena_table(results['arena'])}")
    print(f"\nreport: {report}")
    return verdict(rows)
