"""The `monitor` section of `rlhfkit ppo` and `rlhfkit dpo`: run-time alarms on the logged metrics
(monitors/rules.py, docs/monitors.md). Each limit's default and doc are its `LIMITS` entry's."""

from __future__ import annotations

from dataclasses import dataclass, fields

from rlhfkit.config.fields import option
from rlhfkit.errors import ConfigError
from rlhfkit.monitors.rules import LIMITS

MONITOR_ACTIONS = ("warn", "stop", "stop_best")


def limit(name: str):
    """The config field of LIMITS[name]: its default and doc."""
    entry = LIMITS[name]
    return option(entry.default, entry.doc)


@dataclass
class MonitorSection:
    """Alarms on the run's logged metrics (docs/monitors.md): one line in the log and alarm/<rule> = 1 in
    metrics.jsonl when a rule fires; with action=stop the run ends there as at its last step (final/ exported)."""

    enabled: bool = option(True, "watch the logged metrics and raise alarms (docs/monitors.md)")
    action: str = option("warn", "on an alarm: warn (one line in the log, the run goes on), stop (the run ends "
                                 "at that step as at its last: final/ exported, the summary names the alarm) or "
                                 "stop_best (as stop, and the run's model is best/, the policy of the best held-out "
                                 "score: rlhfkit ppo with eval.keep_best)",
                         choices=MONITOR_ACTIONS)
    baseline: int = limit("baseline")
    window: int = limit("window")
    length_change: float = limit("length_change")
    tail_change: float = limit("tail_change")
    repeat_rise: float = limit("repeat_rise")
    entropy_drop: float = limit("entropy_drop")
    kl_nats: float = limit("kl_nats")
    kl_max_nats: float = limit("kl_max_nats")
    group_share: float = limit("group_share")
    group_patience: int = limit("group_patience")
    truncation_rise: float = limit("truncation_rise")
    reward_std_drop: float = limit("reward_std_drop")
    reward_shift: float = limit("reward_shift")
    displacement_share: float = limit("displacement_share")
    gap_se: float = limit("gap_se")

    def limits(self) -> dict[str, float]:
        """The rules' limits by name (`monitors.Monitor(limits)`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in LIMITS}

    def validate(self, prefix: str = "") -> None:
        if self.action not in MONITOR_ACTIONS:
            raise ConfigError(f"config key '{prefix}action': expected one of {MONITOR_ACTIONS}, got {self.action!r}")
        for name, value in self.limits().items():
            if not LIMITS[name].valid(value):
                raise ConfigError(f"config key '{prefix}{name}': {LIMITS[name].rule}, got {value!r}")
