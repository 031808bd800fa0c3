"""Keeping long runs safe: clean stops on SIGTERM/SIGINT, skipped non-finite steps, checkpoint write errors.

Long RLHF runs die (preemption, OOM, full disks), and users of the established frameworks report losing days
of compute to it. Every loop wraps its steps in a `RunGuard` (through `stages/loop.py`):
- SIGTERM / SIGINT only set a flag; the loop finishes the current step, saves a checkpoint and raises
  `RunStopped`, whose message says how to resume. All ranks agree on the stop (one all-reduce per step).
- A step whose loss or gradient is not finite is skipped by the engine (no optimizer update) and counted;
  `max_bad_steps` consecutive ones stop the run with a clear error, the last good checkpoint untouched.
- A checkpoint that cannot be written (disk full, read-only) is a clear error; the previous checkpoint
  stays loadable because checkpoints are written to a temporary folder and renamed only when complete.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

from rlhfkit.errors import RunError, RunStopped
from rlhfkit.run_files import checkpoints_dir, drop_rows_after, latest_pointer

MAX_BAD_STEPS = 5
REPEAT_SECONDS = 2.0  # a second signal sooner than this after the first is the same stop request


def resume_command(stage: str) -> str:
    """The command that continues the stopped run: this command with --resume (a pipeline's too: it skips the
    complete steps and resumes this one); the demo's as it was, since it continues a stopped step itself."""
    args = [a for a in sys.argv[1:] if a not in ("--resume", "--force")]
    if args and args[0] == "demo":
        return f"rlhfkit {' '.join(args)} (the demo continues the stopped step)"
    if args and args[0] in (stage, "pipeline"):
        return f"rlhfkit {' '.join(args)} --resume"
    return f"rlhfkit {stage} ... --resume (the same command with --resume)"


class RunGuard:
    def __init__(self, engine, out: Path, stage: str, max_bad_steps: int = MAX_BAD_STEPS):
        self.engine, self.out, self.stage, self.max_bad = engine, out, stage, max_bad_steps
        self.signum, self.signalled_at = 0, 0.0
        self.bad_in_a_row = 0
        self.skipped = 0
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        now = time.monotonic()
        if self.signum:
            # a second Ctrl-C means "out now"; but launchers pass one Ctrl-C on as SIGINT and SIGTERM together
            # (DeepSpeed's does), so a second signal within REPEAT_SECONDS is the same request
            if now - self.signalled_at > REPEAT_SECONDS:
                raise KeyboardInterrupt
            return
        self.signum, self.signalled_at = signum, now

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def stop_requested(self) -> bool:
        """True on every rank when any rank got a signal (ranks must save and stop together)."""
        return self.engine.reduce_sum(1.0 if self.signum else 0.0) > 0

    def state_dict(self) -> dict:
        """The counts a checkpoint keeps (a resumed run goes on counting the non-finite steps in a row) and the
        stage that wrote it (`resume_state` refuses another stage's)."""
        return {"bad_in_a_row": self.bad_in_a_row, "skipped": self.skipped, "stage": self.stage}

    def load_state_dict(self, state: dict) -> None:
        self.bad_in_a_row, self.skipped = int(state.get("bad_in_a_row", 0)), int(state.get("skipped", 0))

    def check_step(self, step: int, stats: dict, log) -> None:
        """Count skipped (non-finite) steps; raise after `max_bad` in a row."""
        if not stats.get("skipped"):
            self.bad_in_a_row = 0
            return
        self.bad_in_a_row += 1
        self.skipped += 1
        log.write(f"{self.stage}: step {step}: non-finite loss or gradient, update skipped "
                  f"({self.bad_in_a_row} in a row, {self.skipped} in all)")
        if self.bad_in_a_row >= self.max_bad:
            latest = latest_pointer(self.out)
            where = f"the last good checkpoint is {latest.read_text().strip()}" if latest.is_file() else \
                "no checkpoint was written yet"
            raise RunError(f"{self.stage}: {self.bad_in_a_row} consecutive steps with a non-finite loss or gradient "
                           f"(last at step {step}); stopping: {where}. Lower train.lr or check the data")

    def save(self, step: int, trainables: dict, state: dict, keep: int) -> None:
        """engine.save_checkpoint with write errors turned into one clear error."""
        try:
            self.engine.save_checkpoint(checkpoints_dir(self.out), step, trainables, state, keep)
        except OSError as exc:
            latest = latest_pointer(self.out)
            kept = f"the previous checkpoint ({latest.read_text().strip()}) is intact" if latest.is_file() else \
                "no earlier checkpoint exists"
            raise RunError(f"{self.stage}: cannot write the checkpoint of step {step} in "
                           f"'{checkpoints_dir(self.out)}': {exc.strerror or exc}; {kept}") from None

    def stop(self, step: int, trainables: dict, state: dict, keep: int, saved: bool = False) -> None:
        """Save (unless step `step` was `saved` already) and raise RunStopped (called when stop_requested())."""
        if not saved:
            self.save(step, trainables, state, keep)
        name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
        raise RunStopped(f"{self.stage}: stopped by {name} after step {step}; checkpoint saved in "
                         f"'{checkpoints_dir(self.out)}'. Resume with: {resume_command(self.stage)}",
                         self.signum or signal.SIGTERM)


def resume_state(engine, out: Path, trainables: dict, total: int, stage: str) -> dict:
    """Load checkpoints/latest into `trainables` (and RNG states); drop metric and sample rows logged after it.
    A checkpoint past this run's `total` steps is an error (the run would end at the checkpoint's weights,
    rolled back from what it had made, with nothing said), and so is one another `stage` wrote (a DPO run resumed
    in an SFT run's folder would train on from its weights and optimizer state, its metrics appended to the
    SFT run's)."""
    state = engine.load_checkpoint(checkpoints_dir(out), trainables)
    saved = (state.get("guard") or {}).get("stage")
    if saved is not None and saved != stage:
        raise RunError(f"--resume: the checkpoints in '{checkpoints_dir(out)}' were written by `rlhfkit {saved}`, not "
                       f"`rlhfkit {stage}`; resume that run with `rlhfkit {saved}`, or pass --force to start a new "
                       f"{stage} run there")
    if state["step"] > total:
        raise RunError(f"--resume: the checkpoint in '{checkpoints_dir(out)}' is at step {state['step']}, past this "
                       f"run's {total} steps (train.max_steps / train.epochs); resume with at least "
                       f"{state['step']} steps, or pass --force to start a new run")
    if engine.is_main:
        drop_rows_after(out, state["step"])
    return state

