"""Step 3: PPO (InstructGPT, Ouyang et al. 2022; Ziegler et al. 2019). Read top to bottom: load, the loop, export.

Each iteration runs the four steps of `ppo_steps.PPOSteps`: 1 generate responses to a batch of prompts, 2 score
them with the frozen reward, 3 make experience (reference log-probs, values, KL-shaped rewards, advantages),
4 optimise actor (clipped surrogate, + PPO-ptx) and critic (clipped value loss).
"""

from __future__ import annotations

import time

from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.data.loader import skipped_rows
from rlhfkit.errors import ConfigError
from rlhfkit.metric_names import EVAL_GOLD, EVAL_KL, EVAL_REWARD, KL, REWARD_MEAN, TIME_ITERATION
from rlhfkit.envs.load import load_environment
from rlhfkit.models.loading import causal_lm_config, record_template
from rlhfkit.rollout.episodes import check_opening
from rlhfkit.rollout.vllm_server import check_server
from rlhfkit.stages.advice import kl_note, lora_rate_note, pace_line
from rlhfkit.stages.best import BestKeeper
from rlhfkit.stages.common import MetricsLogger, write_run_report
from rlhfkit.stages.run_dir import prepare_output_dir, resumed_from, undone_if_bad_input_at_start
from rlhfkit.stages.loop import TrainLoop
from rlhfkit.stages.ppo_setup import load_ppo_models
from rlhfkit.stages.ppo_steps import PPOSteps, check_ranks, updates_per_iteration
from rlhfkit.stages.ppo_timing import PhaseTimer
from rlhfkit.stages.ppo_update import PtxText, samples_per_iteration
from rlhfkit.stages.start import start_stage

SHOW = (REWARD_MEAN, KL, EVAL_REWARD)


def describe(cfg: PPOConfig, info: dict, notes: list[str]) -> str:
    skipped = skipped_rows(info)
    return (f"ppo: {info['train_rows']} prompts / {info['eval_rows']} eval, template {info['template']}"
            f"{' (skipped ' + skipped + ')' if skipped else ''}; {cfg.train.max_steps} iterations of "
            f"{cfg.train.batch_size} prompts, {updates_per_iteration(cfg)} updates each; " + "; ".join(notes))


def run_ppo(cfg: PPOConfig, resume: bool = False, force: bool = False) -> dict:
    # 0. engine, tokenizer and prompts first (bad input fails before the models load), then the four models
    setup = start_stage(cfg, cfg.actor, "prompts", padding_side="left", resume=resume, force=force,
                        check_ranks=lambda world_size: check_ranks(cfg, world_size))
    cfg, engine, tokenizer, data = setup.cfg, setup.engine, setup.tokenizer, setup.data
    if cfg.monitor.action == "stop_best" and not data.eval:  # before the models load
        raise ConfigError("config key 'monitor.action': stop_best ends the run with best/, the policy of the best "
                          "held-out score, but this run has no held-out prompts (data.eval_prompts, "
                          "data.eval_max_rows)")
    if cfg.eval.judge and not data.eval:
        raise ConfigError("config key 'eval.judge': the judge scores the held-out prompts, and this run has none "
                          "(data.eval_prompts, data.eval_max_rows)")
    seed, iters = cfg.train.seed, cfg.train.max_steps
    ptx = PtxText(cfg.data.ptx, tokenizer, cfg.ptx.max_length, seed) if cfg.ptx.coef > 0 else None
    served = check_server(cfg, tokenizer) if cfg.rollout.server else None  # another model's server: before loading
    environment = load_environment(cfg) if cfg.env else None  # the user's environment class and tools, likewise
    if environment:  # the tools' description is in every opening: one that cannot fit fails here
        check_opening(cfg.data, tokenizer, environment.tools, causal_lm_config(cfg.actor, cfg.load))
    models = load_ppo_models(cfg, tokenizer, engine, iters * updates_per_iteration(cfg),
                             prompt_fields=[row.get("fields") or {} for row in data.train])
    record_template(models.actor.module, data.info["template"])  # into final/ and best/ config.json
    rl = PPOSteps(cfg, models, tokenizer, engine, ptx, served, environment)
    try:  # the sampler (a vLLM engine) stops on every way out: the end, an error, a stop request
        out = prepare_output_dir(cfg, resume, force, engine.is_main)
        resumed = rl.restore(out) if resume else {}
        start = resumed_from(cfg, out, resumed["step"], engine.is_main) if resume else 0
        evaluate = (lambda: rl.evaluate(data.eval, out)) if data.eval else None
        best = BestKeeper(out, models.judge is not None, rl.export_best, engine, resume) \
            if data.eval and cfg.eval.keep_best else None

        with undone_if_bad_input_at_start(out, not resume, engine.is_main), \
                MetricsLogger(out, "ppo", iters, cfg.log, engine.is_main, initial=start) as log:
            log.write(models.speed_line())  # the first line: which fast paths each model takes, and why not others
            log.write(describe(cfg, data.info, models.notes))
            log.write(kl_note(cfg.ppo.kl_estimator))  # why the kl on the bar can be below 0
            if rl.sampler.separate or environment:  # which engine samples, how its weights are kept in step, episodes
                log.write(rl.sampler.describe())
            if environment and (notice := environment.code_notice()):  # model-written code runs, and where
                log.write(notice)
            if note := lora_rate_note(cfg.lora.rank, cfg.train.lr):
                log.write(note)
            first_eval = evaluate() if evaluate and start == 0 else {}
            if first_eval:  # the starting point, so the curves show what PPO changed
                log.log(0, first_eval, show=SHOW)
            with TrainLoop(engine, out, "ppo", iters, cfg.train, log, rl.trainables(), rl.checkpoint_state, evaluate,
                           show=SHOW, resumed=resumed, monitor=cfg.monitor, best=best) as loop:
                if first_eval:
                    loop.start(first_eval)
                for it, epoch, rows in loop.steps(data.train, start):
                    tick, timer, lrs = time.perf_counter(), PhaseTimer(engine.device), rl.lrs()
                    rollout = rl.generate(rows, timer, it + 1)  # 1. responses to the prompts, with their log-probs
                    scored = rl.score(rollout, timer)  # 2. the frozen reward on prompt + response
                    experience = rl.make_experience(scored, timer)  # 3. reference, values, rewards, advantages
                    train_metrics = rl.optimise(experience, it, timer)  # 4. PPO epochs x mini-batches
                    # Ziegler et al. 2019: the coefficient follows the measured KL per sequence, one iteration's
                    # samples at a time (train.batch_size prompts x n_samples_per_prompt: kl_horizon counts samples)
                    rl.kl_ctl.update(experience.kl, samples_per_iteration(cfg))
                    rl.write_samples(out, log, it + 1, scored)
                    rl.note_left_out(log, it + 1, scored)  # said once: unjudged, openings cut, past the context
                    seconds = time.perf_counter() - tick
                    if it == start:  # how long the whole run will take, while it is still cheap to stop and shrink
                        log.write(pace_line("ppo", it + 1, iters, seconds, timer.seconds))
                    loop.end_step(it + 1, {**experience.metrics, **train_metrics, **lrs, "epoch": epoch,
                                           **timer.metrics(), TIME_ITERATION: seconds},
                                  skipped=rl.skipped(train_metrics))
    finally:
        rl.close()

    rl.export(out)
    write_run_report(out, cfg.log, engine.is_main)
    outcome = loop.outcome()
    # the iterations that ran: a monitor's stop ends the run early (iterations_planned says how many were asked)
    ran = {"iterations": outcome["stopped_at_step"], "iterations_planned": iters} if "stopped_at_step" in outcome \
        else {"iterations": iters}
    result = {"output_dir": str(out), **ran, **outcome, **data.info}
    last_eval = loop.last_eval or first_eval
    if first_eval:
        result[f"{EVAL_REWARD}_start"] = first_eval[EVAL_REWARD]
    if last_eval:
        result.update({f"{EVAL_REWARD}_end": last_eval[EVAL_REWARD], f"{EVAL_KL}_end": last_eval[EVAL_KL]})
    if EVAL_GOLD in last_eval:  # the judge's (eval.judge)
        result.update({f"{EVAL_GOLD}_end": last_eval[EVAL_GOLD],
                       **({f"{EVAL_GOLD}_start": first_eval[EVAL_GOLD]} if first_eval else {})})
    return result
