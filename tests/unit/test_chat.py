"""`rlhfkit chat`: answers through the training template, history, /reset, /quit, --compare, context trimming."""

import argparse
import io

import pytest
from transformers import AutoModelForSequenceClassification

from rlhfkit.chat import ChatModel, Conversation, interact, side_by_side
from rlhfkit.config import SFTConfig, load_config
from rlhfkit.stages.sft import run_sft

from conftest import run_cli, sft_rows, write_jsonl

GREEDY = argparse.Namespace(max_new_tokens=12, greedy=True, temperature=0.7, top_p=0.9)


@pytest.fixture(scope="module")
def echo_model(tmp_path_factory, tiny_model_dir):
    """The tiny model after a short SFT on "say X" -> "X X X" (plain template), in-process."""
    tmp = tmp_path_factory.mktemp("chat")
    data = write_jsonl(tmp / "train.jsonl", sft_rows())
    # a cosine decay to the end over 800 steps: the model settles on every name's answer (20 of 20, greedy) instead
    # of ending mid-swing at lr 1e-2, where float rounding of another CPU's kernels turned "river" into "tiger"
    # (500 steps: 19-20 of 20 on AMD hosts, 18 on an Intel one; 800: 20 of 20 there and with seeds 1-3)
    cfg = load_config(SFTConfig, None, [f"model={tiny_model_dir}", f"data.train={data}", f"output_dir={tmp / 'sft'}",
                                        "train.max_steps=800", "train.batch_size=8", "train.micro_batch_size=8",
                                        "train.lr=1e-2", "train.scheduler=cosine", "train.warmup_steps=20",
                                        "data.eval_fraction=0", "train.save_every=0", "log.tensorboard=false",
                                        "log.progress=false"])
    run_sft(cfg)
    return tmp / "sft" / "final"


def test_prompt_prints_the_answer_learned_through_the_template(echo_model):
    res = run_cli("chat", str(echo_model), "--prompt", "say river", "--greedy", "--max-new-tokens", "12")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "river river river"


def test_compare_shows_both_answers_side_by_side(echo_model, tiny_model_dir):
    res = run_cli("chat", str(echo_model), "--compare", str(tiny_model_dir), "--prompt", "say stone", "--greedy",
                  "--max-new-tokens", "12")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert str(echo_model)[-20:] in lines[0] and str(tiny_model_dir)[-20:] in lines[0]
    assert all(" | " in line or line.endswith(" |") for line in lines if line.strip())
    left = " ".join(line.split(" | ")[0] for line in lines[2:])
    assert "stone stone stone" in left  # the trained model's column; the right one is the untrained model


def test_sampling_flags_and_bad_values(echo_model):
    res = run_cli("chat", str(echo_model), "--prompt", "say honey", "--temperature", "0.3", "--top-p", "0.5",
                  "--seed", "1", "--max-new-tokens", "8")
    assert res.returncode == 0 and res.stdout.strip(), res.stderr
    res = run_cli("chat", str(echo_model), "--prompt", "hi", "--temperature", "0")
    assert res.returncode == 2 and "--temperature" in res.stderr


def test_an_answer_as_long_as_the_context_is_refused_and_a_cut_question_is_said(echo_model, capsys):
    """--max-new-tokens at the model's context left one token of the question, silently."""
    res = run_cli("chat", str(echo_model), "--prompt", "say river", "--max-new-tokens", "256")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"rlhfkit chat: error: --max-new-tokens 256 leaves no room for the conversation in '{echo_model}''s context "
        f"of 256 tokens: use fewer (at most 128 leaves it half)")
    model = ChatModel(str(echo_model))
    ids = model.prompt_ids([{"role": "user", "content": "say river " * 40}], max_new_tokens=250)
    assert len(ids) == 6
    assert capsys.readouterr().err.strip().endswith(
        f"more than the 6 that '{echo_model}''s context of 256 leaves beside --max-new-tokens 250: only its last 6 "
        f"are read")


def test_a_reward_model_folder_is_refused_with_a_hint(tmp_path, tiny_model_dir):
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    rm.save_pretrained(tmp_path / "rm")
    (tmp_path / "rm" / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "rm" / "tokenizer_config.json").write_bytes((tiny_model_dir / "tokenizer_config.json").read_bytes())
    res = run_cli("chat", str(tmp_path / "rm"), "--prompt", "hi")
    assert res.returncode == 2 and "reward model" in res.stderr and "rlhfkit score" in res.stderr


def test_interactive_keeps_history_resets_and_quits(echo_model):
    model = ChatModel(str(echo_model))
    seen, reply = [], model.reply
    model.reply = lambda messages, args: seen.append([m["content"] for m in messages]) or reply(messages, args)
    conv = Conversation([model], system=None)
    typed = iter(["say river", "", "say stone", "/reset", "say apple", "/quit", "never read"])
    out = io.StringIO()
    interact(conv, GREEDY, read=lambda _prompt: next(typed), out=out)
    assert next(typed) == "never read"  # /quit left the loop
    text = out.getvalue()
    assert "river river river" in text and "apple apple apple" in text and "(conversation reset)" in text
    # turn 2 is asked with turn 1 in the history; after /reset the history starts again (the empty line is skipped)
    assert seen[0] == ["say river"]
    assert seen[1][:3] == ["say river", "river river river", "say stone"] and len(seen[1]) == 3
    assert seen[2] == ["say apple"] and len(seen) == 3
    assert conv.histories[0] == [{"role": "user", "content": "say apple"},
                                 {"role": "assistant", "content": "apple apple apple"}]


def test_history_is_rendered_and_trimmed_to_the_context(echo_model):
    model = ChatModel(str(echo_model))
    history = [{"role": "system", "content": "be brief"}]
    for name in ("river", "stone", "cloud", "green"):
        history += [{"role": "user", "content": f"say {name}"}, {"role": "assistant", "content": f"{name} " * 3}]
    history.append({"role": "user", "content": "say tiger"})
    full = model.prompt_ids(history, max_new_tokens=8)
    text = model.tokenizer.decode(full)
    assert text.count("User:") == 5 and text.startswith("<s>System: be brief") and text.endswith("Assistant:")
    model.context = len(full) - 10 + 8  # room for all but the oldest exchange or so
    trimmed = model.tokenizer.decode(model.prompt_ids(history, max_new_tokens=8))
    assert "System: be brief" in trimmed and "say river" not in trimmed and "say tiger" in trimmed
    assert trimmed.endswith("Assistant:")


def test_side_by_side_wraps_both_columns():
    text = side_by_side("sft", "short", "ppo", "a much longer answer that needs wrapping", width=43)
    lines = text.splitlines()
    assert lines[0].startswith("sft") and "| ppo" in lines[0]
    assert lines[2].startswith("short") and all(len(line) <= 43 for line in lines)
    assert " ".join(line.split(" | ")[1] for line in lines[2:]) == "a much longer answer that needs wrapping"


def test_side_by_side_titles_stay_on_one_line_and_keep_their_ends():
    left, right = "/tmp/pytest-of-x/popen-gw0/chat0/sft/final", "/tmp/pytest-of-x/popen-gw0/chat0/ppo/final"
    lines = side_by_side(left, "one", right, "two", width=43).splitlines()
    col = (43 - 3) // 2  # 20 characters a column
    assert lines[0] == "…" + left[-19:] + " | " + "…" + right[-19:]  # "…0/chat0/sft/final" against ".../ppo/final"
    assert lines[1] == "-" * col + " | " + "-" * col
    assert lines[2].split(" | ") == ["one" + " " * (col - 3), "two"]


def test_a_template_without_system_messages_is_one_error_and_a_stopped_turn_is_dropped(echo_model, tmp_path):
    """--system with a chat template that refuses system messages (as Gemma's does): one error line and exit 2,
    not a traceback; interactively, a turn that the template refuses or that Ctrl-C stops is dropped from the
    history and the conversation goes on."""
    import shutil

    from rlhfkit.models import load_tokenizer

    folder = tmp_path / "no-system"
    shutil.copytree(echo_model, folder)
    tok = load_tokenizer(str(folder))
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                         "supported') }}{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(folder)
    res = run_cli("chat", str(folder), "--prompt", "hi", "--system", "be brief", "--template", "chat", "--greedy",
                  "--max-new-tokens", "4")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"rlhfkit chat: error: the chat template of '{folder}' refuses this conversation (it may not take --system's "
        f"system message): System role not supported")

    model = ChatModel(str(echo_model))
    reply, calls = model.reply, []

    def flaky(messages, args):  # the second question is stopped by Ctrl-C while it is being answered
        calls.append(len(messages))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return reply(messages, args)

    model.reply = flaky
    conv = Conversation([model], system=None)
    typed = iter(["say river", "say stone", "say apple", "/quit"])
    out = io.StringIO()
    interact(conv, GREEDY, read=lambda _prompt: next(typed), out=out)
    assert "(interrupted: that turn is dropped)" in out.getvalue()
    # the stopped turn left nothing behind: the third question follows the first answer
    assert [m["content"] for m in conv.histories[0]][:3] == ["say river", "river river river", "say apple"]
    assert len(conv.histories[0]) == 4 and calls == [1, 3, 3]
