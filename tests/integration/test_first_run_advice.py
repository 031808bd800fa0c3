"""A new user's first runs (issue 51), through the CLI on the tiny models: what the log says where a setting runs
but may not do what was meant (LoRA at a full fine-tuning rate, an eval split of a row or two, a chat template's
own system prompt), what PPO's numbers mean and how long the run takes, and the third-party noise it no longer
prints."""

from __future__ import annotations

import json
import re
import shutil

import yaml

from conftest import NAMES, read_metrics, run_cli, sft_rows, write_jsonl

# printed by transformers (peft reads its deprecated name) and DeepSpeed (imported by save_pretrained) on every run
NOISE = ("is_gradient_checkpointing", "Setting accelerator to CPU")
LORA_NOTE = "note: LoRA (lora.rank=8) at train.lr=1e-05, a full fine-tuning rate"
# the SmolLM2 template's shape: its own system turn where the conversation has none
SYSTEM_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                   "{{ '<|im_start|>system\\nYou are a helpful AI assistant named Tiny, trained by the tests"
                   "<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                   "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}")


def lines_with(text: str, part: str) -> list[str]:
    return [line for line in text.splitlines() if part in line]


def test_lora_at_a_full_fine_tuning_rate_is_noted_once_and_third_party_noise_is_gone(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    common = ("sft", f"model={tiny_model_dir}", f"data.train={data}", "train.max_steps=2", "train.batch_size=8",
              "lora.rank=8", "log.tensorboard=false")
    res = run_cli(*common, f"output_dir={tmp_path / 'default_lr'}")
    assert res.returncode == 0, res.stderr[-3000:]
    notes = lines_with(res.stderr, "note: LoRA")
    assert len(notes) == 1 and notes[0].startswith(LORA_NOTE) and notes[0].endswith("e.g. train.lr=1e-4"), notes
    # the note changes nothing: the run and its config.yaml keep the rate it was given
    assert yaml.safe_load((tmp_path / "default_lr" / "config.yaml").read_text())["train"]["lr"] == 1e-5
    for noise in NOISE:
        assert noise not in res.stderr + res.stdout, noise

    # the rate the note suggests, pasted: no note
    res = run_cli(*common, "train.lr=1e-4", f"output_dir={tmp_path / 'lora_lr'}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not lines_with(res.stderr, "note: LoRA"), res.stderr[-2000:]


def test_dpo_and_rm_on_twenty_pairs_say_their_automatic_eval_split_is_one_pair(tmp_path, tiny_model_dir):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"say {n}", "chosen": f"{n} {n} {n}",
                                                     "rejected": f"{n}"} for n in NAMES])
    res = run_cli("dpo", f"model={tiny_model_dir}", f"data.train={pairs}", f"output_dir={tmp_path / 'dpo'}",
                  "train.max_steps=2", "train.batch_size=4", "lora.rank=8", "log.tensorboard=false")
    assert res.returncode == 0, res.stderr[-3000:]
    notes = lines_with(res.stderr, "data: evaluation on")
    assert notes == ["data: evaluation on 1 row only, held out by data.eval_fraction=0.05 of 20: eval metrics over "
                     "fewer than 10 rows mean little (one row is 100% of every eval mean); set data.eval=PATH "
                     "(rows of your own), data.eval_fraction=0.5 (holds out 10 of 20), or data.eval_fraction=0 for "
                     "no evaluation"], res.stderr[-3000:]
    assert len(lines_with(res.stderr, LORA_NOTE)) == 1  # dpo notes LoRA's rate too, and so does rm
    res = run_cli("rm", f"model={tiny_model_dir}", f"data.train={pairs}", f"output_dir={tmp_path / 'rm'}",
                  "train.max_steps=1", "train.batch_size=4", "lora.rank=8", "rm.norm_samples=0",
                  "log.tensorboard=false")
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(lines_with(res.stderr, LORA_NOTE)) == 1 and len(lines_with(res.stderr, "data: evaluation on")) == 1


def test_a_chat_templates_own_system_prompt_is_said_once(tmp_path, tiny_model_dir):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": SYSTEM_TEMPLATE}))
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    res = run_cli("sft", f"model={model}", f"data.train={data}", f"output_dir={tmp_path / 'run'}",
                  "train.max_steps=1", "train.batch_size=8", "log.tensorboard=false")
    assert res.returncode == 0, res.stderr[-3000:]
    said = lines_with(res.stderr, "system prompt")
    assert said == ["data: the chat template adds its own system prompt to every row without a system turn: 'You "
                    "are a helpful AI assistant named Tiny, trained by the tests'; to use another, give the rows one "
                    "(a first message {\"role\": \"system\", \"content\": ...} in \"messages\", or a \"system\" "
                    "field in alpaca and sharegpt rows), or data.template=plain for no chat template"], said


def test_ppo_says_what_its_kl_is_previews_the_start_of_prompts_and_says_its_pace(tmp_path, tiny_model_dir):
    question = ("Name a primary colour and say in a few words why painters call it one, and which two colours "
                "mix into green; then say")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{question} {n}"} for n in NAMES])
    (tmp_path / "rewards.py").write_text("def short(prompts, responses):\n"
                                         "    return [-len(r.split()) / 8 for r in responses]\n")
    res = run_cli("ppo", f"actor={tiny_model_dir}", "reward=rewards.py:short", f"data.prompts={prompts}",
                  f"output_dir={tmp_path / 'ppo'}", "train.max_steps=2", "train.batch_size=4",
                  "gen.max_new_tokens=8", "ppo.sample_every=1", "lora.rank=8", "log.tensorboard=false", cwd=tmp_path,
                  env={"RLHFKIT_NO_BAR": "0"})  # the progress as a user gets it
    assert res.returncode == 0, res.stderr[-3000:]
    kl = lines_with(res.stderr, "kl (bar, metrics.jsonl)")
    assert kl == ["kl (bar, metrics.jsonl): k1 = log pi - log pi_ref, summed over each response's tokens, averaged "
                  "over the responses, in nats; unbiased, and below 0 (the true KL cannot be) where it is near 0, as "
                  "at the start: noise (docs/ppo.md)"], kl
    # stderr is a pipe here, as a redirected log: plain lines, no bar redrawn into it, no library bars' fragments
    assert "\r" not in res.stderr and "\x1b[" not in res.stderr and "Writing model shards" not in res.stderr
    progress = [line for line in res.stderr.splitlines() if line.startswith("ppo 1/2 ") or line.startswith("ppo 2/2 ")]
    assert len(progress) == 2 and progress[1].startswith("ppo 2/2 (100%), ") and "kl=" in progress[1], progress
    assert max(map(len, res.stderr.splitlines())) <= 300  # the speed plan and the kl note included
    # the row's own prompt, longer than the preview: its start and its end (the question's last words) are kept
    preview = next(line for line in res.stderr.splitlines() if line.startswith("[1] "))
    assert re.match(rf"\[1\] '{question[:40]}.* \.\.\. .*then say ({'|'.join(NAMES)})' -> ", preview), preview
    pace = lines_with(res.stderr, "ppo: iteration 1 of 2 took")
    assert len(pace) == 1 and "; 1 more at this pace: about " in pace[0] and "generate" in pace[0], pace
    assert len(lines_with(res.stderr, LORA_NOTE)) == 1


def test_the_end_of_a_run_says_what_it_learned_or_why_it_did_not(tmp_path, tiny_model_dir):
    """The last line above the result: each bar metric from its first logged value to its last; a held-out loss
    that did not move (here train.lr=0: the same eval rows give the same loss) says why it may not have."""
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    common = ("sft", f"model={tiny_model_dir}", f"data.train={data}", "train.max_steps=6", "train.batch_size=8",
              "data.eval_fraction=0.1", "log.tensorboard=false")
    res = run_cli(*common, "train.lr=3e-3", f"output_dir={tmp_path / 'trained'}")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "trained" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert lines_with(res.stderr, "sft: after") == [
        f"sft: after 6 steps: loss {losses[0]:.4g} -> {losses[-1]:.4g}, eval/loss {evals[0]:.4g} -> {evals[-1]:.4g}"]
    assert evals[-1] < 0.99 * evals[0]

    res = run_cli(*common, "train.lr=0", f"output_dir={tmp_path / 'still'}")
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = lines_with(res.stderr, "sft: after 6 steps")
    assert line.endswith("; the eval/loss barely moved (under 1%): a higher train.lr (LoRA trains at 1e-4 or more) "
                         "or more steps"), line


def test_responses_past_the_models_positions_are_counted_and_said(tmp_path, tiny_model_dir):
    """The tiny model reads 256 positions; prompts of ~250 tokens and 16 new tokens run past them: counted in
    response/past_context each iteration and said once, with what to lower."""
    long = " ".join(NAMES * 12)  # about 240 tokens of the tiny tokenizer
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{long} say {n}"} for n in NAMES[:8]])
    (tmp_path / "rewards.py").write_text("def short(prompts, responses):\n"
                                         "    return [-len(r.split()) / 8 for r in responses]\n")
    res = run_cli("ppo", f"actor={tiny_model_dir}", "reward=rewards.py:short", f"data.prompts={prompts}",
                  f"output_dir={tmp_path / 'ppo'}", "train.max_steps=2", "train.batch_size=4", "gen.max_new_tokens=16",
                  "gen.min_new_tokens=16", "data.eval_fraction=0", "log.tensorboard=false", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "ppo" / "metrics.jsonl") if "reward/mean" in r]
    assert all(r["response/past_context"] == 4 for r in rows), rows  # every response: 240 + 16 > 256
    said = lines_with(res.stderr, "ran past the model's 256 positions")
    assert said == ["past context: 4 of the 4 responses of iteration 1 ran past the model's 256 positions (prompt and "
                    "response together); lower data.max_prompt_length or gen.max_new_tokens. response/past_context "
                    "counts them every iteration"], said
