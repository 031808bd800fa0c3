"""Tasks from other libraries as a step's rows and reward (`task` in a config, config/task_schema.py):
reasoning-gym's procedural tasks, each scored by its own scorer (reasoning_gym.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def task_rows(cfg, kind: str, note: Callable[[str], None], cache_dir: Path) -> str | None:
    """The folder of the task's rows when this step reads them: it names a task (`task.name`) and no data source
    of its own (`data.train`; ppo: `data.prompts`). The rows are generated and written first (once, under
    `cache_dir`: the folder is named by the task's settings), and a line says what they are. None when the step
    reads its own data."""
    task = getattr(cfg, "task", None)
    own = cfg.data.prompts if kind == "prompts" else cfg.data.train
    if task is None or not task.name or own is not None:
        return None
    from rlhfkit.tasks import reasoning_gym

    folder = reasoning_gym.write_rows(task, cache_dir)
    if kind == "sft":
        reasoning_gym.sft_rows(folder)
    note(f"task {task.name} (reasoning-gym{', ' + str(task.args) if task.args else ''}): {task.size} training and "
         f"{task.eval_size} held-out questions (none a training one) in {folder}")
    return str(folder)
