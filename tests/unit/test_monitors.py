"""The alarm rules on hand-built metric streams: each fires with the right numbers and step, stays quiet on a
healthy stream with noise, clears and fires again; the monitor section's validation; the cheap signals."""

from __future__ import annotations

import random

import pytest

from rlhfkit.config import DPOConfig, load_config
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.errors import ConfigError
from rlhfkit.monitors import DEFAULT_LIMITS, LIMITS, RULES, Monitor, check_rule, repeated_ngram_share

LIMITS_ = dict(DEFAULT_LIMITS)  # baseline 5, window 3


def stream(**metrics) -> list[dict]:
    """Rows step 1.. from per-metric value lists of equal length."""
    n = len(next(iter(metrics.values())))
    return [{"step": i + 1, **{k: v[i] for k, v in metrics.items()}} for i in range(n)]


def healthy(seed: int = 0, n: int = 60) -> list[dict]:
    """A run that learns slowly and stays well: noise on every metric, gentle trends, nothing past a limit."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        rows.append({"step": i + 1, "response_length": 40 * (1 + 0.15 * i / n) + rng.gauss(0, 3),
                     "response_length/p90": 60 + rng.gauss(0, 5), "response/repeated_4grams": 0.05 + rng.gauss(0, .02),
                     "entropy": 1.2 * (1 - 0.3 * i / n) + rng.gauss(0, 0.05), "kl": 0.1 + 4 * i / n + rng.gauss(0, .2),
                     "kl/max": 2 + 20 * i / n + rng.gauss(0, 2), "group/all_equal": 0.3 + rng.gauss(0, 0.1),
                     "response/finished": 0.95 + rng.uniform(-0.05, 0.05),
                     "reward/mean": 0.5 + 0.3 * i / n + rng.gauss(0, 0.03), "reward/std": 0.25 + rng.gauss(0, 0.02),
                     "logps/chosen": -9 - 1.0 * i / n + rng.gauss(0, 0.3),
                     "logps/rejected": -9 - 4 * i / n + rng.gauss(0, 0.3), "margin": 0.3 * i / n + rng.gauss(0, .05)})
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_noisy_run_raises_no_alarm(seed):
    monitor = Monitor(LIMITS_)
    raised = [a for row in healthy(seed) for a in monitor.observe(row)]
    assert raised == []


def test_length_drift_fires_with_its_numbers_and_the_step_it_started():
    lengths = [40, 42, 38, 40, 40] + [41, 39, 40] + [70, 70, 70, 70]  # level 40 over steps 1-5
    rows = stream(response_length=lengths)
    # the current value is the mean of the last 3: at step 10 (40+70+70)/3 = 60 is +50%, not past it; step 11: 70
    assert check_rule("length_drift", rows[:10], LIMITS_) is None
    alarm = check_rule("length_drift", rows[:11], LIMITS_)
    assert (alarm.level, alarm.value, alarm.since, alarm.metric) == (40, 70, 11, "response_length")
    assert alarm.line() == ("alarm: response_length 40 -> 70 tokens (+75% on its level over steps 1-5, now the mean "
                            "of its last 3) since step 11: length drift: responses grow or shrink to please the reward; see docs/monitors.md")
    # shrinking fires too
    short = check_rule("length_drift", stream(response_length=[40] * 5 + [15] * 3), LIMITS_)
    assert short.value == 15 and short.since == 8 and "-62%" in short.line()


def test_no_drift_is_watched_before_baseline_plus_window_values():
    rows = stream(response_length=[40] * 5 + [400, 400], entropy=[2] * 5 + [0.1, 0.1])
    assert all(check_rule(name, rows, LIMITS_) is None for name in RULES)
    assert check_rule("length_drift", stream(response_length=[40] * 5 + [400] * 3), LIMITS_) is not None


def test_length_tail_repetition_truncation_and_entropy():
    tail = check_rule("length_tail", stream(**{"response_length/p90": [60] * 8 + [100] * 3}), LIMITS_)
    assert tail.metric == "response_length/p90" and tail.since == 11  # (60 + 100 + 100) / 3 = 86.7: +44%, not yet
    rep = check_rule("repetition", stream(**{"response/repeated_4grams": [0.05] * 8 + [0.4] * 3}), LIMITS_)
    assert rep.level == pytest.approx(0.05) and rep.value == pytest.approx(0.4) and rep.since == 10
    assert check_rule("repetition", stream(**{"response/repeated_4grams": [0.05] * 8 + [0.2] * 3}), LIMITS_) is None
    trunc = check_rule("truncation_creep", stream(**{"response/finished": [1.0] * 5 + [0.9, 1.0, 1.0] + [0.5] * 3}),
                       LIMITS_)
    # (0 + 0.5 + 0.5) / 3 = 0.33 at step 10 is not 0.35 above the level of 0; 0.5 at step 11 is
    assert trunc.metric == "truncation" and trunc.value == pytest.approx(0.5) and trunc.since == 11
    assert "truncation 0 -> 0.5 (+0.5 on its level over steps 1-5, now the mean of its last 3)" in trunc.line()
    ent = check_rule("entropy_collapse", stream(entropy=[2.0] * 5 + [1.5] * 3 + [0.3] * 3), LIMITS_)
    # a quarter of the level is 0.5: (1.5 + 0.3 + 0.3) / 3 = 0.7 at step 10 is not below it, 0.3 at step 11 is
    assert ent.since == 11 and ent.value == pytest.approx(0.3) and "-85%" in ent.line()


def test_kl_blowup_is_an_absolute_limit_watched_from_the_window_on():
    rows = stream(kl=[0.0] * 5 + [1.0] * 3 + [12.4] * 3)
    assert check_rule("kl_blowup", rows, LIMITS_) is None  # 12.4 < 20 nats
    alarm = check_rule("kl_blowup", rows, {**LIMITS_, "kl_nats": 10})
    # the window's mean (not the last value the bar shows), said as such
    assert alarm.line().startswith("alarm: kl 12.4 nats, the mean of its last 3 logged values (past 10 nats; 0 at "
                                   "step 1) since step 11: KL blow-up")
    # a recipe that breaks at once: no level is needed, the third value is watched (the mean of steps 1-3 is 54)
    early = check_rule("kl_blowup", stream(kl=[0.0, 99.0, 62.0]), LIMITS_)
    assert early.since == 3 and early.value == pytest.approx(161 / 3)
    high = check_rule("kl_max_blowup", stream(**{"kl/max": [3.0] * 8 + [150.0] * 3}), LIMITS_)
    assert high.metric == "kl/max" and high.since == 10


def test_group_collapse_needs_patience_iterations_in_a_row():
    shares = [0.2] * 5 + [0.95, 0.95, 0.5, 0.95, 0.95]
    assert check_rule("group_collapse", stream(**{"group/all_equal": shares}), LIMITS_) is None  # two in a row
    alarm = check_rule("group_collapse", stream(**{"group/all_equal": shares + [1.0]}), LIMITS_)
    assert alarm.since == 9 and alarm.level == pytest.approx(0.2) and alarm.value == pytest.approx((0.95 * 2 + 1) / 3)
    assert alarm.line().startswith("alarm: group/all_equal 0.967 (the share of groups whose samples all scored alike, "
                                   "above 0.9 in the last 3 logged iterations; 0.2 over steps 1-5) since step 9")
    # a run that starts collapsed is told so (no level needed), without a "1 -> 1" from itself to itself
    collapsed = check_rule("group_collapse", stream(**{"group/all_equal": [1.0] * 3}), LIMITS_)
    assert collapsed.since == 1 and collapsed.line().startswith(
        "alarm: group/all_equal 1 (the share of groups whose samples all scored alike, above 0.9 in every logged "
        "iteration) since step 1")


def test_reward_std_collapse_and_reward_jump():
    std = [0.3] * 5 + [0.3] * 3 + [0.03] * 3
    collapse = check_rule("reward_std_collapse", stream(**{"reward/std": std}), LIMITS_)
    # each of the last 3 below 0.2 x level = 0.06 from step 11 on; it is sustained, so "since" is where it began
    assert collapse.since == 11 and collapse.value == pytest.approx(0.03)
    assert "-90% on its level over steps 1-5; each of the last 3" in collapse.line()
    # a policy near the top of its reward: batches that all score alike now and then are not a collapse
    lucky = [0.3] * 8 + [0.0, 0.0, 0.1, 0.0, 0.0, 0.2]
    assert check_rule("reward_std_collapse", stream(**{"reward/std": lucky}), LIMITS_) is None
    # level 0.5, its level's std 0.1: 4 stds = 0.4; 0.95 is +4.5 stds
    rows = stream(**{"reward/mean": [0.5] * 8 + [0.95] * 3, "reward/std": [0.1] * 11})
    jump = check_rule("reward_jump", rows, LIMITS_)
    assert jump.since == 11 and "+4.5 x its level's reward/std 0.1" in jump.line()
    assert check_rule("reward_jump", stream(**{"reward/mean": [0.5] * 8 + [0.85] * 3, "reward/std": [0.1] * 11}),
                      LIMITS_) is None


def test_dpo_likelihood_displacement_needs_both_to_fall_while_the_margin_grows():
    # the demo's over-optimised DPO: chosen and rejected alike from -9 to -17 nats
    falling = [-9.0] * 5 + [-10, -12, -14, -16, -17, -17]
    margin = [0.0] * 5 + [0.5, 1, 1.5, 2, 2.5, 3]
    alarm = check_rule("likelihood_displacement", stream(**{"logps/chosen": falling, "logps/rejected": falling,
                                                            "margin": margin}), LIMITS_)
    # (-12 - 14 - 16) / 3 = -14 is the first current value more than half of -9 below it: step 9
    assert alarm.since == 9 and alarm.level == -9 and alarm.value == pytest.approx(-50 / 3)
    assert "logps/chosen -9 -> -16.7 nats and logps/rejected -9 -> -16.7 nats" in alarm.line()
    # healthy DPO: the rejected falls, the chosen holds
    held = stream(**{"logps/chosen": [-9.0] * 11, "logps/rejected": falling, "margin": margin})
    assert check_rule("likelihood_displacement", held, LIMITS_) is None
    # long responses: the test suite's DPO run, chosen -42 -> -53 nats (-26%) while rejected -46 -> -72: quiet
    long = stream(**{"logps/chosen": [-42.0] * 8 + [-53.0] * 3, "logps/rejected": [-46.0] * 8 + [-72.0] * 3,
                     "margin": [0.3] * 8 + [1.7] * 3})
    assert check_rule("likelihood_displacement", long, LIMITS_) is None
    # both fall but the margin shrinks: not displacement (a diverging run; other alarms)
    shrink = stream(**{"logps/chosen": falling, "logps/rejected": falling, "margin": [0.0] * 5 + [-1] * 6})
    assert check_rule("likelihood_displacement", shrink, LIMITS_) is None


def test_an_alarm_fires_once_clears_and_fires_again():
    monitor = Monitor(LIMITS_)
    kl = [0.5] * 8 + [30] * 4 + [0.5] * 4 + [30] * 3
    fired = {row["step"]: [a.rule for a in monitor.observe(row)] for row in stream(kl=kl)}
    # up at step 10 ((0.5 + 30 + 30) / 3 = 20.2 > 20 nats), cleared at 14 (10.3), up again at 18
    assert [step for step, rules in fired.items() if rules] == [10, 18]
    assert fired[10] == ["kl_blowup"] and "kl_blowup" in monitor.up


def test_replay_restores_which_alarms_are_up_without_repeating_them():
    rows = stream(kl=[0.5] * 8 + [30] * 4)
    monitor = Monitor(LIMITS_)
    monitor.replay(rows[:-1])
    assert monitor.up == {"kl_blowup"} and monitor.observe(rows[-1]) == []


def test_rules_ignore_missing_and_non_finite_values():
    rows = stream(kl=[0.5] * 8 + [float("nan")] * 3)
    assert check_rule("kl_blowup", rows, LIMITS_) is None
    assert Monitor(LIMITS_).observe({"step": 1, "loss": 1.0}) == []


def test_repeated_ngram_share():
    assert repeated_ngram_share([[1, 2, 3, 4, 5, 6]]) == 0.0
    # 1 2 1 2 1 2 1: 4-grams 1212, 2121, 1212, 2121 -> 2 of 4 repeat an earlier one
    assert repeated_ngram_share([[1, 2, 1, 2, 1, 2, 1]]) == 0.5
    assert repeated_ngram_share([[7] * 10, [1, 2, 3]]) == 6 / 7  # pooled: 7 grams, 6 repeats; short ones add none
    assert repeated_ngram_share([[1, 2], []]) == 0.0


def test_monitor_section_defaults_and_validation():
    cfg = load_config(PPOConfig, None, ["actor=a", "reward=m:f", "data.prompts=p", "train.max_steps=2"])
    assert cfg.monitor.enabled and cfg.monitor.action == "warn"
    assert cfg.monitor.limits() == {name: limit.default for name, limit in LIMITS.items()}
    dpo = load_config(DPOConfig, None, ["model=m", "data.train=t", "monitor.action=stop", "monitor.kl_nats=5"])
    assert dpo.monitor.action == "stop" and dpo.monitor.limits()["kl_nats"] == 5
    for override, message in [("monitor.action=halt", "monitor.action': expected one of ('warn', 'stop', 'stop_best')"),
                              ("monitor.baseline=0", "monitor.baseline': a whole number >= 1, got 0"),
                              ("monitor.entropy_drop=1.5", "monitor.entropy_drop': in (0, 1), got 1.5"),
                              ("monitor.kl_nats=0", "monitor.kl_nats': > 0, got 0"),
                              ("monitor.reward_shift=-1", "monitor.reward_shift': > 0, got -1")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(DPOConfig, None, ["model=m", "data.train=t", override])


def evals(gold, proxy, se=0.04, every=10) -> list[dict]:
    """Held-out evaluation rows at steps 0, every, ... between training rows that log no eval metric."""
    rows = []
    for i, (g, p) in enumerate(zip(gold, proxy)):
        rows.append({"step": i * every, "eval/gold": g, "eval/gold_se": se, "eval/reward": p})
        rows.append({"step": i * every + 1, "reward/mean": p})
    return rows


def test_proxy_truth_gap_fires_when_gold_leaves_its_best_by_standard_errors_while_the_proxy_rises():
    rows = evals([0.2, 0.5, 0.6, 0.45, 0.30], [0.1, 0.5, 0.9, 1.3, 1.6])
    # up to step 20 the gold only rose
    assert check_rule("proxy_truth_gap", rows[:6], LIMITS_) is None
    # step 30: 0.6 -> 0.45 is 0.15 below its best, 2.65 standard errors of the difference (0.04 x sqrt 2)
    alarm = check_rule("proxy_truth_gap", rows[:8], LIMITS_)
    assert (alarm.level, alarm.value, alarm.since, alarm.metric) == (0.6, 0.45, 30, "eval/gold")
    last = check_rule("proxy_truth_gap", rows, LIMITS_)
    assert last.since == 30 and last.line() == (
        "alarm: eval/gold 0.6 (step 20) -> 0.3 (-5.3 SE) while eval/reward rose 0.9 -> 1.6 since step 30: proxy up, "
        "truth down: the policy games its reward (best/ keeps the judge's best); see docs/monitors.md")


def test_proxy_truth_gap_stays_quiet_within_noise_when_the_proxy_falls_too_and_without_a_judge():
    assert check_rule("proxy_truth_gap", evals([0.2, 0.6, 0.45], [0.1, 0.9, 1.3], se=0.1), LIMITS_) is None
    assert check_rule("proxy_truth_gap", evals([0.2, 0.6, 0.3], [0.1, 0.9, 0.5]), LIMITS_) is None  # both fell
    no_judge = [{k: v for k, v in row.items() if not k.startswith("eval/gold")}
                for row in evals([0.2, 0.6, 0.3], [0.1, 0.9, 1.5])]
    assert check_rule("proxy_truth_gap", no_judge, LIMITS_) is None
    # a tighter limit makes the same small drop an alarm; the gold recovering clears it
    tight = {**LIMITS_, "gap_se": 1.0}
    assert check_rule("proxy_truth_gap", evals([0.2, 0.6, 0.45], [0.1, 0.9, 1.3], se=0.1), tight) is not None
    monitor = Monitor(LIMITS_)
    raised = [a.rule for row in evals([0.2, 0.6, 0.3, 0.62, 0.2], [0.1, 0.9, 1.3, 1.4, 1.8]) for a in
              monitor.observe(row)]
    assert raised == ["proxy_truth_gap", "proxy_truth_gap"]
