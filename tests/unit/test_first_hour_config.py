"""Issue 51, a new user's first hour: dotted overrides typed the way people type them, one line per mistake, and
every hint the CLI prints pasteable as printed.

Each command line is split with `shlex.split`, which is what bash does (quote removal, word splitting) except brace
expansion; the brace-expanded lines are written out by hand."""

import re
import shlex

import pytest

from rlhfkit import cli
from rlhfkit.commands import train
from rlhfkit.config import ConfigError, SFTConfig, load_config, parse_overrides
from rlhfkit.data.formats import detect_format, renamed_columns

FIELDS = {"prompt": "question", "response": "answer"}


@pytest.fixture
def rlhfkit(monkeypatch, capsys):
    """`rlhfkit` as typed in bash: (exit code, stderr, the config the stage would have run with)."""
    seen = {}

    def record(cfg, **flags):
        seen["cfg"] = cfg
        return {}

    real_load = train._load
    monkeypatch.setattr(train, "_load", lambda path: record if path == train.TRAIN_VERBS["sft"][1] else real_load(path))

    def run(line, argv=None):
        words = shlex.split(line) if argv is None else argv
        assert words[0] == "rlhfkit"
        code = cli.main(words[1:])
        return code, capsys.readouterr().err, seen.pop("cfg", None)

    return run


@pytest.mark.parametrize("line, fields", [
    # the README's form pasted unquoted: bash splits it into four words
    ("rlhfkit sft model=m data.train=t data.fields={prompt: question, response: answer}", FIELDS),
    # Python-dict style unquoted: bash strips the single quotes, the same four words
    ("rlhfkit sft model=m data.train=t data.fields={'prompt': 'question', 'response': 'answer'}", FIELDS),
    ('rlhfkit sft model=m data.train=t "data.fields={prompt: question, response: answer}"', FIELDS),
    ("rlhfkit sft model=m data.train=t \"data.fields={'prompt': 'question', 'response': 'answer'}\"", FIELDS),
    ("rlhfkit sft model=m data.train=t 'data.fields={\"prompt\": \"question\", \"response\": \"answer\"}'", FIELDS),
    ('rlhfkit sft model=m data.train=t data.fields={"prompt": "question", "response": "answer"}', FIELDS),
    ("rlhfkit sft model=m data.train=t 'data.fields={\"prompt\":\"question\",\"response\":\"answer\"}'", FIELDS),
    # no space after the colon: YAML alone reads {'prompt:question': None}
    ("rlhfkit sft model=m data.train=t data.fields={prompt:question}", {"prompt": "question"}),
    ("rlhfkit sft model=m data.train=t 'data.fields={prompt:question, response:answer}'", FIELDS),
    # the split words around flags, either side
    ("rlhfkit sft --force model=m data.train=t data.fields={prompt: question, response: answer}", FIELDS),
    ("rlhfkit sft model=m data.fields={prompt: question, response: answer} --force data.train=t", FIELDS),
])
def test_a_mapping_override_parses_the_way_it_is_typed(rlhfkit, line, fields):
    code, err, cfg = rlhfkit(line)
    assert (code, err) == (0, "")
    assert cfg.data.fields == fields


@pytest.mark.parametrize("line, key, value", [
    ("rlhfkit sft model=m data.train=[a.jsonl, b.jsonl]", "data.train", ["a.jsonl", "b.jsonl"]),
    ("rlhfkit sft model=m data.train=t train.betas=[0.9, 0.99]", "train.betas", [0.9, 0.99]),
    ("rlhfkit sft model=m data.train=t 'data.split_fractions=[2, 4, 4]'", "data.split_fractions", [2, 4, 4]),
    ("rlhfkit sft model=m data.train=t data.split_fractions=[2,4,4]", "data.split_fractions", [2, 4, 4]),
])
def test_a_list_override_parses_the_way_it_is_typed(rlhfkit, line, key, value):
    code, err, cfg = rlhfkit(line)
    assert (code, err) == (0, "")
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == value


def test_nested_mappings_read_floats_and_unspaced_colons():
    assert parse_overrides(shlex.split("sft={train: {lr: 1e-5}}")) == {"sft": {"train": {"lr": 1e-5}}}
    assert parse_overrides(["sft={train:{lr:1e-5}}"]) == {"sft": {"train": {"lr": 1e-5}}}
    assert parse_overrides(["train.lr=1e-5"]) == {"train": {"lr": 1e-5}}


QUOTE = "quote the whole override so the shell keeps it one word"


# (the line as typed, bash's words where they differ from shlex.split's, the whole message after "error: ")
MISTAKES = [
    ("rlhfkit sft data.fields={prompt:question,response:answer}",
     ["rlhfkit", "sft", "data.fields=prompt:question", "data.fields=response:answer"],  # bash's brace expansion
     "override 'data.fields' arrived as 2 words (data.fields=prompt:question data.fields=response:answer): the "
     f"shell expanded its braces; {QUOTE}: 'data.fields={{prompt: question, response: answer}}'"),
    ("rlhfkit sft data.fields={'prompt':'question','response':'answer'}",
     ["rlhfkit", "sft", "data.fields=prompt:question", "data.fields=response:answer"],
     "override 'data.fields' arrived as 2 words (data.fields=prompt:question data.fields=response:answer): the "
     f"shell expanded its braces; {QUOTE}: 'data.fields={{prompt: question, response: answer}}'"),
    ("rlhfkit sft data.fields={prompt: question", None,
     f"override 'data.fields={{prompt: question' leaves a '{{' open; {QUOTE}: 'data.fields={{prompt: question}}'"),
    ("rlhfkit sft data.fields={prompt: question train.lr=1", None,
     f"override 'data.fields={{prompt: question' leaves a '{{' open; {QUOTE}: 'data.fields={{prompt: question}}'"),
    ("rlhfkit sft 'train.betas=[0.9, 0.99'", None,
     f"override 'train.betas=[0.9, 0.99' leaves a '[' open; {QUOTE}: 'train.betas=[0.9, 0.99]'"),
    ("rlhfkit sft 'data.fields={prompt: a: b}'", None,
     "override 'data.fields={prompt: a: b}': not valid YAML (expected ',' or '}', but got ':', column 11); "
     f"{QUOTE}, e.g. 'data.fields={{prompt: question, response: answer}}'"),
    ("rlhfkit sft 'train.lr=:'", None,
     "override 'train.lr=:': not valid YAML (expected <block end>, but found ':', column 1); "
     f"{QUOTE}, and a text value in double quotes inside it: 'train.lr=\":\"'"),
    ("rlhfkit sft data.fields=prompt:question", None,
     "config key 'data.fields': expected a mapping, got 'prompt:question'; write it in braces and "
     f"{QUOTE}: 'data.fields={{prompt: question}}'"),
    ("rlhfkit sft =5", None, "override '=5' has no key before '='"),
    ("rlhfkit sft a..b=1", None, "override 'a..b=1': the key 'a..b' has an empty part"),
    ("rlhfkit sft train.lr = 1e-5", None,
     "override 'train.lr' is not of the form dotted.key=value (one word, no spaces around '=')"),
    ("rlhfkit sft configs/sft.yaml", None,
     "override 'configs/sft.yaml' is not of the form dotted.key=value; a config file is passed as --config "
     "configs/sft.yaml"),
    ("rlhfkit sft train.max_step=3", None, "unknown config key 'train.max_step': did you mean 'train.max_steps'?"),
    ("rlhfkit sft model=m data.train=t modle=x", None, "unknown config key 'modle': did you mean 'model'?"),
    ("rlhfkit sft train.rank=8", None, "unknown config key 'train.rank': did you mean 'lora.rank'?"),
    ("rlhfkit sft rank=8", None, "unknown config key 'rank': did you mean 'lora.rank'?"),
    ("rlhfkit sft trian.lr=1", None, "unknown config key 'trian': did you mean 'train'?"),
    ("rlhfkit sft train.lrr=1", None, "unknown config key 'train.lrr': did you mean 'train.lr'?"),
    ("rlhfkit sft train.zzz=1", None,
     "unknown config key 'train.zzz' (known keys here: balance_micro_batches, batch_size, betas, epochs, "
     "eval_every, keep_checkpoints, log_every, lr, max_grad_norm, max_steps, micro_batch_size, min_lr_ratio, "
     "save_every, scheduler, seed, warmup_steps, weight_decay)"),
    ("rlhfkit sft model=m data.train=t train.lr=", None, "config key 'train.lr': expected float, got ''"),
]


@pytest.mark.parametrize("line, argv, message", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_an_override_mistake_is_one_line_and_exit_code_2(rlhfkit, line, argv, message):
    code, err, cfg = rlhfkit(line, argv)
    assert (code, err) == (2, f"rlhfkit sft: error: {message}\n")


def pasteable_overrides(text: str) -> list[str]:
    """The single-quoted overrides a message offers (`'key=value'`, after the override it echoes), as bash would
    read each."""
    offered = text.split(QUOTE)[-1]
    return [shlex.split(quoted)[0] for quoted in re.findall(r"'[\w.]+=[^']*'", offered)]


@pytest.mark.parametrize("line, argv, message", [m for m in MISTAKES if QUOTE in m[2] or "'data.fields=" in m[2]])
def test_the_quoting_hints_paste_as_printed(line, argv, message):
    for word in pasteable_overrides(message):
        key, _, _ = word.partition("=")
        value = parse_overrides([word])
        for part in key.split("."):
            value = value[part]
        assert isinstance(value, (dict, list, str)) and value != "", word


@pytest.mark.parametrize("row, task", [
    ({"question": "q", "answer": "a"}, "sft"),
    ({"text": "Once upon a time"}, "sft"),
    ({"prompt": "q", "completion": "a"}, "sft"),
    ({"question": "q"}, "prompt"),
    ({"question": "q", "better": "a", "worse": "b"}, "preference"),
])
def test_the_data_fields_hint_pastes_into_bash_and_fixes_the_rows(row, task):
    with pytest.raises(Exception) as info:
        detect_format(row, task)
    hints = pasteable_overrides(str(info.value))
    assert len(hints) == 1, str(info.value)
    cfg = load_config(SFTConfig, None, ["model=m", "data.train=t", *hints])
    assert isinstance(cfg.data.fields, dict) and cfg.data.fields
    if set(cfg.data.fields.values()) <= set(row):  # the example names this row's columns: it fixes the row
        detect_format(renamed_columns(row, cfg.data.fields), task)


@pytest.mark.parametrize("verb", list(train.EXAMPLES))
def test_the_help_examples_parse_as_printed(verb):
    words = shlex.split(train.EXAMPLES[verb])
    args, extra = cli.build_parser().parse_known_args(words[1:])
    assert args.verb == verb and all("=" in x for x in extra)
    config_cls = train._load(train.TRAIN_VERBS[verb][0])
    required = {"ppo": {"actor": "a", "reward": "r", "data": {"prompts": "p"}}, "pipeline": {}}
    load_config(config_cls, args.config, [*args.overrides, *extra],
                base=required.get(verb, {"model": "m", "data": {"train": "t"}}))


def test_every_key_value_a_message_in_src_suggests_is_a_config_key_and_parses():
    """A `key=value` in rlhfkit's source (error hints, help, examples) names a key some verb has (a pipeline step's
    `ppo.train.max_steps` included) and reads as one override."""
    from pathlib import Path

    from rlhfkit.config.fields import help_rows

    keys = {row[0] for _, (cls, _, _) in train.TRAIN_VERBS.items() for row in help_rows(train._load(cls))}
    pattern = re.compile(r"(?<![\w.{/])([a-z_]+(?:\.[a-z_]+)+)=([^\s,;)`'\"{\\]+)")
    src = Path(cli.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        for match in pattern.finditer(path.read_text(encoding="utf-8")):
            key = match.group(1)
            if key == "dotted.key" or match.group(2) == "...":  # placeholders
                continue
            step_key = key.split(".", 1)[1]  # a pipeline step's own section: ppo.train.max_steps
            assert key in keys or step_key in keys, f"{path.relative_to(src)}: {match.group(0)} names no config key"
            parse_overrides([match.group(0)])
            found.append(key)
    assert "data.on_long_prompt" in found and len(found) > 20


def test_a_verb_without_overrides_points_at_a_help_command_that_runs(capsys):
    with pytest.raises(SystemExit) as refused:
        cli.main(shlex.split("chat runs/x/final train.lr=1"))
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "rlhfkit chat takes no key=value overrides" in err
    suggested = re.search(r"see (rlhfkit [^)]*)\)", err).group(1)
    with pytest.raises(SystemExit) as helped:
        cli.main(shlex.split(suggested)[1:])
    assert helped.value.code == 0
