"""`rlhfkit pipeline`: SFT -> RM -> PPO (or SFT -> DPO) from one config, each step the same `run_*` a single-step
command calls.

1. build and check every step's config before anything trains (a shared `dataset` reaches each step as its
data source with data.split_fractions = data_split and its own data.split_index), 2. run the steps in order,
skipping a complete one (its final/ exists, made with these settings) unless --force or --rerun names it or it
is built on a step that runs again (`plan`), each logging into output_dir/STEP/ (metrics.jsonl,
log.txt, result.json: what the step returned and its seconds), 3. write and print the summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from rlhfkit.config.pipeline_schema import PipelineConfig, step_config
from rlhfkit.data.loader import mix_sources
from rlhfkit.data.presets import unreadable_source
from rlhfkit.engine.launch import is_main_process
from rlhfkit.errors import USER_ERRORS, ConfigError, DataError, RunError
from rlhfkit.metric_names import EVAL_ACCURACY, EVAL_KL, EVAL_LOSS, EVAL_MARGIN, EVAL_REWARD
from rlhfkit.run_files import (CONFIG_FILE, LOG_FILE, METRICS_FILE, RESULT_FILE, SUMMARY_FILE, final_dir,
                               latest_pointer)
from rlhfkit.stages.common import write_run_report
from rlhfkit.stages.dpo import run_dpo
from rlhfkit.stages.ppo import run_ppo
from rlhfkit.stages.reward import run_rm
from rlhfkit.stages.run_dir import QUIET, changes_since, listed
from rlhfkit.stages.sft import run_sft

RUNNERS = {"sft": run_sft, "rm": run_rm, "ppo": run_ppo, "dpo": run_dpo}
# metrics worth a line in the summary: (step, metrics.jsonl key)
HEADLINES = (("sft", EVAL_LOSS), ("rm", EVAL_ACCURACY), ("ppo", EVAL_REWARD), ("ppo", EVAL_KL),
             ("dpo", EVAL_ACCURACY), ("dpo", EVAL_MARGIN))


def _say(text: str) -> None:
    if is_main_process():
        print(text, file=sys.stderr)


def _write_atomic(path: Path, text: str) -> None:
    """Written under a temporary name and renamed: a reader (or a killed run) never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class _Tee:
    """A text stream writing to the terminal and to a step's log.txt."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()

    def isatty(self) -> bool:
        return self.streams[0].isatty()


@contextlib.contextmanager
def step_log(folder: Path):
    """Copy stderr (the step's progress lines) into folder/log.txt, on the main rank."""
    if not is_main_process():
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOG_FILE, "a", encoding="utf-8") as fh, contextlib.redirect_stderr(_Tee(sys.stderr, fh)):
        yield


def _first_last(folder: Path, key: str) -> tuple | None:
    from rlhfkit.report.metrics import load_metrics, series

    path = folder / METRICS_FILE
    if not path.is_file():
        return None
    _, values = series(load_metrics(path), key)
    return (float(values[0]), float(values[-1])) if len(values) else None


def summary_rows(out: Path, steps: dict) -> list[dict]:
    """Rows in the report's summary format: one per step (ran / skipped, seconds), one per headline metric."""
    rows = []
    for step, info in steps.items():
        rows.append({"name": f"{step}: {info['status']}", "value": round(info.get("seconds", 0.0), 1),
                     "target": "seconds", "passed": None})
    for step, key in HEADLINES:
        span = _first_last(out / step, key) if step in steps else None
        if span:
            rows.append({"name": f"{step} {key} (first -> last)", "value": f"{span[0]:.4g} -> {span[1]:.4g}",
                         "target": "", "passed": None})
    return rows


def print_table(title: str, rows: list[dict], stream=None) -> None:
    stream = stream or sys.stdout
    width = max(len(r["name"]) for r in rows)
    print(f"\n{title}", file=stream)
    for r in rows:
        mark = {True: "PASS", False: "FAIL"}.get(r.get("passed"), "")
        value = f"{r['value']:.4g}" if isinstance(r["value"], float) else str(r["value"])
        target = f"  ({r['target']})" if r.get("target") else ""
        print(f"  {r['name']:<{width}}  {value:>16}{target}  {mark}".rstrip(), file=stream)


# a finished step's settings that do not change what it made (its steps and epochs do)
FINISHED_QUIET = tuple(key for key in QUIET if key not in ("train.max_steps", "train.epochs"))


def inputs_from(step_cfg, out: Path) -> set:
    """The pipeline steps whose final/ this step's config reads (its model, actor, reward, critic, reference)."""
    made = {str(final_dir(out / step)): step for step in RUNNERS}
    return {made[value] for key in ("model", "actor", "reward", "critic", "reference")
            if isinstance(value := getattr(step_cfg, key, None), str) and value in made}


def plan(cfg: PipelineConfig, configs: dict, force: bool, rerun: str | None) -> dict:
    """Each step's fate, in order: "skip" (complete, as it was made), "run" (fresh, or its unfinished run), or
    "redo" (a fresh start over what it made: --force, --rerun, or it is built on a step that runs again, whose
    old outputs it was made from). A complete step made with other settings than these is an error."""
    out, fates = Path(cfg.output_dir), {}
    for step in cfg.steps:
        folder = out / step
        upstream = inputs_from(configs[step], out) & {s for s, fate in fates.items() if fate != "skip"}
        if force or step == rerun or upstream:
            fates[step] = "redo"
        elif final_dir(folder).exists():
            changes = changes_since(folder, configs[step], FINISHED_QUIET)
            if changes:
                raise RunError(f"pipeline: {step}: '{folder}' holds a finished run made with other settings "
                               f"({listed(changes)}); pass --rerun {step} to rerun it (and the steps built on it) "
                               f"with these, or put back the settings of '{folder / CONFIG_FILE}'")
            fates[step] = "skip"
        else:
            fates[step] = "run"
    return fates


def data_sources(step_cfg) -> list[tuple[str, str]]:
    """(config key, source name) of every data source a step's config names: prompts, eval prompts and PPO-ptx
    text for ppo; train and eval data for the others."""
    data, named = step_cfg.data, []
    if hasattr(data, "prompts"):
        keys = [("data.prompts", data.prompts), ("data.eval_prompts", data.eval_prompts)]
        keys += [("data.ptx", data.ptx)] if step_cfg.ptx.coef > 0 else []
    else:
        keys = [("data.train", data.train), ("data.eval", data.eval)]
    for key, spec in keys:
        if spec is not None:
            named += [(key, name) for name, _ in mix_sources(spec, key)]
    return named


def check_data(configs: dict) -> None:
    """Every step's data sources exist (or are hub names that can be fetched) before the first step trains: a
    wrong path in the last step would otherwise be found after the first steps ran for hours. (Only the steps
    that will run: a complete step's data may be gone since.)"""
    for step, step_cfg in configs.items():
        for key, name in data_sources(step_cfg):
            problem = unreadable_source(name, step_cfg.data.preset, step_cfg.data.local_dir)
            if problem:
                raise DataError(f"pipeline: {step}: {key}: {problem}")


def run_pipeline(cfg: PipelineConfig, resume: bool = False, force: bool = False, rerun: str | None = None) -> dict:
    out = Path(cfg.output_dir)
    if rerun is not None and rerun not in cfg.steps:
        raise ConfigError(f"--rerun: '{rerun}' is not one of the pipeline's steps {cfg.steps}")
    # 1. every step's config first: a bad key fails before anything trains (each step checks its data itself)
    configs = {step: step_config(cfg, step) for step in cfg.steps}
    fates = plan(cfg, configs, force, rerun)
    check_data({step: step_cfg for step, step_cfg in configs.items() if fates[step] != "skip"})
    steps: dict = {}

    # 2. the steps, in order; each is exactly `rlhfkit STEP --config <its config>`
    for step in cfg.steps:
        folder = out / step
        if fates[step] == "skip":
            previous = folder / RESULT_FILE
            result = json.loads(previous.read_text()) if previous.is_file() else {}
            # the seconds it took when it ran (result.json keeps them), not the 0 of this skip
            steps[step] = {"status": "skipped (complete)", "result": result, "seconds": result.get("seconds", 0.0)}
            _say(f"pipeline: {step}: {final_dir(folder)} exists, skipped (--rerun {step} reruns it)")
            continue
        redo = fates[step] == "redo"
        latest = latest_pointer(folder)
        if latest.is_file() and not (resume or redo):
            raise RunError(f"pipeline: {step}: '{folder}' holds an unfinished run (checkpoint "
                           f"{latest.read_text().strip()}): pass --resume to continue it, or --rerun {step} to "
                           f"start it over")
        if redo and not force and step != rerun and (final_dir(folder).exists() or latest.is_file()):
            built_on = sorted(inputs_from(configs[step], out) & {s for s in steps if steps[s]["status"] == "ran"})
            _say(f"pipeline: {step}: built on {', '.join(built_on)}, which ran again: its earlier run is replaced")
        _say(f"pipeline: {step}: running into {folder}")
        tick, fresh = time.perf_counter(), not folder.exists()
        try:
            with step_log(folder):
                again = resume and not redo and latest.is_file()
                result = RUNNERS[step](configs[step], resume=again, force=redo)
        except USER_ERRORS:
            # bad input found before the step wrote anything: its folder held only the log, now gone again
            if fresh and is_main_process() and folder.is_dir() and [p.name for p in folder.iterdir()] == [LOG_FILE]:
                shutil.rmtree(folder)
            raise
        seconds = time.perf_counter() - tick
        if is_main_process():
            _write_atomic(folder / RESULT_FILE, json.dumps({**result, "seconds": round(seconds, 1)}, indent=2,
                                                             default=str))
        stopped = result.get("stopped_at_step")
        steps[step] = {"status": "ran" if stopped is None else f"stopped at step {stopped} by a monitor",
                       "seconds": seconds, "result": result}

    # 3. summary.json in the report's format (`rlhfkit report OUTPUT_DIR` renders it) and a table on stdout
    rows = summary_rows(out, steps)
    summary = {"title": f"rlhfkit pipeline — {out.name}", "rows": rows, "steps": steps}
    if is_main_process():
        _write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=2, default=str))
        print_table(summary["title"], rows)
        write_run_report(out, cfg.log, True)  # every step's curves on one page
    stopped = {step: info["result"]["stopped_by"] for step, info in steps.items()
               if info["status"] != "skipped (complete)" and "stopped_by" in info["result"]}
    return {"output_dir": str(out), **{step: info["status"] for step, info in steps.items()},
            "final": {step: str(final_dir(out / step)) for step in steps},
            **({"stopped_by": stopped} if stopped else {})}
