"""The bar the demo must clear, as rows of the report's summary format {name, value, target, passed}.

1. The reward model generalises: accuracy >= 0.8 on pairs of SFT samples for held-out prompts, labelled by the gold
   reward without noise (some pairs differ only in what SFT's samples rarely show, a repeat or another topic, which
   a reward model trained on them cannot learn; see docs/demo.md).
2. PPO improved the gold reward, not just the proxy: PPO's held-out gold mean is above SFT's by at least 3
   standard errors of the difference (sqrt(se_ppo^2 + se_sft^2), so sampling noise cannot explain it) AND by at
   least a third of the way from the SFT mean to the best achievable gold reward (so the gain is material).
3. It stayed near its reference: KL(PPO || SFT) per response within the budget.
4. It generalises to unseen (topic, mood) combinations: PPO's gold on held-out prompts is below its gold on
   training prompts by at most a quarter of its gain there (training gold - SFT's gold): the generalisation gap.
5. It did not buy its proxy reward with exploits: at most 40% of PPO's held-out samples show an exploit, a flaw the
   gold punishes that SFT's samples rarely show and the reward model therefore never learned to punish (a repeated
   adjective, another topic, an unfinished sentence). A healthy run measures 0.2-0.3; PPO without its KL penalty
   (ppo.ppo.kl_coef=0) 0.65.
6. It ran in the promised time.
"""

from __future__ import annotations

import math
import sys

GAP_FRACTION = 0.25  # the held-out gold may be this fraction of PPO's gain on training prompts below them
EXPLOIT_TARGET = 0.4  # fraction of PPO's held-out samples that may show an exploit


def bar_rows(rm_accuracy: float, gold: dict, best: float, kl: dict, kl_budget: float, wall_seconds: float,
             train_gold: dict, exploit_rate: float, rm_target: float = 0.8, time_target: float = 600.0) -> list[dict]:
    """`gold`: {policy: mean_stderr} on held-out prompts (sft and ppo at least); `train_gold`: PPO's on training
    prompts; `exploit_rate`: the fraction of PPO's held-out samples showing an exploit."""
    sft, ppo = gold["sft"], gold["ppo"]
    gain = ppo["mean"] - sft["mean"]
    se = math.sqrt(ppo["stderr"] ** 2 + sft["stderr"] ** 2)
    third = (best - sft["mean"]) / 3
    gap = train_gold["mean"] - ppo["mean"]
    allowed_gap = GAP_FRACTION * (train_gold["mean"] - sft["mean"])
    return [
        {"name": "RM accuracy, held-out gold-labelled pairs", "value": rm_accuracy, "target": f">= {rm_target}",
         "passed": rm_accuracy >= rm_target},
        {"name": "gold gain PPO - SFT, in standard errors", "value": gain / se if se > 0 else math.inf,
         "target": ">= 3", "passed": se > 0 and gain >= 3 * se},
        {"name": "gold gain PPO - SFT", "value": gain, "target": f">= (best - SFT) / 3 = {third:.3f}",
         "passed": gain >= third},
        {"name": "KL(PPO || SFT), nats per response", "value": kl["mean"], "target": f"<= {kl_budget}",
         "passed": kl["mean"] <= kl_budget},
        {"name": "generalisation gap: PPO gold, training - held-out prompts", "value": gap,
         "target": f"<= {GAP_FRACTION:g} x (training gold - SFT) = {allowed_gap:.3f}", "passed": gap <= allowed_gap},
        {"name": "exploit rate: PPO held-out samples with an exploit", "value": exploit_rate,
         "target": f"<= {EXPLOIT_TARGET:g}", "passed": exploit_rate <= EXPLOIT_TARGET},
        {"name": "wall time, seconds", "value": wall_seconds, "target": f"<= {time_target:.0f}",
         "passed": wall_seconds <= time_target},
    ]


def context_rows(gold: dict, best: float, train_gold: dict, flaws: dict, exploits: list[str]) -> list[dict]:
    """Rows that inform and check nothing: gold of every policy, PPO's gold on training prompts, each flaw's rate
    in SFT's and PPO's held-out samples (`flaws`: {policy: {flaw: rate}}), and the proxy exploits found."""
    rows = [{"name": f"gold reward of {name}, held-out (mean ± stderr)",
             "value": f"{stats['mean']:.3f} ± {stats['stderr']:.3f}", "target": f"best {best:g}", "passed": None}
            for name, stats in gold.items()]
    rows.append({"name": "gold reward of ppo, training prompts", "value": f"{train_gold['mean']:.3f} ± "
                 f"{train_gold['stderr']:.3f}", "target": f"best {best:g}", "passed": None})
    for flaw in flaws["ppo"]:
        rows.append({"name": f"{flaw}: share of samples, sft -> ppo",
                     "value": f"{flaws['sft'][flaw]:.3f} -> {flaws['ppo'][flaw]:.3f}", "target": "", "passed": None})
    rows.append({"name": "proxy exploits found (flaws PPO made more frequent)", "value": ", ".join(exploits) or "none",
                 "target": "", "passed": None})
    return rows


def failed(rows: list[dict]) -> list[str]:
    return [r["name"] for r in rows if r.get("passed") is False]


def report_verdict(out, title: str, rows: list[dict]) -> int:
    """The end of a task demo: OUT/report.html, the bar printed, and the exit code (0 when every bar passed, else 1
    with the failed bars on stderr)."""
    from rlhfkit.report import write_report
    from rlhfkit.stages.pipeline import print_table

    report = write_report(out)
    print_table(title, rows)
    print(f"\nreport: {report}")
    return verdict(rows)


def verdict(rows: list[dict]) -> int:
    """The demo's exit code: 0 when every bar passed, else 1 with the failed bars on stderr."""
    bad = failed(rows)
    if bad:
        print(f"rlhfkit demo: FAILED: {'; '.join(bad)}", file=sys.stderr)
        return 1
    print("rlhfkit demo: every bar passed")
    return 0
