"""best/: the policy of the best held-out score so far, exported beside final/ whenever an evaluation improves on it.

The score is eval/gold, the second judge's (`eval.judge`), where there is one; else eval/reward, the training
reward on held-out prompts, which the policy climbed and can game: the summary says which. The starting policy's
evaluation counts too, so a run that only made things worse keeps its start. best.json beside the folder says which
step best/ is, its score and standard error; a resumed run reads it back, so a later improvement must beat the
killed run's best.

    keeper = BestKeeper(out, judged=True, export=lambda target: ..., engine=engine, resume=False)
    keeper.consider(step, eval_metrics)   # on every rank: the export is a collective under ZeRO-3

Every rank decides alike: the metrics are averaged over ranks, and a resumed run's best score is the main rank's
(the one that wrote best.json; another node may not see that file), shared by one all-reduce.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Optional

from rlhfkit.metric_names import EVAL_GOLD, EVAL_REWARD, standard_error
from rlhfkit.run_files import BEST_DIR, BEST_FILE


class BestKeeper:
    def __init__(self, out: Path, judged: bool, export: Callable[[Path], None], engine, resume: bool):
        self.out, self.export, self.is_main = out, export, engine.is_main
        self.key = EVAL_GOLD if judged else EVAL_REWARD
        self.record: Optional[dict] = None  # {"step", "metric", "value", "se"} of best/
        if not resume:
            return
        saved = out / BEST_FILE
        if self.is_main and saved.is_file() and (out / BEST_DIR).is_dir():
            record = json.loads(saved.read_text(encoding="utf-8"))
            if record.get("metric") == self.key:  # a judge added or dropped at the resume: start afresh
                self.record = record
        value = engine.reduce_max(self.record["value"] if self.record else -math.inf)
        if self.record is None and value > -math.inf:  # another rank: the score to beat, not the file
            self.record = {"step": None, "metric": self.key, "value": value, "se": None}

    def consider(self, step: int, metrics: dict) -> bool:
        """Export best/ when `metrics` (an evaluation after `step`, averaged over ranks: the same on every rank)
        beat the best so far (strictly: the earliest among equals stays). True when it did."""
        value = metrics.get(self.key)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.record is not None and value <= self.record["value"]:
            return False
        self.export(self.out / BEST_DIR)
        self.record = {"step": step, "metric": self.key, "value": value, "se": metrics.get(standard_error(self.key))}
        if self.is_main:
            tmp = self.out / f"{BEST_FILE}.tmp"
            tmp.write_text(json.dumps(self.record) + "\n", encoding="utf-8")
            os.replace(tmp, self.out / BEST_FILE)
        return True

    def summary(self) -> dict:
        """For the run's result: which step best/ is, by which score (and that it is the training reward's where no
        judge was given)."""
        if self.record is None:
            return {}
        by = self.key if self.key == EVAL_GOLD else \
            f"{EVAL_REWARD} (no eval.judge: the training reward on held-out prompts)"
        return {"best_step": self.record["step"], "best_by": by, "best_value": self.record["value"]}

    def line(self, final_step: int, final: dict) -> Optional[str]:
        """The run's last line about best/ and final/: which step each is and their held-out scores."""
        if self.record is None:
            return None
        r = self.record
        score = self.score(r["value"], r.get("se"))
        end = self.score(final[self.key], final.get(standard_error(self.key))) if self.key in final else \
            "not evaluated"
        note = "" if self.key == EVAL_GOLD else \
            " (no eval.judge: best by the training reward, which the policy can game)"
        return f"best/ is step {r['step']} ({score}); final/ is step {final_step} ({end}){note}"

    def score(self, value: float, se: Optional[float]) -> str:
        return f"{self.key} {value:.4g}" + (f" ± {se:.2g}" if se is not None else "")
