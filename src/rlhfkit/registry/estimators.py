"""Advantage estimators, one registered entry each; `ppo.advantage_estimator` names one.

An estimator turns a rollout batch carrying scores and per-token rewards (`experience.add_rewards`: the score on
the last valid token, -kl_coef * KL on every token) into advantages and returns, both (B, R) and 0 on masked
positions. Its entry says what it needs, and the rest of rlhfkit reads that instead of its name:
- the config: `ppo.advantage_estimator`'s choices and `--help`, the checks of `PPOSection.validate` (groups need
  n_samples_per_prompt >= 2, a KL in the loss refuses kl_coef and adaptive_kl, no critic refuses the critic's
  settings) and `PPOSection.without_effect` (the changed ESTIMATOR_SETTINGS it does not read, named in the run's
  first log line);
- the PPO stage: whether a critic is loaded, where the KL goes, whether the critic's values may be fused with its
  update (`row_local`), how the advantages are whitened.

To add an estimator, register its function here and test it in tests/unit/test_estimators.py: the config picks it
up with no other edit (a test registers a toy one to show it).

Nothing is imported at module level (the config reads this module, and `rlhfkit --help` must not import torch):
each function imports the torch math it calls from `rlhfkit.algos`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# The ppo.* settings that some estimators read and others do not; `Estimator.unread` is the part of these an
# estimator does not read. Settings that every estimator reads (score_clip, n_samples_per_prompt, the PPO loss's)
# are not listed.
ESTIMATOR_SETTINGS = ("gamma", "lam", "value_clip", "whiten_advantages", "grpo_scale_by_std", "value_head_init")
CRITIC_SETTINGS = ("value_clip", "value_head_init")  # of ESTIMATOR_SETTINGS, those only a critic reads
KL_PLACES = ("reward", "loss")
WHITENINGS = ("config", "global", "none")


@dataclass(frozen=True)
class Estimator:
    name: str
    advantages: Callable[[Any, Any], tuple]  # (batch: RolloutBatch, ppo: PPOSection) -> (advantages, returns), (B, R)
    doc: str  # one line for --help, naming the paper
    critic: bool  # reads V(s_t) from a value model in batch.values; False: no critic is loaded at all
    groups: bool  # compares the ppo.n_samples_per_prompt samples of a prompt (rows sharing batch.group): needs >= 2
    kl_in: str  # "reward": -kl_coef * KL per token in the shaped reward; "loss": a k3 term x ppo.kl_loss_coef
    reads: tuple[str, ...]  # the ESTIMATOR_SETTINGS its function reads (a critic's and whitening's: implied)
    row_local: bool  # a row's advantages need only that row: a critic's values may come micro-batch by micro-batch
    whiten: str  # "config": over the valid tokens of all ranks when ppo.whiten_advantages; "global": the same,
    # always (REINFORCE++); "none": the group statistics already normalise (GRPO, RLOO)
    algorithm: str | None = None  # the RL algorithm it makes, as the demo names it (`algorithms`); None: a variant

    def unread(self) -> tuple[str, ...]:
        """The ESTIMATOR_SETTINGS this estimator does not read, in that order."""
        read = set(self.reads) | set(CRITIC_SETTINGS if self.critic else ())
        read |= {"whiten_advantages"} if self.whiten == "config" else set()
        return tuple(key for key in ESTIMATOR_SETTINGS if key not in read)


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, *, doc: str, critic: bool, groups: bool, kl_in: str, reads: tuple[str, ...] = (),
                       row_local: bool, whiten: str, algorithm: str | None = None):
    """Decorator: enter `fn(batch, ppo) -> (advantages, returns)` in ESTIMATORS as `name` (fields: `Estimator`).
    An entry that contradicts itself is refused here, at import, naming itself."""

    def add(fn):
        problem = _refusal(name, kl_in, whiten, tuple(reads), algorithm)
        if problem:
            raise ValueError(f"advantage estimator {name!r} {problem}")
        ESTIMATORS[name] = Estimator(name, fn, doc, critic, groups, kl_in, tuple(reads), row_local, whiten, algorithm)
        return fn

    return add


def algorithms() -> dict[str, str]:
    """{algorithm: estimator name} of the estimators that make an RL algorithm of their own, in registration order:
    ppo (GAE with its critic), grpo, rloo, reinforce_pp. The demo's --algo and --algos choose among them."""
    return {e.algorithm: e.name for e in ESTIMATORS.values() if e.algorithm}


def _refusal(name: str, kl_in: str, whiten: str, reads: tuple[str, ...], algorithm: str | None) -> str | None:
    """Why an entry cannot be registered, or None."""
    if name in ESTIMATORS:
        return "is registered twice"
    if algorithm and algorithm in algorithms():
        return f"names algorithm {algorithm!r}, which estimator {algorithms()[algorithm]!r} makes already"
    if kl_in not in KL_PLACES or whiten not in WHITENINGS:
        return f"has kl_in={kl_in!r}, whiten={whiten!r}: expected one of {KL_PLACES} and one of {WHITENINGS}"
    unknown = sorted(set(reads) - set(ESTIMATOR_SETTINGS))
    if unknown:
        return f"reads {unknown}, not among ESTIMATOR_SETTINGS (a new ppo.* setting is added there)"
    implied = sorted(set(reads) & {*CRITIC_SETTINGS, "whiten_advantages"})
    if implied:
        return f"lists {implied} in reads: critic= and whiten= imply them"
    return None


def clipped_scores(batch, ppo):
    """(B,) the outcome scores as floats, clipped to ppo.score_clip as in the shaped reward."""
    scores = batch.scores.float()
    return scores.clamp(-ppo.score_clip, ppo.score_clip) if ppo.score_clip is not None else scores


@register_estimator("gae", critic=True, groups=False, kl_in="reward", reads=("gamma", "lam"), row_local=True,
                    whiten="config", algorithm="ppo",
                    doc="GAE (Schulman et al. 2016) with the critic's values: PPO as in InstructGPT")
def gae(batch, ppo):
    """Generalised advantage estimation over the shaped rewards, with the critic's values (ppo.gamma, ppo.lam)."""
    from rlhfkit.algos import compute_gae

    return compute_gae(batch.rewards, batch.values, batch.response_mask, ppo.gamma, ppo.lam)


@register_estimator("grpo", critic=False, groups=True, kl_in="loss", reads=("grpo_scale_by_std",), row_local=False,
                    whiten="none", algorithm="grpo",
                    doc="GRPO (Shao et al. 2024): the score standardised within its prompt's group")
def grpo(batch, ppo):
    """(r - group mean) / (group std + eps) on every response token (ppo.grpo_scale_by_std=false: Dr.GRPO's
    r - group mean)."""
    from rlhfkit.algos import broadcast_to_tokens, grpo_advantages, per_group

    adv = per_group(grpo_advantages, clipped_scores(batch, ppo), batch.group, ppo.n_samples_per_prompt, batch.judged,
                    scale_by_std=ppo.grpo_scale_by_std)
    tokens = broadcast_to_tokens(adv, batch.response_mask)
    return tokens, tokens


@register_estimator("rloo", critic=False, groups=True, kl_in="loss", row_local=False, whiten="none",
                    algorithm="rloo",
                    doc="RLOO (Ahmadian et al. 2024): the score minus the mean of the prompt's other samples")
def rloo(batch, ppo):
    """r - the mean of the other n - 1 samples of the prompt, on every response token."""
    from rlhfkit.algos import broadcast_to_tokens, per_group, rloo_advantages

    adv = per_group(rloo_advantages, clipped_scores(batch, ppo), batch.group, ppo.n_samples_per_prompt, batch.judged)
    tokens = broadcast_to_tokens(adv, batch.response_mask)
    return tokens, tokens


@register_estimator("reinforce_pp", critic=False, groups=False, kl_in="reward", reads=("gamma",), row_local=True,
                    whiten="global", algorithm="reinforce_pp",
                    doc="REINFORCE++ (Hu 2025): KL-shaped discounted returns, whitened over the global batch")
def reinforce_pp(batch, ppo):
    """Discounted returns of the shaped rewards (score - beta * KL per token), ppo.gamma; whitened globally."""
    from rlhfkit.algos import discounted_returns

    returns = discounted_returns(batch.rewards, batch.response_mask, ppo.gamma)
    return returns, returns


@register_estimator("reinforce_pp_baseline", critic=False, groups=True, kl_in="reward", reads=("gamma",),
                    row_local=False, whiten="global",
                    doc="REINFORCE++ with the prompt's group mean as the score's baseline")
def reinforce_pp_baseline(batch, ppo):
    """REINFORCE++ with the prompt's group mean subtracted from the score before the returns."""
    import torch

    from rlhfkit.algos import discounted_returns, group_baseline, last_valid_index, per_group

    scores = clipped_scores(batch, ppo)
    baseline = scores - per_group(group_baseline, scores, batch.group, ppo.n_samples_per_prompt)  # group means
    last = last_valid_index(batch.response_mask)  # (B,) where the score sits in the shaped reward
    rewards = batch.rewards.clone()
    rewards[torch.arange(batch.size, device=rewards.device), last] -= baseline.to(rewards.dtype)
    returns = discounted_returns(rewards, batch.response_mask, ppo.gamma)
    return returns, returns
