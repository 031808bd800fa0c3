"""Reading `metrics.jsonl` files and finding the stage runs inside an output folder."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlhfkit.run_files import METRICS_FILE, read_jsonl

STAGE_ORDER = {"pretrain": -1, "sft": 0, "rm": 1, "ppo": 2}  # pretrain: the demo's base model


@dataclass
class StageRun:
    """One run's metrics. `label` is unique within a report and safe to use in a file name."""

    label: str  # "sft", "rm", "ppo" or the subfolder's name
    stage: str  # the "stage" field of the rows ("sft" | "rm" | "ppo"), or the label when rows lack it
    path: Path  # the metrics.jsonl file
    rows: list[dict]


def load_metrics(path: str | Path) -> list[dict]:
    """Rows of a `metrics.jsonl` file, as written (non-numeric values are kept; `series` ignores them)."""
    rows = read_jsonl(path)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i + 1} is {type(row).__name__}, expected a JSON object")
    return rows


def is_number(value) -> bool:
    """True for finite ints and floats (bools are not metrics)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def numeric_keys(rows: list[dict]) -> list[str]:
    """Metric names with at least one numeric value, in first-seen order (`step` excluded)."""
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and is_number(value):
                keys.setdefault(key, None)
    return list(keys)


# A value this close to 0 is 0 but for float rounding: PPO's approx. KL under one update per rollout, a ratio of 1
# computed from two forwards, logs ~1e-13; a policy that moved logs 1e-5 and more.
ZERO = 1e-9


def zero_everywhere(rows: list[dict], key: str) -> bool:
    """`key` is logged and every logged value is 0 (to float rounding): a curve that carries no information (e.g.
    PPO's clip fraction with one update per rollout, which never moves the policy from the one that sampled)."""
    _, values = series(rows, key)
    return len(values) > 0 and bool((np.abs(values) <= ZERO).all())


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values), both (N,), sorted by step, over the rows with a numeric `step` and a numeric `key`.

    A resumed run logs again the steps after its last checkpoint: the later row of a step wins.
    """
    by_step = {row["step"]: row[key] for row in rows if is_number(row.get("step")) and is_number(row.get(key))}
    if not by_step:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*sorted(by_step.items()))
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def last_value(rows: list[dict], key: str):
    """The last numeric value of `key`, or None."""
    for row in reversed(rows):
        if is_number(row.get(key)):
            return row[key]
    return None


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average of (N,) values; the ends average over the points that exist, so no shrinkage."""
    if window <= 1 or len(values) == 0:
        return values.astype(float)
    kernel = np.ones(window)
    total = np.convolve(values, kernel, mode="same")
    count = np.convolve(np.ones_like(values, dtype=float), kernel, mode="same")
    return total / count


def _stage_of(rows: list[dict], fallback: str) -> str:
    stages = Counter(row["stage"] for row in rows if isinstance(row.get("stage"), str))
    return stages.most_common(1)[0][0] if stages else fallback


def _safe_label(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "run"


def find_stage_runs(run_dir: str | Path) -> list[StageRun]:
    """The runs in `run_dir`: its own `metrics.jsonl` and those of its direct subfolders.

    Ordered sft, rm, ppo, then any other stage by name. Raises FileNotFoundError when there is none.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: not a folder")
    candidates = []
    if (run_dir / METRICS_FILE).is_file():
        candidates.append((None, run_dir / METRICS_FILE))
    for sub in sorted(p for p in run_dir.iterdir() if p.is_dir()):
        if (sub / METRICS_FILE).is_file():
            candidates.append((sub.name, sub / METRICS_FILE))
    if not candidates:
        raise FileNotFoundError(f"{run_dir}: no {METRICS_FILE} in it or in its subfolders")

    runs, used = [], set()
    for sub_name, path in candidates:
        rows = load_metrics(path)
        stage = _stage_of(rows, fallback=sub_name or "run")
        label = base = _safe_label(sub_name or stage)
        n = 2
        while label in used:  # e.g. two subfolders that sanitise to the same name
            label, n = f"{base}_{n}", n + 1
        used.add(label)
        runs.append(StageRun(label=label, stage=stage, path=path, rows=rows))
    runs.sort(key=lambda r: (STAGE_ORDER.get(r.stage, len(STAGE_ORDER)), r.label))
    return runs
