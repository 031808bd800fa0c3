"""The loop every stage shares: this rank's rows of each step, and the tail of a step (skipped-step count,
evaluation, logging, checkpoint, clean stop on a signal).

    with TrainLoop(engine, out, "sft", total, cfg.train, log, {"model": model}, evaluate=...) as loop:
        for step, epoch, rows in loop.steps(data.train, start):
            metrics = ...one optimizer step on rows...
            loop.end_step(step + 1, metrics)
"""

from __future__ import annotations

import array
import hashlib
from pathlib import Path
from typing import Callable, Optional

from rlhfkit.config.schema import TrainConfig
from rlhfkit.stages.advice import learned_line
from rlhfkit.stages.common import MetricsLogger, batches, longest_first
from rlhfkit.stages.guard import RunGuard


class TrainLoop:
    """`trainables` and `state()` are what a checkpoint holds (with the guard's count of skipped steps);
    `resumed` is the state a resumed run loaded; `evaluate()` (None: no eval data) returns the eval metrics, run
    every `train.eval_every` steps and after the last; `show` are the metrics on the bar."""

    def __init__(self, engine, out: Path, stage: str, total: int, train: TrainConfig, log: MetricsLogger,
                 trainables: dict, state: Callable[[], dict] = dict, evaluate: Optional[Callable[[], dict]] = None,
                 show: tuple[str, ...] = (), resumed: Optional[dict] = None):
        self.engine, self.total, self.train, self.log = engine, total, train, log
        self.trainables, self.evaluate, self.show = trainables, evaluate, show
        self.guard = RunGuard(engine, out, stage)
        saved = (resumed or {}).get("guard") or {}
        self.guard.load_state_dict(saved)
        # the training rows' count and a digest of them, kept with the checkpoint: a resumed run on other data
        # says so (the data order is a permutation of the rows, so from there on it is not the killed run's)
        self.rows = self.digest = None
        self.resumed_rows, self.resumed_digest = saved.get("rows"), saved.get("rows_digest")
        self.state = lambda: {**state(), "guard": {**self.guard.state_dict(), "rows": self.rows,
                                                   "rows_digest": self.digest}}
        self.last_eval: dict = {}

    def __enter__(self) -> "TrainLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.guard.close()

    def steps(self, rows: list, start: int = 0, length: Optional[Callable[[dict], int]] = None):
        """(step, epoch, this rank's share of the step's rows) from `start` to the last step: every rank draws
        the same global batch (a seeded permutation per epoch) and keeps its own slice. With `length` (a row's
        length) the global batch is ordered longest first before it is split (`common.longest_first`), so every
        rank's micro-batches hold rows of similar length, the same ones on any number of ranks."""
        if self.rows is None:
            self.rows, self.digest = len(rows), rows_digest(rows)
            if self.resumed_rows is not None and self.resumed_rows != self.rows:
                self.engine.say(f"resume: the training data has {self.rows} rows, the checkpointed run's had "
                                f"{self.resumed_rows}: from here on the rows come in another order than that run's")
            elif self.resumed_digest is not None and self.resumed_digest != self.digest:
                self.engine.say(f"resume: the training data's {self.rows} rows are not the checkpointed run's (as "
                                f"many, other contents): from here on the steps see other rows than that run's")
        for step, epoch, idx in batches(len(rows), self.train.batch_size, self.train.seed, start):
            if step >= self.total:
                return
            if length is not None:
                idx = longest_first(idx, rows, length)
            yield step, epoch, self.engine.shard([rows[i] for i in idx])

    def due(self, every: int, done: int) -> bool:
        return every > 0 and done % every == 0

    def end_step(self, done: int, metrics: dict, skipped: bool = False) -> None:
        """After optimizer step `done` (1-based): count a skipped step, evaluate, log, checkpoint, and stop
        cleanly when a signal asked for it (RunStopped after saving)."""
        self.guard.check_step(done, {"skipped": skipped or bool(metrics.get("skipped"))}, self.log)
        last = done == self.total
        if self.evaluate is not None and (self.due(self.train.eval_every, done) or last):
            self.last_eval = self.evaluate()
            metrics.update(self.last_eval)
        if done % self.train.log_every == 0 or last or self.last_eval.keys() & metrics.keys():
            self.log.log(done, metrics, show=self.show)
        self.log.advance()
        if last and (line := learned_line(self.guard.stage, done, self.log.seen, self.show)):
            self.log.write(line)  # what the run changed, or why it may not have
        keep = self.train.keep_checkpoints
        saved = self.due(self.train.save_every, done) and not last
        if saved:
            self.guard.save(done, self.trainables, self.state(), keep)
        if self.guard.stop_requested() and not last:  # a step just saved is not written a second time
            self.guard.stop(done, self.trainables, self.state(), keep, saved=saved)


def rows_digest(rows: list) -> str:
    """A digest of the training rows as the loop receives them (tokenised; their order too), for a resumed run
    to compare with its checkpoint's. Token-id lists are hashed as machine integers (a second per ~50M tokens)."""
    digest = hashlib.blake2b(digest_size=16)
    for row in rows:
        for key, value in sorted(row.items()) if isinstance(row, dict) else [("", row)]:
            digest.update(key.encode())
            try:
                digest.update(array.array("q", value).tobytes() if isinstance(value, list) else repr(value).encode())
            except (TypeError, OverflowError):  # a list of something else than ints
                digest.update(repr(value).encode())
    return digest.hexdigest()
