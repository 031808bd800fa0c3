"""The metric names that more than one part of rlhfkit writes or reads: the stages log them (metrics.jsonl,
TensorBoard, the bar), the monitors watch them (monitors/rules.py), best/ chooses by them (stages/best.py), the
pipeline's summary lists them and the report draws them. One constant each: a renamed metric is renamed everywhere.

A held-out evaluation's metrics start with `EVAL_PREFIX`; a pooled score also logs its `_std` and its `_se` (the
standard error of its mean: `standard_error`). Imports nothing.
"""

from __future__ import annotations

EVAL_PREFIX = "eval/"
ALARM_PREFIX = "alarm/"

# the training step's
KL = "kl"  # nats per response to the reference, the ppo.kl_estimator's
KL_MAX = "kl/max"  # the largest response's
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
REWARD_UNJUDGED = "reward/unjudged"  # responses the reward left unjudged (None)
REMOTE_FAILED = "reward/remote_failed"  # responses a reward server did not score (remote/client.py)
TIME_STEP = "time/step"  # seconds of an SFT, RM or DPO step
TIME_ITERATION = "time/iteration"  # seconds of a PPO iteration

# the held-out evaluation's
EVAL_LOSS = "eval/loss"
EVAL_PERPLEXITY = "eval/perplexity"
EVAL_ACCURACY = "eval/accuracy"  # a reward model's or DPO's: chosen scored above rejected
EVAL_MARGIN = "eval/margin"
EVAL_REWARD = "eval/reward"  # the training reward on held-out prompts
EVAL_GOLD = "eval/gold"  # the second judge's (eval.judge) on the same responses
EVAL_KL = "eval/kl"
EVAL_RESPONSE_LENGTH = "eval/response_length"
EVAL_FINISHED = "eval/finished"


def standard_error(name: str) -> str:
    """The metric holding the standard error of `name`'s mean: eval/reward -> eval/reward_se."""
    return f"{name}_se"


def alarm_metric(rule: str) -> str:
    """The metric a monitor rule logs (1) at the step it fired: alarm/<rule>."""
    return f"{ALARM_PREFIX}{rule}"


EVAL_REWARD_SE = standard_error(EVAL_REWARD)
EVAL_GOLD_SE = standard_error(EVAL_GOLD)
