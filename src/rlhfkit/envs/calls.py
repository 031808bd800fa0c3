"""Environment calls of a batch of episodes, several at once, each under a time limit.

A call that raises or overruns its limit fails alone: its episode is left unjudged and the others go on. Python
cannot stop a thread, so an overrunning call is abandoned: its thread (a daemon: it cannot hold up the process's
exit) runs on and its result is dropped, and a fresh worker takes its place, so `workers` calls keep running.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class Outcome:
    value: Any = None
    failure: Optional[str] = None  # None: returned; "raised" or "timeout"
    detail: str = ""  # for a failure: what happened, where


def raised_detail(exc: BaseException) -> str:
    """'ExcType: message (at file.py:LINE)', the deepest frame of the traceback (the environment's own code)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_calls(calls: list[Callable[[], Any]], workers: int, timeout: float, poll: float = 0.005) -> list[Outcome]:
    """Run every call, at most `workers` at a time, each limited to `timeout` seconds from its own start; the
    outcomes in the calls' order."""
    n = len(calls)
    outcomes: list[Optional[Outcome]] = [None] * n
    started: list[Optional[float]] = [None] * n
    lock = threading.Lock()
    pending = list(range(n - 1, -1, -1))  # popped from the end: calls start in order

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                i = pending.pop()
                started[i] = time.monotonic()
            try:
                result = Outcome(calls[i]())
            except Exception as exc:  # noqa: BLE001 - the environment's code: any error fails its episode alone
                result = Outcome(failure="raised", detail=raised_detail(exc))
            with lock:
                if outcomes[i] is None:  # not already given up on
                    outcomes[i] = result

    def start_worker() -> None:
        threading.Thread(target=worker, daemon=True, name="rlhfkit-env").start()

    for _ in range(min(workers, n)):
        start_worker()
    while True:
        with lock:
            if all(o is not None for o in outcomes):
                return outcomes
            now = time.monotonic()
            overrun = [i for i in range(n) if outcomes[i] is None and started[i] is not None
                       and now - started[i] > timeout]
            for i in overrun:
                outcomes[i] = Outcome(failure="timeout", detail=f"no answer within {timeout:g} s")
        for _ in overrun:  # the stuck worker's place
            start_worker()
        time.sleep(poll)
