"""Run-time monitors: alarm rules over a run's logged metrics, as metrics.jsonl rows have them (docs/monitors.md).

`rules.RULES` names each rule, the metrics it reads and its check, a pure function of the rows and the limits;
`watch.Monitor` feeds them one logged row at a time and reports an alarm once, until its condition clears;
`signals` computes the cheap per-iteration statistics a rule needs that a stage would not log otherwise. Nothing
here imports torch, a config object or torch.distributed: the training loop decides which rank watches.
"""

from rlhfkit.monitors.rules import DEFAULT_LIMITS, LIMITS, RULES, Alarm, Limit, Rule, check_rule
from rlhfkit.monitors.signals import repeated_ngram_share
from rlhfkit.monitors.watch import Monitor

__all__ = ["Alarm", "DEFAULT_LIMITS", "LIMITS", "Limit", "Monitor", "RULES", "Rule", "check_rule",
           "repeated_ngram_share"]
