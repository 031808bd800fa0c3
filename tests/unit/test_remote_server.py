"""`rlhfkit serve-reward`: real servers on loopback (ephemeral ports), asked over HTTP.

The contract's round trip gives the function's own values; concurrent requests are scored together (dynamic
batching) and each gets its slice; the token, the size limits, malformed requests, wrong paths and methods get
their status codes and one-line messages; a reward that raises gets 500 and the server serves on; a reward-model
folder is served with its own template.

A hostile peer's attacks, each measured once against the server before these limits (issue 63) and kept here as a
test: 200 requests at once (a backlog of 5 dropped 122), a header sent a byte at a time and idle half-requests (302
threads held for ever), Content-Lengths of '²' or 5,000 digits and 100,000 nested `[` (a traceback and no answer),
8 MiB of `{},` (+210 MB before its 400), a token of one space (accepted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import socket
import threading
import time
import tracemalloc
import urllib.error
import urllib.request

import pytest
import torch

from rlhfkit.commands.serve_reward import check_args
from rlhfkit.errors import RunError
from rlhfkit.models.reward_fn import FunctionReward
from rlhfkit.remote.server import DEFAULT_MAX_BYTES, RewardServer, load_target

from conftest import run_cli


@contextlib.contextmanager
def serving(reward, **options):
    """A RewardServer for `reward` on a free loopback port, serving in a thread for the block."""
    server = RewardServer("127.0.0.1", 0, reward, {"serves": "test", "kind": "test"}, **options)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def post(url: str, document=None, *, body: bytes | None = None, token: str | None = None, method: str = "POST",
         headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of one request."""
    data = body if body is not None else (json.dumps(document).encode() if document is not None else None)
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {}),
        **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def judge(prompts, responses, answer):
    """Words in the response, + 10 when it holds the row's answer; None (unjudged) for an empty response."""
    return [None if not r else len(r.split()) + 10.0 * (a in r) for r, a in zip(responses, answer)]


REQUEST = {"prompts": ["say apple", "say river", "say stone"], "responses": ["apple apple", "", "stone"],
           "fields": {"answer": ["apple", "river", "cloud"]}}
TOKEN = "s3cret-of-24-characters"


def command_args(**values) -> argparse.Namespace:
    """`rlhfkit serve-reward`'s parsed flags at their defaults, but `values`."""
    defaults = dict(host="127.0.0.1", port=0, path="/score", max_batch=8, max_request_bytes=1000,
                    max_json_values=1000, request_timeout=10.0, max_connections=64, forward_batch_size=4,
                    token_env="RLHFKIT_REWARD_TOKEN")
    return argparse.Namespace(**{**defaults, **values})


def test_the_contract_round_trip_gives_the_functions_values_and_health_says_what_is_served():
    with serving(FunctionReward(judge, "judge")) as server:
        status, answer = post(server.url, REQUEST)
        assert status == 200 and answer == {"rewards": [12.0, None, 1.0]}
        assert answer["rewards"] == judge(REQUEST["prompts"], REQUEST["responses"], REQUEST["fields"]["answer"])
        assert post(server.url, {"prompts": [], "responses": []}) == (200, {"rewards": []})
        status, health = post(server.url.replace("/score", "/health"), method="GET")
        assert status == 200 and health["status"] == "ok" and health["path"] == "/score"
        assert health["max_batch"] == 256 and health["token"] is False


def test_concurrent_requests_are_scored_together_each_getting_its_own_slice():
    sizes, entered, release = [], threading.Event(), threading.Event()

    def recorder(prompts, responses):
        sizes.append(len(prompts))
        entered.set()
        release.wait(10)  # the first batch holds the scorer while the others queue up
        return [float(p.split()[-1]) for p in prompts]

    def request(first: int, n: int, out: dict):
        out[first] = post(server.url, {"prompts": [f"n {first + i}" for i in range(n)], "responses": ["r"] * n})

    for max_batch, expected in ((256, [2, 9]), (6, [2, 6, 3])):
        sizes.clear()
        entered.clear()
        release.clear()
        with serving(FunctionReward(recorder, "recorder"), max_batch=max_batch) as server:
            answers = {}
            threads = [threading.Thread(target=request, args=(0, 2, answers))]
            threads[0].start()
            assert entered.wait(10)
            threads += [threading.Thread(target=request, args=(first, 3, answers)) for first in (2, 5, 8)]
            for t in threads[1:]:
                t.start()
            deadline = time.monotonic() + 10
            while len(server.scorer.queue) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            release.set()
            for t in threads:
                t.join(10)
        assert sizes == expected
        for first, (status, answer) in answers.items():  # each its own rewards: its samples' numbers
            assert status == 200 and answer["rewards"] == [float(first + i) for i in range(len(answer["rewards"]))]
        assert sorted(answers) == [0, 2, 5, 8]


def test_a_reward_that_raises_gets_500_and_the_server_serves_on():
    def fragile(prompts, responses):
        if "boom" in responses:
            raise ValueError("cannot judge boom")
        return [1.0] * len(responses)

    with serving(FunctionReward(fragile, "fragile.py:fragile")) as server:
        status, answer = post(server.url, {"prompts": ["p"], "responses": ["boom"]})
        assert status == 500
        assert answer["error"].startswith("reward 'fragile.py:fragile' raised ValueError: cannot judge boom (at ")
        assert post(server.url, {"prompts": ["p"], "responses": ["fine"]}) == (200, {"rewards": [1.0]})
        status, answer = post(server.url, {"prompts": ["p"], "responses": ["x"], "fields": {"answer": [1]}})
        assert status == 200  # a column the function does not take is not passed


def test_malformed_requests_get_400_naming_the_field_and_wrong_paths_and_methods_404_405():
    with serving(FunctionReward(judge, "judge")) as server:
        cases = [
            (b"{not json", "malformed JSON: "),
            (b"[1, 2]", "expected a JSON object"),
            (b'{"prompts": ["a"]}', "field 'responses': required"),
            (b'{"prompts": ["a"], "responses": [1]}', "field 'responses': expected a list of strings"),
            (b'{"prompts": ["a", "b"], "responses": ["x"]}', "field 'responses': 1 responses for 2 prompts"),
            (b'{"prompts": ["a"], "responses": ["x"], "response": ["x"]}', "unknown field 'response'"),
            (b'{"prompts": ["a"], "responses": ["x"], "finished": [1]}', "field 'finished'"),
            (b'{"prompts": ["a"], "responses": ["x"], "messages": [[{"role": "user"}]]}', "field 'messages'[0]"),
            (b'{"prompts": ["a"], "responses": ["x"], "fields": {"answer": []}}', "field 'fields.answer'"),
            # the function's own check: a parameter the request's columns do not fill
            (b'{"prompts": ["a"], "responses": ["x"]}', "field 'fields': reward function 'judge' ("),
        ]
        for body, start in cases:
            status, answer = post(server.url, body=body)
            assert status == 400 and start in answer["error"], (body, answer)
            assert "\n" not in answer["error"]
        base = server.url.rsplit("/", 1)[0]
        assert post(base + "/nowhere", REQUEST)[0] == 404
        status, answer = post(server.url, method="GET")
        assert status == 405 and answer["error"] == "/score takes POST, not GET"
        assert post(base + "/health", REQUEST)[0] == 405
        assert post(server.url, REQUEST, method="PUT")[0] == 405


def test_oversized_requests_get_413():
    with serving(FunctionReward(judge, "judge"), max_batch=2, max_request_bytes=1000) as server:
        status, answer = post(server.url, body=b" " * 1001)
        assert status == 413 and "more than this server's --max-request-bytes 1000" in answer["error"]
        status, answer = post(server.url, REQUEST)  # 3 samples
        assert status == 413 and answer["error"] == "too many samples: 3, more than this server's --max-batch 2"


def test_with_a_token_every_request_needs_it_and_other_addresses_need_one(monkeypatch):
    with serving(FunctionReward(judge, "judge"), token=TOKEN) as server:
        for token in (None, "wrong"):
            status, answer = post(server.url, REQUEST, token=token)
            assert status == 401 and "$RLHFKIT_REWARD_TOKEN" in answer["error"]
        assert post(server.url, REQUEST, token=TOKEN)[0] == 200
        assert post(server.url.replace("/score", "/health"), method="GET")[0] == 401

    args = command_args(host="0.0.0.0", token_env="MY_JUDGE_TOKEN")
    monkeypatch.delenv("MY_JUDGE_TOKEN", raising=False)
    with pytest.raises(RunError, match=r"--host 0.0.0.0 would serve other machines without a token: set the "
                                       r"environment variable MY_JUDGE_TOKEN"):
        check_args(args)
    monkeypatch.setenv("MY_JUDGE_TOKEN", TOKEN)
    assert check_args(args) == TOKEN
    assert check_args(argparse.Namespace(**{**vars(args), "host": "127.0.0.1", "token_env": "UNSET_VAR"})) is None


def test_a_reward_model_folder_is_served_with_its_own_template(tiny_model_dir, tmp_path):
    from rlhfkit.data.templates import Template
    from rlhfkit.models import load_scalar_model, load_tokenizer
    from rlhfkit.models.reward_fn import ModelReward
    from rlhfkit.rollout.batch import RolloutBatch

    folder = tmp_path / "rm"
    torch.manual_seed(0)
    load_scalar_model(str(tiny_model_dir), tokenizer=load_tokenizer(str(tiny_model_dir))).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    reward, about = load_target(str(folder), forward_batch_size=2)
    assert about == {"serves": str(folder), "kind": "reward model"} and reward.retokenize

    messages = [[{"role": "user", "content": f"say {n}"}] for n in ("apple", "river", "stone")]
    responses = ["apple apple", "river", "cloud cloud cloud"]
    with serving(reward) as server:
        status, answer = post(server.url, {"prompts": ["unused"] * 3, "responses": responses, "messages": messages,
                                           "finished": [True, False, True]})
        # no messages: the prompt is one user turn (scored alone: padding's rounding apart, the same)
        alone = post(server.url, {"prompts": ["say apple"], "responses": ["apple apple"]})[1]["rewards"]
    assert alone == pytest.approx(answer["rewards"][:1], abs=1e-6)
    assert status == 200 and len(set(answer["rewards"])) == 3

    # the same scores as the reward model scoring an actor's rollout of another tokenizer (re-rendered text)
    tok = load_tokenizer(str(folder))
    rm = load_scalar_model(str(folder), tokenizer=tok).eval()
    local = ModelReward(rm, tok, Template.for_tokenizer(tok), "auto", 2, torch.device("cpu"))
    local.retokenize = True
    batch = RolloutBatch(prompt_ids=torch.zeros(3, 1, dtype=torch.long), prompt_mask=torch.ones(3, 1, dtype=torch.long),
                         response_ids=torch.zeros(3, 1, dtype=torch.long), response_mask=torch.ones(3, 1),
                         prompt_texts=["unused"] * 3, response_texts=responses, messages=messages)
    expected = local(batch, torch.tensor([True, False, True])).tolist()
    assert answer["rewards"] == pytest.approx(expected, abs=1e-6) and all(math.isfinite(v) for v in expected)


def test_the_command_refuses_a_url_target_and_an_open_address_without_a_token(tmp_path):
    res = run_cli("serve-reward", "http://127.0.0.1:8000/score", env={"RLHFKIT_REWARD_TOKEN": ""})
    assert res.returncode == 2 and "is a URL: serve a reward-model folder or a Python function" in res.stderr
    res = run_cli("serve-reward", "judge.py:judge", "--host", "0.0.0.0", env={"RLHFKIT_REWARD_TOKEN": ""})
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith(
        "rlhfkit serve-reward: error: --host 0.0.0.0 would serve other machines without a token")
    assert res.stdout == ""


# ---------------------------------------------------------------------------------------------- a hostile peer

def count_words(prompts, responses):
    return [float(len(r.split())) for r in responses]


def exchange(server, data: bytes, timeout: float = 10.0) -> tuple[int, dict]:
    """(status, JSON answer) of raw bytes sent on one connection, read until the server closes it."""
    with socket.create_connection(server.server_address[:2], timeout=timeout) as conn:
        conn.sendall(data)
        chunks = []
        with contextlib.suppress(ConnectionResetError):  # closed with the rest of the request unread
            while chunk := conn.recv(65536):
                chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def raw_post(body: bytes, length: str | None = None, extra: str = "") -> bytes:
    length = str(len(body)) if length is None else length
    return (f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n{extra}\r\n").encode("latin-1") + body


def handler_threads() -> int:
    """Connection threads of the servers in this process (socketserver names them after their target)."""
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def test_200_simultaneous_requests_are_all_answered():
    """A backlog of 5 dropped 122 of these (connection reset); with the listen backlog and the connection-thread
    cap (64 here, so that most wait in the backlog) every one is answered, each with its own reward."""
    def slow_words(prompts, responses):
        time.sleep(0.01)  # a forward's worth: connections pile up while the scorer works
        return count_words(prompts, responses)

    answers, ready = {}, threading.Barrier(200, timeout=20)
    with serving(FunctionReward(slow_words, "words"), max_connections=64) as server:
        most, stop = [0], threading.Event()

        def watch():
            while not stop.wait(0.005):
                most[0] = max(most[0], handler_threads())

        def ask(i: int):
            ready.wait()
            try:
                answers[i] = post(server.url, {"prompts": ["p"], "responses": ["w " * i]})
            except OSError as exc:  # dropped: refused, reset or timed out
                answers[i] = (type(exc).__name__, None)

        watcher = threading.Thread(target=watch)
        watcher.start()
        clients = [threading.Thread(target=ask, args=(i,)) for i in range(200)]
        start = time.monotonic()
        for t in clients:
            t.start()
        for t in clients:
            t.join(30)
        seconds = time.monotonic() - start
        stop.set()
        watcher.join()
    assert [i for i in range(200) if answers.get(i, (None,))[0] != 200] == []  # none dropped
    assert all(answers[i][1] == {"rewards": [float(i)]} for i in range(200))
    assert seconds < 15, seconds
    assert most[0] <= 64  # never more connection threads than --max-connections


def test_slow_and_idle_connections_are_dropped_within_the_request_timeout():
    """A head sent a byte at a time, a half-request whose body never comes and a connection that sends nothing are
    each dropped within --request-timeout (0.5 s here) of their start, the first two with a 408, before the token
    is looked at; their threads end, and a real request is answered meanwhile."""
    with serving(FunctionReward(count_words, "words"), token=TOKEN, request_timeout=0.5) as server:
        address = server.server_address[:2]
        starts, peers = {}, {}
        for kind, first in (("drip", b"POST /score HTTP/1.1\r\nX-Slow: "),
                            ("half", raw_post(b"", "100", f"Authorization: Bearer {TOKEN}\r\n") + b"{"),
                            ("idle", b"")):
            for i in range(20):
                conn = socket.create_connection(address)
                conn.sendall(first)
                conn.setblocking(False)
                peers[(kind, i)], starts[(kind, i)] = conn, time.monotonic()
        held, settle = 0, time.monotonic() + 0.4  # each one holds a thread until its timeout (0.5 s): count them
        while held < 60 and time.monotonic() < settle:  # as they start (a loaded machine starts some late)
            held = max(held, handler_threads())
            time.sleep(0.01)
        assert post(server.url, REQUEST | {"fields": {}}, token=TOKEN) == (200, {"rewards": [2.0, 0.0, 1.0]})
        dropped = {}
        while len(dropped) < len(peers) and time.monotonic() - min(starts.values()) < 5:
            for key, conn in peers.items():
                if key in dropped:
                    continue
                try:
                    data = conn.recv(4096)
                    dropped[key] = (time.monotonic() - starts[key], data.split(b"\r\n")[0])
                except BlockingIOError:  # still open: the dripping ones send their next byte
                    with contextlib.suppress(OSError):
                        conn.send(b"a") if key[0] == "drip" else None
                except OSError as exc:
                    dropped[key] = (time.monotonic() - starts[key], type(exc).__name__.encode())
            time.sleep(0.02)
        for conn in peers.values():
            conn.close()
        deadline = time.monotonic() + 2
        while handler_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        after = handler_threads()
    assert held >= 60 and after == 0, (held, after)
    assert len(dropped) == 60 and max(seconds for seconds, _ in dropped.values()) < 0.5 + 1.0
    for (kind, _), (seconds, first_line) in dropped.items():
        assert seconds >= 0.45 and first_line == (b"" if kind == "idle" else b"HTTP/1.0 408 Request Timeout"), kind


def test_malformed_content_lengths_get_400_in_one_line_and_never_a_traceback(capsys):
    body = json.dumps({"prompts": ["p"], "responses": ["a b"]}).encode()
    with serving(FunctionReward(count_words, "words"), max_request_bytes=1000) as server:
        cases = [
            (raw_post(body, "\u00b2"), 400, "Content-Length '\u00b2' is not a byte count (ASCII digits)"),
            (raw_post(body, "\u00b2".encode().decode("latin-1")), 400, "is not a byte count (ASCII digits)"),
            (raw_post(body, "9" * 5000), 400, "Content-Length of 5000 digits is not a byte count this server takes"),
            (raw_post(body, "-1"), 400, "Content-Length '-1' is not a byte count"),
            (raw_post(body, "+40"), 400, "Content-Length '+40' is not a byte count"),
            (raw_post(body, "40, 40"), 400, "Content-Length '40, 40' is not a byte count"),
            (raw_post(body, extra=f"Content-Length: {len(body)}\r\n"), 400, "2 Content-Length headers: a request "
                                                                            "has one"),
            (raw_post(body, "1001"), 413, "the request is 1001 bytes, more than this server's --max-request-bytes"),
            (raw_post(body, extra="Transfer-Encoding: chunked\r\n"), 411, "a request needs its Content-Length"),
            (b"POST /score HTTP/1.1\r\n\r\n", 411, "a request needs its Content-Length"),
            (b"GARBAGE\r\n\r\n", 400, "Bad request syntax ('GARBAGE')"),  # http.server's own refusals too
            (b"POST /score HTTP/1.1\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431, "head is over 65536 bytes"),
            (raw_post(body, f"000{len(body)}"), 200, None),  # leading zeros are still a byte count
        ]
        for data, status, start in cases:
            got, answer = exchange(server, data)
            assert got == status, (data[:60], answer)
            assert start is None and answer == {"rewards": [2.0]} or start in answer["error"], (data[:60], answer)
    assert "Traceback" not in capsys.readouterr().err


def test_deep_json_gets_400_and_brackets_inside_strings_do_not_count(capsys):
    def nested(depth: int) -> list:
        value = []
        for _ in range(depth - 1):
            value = [value]
        return value

    too_deep = "malformed JSON: brackets unbalanced or nested more than 64 deep"
    with serving(FunctionReward(count_words, "words")) as server:
        for body in (b"[" * 100_000, b'{"prompts": ' + b"[" * 5000 + b"]" * 5000 + b', "responses": []}',
                     json.dumps({"prompts": ["p"], "responses": ["r"], "fields": {"x": [nested(62)]}}).encode()):
            status, answer = exchange(server, raw_post(body))
            assert (status, answer) == (400, {"error": too_deep})
        # 64 deep: the object, fields, the column, and 61 lists of a value
        deep = {"prompts": ["p"], "responses": ["r"], "fields": {"x": [nested(61)]}}
        assert post(server.url, deep) == (200, {"rewards": [1.0]})
        # a response may hold any text: brackets, quotes and backslashes in strings are not structure
        text = ["[" * 100_000, '\\"[[[[', "}}}}\\", '"{' * 1000, ",:" * 100_000]
        assert post(server.url, {"prompts": ["p"] * 5, "responses": text}) == (200, {"rewards": [1.0] * 5})
        status, answer = exchange(server, raw_post(json.dumps({"prompts": [], "responses": []}).encode("utf-16")))
        assert status == 400 and answer["error"].startswith("malformed JSON: ")  # UTF-8 only
    assert "Traceback" not in capsys.readouterr().err


def test_a_body_of_millions_of_tiny_values_is_refused_before_it_is_parsed():
    """8 MiB of `{},` parses into 2.8 million dicts: +210 MB of peak memory for its 400. It is counted on its bytes
    and refused (413) before json.loads builds anything."""
    body = b'{"prompts": [' + b"{}," * ((DEFAULT_MAX_BYTES - 40) // 3) + b'{}], "responses": []}'
    assert len(body) <= DEFAULT_MAX_BYTES
    request = raw_post(body)
    with serving(FunctionReward(count_words, "words")) as server:
        tracemalloc.start()  # the server's allocations (this process's): the request's bytes are made already
        try:
            status, answer = exchange(server, request, timeout=30)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert (status, answer) == (413, {"error": "the request holds 2796195 JSON values, more than this server's "
                                                   "--max-json-values 262144"})
        # the body read, and the bytes outside its strings (re.sub's pieces and their join): 3 x, not +210 MB
        assert peak < 4 * len(body), peak
        many = {"prompts": ["p"] * 100, "responses": ["r"] * 100, "fields": {"x": [[0] * 9] * 100}}  # 1,209 values
        with serving(FunctionReward(count_words, "words"), max_json_values=1000) as small:
            status, answer = post(small.url, many)
            assert status == 413 and "holds 1209 JSON values, more than this server's --max-json-values 1000" in \
                answer["error"]
        assert post(server.url, many) == (200, {"rewards": [1.0] * 100})


def test_a_token_too_short_or_of_whitespace_is_refused_at_start(monkeypatch):
    for token, problem in ((" ", "is only whitespace"), ("short", "is 5 characters, fewer than 16"),
                           ("sixteen chars ok", "holds whitespace or characters other than printable ASCII")):
        with pytest.raises(RunError, match=f"the token in \\$RLHFKIT_REWARD_TOKEN {problem}: set it to a secret of "
                                           f"at least 16 printable characters"):
            RewardServer("127.0.0.1", 0, FunctionReward(count_words, "words"), {}, token=token)
        monkeypatch.setenv("RLHFKIT_REWARD_TOKEN", token)
        with pytest.raises(RunError, match=problem):
            check_args(command_args())
    res = run_cli("serve-reward", "judge.py:judge", env={"RLHFKIT_REWARD_TOKEN": " "})
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == ('rlhfkit serve-reward: error: the token in $RLHFKIT_REWARD_TOKEN is only whitespace: '
                                  'set it to a secret of at least 16 printable characters (python -c "import secrets; '
                                  'print(secrets.token_urlsafe(32))"), or unset it to serve this machine only')
