"""Fail fast on the right cause, before any model loads: a model name that is neither a folder nor reachable, a
reward function whose signature the prompt rows cannot fill, an output folder that already holds a finished run.
Each exits with code 2 and one line that blames the right thing, within seconds, and writes nothing.

Most cases run `rlhfkit.cli.main` in-process (what the `rlhfkit` entry point calls); the hub cases whose
offline switch huggingface_hub reads at import run the real entry point in a subprocess.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhfkit.cli import main as cli_main
from rlhfkit.stages import ppo, sft  # noqa: F401  imported here, so that the timings below leave the imports out

from conftest import NAMES, ROOT, sft_rows, write_jsonl

FETCHED = "SmolLM2-135M-Instruct"  # the folder `rlhfkit fetch smollm2-135m-instruct` writes


def sft_args(tmp: Path, model) -> list[str]:
    data = write_jsonl(tmp / "train.jsonl", sft_rows())
    return [f"model={model}", f"data.train={data}", f"output_dir={tmp / 'out'}", "train.batch_size=4",
            "train.micro_batch_size=4", "train.max_steps=1", "log.tensorboard=false", f"data.cache_dir={tmp / 'cache'}"]


def ppo_args(tmp: Path, model, reward: str) -> list[str]:
    prompts = write_jsonl(tmp / "prompts.jsonl", [{"prompt": f"say {n}", "ground_truth": n} for n in NAMES])
    return [f"actor={model}", f"reward={reward}", f"data.prompts={prompts}", f"output_dir={tmp / 'out'}",
            "train.batch_size=4", "train.micro_batch_size=4", "train.max_steps=1", "gen.max_new_tokens=4",
            "data.eval_fraction=0", "log.tensorboard=false"]


def run(capsys, verb: str, args: list[str]) -> tuple[int, str, float]:
    """(exit code, the last stderr line, seconds) of `rlhfkit VERB ARGS` in-process."""
    start = time.monotonic()
    code = cli_main([verb, *args])
    seconds = time.monotonic() - start
    err = capsys.readouterr().err.strip()
    return code, err.splitlines()[-1] if err else "", seconds


def rlhfkit(*args: str, env: dict) -> subprocess.CompletedProcess:
    """The real entry point, with `env` as its whole environment but PYTHONPATH."""
    return subprocess.run([sys.executable, "-m", "rlhfkit", *args], capture_output=True, text=True, timeout=600,
                          env={**env, "PYTHONPATH": str(ROOT / "src")})


def without_offline() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


# ---------------------------------------------------------------- a model that is neither a folder nor reachable


@pytest.mark.parametrize("name", [FETCHED, f"HuggingFaceTB/{FETCHED}"])
def test_a_model_name_offline_says_so_and_names_the_fetched_folder(tmp_path, monkeypatch, capsys, name):
    """HF_HUB_OFFLINE=1 (the test session's setting): no request at all; the fetched SmolLM2 is what was meant."""
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "rlhfkit-cache"
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(cache))
    folder = cache / "models" / FETCHED
    code, line, seconds = run(capsys, "sft", sft_args(tmp_path, name))
    assert code == 2 and seconds < 5
    assert line == (f"rlhfkit sft: error: config key 'model': '{name}' is not a folder, and HF_HUB_OFFLINE is set "
                    f"(the hub is not asked, and its cache has no copy); did you mean the folder that rlhfkit fetch "
                    f"smollm2-135m-instruct writes? run that, then pass model={folder}")
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()  # nothing written, nothing read

    (folder).mkdir(parents=True)  # once fetched (the folder's marker: it is complete), it is named as it is
    (folder / "rlhfkit-source.json").write_text("{}")
    code, line, _ = run(capsys, "sft", sft_args(tmp_path, name))
    assert code == 2 and line.endswith(f"; did you mean model={folder} (what rlhfkit fetch smollm2-135m-instruct "
                                       f"wrote)?")


def test_every_model_setting_is_checked_and_named(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """PPO's critic (and reference, reward) are checked with the actor, before the prompts are tokenised."""
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(tmp_path / "rlhfkit cache"))  # a space: quoted in the hint
    reward = tmp_path / "r.py"
    reward.write_text("def score(prompts, responses):\n    return [0.0] * len(responses)\n")
    code, line, seconds = run(capsys, "ppo", ppo_args(tmp_path, tiny_model_dir, f"{reward}:score") + ["critic=gpt2"])
    assert code == 2 and seconds < 5
    fetched = shlex.quote(f"critic={tmp_path / 'rlhfkit cache' / 'models' / FETCHED}")
    assert line == (f"rlhfkit ppo: error: config key 'critic': 'gpt2' is not a folder, and HF_HUB_OFFLINE is set (the "
                    f"hub is not asked, and its cache has no copy): pass a model folder; rlhfkit fetch NAME makes "
                    f"one (rlhfkit fetch smollm2-135m-instruct, then {fetched})")
    assert not (tmp_path / "out").exists()


def test_an_unreachable_hub_is_asked_once_without_retries(tmp_path, tiny_model_dir):
    """Online, one request to the hub (here an endpoint where nothing listens) and no retries: the line says the
    hub is unreachable, not that the tokenizer is missing, and points to fetch and to HF_HUB_OFFLINE."""
    env = {**without_offline(), "HF_ENDPOINT": "http://127.0.0.1:9", "RLHFKIT_CACHE_DIR": str(tmp_path / "c")}
    res = rlhfkit("sft", *sft_args(tmp_path, FETCHED), env=env)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Retry" not in res.stderr and "tokenizer" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlhfkit sft: error: config key 'model': '{FETCHED}' is not a folder, and the hub "
                           f"(http://127.0.0.1:9) is not reachable (ConnectError: ")
    assert last.endswith(f"; HF_HUB_OFFLINE=1 before the command skips it); did you mean the folder that rlhfkit fetch "
                         f"smollm2-135m-instruct writes? run that, then pass "
                         f"model={tmp_path / 'c' / 'models' / FETCHED}")
    assert not (tmp_path / "out").exists()


def test_chat_with_a_name_that_is_no_folder_asks_the_unreachable_hub_once(tmp_path):
    """`rlhfkit chat NAME` (a command's argument, not a config key) gets the same one line, naming no config key,
    and its hint is the folder alone."""
    env = {**without_offline(), "HF_ENDPOINT": "http://127.0.0.1:9", "RLHFKIT_CACHE_DIR": str(tmp_path / "c")}
    res = rlhfkit("chat", FETCHED, "--prompt", "hi", env=env)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Retry" not in res.stderr and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlhfkit chat: error: '{FETCHED}' is not a folder, and the hub (http://127.0.0.1:9) is "
                           f"not reachable (ConnectError: ")
    assert last.endswith(f"run that, then pass {tmp_path / 'c' / 'models' / FETCHED}")


def test_a_name_the_hub_does_not_have_is_said_after_one_answer(tmp_path):
    """A hub that answers (here a stand-in on localhost) that it has no such repository: one line, not transformers'
    'not a valid model identifier' wrapped as a tokenizer error."""
    import http.server
    import threading

    class NoSuchRepo(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # what the hub answers for a repository that does not exist
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoSuchRepo)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{hub.server_port}"
    try:
        res = rlhfkit("sft", *sft_args(tmp_path, "gpt2"), env={**without_offline(), "HF_ENDPOINT": endpoint,
                                                                "RLHFKIT_CACHE_DIR": str(tmp_path / "c")})
    finally:
        hub.shutdown()
    assert res.returncode == 2 and "Retry" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"rlhfkit sft: error: config key 'model': 'gpt2' is not a folder, and the hub ({endpoint}) has no model of "
        f"that name (or it is private: log in with hf auth login): pass a model folder; rlhfkit fetch NAME makes one "
        f"(rlhfkit fetch smollm2-135m-instruct, then model={tmp_path / 'c' / 'models' / FETCHED})")
    assert not (tmp_path / "out").exists()


def test_transformers_offline_is_offline_too(tmp_path, tiny_model_dir):
    env = {**without_offline(), "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    res = rlhfkit("sft", *sft_args(tmp_path, "gpt2"), env=env)
    assert res.returncode == 2 and "Retry" not in res.stderr
    assert "config key 'model': 'gpt2' is not a folder, and HF_HUB_OFFLINE is set" in res.stderr.splitlines()[-1]


def test_a_model_in_the_hub_cache_loads_offline_and_is_named_when_the_hub_is_unreachable(tmp_path, tiny_model_dir):
    """A hub id whose copy is in huggingface_hub's cache is what HF_HUB_OFFLINE=1 is for: it trains (transformers
    reads the cache). Online with the hub unreachable, the downloads would wait on retries for every file: the
    line says to set HF_HUB_OFFLINE=1."""
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    env = {**without_offline(), "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    res = rlhfkit("sft", *sft_args(tmp_path, "org/tiny"), env={**env, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
    res = rlhfkit("sft", *sft_args(tmp_path, "org/tiny"), "output_dir=" + str(tmp_path / "out2"), env=env)
    assert res.returncode == 2 and "Retry" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("rlhfkit sft: error: config key 'model': 'org/tiny' is in the hub's cache, but the hub "
                           "(http://127.0.0.1:9) is not reachable (ConnectError: ")  # then the OS's words
    assert last.endswith("): put HF_HUB_OFFLINE=1 before the command to load the cached copy without waiting on "
                         "retries")
    assert not (tmp_path / "out2").exists()


# ---------------------------------------------------------------- a reward function the rows cannot call


@pytest.mark.parametrize("source,problem", [
    ("def score(prompts, responses, answer):",
     "takes a parameter 'answer' that the prompt rows do not have (they have: ground_truth, prompt): rename it to "
     "one of those, or give it a default"),
    ("def score(completions, ground_truth, **kwargs):",
     "gets the responses as its second parameter, 'ground_truth', and the prompt rows' field 'ground_truth' too: it "
     "is called as score(prompts, responses, ground_truth=..., prompt=...)"),
    ("def score(responses):",
     "takes 1 positional parameter, but is called as score(prompts, responses)"),
])
def test_a_reward_function_with_the_wrong_signature_fails_before_any_model_loads(tmp_path, tiny_model_dir, capsys,
                                                                                   source, problem):
    reward = tmp_path / "my_reward.py"
    reward.write_text(f"import math\n\n\n{source}\n    return [0.0 for _ in prompts]\n")
    code, line, seconds = run(capsys, "ppo", ppo_args(tmp_path, tiny_model_dir, f"{reward}:score"))
    assert code == 2
    assert line == f"rlhfkit ppo: error: reward function 'score' ({reward}:4) {problem}"
    assert seconds < 5  # before the actor loads and generates
    assert not (tmp_path / "out").exists()


def test_an_error_inside_the_reward_points_at_the_users_line(tmp_path, tiny_model_dir, capsys):
    """Raised in a library the user's function called: the line named is the user's call, not json's nor rlhfkit's."""
    reward = tmp_path / "my_reward.py"
    reward.write_text("import json\n\n\ndef score(prompts, responses):\n    return json.loads(responses[0])\n")
    code, line, _ = run(capsys, "ppo", ppo_args(tmp_path, tiny_model_dir, f"{reward}:score"))
    assert code == 2 and line.startswith(f"rlhfkit ppo: error: reward '{reward}:score' raised JSONDecodeError: ")
    assert line.endswith(f"(at {reward}:5 in score)")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- an output folder that holds a finished run


def test_a_finished_output_folder_is_refused_before_the_data_is_read(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "out" / "final").mkdir(parents=True)
    (tmp_path / "out" / "final" / "model.safetensors").write_bytes(b"weights of a finished run")
    code, line, seconds = run(capsys, "sft", sft_args(tmp_path, tiny_model_dir))
    assert code == 2 and seconds < 5
    assert line == (f"rlhfkit sft: error: output_dir '{tmp_path / 'out'}' already holds a finished run (final/ "
                    f"exists): pass --force to overwrite it, --resume to continue from its checkpoints, or choose "
                    f"another output_dir")
    assert not (tmp_path / "cache").exists()  # refused before the rows were tokenised (and cached)
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["final", "model.safetensors"]
    code, _, _ = run(capsys, "sft", sft_args(tmp_path, tiny_model_dir) + ["--force"])  # --force still replaces it
    assert code == 0 and (tmp_path / "out" / "final" / "config.json").is_file()


def test_eval_judge_mistakes_fail_before_any_model_loads(tmp_path, tiny_model_dir, capsys):
    """A misspelt judge function is named as the judge, before the actor loads; a judge with no held-out prompts
    to judge is refused as well (ppo_args' data.eval_fraction=0: no evaluation)."""
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(prompts, responses):\n    return [0.0 for _ in prompts]\n")
    code, line, seconds = run(capsys, "ppo", ppo_args(tmp_path, tiny_model_dir, f"{reward}:score")
                              + [f"eval.judge={reward}:gold", "data.eval_fraction=0.2"])
    assert code == 2 and seconds < 5 and not (tmp_path / "out").exists()
    assert line == f"rlhfkit ppo: error: eval.judge '{reward}:gold': '{reward}' has no function 'gold'"
    code, line, _ = run(capsys, "ppo", ppo_args(tmp_path, tiny_model_dir, f"{reward}:score")
                        + [f"eval.judge={reward}:score"])
    assert code == 2 and not (tmp_path / "out").exists()
    assert line == ("rlhfkit ppo: error: config key 'eval.judge': the judge scores the held-out prompts, and this run "
                    "has none (data.eval_prompts, data.eval_max_rows)")
