"""`rlhfkit ppo` with `reward: http://...` end to end: the same run as with the Python function itself, and a run
that finishes against a server that never answers.

The reward function is served by `rlhfkit serve-reward` started as a real subprocess on a free port; the PPO runs
go through the real CLI on the tiny random model. JSON carries a float exactly (Python writes the shortest repr
that reads back to the same double), so the served run's curves equal the local run's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import NAMES, ROOT, read_metrics, run_cli, write_jsonl

REWARD = """\
def judge(prompts, responses, answer):
    # words up to 4, + 1 when the row's answer is in the response; an empty response is left unjudged
    return [None if not r.strip() else min(len(r.split()), 4) / 4 + (a in r) for r, a in zip(responses, answer)]
"""
RUN = ["train.batch_size=8", "train.micro_batch_size=8", "train.max_steps=4", "train.lr=1e-3", "gen.max_new_tokens=8",
       "train.eval_every=2", "train.seed=7", "log.tensorboard=false", "ppo.sample_every=0"]
CURVES = ("reward/mean", "reward/std", "reward/unjudged", "kl", "policy_loss", "eval/reward")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote_world")
    write_jsonl(root / "prompts.jsonl", [{"prompt": f"say {n}", "answer": n} for n in NAMES[:16]])
    write_jsonl(root / "eval.jsonl", [{"prompt": f"say {n}", "answer": n} for n in NAMES[16:]])
    (root / "rewards.py").write_text(REWARD)
    return root


def ppo(world: Path, actor: Path, out: str, reward: str, *overrides: str) -> subprocess.CompletedProcess:
    return run_cli("ppo", f"actor={actor}", f"reward={reward}", "data.prompts=prompts.jsonl",
                   "data.eval_prompts=eval.jsonl", f"output_dir={world / out}", *RUN, *overrides, cwd=world,
                   timeout=300)


def curves(path: Path) -> dict:
    rows = read_metrics(path)
    return {key: [r[key] for r in rows if key in r] for key in CURVES}


@contextlib.contextmanager
def serve_reward(world: Path, target: str):
    """`rlhfkit serve-reward TARGET --port 0` in a subprocess; yields the URL it printed. Started with SIGINT
    ignored, as a script's background job starts it (`rlhfkit serve-reward ... &`): Ctrl-C must stop it anyway."""
    proc = subprocess.Popen([sys.executable, "-m", "rlhfkit", "serve-reward", target, "--port", "0"], cwd=world,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "RLHFKIT_REWARD_TOKEN": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/score"), (url, proc.poll())
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_served_reward_gives_the_same_run_as_the_function_itself(world, tiny_model_dir):
    local = ppo(world, tiny_model_dir, "local", "rewards.py:judge")
    assert local.returncode == 0, local.stderr[-3000:]
    with serve_reward(world, "rewards.py:judge") as (url, server):
        served = ppo(world, tiny_model_dir, "served", url)
        assert served.returncode == 0, served.stderr[-3000:]
        server.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop
        assert server.wait(10) == 0 and server.stderr.read().strip().endswith("rlhfkit serve-reward: stopped")

    expected, got = curves(world / "local" / "metrics.jsonl"), curves(world / "served" / "metrics.jsonl")
    assert len(expected["reward/mean"]) == 4 and len(expected["eval/reward"]) == 3
    for key in CURVES:
        assert got[key] == pytest.approx(expected[key], abs=1e-6, rel=0), key
    rows = [r for r in read_metrics(world / "served" / "metrics.jsonl") if "reward/mean" in r]
    assert all(r["reward/remote_failed"] == 0 for r in rows)
    assert f"reward: {url}" in served.stderr


class Silent(BaseHTTPRequestHandler):
    """Takes the request and never answers (a judge stuck in its queue)."""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(120)

    def log_message(self, *args):
        pass


def test_a_run_against_a_server_that_hangs_finishes_with_its_samples_unjudged(world, tiny_model_dir):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    quick = ["remote.timeout=0.5", "remote.retries=1", "remote.backoff=0.1"]
    no_eval = ["data.eval_prompts=null", "data.eval_fraction=0", "train.eval_every=0"]
    try:
        start = time.monotonic()
        res = ppo(world, tiny_model_dir, "hung", url, *quick, "remote.max_failed=1", "train.max_steps=2", *no_eval)
        seconds = time.monotonic() - start
        assert res.returncode == 0, res.stderr[-3000:]
        rows = [r for r in read_metrics(world / "hung" / "metrics.jsonl") if "reward/mean" in r]
        assert [(r["reward/remote_failed"], r["reward/unjudged"]) for r in rows] == [(8, 8), (8, 8)]
        assert seconds < 120, seconds  # the server would hold each request 120 s

        # the default remote.max_failed (0.25): the first iteration stops the run, naming the server and why
        res = ppo(world, tiny_model_dir, "hung_stop", url, *quick, *no_eval)
        assert res.returncode == 2
        assert res.stderr.strip().splitlines()[-1] == (
            f"rlhfkit ppo: error: reward server {url}: 8 of 8 samples could not be judged, more than "
            f"remote.max_failed=0.25 of them; first: no answer within remote.timeout=0.5 s (2 tries)")
    finally:
        server.shutdown()
        server.server_close()


def test_the_pages_quick_start_answers_as_printed(tmp_path):
    """docs/remote.md's quick start up to its printed answer, run by bash (on a free port in place of 8000)."""
    text = (ROOT / "docs" / "remote.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    script, printed = block.split("\n# {", 1)
    printed = "{" + printed.splitlines()[0]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = script.replace("8000", str(port)) + "\nkill $!\nwait\n"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT / "src"), "RLHFKIT_REWARD_TOKEN": ""}
    res = subprocess.run(["timeout", "120", "bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == [f"http://127.0.0.1:{port}/score", printed]
    assert res.stderr.strip().endswith("rlhfkit serve-reward: stopped")
