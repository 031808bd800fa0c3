"""Step 2: the reward model. Read top to bottom: load, then the loop, then the reward statistics and export.

The model is the backbone with a fresh one-output head (`AutoModelForSequenceClassification`, num_labels=1),
so plain transformers loads the result. It is trained with the Bradley-Terry loss -log sigmoid(r_c - r_r)
(Ouyang et al. 2022, eq. 1), chosen and rejected sides in one forward pass, each score read at the last real
token of its sequence (`sequence_scores`: correct for left and right padding and for pad == EOS).
"""

from __future__ import annotations

import operator
import random
import time

import torch

from rlhfkit.algos import pairwise_loss
from rlhfkit.config.schema import RMConfig
from rlhfkit.data.loader import skipped_rows
from rlhfkit.data.tokenize import micro_batches
from rlhfkit.metric_names import EVAL_ACCURACY, EVAL_PREFIX, TIME_STEP
from rlhfkit.models import load_scalar_model
from rlhfkit.models.stage_forward import pair_scores
from rlhfkit.models.loading import TEMPLATE_KEY
from rlhfkit.lora import apply_lora, base_model
from rlhfkit.run_files import final_dir
from rlhfkit.stages.advice import lora_rate_note
from rlhfkit.stages.common import MetricsLogger, plan_steps, set_seed, write_run_report
from rlhfkit.stages.run_dir import prepare_output_dir, resumed_from
from rlhfkit.stages.guard import resume_state
from rlhfkit.stages.loop import TrainLoop
from rlhfkit.stages.start import start_stage
from rlhfkit.speed.registry import Probe, Target, plan_line, plan_model

# Keys written into final/config.json next to the weights; PPO and `rlhfkit score` read them back.
MEAN_KEY, STD_KEY = "rlhfkit_reward_mean", "rlhfkit_reward_std"
MAX_LENGTH_KEY = "rlhfkit_max_length"
END_IDS_KEY = "rlhfkit_end_ids"  # the ids the training responses ended with (data/templates.py: end_token_ids)


SUM_KEYS = ("loss", "accuracy", "chosen", "rejected", "margin")


def pair_sums(chosen: torch.Tensor, rejected: torch.Tensor, margin: float | None) -> dict:
    """Per-batch sums (not means), so micro-batches and ranks add up before one division; "accuracy" sums the
    pairs with r_c > r_r (a tie counts as wrong)."""
    gap = (chosen - rejected).detach()
    return {"loss": pairwise_loss(chosen, rejected, margin).item() * len(chosen), "accuracy": (gap > 0).sum().item(),
            "chosen": chosen.detach().sum().item(), "rejected": rejected.detach().sum().item(),
            "margin": gap.sum().item()}


def pair_means(sums: dict, n_pairs: int, engine, prefix: str = "") -> dict:
    """Sums from `pair_sums`, added over ranks, divided by the pairs: mean loss, accuracy, scores and margin."""
    return {prefix + key: engine.reduce_sum(value) / max(1, n_pairs) for key, value in sums.items()}


@torch.no_grad()
def evaluate_rm(model, rows: list, pad_id: int, micro: int, device, engine, margin: float | None, plan) -> dict:
    """Held-out eval/loss, eval/accuracy, eval/chosen, eval/rejected (mean scores) and eval/margin (r_c - r_r)."""
    model.eval()
    sums = dict.fromkeys(SUM_KEYS, 0.0)
    for i in range(0, len(rows), micro):
        for key, value in pair_sums(*pair_scores(model, rows[i:i + micro], pad_id, device, plan), margin).items():
            sums[key] += value
    model.train()
    return pair_means(sums, engine.reduce_sum(len(rows)), engine, prefix=EVAL_PREFIX)


@torch.no_grad()
def reward_stats(model, rows: list, pad_id: int, micro: int, device, n_samples: int, seed: int, plan) -> dict:
    """Mean and std of the reward over up to `n_samples` training responses, chosen and rejected alike.

    PPO may normalise rewards with them (as OpenRLHF does with its RM's saved mean/std), so that the KL
    coefficient means the same thing whatever scale this reward model happened to learn.
    """
    pairs = random.Random(seed).sample(rows, min(len(rows), (n_samples + 1) // 2))
    model.eval()
    scores = []
    for i in range(0, len(pairs), micro):
        scores.extend(torch.cat(pair_scores(model, pairs[i:i + micro], pad_id, device, plan)).tolist())
    model.train()
    scores = torch.tensor(scores[:n_samples], dtype=torch.float64)
    std = scores.std().item() if len(scores) > 1 else 0.0
    return {MEAN_KEY: scores.mean().item(), STD_KEY: std, "rlhfkit_reward_samples": len(scores)}


def describe(info: dict) -> str:
    """The data summary a user sees first: pairs kept, and every pair dropped or skipped, with why."""
    skipped = skipped_rows(info)
    return (f"rm: {info['train_rows']} train / {info['eval_rows']} eval pairs, template {info['template']}, "
            f"{info['truncated']} truncated, {info['dropped']} dropped (prompt over data.max_length, or both "
            f"sides equal once truncated){'; skipped ' + skipped if skipped else ''}")


def train_step(rm, rows: list, accum: int, micro_size: int, batch_size: int, pad_id: int, margin, engine, plan,
               balance: bool = True) -> dict:
    """One optimizer step over `rows` (this rank's share of `batch_size` pairs) in `accum` micro-batches
    (`balance`: arranged by length, `data.tokenize.micro_batches`), packed where the model's plan says so."""
    packed = plan.packing
    sums = dict.fromkeys(SUM_KEYS, 0.0)
    rows = rows[:accum * micro_size]
    lengths = [(operator.add if packed else max)(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows]
    for micro in micro_batches(rows, micro_size, lengths if balance else None, packed):
        chosen, rejected = pair_scores(rm.module, micro, pad_id, engine.device, plan, packed)
        # the micro-batch's summed loss over the pairs of the whole batch: micro 1 x accum 4 == micro 4 x accum 1
        rm.backward(pairwise_loss(chosen, rejected, margin) * len(micro), batch_size)
        for key, value in pair_sums(chosen, rejected, margin).items():
            sums[key] += value
    lr = rm.lr
    return {**pair_means(sums, batch_size, engine), "lr": lr, **rm.step()}


def run_rm(cfg: RMConfig, resume: bool = False, force: bool = False) -> dict:
    # 1. engine, tokenizer and pairs first: bad input fails here, before any folder is written
    setup = start_stage(cfg, cfg.model, "rm", resume=resume, force=force)
    cfg, engine, tokenizer, data = setup.cfg, setup.engine, setup.tokenizer, setup.data
    set_seed(cfg.train.seed)  # the fresh score head is drawn from the torch RNG: same seed, same head
    model = load_scalar_model(cfg.model, cfg.load, tokenizer)
    model = apply_lora(model, cfg.lora, task="scalar")
    _, accum, total = plan_steps(len(data.train), cfg.train, engine.world_size)
    out = prepare_output_dir(cfg, resume, force, engine.is_main)

    # 2. the optimizer (and the state of a resumed run)
    # gradients kept allocated between steps on a CPU only (see stages/sft.py)
    keep = engine.device.type == "cpu"
    rm = engine.prepare(model, cfg.train, total, role="reward_model", keep_grads=keep)
    resumed = resume_state(engine, out, {"model": rm}, total, "rm") if resume else {}
    start = resumed_from(cfg, out, resumed["step"], engine.is_main) if resume else 0
    pad_id, device, micro_size = tokenizer.pad_token_id, engine.device, cfg.train.micro_batch_size
    margin = cfg.rm.margin or None
    # the fast paths this model takes, decided once (speed/registry.py), and the CPU kernels installed
    plan = plan_model(Target(rm.module, "reward_model", "rm", cfg, engine, keep_grads=keep,
                             probe=Probe(data.train[:max(micro_size, 2)], pad_id)))
    evaluate = (lambda: evaluate_rm(rm.module, data.eval, pad_id, micro_size, device, engine, margin, plan)) \
        if data.eval else None

    with MetricsLogger(out, "rm", total, cfg.log, engine.is_main, initial=start) as log:
        log.write(plan_line({"reward_model": plan}))
        log.write(f"{describe(data.info)}; {total} steps of {cfg.train.batch_size} pairs (accumulation {accum})")
        if note := lora_rate_note(cfg.lora.rank, cfg.train.lr):
            log.write(note)
        if start == 0 and evaluate:  # the untrained head's accuracy (~0.5): curves show what training changed
            log.log(0, evaluate())

        # 3. the loop: each step sees batch_size pairs over all ranks, in micro-batches
        with TrainLoop(engine, out, "rm", total, cfg.train, log, {"model": rm}, evaluate=evaluate,
                       resumed=resumed, show=("loss", "accuracy", EVAL_ACCURACY)) as loop:
            for step, epoch, rows in loop.steps(data.train, start):
                tick = time.perf_counter()
                metrics = train_step(rm, rows, accum, micro_size, cfg.train.batch_size, pad_id, margin, engine, plan,
                                     cfg.train.balance_micro_batches)
                loop.end_step(step + 1, {**metrics, "epoch": epoch, TIME_STEP: time.perf_counter() - tick})

        # 4. reward statistics and how inputs were rendered, stored in config.json for PPO and `rlhfkit score`
        final_eval = loop.last_eval
        if not final_eval and evaluate:  # resumed from a run that had already finished its steps
            final_eval = evaluate()
        config = base_model(rm.module).config
        extra = {TEMPLATE_KEY: data.info["template"], END_IDS_KEY: setup.end_ids, MAX_LENGTH_KEY: cfg.data.max_length}
        if cfg.rm.norm_samples > 0:
            extra.update(reward_stats(rm.module, data.train, pad_id, micro_size, device, cfg.rm.norm_samples,
                                      cfg.train.seed, plan))
            log.write(f"rm: reward over {extra['rlhfkit_reward_samples']} training responses: mean "
                      f"{extra[MEAN_KEY]:.4f}, std {extra[STD_KEY]:.4f}")
    for key, value in extra.items():
        setattr(config, key, value)
    config.pad_token_id = tokenizer.pad_token_id  # plain transformers pools by it (batch size > 1 needs it)

    # 5. export a plain transformers folder (LoRA merged, score head included, ZeRO-3 gathered)
    engine.export_hf(rm.module, tokenizer, final_dir(out))
    write_run_report(out, cfg.log, engine.is_main)
    return {"output_dir": str(out), "steps": total, **final_eval, **extra, **data.info}
