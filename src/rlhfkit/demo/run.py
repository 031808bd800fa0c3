"""`rlhfkit demo`: the embedded default. Builds a world, runs SFT -> RM -> PPO through `rlhfkit pipeline`, and
checks on held-out prompts that PPO improved what the reward stands for (the hidden gold reward), not only the
reward model's score.

Steps: 1 world and base model, 2 SFT (pipeline), 3 preference pairs from the SFT model's own samples labelled by
the gold reward with noise, 4 RM and PPO (pipeline), 5 held-out evaluation, 6 summary, gold.json, samples and
report. Everything is seeded; each step reuses a complete output, so a second run only re-evaluates.
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

# The two sizes. "full" is what `rlhfkit demo` runs (configs/demo.yaml is its pipeline config): a 4-layer Llama of
# width 128 (0.7M parameters), about 2 minutes on 2 cores. "quick" (`--quick`, the test's reduced run) is the same
# recipe at width 64 with 2 layers (0.1M), about 40 seconds; it clears the same bar.
SIZES = {
    "full": {"vocab": 512, "hidden": 128, "layers": 4, "heads": 4, "corpus": 6000, "pretrain_steps": 600,
             "demonstrations": 4000, "sft_steps": 300, "pair_prompts": 6000, "heldout_pair_repeats": 10,
             "rm_epochs": 2, "ppo_steps": 120, "eval_samples": 8},
    "quick": {"vocab": 512, "hidden": 64, "layers": 2, "heads": 4, "corpus": 4000, "pretrain_steps": 400,
              "demonstrations": 3000, "sft_steps": 300, "pair_prompts": 6000, "heldout_pair_repeats": 6,
              "rm_epochs": 2, "ppo_steps": 120, "eval_samples": 5},
}
LABEL_NOISE = 0.1  # fraction of preference labels flipped, as disagreeing human labellers would
KL_BUDGET = 8.0  # nats per response: how far PPO may move from the SFT policy and still count as a pass
RM_ACCURACY_TARGET = 0.85
WALL_TIME_TARGET = 600.0  # seconds on 2 CPU cores: the README's demo table holds the demo to it
MAX_NEW_TOKENS = 24
STEP_FOLDERS = ("base", "sft", "rm", "ppo", "data", "plots")


@dataclass
class Demo:
    """Where the demo writes, how big it is, and the seed everything derives from."""

    out: Path
    size: dict
    seed: int
    overrides: list
    gen: GenConfig = field(default_factory=lambda: GenConfig(max_new_tokens=MAX_NEW_TOKENS, generation_batch_size=256))
    reused: list = field(default_factory=list)  # steps taken from an earlier run instead of recomputed


def pipeline_dict(out: Path, size: dict, seed: int) -> dict:
    """The pipeline config the demo runs (written to OUT/pipeline.yaml; configs/demo.yaml is the full one)."""
    data = out / "data"
    every = {"micro_batch_size": 32, "log_every": 1, "save_every": 0}
    return {
        "model": str(out / "base" / "final"),
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
        "ppo": {"data": {"prompts": str(data / "ppo_prompts.jsonl"), "eval_prompts": str(data / "heldout_prompts.jsonl"),
                         "max_prompt_length": 32},
                "train": {**every, "max_steps": size["ppo_steps"], "batch_size": 32, "micro_batch_size": 16,
                          "lr": 2.0e-4, "eval_every": 20},
                "gen": {"max_new_tokens": MAX_NEW_TOKENS},
                # normalised RM scores: kl_coef then means the same whatever scale the RM happened to learn
                "ppo": {"kl_coef": 0.1, "normalize_reward": True, "mini_batch_size": 16, "sample_every": 20}},
    }


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
    write_jsonl(data / "heldout_prompts.jsonl", [{"prompt": p} for p in world.heldout_prompts])
    (data / "corpus.txt").write_text("\n\n".join(world.corpus) + "\n", encoding="utf-8")
    if (out / "base" / "final").is_dir():
        demo.reused.append("base")
    else:
        print(f"demo: pretraining the base model on {len(world.corpus)} sentences", file=sys.stderr)
        _, log = W.build_base_model(world, out / "base" / "final", size, size["pretrain_steps"], demo.seed)
        write_jsonl(out / "base" / "metrics.jsonl", log)
    return world


def build_pairs(demo: Demo, world: W.World) -> dict:
    """Step 3: pairs of the SFT model's own samples, gold-labelled: noisy for training, clean for evaluation."""
    from rlhfkit.demo.sampling import load_policy, sample_pairs

    data, size, seed = demo.out / "data", demo.size, demo.seed
    if (demo.out / "rm" / "final").is_dir() and (data / "pairs.json").is_file():
        demo.reused.append("pairs")  # the RM that learned from them is complete: same seed, same pairs
        return json.loads((data / "pairs.json").read_text())
    model, tokenizer = load_policy(demo.out / "sft" / "final")
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
    result = run_pipeline(cfg)
    demo.reused += [step for step in steps if result[step] != "ran"]


def check_config(demo: Demo) -> None:
    """Validate the whole pipeline config with the user's overrides before step 1, so a typo in a later
    section fails now rather than after SFT trained."""
    from rlhfkit.config.fields import deep_merge, from_dict, parse_overrides
    from rlhfkit.config.pipeline_schema import PipelineConfig

    base = pipeline_dict(demo.out, demo.size, demo.seed)
    from_dict(PipelineConfig, deep_merge(base, parse_overrides(demo.overrides)))


def evaluate(demo: Demo, world: W.World) -> dict:
    """Step 5: RM accuracy on clean held-out pairs; gold reward of base / SFT / PPO; KL of PPO to SFT."""
    from rlhfkit.demo.evaluate import gold_of_policies, rm_accuracy

    out = demo.out
    acc = rm_accuracy(out / "rm" / "final", str(out / "data" / "heldout_pairs.jsonl"))
    folders = {name: out / name / "final" for name in ("base", "sft", "ppo")}
    prompts = world.heldout_prompts * demo.size["eval_samples"]
    gold, texts, kl = gold_of_policies(folders, prompts, demo.gen, lambda _, text: W.gold_reward(text), demo.seed + 2)
    samples = [{"prompt": p, "before": b, "after": a, "before_reward": W.gold_reward(b),
                "after_reward": W.gold_reward(a)}
               for p, b, a in zip(prompts, texts["sft"], texts["ppo"])][:len(world.heldout_prompts)]
    return {"rm_accuracy": acc["accuracy"], "rm_pairs": acc["pairs"], "gold": gold, "kl": kl, "samples": samples}


def write_outputs(demo: Demo, results: dict, rows: list[dict], title: str) -> Path:
    """Step 6: summary.json, gold.json, samples.jsonl and report.html (the report module's formats)."""
    from rlhfkit.report import write_report

    out = demo.out
    summary = {"title": title, "rows": rows, "seed": demo.seed, "size": demo.size, "reused": demo.reused,
               "kl_budget": KL_BUDGET, **{k: results[k] for k in ("pairs", "rm_pairs", "kl", "timings")}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    gold = {"policies": {k: {"mean": v["mean"], "stderr": v["stderr"]} for k, v in results["gold"].items()},
            "best": W.BEST_GOLD, "good_words": sorted(W.GOOD), "cap": W.GOLD_CAP}
    (out / "gold.json").write_text(json.dumps(gold, indent=2), encoding="utf-8")
    write_jsonl(out / "samples.jsonl", results["samples"])
    return write_report(out)


def run_demo(output: str, quick: bool = False, overrides: list[str] | None = None, force: bool = False,
             seed: int = 0) -> int:
    """The whole demo; returns the exit code (0 when every bar passes, 1 otherwise)."""
    import torch

    from rlhfkit.demo.bar import bar_rows, failed
    from rlhfkit.stages.pipeline import print_table

    # One intra-op thread: the matrices are ~100 wide, so a second thread costs more in synchronisation than it
    # saves, and on a shared 2-core machine it waits for a busy core (measured: SFT 3x slower with 2 threads).
    torch.set_num_threads(1)
    tick = time.perf_counter()
    demo = Demo(Path(output), SIZES["quick" if quick else "full"], seed, list(overrides or []))
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
    results = {**timed("evaluation", evaluate, world), "pairs": pairs, "timings": timings}  # 5
    wall = time.perf_counter() - tick

    rows = bar_rows(results["rm_accuracy"], results["gold"], W.BEST_GOLD, results["kl"], KL_BUDGET, wall,
                    RM_ACCURACY_TARGET, WALL_TIME_TARGET)  # 6
    if demo.reused:  # a rerun's wall time says nothing about the demo's
        rows[4].update(target=f"not measured: reused {', '.join(demo.reused)} (--force reruns)", passed=None)
    title = f"rlhfkit demo{' (quick)' if quick else ''} — does PPO improve the hidden gold reward?"
    report = write_outputs(demo, results, rows, title)
    print_table(title, rows)
    print(f"\nreport: {report}")
    bad = failed(rows)
    if bad:
        print(f"rlhfkit demo: FAILED: {'; '.join(bad)}", file=sys.stderr)
        return 1
    print("rlhfkit demo: every bar passed")
    return 0
