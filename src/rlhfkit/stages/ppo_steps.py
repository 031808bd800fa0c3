"""The four steps of a PPO iteration, one call each, and the state they carry between iterations.

1. `generate`: `ppo.n_samples_per_prompt` responses per prompt (KV cache, left padding, stop at EOS), keeping
   the sampled tokens' log-probs: they are the old log-probs, so the actor needs no extra forward, unless
   `ppo.old_logprobs` asks for one.
2. `score`: the frozen reward model / function on prompt + response (normalised, missing-EOS penalty).
3. `make_experience`: the reference's log-probs, the critic's values, per-token rewards (score on the last
   valid token, -beta * KL everywhere; Ziegler et al. 2019) and the advantages of `ppo.advantage_estimator`
   (an entry of `registry/estimators.py`).
4. `optimise`: PPO epochs x mini-batches of clipped-surrogate actor steps (+ PPO-ptx) and clipped-value critic
   steps. With one optimizer step per rollout the critic's values come out of its own update's forward
   (`critic_update_with_values`): the same numbers as a separate values pass, computed once.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace

import torch

from rlhfkit.algos import AdaptiveKLController, FixedKLController
from rlhfkit.algos.group import group_filter_mask
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.data.templates import Template, encode_prompt
from rlhfkit.errors import ConfigError
from rlhfkit.metric_names import KL, KL_MAX, REMOTE_FAILED, REWARD_MEAN, REWARD_STD, REWARD_UNJUDGED
from rlhfkit.models.ema import EMA
from rlhfkit.monitors.signals import repeated_ngram_share
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.rollout.engines import make_rollout_engine
from rlhfkit.rollout.episodes import EpisodeRollout, episode_metrics
from rlhfkit.rollout.evaluate import evaluate_held_out, reward_on_device
from rlhfkit.rollout.experience import (add_model_outputs, add_rewards, adjust_scores, ended_with_eos,
                                        finish_advantages, kl_rows, sort_by_length)
from rlhfkit.rollout.generate import eos_token_ids
from rlhfkit.rollout.sync_check import check_gap, logprob_gap, tis_metrics, tis_weights
from rlhfkit.run_files import EVAL_SAMPLES_FILE, FINAL_CRITIC_DIR, FINAL_EMA_DIR, SAMPLES_FILE, final_dir
from rlhfkit.stages.guard import resume_state
from rlhfkit.stages.ppo_setup import PPOModels
from rlhfkit.stages.ppo_update import (PtxText, critic_update_with_values, mini_batch_size, ppo_update,
                                      samples_per_iteration, single_step)


def kl_controller(cfg: PPOConfig):
    if cfg.ppo.adaptive_kl:
        return AdaptiveKLController(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
    return FixedKLController(cfg.ppo.kl_coef)


def check_ranks(cfg: PPOConfig, world_size: int) -> None:
    """Each rank takes an equal share of an iteration's prompts, of each optimizer step's samples and of the PPO-ptx
    texts: checked before anything loads (an uneven split would drop the remainder every iteration, or leave a rank
    with nothing to do)."""
    if world_size <= 1:
        return
    batch = cfg.train.batch_size
    if batch % world_size:
        raise ConfigError(f"config key 'train.batch_size': {batch} prompts do not split evenly over the "
                          f"{world_size} ranks")
    mini = mini_batch_size(cfg)  # a rank's share may be less than a micro-batch: its one micro-batch is smaller
    if mini % world_size:
        raise ConfigError(f"config key 'ppo.mini_batch_size': each optimizer step's {mini} samples do not split "
                          f"evenly over the {world_size} ranks")
    if cfg.ptx.coef > 0 and cfg.ptx.batch_size % world_size:
        raise ConfigError(f"config key 'ptx.batch_size': {cfg.ptx.batch_size} texts do not split evenly over the "
                          f"{world_size} ranks")


def updates_per_iteration(cfg: PPOConfig) -> int:
    """Optimizer steps per iteration: PPO epochs x mini-batches."""
    return cfg.ppo.epochs * (samples_per_iteration(cfg) // mini_batch_size(cfg))


# the rollout metrics that count responses or groups (the others are means and fractions)
COUNTS = frozenset({REWARD_UNJUDGED, REMOTE_FAILED, "group/filtered", "response/masked_truncated",
                    "response/past_context"})


def moments(name: str, values: torch.Tensor, squares: bool = False) -> dict:
    """This rank's count and sum (and sum of squares) of `values`, under private keys that `pool_moments` turns
    into the statistics of every rank's values once `engine.reduce_mean` has averaged them: the mean over ranks of
    each rank's mean (or standard deviation) is not the batch's when the ranks hold different numbers of values
    (judged responses, kept rows). Sums in float64."""
    v = values.detach().double()
    out = {f"{name}/_n": float(v.numel()), f"{name}/_sum": float(v.sum())}
    if squares:
        out[f"{name}/_sumsq"] = float((v * v).sum())
    return out


def pool_moments(metrics: dict, world_size: int) -> dict:
    """`metrics` (averaged over ranks) with the `moments` of the reward and the KL replaced by `reward/mean`,
    `reward/std` (unbiased, as `torch.std`) and `kl`, over every rank's values (0 where there are none)."""
    metrics = dict(metrics)
    for name in ("reward", KL):
        if f"{name}/_n" not in metrics:
            continue
        n = metrics.pop(f"{name}/_n") * world_size
        total = metrics.pop(f"{name}/_sum") * world_size
        mean = total / n if n > 0 else 0.0
        if name == KL:
            metrics[KL] = mean
            continue
        squares = metrics.pop(f"{name}/_sumsq") * world_size
        variance = max(0.0, squares - total * mean) / (n - 1) if n > 1 else 0.0
        metrics[REWARD_MEAN], metrics[REWARD_STD] = mean, variance ** 0.5
    return metrics


def shorten_middle(text: str, width: int) -> str:
    """`text` in at most `width` characters: its start and its end, the middle replaced by " ... "."""
    if len(text) <= width:
        return text
    head = (width - 5) // 2
    return text[:head] + " ... " + text[len(text) - (width - 5 - head):]


def prompt_preview(messages: list[dict] | None, rendered: str, width: int = 100) -> str:
    """A prompt for the log, from its start: the row's own turns (one user turn: its text; more: "role: text" each,
    joined by " | "), not the template's markup and system prompt, which would fill the preview before the
    question (the first log lines name a template's own system prompt); `rendered` where the row kept no turns.
    Whitespace collapsed; a long prompt loses its middle, keeping its start and the question it ends with."""
    if messages:
        text = messages[0]["content"] if len(messages) == 1 else " | ".join(f"{m['role']}: {m['content']}"
                                                                          for m in messages)
    else:
        text = rendered
    return shorten_middle(" ".join(text.split()), width)


def fill_unjudged(raw: torch.Tensor, judged: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Unjudged scores replaced by the mean of their group's judged ones (0 when none is judged)."""
    out = raw.clone()
    for g in group[~judged].unique().tolist():
        members = (group == g) & judged
        out[(group == g) & ~judged] = raw[members].mean() if members.any() else 0.0
    return out


def equal_group_rows(scores: torch.Tensor, group: torch.Tensor, n: int) -> torch.Tensor:
    """(B,) bool: the row's group (n rows sharing `group`, in any order) scored all alike."""
    order = torch.argsort(group, stable=True)
    alike = torch.empty_like(group, dtype=torch.bool)
    alike[order] = ~group_filter_mask(scores[order], n)
    return alike


def response_shape(ids: torch.Tensor, lengths: torch.Tensor) -> dict:
    """The length tail (90th percentile) and the share of repeated 4-grams of an iteration's responses, for the
    monitors (docs/monitors.md); `ids` (B, R), `lengths` (B,) as sampled. Averaged over ranks like the mean length
    (exact on one rank)."""
    ids, lengths = ids.cpu(), lengths.cpu()  # one copy, not one per row
    sequences = [row[:int(n)].tolist() for row, n in zip(ids, lengths)]
    return {"response_length/p90": torch.quantile(lengths.float(), 0.9).item(),
            "response/repeated_4grams": repeated_ngram_share(sequences, 4)}


def write_eval_samples(path, step: int, batch: RolloutBatch, scores: dict) -> None:
    """One line per held-out response of an evaluation after iteration `step` (0: the starting policy): prompt,
    response, each judge's score ("reward", "gold"; null where it left the response unjudged), and the prompt
    row's other fields (`fields`: a reference answer, a task's entry) where it has any."""
    with open(path, "a", encoding="utf-8") as f:
        for i in range(batch.size):
            judged = {name: (float(v[i]) if torch.isfinite(v[i]) else None) for name, v in scores.items()}
            f.write(json.dumps({"step": step, "prompt": batch.prompt_texts[i], "response": batch.response_texts[i],
                                **row_fields(batch, i),
                                **judged}) + "\n")


def row_fields(batch: RolloutBatch, i: int) -> dict:
    """{"fields": row i's dataset fields} for a samples file, or nothing where the row has none."""
    return {"fields": batch.fields[i]} if i < len(batch.fields) and batch.fields[i] else {}


@dataclass
class Scored:
    rollout: RolloutBatch  # rows sorted by length
    raw: torch.Tensor  # (B,) the reward as returned
    scores: torch.Tensor  # (B,) after normalisation and the missing-EOS penalty
    finished: torch.Tensor  # (B,) bool: the response ended with EOS
    judged: torch.Tensor  # (B,) bool: every reward judged it (unjudged ones are masked out of the update)
    dropped: dict  # counts of rows masked out by ppo.filter_equal_groups / ppo.mask_truncated
    kept: torch.Tensor  # (B,) bool: the rows the update keeps (judged, not filtered, not masked as truncated)
    lengths: torch.Tensor  # (B,) each response's length as sampled (a masked row's mask is all zeros)


def past_context(scored: Scored, context: int | None) -> torch.Tensor:
    """(B,) bool: the prompt and response together are longer than the model's `context` positions (it was never
    trained at such positions: what it samples there, and the log-probs, mean little). The lengths as sampled (a
    masked row's mask is zeros): an episode's whole trajectory, the environment's tokens included."""
    rollout = scored.rollout
    if not context:
        return torch.zeros(len(scored.lengths), dtype=torch.bool)
    response = rollout.response_attention.sum(-1) if rollout.response_attention is not None else scored.lengths
    return rollout.prompt_mask.sum(-1).cpu() + response.cpu() > context


@dataclass
class Experience:
    batch: RolloutBatch  # + old / reference log-probs, KL, rewards (+ values, advantages, returns unless pending)
    kl: float  # KL to the reference, nats per sequence, averaged over all ranks: what the KL controller follows
    metrics: dict  # the rollout's metrics, averaged over ranks
    pending: bool  # values and advantages come with the critic's update (one optimizer step per rollout)


class PPOSteps:
    def __init__(self, cfg: PPOConfig, models: PPOModels, tokenizer, engine, ptx: PtxText | None = None,
                 served: str | None = None, environment=None):
        self.cfg, self.models, self.tokenizer, self.engine, self.ptx = cfg, models, tokenizer, engine, ptx
        self.actor, self.critic = models.actor, models.critic
        self.estimator = cfg.ppo.estimator()
        # one optimizer step per rollout: the critic's update forward gives the values (no separate pass)
        self.fused = self.estimator.critic and self.estimator.row_local and single_step(cfg)
        self.kl_ctl = kl_controller(cfg)
        self.ema = EMA(self.actor.module, engine, cfg.ema.beta) if cfg.ema.enabled else None
        self.eos_ids = eos_token_ids(tokenizer, self.actor.module)
        # what samples: the actor itself (native) or an engine holding its own copy of the weights (vllm), synced
        # before it samples whenever the actor has changed since (`stale`)
        self.sampler = make_rollout_engine(cfg, self.actor.module, engine, tokenizer, models.plans["actor"], served)
        if environment is not None:  # multi-turn: the engine samples each model turn of the episodes
            template = Template.for_tokenizer(tokenizer, cfg.data.template, self.eos_ids)
            self.sampler = EpisodeRollout(self.sampler, environment.env_class, cfg.episode, template, engine,
                                          environment.tools, environment.env_args, environment.spec,
                                          cfg.data.max_prompt_length)
        # the model's positions: a prompt and response longer are counted (response/past_context) and said
        self.stale = self.sampler.separate
        self.context = getattr(self.actor.module.config, "max_position_embeddings", None)
        self.said: dict[str, int] = {}  # note_left_out: what was said, at which level
        # the old log-probs from a forward after sampling, not from sampling itself (auto: under bf16 autocast;
        # always where another engine sampled: its log-probs are checked against the forward's)
        self.recompute_old = self.sampler.separate or cfg.ppo.old_logprobs == "forward" or (
            cfg.ppo.old_logprobs == "auto" and cfg.engine.precision == "bf16")
        self.iteration = 0

    # -- 1. generate ---------------------------------------------------------------------------------------
    def generate(self, rows: list[dict], timer, iteration: int = 0) -> RolloutBatch:
        """ppo.n_samples_per_prompt responses to each prompt row; `group` says which prompt a row answers."""
        n, self.iteration = self.cfg.ppo.n_samples_per_prompt, iteration
        self.sync_sampler(timer)
        with timer("generate"):
            rollout = self.sampler.generate([row for row in rows for _ in range(n)], self.cfg.gen, group_size=n)
        rollout = replace(rollout, group=torch.arange(len(rows)).repeat_interleave(n), groups_share_prompts=n > 1)
        return sort_by_length(rollout)  # neighbours of similar length: each micro-batch trims its padding

    def sync_sampler(self, timer=None) -> None:
        """The actor's weights to a separate sampler when they changed since its last sync (time/sync)."""
        if self.stale:
            with timer("sync") if timer is not None else contextlib.nullcontext():
                self.sampler.sync(self.actor.module)
            self.stale = False

    # -- 2. score ------------------------------------------------------------------------------------------
    def score(self, rollout: RolloutBatch, timer) -> Scored:
        """The reward of each response. A response a reward function left unjudged (None) is left out of the update:
        its tokens are masked, and its score (for the group statistics of the others) is its group's mean
        over the judged ones."""
        reward, engine = self.models.reward, self.engine
        finished = ended_with_eos(rollout, self.eos_ids)
        with timer("reward"), reward_on_device(engine, reward):
            raw = reward(rollout, finished).float().to(engine.device)
        judged = torch.isfinite(raw)
        group = rollout.group.to(raw.device)
        if not judged.all():
            raw = fill_unjudged(raw, judged, group)
        keep, dropped, lengths = judged.clone(), {}, rollout.response_lengths
        if self.cfg.ppo.filter_equal_groups:  # DAPO: a group that scored all alike has no signal to learn from
            alike = equal_group_rows(raw, group, self.cfg.ppo.n_samples_per_prompt)
            keep &= ~alike
            dropped["group/filtered"] = float(alike.sum()) / self.cfg.ppo.n_samples_per_prompt
        if self.cfg.ppo.mask_truncated:  # DAPO: a response cut at the token limit is not judged by its ending
            keep &= finished.to(keep.device)
            dropped["response/masked_truncated"] = float((~finished).sum())
        if not keep.all():  # masked rows: no tokens in any loss, metric or count of the update
            rollout = replace(rollout, response_mask=rollout.response_mask * keep[:, None].to(
                rollout.response_mask.dtype))
        return Scored(rollout, raw, adjust_scores(raw, finished, self.cfg.ppo, reward.stats), finished, judged,
                      dropped, keep, lengths)

    # -- 3. make experience --------------------------------------------------------------------------------
    def make_experience(self, scored: Scored, timer) -> Experience:
        cfg, engine, reference = self.cfg, self.engine, self.models.reference
        values_pass = self.estimator.critic and not self.fused
        with engine.on_device(reference):
            batch = add_model_outputs(scored.rollout.to(engine.device), self.actor.module,
                                      self.critic.module if values_pass else None, reference, self.models.plans,
                                      cfg.gen.temperature,
                                      cfg.ppo.forward_batch_size or cfg.train.micro_batch_size,
                                      old_from_sampling=not self.recompute_old,
                                      timer=timer)
        sampler_metrics = {}
        if self.sampler.separate:  # the sampler's log-probs against the trainer's: checked, then corrected (TIS)
            sampler_metrics = logprob_gap(batch.old_logprobs, batch.sample_logprobs, batch.response_mask,
                                          cfg.rollout.sync_tolerance, engine)
            check_gap(sampler_metrics, cfg.rollout.sync_max_gap, cfg.rollout.sync_tolerance, self.iteration,
                      self.sampler.name)
            if cfg.rollout.tis_cap is not None:
                weights = tis_weights(batch.old_logprobs, batch.sample_logprobs, batch.response_mask,
                                      cfg.rollout.tis_cap)
                sampler_metrics.update(tis_metrics(weights, batch.response_mask, cfg.rollout.tis_cap, engine))
                batch = replace(batch, tis_weights=weights)
        batch = add_rewards(batch, scored.scores, self.kl_ctl.value, cfg.ppo)
        if not scored.judged.all():  # the group statistics leave the unjudged rows out
            batch = replace(batch, judged=scored.judged.to(batch.scores.device))
        kl_each = kl_rows(batch, scored.kept)  # (K,) nats per kept response
        metrics = {**self.rollout_metrics(scored), **response_shape(scored.rollout.response_ids, scored.lengths),
                   **moments(KL, kl_each)}
        if not self.fused:
            batch, advantage_metrics = finish_advantages(batch, *self.estimator.advantages(batch, cfg.ppo), cfg.ppo,
                                                         self.estimator.whiten, engine)
            metrics.update(advantage_metrics)
        if self.estimator.groups:  # groups whose samples all scored the same carry no learning signal
            alike = equal_group_rows(batch.scores, batch.group.to(batch.scores.device), cfg.ppo.n_samples_per_prompt)
            metrics["group/all_equal"] = alike.float().mean().item()
        metrics = pool_moments(engine.reduce_mean(metrics), engine.world_size)
        # the batch's largest KL of one response: a few runaway responses hide in the mean (monitor: kl_max_blowup)
        metrics[KL_MAX] = engine.reduce_max(kl_each.max().item() if kl_each.numel() else 0.0)
        for key in COUNTS.intersection(metrics):  # counts of the whole batch: the sum over ranks
            metrics[key] *= engine.world_size
        metrics.update(sampler_metrics)  # pooled over ranks already
        return Experience(batch, metrics[KL], metrics, pending=self.fused)

    def rollout_metrics(self, scored: Scored) -> dict:
        """What the rollout looked like: reward (as returned, over the judged responses: `moments`, pooled over ranks
        into reward/mean and reward/std), score (after normalisation/penalty), lengths."""
        parts = getattr(self.models.reward, "last", {})
        named = {f"reward/{name}": value for name, value in parts.items()} if len(parts) > 1 else {}
        judged = scored.judged
        # kl_coef: the reward's KL coefficient, none where the estimator keeps the KL in the loss
        coef = {} if self.cfg.ppo.estimator().kl_in == "loss" else {"kl_coef": self.kl_ctl.value}
        return {**moments("reward", scored.raw[judged], squares=True), **named,
                REWARD_UNJUDGED: float((~judged).sum()), **getattr(self.models.reward, "counts", {}),
                "response/past_context": float(past_context(scored, self.context).sum()),
                **scored.dropped,
                "score/mean": scored.scores.mean().item(), **coef,
                "response_length": scored.lengths.float().mean().item(),
                "response/finished": scored.finished.float().mean().item(), **episode_metrics(scored.rollout)}

    # -- 4. optimise ---------------------------------------------------------------------------------------
    def optimise(self, experience: Experience, iteration: int, timer) -> dict:
        """The iteration's optimizer steps; returns their metrics (averaged over steps and ranks), the
        advantage metrics too when the critic's update computed the advantages."""
        cfg, engine, batch, metrics = self.cfg, self.engine, experience.batch, {}
        if experience.pending:  # values, advantages and the critic's step from one critic forward
            batch, advantage_metrics, critic_metrics = critic_update_with_values(
                batch, self.critic, cfg, engine, self.models.plans["critic"], timer, self.estimator)
            metrics.update({**engine.reduce_mean(advantage_metrics), **critic_metrics})
        update_actor = iteration >= cfg.ppo.critic_warmup_iters  # the actor waits while the critic warms up
        update_critic = self.critic is not None and not experience.pending
        metrics.update(ppo_update(batch, self.actor, self.critic, cfg, engine, iteration, self.models.plans,
                                  update_actor, self.ptx, self.ema, self.tokenizer.pad_token_id, timer,
                                  update_critic=update_critic))
        self.stale = self.sampler.separate and (self.stale or update_actor)
        return metrics

    @staticmethod
    def skipped(metrics: dict) -> bool:
        return metrics.get("skipped_actor_steps", 0.0) + metrics.get("skipped_critic_steps", 0.0) > 0

    def lrs(self) -> dict:
        return {"lr": self.actor.lr, **({"critic_lr": self.critic.lr} if self.critic is not None else {})}

    # -- around the steps ------------------------------------------------------------------------------------
    def evaluate(self, rows: list[dict], out=None) -> dict:
        """Held-out eval/reward (one sampled response per prompt, fixed seed), eval/kl, and eval/gold with a
        judge (eval.judge). With `out`, the main rank's responses and their scores go to eval_samples.jsonl (the
        report's proxy-against-truth samples)."""
        self.sync_sampler()
        metrics, batch, scores = evaluate_held_out(
            self.actor.module, self.models.reference, self.models.reward, self.tokenizer, rows, self.cfg.gen,
            self.engine, self.cfg.train.micro_batch_size, self.cfg.train.seed, self.eos_ids, self.models.plans,
            self.sampler, self.models.judge)
        if out is not None and self.engine.is_main:
            write_eval_samples(out / EVAL_SAMPLES_FILE, self.iteration, batch, scores)
        return metrics

    def close(self) -> None:
        """Stop the sampler (a vLLM engine frees its memory); every exit of the run calls it."""
        self.sampler.close()

    def write_samples(self, out, log, iteration: int, scored: Scored) -> None:
        """Every ppo.sample_every iterations (and the first): a few (prompt, response, reward) triples to
        samples.jsonl (reward null: unjudged, as in eval_samples.jsonl; with the row's `fields`, e.g. a reference
        answer, where it has any) and one line above the bar."""
        every, n = self.cfg.ppo.sample_every, self.cfg.ppo.num_samples
        if not log.enabled or n <= 0 or every <= 0 or not (iteration % every == 0 or iteration == 1):
            return
        rollout = scored.rollout
        shown = [self.prompt_seen(rollout, i) for i in range(min(n, rollout.size))]
        # the reward as returned; null where it left the response unjudged (its raw value is only a stand-in)
        rewards = [float(scored.raw[i]) if scored.judged[i] else None for i in range(len(shown))]
        with open(out / SAMPLES_FILE, "a", encoding="utf-8") as f:
            for i, (prompt, cut) in enumerate(shown):
                f.write(json.dumps({"step": iteration, "prompt": prompt, **({"prompt_truncated": True} if cut else {}),
                                    "response": rollout.response_texts[i], "reward": rewards[i],
                                    **row_fields(rollout, i)}) + "\n")
        prompt = prompt_preview(rollout.messages[0] if rollout.messages else None, shown[0][0])
        verdict = "unjudged" if rewards[0] is None else f"reward {rewards[0]:.3g}"
        log.write(f"[{iteration}] {prompt!r} -> {rollout.response_texts[0][:120]!r} ({verdict})")

    def note_left_out(self, log, iteration: int, scored: Scored) -> None:
        """Say it once (and again when it first reaches half of the batch) when responses were left unjudged (out
        of the update: it can starve the run without the bar showing why), when episode openings were cut to
        data.max_prompt_length, or when sequences ran past the model's positions."""
        rollout, total = scored.rollout, scored.judged.numel()
        cut = sum(s.get("opening_cut", False) for s in (rollout.episodes or []))
        counts = {"unjudged": int((~scored.judged).sum()), "opening_cut": int(cut),
                  "past_context": int(past_context(scored, self.context).sum())}
        lines = {
            "unjudged": "were left unjudged (the reward returned None or NaN, or could not be reached); they are out "
                        "of the update. reward/unjudged counts them every iteration",
            "opening_cut": f"opened with more than data.max_prompt_length={self.cfg.data.max_prompt_length} tokens "
                           f"(the prompt with the tools' description) and were cut to it: their start and end kept. "
                           f"episode/opening_cut gives the share every iteration",
            "past_context": f"ran past the model's {self.context} positions (prompt and response together); lower "
                            f"data.max_prompt_length or {'episode.max_tokens' if rollout.episodes else 'gen.max_new_tokens'}. "
                            f"response/past_context counts them every iteration"}
        for what, left in counts.items():
            level = 2 if 2 * left >= total else 1 if left else 0
            if level > self.said.get(what, 0):
                self.said[what] = level
                log.write(f"{what.replace('_', ' ')}: {left} of the {total} responses of iteration {iteration} "
                          f"{lines[what]}")

    def prompt_seen(self, rollout, i: int) -> tuple[str, bool]:
        """(the prompt as the actor saw it, whether data.max_prompt_length cut it): a cut prompt kept its end, so
        its rendered text is not what the response answers; it is shown decoded from the ids the actor read."""
        ids = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        text = rollout.prompt_texts[i]
        if len(ids) < self.cfg.data.max_prompt_length or len(encode_prompt(self.tokenizer, text)) <= len(ids):
            return text, False
        return self.tokenizer.decode(ids), True

    def trainables(self) -> dict:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def checkpoint_state(self) -> dict:
        return {"kl_ctl": self.kl_ctl.state_dict(), "ema": self.ema.state_dict() if self.ema else None}

    def restore(self, out) -> dict:
        """Models, optimizers, schedules, RNG, KL coefficient and EMA from checkpoints/latest; returns the loaded
        state (its "step", the loop's "guard" counts)."""
        state = resume_state(self.engine, out, self.trainables(), self.cfg.train.max_steps, "ppo")
        self.stale = self.sampler.separate  # the resumed weights are not the sampler's
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.ema is not None:
            if state.get("ema") is not None:
                self.ema.load_state_dict(state["ema"])
            else:  # switched on at the resume: the average starts from the resumed weights, not the initial ones
                self.ema = EMA(self.actor.module, self.engine, self.ema.beta)
        return state

    def export_best(self, target) -> None:
        """best/ (stages/best.py): the actor as it is now, a plain transformers folder like final/ (LoRA merged into
        a copy: training goes on). In a forked RNG: the ZeRO-3 export builds a twin of the model, whose LoRA adapters
        draw their initial weights, and the run's random stream must not depend on when best/ improved."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            self.engine.export_hf(self.actor.module, self.tokenizer, target, in_place=False)

    def export(self, out) -> None:
        """Plain transformers folders (LoRA merged); final/ last, since its presence marks a finished run."""
        engine, tokenizer = self.engine, self.tokenizer
        if self.ema is not None:
            with self.ema.swapped_in(self.actor.module):
                engine.export_hf(self.actor.module, tokenizer, out / FINAL_EMA_DIR, in_place=False)
        if self.critic is not None:  # the critic reads the actor's token ids, so the actor's tokenizer goes with it
            engine.export_hf(self.critic.module, tokenizer, out / FINAL_CRITIC_DIR)
        engine.export_hf(self.actor.module, tokenizer, final_dir(out))
