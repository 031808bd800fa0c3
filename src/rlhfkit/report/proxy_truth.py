"""The report's proxy-against-truth section of an RL run (docs/monitors.md): the held-out evaluations' proxy
(eval/reward, the training reward) and truth (eval/gold, the second judge's, eval.judge) against KL and the
iteration, the alarms on the same timeline, and the held-out samples where proxy and truth disagree most beside the
starting policy's answers to the same prompts (eval_samples.jsonl). The demo's over-optimisation section draws
its curve and table with the same functions (`plot_proxy_truth`, `points_table`).
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

from rlhfkit.metric_names import ALARM_PREFIX, EVAL_GOLD, EVAL_GOLD_SE, EVAL_KL, EVAL_REWARD, EVAL_REWARD_SE
from rlhfkit.report.metrics import StageRun, is_number
from rlhfkit.report.plots import plot_proxy_truth
from rlhfkit.run_files import EVAL_SAMPLES_FILE, read_jsonl

SHOWN = 5  # disagreeing samples in the table


def eval_points(rows: list[dict]) -> list[dict]:
    """One point per held-out evaluation: {step, kl, proxy, proxy_stderr, gold, gold_stderr} (no gold without a
    judge), the last row of each step where a resumed run logged it again."""
    points = {}
    for row in rows:
        if is_number(row.get("step")) and is_number(row.get(EVAL_REWARD)) and is_number(row.get(EVAL_KL)):
            point = {"step": int(row["step"]), "kl": row[EVAL_KL], "proxy": row[EVAL_REWARD],
                     "proxy_stderr": row.get(EVAL_REWARD_SE)}
            if is_number(row.get(EVAL_GOLD)):
                point.update(gold=row[EVAL_GOLD], gold_stderr=row.get(EVAL_GOLD_SE))
            points[point["step"]] = point
    return [points[step] for step in sorted(points)]


def alarm_events(rows: list[dict]) -> list[tuple[int, str]]:
    """(step, rule) of every alarm the run raised (metrics.jsonl's alarm/<rule>), in step order, once each."""
    seen = {(int(row["step"]), key.removeprefix(ALARM_PREFIX)) for row in rows if is_number(row.get("step"))
            for key in row if key.startswith(ALARM_PREFIX)}
    return sorted(seen)


def _cell(value, digits: str = ".3g") -> str:
    return f'<td class="num">{format(value, digits) if is_number(value) else escape(str(value or ""))}</td>'


def points_table(points: list[dict], alarms: list[tuple[int, str]] = ()) -> str:
    """The points as a table: iteration, KL, proxy and gold (± standard errors), each flaw's rate where the points
    have them, and the alarms raised since the previous point."""
    flaws = list(points[0].get("flaws", {})) if points else []
    judged = any("gold" in p for p in points)
    head = ["iteration", "KL", "proxy", "± stderr"] + (["gold", "± stderr"] if judged else []) + flaws + \
        (["alarms since the previous point"] if alarms else [])
    body, previous = [], -math.inf
    for p in points:
        cells = [_cell(p["step"], "d"), _cell(p["kl"]), _cell(p["proxy"]), _cell(p.get("proxy_stderr"), ".2g")]
        if judged:
            cells += [_cell(p.get("gold")), _cell(p.get("gold_stderr"), ".2g")]
        cells += [_cell(p.get("flaws", {}).get(name)) for name in flaws]
        if alarms:
            raised = [f"{rule} ({step})" for step, rule in alarms if previous < step <= p["step"]]
            cells.append(f"<td>{escape(', '.join(raised))}</td>")
        previous = p["step"]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>\n" + "\n".join(body)
            + "\n</table>")


def disagreements(samples: list[dict], k: int = SHOWN) -> tuple[int | None, list[dict]]:
    """(the last evaluation's step, its `k` samples where the proxy most out-scores the truth, each with the
    starting policy's answer to the same prompt). Scores in units of the starting policy's spread (its standard
    deviation over the held-out samples, each judge's own), so the two judges' scales compare; [] without gold."""
    by_step: dict[int, list[dict]] = {}
    for s in samples:
        if isinstance(s, dict) and is_number(s.get("step")):
            by_step.setdefault(int(s["step"]), []).append(s)
    if 0 not in by_step or len(by_step) < 2:
        return None, []
    start, step = by_step[0], max(by_step)
    last = by_step[step][-len(start):]  # a resumed run appends an evaluation again: the last one counts

    def scale(name: str) -> tuple[float, float]:
        values = [s[name] for s in start if is_number(s.get(name))]
        if len(values) < 2:
            return 0.0, 1.0
        mean = sum(values) / len(values)
        sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        return mean, sd or 1.0

    (pm, ps), (gm, gs) = scale("reward"), scale("gold")
    first = {s.get("prompt"): s for s in reversed(start)}
    scored = [((s["reward"] - pm) / ps - (s["gold"] - gm) / gs, s) for s in last
              if is_number(s.get("reward")) and is_number(s.get("gold"))]
    scored.sort(key=lambda pair: -pair[0])
    return step, [{**s, "start": first.get(s.get("prompt"), {}), "gap": gap} for gap, s in scored[:k]]


def _answer(sample: dict) -> str:
    scores = " · ".join(f"{name} {sample[name]:.3g}" for name in ("reward", "gold") if is_number(sample.get(name)))
    return (f'<td><pre>{escape(str(sample.get("response", "")))}</pre>'
            f'<div class="meta">{escape(scores.replace("reward", "proxy"))}</div></td>')


def proxy_truth_section(run: StageRun, plots: Path) -> str:
    """The section for an RL stage whose metrics hold held-out evaluations ("" for any other)."""
    points = eval_points(run.rows)
    if len(points) < 2:
        return ""
    alarms = alarm_events(run.rows)
    png = plots / f"proxy_truth_{run.label}.png"
    plot_proxy_truth(points, png, alarms=alarms)
    judged = all("gold" in p for p in points)
    what = ("the training reward (proxy) and the held-out judge's gold (eval.judge) on the same responses"
            if judged else "the training reward on held-out prompts (no eval.judge: no truth to set beside it)")
    title = "Proxy and truth" if judged else "Held-out reward"  # no judge: no truth to name
    parts = [f"<h3>{title}: {escape(run.label)}</h3>",
             f'<p class="meta">Each held-out evaluation: {what}, against KL to the starting policy and the '
             f"iteration; alarms on the same timeline (docs/monitors.md).</p>",
             f'<img src="{plots.name}/{png.name}" alt="proxy and truth against KL and iteration">',
             points_table(points, alarms)]
    step, worst = disagreements(read_jsonl(run.path.parent / EVAL_SAMPLES_FILE)) \
        if (run.path.parent / EVAL_SAMPLES_FILE).is_file() else (None, [])
    if worst:
        rows = "\n".join(f'<tr><td><pre>{escape(str(s.get("prompt", "")))}</pre></td>{_answer(s["start"])}'
                         f"{_answer(s)}</tr>" for s in worst)
        parts.append(f'<p class="meta">Where proxy and truth disagree most at iteration {step}: the held-out '
                     f"answers the proxy rates most above the truth (each in units of its spread over the starting "
                     f"policy's answers), beside the starting policy's answers.</p>\n"
                     f"<table><tr><th>prompt</th><th>starting policy</th><th>iteration {step}</th></tr>\n{rows}"
                     f"\n</table>")
    return "\n".join(parts)
