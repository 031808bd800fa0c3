"""reasoning-gym's procedural tasks as rows and reward: `task.name` (config/task_schema.py).

- `check(task)`: the name is a reasoning-gym task and `task.args` are fields of its config, said as a ConfigError
  naming the key (before any model loads);
- `write_rows(task, cache_dir)`: the task's questions, written once (atomically) to a folder named by the
  settings: train.jsonl (`task.size` questions from `task.seed`) and test.jsonl (`task.eval_size` distinct
  questions from seed + 1, none of them the text of a training question). Each row is
  {prompt, response, answer, task}: sft reads prompt -> response, ppo the prompt, `score` the task field (which
  entry of which reasoning-gym dataset the row is);
- `score(prompts, responses, task)`: the task's own scorer (the dataset's `score_answer`) on each response,
  stripped of surrounding whitespace: reasoning-gym's scorers want the bare answer ("7", not "The answer is 7"),
  which is what sft on the task's rows teaches.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import fields as dataclass_fields
from pathlib import Path

from rlhfkit.errors import ConfigError, DataError

INSTALL = "pip install 'rlhfkit[tasks]'"
SCORE = "rlhfkit.tasks.reasoning_gym:score"  # the reward a ppo step with a task gets
LIST = "python -c \"import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))\""
# held-out candidates drawn per held-out question before giving up: a task whose questions the training ones
# nearly exhaust cannot give a held-out set that does not overlap it
CANDIDATES_PER_QUESTION = 50


def library(prefix: str = "task."):
    """The reasoning_gym module; ConfigError with the install line when it is missing."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"config key '{prefix}name': reasoning-gym is not installed; {INSTALL}") from None
    return reasoning_gym


def registry(prefix: str = "task.") -> dict:
    """reasoning-gym's tasks: name -> (dataset class, config class)."""
    return library(prefix).factory.DATASETS


def check(task, prefix: str = "task.") -> None:
    """The task exists and takes `task.args`; ConfigError naming the key otherwise."""
    known = registry(prefix)
    if task.name not in known:
        close = difflib.get_close_matches(task.name, list(known), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(f"config key '{prefix}name': reasoning-gym has no task {task.name!r}; {hint}"
                          f"its {len(known)} tasks: {LIST}")
    config_cls = known[task.name][1]
    params = [f.name for f in dataclass_fields(config_cls) if f.name not in ("seed", "size")]
    for key in task.args:
        if key not in params:
            raise ConfigError(f"config key '{prefix}args.{key}': reasoning-gym's {task.name} has no parameter "
                              f"{key!r} (its parameters: {', '.join(params)})")
    dataset(task, task.seed, 1, prefix)  # the task's own checks of its parameters (min <= max, ...)


def dataset(task, seed: int, size: int, prefix: str = "task."):
    """reasoning-gym's dataset of `size` questions of the task from `seed`."""
    try:
        return library().create_dataset(task.name, **task.args, seed=seed, size=size)
    except (AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(f"config key '{prefix}args': reasoning-gym's {task.name} refused {task.args}: "
                          f"{exc or type(exc).__name__}") from None


def _row(entry: dict, task, seed: int, size: int, index: int) -> dict:
    """A question as a row: what sft and ppo read, and where the entry comes from. `score` regenerates the entry
    from `task` (reasoning-gym makes entry `index` of a seed the same every time) rather than reading its metadata
    back from JSON, which turns its tuples into lists that some scorers (arc_agi, rearc) then find unequal."""
    source = {"name": task.name, "args": task.args, "seed": seed, "size": size, "index": index}
    return {"prompt": entry["question"], "response": entry.get("answer"), "answer": entry.get("answer"),
            "task": source}


def rows(task) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): `task.size` questions from `task.seed`; then `task.eval_size` distinct
    questions from seed + 1 whose text is no training question's (DataError when the task cannot give that many)."""
    train = [_row(entry, task, task.seed, task.size, i) for i, entry in enumerate(dataset(task, task.seed, task.size))]
    seen = {row["prompt"] for row in train}
    candidates = task.eval_size * CANDIDATES_PER_QUESTION
    heldout = []
    for i, entry in enumerate(dataset(task, task.seed + 1, candidates)):
        if entry["question"] not in seen:
            seen.add(entry["question"])
            heldout.append(_row(entry, task, task.seed + 1, candidates, i))
            if len(heldout) == task.eval_size:
                return train, heldout
    raise DataError(f"task {task.name}: {candidates} more questions gave only {len(heldout)} that are neither a "
                    f"training question nor a repeat, short of task.eval_size={task.eval_size}: its settings "
                    f"{task.args or '(defaults)'} allow few distinct questions; lower task.size or task.eval_size, "
                    f"or widen task.args")


def folder_for(task, cache_dir: Path) -> Path:
    """The folder the task's rows go to: task.dir, else cache_dir/tasks/<name>-<hash of the settings and the
    reasoning-gym version>."""
    if task.dir:
        return Path(task.dir).expanduser()
    from importlib.metadata import version

    settings = {"name": task.name, "args": task.args, "size": task.size, "eval_size": task.eval_size,
                "seed": task.seed, "reasoning_gym": version("reasoning_gym")}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return cache_dir / "tasks" / f"{task.name}-{digest}"


def _write_atomic(path: Path, text: str) -> None:
    """Written under a temporary name and renamed (every rank writes the same text; a reader never sees half)."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return  # unchanged: its modification time (the data cache's key) stays
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_rows(task, cache_dir: Path) -> Path:
    """Generate the task's rows and write them to `folder_for(task, cache_dir)`: train.jsonl and test.jsonl (the
    folder's test split, which the steps evaluate on)."""
    check(task)
    train, heldout = rows(task)
    folder = folder_for(task, cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("test", heldout)):
        _write_atomic(folder / f"{name}.jsonl", "".join(json.dumps(row) + "\n" for row in part))
    return folder


def sft_rows(folder: Path) -> None:
    """DataError when no training row of the task has an answer to learn from (a task that checks answers
    instead of knowing one)."""
    with open(folder / "train.jsonl", encoding="utf-8") as fh:
        if not any(json.loads(line).get("response") is not None for line in fh):
            raise DataError(f"task rows {folder / 'train.jsonl'}: the task gives no answer to its questions (its "
                            f"scorer checks answers instead), so sft has nothing to learn from; give sft data.train")


_DATASETS: dict = {}  # (name, args, seed, size) -> the dataset the rows came from, and its scorer


def entry_of(source: dict) -> tuple[dict, object]:
    """(the reasoning-gym entry a row's `task` field names, the dataset that scores it)."""
    key = json.dumps([source["name"], source["args"], source["seed"], source["size"]], sort_keys=True)
    if key not in _DATASETS:
        _DATASETS[key] = library().create_dataset(source["name"], **source["args"], seed=source["seed"],
                                                  size=source["size"])
    data = _DATASETS[key]
    return data[source["index"]], data


def score(prompts, responses, task) -> list:
    """Each response scored by its task's own scorer (the `score_answer` of the reasoning-gym dataset the row came
    from, on the entry regenerated exactly), on the response stripped of surrounding whitespace; None (unjudged)
    where the scorer raised."""
    scores = []
    for response, source in zip(responses, task):
        entry, data = entry_of(source)
        try:
            scores.append(float(data.score_answer(response.strip(), entry)))
        except Exception:  # the library's scorer failed on this text: not judged, rather than judged wrong
            scores.append(None)
    return scores
