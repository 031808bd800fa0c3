"""A stage's output folder: what a fresh run clears, what --resume checks, the config.yaml it writes.

A folder holds one run. A fresh run (no --resume) into a folder that holds another run's outputs is refused
unless --force, and with --force everything an earlier run wrote is removed first (checkpoints included), so a
later --resume can only continue this run. --resume compares the command's settings with the config.yaml of the
run that wrote the checkpoints: a different model or data is an error (the checkpoint belongs to another run),
any other changed setting is listed on stderr and used.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

import yaml

from rlhfkit.config.fields import dump_yaml, to_dict
from rlhfkit.errors import USER_ERRORS, RunError
from rlhfkit.registry.estimators import ESTIMATORS
from rlhfkit.run_files import (CONFIG_FILE, METRICS_FILE, STAGE_FILES, STAGE_FOLDERS, checkpoints_dir, final_dir,
                               latest_pointer, read_jsonl)

# settings that make a checkpoint another run's: the models and the data
IDENTITY = ("model", "actor", "critic", "reward", "reference", "load.tokenizer", "data.train", "data.eval",
            "data.prompts", "data.eval_prompts", "data.ptx", "data.format", "data.fields", "lora.rank",
            "lora.alpha", "lora.target_modules", "task")
# ... where the task is read at all: the task keys of two runs that name none are not data (rm and dpo have none)
TASK_KEYS = "task."
# settings a resumed run changes routinely (more steps, other logging): not worth a line
QUIET = ("output_dir", "eval.keep_best", "train.max_steps", "train.epochs", "train.log_every", "train.eval_every", "train.save_every",
         "train.keep_checkpoints", "log.", "data.cache", "data.cache_dir", "engine.collective_timeout_s")


def check_output_dir(cfg, resume: bool, force: bool) -> None:
    """RunError when the folder refuses the run: a finished or unfinished run there and neither --force nor
    --resume, or --resume with no checkpoint. Reads the folder only: a stage checks it before anything loads."""
    out = Path(cfg.output_dir)
    latest = latest_pointer(out)
    if resume:
        if not latest.is_file():
            raise RunError(f"--resume: no checkpoint in '{checkpoints_dir(out)}' to resume from")
    elif not force:
        if final_dir(out).exists():
            raise RunError(f"output_dir '{out}' already holds a finished run (final/ exists): pass --force to "
                           f"overwrite it, --resume to continue from its checkpoints, or choose another output_dir")
        if latest.is_file():
            raise RunError(f"output_dir '{out}' holds an unfinished run (checkpoint {latest.read_text().strip()}): "
                           f"pass --resume to continue it, --force to start over, or choose another output_dir")


def prepare_output_dir(cfg, resume: bool, force: bool, is_main: bool = True) -> Path:
    """Check the folder against --resume / --force (again: `start_stage` checked it first), clear a replaced run's
    outputs, write a fresh run's config.yaml (a resumed run's is written by `resumed_from`, once its checkpoint
    loaded).

    Called only after data and models were checked, so a bad input leaves no folder behind.
    """
    out = Path(cfg.output_dir)
    check_output_dir(cfg, resume, force)
    if resume:
        _check_resume(cfg, out, is_main)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not resume:
            clear_run_outputs(out)
            dump_yaml(cfg, out / CONFIG_FILE)
    return out


def resumed_from(cfg, out: Path, step: int, is_main: bool) -> int:
    """After a resumed run's checkpoint loaded: config.yaml takes its settings (a resume that failed to load,
    say on another engine, leaves the checkpointed run's config.yaml as it was). Returns `step`."""
    if is_main:
        dump_yaml(cfg, out / CONFIG_FILE)
    return step


@contextlib.contextmanager
def undone_if_bad_input_at_start(out: Path, fresh: bool, is_main: bool):
    """Bad input that shows only once the run started (a PPO reward function that raises, or returns NaN, on its
    first responses) leaves no half-written run behind: if such an error comes before the first training step
    was logged, the outputs of a fresh run and its config.yaml are removed again (and its folder, when empty)."""
    try:
        yield
    except USER_ERRORS:
        if fresh and is_main and not _logged_a_step(out):
            clear_run_outputs(out)
            (out / CONFIG_FILE).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                out.rmdir()  # only when nothing else is in it
        raise


def _logged_a_step(out: Path) -> bool:
    path = out / METRICS_FILE
    rows = read_jsonl(path, skip_bad_lines=True) if path.is_file() else []
    return any(isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] >= 1 for row in rows)


def clear_run_outputs(out: Path) -> None:
    """Remove what an earlier run wrote into `out` (only the names the stages write; other files stay)."""
    for name in STAGE_FILES:
        (out / name).unlink(missing_ok=True)
    for name in STAGE_FOLDERS:
        if (out / name).is_dir():
            shutil.rmtree(out / name)


def _flatten(tree, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "fields":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _same(old, new) -> bool:
    if old == new:
        return True
    if isinstance(old, str) and isinstance(new, str):
        # the same folder or file, written another way (./data/x.jsonl, data/x.jsonl, an absolute path)
        a, b = Path(old), Path(new)
        return a.exists() and b.exists() and a.resolve() == b.resolve()
    return False


def changed_settings(old: dict, new: dict, quiet: tuple = QUIET) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every setting that differs, the `quiet` (housekeeping) keys left
    out."""
    old_flat, new_flat = _flatten(old), _flatten(new)
    changes = []
    for key in new_flat.keys() | old_flat.keys():
        if any(key == q or (q.endswith(".") and key.startswith(q)) for q in quiet):
            continue
        if not _same(old_flat.get(key), new_flat.get(key)):
            changes.append((key, old_flat.get(key), new_flat.get(key)))
    return sorted(changes)


def _uses_critic(estimator) -> bool:
    return estimator in ESTIMATORS and ESTIMATORS[estimator].critic


def changes_since(out: Path, cfg, quiet: tuple = QUIET) -> list[tuple[str, object, object]]:
    """`changed_settings` between the run recorded in `out/config.yaml` and `cfg`; none when no readable
    config.yaml is there (a folder from before it was written: nothing to compare)."""
    previous = out / CONFIG_FILE
    if not previous.is_file():
        return []
    try:
        old = yaml.safe_load(previous.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError:
        return []
    return changed_settings(old, to_dict(cfg), quiet)


def listed(changes: list[tuple[str, object, object]]) -> str:
    """The changes as one line: `key: old -> new; ...`."""
    return "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes)


def _check_resume(cfg, out: Path, is_main: bool) -> None:
    previous = out / CONFIG_FILE
    changes = changes_since(out, cfg)
    named = any(key == "task.name" and (old or new) for key, old, new in changes) or \
        bool(getattr(getattr(cfg, "task", None), "name", None))
    foreign = [c for c in changes if any(c[0] == k or c[0].startswith(k + ".") for k in IDENTITY)
               and (named or not c[0].startswith(TASK_KEYS))]
    if foreign:
        raise RunError(f"--resume: the checkpoints in '{checkpoints_dir(out)}' belong to a run with another model "
                       f"or data ({listed(foreign)}); resume with the settings in '{previous}', or pass --force to "
                       f"start a new run there")
    estimator = next((c for c in changes if c[0] == "ppo.advantage_estimator"), None)
    if estimator is not None and _uses_critic(estimator[1]) != _uses_critic(estimator[2]):
        _, before, after = estimator
        raise RunError(f"--resume: the checkpoints in '{checkpoints_dir(out)}' belong to a run "
                       f"{'with' if _uses_critic(before) else 'without'} a critic (ppo.advantage_estimator: "
                       f"{before!r} -> {after!r}); resume with {before!r}, or pass --force to start a new run there")
    if changes and is_main:
        print(f"resume: settings changed since the checkpointed run, the new ones are used: {listed(changes)}",
              file=sys.stderr)
