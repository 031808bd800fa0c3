"""A run's monitor: the logged rows so far, and which alarms are up.

    monitor = Monitor(limits)                  # LIMITS' names -> values (config: monitor.*)
    for alarm in monitor.observe({"step": 12, "kl": 31.0, ...}):
        print(alarm.line())

An alarm is reported once, when its rule first fires; it is up until the rule stops firing (its condition
cleared), and fires again if the condition comes back.
"""

from __future__ import annotations

from rlhfkit.monitors.rules import DEFAULT_LIMITS, RULES, Alarm, check_rule

WATCHED = frozenset(metric for rule in RULES.values() for metric in rule.metrics)


class Monitor:
    def __init__(self, limits: dict | None = None):
        self.limits = {**DEFAULT_LIMITS, **(limits or {})}
        self.rows: list[dict] = []  # the watched metrics of each observed row, with its step
        self.up: set[str] = set()  # the rules whose alarm is up

    def observe(self, row: dict) -> list[Alarm]:
        """Add one logged row (a metrics.jsonl row: "step" and the metrics); return the alarms it raised."""
        self.rows.append({"step": row["step"], **{k: v for k, v in row.items() if k in WATCHED}})
        raised = []
        for name in RULES:
            alarm = check_rule(name, self.rows, self.limits)
            if alarm is None:
                self.up.discard(name)
            elif name not in self.up:
                self.up.add(name)
                raised.append(alarm)
        return raised

    def replay(self, rows: list[dict]) -> None:
        """Observe the rows a resumed run had logged, silently: their alarms were printed by that run."""
        for row in rows:
            if isinstance(row.get("step"), int):
                self.observe(row)
