"""PNG plots: one grid of training curves per stage, the gold-reward bar chart, and proxy vs gold against KL.

Figures are built with `matplotlib.figure.Figure` and saved as PNG, which matplotlib always renders with its
Agg backend, so this works headless with no `matplotlib.use("Agg")`. Pyplot is never imported: calling
`matplotlib.use` would switch (and close the figures of) a caller's interactive backend, e.g. in a notebook,
and pyplot's global figure registry would need closing; a bare Figure is freed like any object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rlhfkit.metric_names import (EVAL_ACCURACY, EVAL_KL, EVAL_LOSS, EVAL_MARGIN, EVAL_PERPLEXITY, EVAL_PREFIX,
                                  EVAL_RESPONSE_LENGTH, EVAL_REWARD, KL, REWARD_MEAN, REWARD_STD)
from rlhfkit.report.metrics import StageRun, is_number, moving_average, numeric_keys, series, zero_everywhere

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
MARKERS = ["o", "s", "D", "^", "v", "P"]  # a short curve's points: equal values of two metrics stay both visible
MAX_GENERIC_PANELS = 12
FEW_POINTS = 10  # a curve with fewer points is drawn as points: a line between so few suggests a trend unmeasured
DPI = 110


@dataclass(frozen=True)
class Panel:
    """One subplot: `keys` share the left axis, `twin_keys` a right axis (another scale, e.g. kl_coef).

    `band` = (mean_key, std_key) shades mean ± std around that curve. `smooth=False` for schedules (lr),
    which are not noisy and whose shape (warmup, decay) an average would blur. `prefix`: every logged metric whose
    name starts with it is drawn too, before `keys` (a family whose members the run names, e.g. the ways an
    episode can end). `legend`: name even a lone curve (its panel's title names others, which were not drawn).
    """

    title: str
    keys: tuple[str, ...]
    twin_keys: tuple[str, ...] = ()
    band: tuple[str, str] | None = None
    smooth: bool = True
    prefix: str = ""
    legend: bool = False


PANELS: dict[str, list[Panel]] = {
    "sft": [
        Panel("Loss", ("loss", EVAL_LOSS)),
        Panel("Eval perplexity", (EVAL_PERPLEXITY,)),
        Panel("Learning rate", ("lr",), smooth=False),
    ],
    "rm": [
        Panel("Pairwise loss", ("loss", EVAL_LOSS)),
        Panel("Accuracy (chosen > rejected)", ("accuracy", EVAL_ACCURACY)),
        Panel("Eval rewards", ("eval/chosen", "eval/rejected", EVAL_MARGIN)),
    ],
    "ppo": [
        # eval/*: the held-out prompts' (train.eval_every), drawn with the rollouts' own
        Panel("Reward (mean ± std)", (REWARD_MEAN, EVAL_REWARD), band=(REWARD_MEAN, REWARD_STD)),
        Panel("KL to reference", (KL, EVAL_KL), twin_keys=("kl_coef",)),
        Panel("Response length (tokens)", ("response_length", EVAL_RESPONSE_LENGTH)),
        Panel("Policy loss", ("policy_loss",)),
        Panel("Value loss", ("value_loss",)),
        Panel("Entropy", ("entropy",)),
        Panel("Clip fraction", ("clip_fraction",)),
        Panel("Approx. KL (old -> new policy)", ("approx_kl",)),
        Panel("Returns, values, advantages", ("return/mean", "value/mean", "advantage/mean")),
        # an env run's episodes (rollout/episodes.py: episode_metrics): means per episode, then shares of episodes
        Panel("Turns and tool calls per episode", ("episode/turns", "episode/tool_calls")),
        Panel("Environment tokens per episode", ("episode/env_tokens",)),
        Panel("Share of episodes: how they ended, tool use", ("episode/used_tool", "episode/opening_cut"),
              prefix="episode/ended_"),
    ],
}


def _generic_panels(rows: list[dict]) -> list[Panel]:
    """For a stage with no table above: one panel per metric, `eval/x` drawn together with `x`."""
    keys = numeric_keys(rows)
    panels = [Panel(k, (k, EVAL_PREFIX + k) if EVAL_PREFIX + k in keys else (k,)) for k in keys
              if not k.startswith(EVAL_PREFIX)]
    covered = {k for p in panels for k in p.keys}
    panels += [Panel(k, (k,)) for k in keys if k not in covered]
    return panels[:MAX_GENERIC_PANELS]


def _smoothing_window(n: int) -> int:
    """About a tenth of the points, at most 25; short (e.g. eval) series are left unsmoothed."""
    window = min(n // 10, 25)
    return window if window >= 3 else 1


def _draw_curve(ax, steps, values, label: str, color: str, smooth: bool, marker: str = "o", **style) -> None:
    """Points, a line through them, or faint raw values under a moving average, by how many there are.

    Fewer than FEW_POINTS (a smoke run's 2 steps, a single eval): markers alone, a line would draw a trend between
    measurements that nothing measured. Up to 30 (sparse eval points): a line with small markers. More: per-step
    RL metrics (reward, KL, losses) are noisy, so the moving average shows the trend while the faint raw curve
    keeps spikes and divergence visible.
    """
    if len(values) < FEW_POINTS:
        ax.plot(steps, values, color=color, marker=marker, markersize=6, linestyle="none", alpha=0.85, label=label)
        return
    window = _smoothing_window(len(values)) if smooth else 1
    if window == 1:
        dots = marker if len(values) <= 30 else None  # dots mark sparse (eval) points
        ax.plot(steps, values, color=color, marker=dots, markersize=3, linewidth=1.5, label=label, **style)
        return
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8, **style)
    ax.plot(steps, moving_average(values, window), color=color, linewidth=1.8, label=f"{label} (avg {window})",
            **style)


def _draw_band(ax, steps, mean, std) -> None:
    """mean ± std: a shaded band, or error bars on the points of a short curve (a band over 2 points is a
    trapezoid, over 1 nothing)."""
    if len(steps) < FEW_POINTS:
        ax.errorbar(steps, mean, yerr=std, color=COLORS[0], linestyle="none", capsize=4, alpha=0.6, label="± std")
    else:
        ax.fill_between(steps, mean - std, mean + std, color=COLORS[0], alpha=0.12, linewidth=0, label="± std")


def _draw_panel(ax, rows: list[dict], panel: Panel) -> None:
    handles_axes = [ax]
    for i, key in enumerate(k for k in panel.keys if len(series(rows, k)[0])):
        steps, values = series(rows, key)
        _draw_curve(ax, steps, values, key, COLORS[i % len(COLORS)], panel.smooth, MARKERS[i % len(MARKERS)])
    if panel.band:
        mean_key, std_key = panel.band
        both = [r for r in rows if is_number(r.get(mean_key)) and is_number(r.get(std_key))]
        (steps, mean), (_, std) = series(both, mean_key), series(both, std_key)  # same steps: rows have both
        if len(steps):
            _draw_band(ax, steps, mean, std)
    twin_keys = [k for k in panel.twin_keys if len(series(rows, k)[0])]
    if twin_keys:
        twin = ax.twinx()
        for i, key in enumerate(twin_keys):
            _draw_curve(twin, *series(rows, key), key, COLORS[-1 - i], False, MARKERS[-1 - i], linestyle="--")
        twin.set_ylabel(", ".join(twin_keys))
        handles_axes.append(twin)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at step 1.5
    ax.grid(alpha=0.3)
    handles, labels = [], []
    for a in handles_axes:
        h, lab = a.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if len(handles) > 1 or (handles and panel.legend):
        ax.legend(handles, labels, fontsize=7, loc="best")


def plot_stage(run: StageRun, out_path: Path, title: str | None = None) -> bool:
    """Write the stage's curve grid to `out_path`; False (and no file) when it has nothing to plot."""
    fig = stage_figure(run, title)
    if fig is None:
        return False
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
    return True


def stage_panels(run: StageRun) -> tuple[list[Panel], list[str]]:
    """(the panels worth drawing, each with only its metrics that carry information; the metrics left out for being
    0 at every step, which the page names). A panel none of whose metrics is logged is left out without a word: the
    run does not measure it (a critic-free run's value loss, a single-turn run's episodes)."""
    logged = numeric_keys(run.rows)
    zero = [key for key in logged if zero_everywhere(run.rows, key)]
    panels, left_out = [], []
    for panel in PANELS.get(run.stage) or _generic_panels(run.rows):
        family = tuple(k for k in logged if panel.prefix and k.startswith(panel.prefix))
        keys = [k for k in family + panel.keys if k in logged]
        twins = [k for k in panel.twin_keys if k in logged]
        left_out += [k for k in keys + twins if k in zero and k not in left_out]
        keys, twins = tuple(k for k in keys if k not in zero), tuple(k for k in twins if k not in zero)
        if keys or twins:
            band = panel.band if panel.band and panel.band[0] in keys else None
            panels.append(replace(panel, keys=keys, twin_keys=twins, band=band, prefix="",
                                  legend=len(family + panel.keys) > 1))
    return panels, left_out


def stage_figure(run: StageRun, title: str | None = None) -> Figure | None:
    """The stage's curve grid (None when it has nothing to plot), under `title` (default "PPO — label")."""
    panels, _ = stage_panels(run)
    if not panels:
        return None
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.3 * nrows), dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        if panel.keys:
            _draw_panel(ax, run.rows, panel)
        else:  # only the twin-axis metric exists: draw it on the main axis
            _draw_panel(ax, run.rows, Panel(panel.title, panel.twin_keys, smooth=False))
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title or f"{run.stage.upper()} — {run.label}", fontsize=12, fontweight="bold")
    return fig


def plot_gold(policies: dict[str, dict], best: float | None, out_path: Path) -> None:
    """Bar chart of gold reward per policy (mean with ± stderr bars); a dashed line at `best` if given."""
    names = list(policies)
    means = [float(policies[n]["mean"]) for n in names]
    errors = [float(policies[n].get("stderr", 0.0)) for n in names]
    fig = Figure(figsize=(max(4.0, 1.3 * len(names) + 2), 3.6), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    bars = ax.bar(names, means, yerr=errors, capsize=6, color=COLORS[: len(names)] or None, alpha=0.85)
    ax.bar_label(bars, labels=[f"{m:.3g}" for m in means], padding=3, fontsize=8)
    if best is not None:
        ax.axhline(float(best), color="black", linestyle="--", linewidth=1.2, label=f"best = {float(best):.3g}")
        ax.legend(fontsize=8, loc="best")
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.margins(y=0.15)  # room for the bar labels and the best line
    ax.set_ylabel("gold reward (held-out prompts)")
    ax.set_title("Gold reward by policy (± stderr)", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)


def plot_proxy_truth(points: list[dict], out_path: Path, chosen_step: int | None = None,
                     alarms: list[tuple[int, str]] = ()) -> None:
    """Write `proxy_truth_figure` to `out_path`."""
    fig = proxy_truth_figure(points, chosen_step, alarms)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)


def proxy_truth_figure(points: list[dict], chosen_step: int | None = None,
                       alarms: list[tuple[int, str]] = ()) -> Figure:
    """Proxy and truth against KL and against the iteration (the picture of Gao et al. 2022, fig. 1), with the
    alarms raised on the run's timeline and, where the points have them, the rate of each flaw the truth punishes.
    The demo's over-optimisation curve and a run's held-out evaluations (report/proxy_truth.py) are both drawn here.

    `points`: [{"step", "kl", "proxy", "gold" (optional: no judge), "gold_stderr", "flaws": {name: rate}}, ...] in
    step order; `alarms`: (step, rule) of each alarm raised. Gold (left axis, ± stderr) and proxy (right axis: the
    reward's own scale) share each x axis; in the KL panel a faint line joins the points in training order, since
    the KL penalty can pull a policy back. Where the proxy keeps rising and the gold does not, the policy is buying
    proxy reward the gold does not pay for. Without a judge (no gold) the proxy has the left axis to itself: an
    empty gold axis would only say what the missing judge already says.
    """
    steps = [p["step"] for p in points]
    kl = [float(p["kl"]) for p in points]
    judged = all(is_number(p.get("gold")) for p in points)
    names = list(points[0].get("flaws", {})) if points else []
    fig = Figure(figsize=(5.5 * (3 if names else 2), 4.0), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, 3 if names else 2)
    chosen = next((i for i, step in enumerate(steps) if step == chosen_step), None)
    for ax, xs, label in ((axes[0], kl, "KL(policy || start), nats per response"), (axes[1], steps, "iteration")):
        _draw_proxy_and_gold(ax, xs, points, chosen if judged else None)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    drawn = [float(p["gold"]) for p in points] if judged else [float(p["proxy"]) for p in points]
    for p, x, y in zip(points, kl, drawn):
        axes[0].annotate(str(p["step"]), (x, y), textcoords="offset points", xytext=(4, -10), fontsize=6,
                         color="#555")
    what = "Proxy and gold" if judged else "Held-out proxy (no eval.judge)"
    axes[0].set_title(f"{what} against KL (labels: iteration)", fontsize=10)
    axes[1].set_title("... against the iteration, alarms as dashed lines", fontsize=10)
    for step, rule in alarms:
        axes[1].axvline(step, color="#b3261e", linestyle=":", linewidth=1)
        axes[1].annotate(rule, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=6,
                         color="#b3261e", va="top", ha="right")
    if names:
        _draw_flaws(axes[2], steps, points, names)
    return fig


def _draw_proxy_and_gold(ax, xs: list[float], points: list[dict], chosen: int | None) -> None:
    """Gold (± stderr) on `ax` and the proxy on a right axis of its own scale; with no gold, the proxy on `ax`."""
    proxy = [float(p["proxy"]) for p in points]
    judged = all(is_number(p.get("gold")) for p in points)
    twin = ax.twinx() if judged else ax
    if judged:
        gold = [float(p["gold"]) for p in points]
        ax.plot(xs, gold, color=COLORS[2], alpha=0.3, linewidth=0.8)
        ax.errorbar(xs, gold, yerr=[float(p.get("gold_stderr") or 0.0) for p in points], color=COLORS[2],
                    marker="o", markersize=5, capsize=3, linestyle="none", label="gold (held-out judge)")
        ax.set_ylabel("gold reward")
        if chosen is not None:
            ax.plot(xs[chosen], gold[chosen], marker="*", markersize=14, color="black", linestyle="none",
                    label="kept policy")
    twin.plot(xs, proxy, color=COLORS[1], alpha=0.3, linewidth=0.8, linestyle="--")
    twin.plot(xs, proxy, color=COLORS[1], marker="s", markersize=5, linestyle="none", label="proxy (training reward)")
    twin.set_ylabel("proxy reward")
    handles, labels = [], []
    for one in dict.fromkeys((ax, twin)):
        h, lab = one.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    ax.legend(handles, labels, fontsize=7, loc="lower right")


def _draw_flaws(ax, steps: list, points: list[dict], names: list[str]) -> None:
    for i, name in enumerate(names):
        ax.plot(steps, [float(p["flaws"][name]) for p in points], color=COLORS[i % len(COLORS)], marker="o",
                markersize=3, linewidth=1.4, label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("share of samples")
    ax.set_title("Flaws the gold punishes", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def plot_arena(sft: dict, algos: dict[str, dict], best: float | None, out_path: Path) -> None:
    """Gold reward (± stderr) against KL to SFT, one point per algorithm and SFT at KL 0: which algorithm buys
    more true reward for how far it moved. `algos`: {name: {"gold": {"mean", "stderr"}, "kl"}}."""
    fig = Figure(figsize=(6.4, 4.0), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    ax.errorbar([0.0], [sft["mean"]], yerr=[sft.get("stderr", 0.0)], color="#555", marker="D", markersize=6,
                capsize=3, linestyle="none", label="sft (start)")
    for i, (name, r) in enumerate(algos.items()):
        ax.errorbar([float(r["kl"])], [float(r["gold"]["mean"])], yerr=[float(r["gold"].get("stderr", 0.0))],
                    color=COLORS[i % len(COLORS)], marker="o", markersize=7, capsize=3, linestyle="none", label=name)
        ax.annotate(name, (float(r["kl"]), float(r["gold"]["mean"])), textcoords="offset points", xytext=(6, 4),
                    fontsize=8)
    if best is not None:
        ax.axhline(best, color="#999", linestyle=":", linewidth=1, label="best achievable")
    ax.set_xlabel("KL(policy || SFT), nats per response")
    ax.set_ylabel("gold reward, held-out prompts")
    ax.set_title("The arena: gold reward against KL", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
