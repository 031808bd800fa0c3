"""The first-run notes (issue 51) on their own: which chat templates add a system prompt of their own, when an
automatic eval split is too small and whether its pasted hint fixes it, what LoRA's rate note and PPO's pace and
KL lines say, and how a prompt preview is shortened. The CLI runs are in tests/integration/test_first_run_advice.py."""

from __future__ import annotations

import copy

import pytest

from rlhfkit.config import DataConfig
from rlhfkit.config.fields import help_rows
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.data.loader import MIN_EVAL_ROWS, load_stage_data
from rlhfkit.data.templates import Template
from rlhfkit.models import load_tokenizer
from rlhfkit.stages.advice import duration, kl_note, lora_rate_note, pace_line
from rlhfkit.stages.ppo_steps import prompt_preview, shorten_middle

from conftest import NAMES, write_jsonl

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# SmolLM2's: its own system turn when the conversation has none
WITH_SYSTEM = ("{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}<|im_start|>system\n"
               "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{% endif %}"
               "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 3.1's shape: a system header with its dates always, the conversation's system text after them
DATED = ("{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}<|system|>Today: "
         "26 Jul 2024\n\n{{ system }}<|end|>{% for m in messages if m['role'] != 'system' %}<|{{ m['role'] }}|>"
         "{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Gemma's shape: a system turn refused
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def with_template(tok, template: str | None):
    other = copy.deepcopy(tok)
    other.chat_template = template
    return other


@pytest.mark.parametrize("template, added", [
    (WITH_SYSTEM, "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    (CHATML, None), (DATED, None), (NO_SYSTEM, None), (None, None)])
def test_the_system_prompt_a_chat_template_adds_of_its_own(tok, template, added):
    assert Template.for_tokenizer(with_template(tok, template)).added_system_prompt() == added
    # data.template=plain renders no chat template, so nothing is added
    assert Template.for_tokenizer(with_template(tok, template), "plain").added_system_prompt() is None


def test_the_system_prompt_note_is_said_for_a_template_that_adds_one_only(tmp_path, tok, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"say {n}", "response": n} for n in NAMES])
    cfg = DataConfig(train=str(data), cache_dir=str(tmp_path / "cache"), eval_fraction=0.5)
    for template, said in ((WITH_SYSTEM, 1), (CHATML, 0), (None, 0)):
        for _ in ("miss", "hit"):  # said from the cache too
            load_stage_data("sft", cfg, with_template(tok, template), seed=0)
            lines = [line for line in capsys.readouterr().err.splitlines() if "system prompt" in line]
            assert len(lines) == said, (template, lines)
            assert all(": 'You are a helpful AI assistant named SmolLM, trained by Hugging Face'; " in line
                       for line in lines)


def test_a_tiny_automatic_eval_split_is_said_and_its_pasted_hint_silences_it(tmp_path, tok, capsys):
    rows = [{"prompt": f"say {n}", "chosen": f"{n} {n}", "rejected": n} for n in NAMES]  # 20 pairs
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)

    def load(**options) -> tuple[int, list[str]]:
        cfg = DataConfig(train=str(data), cache_dir=str(tmp_path / "cache"), **options)
        evals = load_stage_data("rm", cfg, tok, seed=0).eval
        return len(evals), [line for line in capsys.readouterr().err.splitlines() if "evaluation on" in line]

    assert load() == (1, ["data: evaluation on 1 row only, held out by data.eval_fraction=0.05 of 20: eval metrics "
                          "over fewer than 10 rows mean little (one row is 100% of every eval mean); set "
                          "data.eval=PATH (rows of your own), data.eval_fraction=0.5 (holds out 10 of 20), or "
                          "data.eval_fraction=0 for no evaluation"])
    assert load()[1]  # a cache hit says it too
    assert load(eval_fraction=0.5) == (MIN_EVAL_ROWS, [])  # the hint, pasted
    assert load(eval_fraction=0.0) == (0, [])
    assert load(eval_fraction=0.5, eval_max_rows=4) == (4, [])  # a cap the user chose
    cfg = DataConfig(train=str(data), cache_dir=str(tmp_path / "cache"), eval_fraction=0.5, eval_max_rows=4)
    for _ in ("miss", "hit"):  # but the rows it leaves out are counted and said, from the cache too
        assert load_stage_data("rm", cfg, tok, seed=0).info["eval_capped_from"] == 10
        assert "data: evaluation rows: 4 of 10 (data.eval_max_rows=4 keeps each evaluation quick; raise it to " \
               "evaluate on all of them)" in capsys.readouterr().err.splitlines()
    eval_file = write_jsonl(tmp_path / "eval.jsonl", rows[:3])
    assert load(eval=str(eval_file)) == (3, [])  # rows the user chose are theirs to judge
    # from 100 rows, 5 held out: the share that holds out 10 is offered
    many = write_jsonl(tmp_path / "many.jsonl", [{**row, "prompt": f"{row['prompt']} {k}"} for k in range(5)
                                                  for row in rows])
    cfg = DataConfig(train=str(many), cache_dir=str(tmp_path / "cache"))
    load_stage_data("rm", cfg, tok, seed=0)
    assert "data.eval_fraction=0.1 (holds out 10 of 100)" in capsys.readouterr().err


def test_lora_rate_note_below_the_floor_only():
    assert lora_rate_note(0, 1e-5) is None  # full fine-tuning
    assert lora_rate_note(8, 1e-4) is None and lora_rate_note(8, 5e-5) is None
    assert lora_rate_note(8, 1e-5) == (
        "note: LoRA (lora.rank=8) at train.lr=1e-05, a full fine-tuning rate: the adapters start at zero and barely "
        "move at it (the answers may stay the base model's); LoRA usually trains at 1e-4 to 2e-4, e.g. train.lr=1e-4")


def test_pace_line_and_durations():
    assert [duration(s) for s in (45.2, 89, 600, 5399, 12600)] == ["45 s", "89 s", "10 min", "90 min", "3.5 h"]
    phases = {"generate": 40.2, "reward": 0.1, "actor_update": 12.0, "reference": 3.0}
    assert pace_line("ppo", 1, 200, 61.53, phases) == (
        "ppo: iteration 1 of 200 took 61.5 s (generate 40.2 s, actor_update 12.0 s, reference 3.0 s); 199 more at "
        "this pace: about 3.4 h")
    assert pace_line("ppo", 3, 3, 2.0, {"generate": 1.5}).endswith("; the last one")


def test_the_kl_line_and_help_say_when_the_estimate_can_be_below_zero():
    assert "below 0 (the true KL cannot be)" in kl_note("k1")
    assert kl_note("k2").endswith("; biased, never below 0 (docs/ppo.md)")
    assert kl_note("k3").endswith("; unbiased, never below 0 (docs/ppo.md)")
    docs = {key: doc for key, _, _, doc in help_rows(PPOConfig)}
    assert "k1 = log pi - log pi_ref: unbiased, and below 0" in docs["ppo.kl_estimator"]
    assert "why it can be below 0: ppo.kl_estimator" in docs["ppo.kl_coef"]
    assert "a quick first try: gen.max_new_tokens=32 train.batch_size=4 train.max_steps=2" in \
        docs["gen.max_new_tokens"]


def test_a_preview_shows_the_rows_own_prompt_from_its_start():
    rendered = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\nName a primary color.<|im_end|>\n<|im_start|>assistant\n")
    # the question, not the template's system prompt and markup (before: the last 60 characters of `rendered`)
    assert prompt_preview([{"role": "user", "content": "Name a primary color."}], rendered) == "Name a primary color."
    turns = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a\nprimary color."}]
    assert prompt_preview(turns, rendered) == "system: Answer briefly. | user: Name a primary color."
    assert prompt_preview(None, "User: say apple\n\nAssistant:") == "User: say apple Assistant:"
    long = "Describe " + "a very long scene " * 10 + "then name a primary color."
    shown = prompt_preview([{"role": "user", "content": long}], "")
    assert len(shown) == 100 and shown.startswith("Describe a very long scene") and " ... " in shown
    assert shown.endswith("then name a primary color.")
    assert shorten_middle("abcdefghijkl", 11) == "abc ... jkl" and shorten_middle("abc", 3) == "abc"


def test_learned_line_names_each_bar_metric_and_a_loss_that_did_not_move():
    from rlhfkit.stages.advice import learned_line

    seen = {"loss": (2.0, 1.0), "accuracy": (0.5, 0.75), "lr": (1e-3, 0.0)}
    assert learned_line("rm", 10, seen, ("loss", "accuracy", "lr", "eval/accuracy")) == \
        "rm: after 10 steps: loss 2 -> 1, accuracy 0.5 -> 0.75"
    # the held-out loss decides when there is one; 1% of it is the line between moved and not
    still = {"loss": (2.0, 1.0), "eval/loss": (3.0, 2.98)}
    assert learned_line("sft", 1, still, ("loss", "eval/loss")).startswith(
        "sft: after 1 step: loss 2 -> 1, eval/loss 3 -> 2.98; the eval/loss barely moved (under 1%)")
    assert "barely" not in learned_line("sft", 1, {"eval/loss": (3.0, 2.96)}, ("eval/loss",))
    assert learned_line("ppo", 3, {"kl": (0.0, 0.1)}, ("reward/mean",)) is None
