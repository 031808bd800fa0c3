"""Step 3: PPO (InstructGPT, Ouyang et al. 2022; Ziegler et al. 2019). Read top to bottom: load, the loop, export.

Each iteration: 1 generate responses to a batch of prompts (recording the actor's old log-probs), 2 score them
with the frozen reward, 3 take the reference's log-probs and critic's values, 4 shape per-token rewards
(score - beta * KL) and GAE advantages, 5 optimise actor (clipped surrogate, + PPO-ptx) and critic (clipped
value loss).
"""

from __future__ import annotations

import json
import time

import torch

from rlhfkit.algos import AdaptiveKLController, FixedKLController
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.data.loader import load_stage_data, skipped_rows
from rlhfkit.engine import make_engine
from rlhfkit.models import load_tokenizer
from rlhfkit.models.ema import EMA
from rlhfkit.rollout.evaluate import evaluate_policy, generate_all
from rlhfkit.rollout.experience import (add_advantages, add_model_outputs, add_rewards, adjust_scores,
                                        ended_with_eos, sort_by_length)
from rlhfkit.rollout.generate import eos_token_ids
from rlhfkit.stages.common import MetricsLogger, batches, prepare_output_dir, set_seed
from rlhfkit.stages.guard import RunGuard, resume_state
from rlhfkit.stages.ppo_setup import load_ppo_models
from rlhfkit.stages.ppo_timing import PhaseTimer
from rlhfkit.stages.ppo_update import PtxText, critic_update_with_values, ppo_update, single_step

SHOW = ("reward/mean", "kl", "eval/reward")


def kl_controller(cfg: PPOConfig):
    if cfg.ppo.adaptive_kl:
        return AdaptiveKLController(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
    return FixedKLController(cfg.ppo.kl_coef)


def write_samples(out, log, iteration: int, rollout, scores: torch.Tensor, n: int) -> None:
    """A few (prompt, response, score) triples to samples.jsonl and one line above the bar."""
    if not log.enabled or n <= 0:
        return
    with open(out / "samples.jsonl", "a", encoding="utf-8") as f:
        for i in range(min(n, rollout.size)):
            f.write(json.dumps({"step": iteration, "prompt": rollout.prompt_texts[i],
                                "response": rollout.response_texts[i], "score": float(scores[i])}) + "\n")
    prompt = rollout.prompt_texts[0].replace("\n", " ")[-60:]
    log.write(f"[{iteration}] {prompt!r} -> {rollout.response_texts[0][:120]!r} (score {float(scores[0]):.3g})")


def rollout_metrics(rollout, raw_scores, scores, finished, kl_coef: float) -> dict:
    """What the rollout looked like: reward (as returned), score (after normalisation/penalty), lengths."""
    return {"reward/mean": raw_scores.mean().item(),
            "reward/std": raw_scores.std().item() if rollout.size > 1 else 0.0,
            "score/mean": scores.mean().item(), "kl_coef": kl_coef,
            "response_length": rollout.response_lengths.mean().item(),
            "response/finished": finished.float().mean().item()}


def export_models(engine, actor, critic, ema, tokenizer, out) -> None:
    """Plain transformers folders (LoRA merged); final/ last, since its presence marks a finished run."""
    if ema is not None:
        with ema.swapped_in(actor.module):
            engine.export_hf(actor.module, tokenizer, out / "final-ema", in_place=False)
    # the critic reads the actor's token ids, so the actor's tokenizer goes with it
    engine.export_hf(critic.module, tokenizer, out / "final-critic")
    engine.export_hf(actor.module, tokenizer, out / "final")


def restore(engine, out, actor, critic, kl_ctl, ema) -> int:
    """Models, optimizers, schedules, RNG, KL coefficient and EMA from checkpoints/latest; returns the step."""
    state = resume_state(engine, out, {"actor": actor, "critic": critic})
    kl_ctl.load_state_dict(state["kl_ctl"])
    if ema is not None and state.get("ema") is not None:
        ema.load_state_dict(state["ema"])
    return state["step"]


def run_ppo(cfg: PPOConfig, resume: bool = False, force: bool = False) -> dict:
    engine = make_engine(cfg.engine)
    set_seed(cfg.train.seed)
    seed, micro, iters = cfg.train.seed, cfg.train.micro_batch_size, cfg.train.max_steps

    # 0. tokenizer and data first (bad input fails before the models load), then the four models
    tokenizer = load_tokenizer(cfg.actor, cfg.load, padding_side="left")
    data = load_stage_data("prompts", cfg.data.as_prompt_data(), tokenizer, seed)
    ptx = PtxText(cfg.data.ptx, tokenizer, cfg.ptx.max_length, seed) if cfg.ptx.coef > 0 else None
    per_rank = cfg.train.batch_size // engine.world_size
    updates = cfg.ppo.epochs * (cfg.train.batch_size // (cfg.ppo.mini_batch_size or cfg.train.batch_size))
    models = load_ppo_models(cfg, tokenizer, engine, iters * updates)
    actor, critic, reference, reward = models.actor, models.critic, models.reference, models.reward
    out = prepare_output_dir(cfg, resume, force, engine.is_main)
    kl_ctl = kl_controller(cfg)
    ema = EMA(actor.module, cfg.ema.beta) if cfg.ema.enabled else None
    start = restore(engine, out, actor, critic, kl_ctl, ema) if resume else 0

    log = MetricsLogger(out, "ppo", iters, cfg.log, engine.is_main, initial=start)
    skipped = skipped_rows(data.info)
    log.write(f"ppo: {data.info['train_rows']} prompts / {data.info['eval_rows']} eval, template "
              f"{data.info['template']}{' (skipped ' + skipped + ')' if skipped else ''}; {iters} iterations of "
              f"{cfg.train.batch_size} prompts, {updates} updates each; " + "; ".join(models.notes))
    eos_ids, pad_id = eos_token_ids(tokenizer, actor.module), tokenizer.pad_token_id

    def evaluate() -> dict:
        metrics, _ = evaluate_policy(actor.module, reference, reward, tokenizer, data.eval, cfg.gen, engine, micro,
                                     seed, eos_ids)
        return metrics

    first_eval = evaluate() if data.eval and start == 0 else {}
    if first_eval:  # the starting point, so the curves show what PPO changed
        log.log(0, first_eval, show=SHOW)
    last_eval = dict(first_eval)

    guard = RunGuard(engine, out, "ppo")

    def checkpoint_state() -> dict:
        return {"kl_ctl": kl_ctl.state_dict(), "ema": ema.state_dict() if ema else None}

    try:
        for it, epoch, idx in batches(len(data.train), cfg.train.batch_size, seed, start):
            if it >= iters:
                break
            tick, timer = time.perf_counter(), PhaseTimer(engine.device)
            rows = [data.train[i] for i in idx[engine.rank * per_rank:(engine.rank + 1) * per_rank]]

            # 1. generate: sample one response per prompt (KV cache, left padding, stop at EOS), keeping the
            #    sampled tokens' log-probs: they are the old log-probs, so the actor needs no extra forward
            with timer("generate"):
                rollout = generate_all(actor.module, engine, tokenizer, rows, cfg.gen)
            rollout = sort_by_length(rollout)  # neighbours of similar length: each micro-batch trims its padding

            # 2. score: the frozen reward model / function on prompt + response
            finished = ended_with_eos(rollout, eos_ids)
            with timer("reward"), engine.on_device(getattr(reward, "model", None)):
                raw_scores = reward(rollout, finished).float().to(engine.device)
            scores = adjust_scores(raw_scores, finished, cfg.ppo, reward.stats)

            # 3. reference log-probs and values (critic): one no-grad forward each (old log-probs: from step 1);
            #    with one optimizer step per rollout the critic's update computes the values itself (step 4)
            one_step = single_step(cfg)
            with engine.on_device(reference):
                rollout = add_model_outputs(rollout.to(engine.device), actor.module,
                                            None if one_step else critic.module, reference, cfg.gen.temperature,
                                            micro, old_from_sampling=True, timer=timer)

            # 4. per-token rewards (score on the last valid token, -beta * KL everywhere) and GAE advantages
            lrs = {"lr": actor.lr, "critic_lr": critic.lr}
            if one_step:  # values, advantages and the critic's step from one critic forward (same weights)
                rollout = add_rewards(rollout, scores, kl_ctl.value, cfg.ppo)
                rollout, advantage_metrics, critic_metrics = critic_update_with_values(rollout, critic, cfg, engine,
                                                                                       timer)
            else:
                rollout, advantage_metrics = add_advantages(rollout, scores, kl_ctl.value, cfg.ppo)
                critic_metrics = {}

            # 5. optimise: PPO epochs x mini-batches; the actor waits while the critic warms up
            update_actor = it >= cfg.ppo.critic_warmup_iters
            train_metrics = ppo_update(rollout, actor, critic, cfg, engine, it, update_actor, ptx, ema, pad_id,
                                       timer, update_critic=not one_step)
            train_metrics.update(critic_metrics)
            skipped = train_metrics.get("skipped_actor_steps", 0.0) + train_metrics.get("skipped_critic_steps", 0.0)
            guard.check_step(it + 1, {"skipped": skipped > 0}, log)

            done = it + 1
            metrics = {**rollout_metrics(rollout, raw_scores, scores, finished, kl_ctl.value), **advantage_metrics}
            metrics = {**engine.reduce_mean(metrics), **train_metrics, **lrs, "epoch": epoch,
                       **timer.metrics(), "time/iteration": time.perf_counter() - tick}
            # Ziegler et al. 2019: the coefficient follows the measured KL per sequence, batch_size samples at a time
            kl_ctl.update(metrics["kl"], cfg.train.batch_size)
            if cfg.ppo.sample_every > 0 and (done % cfg.ppo.sample_every == 0 or done == 1):
                write_samples(out, log, done, rollout, raw_scores, cfg.ppo.num_samples)
            if data.eval and ((cfg.train.eval_every > 0 and done % cfg.train.eval_every == 0) or done == iters):
                last_eval = evaluate()
                metrics.update(last_eval)
            if done % cfg.train.log_every == 0 or done == iters or "eval/reward" in metrics:
                log.log(done, metrics, show=SHOW)
            log.advance()
            if cfg.train.save_every > 0 and done % cfg.train.save_every == 0 and done < iters:
                guard.save(done, {"actor": actor, "critic": critic}, checkpoint_state(), cfg.train.keep_checkpoints)
            if guard.stop_requested() and done < iters:
                guard.stop(done, {"actor": actor, "critic": critic}, checkpoint_state(), cfg.train.keep_checkpoints)
    finally:
        guard.close()
        log.close()

    export_models(engine, actor, critic, ema, tokenizer, out)
    result = {"output_dir": str(out), "iterations": iters, **data.info}
    if first_eval:
        result["eval/reward_start"] = first_eval["eval/reward"]
    if last_eval:
        result.update({"eval/reward_end": last_eval["eval/reward"], "eval/kl_end": last_eval["eval/kl"]})
    return result
