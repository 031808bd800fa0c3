"""Over-optimisation in view: the proxy reward and the gold reward against KL to the SFT policy, along the RL run
(the picture of Gao, Schulman and Hilton 2022, "Scaling Laws for Reward Model Overoptimization").

The RL stage stays generic: it saves a checkpoint every `train.save_every` iterations (checkpoints/step-N/
actor.safetensors, the engine's layout), and any stage that trains an actor against the reward model does the same.
Afterwards the demo loads the SFT start, each checkpoint and the final policy, samples the validation prompts with
one seed, and measures on those samples: the reward model's score (the proxy the policy climbed), the gold reward
(what the proxy stands for), KL(policy || SFT) and the rate of each flaw the gold punishes. The proxy rises as the
policy moves away from SFT; where the gold stops following it, the policy is exploiting the reward model.

Early stopping (`rlhfkit demo --early-stop`) keeps the point of highest validation gold, a held-out gold-labelled
set distinct from the test prompts the bar reads, and exports it as a model folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_model

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.demo import world as W
from rlhfkit.demo.evaluate import ProxyScorer, gold_of_policy
from rlhfkit.demo.sampling import load_policy
from rlhfkit.run_files import checkpoints_dir, final_dir


def saved_actors(run_dir: Path) -> list[tuple[int, Path]]:
    """(iteration, actor weights) of every complete checkpoint of an RL run, in iteration order."""
    found = []
    for folder in checkpoints_dir(run_dir).glob("step-*"):
        weights = folder / "actor.safetensors"
        if folder.is_dir() and not folder.name.endswith(".tmp") and weights.is_file():
            found.append((int(folder.name.split("-")[1]), weights))
    return sorted(found)


def measure(model, tokenizer, reference, proxy: ProxyScorer, prompts: list[str], gen: GenConfig, seed: int,
            step: int) -> dict:
    """One point of the curve: {step, kl, proxy, gold (means and stderrs), flaws (rates)}."""
    result = gold_of_policy(model, tokenizer, prompts, gen, W.gold_reward, seed, reference, proxy)
    point = {"step": step}
    for name, stats in result.summary().items():
        point[name], point[f"{name}_stderr"] = stats["mean"], stats["stderr"]
    point["flaws"] = W.flaw_rates(prompts, result.texts)
    return point


def track(sft_dir: Path, rm_dir: Path, run_dir: Path, final_step: int, prompts: list[str], gen: GenConfig,
          seed: int) -> list[dict]:
    """The curve's points, from the SFT policy (step 0) through every saved checkpoint to run_dir/final."""
    reference, tokenizer = load_policy(sft_dir)
    proxy = ProxyScorer(rm_dir, tokenizer.eos_token_id)
    points = [measure(reference, tokenizer, reference, proxy, prompts, gen, seed, 0)]
    model, _ = load_policy(sft_dir)
    for step, weights in saved_actors(run_dir):
        try:
            load_model(model, str(weights))  # strict: the checkpoint holds the whole actor
        except RuntimeError as exc:  # e.g. a LoRA actor (ppo.lora.rank > 0): not the SFT model's parameters
            print(f"demo: over-optimisation: {weights} is not a plain actor, skipped ({str(exc)[:120]})",
                  file=sys.stderr)
            continue
        points.append(measure(model, tokenizer, reference, proxy, prompts, gen, seed, step))
        print(f"demo: over-optimisation: step {step}: KL {points[-1]['kl']:.2f}, proxy {points[-1]['proxy']:.3f}, "
              f"gold {points[-1]['gold']:.3f}", file=sys.stderr)
    final, _ = load_policy(final_dir(run_dir))
    points.append(measure(final, tokenizer, reference, proxy, prompts, gen, seed, final_step))
    return points


def best_point(points: list[dict]) -> dict:
    """The point of highest gold (the earliest among equals): what early stopping keeps."""
    return max(points, key=lambda p: (p["gold"], -p["step"]))


def export_policy(sft_dir: Path, run_dir: Path, step: int, final_step: int, target: Path) -> Path:
    """A model folder of the policy at `step`: sft_dir for 0, run_dir/final for the last, else the checkpoint's
    actor written to `target` (a plain transformers folder)."""
    from rlhfkit.engine.storage import write_hf_folder

    if step == 0:
        return sft_dir
    if step == final_step:
        return final_dir(run_dir)
    model, tokenizer = load_policy(sft_dir)
    load_model(model, str(dict(saved_actors(run_dir))[step]))
    return write_hf_folder(model, tokenizer, target)


def proxy_exploits(before: dict, after: dict, margin: float = 0.02) -> list[str]:
    """The flaws of W.EXPLOITS more frequent `after` than `before` by more than `margin` (rates, 0-1): behaviour
    the proxy paid for and the gold did not."""
    return [name for name in W.EXPLOITS if after[name] > before[name] + margin]
