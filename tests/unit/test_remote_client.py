"""`reward: http://...`: the client against real servers on loopback (ephemeral ports).

`rlhfkit serve-reward`'s own server for the contract's round trip, the token and contract errors; small scripted
servers for what a judge elsewhere may do: answer slowly, fail and then succeed, fail always, answer nonsense.

A hostile server's attacks, each measured once against the client before these limits (issue 63) and kept here as a
test: a redirect to another host (followed, with the token), an answer of 400 MiB (read whole: +400 MB per request
in flight), an answer dripped a byte at a time (the request's thread ran on after the call gave up).
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhfkit.config.ppo_schema import RemoteSection
from rlhfkit.errors import RunError
from rlhfkit.models.reward_fn import FunctionReward
from rlhfkit.remote.client import MAX_ANSWER_BYTES, RemoteReward
from rlhfkit.rollout.batch import RolloutBatch

from test_remote_server import TOKEN, judge, serving

NAMES = ["apple", "river", "stone", "cloud", "green", "tiger", "music"]


def rollout(prompts: list[str], responses: list[str], answers: list[str]) -> RolloutBatch:
    """A rollout batch as the PPO loop hands it to its reward (the ids play no part here)."""
    n = len(prompts)
    return RolloutBatch(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                        response_ids=torch.zeros(n, 1, dtype=torch.long), response_mask=torch.ones(n, 1),
                        prompt_texts=prompts, response_texts=responses,
                        messages=[[{"role": "user", "content": p}] for p in prompts],
                        fields=[{"answer": a, "id": i} for i, a in enumerate(answers)])


def world_batch() -> RolloutBatch:
    """7 samples: some hold their answer, one is empty (the judge leaves it unjudged)."""
    return rollout([f"say {n}" for n in NAMES], ["apple apple", "", "stone", "green", "green green", "x", "music"],
                   NAMES[:3] + ["cloud", "green", "tiger", "music"])


@contextlib.contextmanager
def scripted(answer):
    """A server whose every POST gets `answer(document, hit)` -> (status, JSON-able or bytes, seconds to wait
    first); `hits` lists the documents it received."""
    hits, lock = [], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            document = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                hits.append(document)
                hit = len(hits)
            status, body, delay = answer(document, hit)
            time.sleep(delay)
            body = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the client gave up waiting
                pass

        def log_message(self, *args):
            pass

    with listening(Handler) as url:
        yield url, hits


@contextlib.contextmanager
def listening(handler):
    """A threaded server on a free loopback port answering with `handler`; yields its /score URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


def judged(document) -> dict:
    return {"rewards": judge(document["prompts"], document["responses"], document["fields"]["answer"])}


QUICK = dict(timeout=0.3, retries=1, backoff=0.05)


def test_the_round_trip_gives_the_functions_own_values_in_requests_of_batch_size():
    batch = world_batch()
    sizes = []

    def recorded(prompts, responses, answer):
        sizes.append(len(prompts))
        return judge(prompts, responses, answer)

    with serving(FunctionReward(recorded, "judge"), max_batch=3) as server:
        reward = RemoteReward(server.url, RemoteSection(batch_size=3, concurrency=2))
        scores = reward(batch, torch.tensor([True] * 7))
    local = FunctionReward(judge, "judge")(batch)
    torch.testing.assert_close(scores, local, rtol=0, atol=0, equal_nan=True)
    assert math.isnan(scores[1]) and scores[0] == 12.0  # None -> unjudged
    assert sorted(sizes) == [1, 3, 3] and reward.counts == {"reward/remote_failed": 0.0}


def test_the_request_carries_prompts_responses_messages_finished_and_the_rows_fields():
    batch = world_batch()
    with scripted(lambda document, hit: (200, judged(document), 0)) as (url, hits):
        RemoteReward(url, RemoteSection(batch_size=4))(batch, torch.tensor([True, False] * 3 + [True]))
    first, second = sorted(hits, key=lambda d: d["fields"]["id"][0])
    assert first["prompts"] == batch.prompt_texts[:4] and second["responses"] == batch.response_texts[4:]
    assert first["messages"] == [[{"role": "user", "content": f"say {n}"}] for n in NAMES[:4]]
    assert first["finished"] == [True, False, True, False] and second["finished"] == [True, False, True]
    assert second["fields"] == {"answer": ["green", "tiger", "music"], "id": [4, 5, 6]}


def test_a_slow_server_leaves_its_samples_unjudged_within_the_bound():
    batch = world_batch()

    def slow_for_stone(document, hit):
        return 200, judged(document), 3.0 if "say stone" in document["prompts"] else 0.0

    with scripted(slow_for_stone) as (url, hits):
        reward = RemoteReward(url, RemoteSection(batch_size=2, concurrency=4, max_failed=1.0, **QUICK))
        start = time.monotonic()
        scores = reward(batch)
        seconds = time.monotonic() - start
    assert seconds < reward.request_bound() + 1.0, seconds  # 2 tries of 0.3 s, 0.05 s between
    assert [math.isnan(v) for v in scores.tolist()] == [False, True, True, True, False, False, False]
    assert scores[0] == 12.0 and scores[4] == 12.0  # the others judged
    assert reward.counts == {"reward/remote_failed": 2.0}  # stone, cloud; the empty response is the judge's None
    assert sum("say stone" in d["prompts"] for d in hits) == 2  # tried, and retried once


@pytest.mark.parametrize("status", [500, 503, 429, 408])
def test_failures_that_may_pass_are_retried_with_back_off(status):
    batch = world_batch()
    with scripted(lambda document, hit: (status, {"error": "busy"}, 0) if hit <= 2 else (200, judged(document), 0)) \
            as (url, hits):
        reward = RemoteReward(url, RemoteSection(retries=2, backoff=0.05))
        start = time.monotonic()
        scores = reward(batch)
    assert len(hits) == 3 and time.monotonic() - start >= 0.05 + 0.1  # back-off 0.05 s, then 0.1 s
    torch.testing.assert_close(scores, FunctionReward(judge, "judge")(batch), rtol=0, atol=0, equal_nan=True)
    assert reward.counts == {"reward/remote_failed": 0.0}


def test_a_server_that_always_fails_leaves_everything_unjudged_then_stops_the_run():
    batch = world_batch()
    with scripted(lambda document, hit: (503, {"error": "down for maintenance"}, 0)) as (url, hits):
        reward = RemoteReward(url, RemoteSection(batch_size=4, max_failed=1.0, **QUICK))
        assert torch.isnan(reward(batch)).all() and reward.counts == {"reward/remote_failed": 7.0}
        assert len(hits) == 4  # 2 requests, each tried twice
        with pytest.raises(RunError) as err:
            RemoteReward(url, RemoteSection(batch_size=4, **QUICK))(batch)
    assert str(err.value) == (f"reward server {url}: 7 of 7 samples could not be judged, more than "
                              f"remote.max_failed=0.25 of them; first: HTTP 503: down for maintenance (2 tries)")


def test_the_failed_share_is_pooled_over_ranks():
    """2 of this rank's 4 samples failed, none of another rank's 4: 2 of 8 is not more than 0.25."""
    batch = rollout([f"say {n}" for n in NAMES[:4]], ["a"] * 4, NAMES[:4])
    with scripted(lambda document, hit: (500, {}, 0) if "say apple" in document["prompts"]
                  else (200, judged(document), 0)) as (url, _):
        other_rank = iter([0.0, 4.0])  # its failed samples, then its samples: what the sum over ranks adds
        reward = RemoteReward(url, RemoteSection(batch_size=2, **QUICK), lambda value: value + next(other_rank))
        assert torch.isnan(reward(batch)).tolist() == [True, True, False, False]
        with pytest.raises(RunError, match=r"2 of 4 samples could not be judged"):  # alone: 2 of 4
            RemoteReward(url, RemoteSection(batch_size=2, **QUICK))(batch)


def test_connection_refused_is_retried_then_unjudged_and_named():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    reward = RemoteReward(url, RemoteSection(max_failed=1.0, **QUICK))
    assert torch.isnan(reward(world_batch())).all() and reward.counts == {"reward/remote_failed": 7.0}
    with pytest.raises(RunError, match=r"first: connection refused \(is the server running\?\) \(2 tries\)$"):
        RemoteReward(url, RemoteSection(**QUICK))(world_batch())


def test_a_wrong_or_missing_token_is_a_clear_error_naming_the_variable(monkeypatch):
    batch = world_batch()
    with serving(FunctionReward(judge, "judge"), token=TOKEN) as server:
        monkeypatch.setenv("RLHFKIT_REWARD_TOKEN", "wrong")
        with pytest.raises(RunError, match=r"answered HTTP 401: missing or wrong token.*: it refused the token in "
                                           r"\$RLHFKIT_REWARD_TOKEN \(remote.token_env\)"):
            RemoteReward(server.url, RemoteSection(**QUICK))(batch)
        monkeypatch.delenv("RLHFKIT_REWARD_TOKEN")
        with pytest.raises(RunError, match=r"it wants a token: set the environment variable RLHFKIT_REWARD_TOKEN"):
            RemoteReward(server.url, RemoteSection(**QUICK))(batch)
        monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
        scores = RemoteReward(server.url, RemoteSection(token_env="JUDGE_TOKEN"))(batch)
    torch.testing.assert_close(scores, FunctionReward(judge, "judge")(batch), rtol=0, atol=0, equal_nan=True)


def test_contract_errors_stop_at_once_with_what_to_do():
    batch = world_batch()
    with serving(FunctionReward(judge, "judge"), max_batch=2) as server:
        start = time.monotonic()
        with pytest.raises(RunError, match=r"answered HTTP 413: too many samples: 4, more than this server's "
                                           r"--max-batch 2 to a request of 4 samples: lower remote.batch_size"):
            RemoteReward(server.url, RemoteSection(batch_size=4, backoff=5.0))(batch)
        assert time.monotonic() - start < 5.0  # not retried
        with pytest.raises(RunError, match=r"answered HTTP 404: .*check the URL's path"):
            RemoteReward(server.url + "x", RemoteSection(batch_size=2))(batch)


@pytest.mark.parametrize("body", [{"rewards": [1.0]}, {"rewards": ["1", 2.0]}, {"scores": [1, 2]}, b"NaN",
                                  {"rewards": [float("inf"), 1.0]}, b"<html>oops</html>", {"rewards": [True, 1]},
                                  b"[" * 100_000])
def test_a_malformed_answer_leaves_its_samples_unjudged_said_once(body, capsys):
    batch = rollout(["say apple", "say river"], ["apple", "river"], ["apple", "river"])
    with scripted(lambda document, hit: (200, body, 0)) as (url, hits):
        reward = RemoteReward(url, RemoteSection(max_failed=1.0))
        for _ in range(2):
            assert torch.isnan(reward(batch)).all() and reward.counts == {"reward/remote_failed": 2.0}
    assert len(hits) == 2  # not retried
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"reward server {url}: a malformed answer: ")


def rlhfkit_threads() -> list[str]:
    """The client's request threads alive now (envs/calls.py names them)."""
    return [t.name for t in threading.enumerate() if t.name == "rlhfkit-env"]


def test_a_server_that_drips_its_answer_is_given_up_with_no_thread_left():
    """Each byte within remote.timeout, the answer never complete: every try ends at its deadline, on its socket,
    and the thread that waited ends with it (before, it read on for as long as the server dripped)."""
    dripped = []

    class Drip(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            with contextlib.suppress(OSError):  # until the client hangs up (at most 5 s)
                for _ in range(100):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    dripped.append(1)
                    time.sleep(0.05)

        def log_message(self, *args):
            pass

    before = set(threading.enumerate())
    with listening(Drip) as url:
        reward = RemoteReward(url, RemoteSection(batch_size=2, concurrency=4, max_failed=1.0, **QUICK))
        start = time.monotonic()
        assert torch.isnan(reward(world_batch())).all() and reward.counts == {"reward/remote_failed": 7.0}
        seconds = time.monotonic() - start
        deadline = time.monotonic() + 1.0
        while rlhfkit_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rlhfkit_threads() == []  # no request thread left running
        assert seconds < reward.request_bound() + 0.5, seconds  # 2 tries of 0.3 s, 0.05 s between
        with pytest.raises(RunError, match=r"first: no answer within remote.timeout=0.3 s \(2 tries\)$"):
            RemoteReward(url, RemoteSection(**QUICK))(world_batch())
        assert len(dripped) < 100  # the server's writes failed once the client hung up
    deadline = time.monotonic() + 2.0
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) - before == set()  # the server's threads too, once it is shut


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_the_token_goes_nowhere_else(status, monkeypatch):
    """The redirect points at a second listener that records what reaches it: nothing does, the token least."""
    caught = []

    class Catcher(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            caught.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        do_GET = do_POST  # noqa: N815

        def log_message(self, *args):
            pass

    monkeypatch.setenv("RLHFKIT_REWARD_TOKEN", TOKEN)
    with listening(Catcher) as elsewhere:
        location = elsewhere.replace("127.0.0.1", "localhost")
        answer = (status, b"moved", 0)

        class Redirect(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(answer[0])
                self.send_header("Location", location)
                self.send_header("Content-Length", "5")
                self.end_headers()
                self.wfile.write(answer[1])

            def log_message(self, *args):
                pass

        with listening(Redirect) as url:
            start = time.monotonic()
            with pytest.raises(RunError) as err:
                RemoteReward(url, RemoteSection(backoff=5.0))(world_batch())
            assert time.monotonic() - start < 5.0  # not retried
    assert str(err.value) == (f"reward server {url} answered HTTP {status}, a redirect to {location!r}: redirects "
                              f"are not followed (the request and its token would go with it): put the URL you "
                              f"mean in `reward:`")
    assert caught == []


@pytest.mark.parametrize("declared", [True, False])
def test_an_answer_over_the_cap_is_not_read_past_it(declared, capsys):
    """A server answering 400 MiB (announced, or streamed with no length until it closes): the client reads at most
    its cap, MAX_ANSWER_BYTES, and its samples are left unjudged as for a malformed answer."""
    sent = []
    chunk = b" " * 2 ** 20

    class Huge(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            if declared:
                self.send_header("Content-Length", str(400 * 2 ** 20))
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(400):
                    self.wfile.write(chunk)
                    sent.append(len(chunk))

        def log_message(self, *args):
            pass

    batch = rollout(["say apple", "say river"], ["apple", "river"], ["apple", "river"])
    with listening(Huge) as url:
        reward = RemoteReward(url, RemoteSection(max_failed=1.0, timeout=5.0))
        tracemalloc.start()
        try:
            assert torch.isnan(reward(batch)).all() and reward.counts == {"reward/remote_failed": 2.0}
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 8 * MAX_ANSWER_BYTES, peak  # the 400 MiB never read: a few MiB at most
    assert sum(sent) < 100 * 2 ** 20  # the server's writes failed once the client hung up
    said = capsys.readouterr().err
    assert f"a malformed answer: an answer {'of 419430400 bytes, ' if declared else ''}over the client's cap of " \
           f"{MAX_ANSWER_BYTES} bytes" in said
