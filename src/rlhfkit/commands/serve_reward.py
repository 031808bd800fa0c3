"""`rlhfkit serve-reward TARGET`: a reward-model folder or a Python reward function served over HTTP
(remote/server.py), for `reward: http://host:port/score` in a PPO config run elsewhere (docs/remote.md). The flags,
their checks, and the server's life: started, its URL printed, stopped by Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from rlhfkit.errors import USER_ERRORS, RunError
from rlhfkit.remote.request import DEFAULT_MAX_JSON_VALUES
from rlhfkit.remote.server import (DEFAULT_MAX_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_PATH, DEFAULT_REQUEST_TIMEOUT,
                                   DEFAULT_TOKEN_ENV, HEALTH_PATH, LISTEN_BACKLOG, MIN_TOKEN_CHARS, RewardServer,
                                   check_token, is_loopback, load_target)

DESCRIPTION = "serve a reward model or a Python reward function over HTTP for `reward: http://...` (docs/remote.md)"
EPILOG = """\
contract (one JSON document each way):
  POST PATH   {"prompts": [str], "responses": [str], "messages": [[{"role", "content"}] | null],
               "finished": [bool], "fields": {column: [value, ...]}}
              prompts and responses required, one entry per sample in every list; messages default to one user
              turn holding the prompt, finished to true, fields to none
  200         {"rewards": [number | null, ...]}   null: the sample is left unjudged
  GET /health {"status": "ok", "serves": TARGET, ...}
  errors      {"error": "one line"} with 400 (malformed JSON, Content-Length or contract, naming the field),
              401 (token), 404 (path), 405 (method), 408 (not sent within --request-timeout), 411 (no
              Content-Length), 413 (too large: bytes, samples or JSON values), 431 (a head over 64 KiB),
              500 (the reward raised)

security: binds 127.0.0.1 unless --host says otherwise; any other address needs a token in the environment
variable --token-env names (at least 16 printable ASCII characters, no spaces); with a token set every request
needs `Authorization: Bearer TOKEN`.

limits: --max-connections served at once, the others wait in a listen backlog of 1024; a request (head and body,
idle time before it included) must arrive within --request-timeout seconds in all, else 408 and closed; its body
holds at most --max-request-bytes bytes, --max-json-values JSON values, nesting 64 deep, --max-batch samples.

examples:
  rlhfkit serve-reward rewards.py:four_words --port 8000
  rlhfkit serve-reward runs/rm/final --port 8000 --max-batch 64
  export RLHFKIT_REWARD_TOKEN=$(python -c "import secrets; print(secrets.token_urlsafe(32))")
  rlhfkit serve-reward runs/rm/final --host 0.0.0.0 --port 8000
"""


def add_parser(sub, verb: str, summary: str) -> argparse.ArgumentParser:
    p = sub.add_parser(verb, help=summary, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--max-json-values", type=int, default=DEFAULT_MAX_JSON_VALUES,
                   help=f"the most JSON values (strings, numbers, lists, objects, keys) a request body may hold, "
                        f"counted before it is parsed; more get 413 (default {DEFAULT_MAX_JSON_VALUES}: a body of "
                        f"millions of tiny values would parse into hundreds of MB)")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                   help=f"seconds a connection may take to send one whole request, head and body, idle time "
                        f"before it included; a slower one gets 408 and is closed (default "
                        f"{DEFAULT_REQUEST_TIMEOUT:g})")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help=f"connections served at once, a thread each; more wait in the listen backlog "
                        f"({LISTEN_BACKLOG}) (default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--token-env", default=DEFAULT_TOKEN_ENV, help=f"the environment variable holding the token "
                                                                  f"requests must carry as Authorization: Bearer "
                                                                  f"(default {DEFAULT_TOKEN_ENV}; unset or empty: "
                                                                  f"no token, loopback only; else at least "
                                                                  f"{MIN_TOKEN_CHARS} printable characters)")
    p.add_argument("--forward-batch-size", type=int, default=16, help="a reward model's rows per forward "
                                                                      "(default 16)")
    p.add_argument("--template", default="auto", choices=("auto", "chat", "plain"),
                   help="a reward model's prompt rendering when its folder recorded none (default auto)")
    return p


def check_args(args) -> str | None:
    """The token (None: none), after the checks that need no model: RunError naming the flag."""
    if not args.path.startswith("/") or args.path == HEALTH_PATH:
        raise RunError(f"--path must start with / and not be {HEALTH_PATH}, got {args.path!r}")
    for flag, value in (("--max-batch", args.max_batch), ("--max-request-bytes", args.max_request_bytes),
                        ("--max-json-values", args.max_json_values), ("--max-connections", args.max_connections),
                        ("--forward-batch-size", args.forward_batch_size)):
        if value < 1:
            raise RunError(f"{flag} must be >= 1, got {value}")
    if not args.request_timeout > 0:
        raise RunError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if not 0 <= args.port <= 65535:
        raise RunError(f"--port must be in 0..65535, got {args.port}")
    token = check_token(os.environ.get(args.token_env), args.token_env)
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
                              max_request_bytes=args.max_request_bytes, max_json_values=args.max_json_values,
                              request_timeout=args.request_timeout, max_connections=args.max_connections,
                              token=token, token_env=args.token_env)
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
