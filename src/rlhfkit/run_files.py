"""What a run writes into its output folder: the name of every file and folder, the one reader of its JSON-lines
files, and the one cut of them a resumed run makes.

    out/                      output_dir of one stage (a pipeline's or a demo's: one such folder per step)
      config.yaml             the run's settings, written once its models loaded (stages/run_dir.py)
      metrics.jsonl           one JSON object per logged step (stages/common.py: MetricsLogger)
      samples.jsonl           sampled responses: PPO's every ppo.sample_every steps; a demo's, shown in the report
      eval_samples.jsonl      an RL run's held-out responses and their scores, at each evaluation
      best.json               which step best/ is, its score and standard error (stages/best.py)
      result.json             what a pipeline step returned, and its seconds (stages/pipeline.py)
      summary.json            a pipeline's or a demo's summary rows (report/page.py renders them)
      log.txt                 a pipeline step's copy of stderr (appended to, and kept, by a rerun)
      report.html, plots/     the report (report/page.py)
      final/, final-critic/, final-ema/, best/   exported models (HF folders)
      checkpoints/latest      the pointer to the newest checkpoint folder (engine/storage.py)
      tensorboard/

Imports nothing of rlhfkit, so every layer names a run's files through it.
"""

from __future__ import annotations

import json
from pathlib import Path

# files
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"
BEST_FILE = "best.json"
RESULT_FILE = "result.json"
SUMMARY_FILE = "summary.json"
LOG_FILE = "log.txt"
REPORT_FILE = "report.html"
# the demo's (demo/run.py, demo/task_run.py), drawn by the report when present (report/page.py)
GOLD_FILE = "gold.json"
OVEROPTIMISATION_FILE = "overoptimisation.json"
ARENA_FILE = "arena.json"

# folders
FINAL_DIR = "final"
FINAL_CRITIC_DIR = "final-critic"
FINAL_EMA_DIR = "final-ema"
BEST_DIR = "best"
CHECKPOINTS_DIR = "checkpoints"
LATEST_POINTER = "latest"  # in checkpoints/: the name of the newest complete checkpoint's folder
TENSORBOARD_DIR = "tensorboard"
PLOTS_DIR = "plots"

# what a stage writes into its output_dir: what a fresh run over an earlier one clears (stages/run_dir.py); the
# pipeline's log.txt is appended to and kept
STAGE_FILES = (METRICS_FILE, SAMPLES_FILE, EVAL_SAMPLES_FILE, BEST_FILE, RESULT_FILE, REPORT_FILE)
STAGE_FOLDERS = (CHECKPOINTS_DIR, TENSORBOARD_DIR, FINAL_DIR, FINAL_CRITIC_DIR, FINAL_EMA_DIR, BEST_DIR, PLOTS_DIR)
# the run files whose rows carry the step that logged them, cut on resume (samples.jsonl: PPO's `ppo.sample_every`
# triples; eval_samples.jsonl: each evaluation's held-out answers, step 0 the start's)
STEP_LOGS = (METRICS_FILE, SAMPLES_FILE, EVAL_SAMPLES_FILE)


def final_dir(out: str | Path) -> Path:
    """out/final: the model a finished run exported."""
    return Path(out) / FINAL_DIR


def checkpoints_dir(out: str | Path) -> Path:
    """out/checkpoints: the run's checkpoints, one folder each, and the `latest` pointer."""
    return Path(out) / CHECKPOINTS_DIR


def latest_pointer(out: str | Path) -> Path:
    """out/checkpoints/latest: the file naming the newest checkpoint (a run that has one can be resumed)."""
    return checkpoints_dir(out) / LATEST_POINTER


def _parsed_lines(path: Path, skip_bad_lines: bool):
    """(line, value) of each non-blank line of a JSON-lines file that parses (see `read_jsonl`)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    for k, (lineno, line) in enumerate(numbered):
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            if skip_bad_lines:
                continue
            if k == len(numbered) - 1:
                break  # the truncated last line of a killed run
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
        yield line, value


def read_jsonl(path: str | Path, skip_bad_lines: bool = False) -> list:
    """The values of a JSON-lines file, blank lines skipped.

    A run killed mid-write leaves a partial last line, so that one is dropped; a malformed line anywhere else means
    the file is corrupt and raises ValueError naming the line. With `skip_bad_lines` every line that is not JSON is
    skipped instead (what a resumed run reads back: it goes on from whatever the killed run left).
    """
    return [value for _, value in _parsed_lines(Path(path), skip_bad_lines)]


def drop_rows_after(out: str | Path, step: int) -> None:
    """On resume from the checkpoint of `step`, drop the rows of `STEP_LOGS` logged after it: the resumed run logs
    those steps again (a killed run's samples of later steps would otherwise stay beside the resumed run's own).
    Kept rows keep their text; a line cut by the kill, and a row without an integer step, go."""
    for name in STEP_LOGS:
        path = Path(out) / name
        if not path.is_file():
            continue
        kept = [line for line, row in _parsed_lines(path, skip_bad_lines=True)
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        tmp.replace(path)
