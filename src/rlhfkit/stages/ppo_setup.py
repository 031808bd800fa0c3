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
from rlhfkit.accel.cpu_linear import use_fast_cpu_linear
from rlhfkit.models.loading import causal_lm_config, load_generation_config
from rlhfkit.models.lora import apply_lora
from rlhfkit.models.reward_fn import (CombinedReward, FunctionReward, ModelReward, is_function_spec,
                                     load_reward_function, same_tokenization)
from rlhfkit.rollout.generate import ignored_generation_settings
from rlhfkit.stages.common import (choose_common_prefix, choose_group_packing, choose_head_logprobs,
                                   choose_padding_free)


@dataclass
class PPOModels:
    actor: object  # Trainable: the policy
    critic: Optional[object]  # Trainable: a scalar-head model giving a value per token; None when the advantage
    #                           estimator needs none (grpo, rloo, reinforce_pp): nothing loaded, trained or saved
    reference: Optional[torch.nn.Module]  # frozen; None = the actor with its LoRA adapter disabled
    reward: CombinedReward  # the weighted reward parts: rollout batch -> (B,) scores (NaN: unjudged)
    notes: list  # which model each role got, for the log


def _check_vocab(name: str, role: str, actor_tok, opts) -> None:
    """Critic and reference read the actor's token ids, so they must share its vocabulary."""
    tok = load_tokenizer(name, dataclasses.replace(opts, tokenizer=None))
    if tok.get_vocab() != actor_tok.get_vocab():
        raise ModelError(f"{role} '{name}' has a different tokenizer from the actor's; the {role} reads the "
                         f"actor's token ids, so it must share its vocabulary")


def load_reward(cfg: PPOConfig, actor_tok, engine, prompt_fields: list[dict] | None = None
                ) -> tuple[CombinedReward, list]:
    """-> (the weighted sum of every `reward` part, the tokenizer of each part: None for a Python function).
    `prompt_fields`: the prompt rows' dataset fields, checked against what each reward function takes."""
    parts, tokenizers = [], []
    for part in cfg.reward_parts():
        reward, tok = load_one_reward(part.spec, cfg, actor_tok, engine)
        if prompt_fields is not None and isinstance(reward, FunctionReward):
            reward.check_fields(prompt_fields)
        parts.append((part.name, reward, part.weight))
        tokenizers.append(tok)
    return CombinedReward(parts), tokenizers


def load_one_reward(spec: str, cfg: PPOConfig, actor_tok, engine):
    """-> (reward callable, reward tokenizer or None for a Python function)."""
    if is_function_spec(spec):
        return FunctionReward(load_reward_function(spec), spec), None
    frozen_opts = dataclasses.replace(cfg.load, tokenizer=None, gradient_checkpointing=False)
    rm_tok = load_tokenizer(spec, frozen_opts)
    model = load_scalar_model(spec, frozen_opts, rm_tok)
    if not any("SequenceClassification" in a for a in (model.config.architectures or [])):
        raise ModelError(f"reward '{spec}' is not a reward model (no trained score head in its config.json); "
                         f"train one with `rlhfkit rm` or pass a Python function module:function")
    model = engine.prepare_frozen(model, role="reward")
    actor_ends = end_token_ids(actor_tok, load_generation_config(cfg.actor, cfg.load))  # where rollouts stop
    actor_template = Template.for_tokenizer(actor_tok, cfg.data.template, actor_ends, key="data.template")
    reward = ModelReward(model, rm_tok, actor_template, cfg.data.template,
                         cfg.ppo.forward_batch_size or cfg.train.micro_batch_size, engine.device)
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


def load_ppo_models(cfg: PPOConfig, tokenizer, engine, total_updates: int,
                    prompt_fields: list[dict] | None = None) -> PPOModels:
    causal_lm_config(cfg.actor, cfg.load)  # a reward-model folder given as the actor: said first, as itself
    notes = []
    parts = cfg.reward_parts()
    if cfg.ppo.normalize_reward and is_function_spec(parts[0].spec):
        raise RunError("ppo.normalize_reward needs a reward-model folder (its stored mean/std); the reward is a "
                       "Python function")
    reward, reward_toks = load_reward(cfg, tokenizer, engine, prompt_fields)
    for part, (_, one, _) in zip(parts, reward.parts):
        notes.append(f"reward: {part.spec}" + (f" x {part.weight:g} as {part.name}" if len(parts) > 1 else "")
                     + (" (re-tokenised: its tokenizer differs)" if getattr(one, "retokenize", False) else ""))
    # the critic may start from a reward model that reads the actor's tokens: the first such part
    rm_spec = next((part.spec for part, tok in zip(parts, reward_toks)
                    if tok is not None and same_tokenization(tok, tokenizer)), None)

    # critic: the RM when it reads the actor's tokens, else the actor with a fresh value head (seeded)
    needs_critic = cfg.ppo.estimator().critic
    if not needs_critic:
        critic_name = None
        notes.append(f"no critic ({cfg.ppo.advantage_estimator}: {cfg.ppo.n_samples_per_prompt} samples per prompt)")
    elif cfg.critic:
        _check_vocab(cfg.critic, "critic", tokenizer, cfg.load)
        critic_name = cfg.critic
    elif rm_spec is not None:
        critic_name = rm_spec
    else:
        critic_name = cfg.actor
    unread = cfg.ppo.without_effect()
    if unread:
        notes.append(f"no effect with {cfg.ppo.advantage_estimator}: {', '.join('ppo.' + s for s in unread)}")
    if cfg.ppo.estimator().kl_in == "loss":
        notes.append(f"KL to the reference: a k3 loss x {cfg.ppo.kl_loss_coef:g}" if cfg.ppo.kl_loss_coef else
                     f"no KL to the reference ({cfg.ppo.advantage_estimator} puts it in the loss and "
                     f"ppo.kl_loss_coef is 0; e.g. ppo.kl_loss_coef=0.05)")
    critic = None
    if critic_name is not None:
        critic = load_scalar_model(critic_name, cfg.load, tokenizer)
        fresh = critic.fresh_head  # a causal LM's folder (the actor's, or any other `critic=`), not an RM's
        if fresh and cfg.ppo.value_head_init == "zero":
            zero_value_head(critic)
        critic = apply_lora(critic, cfg.lora, task="scalar")
        notes.append(f"critic: {critic_name}" + (" (fresh value head)" if fresh else ""))

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

    # on a CPU the gradients stay allocated between iterations (see Engine.prepare): the update's peak holds them
    # anyway, and memory a step gets afresh costs page faults there (SmolLM2 PPO: update 12.0 -> 11.6 s)
    keep = engine.device.type == "cpu"
    actor = engine.prepare(actor, cfg.train, total_updates, role="policy", keep_grads=keep)
    if critic is not None:
        critic = engine.prepare(critic, cfg.train, total_updates, role="critic", lr=cfg.ppo.critic_lr,
                                keep_grads=keep)
    # on CPUs where oneDNN's float32 GEMM beats MKL's (AMD), ~2x faster linears for all four models
    models = (actor.module, critic.module if critic else None, reference, *reward.models)
    if sum(use_fast_cpu_linear(m, engine.device) for m in models if m is not None):
        notes.append("CPU linear layers: oneDNN (faster than MKL here)")
    chunked = {id(m): choose_head_logprobs(m, cfg.ppo.chunked_logprobs, cfg.engine.precision, engine)
               for m in (actor.module, reference) if m is not None}
    if any(chunked.values()):
        notes.append("response log-probs: LM head in chunks")
    # padding-free: the actor's rollout prefill, the policies' log-probs where they read hidden states (the head in
    # chunks), every scalar model
    models = [("actor", actor.module), ("critic", critic.module if critic else None), ("reference", reference),
              *(("reward", m) for m in reward.models)]
    packing = [name for name, m in models if m is not None and choose_padding_free(
        m, cfg.ppo.packing if chunked.get(id(m), True) or m is actor.module else False, cfg.engine.precision,
        engine)]
    if packing:
        notes.append(f"padding-free forwards: {', '.join(dict.fromkeys(packing))}")
    # a group's prompt, or the template's run every row begins with, once in one packed row with the rest: the
    # policies' response hidden states (where the head runs in chunks) and the critic's values
    packable = (("actor", actor.module, chunked.get(id(actor.module))), ("critic", critic.module if critic else None,
                True), ("reference", reference, chunked.get(id(reference))))
    grouped = [name for name, m, reads in packable if m is not None and reads
               and choose_group_packing(m, cfg.ppo.packing, cfg.engine.precision, engine)]
    if grouped:
        notes.append(f"shared prompts and prefixes in one packed forward: {', '.join(grouped)}")
    shared = [name for name, m in models[:3] if m is not None and choose_common_prefix(
        m, cfg.ppo.shared_prefix, cfg.engine.precision, engine)]
    if shared:
        notes.append(f"tokens every row begins with, computed once: {', '.join(shared)}")
    return PPOModels(actor, critic, reference, reward, notes)
