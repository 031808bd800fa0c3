"""`write_report`: a run folder -> `report.html` + PNGs under `plots/` (what `rlhfkit report` draws)."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from rlhfkit.report.metrics import StageRun, find_stage_runs, is_number, last_value, numeric_keys
from rlhfkit.report.plots import plot_arena, plot_gold, plot_proxy_truth, plot_stage, stage_panels
from rlhfkit.report.proxy_truth import points_table, proxy_truth_section
from rlhfkit.report.run_info import WhatRan, what_ran, zero_note
from rlhfkit.run_files import (ARENA_FILE, GOLD_FILE, OVEROPTIMISATION_FILE, PLOTS_DIR, REPORT_FILE, SAMPLES_FILE,
                               SUMMARY_FILE, read_jsonl)

MAX_SAMPLES = 100  # more rows make the page long without telling more

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1200px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { margin-top: 1.8em; border-bottom: 1px solid #eee; }
table { border-collapse: collapse; margin: .8em 0; font-size: .92em; }
th, td { border: 1px solid #ddd; padding: .35em .7em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
table.ran th { background: none; font-weight: 600; white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.pass td { background: #e8f6ea; } tr.fail td { background: #fbe6e6; }
td.status { font-weight: bold; } tr.pass td.status { color: #1b7a2f; } tr.fail td.status { color: #b3261e; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: .9em; }
img { max-width: 100%; border: 1px solid #eee; }
.meta { color: #666; font-size: .9em; }
"""


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _cell(value, numeric_class: bool = True) -> str:
    cls = ' class="num"' if numeric_class and is_number(value) else ""
    return f"<td{cls}>{escape(_fmt(value))}</td>"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _summary_section(path: Path) -> tuple[str, str | None]:
    """(html, title from the file or None) for summary.json."""
    data = _read_json(path)
    rows = data.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "name" in r for r in rows):
        raise ValueError(f"{path}: expected {{'rows': [{{'name': ..., 'value': ...}}, ...]}}")
    body = []
    for row in rows:
        passed = row.get("passed")
        css, status = {True: ("pass", "PASS"), False: ("fail", "FAIL")}.get(passed, ("", "—"))
        body.append(
            f'<tr class="{css}"><td>{escape(str(row["name"]))}</td>{_cell(row.get("value", ""))}'
            f'<td>{escape(str(row.get("target", "")))}</td><td class="status">{status}</td></tr>'
        )
    title = data.get("title") if isinstance(data.get("title"), str) else None
    html = (
        "<h2>Summary</h2>\n<table><tr><th>check</th><th>value</th><th>target</th><th>result</th></tr>\n"
        + "\n".join(body) + "\n</table>"
    )
    return html, title


def _gold_section(path: Path, plots: Path) -> str:
    data = _read_json(path)
    policies = data.get("policies")
    if not isinstance(policies, dict) or not policies or not all(
        isinstance(p, dict) and is_number(p.get("mean")) for p in policies.values()
    ):
        raise ValueError(f"{path}: expected {{'policies': {{NAME: {{'mean': float, 'stderr': float}}}}}}")
    best = data.get("best") if is_number(data.get("best")) else None
    png = plots / "gold_reward.png"
    plot_gold(policies, best, png)
    rows = "\n".join(
        f"<tr><td>{escape(name)}</td>{_cell(p['mean'])}{_cell(p.get('stderr', ''))}</tr>"
        for name, p in policies.items()
    )
    best_row = f"<tr><td><i>best</i></td>{_cell(best)}<td></td></tr>" if best is not None else ""
    return (
        "<h2>Gold reward</h2>\n<p class=\"meta\">The hidden gold reward of each policy's responses on held-out "
        "prompts (mean ± standard error).</p>\n"
        f'<img src="{PLOTS_DIR}/{png.name}" alt="gold reward by policy">\n'
        f"<table><tr><th>policy</th><th>mean</th><th>stderr</th></tr>\n{rows}\n{best_row}</table>"
    )


def _overoptimisation_section(path: Path, plots: Path) -> str:
    """overoptimisation.json (the demo's): proxy and gold reward against KL for every saved policy of an RL run."""
    data = _read_json(path)
    points = data.get("points")
    keys = ("step", "kl", "proxy", "gold")
    if not isinstance(points, list) or not points or not all(
        isinstance(p, dict) and all(is_number(p.get(k)) for k in keys) for p in points
    ):
        raise ValueError(f"{path}: expected {{'points': [{{'step', 'kl', 'proxy', 'gold', ...}}, ...]}}")
    chosen = data.get("chosen_step") if is_number(data.get("chosen_step")) else None
    png = plots / "overoptimisation.png"
    plot_proxy_truth(points, png, chosen)
    split, samples = escape(str(data.get("split", "held-out"))), escape(str(data.get("samples", "")))
    kept = (f" Early stopping kept iteration {escape(str(chosen))} (best {split} gold)." if data.get("early_stop")
            else f" Best {split} gold at iteration {escape(str(data.get('best_step', '')))}; the bar evaluates the "
                 f"last policy.")
    return (
        "<h2>Over-optimisation: proxy vs gold against KL</h2>\n"
        f'<p class="meta">Every saved policy of the RL run, sampled on the {split} prompts ({samples} samples each): '
        "the reward model's score (the proxy it climbed), the hidden gold reward (what the proxy stands for), KL to "
        f"the SFT policy, and the share of samples with each flaw the gold punishes.{kept}</p>\n"
        f'<img src="{PLOTS_DIR}/{png.name}" alt="proxy and gold reward against KL">\n' + points_table(points)
    )


def _arena_section(path: Path, plots: Path) -> str:
    """arena.json (the demo's --algos): every algorithm's gold reward, gain over SFT, KL, exploits, time."""
    data = _read_json(path)
    algos, sft = data.get("algos"), data.get("sft")
    if not isinstance(algos, dict) or not algos or not isinstance(sft, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("gold"), dict) and is_number(r["gold"].get("mean"))
        and is_number(r.get("kl")) for r in algos.values()
    ):
        raise ValueError(f"{path}: expected {{'sft': {{'mean', 'stderr'}}, 'algos': {{NAME: {{'gold', 'kl', ...}}}}}}")
    best = data.get("best") if is_number(data.get("best")) else None
    png = plots / "arena.png"
    plot_arena(sft, algos, best, png)
    head = "".join(f"<th>{escape(h)}</th>" for h in ("policy", "gold", "± stderr", "gain (se)", "KL", "exploit",
                                                      "seconds", "trained on"))
    rows = [f"<tr><td>sft</td>{_cell(sft['mean'])}{_cell(sft.get('stderr', ''))}<td></td>{_cell(0.0)}"
            "<td></td><td></td><td></td></tr>"]
    for name, r in algos.items():
        rows.append(f"<tr><td>{escape(name)}</td>{_cell(r['gold']['mean'])}{_cell(r['gold'].get('stderr', ''))}"
                    f"{_cell(r.get('gain_se', ''))}{_cell(r['kl'])}{_cell(r.get('exploit', ''))}"
                    f"{_cell(r.get('seconds') if r.get('seconds') is not None else '')}"
                    f"<td>{escape(str(r.get('used', '')))}</td></tr>")
    return (
        "<h2>The arena: algorithms on one world</h2>\n"
        f'<p class="meta">Every algorithm trained from the same SFT model and sampled on the same test prompts '
        f"({escape(str(data.get('samples', '')))} samples each): gold reward (mean ± standard error), its gain over "
        "SFT in standard errors of the difference, KL to SFT (nats per response), the share of samples with an "
        "exploit, training seconds and what it trained on.</p>\n"
        f'<img src="{PLOTS_DIR}/{png.name}" alt="gold reward against KL per algorithm">\n'
        f"<table><tr>{head}</tr>\n" + "\n".join(rows) + "\n</table>"
    )


def _what_ran_table(ran: WhatRan) -> str:
    rows = "\n".join(f"<tr><th>{escape(what)}</th><td>{escape(text)}</td></tr>" for what, text in ran.rows)
    return f'<table class="ran">\n{rows}\n</table>'


def _stage_title(run: StageRun, ran: WhatRan | None) -> str:
    """"GRPO — rlhfkit ppo" (with the folder's name when it is not the stage's); without a config.yaml to say
    more, "PPO — ppo"."""
    if ran is None:
        return f"{run.stage.upper()} — {run.label}"
    return f"{ran.algorithm} — {ran.verb}" + (f" ({run.label})" if run.label != run.stage else "")


def _stage_section(run: StageRun, ran: WhatRan | None, run_dir: Path, plots: Path) -> str:
    source = run.path.relative_to(run_dir).as_posix()
    steps = [r["step"] for r in run.rows if is_number(r.get("step"))]
    span = f", steps {_fmt(min(steps))}–{_fmt(max(steps))}" if steps else ""
    title = _stage_title(run, ran)
    parts = [f"<h2>{escape(title)}</h2>"]
    if ran is not None:
        parts.append(_what_ran_table(ran))
    parts.append(f'<p class="meta">{escape(source)}: {len(run.rows)} logged rows{span}</p>')
    png = plots / f"curves_{run.label}.png"
    _, zero = stage_panels(run)
    if plot_stage(run, png, title):
        parts.append(f'<img src="{PLOTS_DIR}/{png.name}" alt="{escape(run.stage)} training curves">')
    elif not zero:
        parts.append("<p>No numeric metrics logged yet.</p>")
    if zero:  # a flat line at 0 tells nothing a sentence does not: left out of the plots, said here once
        note = zero_note(ran.config if ran else {}, zero)
        parts.append(f'<p class="meta">Not drawn: {escape(note)}.</p>')
    if section := proxy_truth_section(run, plots):  # an RL run's held-out evaluations: proxy, truth, alarms
        parts.append(section)
    keys = numeric_keys(run.rows)
    if keys:
        rows = "\n".join(f"<tr><td>{escape(k)}</td>{_cell(last_value(run.rows, k))}</tr>" for k in keys)
        parts.append(
            f"<details><summary>Last logged value of each metric ({len(keys)})</summary>\n"
            f"<table><tr><th>metric</th><th>last value</th></tr>\n{rows}\n</table></details>"
        )
    return "\n".join(parts)


def _text_cell(text, reward=None, unjudged=False) -> str:
    """A cell of escaped, whitespace-preserving text, with the reward under it when there is one ("unjudged" where
    the reward left it unjudged)."""
    note = f'<div class="meta">reward {escape(_fmt(reward))}</div>' if is_number(reward) else \
        '<div class="meta">unjudged</div>' if unjudged else ""
    return f"<td><pre>{escape(str(text))}</pre>{note}</td>"


def _samples_section(path: Path) -> str:
    """The demo's before/after table (`before`, `after` and their rewards per prompt), or a training run's samples
    (`ppo.sample_every`: step, prompt, response, reward), the first and the last ones when there are many."""
    samples = [s for s in read_jsonl(path) if isinstance(s, dict)]
    if samples and not any("before" in s or "after" in s for s in samples):
        return _training_samples(samples)
    body = []
    for i, s in enumerate(samples[:MAX_SAMPLES]):
        body.append(
            f'<tr><td class="num">{i + 1}</td>{_text_cell(s.get("prompt", ""))}'
            f'{_text_cell(s.get("before", ""), s.get("before_reward"))}'
            f'{_text_cell(s.get("after", ""), s.get("after_reward"))}</tr>'
        )
    shown = f" (first {MAX_SAMPLES} of {len(samples)})" if len(samples) > MAX_SAMPLES else ""
    return (
        f"<h2>Samples{shown}</h2>\n<p class=\"meta\">Responses to the same prompts before and after training.</p>\n"
        "<table><tr><th>#</th><th>prompt</th><th>before</th><th>after</th></tr>\n" + "\n".join(body) + "\n</table>"
    )


def _training_samples(samples: list[dict]) -> str:
    first = MAX_SAMPLES // 2
    shown = samples if len(samples) <= MAX_SAMPLES else samples[:first] + samples[-(MAX_SAMPLES - first):]
    note = (f" (the first {first} and the last {MAX_SAMPLES - first} of {len(samples)})"
            if len(samples) > MAX_SAMPLES else "")
    body = [f'<tr><td class="num">{escape(_fmt(s.get("step", "")))}</td>{_text_cell(s.get("prompt", ""))}'
            f'{_text_cell(s.get("response", ""), s.get("reward", s.get("score")), "reward" in s and s["reward"] is None)}'
            '</tr>' for s in shown]
    return (
        f"<h2>Samples{note}</h2>\n<p class=\"meta\">Responses sampled during training (<code>samples.jsonl</code>), "
        "with their reward.</p>\n<table><tr><th>step</th><th>prompt</th><th>response</th></tr>\n"
        + "\n".join(body) + "\n</table>"
    )


def _stage_name(run: StageRun, ran: WhatRan | None) -> str:
    """A stage in the page's list: "GRPO (ppo)", or its folder's label when nothing says more."""
    return f"{ran.algorithm} ({run.label})" if ran is not None else run.label


def write_report(run_dir: str | Path, title: str | None = None) -> Path:
    """Write `run_dir/report.html` and its PNGs under `run_dir/plots/`; return the HTML path.

    `run_dir` is a single-stage run (holds `metrics.jsonl`) or a pipeline/demo folder whose direct
    subfolders hold stage runs. Each stage's section opens with what ran (`run_info.what_ran`: its algorithm,
    models, data, key settings and duration, from its config.yaml). `summary.json`, `gold.json`,
    `overoptimisation.json`, `arena.json` and `samples.jsonl` in `run_dir` are rendered when present. Raises
    FileNotFoundError when no metrics.jsonl is found, ValueError on a malformed file.
    """
    run_dir = Path(run_dir)
    runs = find_stage_runs(run_dir)
    plots = run_dir / PLOTS_DIR
    sections = []
    summary_title = None
    if (run_dir / SUMMARY_FILE).is_file():
        html, summary_title = _summary_section(run_dir / SUMMARY_FILE)
        sections.append(html)
    if (run_dir / GOLD_FILE).is_file():
        sections.append(_gold_section(run_dir / GOLD_FILE, plots))
    if (run_dir / OVEROPTIMISATION_FILE).is_file():
        sections.append(_overoptimisation_section(run_dir / OVEROPTIMISATION_FILE, plots))
    if (run_dir / ARENA_FILE).is_file():
        sections.append(_arena_section(run_dir / ARENA_FILE, plots))
    ran = [what_ran(run.stage, run.path.parent, run.rows) for run in runs]
    sections += [_stage_section(run, what, run_dir, plots) for run, what in zip(runs, ran)]
    if (run_dir / SAMPLES_FILE).is_file():
        sections.append(_samples_section(run_dir / SAMPLES_FILE))

    title = title or summary_title or f"rlhfkit report — {run_dir.resolve().name}"
    page = (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{escape(title)}</title>\n'
        f"<style>{CSS}</style>\n</head>\n<body>\n<h1>{escape(title)}</h1>\n"
        f'<p class="meta">Stages: {escape(", ".join(_stage_name(r, w) for r, w in zip(runs, ran)))}</p>\n'
        + "\n\n".join(sections) + "\n</body>\n</html>\n"
    )
    out = run_dir / REPORT_FILE
    out.write_text(page, encoding="utf-8")
    return out
