"""`write_report`: a run folder -> `report.html` + PNGs under `plots/`; and the `rlhfkit report` verb."""

from __future__ import annotations

import argparse
import json
import sys
from html import escape
from pathlib import Path

from rlhfkit.report.metrics import StageRun, find_stage_runs, is_number, last_value, numeric_keys, read_jsonl
from rlhfkit.report.plots import plot_gold, plot_stage

PLOTS_DIR = "plots"
MAX_SAMPLES = 100  # more rows make the page long without telling more

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1200px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { margin-top: 1.8em; border-bottom: 1px solid #eee; }
table { border-collapse: collapse; margin: .8em 0; font-size: .92em; }
th, td { border: 1px solid #ddd; padding: .35em .7em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
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


def _stage_section(run: StageRun, run_dir: Path, plots: Path) -> str:
    source = run.path.relative_to(run_dir).as_posix()
    steps = [r["step"] for r in run.rows if is_number(r.get("step"))]
    span = f", steps {_fmt(min(steps))}–{_fmt(max(steps))}" if steps else ""
    parts = [
        f"<h2>{escape(run.stage.upper())} — {escape(run.label)}</h2>",
        f'<p class="meta">{escape(source)}: {len(run.rows)} logged rows{span}</p>',
    ]
    png = plots / f"curves_{run.label}.png"
    if plot_stage(run, png):
        parts.append(f'<img src="{PLOTS_DIR}/{png.name}" alt="{escape(run.stage)} training curves">')
    else:
        parts.append("<p>No numeric metrics logged yet.</p>")
    keys = numeric_keys(run.rows)
    if keys:
        rows = "\n".join(f"<tr><td>{escape(k)}</td>{_cell(last_value(run.rows, k))}</tr>" for k in keys)
        parts.append(
            f"<details><summary>Last logged value of each metric ({len(keys)})</summary>\n"
            f"<table><tr><th>metric</th><th>last value</th></tr>\n{rows}\n</table></details>"
        )
    return "\n".join(parts)


def _text_cell(text, reward=None) -> str:
    """A cell of escaped, whitespace-preserving text, with the reward under it when there is one."""
    note = f'<div class="meta">reward {escape(_fmt(reward))}</div>' if is_number(reward) else ""
    return f"<td><pre>{escape(str(text))}</pre>{note}</td>"


def _samples_section(path: Path) -> str:
    samples = [s for s in read_jsonl(path) if isinstance(s, dict)]
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


def write_report(run_dir: str | Path, title: str | None = None) -> Path:
    """Write `run_dir/report.html` and its PNGs under `run_dir/plots/`; return the HTML path.

    `run_dir` is a single-stage run (holds `metrics.jsonl`) or a pipeline/demo folder whose direct
    subfolders hold stage runs. `summary.json`, `gold.json` and `samples.jsonl` in `run_dir` are rendered
    when present. Raises FileNotFoundError when no metrics.jsonl is found, ValueError on a malformed file.
    """
    run_dir = Path(run_dir)
    runs = find_stage_runs(run_dir)
    plots = run_dir / PLOTS_DIR
    sections = []
    summary_title = None
    if (run_dir / "summary.json").is_file():
        html, summary_title = _summary_section(run_dir / "summary.json")
        sections.append(html)
    if (run_dir / "gold.json").is_file():
        sections.append(_gold_section(run_dir / "gold.json", plots))
    sections += [_stage_section(run, run_dir, plots) for run in runs]
    if (run_dir / "samples.jsonl").is_file():
        sections.append(_samples_section(run_dir / "samples.jsonl"))

    title = title or summary_title or f"rlhfkit report — {run_dir.resolve().name}"
    page = (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{escape(title)}</title>\n'
        f"<style>{CSS}</style>\n</head>\n<body>\n<h1>{escape(title)}</h1>\n"
        f'<p class="meta">Stages: {escape(", ".join(r.label for r in runs))}</p>\n'
        + "\n\n".join(sections) + "\n</body>\n</html>\n"
    )
    out = run_dir / "report.html"
    out.write_text(page, encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    """`rlhfkit report OUTPUT_DIR [--title T]`: write the report and print the path of report.html."""
    parser = argparse.ArgumentParser(
        prog="rlhfkit report", description="Plot a run's metrics.jsonl and write OUTPUT_DIR/report.html."
    )
    parser.add_argument("output_dir", help="a run's output_dir, or a pipeline/demo folder of stage runs")
    parser.add_argument("--title", default=None, help="page title (default: summary.json's title or the folder)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.output_dir, title=args.title)
    except (FileNotFoundError, ValueError) as err:
        print(f"rlhfkit report: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0
