"""`rlhfkit serve-reward`: real servers on loopback (ephemeral ports), asked over HTTP.

The contract's round trip gives the function's own values; concurrent requests are scored together (dynamic
batching) and each gets its slice; the token, the size limits, malformed requests, wrong paths and methods get
their status codes and one-line messages; a reward that raises gets 500 and the server serves on; a reward-model
folder is served with its own template.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from rlhfkit.errors import RunError
from rlhfkit.models.reward_fn import FunctionReward
from rlhfkit.remote.server import RewardServer, check_args, load_target

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
    with serving(FunctionReward(judge, "judge"), token="s3cret") as server:
        for token in (None, "wrong"):
            status, answer = post(server.url, REQUEST, token=token)
            assert status == 401 and "$RLHFKIT_REWARD_TOKEN" in answer["error"]
        assert post(server.url, REQUEST, token="s3cret")[0] == 200
        assert post(server.url.replace("/score", "/health"), method="GET")[0] == 401

    args = argparse.Namespace(host="0.0.0.0", port=0, path="/score", max_batch=8, max_request_bytes=1000,
                              forward_batch_size=4, token_env="MY_JUDGE_TOKEN")
    monkeypatch.delenv("MY_JUDGE_TOKEN", raising=False)
    with pytest.raises(RunError, match=r"--host 0.0.0.0 would serve other machines without a token: set the "
                                       r"environment variable MY_JUDGE_TOKEN"):
        check_args(args)
    monkeypatch.setenv("MY_JUDGE_TOKEN", "s3cret")
    assert check_args(args) == "s3cret"
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
