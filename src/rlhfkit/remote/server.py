"""`rlhfkit serve-reward TARGET`: a reward-model folder or a Python reward function served over HTTP, for
`reward: http://host:port/score` in a PPO config run elsewhere (remote/client.py has the contract; docs/remote.md).

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
  names), and with a token every request must carry `Authorization: Bearer TOKEN` (else 401). Oversized requests
  get 413, malformed ones 400 naming the field, a wrong path 404, a wrong method 405.

Only the standard library is imported at module level, so that `rlhfkit --help` stays fast.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import math
import os
import signal
import socket
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional
from urllib.parse import urlsplit

from rlhfkit.errors import USER_ERRORS

DEFAULT_PATH = "/score"
HEALTH_PATH = "/health"
DEFAULT_MAX_BYTES = 8 * 2 ** 20
DEFAULT_TOKEN_ENV = "RLHFKIT_REWARD_TOKEN"
KEYS = ("prompts", "responses", "messages", "finished", "fields")
DESCRIPTION = "serve a reward model or a Python reward function over HTTP for `reward: http://...` (docs/remote.md)"
EPILOG = """\
contract (one JSON document each way):
  POST PATH   {"prompts": [str], "responses": [str], "messages": [[{"role", "content"}] | null],
               "finished": [bool], "fields": {column: [value, ...]}}
              prompts and responses required, one entry per sample in every list; messages default to one user
              turn holding the prompt, finished to true, fields to none
  200         {"rewards": [number | null, ...]}   null: the sample is left unjudged
  GET /health {"status": "ok", "serves": TARGET, ...}
  errors      {"error": "one line"} with 400 (malformed JSON or contract, naming the field), 401 (token),
              404 (path), 405 (method), 411 (no Content-Length), 413 (too large), 500 (the reward raised)

security: binds 127.0.0.1 unless --host says otherwise; any other address needs a token in the environment
variable --token-env names; with a token set every request needs `Authorization: Bearer TOKEN`.

examples:
  rlhfkit serve-reward rewards.py:four_words --port 8000
  rlhfkit serve-reward runs/rm/final --port 8000 --max-batch 64
  RLHFKIT_REWARD_TOKEN=secret rlhfkit serve-reward runs/rm/final --host 0.0.0.0 --port 8000
"""


def add_serve_reward_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve-reward", help="serve a reward model or function over HTTP (docs/remote.md)",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", help="a reward-model folder (an `rlhfkit rm` run's final/), or a "
                                                    "Python function module:function or path/file.py:function "
                                                    "taking (prompts, responses[, dataset columns])")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                                                       "another one needs a token)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one, "
                                                          "printed)")
    p.add_argument("--path", default=DEFAULT_PATH, help=f"the path that takes POST requests (default "
                                                        f"{DEFAULT_PATH})")
    p.add_argument("--max-batch", type=int, default=256, help="samples scored together, queued requests pooled "
                                                             "up to it; also the most samples one request may "
                                                             "carry (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help=f"the largest request body taken; a larger one gets 413 (default {DEFAULT_MAX_BYTES}: "
                        f"8 MiB)")
    p.add_argument("--token-env", default=DEFAULT_TOKEN_ENV, help=f"the environment variable holding the token "
                                                                  f"requests must carry as Authorization: Bearer "
                                                                  f"(default {DEFAULT_TOKEN_ENV}; unset or empty: "
                                                                  f"no token, loopback only)")
    p.add_argument("--forward-batch-size", type=int, default=16, help="a reward model's rows per forward "
                                                                      "(default 16)")
    p.add_argument("--template", default="auto", choices=("auto", "chat", "plain"),
                   help="a reward model's prompt rendering when its folder recorded none (default auto)")
    return p


class ContractError(ValueError):
    """A request the server refuses: `status` (400 or 413) and a one-line message naming the field."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Samples:
    """One request's samples (or several pooled), read as a reward reads a rollout batch (rollout/batch.py)."""

    prompt_texts: list  # B prompts
    response_texts: list  # B responses
    messages: list  # B prompt turn lists ([{role, content}]), a reward model re-renders
    fields: list  # B dicts: the request's columns, row by row
    finished: list  # B bools: the response ended with EOS

    @property
    def size(self) -> int:
        return len(self.prompt_texts)

    @property
    def columns(self) -> tuple:
        """The field names: requests pool only with requests of the same columns."""
        return tuple(sorted(self.fields[0])) if self.fields else ()


def read_request(body: bytes, max_samples: int) -> Samples:
    """The samples of a request body; ContractError naming the field when it breaks the contract."""
    try:
        document = json.loads(body)
    except ValueError as exc:  # UnicodeDecodeError too
        raise ContractError(f"malformed JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ContractError('expected a JSON object {"prompts": [...], "responses": [...]}')
    unknown = sorted(set(document) - set(KEYS))
    if unknown:
        raise ContractError(f"unknown field '{unknown[0]}' (the contract's fields: {', '.join(KEYS)})")
    prompts, responses = _strings(document, "prompts"), _strings(document, "responses")
    n = len(prompts)
    if len(responses) != n:
        raise ContractError(f"field 'responses': {len(responses)} responses for {n} prompts")
    if n > max_samples:
        raise ContractError(f"too many samples: {n}, more than this server's --max-batch {max_samples}", 413)
    messages = _listed(document, "messages", n, [None] * n)
    messages = [_messages(m, i) if m is not None else [{"role": "user", "content": p}]
                for i, (m, p) in enumerate(zip(messages, prompts))]
    finished = _listed(document, "finished", n, [True] * n)
    if not all(isinstance(f, bool) for f in finished):
        raise ContractError("field 'finished': expected true or false per sample")
    columns = document.get("fields") or {}
    if not isinstance(columns, dict):
        raise ContractError("field 'fields': expected an object {column: [one value per sample]}")
    for name, values in columns.items():
        if not isinstance(values, list) or len(values) != n:
            raise ContractError(f"field 'fields.{name}': expected a list of {n} values, one per sample")
    rows = [{name: values[i] for name, values in columns.items()} for i in range(n)]
    return Samples(prompts, responses, messages, rows, finished)


def _strings(document: dict, key: str) -> list:
    values = document.get(key)
    if values is None:
        raise ContractError(f"field '{key}': required, a list of strings")
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ContractError(f"field '{key}': expected a list of strings")
    return values


def _listed(document: dict, key: str, n: int, default: list) -> list:
    values = document.get(key)
    if values is None:
        return default
    if not isinstance(values, list) or len(values) != n:
        raise ContractError(f"field '{key}': expected a list of {n} entries, one per sample")
    return values


def _messages(turns, i: int) -> list:
    ok = isinstance(turns, list) and turns and all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns)
    if not ok:
        raise ContractError(f"field 'messages'[{i}]: expected a list of {{\"role\": str, \"content\": str}} or null")
    return turns


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
    """The HTTP server: `reward` behind POST `path` and GET /health."""

    daemon_threads = True  # a connection's thread never holds up the exit

    def __init__(self, host: str, port: int, reward: Callable, about: dict, *, path: str = DEFAULT_PATH,
                 max_batch: int = 256, max_request_bytes: int = DEFAULT_MAX_BYTES, token: str | None = None,
                 token_env: str = DEFAULT_TOKEN_ENV):
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), RewardHandler)
        self.reward, self.about, self.route = reward, about, path
        self.max_batch, self.max_request_bytes = max_batch, max_request_bytes
        self.token, self.token_env = token or None, token_env
        self.scorer = Scorer(reward, max_batch)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{self.route}"

    def health(self) -> dict:
        return {"status": "ok", **self.about, "path": self.route, "max_batch": self.max_batch,
                "max_request_bytes": self.max_request_bytes, "token": self.token is not None}

    def server_close(self) -> None:
        super().server_close()
        self.scorer.stop()


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "rlhfkit-serve-reward"

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
        path = urlsplit(self.path).path
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
        length, limit = self.headers.get("Content-Length"), self.server.max_request_bytes
        if length is None or not length.strip().isdigit():
            self.close_connection = True
            return self._answer(411, {"error": "a request needs its Content-Length"})
        if int(length) > limit:  # refused unread
            self.close_connection = True
            return self._answer(413, {"error": f"the request is {int(length)} bytes, more than this server's "
                                               f"--max-request-bytes {limit}"})
        try:
            samples = read_request(self.rfile.read(int(length)), self.server.max_batch)
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

    def _answer(self, status: int, document: dict, headers: dict | None = None) -> None:
        body = json.dumps(document).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client went away (its own timeout): nothing to answer
            self.close_connection = True


# ------------------------------------------------------------------------------------------------ the command

def load_target(target: str, template: str = "auto", forward_batch_size: int = 16):
    """(the reward callable `target` names, what /health says of it). ModelError / ConfigError when it is none."""
    from rlhfkit.config.ppo_schema import reward_kind
    from rlhfkit.errors import ConfigError
    from rlhfkit.models.reward_fn import FunctionReward, load_reward_function

    kind = reward_kind(target)
    if kind == "url":
        raise ConfigError(f"TARGET {target!r} is a URL: serve a reward-model folder or a Python function")
    if kind == "function":
        return FunctionReward(load_reward_function(target), target), {"serves": target, "kind": "Python function"}
    return load_reward_model(target, template, forward_batch_size), {"serves": target, "kind": "reward model"}


def load_reward_model(folder: str, template: str, forward_batch_size: int):
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


def check_args(args) -> str | None:
    """The token (None: none), after the checks that need no model: RunError naming the flag."""
    from rlhfkit.errors import RunError

    if not args.path.startswith("/") or args.path == HEALTH_PATH:
        raise RunError(f"--path must start with / and not be {HEALTH_PATH}, got {args.path!r}")
    for flag, value in (("--max-batch", args.max_batch), ("--max-request-bytes", args.max_request_bytes),
                        ("--forward-batch-size", args.forward_batch_size)):
        if value < 1:
            raise RunError(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.port <= 65535:
        raise RunError(f"--port must be in 0..65535, got {args.port}")
    token = os.environ.get(args.token_env) or None
    if token is None and not is_loopback(args.host):
        raise RunError(f"--host {args.host} would serve other machines without a token: set the environment "
                       f"variable {args.token_env} (--token-env) to a secret that clients send as "
                       f"Authorization: Bearer, or bind 127.0.0.1")
    return token


def _stop(signum, frame):
    raise KeyboardInterrupt


def main(args) -> int:
    try:
        token = check_args(args)
        reward, about = load_target(args.target, args.template, args.forward_batch_size)
        server = RewardServer(args.host, args.port, reward, about, path=args.path, max_batch=args.max_batch,
                              max_request_bytes=args.max_request_bytes, token=token, token_env=args.token_env)
    except USER_ERRORS as exc:
        print(f"rlhfkit serve-reward: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the address is taken, or not this machine's
        print(f"rlhfkit serve-reward: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    print(server.url, flush=True)  # the one line on stdout: what to put in `reward:`
    print(f"rlhfkit serve-reward: {about['serves']} ({about['kind']}), up to {args.max_batch} samples per batch, "
          f"{'token required' if token else 'no token'}; Ctrl-C stops", file=sys.stderr, flush=True)
    # Ctrl-C and SIGTERM stop it cleanly, even where SIGINT came in ignored (a background job of a script, a test
    # runner's worker): Python leaves an inherited SIG_IGN in place, and the server would not stop
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("rlhfkit serve-reward: stopped", file=sys.stderr, flush=True)
    finally:
        server.server_close()
    return 0
