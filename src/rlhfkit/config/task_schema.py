"""The `task` section: a procedural task from a library (reasoning-gym) as a step's rows and reward, by name.

```yaml
task: {name: chain_sum, args: {min_terms: 2, max_terms: 2}, size: 2000, eval_size: 100}
```

sft reads the task's questions with their answers, ppo its questions as prompts, scored by the task's own scorer
(`rlhfkit.tasks.reasoning_gym:score`), each unless the step sets `data.train` / `data.prompts` / `reward` itself.
The rows are written once to a folder named by these settings (`rlhfkit.tasks.reasoning_gym`), so every step of
a pipeline reads the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhfkit.config.fields import option
from rlhfkit.errors import ConfigError


@dataclass
class TaskConfig:
    name: Optional[str] = option(None, "a reasoning-gym task by name (e.g. chain_sum, basic_arithmetic, "
                                       "leg_counting; needs `pip install 'rlhfkit[tasks]'`): sft trains on its "
                                       "question -> answer rows, ppo on its questions scored by the task's own "
                                       "scorer, unless data.train / data.prompts / reward are set (docs/tasks.md)")
    args: dict = option({}, "the task's own parameters: fields of its reasoning-gym config, e.g. "
                            "{min_terms: 2, max_terms: 2} for chain_sum")
    size: int = option(2000, "training questions generated")
    eval_size: int = option(100, "held-out questions: none is the text of a training question")
    seed: int = option(0, "the training questions' seed (the held-out ones are drawn from seed + 1)")
    dir: Optional[str] = option(None, "where the rows are written (train.jsonl, test.jsonl); default a folder named "
                                      "by the task's settings under the data cache (data.cache_dir)")

    def validate(self, prefix: str = "") -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ConfigError(f"config key '{prefix}name': expected a task name such as chain_sum, got {self.name!r}")
        if not isinstance(self.args, dict):
            raise ConfigError(f"config key '{prefix}args': expected a mapping of the task's parameters, got "
                              f"{self.args!r}")
        for key in ("size", "eval_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{prefix}{key}': must be >= 1, got {getattr(self, key)}")
        if self.name:  # the name and parameters, checked by the library itself now, not when a step starts
            from rlhfkit.tasks.reasoning_gym import check

            check(self, prefix)
