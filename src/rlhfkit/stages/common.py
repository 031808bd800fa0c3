"""What every stage shares: the output folder, seeding, and the metrics logger (jsonl + TensorBoard + bar)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from rlhfkit.errors import RunError
from rlhfkit.metric_names import EVAL_PREFIX
from rlhfkit.run_files import METRICS_FILE, REPORT_FILE, TENSORBOARD_DIR
from rlhfkit.stages.advice import duration


def with_trained_template(cfg, name: str, tokenizer):
    """`cfg` whose data.template, when auto, follows how the model folder `name` was trained
    (`models.loading.template_mode`)."""
    from rlhfkit.models.loading import template_mode

    mode = template_mode(cfg.data.template, name, cfg.load, tokenizer)
    return cfg if mode == cfg.data.template else dataclasses.replace(cfg, data=dataclasses.replace(cfg.data,
                                                                                                   template=mode))


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _finite(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


PLAIN_LINES = 10  # progress lines a run writes to a log that is not a terminal: one each tenth of its steps


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class MetricsLogger:
    """One JSON object per logged step in metrics.jsonl, the same numbers in TensorBoard, a live bar.

    Only the main rank writes; other ranks get a silent logger so loops need no rank checks.
    """

    def __init__(self, out: Path, stage: str, total: int, cfg, enabled: bool = True, initial: int = 0):
        self.stage, self.enabled = stage, enabled
        self.file = open(out / METRICS_FILE, "a", encoding="utf-8") if enabled else None
        self.tb = None
        if enabled and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run logs the steps after its checkpoint again: TensorBoard drops the killed run's events
            # from purge_step on, as metrics.jsonl drops its rows
            self.tb = SummaryWriter(str(out / TENSORBOARD_DIR), purge_step=initial + 1 if initial else None)
        self.wandb = None
        if enabled and cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise RunError("log.wandb is true but wandb is not installed: pip install wandb") from None
            self.wandb = wandb.init(project=cfg.wandb_project, name=out.name, dir=str(out))
        show = enabled and cfg.progress and os.environ.get("RLHFKIT_NO_BAR") != "1"
        # a terminal gets the live bar; a file or pipe (a redirected log, a scheduler's) gets plain progress lines
        # instead, since every redraw of a bar lands in the file as another copy of it
        self.plain = show and not _is_terminal(sys.stderr)
        self.bar = tqdm(total=total, initial=initial, desc=stage, disable=not show or self.plain, dynamic_ncols=True,
                        file=sys.stderr)
        self.done, self.total, self.said = initial, total, initial
        self.started, self.said_from = time.monotonic(), initial  # the pace counts the steps this process ran
        self.postfix: dict[str, str] = {}
        self.seen: dict[str, tuple[float, float]] = {}  # metric -> (first, last) value this process logged

    def log(self, step: int, metrics: dict, show: tuple[str, ...] = ()) -> None:
        if not self.enabled:
            return
        clean = {k: _finite(v) for k, v in metrics.items()}
        for key, value in clean.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.seen[key] = (self.seen.get(key, (value,))[0], value)
        self.file.write(json.dumps({"step": step, "stage": self.stage, **clean}) + "\n")
        self.file.flush()
        for key, value in clean.items():
            if isinstance(value, (int, float)) and self.tb is not None:
                self.tb.add_scalar(f"{self.stage}/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"{self.stage}/{k}": v for k, v in clean.items()}, step=step)
        shown = {k: clean[k] for k in show if isinstance(clean.get(k), (int, float))}
        if shown:
            # "eval/loss" -> "eval_loss", so it does not overwrite the training "loss" on the bar
            self.postfix.update({k.replace(EVAL_PREFIX, "eval_").split("/")[-1]: f"{v:.4g}" for k, v in shown.items()})
            self.bar.set_postfix(self.postfix, refresh=False)

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)
        self.done += n
        if self.plain and (self.done - self.said >= max(1, self.total // PLAIN_LINES) or self.done >= self.total):
            self.said = self.done
            self.write(self.progress_line())

    def progress_line(self) -> str:
        """`ppo 30/100 (30%), 2.1 s/step, about 2.5 min left; mean=0.61, kl=0.002`: the bar, once, as text."""
        per = (time.monotonic() - self.started) / max(self.done - self.said_from, 1)
        left = f", about {duration(per * (self.total - self.done))} left" if self.done < self.total else ""
        values = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        return (f"{self.stage} {self.done}/{self.total} ({self.done / max(self.total, 1):.0%}), {per:.3g} s/step"
                f"{left}{'; ' + values if values else ''}")

    def write(self, text: str) -> None:
        """A line above the bar (tqdm.write keeps the bar intact), or a plain line where there is no bar."""
        if not self.enabled:
            return
        if self.plain:
            print(text, file=sys.stderr, flush=True)
        else:
            self.bar.write(text, file=sys.stderr)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent: closed on leaving its `with` block, also when a signal or an error stopped the run."""
        self.bar.close()
        if self.file:
            self.file.close()
            self.file = None
        if self.tb:
            self.tb.close()
            self.tb = None
        if self.wandb:
            self.wandb.finish()
            self.wandb = None
        self.enabled = False


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """A reproducible permutation per epoch: resuming at (epoch, position) replays the same data order."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(n, generator=g).tolist()


def write_run_report(out: Path, log_cfg, is_main: bool) -> None:
    """report.html and its plots, once the run's outputs are complete (`log.report`; RLHFKIT_NO_REPORT=1 skips it,
    for scripted sweeps). It is a view of files already written: a failure to draw is a note, not a failed run."""
    if not (is_main and log_cfg.report) or os.environ.get("RLHFKIT_NO_REPORT") == "1":
        return
    try:
        from rlhfkit.report import write_report

        write_report(out)
    except Exception as exc:  # noqa: BLE001 - any plotting failure; the run itself succeeded
        print(f"note: {REPORT_FILE} not written ({type(exc).__name__}: {exc}); `rlhfkit report {out}` retries",
              file=sys.stderr)


def plan_steps(n_rows: int, train, world_size: int) -> tuple[int, int, int]:
    """(examples per rank per step, micro-batches per step, total steps), checked before anything is written."""
    if train.batch_size % world_size:
        raise RunError(f"train.batch_size {train.batch_size} is not divisible by the {world_size} ranks")
    per_rank = train.batch_size // world_size
    if per_rank % train.micro_batch_size:
        raise RunError(f"train.batch_size / ranks = {per_rank} is not a multiple of train.micro_batch_size "
                       f"{train.micro_batch_size}")
    steps_per_epoch = n_rows // train.batch_size
    if steps_per_epoch == 0:
        raise RunError(f"only {n_rows} training rows, fewer than one batch of {train.batch_size}: lower "
                       f"train.batch_size or add data")
    total = train.max_steps if train.max_steps > 0 else train.epochs * steps_per_epoch
    return per_rank, per_rank // train.micro_batch_size, total


def longest_first(idx: list[int], rows: list, length: Callable[[dict], int]) -> list[int]:
    """`idx` ordered by the length of its rows, longest first (ties keep their order): cut into consecutive
    micro-batches, each then holds rows of similar length, so less of it is padding."""
    return sorted(idx, key=lambda i: -length(rows[i]))


def batches(n_rows: int, batch_size: int, seed: int, start_step: int = 0):
    """Yield (step, epoch, row indices) forever, epoch after epoch; drops the last partial batch."""
    per_epoch = n_rows // batch_size
    if per_epoch == 0:
        raise RunError(f"only {n_rows} training rows, fewer than one batch of {batch_size}: lower train.batch_size")
    step = start_step
    while True:
        epoch, pos = divmod(step, per_epoch)
        order = epoch_order(n_rows, seed, epoch)
        yield step, epoch, order[pos * batch_size:(pos + 1) * batch_size]
        step += 1
