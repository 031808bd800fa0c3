"""Loading the four PPO models: actor and critic (trained), reference and reward (frozen).

Defaults follow DeepSpeed-Chat / OpenRLHF: the critic starts from the reward model (its score head becomes
the value head), the reference is the actor's starting point, and with LoRA the reference is the actor with
its adapter disabled, so no second copy of the weights is held (TRL's choice).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.data.templates import Template, end_token_ids
from rlhfkit.errors import ModelError, RunError
from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer
from rlhfkit.models.loading import causal_lm_config, has_trained_score_head, load_generation_config
from rlhfkit.lora import apply_lora
from rlhfkit.config.ppo_schema import RewardPart, reward_kind
from rlhfkit.models.reward_fn import CombinedReward, FunctionReward, ModelReward, same_tokenization
from rlhfkit.user_code import load_user_object
from rlhfkit.remote.client import RemoteReward
from rlhfkit.rollout.episodes import EnvironmentReward
from rlhfkit.rollout.generate import ignored_generation_settings
from rlhfkit.speed.registry import Target, plan_line, plan_model


@dataclass
class PPOModels:
    actor: object  # Trainable: the policy
    critic: Optional[object]  # Trainable: a scalar-head model giving a value per token; None when the advantage
    #                           estimator needs none (grpo, rloo, reinforce_pp): nothing loaded, trained or saved
    reference: Optional[torch.nn.Module]  # frozen; None = the actor with its LoRA adapter disabled
    reward: CombinedReward  # the weighted reward parts: rollout batch -> (B,) scores (NaN: unjudged)
    judge: Optional[CombinedReward]  # eval.judge: the held-out evaluation's second judge (eval/gold), or None
    notes: list  # which model each role got, for the log
    plans: dict  # role -> the model's speed plan: "actor", "critic" (with a critic), "reference" (the actor's own
    #              where the reference is the actor with its adapter disabled), and each reward model's by part name

    def speed_line(self) -> str:
        """The first log line: every model's speed plan (`speed.registry.plan_line`), each model named once."""
        aliased = self.reference is None  # the reference forwards are the actor's, on its plan
        return plan_line({role: plan for role, plan in self.plans.items() if not (aliased and role == "reference")})


def _check_vocab(name: str, role: str, actor_tok, opts) -> None:
    """Critic and reference read the actor's token ids, so they must share its vocabulary."""
    tok = load_tokenizer(name, dataclasses.replace(opts, tokenizer=None))
    if tok.get_vocab() != actor_tok.get_vocab():
        raise ModelError(f"{role} '{name}' has a different tokenizer from the actor's; the {role} reads the "
                         f"actor's token ids, so it must share its vocabulary")


def load_reward(cfg: PPOConfig, actor_tok, engine, prompt_fields: list[dict] | None = None
                ) -> tuple[CombinedReward, list]:
    """-> (the weighted sum of every `reward` part, the tokenizer of each part: None for a Python function or a
    reward server). `prompt_fields`: the prompt rows' dataset fields, checked against what each reward function
    takes before any reward model loads."""
    if cfg.env:  # the environment judges its episodes (rollout/episodes.py)
        return CombinedReward([("env", EnvironmentReward(), 1.0)]), [None]
    functions = {part.name: function_reward(part, prompt_fields)
                 for part in cfg.reward_parts() if reward_kind(part.spec) == "function"}
    parts, tokenizers = [], []
    for part in cfg.reward_parts():
        reward, tok = (functions[part.name], None) if part.name in functions else \
            load_reward_part(part, cfg, actor_tok, engine)
        parts.append((part.name, reward, part.weight))
        tokenizers.append(tok)
    return CombinedReward(parts), tokenizers


def function_reward(part: RewardPart, prompt_fields: list[dict] | None, what: str = "reward") -> FunctionReward:
    """A reward function, checked against the prompt rows' fields (when given) before any model loads; `what` names
    it in an error ("reward", "eval.judge")."""
    function = FunctionReward(load_user_object(part.spec, what), part.spec)
    if prompt_fields is not None:
        function.check_fields(prompt_fields)
    return function


def load_reward_part(part: RewardPart, cfg: PPOConfig, actor_tok, engine, prompt_fields: list[dict] | None = None,
                     what: str = "reward"):
    """-> (one reward: a function, a reward server or a reward-model folder; its tokenizer, None but for a folder)."""
    kind = reward_kind(part.spec)
    if kind == "function":
        return function_reward(part, prompt_fields, what), None
    if kind == "url":  # each rank asks the server for its own rows; only the failure count is pooled over ranks
        return RemoteReward(part.spec, cfg.remote, engine.reduce_sum), None
    return load_rollout_reward_model(part.spec, cfg, actor_tok, engine)


def load_judge(cfg: PPOConfig, actor_tok, engine, prompt_fields: list[dict] | None = None
               ) -> Optional[CombinedReward]:
    """eval.judge, the held-out evaluation's second judge (eval/gold), or None."""
    part = cfg.judge_part()
    if part is None:
        return None
    judge, _ = load_reward_part(part, cfg, actor_tok, engine, prompt_fields, "eval.judge")
    return CombinedReward([(part.name, judge, 1.0)])


def load_rollout_reward_model(spec: str, cfg: PPOConfig, actor_tok, engine):
    """-> (the reward model in folder `spec`, scoring rollouts; its tokenizer)."""
    frozen_opts = dataclasses.replace(cfg.load, tokenizer=None, gradient_checkpointing=False)
    rm_tok = load_tokenizer(spec, frozen_opts)
    model = load_scalar_model(spec, frozen_opts, rm_tok)
    if not has_trained_score_head(model):
        raise ModelError(f"reward '{spec}' is not a reward model (no trained score head in its config.json); "
                         f"train one with `rlhfkit rm` or pass a Python function module:function")
    model = engine.prepare_frozen(model, role="reward")
    actor_ends = end_token_ids(actor_tok, load_generation_config(cfg.actor, cfg.load))  # where rollouts stop
    actor_template = Template.for_tokenizer(actor_tok, cfg.data.template, actor_ends, key="data.template")
    reward = ModelReward(model, rm_tok, actor_template, cfg.data.template,
                         cfg.ppo.forward_batch_size or cfg.train.micro_batch_size, engine.device,
                         plan=plan_model(Target(model, "reward", "ppo", cfg, engine)))
    if cfg.ppo.normalize_reward and reward.stats is None:
        raise RunError(f"ppo.normalize_reward is true but '{spec}/config.json' has no rlhfkit_reward_mean/"
                       f"rlhfkit_reward_std; set ppo.normalize_reward=false")
    if cfg.ppo.normalize_reward and not reward.stats["std"] >= 1e-6:  # also NaN
        raise RunError(f"ppo.normalize_reward is true but '{spec}/config.json' has rlhfkit_reward_std "
                       f"{reward.stats['std']} (its scores did not vary when measured): dividing by it would blow "
                       f"every score up; set ppo.normalize_reward=false")
    return reward, rm_tok


def zero_value_head(model) -> None:
    """Every value of a fresh value head starts at 0 (its output layer's weights and bias zeroed)."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Linear):
        raise ModelError(f"ppo.value_head_init=zero: {type(model).__name__} has no linear `score` head to zero")
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()


def reward_notes(cfg: PPOConfig, reward: CombinedReward) -> list[str]:
    """Which reward each part is, for the log."""
    if cfg.env:
        return [f"reward: the environment's ({cfg.env})"]
    parts = cfg.reward_parts()
    return [f"reward: {part.spec}" + (f" x {part.weight:g} as {part.name}" if len(parts) > 1 else "")
            + (" (re-tokenised: its tokenizer differs)" if getattr(one, "retokenize", False) else "")
            for part, (_, one, _) in zip(parts, reward.parts)]


def estimator_notes(cfg: PPOConfig) -> list[str]:
    """What the advantage estimator leaves out or moves, for the log."""
    estimator, notes = cfg.ppo.estimator(), []
    if not estimator.critic:
        notes.append(f"no critic ({cfg.ppo.advantage_estimator}: {cfg.ppo.n_samples_per_prompt} samples per prompt)")
    unread = cfg.ppo.without_effect()
    if unread:
        notes.append(f"no effect with {cfg.ppo.advantage_estimator}: {', '.join('ppo.' + s for s in unread)}")
    if estimator.kl_in == "loss":
        notes.append(f"KL to the reference: a k3 loss x {cfg.ppo.kl_loss_coef:g}" if cfg.ppo.kl_loss_coef else
                     f"no KL to the reference ({cfg.ppo.advantage_estimator} puts it in the loss and "
                     f"ppo.kl_loss_coef is 0; e.g. ppo.kl_loss_coef=0.05)")
    return notes


def critic_source(cfg: PPOConfig, tokenizer, reward_toks: list) -> Optional[str]:
    """The folder the critic starts from: `critic` when set; else the first reward model that reads the actor's
    tokens (its score head becomes the value head); else the actor (a fresh value head). None when the advantage
    estimator needs no critic."""
    if not cfg.ppo.estimator().critic:
        return None
    if cfg.critic:
        _check_vocab(cfg.critic, "critic", tokenizer, cfg.load)
        return cfg.critic
    return next((part.spec for part, tok in zip(cfg.reward_parts(), reward_toks)
                 if tok is not None and same_tokenization(tok, tokenizer)), cfg.actor)


def load_critic(cfg: PPOConfig, name: str, tokenizer):
    """(the critic from `name`, with its value head (zeroed where fresh and asked) and LoRA; its log note)."""
    critic = load_scalar_model(name, cfg.load, tokenizer)
    fresh = critic.fresh_head  # a causal LM's folder (the actor's, or any other `critic=`), not an RM's
    if fresh and cfg.ppo.value_head_init == "zero":
        zero_value_head(critic)
    return apply_lora(critic, cfg.lora, task="scalar"), f"critic: {name}" + (" (fresh value head)" if fresh else "")


def load_reference(cfg: PPOConfig, tokenizer, engine):
    """(the frozen reference, or None for the LoRA actor with its adapter disabled (no second copy); its note)."""
    if cfg.lora.rank > 0 and cfg.reference in (None, cfg.actor):
        return None, "reference: the actor with its LoRA adapter disabled"
    name = cfg.reference or cfg.actor
    if cfg.reference:
        _check_vocab(name, "reference", tokenizer, cfg.load)
    frozen_opts = dataclasses.replace(cfg.load, gradient_checkpointing=False)
    return engine.prepare_frozen(load_causal_lm(name, frozen_opts, tokenizer), role="reference"), f"reference: {name}"


def load_ppo_models(cfg: PPOConfig, tokenizer, engine, total_updates: int,
                    prompt_fields: list[dict] | None = None) -> PPOModels:
    """Reward, critic, actor and reference, in that order, each with its speed plan (`speed.registry`)."""
    causal_lm_config(cfg.actor, cfg.load)  # a reward-model folder given as the actor: said first, as itself
    if cfg.ppo.normalize_reward and reward_kind(cfg.reward_parts()[0].spec) == "function":
        raise RunError("ppo.normalize_reward needs a reward-model folder (its stored mean/std); the reward is a "
                       "Python function")
    judge = load_judge(cfg, tokenizer, engine, prompt_fields)  # a judge function's mistakes before any model loads
    reward, reward_toks = load_reward(cfg, tokenizer, engine, prompt_fields)
    notes = reward_notes(cfg, reward) + ([f"eval.judge: {cfg.eval.judge} (eval/gold)"] if judge else []) \
        + estimator_notes(cfg)
    critic_name, critic = critic_source(cfg, tokenizer, reward_toks), None
    if critic_name is not None:
        critic, note = load_critic(cfg, critic_name, tokenizer)
        notes.append(note)
    actor = apply_lora(load_causal_lm(cfg.actor, cfg.load, tokenizer), cfg.lora)
    ignored = ignored_generation_settings(actor, cfg.gen)
    if ignored:
        notes.append(f"the actor's generation_config.json {', '.join(ignored)}: not applied (rollouts sample "
                     f"with gen.* only)")
    reference, note = load_reference(cfg, tokenizer, engine)
    notes.append(note)

    # on a CPU the gradients stay allocated between iterations (see Engine.prepare): the update's peak holds them
    # anyway, and memory a step gets afresh costs page faults there (SmolLM2 PPO: update 12.0 -> 11.6 s)
    keep = engine.device.type == "cpu"
    actor = engine.prepare(actor, cfg.train, total_updates, role="policy", keep_grads=keep)
    if critic is not None:
        critic = engine.prepare(critic, cfg.train, total_updates, role="critic", lr=cfg.ppo.critic_lr,
                                keep_grads=keep)
    # each model's fast paths, decided once and passed to every forward (speed/registry.py)
    plans = {"actor": plan_model(Target(actor.module, "actor", "ppo", cfg, engine, keep_grads=keep))}
    if critic is not None:
        plans["critic"] = plan_model(Target(critic.module, "critic", "ppo", cfg, engine, keep_grads=keep))
    plans["reference"] = plans["actor"] if reference is None else plan_model(
        Target(reference, "reference", "ppo", cfg, engine))
    plans.update({"reward" if len(reward.parts) == 1 else f"reward {name}": one.plan
                  for name, one, _ in reward.parts if isinstance(one, ModelReward)})
    return PPOModels(actor, critic, reference, reward, judge, notes, plans)
