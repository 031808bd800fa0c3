"""A reward served over HTTP: `reward: http://host:port/path` in a PPO config (docs/remote.md).

The contract, one JSON document each way (`rlhfkit serve-reward` is one server that keeps it):

    POST  {"prompts": [str], "responses": [str], "messages": [[{"role", "content"}] | null],
           "finished": [bool], "fields": {column: [value, ...]}}        one entry per sample in every list
    200   {"rewards": [number | null, ...]}                            one per sample; null: unjudged

`prompts` are rendered as the actor saw them, `responses` decoded (special tokens skipped), `messages` the prompt's
turns (for a judge with its own template), `finished` whether the response ended with EOS, `fields` the prompt rows'
other dataset columns (e.g. a reference answer), as a reward function gets them.

A rollout batch goes in requests of `remote.batch_size` samples, `remote.concurrency` of them in flight (threads);
each rank asks for its own rows, so scoring needs no collective. A request that fails (connection refused, a
timeout of `remote.timeout` seconds, HTTP 5xx, 408, 429) is retried `remote.retries` times after `remote.backoff`,
2 x, 4 x ... seconds; one that still fails, or whose answer is malformed (said once), leaves its samples unjudged
(NaN: out of the update, as a reward function's None), counted in `reward/remote_failed`. When more than
`remote.max_failed` of an iteration's samples (over every rank) failed so, the run stops naming the URL and the
reason. Any other 4xx is a contract error (a wrong path, a missing token, a request too large) and stops the run at
once: retrying cannot mend it. A request takes at most `request_bound()` seconds, retries included: each try keeps
one deadline of `remote.timeout` seconds on its socket (remote/deadline.py), for every read and write together, so
a server that hangs or drips its answer a byte at a time cannot hang the run, and the try's thread ends with it.

Hostile or broken servers: a redirect (3xx) is not followed but stops the run naming its Location (the token would
go with it to another host); an answer over `MAX_ANSWER_BYTES` is not read past that cap: a malformed answer, its
samples unjudged.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlhfkit.config.ppo_schema import RemoteSection
from rlhfkit.envs.calls import run_calls
from rlhfkit.errors import RunError
from rlhfkit.metric_names import REMOTE_FAILED
from rlhfkit.remote.deadline import DeadlineSocket

MAX_ANSWER_BYTES = 2 ** 20  # an answer is a number per sample: 1 MiB holds far more than any remote.batch_size's
MAX_ERROR_BYTES = 4096  # of an error answer's body, for its message
RETRIED_STATUS = frozenset({408, 429})  # and every 5xx: the next try may get an answer
# what to do about a contract error, by status (401 and 403: the token, `RemoteReward.contract_error`)
CONTRACT_HINTS = {
    404: "check the URL's path (rlhfkit serve-reward serves POST /score unless its --path says otherwise)",
    405: "the URL must take POST (rlhfkit serve-reward: POST /score; GET /health)",
    413: "lower remote.batch_size (samples per request) to what the server takes",
}


@dataclass
class Reply:
    """What came of one request, its retries included."""

    rewards: Optional[list] = None  # one float per sample (NaN: the server left it unjudged); None: it failed
    why: str = ""  # why it failed (the last try's failure, or what was malformed)
    error: Optional[RunError] = None  # a contract error: the run stops


class RemoteReward:
    """The reward part of `reward: http(s)://...`: a callable `reward(batch, finished) -> (B,) float tensor` (NaN:
    unjudged), as `FunctionReward` and `ModelReward` are. `reduce_sum`: the engine's sum over ranks, for the share
    of failed samples that `remote.max_failed` bounds (identity on one rank). Nothing is fetched until a call."""

    stats = None  # no stored mean/std to normalise with

    def __init__(self, url: str, settings: RemoteSection, reduce_sum: Callable[[float], float] = lambda x: x):
        self.url, self.settings, self.reduce_sum = url, settings, reduce_sum
        self.token = os.environ.get(settings.token_env) or None  # from the environment only: never in config.yaml
        self.counts: dict = {}  # of the last call: reward/remote_failed (CombinedReward adds it to the metrics)
        self._said = False  # a malformed answer is said once
        self._lock = threading.Lock()

    def request_bound(self) -> float:
        """The most seconds one request takes: every try up to its timeout, and the back-off between them."""
        s = self.settings
        return (s.retries + 1) * s.timeout + s.backoff * (2 ** s.retries - 1)

    def __call__(self, batch, finished: torch.Tensor | None = None) -> torch.Tensor:
        n, size = batch.size, self.settings.batch_size
        done = [bool(f) for f in finished.tolist()] if finished is not None else [True] * n
        chunks = [range(start, min(start + size, n)) for start in range(0, n, size)]
        bodies = [request_body(batch, done, rows) for rows in chunks]
        bound = self.request_bound()
        # a second of slack: each try ends at its own deadline, on its socket, and says why it failed; this bound
        # is the backstop for what no socket deadline reaches (a host name's DNS lookup)
        calls = [lambda body=body, k=len(rows): self.request(body, k) for body, rows in zip(bodies, chunks)]
        outcomes = run_calls(calls, self.settings.concurrency, bound + 1.0)
        rewards, failed, first = [math.nan] * n, 0, ""
        for rows, outcome in zip(chunks, outcomes):
            reply = outcome.value if outcome.failure is None else \
                Reply(why=f"no answer within {bound:g} s (remote.timeout x tries + back-off)"
                      if outcome.failure == "timeout" else outcome.detail)
            if reply.error is not None:
                raise reply.error
            if reply.rewards is None:
                failed += len(rows)
                first = first or reply.why
                continue
            rewards[rows.start:rows.stop] = reply.rewards
        self.counts = {REMOTE_FAILED: float(failed)}
        self._check_failures(failed, n, first)
        return torch.tensor(rewards, dtype=torch.float32)

    def _check_failures(self, failed: int, n: int, first: str) -> None:
        """RunError when the share of samples the server failed to judge, over every rank, passes remote.max_failed
        (a collective: every rank calls its reward at the same points of the loop)."""
        failed_all, total = self.reduce_sum(float(failed)), self.reduce_sum(float(n))
        if total and failed_all / total > self.settings.max_failed:
            raise RunError(f"reward server {self.url}: {int(failed_all)} of {int(total)} samples could not be judged, "
                           f"more than remote.max_failed={self.settings.max_failed:g} of them; "
                           f"{'first: ' + first if first else 'the failures were on another rank'}")

    # -- one request ---------------------------------------------------------------------------------------
    def request(self, body: bytes, size: int) -> Reply:
        """POST `body` (`size` samples), retrying what may pass on another try."""
        delay, why = self.settings.backoff, ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            try:
                rewards, malformed = parse_rewards(self._post(body), size)
            except AnswerTooLarge as exc:
                rewards, malformed = None, str(exc)
            except urllib.error.HTTPError as exc:
                detail, location = server_message(exc), exc.headers.get("Location") if exc.headers else None
                exc.close()
                if 300 <= exc.code < 400:
                    return Reply(error=self.redirect_error(exc.code, location))
                if exc.code >= 500 or exc.code in RETRIED_STATUS:
                    why = f"HTTP {exc.code}{detail}"
                    continue
                return Reply(error=self.contract_error(exc.code, detail, size))
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out (URLError: an OSError)
                why = self._transport_failure(exc)
                continue
            if rewards is None:
                self._say_once(f"reward server {self.url}: a malformed answer: {malformed}; its samples are left "
                               f"unjudged, counted in reward/remote_failed (said once)")
                return Reply(why=f"a malformed answer: {malformed}")
            return Reply(rewards)
        tries = self.settings.retries + 1
        return Reply(why=f"{why} ({tries} {'try' if tries == 1 else 'tries'})")

    def _post(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        deadline = time.monotonic() + self.settings.timeout  # this try's, for all its reads and writes together
        opener = urllib.request.build_opener(NoRedirects(), DeadlineHTTPHandler(deadline),
                                             DeadlineHTTPSHandler(deadline))  # and the proxies of the environment
        with opener.open(request, timeout=self.settings.timeout) as response:
            return read_capped(response)

    def _transport_failure(self, exc: BaseException) -> str:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            return f"no answer within remote.timeout={self.settings.timeout:g} s"
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused (is the server running?)"
        return f"{type(reason).__name__}: {reason}"

    def contract_error(self, status: int, detail: str, size: int) -> RunError:
        """The RunError of a 4xx that retrying cannot mend, with what to do about it."""
        env = self.settings.token_env
        if status in (401, 403):
            hint = (f"it refused the token in ${env} (remote.token_env): set it to the server's token" if self.token
                    else f"it wants a token: set the environment variable {env} (remote.token_env) to the server's "
                         f"token")
        else:
            hint = CONTRACT_HINTS.get(status, "the request does not fit the server's contract (docs/remote.md)")
        return RunError(f"reward server {self.url} answered HTTP {status}{detail} to a request of {size} samples: "
                        f"{hint}")

    def redirect_error(self, status: int, location: str | None) -> RunError:
        """The RunError of a redirect: not followed, so that the token never goes to a host the config did not
        name."""
        where = repr(" ".join(location.split())[:200]) if location else "nowhere (no Location)"
        return RunError(f"reward server {self.url} answered HTTP {status}, a redirect to {where}: redirects are not "
                        f"followed (the request and its token would go with it): put the URL you mean in `reward:`")

    def _say_once(self, line: str) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        print(line, file=sys.stderr, flush=True)


# -- the transport: no redirects, one deadline per try, a capped answer ---------------------------------------

class AnswerTooLarge(ValueError):
    """An answer over MAX_ANSWER_BYTES, left unread past the cap."""


class NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is not followed: urllib raises it as an HTTPError, which `RemoteReward.redirect_error` names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class DeadlineConnection:
    """An http.client connection whose socket keeps one `deadline` (time.monotonic()) for every send and read."""

    def __init__(self, host, *, deadline: float, **kwargs):
        super().__init__(host, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self.timeout = min(self.timeout, left)  # the TCP connect (and TLS handshake) within the deadline too
        super().connect()
        self.sock = DeadlineSocket(self.sock, self.deadline)


class DeadlineHTTPConnection(DeadlineConnection, http.client.HTTPConnection):
    pass


class DeadlineHTTPSConnection(DeadlineConnection, http.client.HTTPSConnection):
    pass


class DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(DeadlineHTTPConnection, req, deadline=self.deadline)


class DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(DeadlineHTTPSConnection, req, deadline=self.deadline)


def read_capped(response) -> bytes:
    """The answer's body, at most MAX_ANSWER_BYTES: AnswerTooLarge, unread, when its Content-Length says more, or
    after MAX_ANSWER_BYTES + 1 bytes when it says nothing (chunked, or until the server closes)."""
    declared = (response.headers.get("Content-Length") or "").strip()
    if re.fullmatch(r"[0-9]+", declared) and (len(declared) > 18 or int(declared) > MAX_ANSWER_BYTES):
        raise AnswerTooLarge(f"an answer of {declared[:20]} bytes, over the client's cap of {MAX_ANSWER_BYTES} "
                             f"bytes (not read)")
    raw = response.read(MAX_ANSWER_BYTES + 1)
    if len(raw) > MAX_ANSWER_BYTES:
        raise AnswerTooLarge(f"an answer over the client's cap of {MAX_ANSWER_BYTES} bytes (not read further)")
    return raw


def request_body(batch, finished: list[bool], rows: range) -> bytes:
    """The JSON request of samples `rows` of `batch` (a RolloutBatch: prompt_texts, response_texts, messages,
    fields)."""
    part = slice(rows.start, rows.stop)
    fields = batch.fields[part] if batch.fields else [{} for _ in rows]
    columns = sorted({key for row in fields for key in row})
    document = {"prompts": list(batch.prompt_texts[part]), "responses": list(batch.response_texts[part]),
                "finished": finished[part], "fields": {c: [row.get(c) for row in fields] for c in columns}}
    if batch.messages:
        document["messages"] = list(batch.messages[part])
    return json.dumps(document, default=plain_value).encode()


def plain_value(value):
    """A dataset value JSON cannot write as it is: a NumPy array or scalar as a list or number, a date as ISO text,
    anything else as its text."""
    for method in ("tolist", "isoformat"):
        if callable(getattr(value, method, None)):
            return getattr(value, method)()
    return str(value)


def parse_rewards(raw: bytes, n: int) -> tuple[Optional[list], str]:
    """(n floats, NaN for null; "") from an answer `{"rewards": [...]}`, or (None, what is wrong with it)."""
    try:
        document = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError too; RecursionError: 100,000 nested `[`
        return None, f"not JSON ({exc})"
    rewards = document.get("rewards") if isinstance(document, dict) else None
    if not isinstance(rewards, list):
        return None, f'expected {{"rewards": [...]}}, got {raw[:80]!r}'
    if len(rewards) != n:
        return None, f'"rewards" holds {len(rewards)} values for the request\'s {n} samples'
    values = []
    for i, value in enumerate(rewards):
        number = _finite(value)
        if number is None and value is not None:
            return None, f'"rewards"[{i}] is {value!r:.40}, not a finite number or null'
        values.append(math.nan if value is None else number)
    return values, ""


def _finite(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range
        return None
    return number if math.isfinite(number) else None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def server_message(exc: urllib.error.HTTPError) -> str:
    """': the server's own one-line message' of an error answer ({"error": ...}, else its text), or ''."""
    try:
        text = exc.read(MAX_ERROR_BYTES).decode("utf-8", "replace").strip()
    except (OSError, http.client.HTTPException):
        return ""
    try:
        document = json.loads(text)
        text = str(document.get("error", text)) if isinstance(document, dict) else text
    except ValueError:
        pass
    text = " ".join(text.split())
    return f": {text[:300]}" if text else ""
