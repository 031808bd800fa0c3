"""The alarm rules: each reads one or a few metrics of a run's logged rows and says whether they moved too far.

A metric's *level* is the mean of its first `baseline` logged values (the run before training changed much);
its *current* value is the mean of its last `window` logged values after those, which smooths one noisy
iteration away. A rule compares the two against its limits (`LIMITS`, the `monitor.*` config keys) and returns
an `Alarm` naming what moved, from what to what, by how much and since which step, or None. KL and group
collapse have absolute limits instead (the current value past a number of nats, a share above a limit for
several iterations in a row). A rule whose metrics are not logged (a DPO run has no response lengths, a PPO run no
chosen log-probs) never fires; nor does a rule with a level before `baseline + window` values, so a run shorter
than that is not watched for drift. The defaults are set so that healthy runs stay quiet; docs/monitors.md says
what each alarm usually means and what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from rlhfkit.metric_names import EVAL_GOLD, EVAL_GOLD_SE, EVAL_REWARD, KL, KL_MAX, REWARD_MEAN, REWARD_STD

Points = list[tuple[int, float]]  # (step, value), in logging order


@dataclass(frozen=True)
class Finding:
    """What a rule's check found."""

    metric: str  # the metric that moved (the first, where a rule reads several)
    level: float  # its level: the mean of its first `baseline` values
    value: float  # its current value: the mean of its last `window` values
    since: int  # the first step of the current streak whose current value was past the limit
    moved: str  # what moved, from what to what, by how much: the body of the alarm's line


@dataclass(frozen=True)
class Alarm(Finding):
    rule: str = ""  # the RULES entry that fired; its metric in metrics.jsonl is alarm/<rule>
    title: str = ""  # what it usually means, in a few words ("KL blow-up")

    def line(self) -> str:
        """The one line an alarm prints."""
        return f"alarm: {self.moved} since step {self.since}: {self.title}; see docs/monitors.md"


@dataclass(frozen=True)
class Limit:
    default: float
    doc: str
    valid: Callable[[float], bool]
    rule: str  # what `valid` requires, for the error message


def _share(x: float) -> bool:
    return 0 < x < 1


def _count(x: float) -> bool:
    return x >= 1 and float(x).is_integer()


# name -> the limit's default, its one-line doc (`--help`), and what a valid value is
LIMITS: dict[str, Limit] = {
    "baseline": Limit(5, "a metric's level: the mean of its first this many logged values", _count,
                      "a whole number >= 1"),
    "window": Limit(3, "a metric's current value: the mean of its last this many logged values after the level's "
                       "(the run is watched from baseline + window logged iterations on)", _count,
                    "a whole number >= 1"),
    "length_change": Limit(0.5, "length drift: the mean response_length moves more than this share away from its "
                                "level (0.5: up by half, or down by half)", lambda x: x > 0, "> 0"),
    "tail_change": Limit(0.5, "length tails: the same for response_length/p90, the 90th percentile", lambda x: x > 0,
                         "> 0"),
    "repeat_rise": Limit(0.2, "repetition: response/repeated_4grams (the share of a response's 4-grams of tokens "
                              "that repeat an earlier one) rises this much above its level", lambda x: 0 < x <= 1,
                         "in (0, 1]"),
    "entropy_drop": Limit(0.75, "entropy collapse: the policy's entropy falls by more than this share of its level",
                          _share, "in (0, 1)"),
    "kl_nats": Limit(20.0, "KL blow-up: the mean KL to the reference exceeds this many nats per response (a "
                           "separate reference, not the starting policy, may need more)", lambda x: x > 0, "> 0"),
    "kl_max_nats": Limit(100.0, "KL blow-up in the tail: kl/max (the batch's largest KL of one response) exceeds this "
                                "many nats", lambda x: x > 0, "> 0"),
    "group_share": Limit(0.9, "group collapse: group/all_equal (the share of groups whose samples all scored alike: "
                              "no gradient) is above this ...", _share, "in (0, 1)"),
    "group_patience": Limit(3, "... for this many logged iterations in a row", _count, "a whole number >= 1"),
    "truncation_rise": Limit(0.35, "truncation creep: the share of responses cut at gen.max_new_tokens (1 - "
                                   "response/finished) rises this much above its level", lambda x: 0 < x <= 1,
                             "in (0, 1]"),
    "reward_std_drop": Limit(0.8, "reward collapse: reward/std (the spread of an iteration's rewards) falls by more "
                                  "than this share of its level in each of the last `window` iterations", _share,
                             "in (0, 1)"),
    "reward_shift": Limit(4.0, "reward jump: reward/mean moves more than this many times its level's reward/std "
                               "away from its level", lambda x: x > 0, "> 0"),
    "displacement_share": Limit(0.5, "DPO likelihood displacement: logps/chosen and logps/rejected both fall by more "
                                     "than this share of their levels (0.5: -9 nats to below -13.5) while the margin "
                                     "grows", lambda x: x > 0, "> 0"),
    "gap_se": Limit(2.0, "proxy up, truth down: eval/gold (the held-out judge, eval.judge) falls below its best so far "
                         "by more than this many standard errors of the difference while eval/reward (the training "
                         "reward on the same responses) is above its value at that best", lambda x: x > 0, "> 0"),
}
DEFAULT_LIMITS = {name: limit.default for name, limit in LIMITS.items()}


# ------------------------------------------------------------------------------------------ streams and levels


def series(rows: list[dict], metric: str) -> Points:
    """(step, value) of every row that logged `metric` as a finite number."""
    out = []
    for row in rows:
        value = row.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((int(row["step"]), float(value)))
    return out


def _mean(points: Points) -> float:
    return sum(v for _, v in points) / len(points)


@dataclass(frozen=True)
class Shift:
    level: float
    steps: tuple[int, int]  # the first and last step of the level
    value: float
    since: int
    window: int  # the current value is the mean of this many last values (not the last one, which the bar shows)

    def over(self) -> str:
        return f"its level over steps {self.steps[0]}-{self.steps[1]}, now the mean of its last {self.window}"


def shift(points: Points, limits: dict, moved: Callable[[float, float], bool]) -> Optional[Shift]:
    """The metric's level and current value when `moved(level, current)`, with the first step of the streak of
    current values (each the mean of `window` values, all after the level's) for which it held; None when it does
    not hold now or the stream is shorter than baseline + window."""
    n, w = int(limits["baseline"]), int(limits["window"])
    if len(points) < n + w:
        return None
    level = _mean(points[:n])
    current = _mean(points[-w:])
    if not moved(level, current):
        return None
    end = len(points)  # the streak: walk back while the window ending one value earlier also moved
    while end - 1 >= n + w and moved(level, _mean(points[end - 1 - w:end - 1])):
        end -= 1
    return Shift(level, (points[0][0], points[n - 1][0]), current, points[end - 1][0], w)


def _fmt(x: float) -> str:
    """3 significant digits; rounding noise (a KL of -3e-07 where the policy is the reference) as 0."""
    return "0" if abs(x) < 5e-4 else f"{x:.3g}"


def _relative(metric: str, unit: str, limit: str):
    """A rule on `metric` moving more than `limits[limit]` (a share) away from its level, either way."""
    def check(rows: list[dict], limits: dict) -> Optional[Finding]:
        change = limits[limit]
        s = shift(series(rows, metric), limits, lambda lv, cur: lv > 0 and abs(cur / lv - 1) > change)
        if s is None:
            return None
        return Finding(metric, s.level, s.value, s.since,
                     f"{metric} {_fmt(s.level)} -> {_fmt(s.value)}{unit} ({(s.value / s.level - 1):+.0%} on "
                     f"{s.over()})")
    return check


def _rise(metric: str, limit: str, values=lambda points: points, shown: str = ""):
    """A rule on `metric` (after `values`, e.g. 1 - x) rising more than `limits[limit]` above its level."""
    def check(rows: list[dict], limits: dict) -> Optional[Finding]:
        rise = limits[limit]
        s = shift(values(series(rows, metric)), limits, lambda lv, cur: cur - lv > rise)
        if s is None:
            return None
        name = shown or metric
        return Finding(name, s.level, s.value, s.since,
                     f"{name} {_fmt(s.level)} -> {_fmt(s.value)} ({s.value - s.level:+.3g} on {s.over()})")
    return check


def _fall(metric: str, limit: str):
    """A rule on a positive `metric` falling by more than `limits[limit]` (a share) of its level."""
    def check(rows: list[dict], limits: dict) -> Optional[Finding]:
        drop = limits[limit]
        s = shift(series(rows, metric), limits, lambda lv, cur: lv > 0 and cur < (1 - drop) * lv)
        if s is None:
            return None
        return Finding(metric, s.level, s.value, s.since,
                     f"{metric} {_fmt(s.level)} -> {_fmt(s.value)} ({s.value / s.level - 1:+.0%} on {s.over()})")
    return check


def _blowup(metric: str, limit: str):
    """KL past `limits[limit]` nats: an absolute limit, watched from the `window`-th value on (the KL to the
    reference starts at 0, where the policy is the reference, so it needs no level, and a recipe that breaks in its
    first iterations would have spoiled one); the line shows the first logged value for scale."""
    def check(rows: list[dict], limits: dict) -> Optional[Finding]:
        nats, w = limits[limit], int(limits["window"])
        points = series(rows, metric)
        if len(points) < w or _mean(points[-w:]) <= nats:
            return None
        end = len(points)
        while end - 1 >= w and _mean(points[end - 1 - w:end - 1]) > nats:
            end -= 1
        (step, first), current = points[0], _mean(points[-w:])
        # the mean of the last w values, which is not the last value the bar shows: the line says which it is
        return Finding(metric, first, current, points[end - 1][0],
                       f"{metric} {_fmt(current)} nats, the mean of its last {w} logged values (past {nats:g} nats; "
                       f"{_fmt(first)} at step {step})")
    return check


# ------------------------------------------------------------------------------------ rules of their own


def truncation(points: Points) -> Points:
    """response/finished -> the share of responses cut at the token limit."""
    return [(step, 1.0 - value) for step, value in points]


def group_collapse(rows: list[dict], limits: dict) -> Optional[Finding]:
    """group/all_equal above `group_share` for the last `group_patience` logged iterations: most groups carry no
    gradient (an absolute condition: it needs no level, and a run that starts collapsed is told so)."""
    points, share, patience = series(rows, "group/all_equal"), limits["group_share"], int(limits["group_patience"])
    if len(points) < patience or not all(v > share for _, v in points[-patience:]):
        return None
    start = len(points) - patience
    while start > 0 and points[start - 1][1] > share:
        start -= 1
    head = points[:int(limits["baseline"])]
    level, current = _mean(head), _mean(points[-patience:])
    # an absolute limit: what matters is the share now and for how long; where it was at the start is said only
    # where the run did not start collapsed
    start_note = "every logged iteration" if start == 0 else \
        f"the last {len(points) - start} logged iterations; {_fmt(level)} over steps {head[0][0]}-{head[-1][0]}"
    return Finding("group/all_equal", level, current, points[start][0],
                   f"group/all_equal {_fmt(current)} (the share of groups whose samples all scored alike, above "
                   f"{share:g} in {start_note})")


def reward_std_collapse(rows: list[dict], limits: dict) -> Optional[Finding]:
    """reward/std below (1 - `reward_std_drop`) x its level in each of the last `window` logged iterations: a
    sustained collapse. Each one, not their mean: with few prompts per iteration, a batch that happens to score all
    alike is common once a policy is good, and one or two such batches are not a collapse."""
    n, w, drop = int(limits["baseline"]), int(limits["window"]), limits["reward_std_drop"]
    points = series(rows, REWARD_STD)
    if len(points) < n + w:
        return None
    level = _mean(points[:n])
    if level <= 0 or not all(v < (1 - drop) * level for _, v in points[-w:]):
        return None
    start = len(points) - w
    while start > n and points[start - 1][1] < (1 - drop) * level:
        start -= 1
    current = _mean(points[-w:])
    return Finding(REWARD_STD, level, current, points[start + w - 1][0],
                   f"{REWARD_STD} {_fmt(level)} -> {_fmt(current)} ({current / level - 1:+.0%} on its level over steps "
                   f"{points[0][0]}-{points[n - 1][0]}; each of the last {w} below {1 - drop:g} x it)")


def reward_jump(rows: list[dict], limits: dict) -> Optional[Finding]:
    """reward/mean moved more than `reward_shift` x its level's reward/std away from its level."""
    n = int(limits["baseline"])
    spread = series(rows, REWARD_STD)[:n]
    if len(spread) < n or _mean(spread) <= 0:
        return None
    std, k = _mean(spread), limits["reward_shift"]
    s = shift(series(rows, REWARD_MEAN), limits, lambda lv, cur: abs(cur - lv) > k * std)
    if s is None:
        return None
    return Finding(REWARD_MEAN, s.level, s.value, s.since,
                   f"{REWARD_MEAN} {_fmt(s.level)} -> {_fmt(s.value)} ({(s.value - s.level) / std:+.1f} x its level's "
                   f"{REWARD_STD} {_fmt(std)}, on {s.over()})")


def likelihood_displacement(rows: list[dict], limits: dict) -> Optional[Finding]:
    """DPO: the chosen and the rejected log-probs both fallen by more than `displacement_share` of their levels
    while the margin is above its level (Razin et al. 2024, "Unintentional unalignment"; Pal et al. 2024, DPOP):
    the policy widens the margin by making both answers unlikely, and the mass goes to responses in neither. A
    share, not nats: the log-probs are summed over a response, so the same change per token moves a long
    response's by more nats."""
    share = limits["displacement_share"]
    fell = shift(series(rows, "logps/chosen"), limits, lambda lv, cur: lv - cur > share * abs(lv))
    rejected = shift(series(rows, "logps/rejected"), limits, lambda lv, cur: lv - cur > share * abs(lv))
    margin = shift(series(rows, "margin"), limits, lambda lv, cur: cur > lv)
    if fell is None or rejected is None or margin is None:
        return None
    since = max(fell.since, rejected.since, margin.since)
    return Finding("logps/chosen", fell.level, fell.value, since,
                   f"logps/chosen {_fmt(fell.level)} -> {_fmt(fell.value)} nats and logps/rejected "
                   f"{_fmt(rejected.level)} -> {_fmt(rejected.value)} nats (down {fell.level - fell.value:.3g} and "
                   f"{rejected.level - rejected.value:.3g} from {fell.over()}) while the margin grew "
                   f"{_fmt(margin.level)} -> {_fmt(margin.value)}")


def proxy_truth_gap(rows: list[dict], limits: dict) -> Optional[Finding]:
    """Gao et al. 2022: the held-out judge's eval/gold below its best so far by more than `gap_se` standard errors
    of the difference (eval/gold_se at both evaluations) while eval/reward, the proxy on the same responses, is
    above its value at that best. Evaluations are few, so each one counts (no level or window)."""
    gold, se, proxy = series(rows, EVAL_GOLD), dict(series(rows, EVAL_GOLD_SE)), dict(series(rows, EVAL_REWARD))

    def parted(i: int) -> Optional[tuple]:
        step, value = gold[i]
        best_step, best = max(gold[:i + 1], key=lambda p: (p[1], -p[0]))  # the highest, the earliest among equals
        spread = (se.get(best_step, 0.0) ** 2 + se.get(step, 0.0) ** 2) ** 0.5
        if best - value <= limits["gap_se"] * spread or best <= value or step not in proxy or best_step not in proxy \
                or proxy[step] <= proxy[best_step]:
            return None
        return best_step, best, value, spread

    found = parted(len(gold) - 1) if len(gold) >= 2 else None
    if found is None:
        return None
    start = len(gold) - 1
    while start > 1 and parted(start - 1):
        start -= 1
    best_step, best, value, spread = found
    step = gold[-1][0]
    drop = f"{(value - best) / spread:+.1f} SE" if spread > 0 else "every response judged alike"
    return Finding(EVAL_GOLD, best, value, gold[start][0],
                   f"{EVAL_GOLD} {_fmt(best)} (step {best_step}) -> {_fmt(value)} ({drop}) while {EVAL_REWARD} rose "
                   f"{_fmt(proxy[best_step])} -> {_fmt(proxy[step])}")


@dataclass(frozen=True)
class Rule:
    title: str  # what an alarm usually means, in a few words: the end of its line
    metrics: tuple[str, ...]  # what it reads (it never fires where none of them is logged)
    check: Callable[[list[dict], dict], Optional[Finding]]


# name -> rule; the name is the alarm's metric in metrics.jsonl (alarm/<name>) and its section in docs/monitors.md
RULES: dict[str, Rule] = {
    "length_drift": Rule("length drift: responses grow or shrink to please the reward", ("response_length",),
                         _relative("response_length", " tokens", "length_change")),
    "length_tail": Rule("length tail drift: the longest responses run away", ("response_length/p90",),
                        _relative("response_length/p90", " tokens", "tail_change")),
    "repetition": Rule("repetition: degenerate, looping text", ("response/repeated_4grams",),
                       _rise("response/repeated_4grams", "repeat_rise")),
    "entropy_collapse": Rule("entropy collapse: the policy stopped exploring", ("entropy",),
                             _fall("entropy", "entropy_drop")),
    "kl_blowup": Rule("KL blow-up: the policy left the reference behind", (KL,), _blowup(KL, "kl_nats")),
    "kl_max_blowup": Rule("KL blow-up in the tail: some responses left the reference far behind", (KL_MAX,),
                          _blowup(KL_MAX, "kl_max_nats")),
    "group_collapse": Rule("group collapse: most groups scored all alike, no gradient", ("group/all_equal",),
                           group_collapse),
    "truncation_creep": Rule("truncation creep: more responses hit gen.max_new_tokens", ("response/finished",),
                             _rise("response/finished", "truncation_rise", truncation, "truncation")),
    "reward_std_collapse": Rule("reward collapse: every response scores alike", (REWARD_STD,),
                                reward_std_collapse),
    "reward_jump": Rule("reward jump: the policy may have found a flaw of the reward (check held-out truth)",
                        (REWARD_MEAN, REWARD_STD), reward_jump),
    "likelihood_displacement": Rule("DPO likelihood displacement: chosen and rejected both made unlikely",
                                    ("logps/chosen", "logps/rejected", "margin"), likelihood_displacement),
    "proxy_truth_gap": Rule("proxy up, truth down: the policy games its reward (best/ keeps the judge's best)",
                            (EVAL_GOLD, EVAL_GOLD_SE, EVAL_REWARD), proxy_truth_gap),
}


def check_rule(name: str, rows: list[dict], limits: dict) -> Optional[Alarm]:
    """RULES[name] on the logged `rows` (metrics.jsonl rows, each with its "step") under `limits` (`LIMITS`'
    names): an Alarm, or None while the rule holds its peace."""
    rule = RULES[name]
    found = rule.check(rows, limits)
    return None if found is None else Alarm(**vars(found), rule=name, title=rule.title)
