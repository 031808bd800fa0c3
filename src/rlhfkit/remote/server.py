"""The server of `rlhfkit serve-reward TARGET` (commands/serve_reward.py): a reward-model folder or a Python reward
function served over HTTP, for `reward: http://host:port/score` in a PPO config run elsewhere (remote/client.py has
the contract; docs/remote.md).

- POST PATH (default /score) takes `{"prompts", "responses"[, "messages", "finished", "fields"]}` and answers
  `{"rewards": [number | null, ...]}`; GET /health says what is served. Standard library only
  (`http.server.ThreadingHTTPServer`): a thread per connection reads and checks its request.
- One scorer thread scores: it takes every queued request that fits in `--max-batch` samples (and has the same
  field columns) and scores them together, answering each its own slice, so concurrent requests share a forward
  (dynamic batching). A request whose scoring raises gets 500 with the error's one line; the server keeps serving.
- A function is called through `FunctionReward`, with the request's fields as its columns: the same checks and
  errors as in a PPO run. A reward-model folder is scored by `ModelReward` on the prompt's turns and the response
  re-rendered with the RM's own template, as for an actor with another tokenizer.
- Safe by default: it binds 127.0.0.1; another address needs a token (the environment variable `--token-env`
  names; at least 16 printable characters), and with a token every request must carry `Authorization: Bearer
  TOKEN` (else 401). Oversized requests get 413, malformed ones 400 naming the field, a wrong path 404, a wrong
  method 405.
- Bounded for a hostile peer (docs/remote.md, "Security and limits"): at most `--max-connections` connections are
  served at once (the rest wait in a listen backlog of 1024); each request, head and body, must arrive within
  `--request-timeout` seconds in all (remote/deadline.py), before the token is checked too; a body is measured
  before it is parsed (its count of JSON values and its nesting depth), so that no request costs more than a few
  times its bytes.

Only the standard library is imported at module level, so that `rlhfkit serve-reward --help` stays fast.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import math
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional
from urllib.parse import urlsplit

from rlhfkit.errors import USER_ERRORS, RunError
from rlhfkit.remote.deadline import DeadlineReader, ReadLimitExceeded
from rlhfkit.remote.request import DEFAULT_MAX_JSON_VALUES, ContractError, Samples, content_length, read_request

DEFAULT_PATH = "/score"
HEALTH_PATH = "/health"
DEFAULT_MAX_BYTES = 8 * 2 ** 20
DEFAULT_REQUEST_TIMEOUT = 10.0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_TOKEN_ENV = "RLHFKIT_REWARD_TOKEN"
LISTEN_BACKLOG = 1024  # connections the kernel holds while every thread is busy (capped by net.core.somaxconn)
MAX_HEAD_BYTES = 64 * 2 ** 10  # the request line and headers together
MIN_TOKEN_CHARS = 16
def check_token(token: str | None, token_env: str) -> str | None:
    """`token` (None when unset or empty), refused with RunError when it is too weak to guard a port: fewer than
    MIN_TOKEN_CHARS characters, or any whitespace or character outside printable ASCII (a header carries it)."""
    if not token:
        return None
    make = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'
    if not token.strip():
        problem = "is only whitespace"
    elif not all(33 <= ord(c) <= 126 for c in token):
        problem = "holds whitespace or characters other than printable ASCII"
    elif len(token) < MIN_TOKEN_CHARS:
        problem = f"is {len(token)} characters, fewer than {MIN_TOKEN_CHARS}"
    else:
        return token
    raise RunError(f"the token in ${token_env} {problem}: set it to a secret of at least {MIN_TOKEN_CHARS} "
                   f"printable characters ({make}), or unset it to serve this machine only")


# ------------------------------------------------------------------------------------------------ the scorer

@dataclass
class Job:
    """One request waiting for the scorer."""

    samples: Samples
    done: threading.Event = field(default_factory=threading.Event)
    rewards: Optional[list] = None  # one number or None per sample
    status: int = 200
    error: str = ""

    def finish(self, rewards: list | None = None, status: int = 200, error: str = "") -> None:
        self.rewards, self.status, self.error = rewards, status, error
        self.done.set()


def one_line(exc: BaseException) -> str:
    """The error as one line: rlhfkit's own messages as they are (they say what and where), others with their type."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, USER_ERRORS) and text else f"{type(exc).__name__}: {text}"


class Scorer:
    """One thread scoring the queued requests: each turn takes the oldest request and every later one with the same
    columns that fits in `max_batch` samples, scores them in one call of `reward` and gives each its own slice.
    Requests that arrive while a batch is scored wait and go together in the next one (dynamic batching)."""

    def __init__(self, reward: Callable, max_batch: int):
        self.reward, self.max_batch = reward, max_batch
        self.queue: deque[Job] = deque()
        self.ready = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="rlhfkit-scorer")
        self.thread.start()

    def submit(self, samples: Samples) -> Job:
        """Queue `samples` and wait for their rewards (or error)."""
        job = Job(samples)
        with self.ready:
            if self.stopped:
                job.finish(status=503, error="the server is stopping")
                return job
            self.queue.append(job)
            self.ready.notify()
        job.done.wait()
        return job

    def stop(self) -> None:
        with self.ready:
            self.stopped = True
            waiting, self.queue = list(self.queue), deque()
            self.ready.notify_all()
        for job in waiting:
            job.finish(status=503, error="the server is stopping")

    def _take(self) -> list[Job] | None:
        with self.ready:
            while not self.queue and not self.stopped:
                self.ready.wait()
            if self.stopped:
                return None
            jobs = [self.queue.popleft()]
            size, columns = jobs[0].samples.size, jobs[0].samples.columns
            for job in list(self.queue):
                if job.samples.columns == columns and size + job.samples.size <= self.max_batch:
                    self.queue.remove(job)
                    jobs.append(job)
                    size += job.samples.size
            return jobs

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            self._score(jobs)

    def _score(self, jobs: list[Job]) -> None:
        import torch

        pooled = Samples(*(sum((getattr(j.samples, name) for j in jobs), []) for name in
                           ("prompt_texts", "response_texts", "messages", "fields", "finished")))
        try:
            scores = self.reward(pooled, torch.tensor(pooled.finished, dtype=torch.bool)).float().tolist()
        except Exception as exc:  # noqa: BLE001 - the reward's own error: 500 with its line, and serve on
            if len(jobs) > 1:  # whose request raised: each alone, so that the others still get their rewards
                for job in jobs:
                    self._score([job])
                return
            print(f"rlhfkit serve-reward: scoring failed: {one_line(exc)}", file=sys.stderr, flush=True)
            jobs[0].finish(status=500, error=one_line(exc))
            return
        start = 0
        for job in jobs:
            part = scores[start:start + job.samples.size]
            job.finish([None if math.isnan(v) else v for v in part])
            start += job.samples.size


# ------------------------------------------------------------------------------------------------ HTTP

class RewardServer(ThreadingHTTPServer):
    """The HTTP server: `reward` behind POST `path` and GET /health, a thread per connection, at most
    `max_connections` of them; the others wait in the listen backlog until a thread is free."""

    daemon_threads = True  # a connection's thread never holds up the exit
    block_on_close = False  # nor the close: each ends within request_timeout, or when its scoring ends
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, host: str, port: int, reward: Callable, about: dict, *, path: str = DEFAULT_PATH,
                 max_batch: int = 256, max_request_bytes: int = DEFAULT_MAX_BYTES,
                 max_json_values: int = DEFAULT_MAX_JSON_VALUES, request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, token: str | None = None,
                 token_env: str = DEFAULT_TOKEN_ENV):
        self.token, self.token_env = check_token(token, token_env), token_env  # before the port is taken
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.slots = threading.BoundedSemaphore(max_connections)
        self.stopping = threading.Event()
        super().__init__((host, port), RewardHandler)
        self.reward, self.about, self.route = reward, about, path
        self.max_batch, self.max_request_bytes, self.max_json_values = max_batch, max_request_bytes, max_json_values
        self.request_timeout, self.max_connections = request_timeout, max_connections
        self.scorer = Scorer(reward, max_batch)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{self.route}"

    def health(self) -> dict:
        return {"status": "ok", **self.about, "path": self.route, "max_batch": self.max_batch,
                "max_request_bytes": self.max_request_bytes, "max_json_values": self.max_json_values,
                "request_timeout": self.request_timeout, "max_connections": self.max_connections,
                "token": self.token is not None}

    def process_request(self, request, client_address) -> None:
        # a free thread slot first: while none is, this connection and the ones behind it wait (in the backlog)
        while not self.slots.acquire(timeout=0.2):
            if self.stopping.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        # one line, not socketserver's traceback (the handler answers what it can; this is what it could not)
        print(f"rlhfkit serve-reward: a connection from {client_address[0]} failed: {one_line(sys.exc_info()[1])}",
              file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        self.stopping.set()
        super().shutdown()

    def server_close(self) -> None:
        super().server_close()
        self.scorer.stop()


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "rlhfkit-serve-reward"

    def setup(self) -> None:
        super().setup()
        # the socket read under a deadline per request (remote/deadline.py): `timeout` alone bounds each recv, and
        # a peer sending a byte a second would hold this thread for ever
        self.reader = DeadlineReader(self.rfile.detach(), self.connection)
        self.rfile = io.BufferedReader(self.reader)
        self.body_pending = False

    def handle_one_request(self) -> None:
        # this request, head and body, idle time before it included, arrives within --request-timeout seconds,
        # and its head within MAX_HEAD_BYTES (the buffer may read ahead, hence the limit is on the raw bytes)
        self.reader.deadline = time.monotonic() + self.server.request_timeout
        self.reader.limit = self.reader.received + MAX_HEAD_BYTES
        self.reader.expired, start = False, self.reader.received
        self.body_pending = False
        self.requestline, self.request_version, self.command = "", "", ""  # until the request line is parsed
        super().handle_one_request()  # a read past the deadline ends the request here, closing the connection
        if self.reader.expired and self.reader.received > start:
            # part of a request came, too slowly (a head a byte at a time, a body that stopped): dropped, before
            # its token is looked at when its head was not complete; an idle connection is closed without a word
            self._refuse(408, f"the request did not arrive within --request-timeout {self.server.request_timeout:g} "
                              f"s")

    def handle(self) -> None:
        try:
            super().handle()
        except ReadLimitExceeded:
            self._refuse(431, f"the request's head is over {MAX_HEAD_BYTES} bytes")
        except ConnectionError:  # the peer went away
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own refusals (a malformed request line, too many headers, an unknown method): one JSON line
        text = " ".join(str(message or self.responses.get(code, ("error",))[0]).split())
        if self.request_version == "HTTP/0.9":  # a line that is no request at all: answered with its status line
            self.request_version = "HTTP/1.0"
        self._refuse(code, text)

    def do_GET(self):  # noqa: N802 - http.server's names
        self._route("GET")

    def do_POST(self):  # noqa: N802
        self._route("POST")

    def do_PUT(self):  # noqa: N802
        self._route("PUT")

    def do_DELETE(self):  # noqa: N802
        self._route("DELETE")

    def do_PATCH(self):  # noqa: N802
        self._route("PATCH")

    def log_message(self, format, *args):  # noqa: A002 - quiet: errors are answered, scoring failures printed
        pass

    def _route(self, method: str) -> None:
        self.body_pending = "Content-Length" in self.headers or "Transfer-Encoding" in self.headers
        try:
            self._dispatch(method, urlsplit(self.path).path)
        except TimeoutError:
            raise  # the request came too slowly: 408 (handle_one_request)
        except OSError:  # the peer went away mid-request
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - never a traceback and no answer: 500 with the error's line
            print(f"rlhfkit serve-reward: a request failed: {one_line(exc)}", file=sys.stderr, flush=True)
            self._answer(500, {"error": f"the server failed: {one_line(exc)}"})

    def _dispatch(self, method: str, path: str) -> None:
        if not self._authorised():
            return self._answer(401, {"error": f"missing or wrong token: send Authorization: Bearer <the token in "
                                               f"${self.server.token_env} on the server>"},
                                {"WWW-Authenticate": "Bearer"})
        wanted = {self.server.route: "POST", HEALTH_PATH: "GET"}.get(path)
        if wanted is None:
            return self._answer(404, {"error": f"no path {path!r}: POST {self.server.route}, GET {HEALTH_PATH}"})
        if method != wanted:
            return self._answer(405, {"error": f"{path} takes {wanted}, not {method}"}, {"Allow": wanted})
        return self._score() if method == "POST" else self._answer(200, self.server.health())

    def _authorised(self) -> bool:
        if self.server.token is None:
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.server.token}".encode())

    def _score(self) -> None:
        try:
            length = content_length(self.headers, self.server.max_request_bytes)  # refused unread when wrong
        except ContractError as exc:
            return self._answer(exc.status, {"error": str(exc)})
        self.reader.limit = self.reader.received + length
        body = self.rfile.read(length)  # TimeoutError past the deadline: handle_one_request answers 408
        if len(body) < length:  # the peer closed before sending it all: no one to answer
            self.close_connection = True
            return
        self.body_pending = False
        try:
            samples = read_request(body, self.server.max_batch, self.server.max_json_values)
            del body  # the parsed samples are what is kept while the request waits for the scorer
            check = getattr(self.server.reward, "check_fields", None)  # a function's parameters against the columns
            if check is not None and samples.size:
                check(samples.fields)
        except ContractError as exc:
            return self._answer(exc.status, {"error": str(exc)})
        except ValueError as exc:  # ModelError: the function cannot be called with these columns
            return self._answer(400, {"error": f"field 'fields': {one_line(exc)}"})
        if not samples.size:
            return self._answer(200, {"rewards": []})
        job = self.server.scorer.submit(samples)
        self._answer(job.status, {"rewards": job.rewards} if job.status == 200 else {"error": job.error})

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close: what is left of the request is not read."""
        self.close_connection = True
        self._answer(status, {"error": message})

    def _answer(self, status: int, document: dict, headers: dict | None = None) -> None:
        body = json.dumps(document).encode()
        if self.body_pending:  # a body left unread would be read as the next request: close instead
            self.close_connection = True
        try:
            self.connection.settimeout(self.server.request_timeout)  # the answer, too, is sent in bounded time
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client went away (its own timeout): nothing to answer
            self.close_connection = True


# ------------------------------------------------------------------------------------------ what is served

def load_target(target: str, template: str = "auto", forward_batch_size: int = 16):
    """(the reward callable `target` names, what /health says of it). ModelError / ConfigError when it is none."""
    from rlhfkit.config.ppo_schema import reward_kind
    from rlhfkit.errors import ConfigError
    from rlhfkit.models.reward_fn import FunctionReward
    from rlhfkit.user_code import load_user_object

    kind = reward_kind(target)
    if kind == "url":
        raise ConfigError(f"TARGET {target!r} is a URL: serve a reward-model folder or a Python function")
    if kind == "function":
        return FunctionReward(load_user_object(target), target), {"serves": target, "kind": "Python function"}
    return load_served_reward_model(target, template, forward_batch_size), {"serves": target, "kind": "reward model"}


def load_served_reward_model(folder: str, template: str, forward_batch_size: int):
    """`ModelReward` on the folder's reward model, scoring the prompt's turns and the response re-rendered with
    its own template (there is no actor whose token ids it could read)."""
    import torch

    from rlhfkit.config.schema import LoadConfig
    from rlhfkit.data.templates import Template
    from rlhfkit.errors import ModelError
    from rlhfkit.models import load_scalar_model, load_tokenizer
    from rlhfkit.models.loading import has_trained_score_head
    from rlhfkit.models.reward_fn import ModelReward

    tokenizer = load_tokenizer(folder)
    model = load_scalar_model(folder, LoadConfig(), tokenizer)
    if not has_trained_score_head(model):
        raise ModelError(f"'{folder}' is not a reward model (no trained score head in its config.json): serve an "
                         f"`rlhfkit rm` run's final/ folder, or a Python function module:function")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    own = Template.for_tokenizer(tokenizer, getattr(model.config, "rlhfkit_template", None) or template,
                                 getattr(model.config, "rlhfkit_end_ids", None))
    reward = ModelReward(model, tokenizer, own, template, forward_batch_size, device)
    reward.retokenize = True  # requests carry text, not its token ids: always render prompt + response anew
    return reward


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False
