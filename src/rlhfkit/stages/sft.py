"""Step 1: supervised fine-tuning. Read top to bottom: load, then the loop, then export."""

from __future__ import annotations

import functools
import math
import time

import torch

from rlhfkit.config.schema import SFTConfig
from rlhfkit.data.loader import skipped_rows
from rlhfkit.data.tokenize import collate_packed, collate_sft, micro_batches
from rlhfkit.metric_names import EVAL_LOSS, EVAL_PERPLEXITY, TIME_STEP
from rlhfkit.models import load_causal_lm
from rlhfkit.models.segments import packed_row_tokens
from rlhfkit.models.stage_forward import lm_forward
from rlhfkit.models.loading import record_template
from rlhfkit.lora import apply_lora
from rlhfkit.run_files import final_dir
from rlhfkit.stages.advice import lora_rate_note
from rlhfkit.stages.common import MetricsLogger, plan_steps, write_run_report
from rlhfkit.stages.run_dir import prepare_output_dir, resumed_from
from rlhfkit.stages.guard import resume_state
from rlhfkit.stages.loop import TrainLoop
from rlhfkit.stages.start import start_stage
from rlhfkit.speed.registry import Probe, Target, plan_line, plan_model


def probe_rows(rows: list, n: int = 2, tokens: int = 256) -> list[dict]:
    """The rows the speed plan's packing check runs on: the last `tokens` tokens (where the labelled response is) of
    the first `n` rows, so that the check's full logits stay small whatever the data's length."""
    return [{k: v[-tokens:] if isinstance(v, list) else v for k, v in row.items()} for row in rows[:n]]


@torch.no_grad()
def evaluate_lm(model, rows: list, pad_id: int, micro: int, device, plan) -> dict:
    """Token-weighted eval loss. Every rank evaluates all rows: ZeRO-3 needs the same forwards on all ranks."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), micro):
        nll, n = lm_forward(model, collate_sft(rows[i:i + micro], pad_id), device, plan)
        total, count = total + nll.item(), count + n
    model.train()
    loss = total / max(count, 1)
    return {EVAL_LOSS: loss, EVAL_PERPLEXITY: math.exp(min(loss, 50.0))}


def count_labels(rows: list) -> int:
    """Tokens that the loss covers (labels != -100 after the shift)."""
    return sum(sum(1 for t in r["labels"][1:] if t != -100) for r in rows)


def train_step(actor, rows: list, accum: int, micro: int, pad_id: int, engine, plan, collate=collate_sft,
               balance: bool = True) -> dict:
    """One optimizer step over `rows` (this rank's share of the batch) in `accum` micro-batches (`balance`:
    arranged by length, `data.tokenize.micro_batches`), on the paths of the model's speed plan."""
    # normalise by the tokens of the whole batch over all ranks, so micro 1 x accum 4 == micro 4 x accum 1
    n_tokens = engine.total(count_labels(rows))
    loss_sum = 0.0
    lengths = [len(r["input_ids"]) for r in rows[:accum * micro]] if balance else None
    for part in micro_batches(rows[:accum * micro], micro, lengths, packed=collate is not collate_sft):
        nll, _ = lm_forward(actor.module, collate(part, pad_id), engine.device, plan)
        actor.backward(nll, n_tokens)
        loss_sum += nll.item()
    lr = actor.lr
    return {"loss": engine.reduce_sum(loss_sum) / n_tokens, "lr": lr, **actor.step()}


def run_sft(cfg: SFTConfig, resume: bool = False, force: bool = False) -> dict:
    # 1. engine, tokenizer and data first: bad input fails here, before any folder is written
    setup = start_stage(cfg, cfg.model, "sft", resume=resume, force=force)
    cfg, engine, tokenizer, data = setup.cfg, setup.engine, setup.tokenizer, setup.data
    model = load_causal_lm(cfg.model, cfg.load, tokenizer)
    model = apply_lora(model, cfg.lora)
    _, accum, total = plan_steps(len(data.train), cfg.train, engine.world_size)
    out = prepare_output_dir(cfg, resume, force, engine.is_main)

    # 2. the optimizer (and the state of a resumed run)
    # on a CPU the gradients stay allocated between steps (memory a step gets afresh costs page faults there); on a
    # GPU they are freed, so the forward's activation peak does not hold them too
    keep = engine.device.type == "cpu"
    actor = engine.prepare(model, cfg.train, total, keep_grads=keep)
    resumed = resume_state(engine, out, {"model": actor}, total, "sft") if resume else {}
    start = resumed_from(cfg, out, resumed["step"], engine.is_main) if resume else 0
    pad_id, device, micro = tokenizer.pad_token_id, engine.device, cfg.train.micro_batch_size
    # the fast paths this model takes, decided once (speed/registry.py), and the CPU kernels installed
    plan = plan_model(Target(actor.module, "policy", "sft", cfg, engine, keep_grads=keep,
                             probe=Probe(probe_rows(data.train), pad_id)))
    collate = functools.partial(collate_packed, capacity=packed_row_tokens(actor.module, plan)) if plan.packing \
        else collate_sft
    evaluate = (lambda: evaluate_lm(actor.module, data.eval, pad_id, micro, device, plan)) if data.eval else None

    # 3. the loop: each step sees batch_size rows over all ranks, in micro-batches
    with MetricsLogger(out, "sft", total, cfg.log, engine.is_main, initial=start) as log:
        log.write(plan_line({"policy": plan}))
        skipped = skipped_rows(data.info)
        log.write(f"sft: {data.info['train_rows']} train / {data.info['eval_rows']} eval rows, template "
                  f"{data.info['template']}, {data.info['truncated']} truncated, {data.info['dropped']} dropped"
                  f"{'; skipped ' + skipped if skipped else ''}; {total} steps of {cfg.train.batch_size} "
                  f"(accumulation {accum})")
        if note := lora_rate_note(cfg.lora.rank, cfg.train.lr):
            log.write(note)
        if start == 0 and evaluate:  # the starting point, so curves show what training changed
            log.log(0, evaluate())
        with TrainLoop(engine, out, "sft", total, cfg.train, log, {"model": actor}, evaluate=evaluate,
                       resumed=resumed, show=("loss", EVAL_LOSS, "lr")) as loop:
            for step, epoch, rows in loop.steps(data.train, start):
                tick = time.perf_counter()
                metrics = train_step(actor, rows, accum, micro, pad_id, engine, plan, collate,
                                     cfg.train.balance_micro_batches)
                loop.end_step(step + 1, {**metrics, TIME_STEP: time.perf_counter() - tick, "epoch": epoch})

    # 4. export a plain transformers folder (LoRA merged, ZeRO-3 gathered)
    record_template(actor.module, data.info["template"])  # PPO and `rlhfkit chat` render as trained
    engine.export_hf(actor.module, tokenizer, final_dir(out))
    write_run_report(out, cfg.log, engine.is_main)
    return {"output_dir": str(out), "steps": total, **data.info}
