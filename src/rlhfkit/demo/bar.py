"""The bar the demo must clear, as rows of the report's summary format {name, value, target, passed}.

1. The reward model generalises: accuracy >= 0.85 on held-out pairs labelled by the gold reward (no noise).
2. PPO improved the gold reward, not just the proxy: PPO's held-out gold mean is above SFT's by at least 3
   standard errors of the difference (sqrt(se_ppo^2 + se_sft^2), so sampling noise cannot explain it) AND by at
   least a third of the way from the SFT mean to the best achievable gold reward (so the gain is material).
3. It stayed near its reference: KL(PPO || SFT) per response within the budget.
4. It ran in the promised time.
"""

from __future__ import annotations

import math


def bar_rows(rm_accuracy: float, gold: dict, best: float, kl: dict, kl_budget: float, wall_seconds: float,
             rm_target: float = 0.85, time_target: float = 600.0) -> list[dict]:
    sft, ppo = gold["sft"], gold["ppo"]
    gain = ppo["mean"] - sft["mean"]
    se = math.sqrt(ppo["stderr"] ** 2 + sft["stderr"] ** 2)
    third = (best - sft["mean"]) / 3
    rows = [
        {"name": "RM accuracy, held-out gold-labelled pairs", "value": rm_accuracy, "target": f">= {rm_target}",
         "passed": rm_accuracy >= rm_target},
        {"name": "gold gain PPO - SFT, in standard errors", "value": gain / se if se > 0 else math.inf,
         "target": ">= 3", "passed": se > 0 and gain >= 3 * se},
        {"name": "gold gain PPO - SFT", "value": gain, "target": f">= (best - SFT) / 3 = {third:.3f}",
         "passed": gain >= third},
        {"name": "KL(PPO || SFT), nats per response", "value": kl["mean"], "target": f"<= {kl_budget}",
         "passed": kl["mean"] <= kl_budget},
        {"name": "wall time, seconds", "value": wall_seconds, "target": f"<= {time_target:.0f}",
         "passed": wall_seconds <= time_target},
    ]
    for name, stats in gold.items():  # context, not checks
        rows.append({"name": f"gold reward of {name} (mean ± stderr)",
                     "value": f"{stats['mean']:.3f} ± {stats['stderr']:.3f}", "target": f"best {best:g}",
                     "passed": None})
    return rows


def failed(rows: list[dict]) -> list[str]:
    return [r["name"] for r in rows if r.get("passed") is False]
