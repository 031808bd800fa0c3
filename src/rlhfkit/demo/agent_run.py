"""`rlhfkit demo --task calculator`: SmolLM2-135M-Instruct learns to use a tool, by SFT on a few demonstrations and
then GRPO on multi-turn episodes, and the demo checks it.

Steps: 1 the model, the questions (training and held-out, disjoint) and the demonstrations (demo/agent.py);
2 SFT on the demonstrations (`run_sft`); 3 GRPO against `env=rlhfkit.demo.agent:MultiplyEnv` (`run_ppo`, the
calculator as its tool); 4 held-out success of the starting model, the SFT model and the trained one, each on the
same episodes (same questions, same sampling seed, temperature 1), with the share of episodes that called the
calculator and the trained policy's KL to the SFT model; 5 the bar, summary, samples and report.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from rlhfkit.config.ppo_schema import EpisodeSection, GenConfig
from rlhfkit.demo.bar import report_verdict
from rlhfkit.demo.run import write_jsonl
from rlhfkit.run_files import SAMPLES_FILE, SUMMARY_FILE, final_dir, latest_pointer

MODEL = "smollm2-135m-instruct"
ENV = "rlhfkit.demo.agent:MultiplyEnv"
TURN_TOKENS = 40  # a call is ~30 tokens, an answer ~4
EPISODE = {"max_turns": 3, "max_tokens": 120}
GROUP = 4
WALL_TIME_TARGET = 900.0
# full: what `rlhfkit demo --task calculator` runs; quick: the test tier's
SIZES = {"full": {"demonstrations": 12, "sft_steps": 8, "iterations": 12, "heldout": 48, "eval_samples": 2},
         "quick": {"demonstrations": 12, "sft_steps": 8, "iterations": 3, "heldout": 16, "eval_samples": 2}}


def sft_dict(out: Path, model: Path, size: dict, seed: int) -> dict:
    return {"model": str(model), "output_dir": str(out / "sft"),
            "data": {"train": str(out / "data" / "demonstrations.jsonl"), "eval_fraction": 0.0, "max_length": 256,
                     "cache": False},
            "train": {"max_steps": size["sft_steps"], "batch_size": 6, "micro_batch_size": 6, "lr": 5.0e-5,
                      "seed": seed, "eval_every": 0, "save_every": 0, "log_every": 1},
            "log": {"tensorboard": False}}


def ppo_dict(out: Path, size: dict, seed: int) -> dict:
    data = out / "data"
    return {"actor": str(final_dir(out / "sft")), "env": ENV, "output_dir": str(out / "ppo"),
            "data": {"prompts": str(data / "train_prompts.jsonl"), "eval_prompts": str(data / "heldout_prompts.jsonl"),
                     "eval_max_rows": 16, "max_prompt_length": 512, "cache": False},
            "train": {"max_steps": size["iterations"], "batch_size": 16 // GROUP, "micro_batch_size": 16,
                      "lr": 2.0e-5, "seed": seed, "eval_every": 0, "save_every": 8, "log_every": 1},
            "gen": {"max_new_tokens": TURN_TOKENS},
            "episode": dict(EPISODE),
            "ppo": {"advantage_estimator": "grpo", "n_samples_per_prompt": GROUP, "kl_coef": 0.0,
                    "kl_loss_coef": 0.05, "sample_every": 4},
            "log": {"tensorboard": False}}


def heldout_rows(tokenizer, template, pairs) -> list[dict]:
    from rlhfkit.data.templates import encode_prompt
    from rlhfkit.demo.agent import prompt_row

    rows = []
    for a, b in pairs:
        row = prompt_row(a, b)
        messages = [{"role": "user", "content": row["prompt"]}]
        text = template.prompt(messages)
        rows.append({"prompt_ids": encode_prompt(tokenizer, text), "prompt_text": text, "messages": messages,
                     "fields": {"answer": row["answer"]}})
    return rows


@torch.no_grad()
def evaluate_policies(folders: dict, pairs, samples: int, seed: int) -> tuple[dict, dict, dict | None]:
    """Held-out episodes of every policy (same questions, same seed): success and tool use (mean and standard
    error), the episodes' texts, and the KL of "trained" to "sft" on its own episodes."""
    from rlhfkit.data.templates import Template
    from rlhfkit.demo.agent import MultiplyEnv
    from rlhfkit.demo.evaluate import mean_stderr, sampling_plan
    from rlhfkit.demo.sampling import load_policy
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.rollout.engines import NativeRollout
    from rlhfkit.rollout.episodes import EpisodeRollout
    from rlhfkit.rollout.evaluate import sequence_kl
    from rlhfkit.rollout.generate import eos_token_ids
    from rlhfkit.tools import resolve_tools

    engine, tools = LocalEngine(), resolve_tools(MultiplyEnv.tools)
    stats, texts, kept = {}, {}, {}
    for name, folder in folders.items():
        model, tokenizer = load_policy(folder)
        plan = sampling_plan(model)
        template = Template.for_tokenizer(tokenizer, "auto", eos_token_ids(tokenizer, model))
        runner = EpisodeRollout(NativeRollout(model, engine, tokenizer, plan), MultiplyEnv,
                                EpisodeSection(**EPISODE), template, engine, tools, spec=ENV)
        rows = heldout_rows(tokenizer, template, pairs) * samples
        torch.manual_seed(seed)
        batch = runner.generate(rows, GenConfig(max_new_tokens=TURN_TOKENS))
        success = torch.nan_to_num(batch.episode_rewards, nan=0.0).tolist()
        stats[name] = {"success": mean_stderr(success),
                       "used_tool": mean_stderr([float(e["tool_calls"] > 0) for e in batch.episodes])}
        texts[name] = batch.response_texts
        kept[name] = (model, batch, plan)
    kl = None
    if "trained" in kept and "sft" in kept:
        model, batch, plan = kept["trained"]
        kls = sequence_kl(model, kept["sft"][0], {"actor": plan, "reference": kept["sft"][2]}, batch, 1.0, 16)
        kl = mean_stderr(kls.tolist())
    return stats, texts, kl


def gain_row(name: str, before: dict, after: dict) -> dict:
    """A bar row: `after`'s mean success above `before`'s by >= 3 standard errors of the difference."""
    gain = after["mean"] - before["mean"]
    se = (after["stderr"] ** 2 + before["stderr"] ** 2) ** 0.5
    return {"name": name, "value": gain / se if se else float("inf") if gain > 0 else 0.0, "target": ">= 3",
            "passed": gain > 0 and (se == 0 or gain >= 3 * se)}


def bar_rows(stats: dict, kl: dict | None, wall: float, reused: bool, quick: bool = False) -> list[dict]:
    """The bar: success rose over the start and (the full run) over SFT by >= 3 standard errors, the trained
    policy succeeds at least half the time and calls the calculator; wall time within budget."""
    start, sft, trained = (stats[name]["success"] for name in ("start", "sft", "trained"))
    rows = [
        gain_row("held-out success gain over the start, in standard errors", start, trained),
        # what RL added to SFT: the quick run's 3 iterations are not held to it
        {**gain_row("held-out success gain of GRPO over SFT, in standard errors", sft, trained),
         **({"passed": None} if quick else {})},
        {"name": "held-out success of the trained policy", "value": trained["mean"], "target": ">= 0.5",
         "passed": trained["mean"] >= 0.5},
        {"name": "share of the trained policy's episodes that called the calculator",
         "value": stats["trained"]["used_tool"]["mean"], "target": ">= 0.5",
         "passed": stats["trained"]["used_tool"]["mean"] >= 0.5},
        {"name": "wall time, seconds", "value": wall, "target": f"<= {WALL_TIME_TARGET:.0f}",
         "passed": None if reused else wall <= WALL_TIME_TARGET},
    ]
    for name, s in stats.items():
        rows.append({"name": f"held-out success of the {name} policy (tool use)", "value":
                     f"{s['success']['mean']:.3f} ± {s['success']['stderr']:.3f} "
                     f"({s['used_tool']['mean']:.2f})", "target": "best 1", "passed": None})
    if kl is not None:
        rows.append({"name": "KL(trained || SFT), nats per episode", "value": kl["mean"], "target": "", "passed": None})
    return rows


def run_agent_demo(output: str, quick: bool = False, overrides: list[str] | None = None, force: bool = False,
                   seed: int = 0) -> int:
    """The whole agent demo; returns the exit code (0 when every bar passes, 1 otherwise)."""
    import shutil

    from rlhfkit.config.fields import deep_merge, from_dict, parse_overrides
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.config.schema import SFTConfig
    from rlhfkit.data.templates import Template
    from rlhfkit.demo.agent import demonstration_rows, prompt_row, questions
    from rlhfkit.models import load_tokenizer
    from rlhfkit.models.fetch import fetch
    from rlhfkit.rollout.turns import TurnRenderer
    from rlhfkit.stages.ppo import run_ppo
    from rlhfkit.stages.sft import run_sft
    from rlhfkit.tools import resolve_tools

    tick = time.perf_counter()
    size, out = SIZES["quick" if quick else "full"], Path(output)
    # 1. the model, the questions and the demonstrations; both configs checked before any training
    model = fetch(MODEL, log=lambda line: print(line, file=sys.stderr))
    sft_cfg = from_dict(SFTConfig, sft_dict(out, model, size, seed))
    ppo_cfg = from_dict(PPOConfig, deep_merge(ppo_dict(out, size, seed), parse_overrides(list(overrides or []))))
    if force:
        for step in ("sft", "ppo"):
            shutil.rmtree(out / step, ignore_errors=True)
    train, heldout = questions(seed, heldout=size["heldout"])
    shown, train = train[:size["demonstrations"]], train[size["demonstrations"]:]
    tokenizer = load_tokenizer(str(model))
    renderer = TurnRenderer(Template.for_tokenizer(tokenizer, "auto", [tokenizer.eos_token_id]),
                            resolve_tools(["calculator"]))
    write_jsonl(out / "data" / "demonstrations.jsonl", demonstration_rows(shown, renderer))
    write_jsonl(out / "data" / "train_prompts.jsonl", [prompt_row(a, b) for a, b in train])
    write_jsonl(out / "data" / "heldout_prompts.jsonl", [prompt_row(a, b) for a, b in heldout])

    # 2-3. SFT on the demonstrations, then GRPO on episodes (complete steps are reused, a started PPO continued)
    reused = []
    if final_dir(out / "sft").is_dir():
        reused.append("sft")
    else:
        run_sft(sft_cfg)
    if final_dir(out / "ppo").is_dir():
        reused.append("ppo")
    else:
        run_ppo(ppo_cfg, resume=latest_pointer(out / "ppo").is_file())

    # 4. held-out episodes of the three policies
    folders = {"start": model, "sft": final_dir(out / "sft"), "trained": final_dir(out / "ppo")}
    stats, texts, kl = evaluate_policies(folders, heldout, size["eval_samples"], seed + 2)
    wall = time.perf_counter() - tick

    # 5. the bar, summary.json, samples.jsonl and the report
    rows = bar_rows(stats, kl, wall, bool(reused), quick)
    title = f"rlhfkit demo --task calculator{' (quick)' if quick else ''} — SmolLM2-135M-Instruct learns to use a tool"
    summary = {"title": title, "rows": rows, "seed": seed, "task": "calculator", "algo": "grpo", "model": str(model),
               "demonstrations": len(shown), "sft_steps": size["sft_steps"], "iterations": size["iterations"],
               "heldout_questions": len(heldout), "samples_per_question": size["eval_samples"],
               "policies": stats, "kl": kl, "reused": reused}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    questions_shown = [f"What is {a} * {b}?" for a, b in heldout] * size["eval_samples"]
    write_jsonl(out / SAMPLES_FILE, [
        {"question": q, **{name: texts[name][i] for name in texts}}
        for i, q in enumerate(questions_shown)][:len(heldout)])
    return report_verdict(out, title, rows)
