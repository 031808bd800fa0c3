"""The algorithm arena: every algorithm trained from the same SFT model on the same world, judged by the same gold.

`rlhfkit demo --algos ppo,grpo,rloo,reinforce_pp,dpo` runs the demo as usual (world, SFT, pairs, RM, PPO), then
trains each other algorithm from OUT/sft/final into OUT/arena/ALGO:

- the RL algorithms (`rlhfkit ppo` with another `ppo.advantage_estimator`, no critic) against the demo's learned
  reward model OUT/rm/final, with PPO's sample budget: the same number of iterations and of samples per iteration
  (GRPO and RLOO: a quarter of the prompts, 4 samples each), the same learning rate and KL reference;
- DPO (`rlhfkit dpo`) on the same noisy preference pairs that trained the reward model (OUT/data/pairs.jsonl).

Then every policy, PPO's included, is sampled on the test prompts with one seed, as the demo's bar samples
them, and the table gives its gold reward (mean ± stderr), its gain over SFT in standard errors of the
difference, KL to SFT, the share of samples with an exploit, training seconds, and the samples or pairs it
trained on. Each algorithm must raise the gold by at least 3 standard errors over SFT.

No algorithm is tuned for the table beyond what is written here: one setting each, the same for every seed.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import yaml

from rlhfkit.demo import world as W
from rlhfkit.registry.estimators import ESTIMATORS, algorithms
from rlhfkit.run_files import CONFIG_FILE, RESULT_FILE, final_dir

GAIN_TARGET = 3.0  # standard errors of the gold gain over SFT that every algorithm must reach
RL_ESTIMATORS = algorithms()  # {algorithm: its estimator}: ppo -> gae, grpo, rloo, reinforce_pp
GROUP = 4  # samples per prompt for the group estimators
ALGOS = (*RL_ESTIMATORS, "dpo")
TIMING_FILE = "timing.json"  # in OUT/arena/ALGO: the seconds an algorithm trained for, and its run's result


def parse_algos(text: str) -> list[str]:
    """"ppo,grpo" -> ["ppo", "grpo"]; "all" -> every algorithm. PPO is always in the table (the demo trains it)."""
    names = list(ALGOS) if text.strip() == "all" else [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ALGOS]
    if unknown:
        from rlhfkit.errors import ConfigError

        raise ConfigError(f"--algos: unknown {', '.join(unknown)}; choose from {', '.join(ALGOS)} or all")
    return ["ppo", *[a for a in dict.fromkeys(names) if a != "ppo"]]


def rl_config(ppo_section: dict, out: Path, algo: str) -> dict:
    """The `rlhfkit ppo` config of one RL algorithm: the demo's PPO section with another estimator and no critic.

    The estimator's entry (registry/estimators.py) decides what changes. One that compares a prompt's samples
    (GRPO, RLOO) takes GROUP responses for each of batch_size / GROUP prompts (PPO's samples per iteration), any
    other one response for each of as many prompts. One that puts the KL in the loss (GRPO, RLOO: their papers'
    form) holds the policy near SFT with a k3 KL loss of the coefficient PPO puts in its reward; any other
    (REINFORCE++) keeps PPO's KL in the reward."""
    section = json.loads(json.dumps(ppo_section))  # a deep copy
    ppo, train = section["ppo"], section["train"]
    estimator = ESTIMATORS[RL_ESTIMATORS[algo]]
    ppo["advantage_estimator"] = estimator.name
    samples = train["batch_size"] * ppo.get("n_samples_per_prompt", 1)  # PPO's samples per iteration: the budget
    if estimator.groups:
        if samples % GROUP:
            from rlhfkit.errors import ConfigError

            raise ConfigError(f"{algo}: PPO's {samples} samples per iteration (train.batch_size x "
                              f"ppo.n_samples_per_prompt) do not split into groups of {GROUP}; the arena gives every "
                              f"algorithm PPO's budget: use a multiple of {GROUP}")
        ppo["n_samples_per_prompt"] = GROUP
        train["batch_size"] = samples // GROUP
    else:  # one sample per prompt, as many prompts as PPO has samples
        ppo["n_samples_per_prompt"] = 1
        train["batch_size"] = samples
    if estimator.kl_in == "loss":
        ppo.update(kl_loss_coef=ppo.get("kl_coef", 0.0), kl_coef=0.0)
    train.update(save_every=0, eval_every=0)
    train.pop("keep_checkpoints", None)
    section.update(actor=str(final_dir(out / "sft")), reward=str(final_dir(out / "rm")),
                   output_dir=str(out / "arena" / algo))
    return section


def dpo_config(shared: dict, out: Path, size: dict) -> dict:
    """The `rlhfkit dpo` config: DPO (sigmoid, beta 0.1) from SFT on the RM's own noisy training pairs, for
    size["dpo_epochs"] passes at the RM's batch size and lr 5e-5.

    Measured on seed 0: two epochs at lr 2e-4 over-optimise, the log-prob of chosen and rejected
    responses alike falls (-9 -> -17 nats) and the policy drifts to KL 14 with gold -0.30 (SFT 0.33); RPO's NLL
    term (dpo.rpo_alpha=1) holds it (gold 0.94, KL 0.43), and so does the usual DPO recipe used here, one epoch
    at a small learning rate (gold 0.97, KL 0.64)."""
    from rlhfkit.config.fields import deep_merge

    return deep_merge(json.loads(json.dumps(shared)), {
        "model": str(final_dir(out / "sft")), "output_dir": str(out / "arena" / "dpo"),
        "data": {"train": str(out / "data" / "pairs.jsonl"), "max_length": 64, "eval_fraction": 0.02},
        "train": {"epochs": size["dpo_epochs"], "max_steps": -1, "batch_size": 32, "micro_batch_size": 32,
                  "lr": 5.0e-5, "warmup_steps": 10, "log_every": 1, "save_every": 0, "eval_every": 50},
        "dpo": {"loss": "sigmoid", "beta": 0.1}})


def arena_configs(demo, merged: dict) -> dict:
    """{algo: (runner, typed config)} of every arena algorithm but PPO (the demo's own run), from the demo's
    pipeline config with the user's overrides (`merged`): its shared keys, then its PPO section."""
    from rlhfkit.config.dpo_schema import DPOConfig
    from rlhfkit.config.fields import deep_merge, from_dict
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.stages.dpo import run_dpo
    from rlhfkit.stages.ppo import run_ppo

    shared = {key: merged[key] for key in ("train", "load", "lora", "engine", "log") if key in merged}
    ppo_section = deep_merge(json.loads(json.dumps(shared)), merged["ppo"])
    configs = {}
    for algo in demo.algos:
        if algo == "dpo":
            configs[algo] = (run_dpo, from_dict(DPOConfig, dpo_config(shared, demo.out, demo.size), prefix="dpo."))
        elif algo != "ppo":
            configs[algo] = (run_ppo, from_dict(PPOConfig, rl_config(ppo_section, demo.out, algo), prefix=f"{algo}."))
    return configs


def check_arena(demo, merged: dict) -> None:
    """Build every arena config now: a bad override fails before the demo trains anything."""
    arena_configs(demo, merged)


def train(demo, algo: str, configs: dict) -> dict:
    """Train `algo` into OUT/arena/ALGO (reused when complete); {"folder", "seconds", "used", "reused"}."""
    from rlhfkit.stages.pipeline import step_log

    out = demo.out
    if algo == "ppo":  # the demo's own PPO run
        result = json.loads((out / "ppo" / RESULT_FILE).read_text())
        cfg = yaml.safe_load((out / "ppo" / CONFIG_FILE).read_text())
        samples = result["iterations"] * cfg["train"]["batch_size"] * cfg["ppo"]["n_samples_per_prompt"]
        return {"folder": final_dir(out / "ppo"), "seconds": result.get("seconds"), "used": f"{samples} samples",
                "reused": True}
    runner, cfg = configs[algo]
    folder = out / "arena" / algo
    reused = final_dir(folder).is_dir() and (folder / TIMING_FILE).is_file()
    if not reused:
        print(f"demo: arena: training {algo} into {folder}", file=sys.stderr)
        tick = time.perf_counter()
        with step_log(folder):
            result = runner(cfg, resume=False, force=True)
        timing = {"seconds": round(time.perf_counter() - tick, 1), "result": result}
        (folder / TIMING_FILE).write_text(json.dumps(timing, indent=2, default=str), encoding="utf-8")
    timing = json.loads((folder / TIMING_FILE).read_text())
    result = timing["result"]
    if algo == "dpo":
        used = f"{result['steps'] * cfg.train.batch_size} pairs"
    else:
        used = f"{result['iterations'] * cfg.train.batch_size * cfg.ppo.n_samples_per_prompt} samples"
    return {"folder": final_dir(folder), "seconds": timing["seconds"], "used": used, "reused": reused}


def run_arena(demo, world: W.World, merged: dict) -> dict:
    """Train every algorithm of demo.algos, sample each on the test prompts, and compare them with SFT."""
    from rlhfkit.demo.evaluate import gold_of_policy, mean_stderr
    from rlhfkit.demo.sampling import load_policy

    configs = arena_configs(demo, merged)
    trained = {algo: train(demo, algo, configs) for algo in demo.algos}
    prompts = world.heldout_prompts * demo.size["eval_samples"]
    reference, tokenizer = load_policy(final_dir(demo.out / "sft"))
    sft = gold_of_policy(reference, tokenizer, prompts, demo.gen, W.gold_reward, demo.seed + 2)
    sft_gold = mean_stderr(sft.gold)
    results = {}
    for algo, info in trained.items():
        model, _ = load_policy(info["folder"])
        ev = gold_of_policy(model, tokenizer, prompts, demo.gen, W.gold_reward, demo.seed + 2, reference)
        gold, kl = mean_stderr(ev.gold), mean_stderr(ev.kl)
        se = math.sqrt(gold["stderr"] ** 2 + sft_gold["stderr"] ** 2)
        gain = gold["mean"] - sft_gold["mean"]
        results[algo] = {"gold": gold, "gain": gain, "gain_se": gain_in_se(gain, se),
                         "kl": kl["mean"], "exploit": W.flaw_rates(prompts, ev.texts)["exploit"],
                         "seconds": info["seconds"], "used": info["used"], "folder": str(info["folder"])}
        print(f"demo: arena: {algo}: gold {gold['mean']:.3f} ± {gold['stderr']:.3f}, gain {gain:+.3f} "
              f"({results[algo]['gain_se']:.1f} se), KL {kl['mean']:.2f}", file=sys.stderr)
    return {"sft": sft_gold, "algos": results, "samples": len(prompts), "best": W.BEST_GOLD}


def gain_in_se(gain: float, se: float) -> float:
    """The gain in standard errors; with no spread on either side (se 0) there is no standard error to count it
    in: +-inf, or 0 for no gain, and `arena_rows` passes neither."""
    if se > 0:
        return gain / se
    return math.copysign(math.inf, gain) if gain else 0.0


def arena_rows(arena: dict) -> list[dict]:
    """The bar of each algorithm (gain >= GAIN_TARGET standard errors) in the summary's row format."""
    rows = []
    for algo, r in arena["algos"].items():
        rows.append({"name": f"arena: {algo} gold gain over SFT, in standard errors", "value": r["gain_se"],
                     "target": f">= {GAIN_TARGET:g}",
                     "passed": math.isfinite(r["gain_se"]) and r["gain_se"] >= GAIN_TARGET})
    return rows


def arena_table(arena: dict) -> str:
    """The comparison as a fixed-width text table, one line per algorithm, SFT first."""
    head = f"{'policy':<14}{'gold ± stderr':>18}{'gain (se)':>11}{'KL':>8}{'exploit':>9}{'seconds':>9}  trained on"
    sft = arena["sft"]
    lines = [head, f"{'sft':<14}{sft['mean']:>10.3f} ± {sft['stderr']:.3f}{'':>11}{0.0:>8.2f}{'':>9}{'':>9}  -"]
    for algo, r in arena["algos"].items():
        seconds = f"{r['seconds']:.0f}" if r["seconds"] is not None else "?"
        lines.append(f"{algo:<14}{r['gold']['mean']:>10.3f} ± {r['gold']['stderr']:.3f}{r['gain_se']:>11.1f}"
                     f"{r['kl']:>8.2f}{r['exploit']:>9.2f}{seconds:>9}  {r['used']}")
    return "\n".join(lines)
