"""The loop every stage shares: this rank's rows of each step, and the tail of a step (skipped-step count,
run-time alarms, evaluation, logging, checkpoint, clean stop on a signal).

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

from rlhfkit.config.monitor_schema import MonitorSection
from rlhfkit.config.schema import TrainConfig
from rlhfkit.metric_names import alarm_metric
from rlhfkit.monitors import Alarm, Monitor
from rlhfkit.run_files import BEST_DIR, METRICS_FILE, read_jsonl
from rlhfkit.stages.advice import learned_line
from rlhfkit.stages.best import BestKeeper
from rlhfkit.stages.common import MetricsLogger, batches, longest_first
from rlhfkit.stages.guard import RunGuard


class TrainLoop:
    """`trainables` and `state()` are what a checkpoint holds (with the guard's count of skipped steps);
    `resumed` is the state a resumed run loaded; `evaluate()` (None: no eval data) returns the eval metrics, run
    every `train.eval_every` steps and after the last; `show` are the metrics on the bar; `monitor` (None: not
    watched) the alarms on the logged metrics (docs/monitors.md); `best` (None: none kept) exports best/ when an
    evaluation improves on the best so far (stages/best.py)."""

    def __init__(self, engine, out: Path, stage: str, total: int, train: TrainConfig, log: MetricsLogger,
                 trainables: dict, state: Callable[[], dict] = dict, evaluate: Optional[Callable[[], dict]] = None,
                 show: tuple[str, ...] = (), resumed: Optional[dict] = None,
                 monitor: Optional[MonitorSection] = None, best: Optional[BestKeeper] = None):
        self.engine, self.total, self.train, self.log = engine, total, train, log
        self.trainables, self.evaluate, self.show, self.best = trainables, evaluate, show, best
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
        # the main rank watches the logged rows and decides; with action=stop every rank learns of it by a reduce
        watched = monitor is not None and monitor.enabled
        self.monitor = Monitor(monitor.limits()) if watched and engine.is_main else None
        self.stop_on_alarm = watched and monitor.action in ("stop", "stop_best")
        self.stop_best = watched and monitor.action == "stop_best"
        if self.monitor is not None and resumed:  # the rows the checkpointed run logged: their alarms are up again
            self.monitor.replay(logged_rows(out / METRICS_FILE, stage))
        self.stopped: Optional[tuple[int, str]] = None  # (step, alarm line) where an alarm ended the run

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
            if step >= self.total or self.stopped:
                return
            if length is not None:
                idx = longest_first(idx, rows, length)
            yield step, epoch, self.engine.shard([rows[i] for i in idx])

    def due(self, every: int, done: int) -> bool:
        return every > 0 and done % every == 0

    def start(self, metrics: dict) -> None:
        """The starting policy's evaluation (logged as step 0 by the stage): the monitor's first held-out point and
        best/'s first candidate."""
        if self.monitor is not None:
            self.monitor.observe({"step": 0, **metrics})
        if self.best is not None:
            self.best.consider(0, metrics)

    def end_step(self, done: int, metrics: dict, skipped: bool = False) -> None:
        """After optimizer step `done` (1-based): count a skipped step, evaluate (best/), watch, log, checkpoint,
        and stop cleanly when a signal or an alarm asked for it (RunStopped after saving)."""
        self.guard.check_step(done, {"skipped": skipped or bool(metrics.get("skipped"))}, self.log)
        logged = done % self.train.log_every == 0 or done == self.total
        evaluated = self.evaluate is not None and (self.due(self.train.eval_every, done) or done == self.total)
        if evaluated:
            self.evaluated(done, metrics)
        stop = (logged or evaluated) and self.watch(done, metrics)  # the last step is watched, never stopped
        last = done == self.total or stop
        if last and not evaluated and self.evaluate is not None:  # an alarm ended the run: its last policy too
            self.evaluated(done, metrics)
        if logged or last or evaluated:
            self.log.log(done, metrics, show=self.show)
        self.log.advance()
        if last and (line := learned_line(self.guard.stage, done, self.log.seen, self.show)):
            self.log.write(line)  # what the run changed, or why it may not have
        if self.stopped:
            kept = f"; best/ (step {self.best.record['step']}) is the run's model" if self.stop_best and \
                self.best is not None and self.best.record else ""
            self.log.write(f"{self.guard.stage}: stopped after step {done} of {self.total} on an alarm "
                           f"(monitor.action={'stop_best' if self.stop_best else 'stop'}); final/ is this step's "
                           f"model{kept}")
        if last and self.best is not None and (line := self.best.line(done, self.last_eval)):
            self.log.write(line)
        keep = self.train.keep_checkpoints
        saved = self.due(self.train.save_every, done) and not last
        if saved:
            self.guard.save(done, self.trainables, self.state(), keep)
        if self.guard.stop_requested() and not last:  # a step just saved is not written a second time
            self.guard.stop(done, self.trainables, self.state(), keep, saved=saved)

    def evaluated(self, done: int, metrics: dict) -> None:
        """Evaluate after step `done` into `metrics`; best/ when it improved."""
        self.last_eval = self.evaluate()
        metrics.update(self.last_eval)
        if self.best is not None:
            self.best.consider(done, self.last_eval)

    def watch(self, done: int, metrics: dict) -> bool:
        """Feed the monitor a logged step's metrics: each new alarm prints its line and sets alarm/<rule> = 1 in
        `metrics`. True, on every rank, when an alarm ends the run (monitor.action=stop)."""
        raised: list[Alarm] = self.monitor.observe({"step": done, **metrics}) if self.monitor else []
        for alarm in raised:
            metrics[alarm_metric(alarm.rule)] = 1
            self.log.write(alarm.line())
        if not self.stop_on_alarm or done == self.total or self.engine.reduce_sum(1.0 if raised else 0.0) == 0:
            return False
        self.stopped = (done, raised[0].line() if raised else "an alarm on the main rank")
        return True

    def outcome(self) -> dict:
        """For the run's summary: where and why an alarm stopped it (nothing when it ran to its last step), and
        which step best/ is."""
        out = self.best.summary() if self.best is not None else {}
        if self.stopped:
            out.update({"stopped_at_step": self.stopped[0], "stopped_by": self.stopped[1]})
            if self.stop_best and out.get("best_step") is not None:
                out["model"] = str(self.best.out / BEST_DIR)
        return out


def logged_rows(path: Path, stage: str) -> list[dict]:
    """The rows of `stage` in a metrics.jsonl (none when it is missing; a line cut by a kill is skipped)."""
    rows = read_jsonl(path, skip_bad_lines=True) if path.is_file() else []
    return [row for row in rows if isinstance(row, dict) and row.get("stage") == stage]


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
