"""Loading the four PPO models: actor and critic (trained), reference and reward (frozen).

Defaults follow DeepSpeed-Chat / OpenRLHF: the critic starts from the reward model (its score head becomes
the value head), the reference is the actor's starting point, and with LoRA the reference is the actor with
its adapter disabled, so no second copy of the weights is held (TRL's choice).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.data.templates import Template, end_token_ids
from rlhfkit.errors import ModelError, RunError
from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer
from rlhfkit.models.cpu_linear import use_fast_cpu_linear
from rlhfkit.models.loading import load_generation_config
from rlhfkit.models.lora import apply_lora
from rlhfkit.models.reward_fn import (FunctionReward, ModelReward, is_function_spec, load_reward_function,
                                     same_tokenization)
from rlhfkit.rollout.estimators import ESTIMATORS
from rlhfkit.rollout.generate import ignored_generation_settings


@dataclass
class PPOModels:
    actor: object  # Trainable: the policy
    critic: Optional[object]  # Trainable: a scalar-head model giving a value per token; None when the advantage
    #                           estimator needs none (grpo, rloo, reinforce_pp): nothing loaded, trained or saved
    reference: Optional[torch.nn.Module]  # frozen; None = the actor with its LoRA adapter disabled
    reward: Callable  # FunctionReward or ModelReward: rollout batch -> (B,) scores
    notes: list  # which model each role got, for the log


def _check_vocab(name: str, role: str, actor_tok, opts) -> None:
    """Critic and reference read the actor's token ids, so they must share its vocabulary."""
    tok = load_tokenizer(name, dataclasses.replace(opts, tokenizer=None))
    if tok.get_vocab() != actor_tok.get_vocab():
        raise ModelError(f"{role} '{name}' has a different tokenizer from the actor's; the {role} reads the "
                         f"actor's token ids, so it must share its vocabulary")


def load_reward(cfg: PPOConfig, actor_tok, engine):
    """-> (reward callable, reward tokenizer or None for a Python function)."""
    if is_function_spec(cfg.reward):
        return FunctionReward(load_reward_function(cfg.reward), cfg.reward), None
    frozen_opts = dataclasses.replace(cfg.load, tokenizer=None, gradient_checkpointing=False)
    rm_tok = load_tokenizer(cfg.reward, frozen_opts)
    model = load_scalar_model(cfg.reward, frozen_opts, rm_tok)
    if not any("SequenceClassification" in a for a in (model.config.architectures or [])):
        raise ModelError(f"reward '{cfg.reward}' is not a reward model (no trained score head in its config.json); "
                         f"train one with `rlhfkit rm` or pass a Python function module:function")
    model = engine.prepare_frozen(model, role="reward")
    actor_ends = end_token_ids(actor_tok, load_generation_config(cfg.actor, cfg.load))  # where rollouts stop
    actor_template = Template.for_tokenizer(actor_tok, cfg.data.template, actor_ends)
    reward = ModelReward(model, rm_tok, actor_template, cfg.data.template, cfg.train.micro_batch_size,
                         engine.device)
    if cfg.ppo.normalize_reward and reward.stats is None:
        raise RunError(f"ppo.normalize_reward is true but '{cfg.reward}/config.json' has no rlhfkit_reward_mean/"
                       f"rlhfkit_reward_std; set ppo.normalize_reward=false")
    return reward, rm_tok


def load_ppo_models(cfg: PPOConfig, tokenizer, engine, total_updates: int) -> PPOModels:
    notes = []
    if cfg.ppo.normalize_reward and is_function_spec(cfg.reward):
        raise RunError("ppo.normalize_reward needs a reward-model folder (its stored mean/std); the reward is a "
                       "Python function")
    reward, rm_tok = load_reward(cfg, tokenizer, engine)
    notes.append(f"reward: {cfg.reward}" + (" (re-tokenised: its tokenizer differs)"
                                             if getattr(reward, "retokenize", False) else ""))

    # critic: the RM when it reads the actor's tokens, else the actor with a fresh value head (seeded)
    needs_critic = ESTIMATORS[cfg.ppo.advantage_estimator].critic
    if not needs_critic:
        critic_name = None
        notes.append(f"no critic ({cfg.ppo.advantage_estimator}: {cfg.ppo.n_samples_per_prompt} samples per prompt)")
    elif cfg.critic:
        _check_vocab(cfg.critic, "critic", tokenizer, cfg.load)
        critic_name = cfg.critic
    elif rm_tok is not None and same_tokenization(rm_tok, tokenizer):
        critic_name = cfg.reward
    else:
        critic_name = cfg.actor
    critic = None
    if critic_name is not None:
        critic = apply_lora(load_scalar_model(critic_name, cfg.load, tokenizer), cfg.lora, task="scalar")
        notes.append(f"critic: {critic_name}" + (" (fresh value head)" if critic_name == cfg.actor else ""))

    actor = apply_lora(load_causal_lm(cfg.actor, cfg.load, tokenizer), cfg.lora)
    ignored = ignored_generation_settings(actor, cfg.gen)
    if ignored:
        notes.append(f"the actor's generation_config.json {', '.join(ignored)}: not applied (rollouts sample "
                     f"with gen.* only)")
    if cfg.lora.rank > 0 and cfg.reference in (None, cfg.actor):
        reference = None
        notes.append("reference: the actor with its LoRA adapter disabled")
    else:
        name = cfg.reference or cfg.actor
        if cfg.reference:
            _check_vocab(name, "reference", tokenizer, cfg.load)
        frozen_opts = dataclasses.replace(cfg.load, gradient_checkpointing=False)
        reference = engine.prepare_frozen(load_causal_lm(name, frozen_opts, tokenizer), role="reference")
        notes.append(f"reference: {name}")

    actor = engine.prepare(actor, cfg.train, total_updates, role="policy")
    if critic is not None:
        critic = engine.prepare(critic, cfg.train, total_updates, role="critic", lr=cfg.ppo.critic_lr)
    # on CPUs where oneDNN's float32 GEMM beats MKL's (AMD), ~2x faster linears for all four models
    models = (actor.module, critic.module if critic else None, reference, getattr(reward, "model", None))
    if sum(use_fast_cpu_linear(m, engine.device) for m in models if m is not None):
        notes.append("CPU linear layers: oneDNN (faster than MKL here)")
    return PPOModels(actor, critic, reference, reward, notes)
