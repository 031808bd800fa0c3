"""The docs check: README.md and docs/*.md say what the code does, and every example runs on a user's machine.

- docs/configuration.md is exactly what `python -m rlhfkit.config.reference` prints (`make docs` rewrites it);
- every `rlhfkit ...` command in a fenced bash block parses with the CLI's own parser, and for the training verbs its
  config file and dotted overrides load and validate through `config.fields.load_config`, the code the CLI runs
  before any model loads (for `demo`: the demo's own config check). A `--config FILE` is a file the same page writes
  with a heredoc (`cat > FILE <<'EOF'`) or one under configs/. Nothing is trained: a command that needs a trained
  model is checked, not run;
- no page points at this project's test data (absent on a user's machine);
- every relative link points at a file that exists, and every #anchor at one of its headings.
Runs in a few seconds, without torch models.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from rlhfkit import cli
from rlhfkit.commands import train
from rlhfkit.config import reference
from rlhfkit.config.fields import help_rows, load_config
from rlhfkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
SHELL = {"bash", "sh", "shell", "console"}
TEST_DATA = ("../shared", "shared/data")  # this project's test data: users do not have it
SUBSTITUTED = "/docs-check/value"  # what $(...) and $VAR stand for: a path the user's shell would print

# Commands that cannot be validated, each with why (a prefix of the command after `rlhfkit`). Empty today: every
# command in the docs parses and validates. Keep it short: a new entry needs a reason the check cannot reach, not a
# reason the example is wrong. What the check does not reach by design, for every command: whether the model and
# data paths exist (most are written by an earlier command, or by `make demo`), the launcher's own flags (deepspeed,
# torchrun), and whether the run then trains well (the integration tests and the demo's bar do that).
ALLOWED: dict[str, str] = {}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------- reading the pages

def fenced_blocks(text: str) -> list[tuple[str, list[str], int]]:
    """(info string, lines, line number of the first line) of every fenced code block."""
    blocks, info, lines, start = [], None, [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if info is None:
                info, lines, start = line[3:].strip(), [], number + 1
            else:
                blocks.append((info, lines, start))
                info = None
        elif info is not None:
            lines.append(line)
    return blocks


def prose(text: str) -> str:
    """The page without its fenced blocks and inline code spans (where links and headings live)."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")


def shell_commands(page: Path) -> tuple[list[tuple[int, str]], dict[str, str]]:
    """The page's shell command lines (continuations joined, heredoc bodies left out), and {file name: content}
    of the files its heredocs write with `cat > NAME <<'EOF'`."""
    commands, written = [], {}
    for info, lines, start in fenced_blocks(page.read_text(encoding="utf-8")):
        if info.split(" ")[0] not in SHELL:
            continue
        i = 0
        while i < len(lines):
            number, line = start + i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            heredoc = HEREDOC.search(line)
            if heredoc:
                end = next((j for j in range(i, len(lines)) if lines[j].strip() == heredoc.group(2)), len(lines))
                target = re.match(r"\s*cat\s*>\s*(\S+)\s*<<", line)
                if target:
                    written[target.group(1)] = "\n".join(lines[i:end]) + "\n"
                i = end + 1
                line = line[:heredoc.start()]
            commands.append((number, line))
    return commands, written


def rlhfkit_argvs(line: str) -> list[list[str]]:
    """The argument lists of every `rlhfkit` invoked on one shell line (`rlhfkit ...`, `.venv/bin/rlhfkit ...`,
    `deepspeed ... --module rlhfkit ...`, `torchrun ... -m rlhfkit ...`, and inside `$(...)`)."""
    inner = re.findall(r"\$\(([^()]*)\)", line)
    line = re.sub(r"\$\([^()]*\)", SUBSTITUTED, line)
    line = re.sub(r"\$\{?[A-Za-z_]\w*\}?", SUBSTITUTED, line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    tokens = list(lexer)
    argvs, segment = [], []
    for token in tokens + [";"]:
        if token in ("&&", "||", ";", "|", "&"):
            argvs += _argv(segment)
            segment = []
        else:
            segment.append(token)
    for command in inner:
        argvs += rlhfkit_argvs(command)
    return argvs


def _argv(tokens: list[str]) -> list[list[str]]:
    for i, token in enumerate(tokens):
        if token == "rlhfkit" or token.endswith("/rlhfkit"):
            argv = tokens[i + 1:]
            for j, tok in enumerate(argv):  # a redirection ends the arguments
                if tok in (">", ">>", "<", "2>", "2>&1"):
                    argv = argv[:j]
                    break
            return [argv]
    return []


# ------------------------------------------------------------------------------------------ checking one command

def check_command(argv: list[str], written: dict[str, str], tmp: Path) -> None:
    """Raise AssertionError naming what is wrong with `rlhfkit ARGV`; return when it would start."""
    assert argv, "rlhfkit without a verb"
    parser = cli.build_parser()
    verbs = parser._subparsers._group_actions[0].choices  # the verbs `rlhfkit --help` lists
    assert argv[0] in verbs, f"no verb {argv[0]!r} (verbs: {', '.join(verbs)})"
    if "--help" in argv or "-h" in argv:
        return
    argv = list(argv)
    if "--config" in argv:
        at = argv.index("--config") + 1
        assert at < len(argv), "--config without a file"
        name = argv[at]
        if name in written:
            path = tmp / f"config-{len(list(tmp.iterdir()))}.yaml"
            path.write_text(written[name], encoding="utf-8")
            argv[at] = str(path)
        else:
            assert name.startswith("configs/") and (ROOT / name).is_file(), (
                f"--config {name}: neither written on this page (cat > {name} <<'EOF' ... EOF) nor a file under "
                f"configs/")
            argv[at] = str(ROOT / name)
    # the same parsing as cli.main: overrides may come before or after flags
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args, extra = parser.parse_known_args(argv)
    except SystemExit:
        raise AssertionError(f"the CLI refuses it: {stderr.getvalue().strip().splitlines()[-1]}") from None
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    assert not stray, f"unrecognized arguments: {' '.join(stray)}"
    assert not extra or hasattr(args, "overrides"), f"rlhfkit {args.verb} takes no key=value overrides: {extra}"
    overrides = list(getattr(args, "overrides", None) or []) + extra
    try:
        if args.verb in train.TRAIN_VERBS:
            load_config(train._load(train.TRAIN_VERBS[args.verb][0]), args.config, overrides)
        elif args.verb == "demo":
            check_demo(args, overrides)
    except ConfigError as exc:
        if "rollout.engine': vllm is not installed" in str(exc):
            return  # right as written, for a Python with the vllm extra (docs/vllm.md); this one has none
        raise AssertionError(f"rlhfkit {args.verb}: error: {exc}") from None


def check_demo(args, overrides: list[str]) -> None:
    """The demo's own check of its config with the user's overrides (what it runs before training anything)."""
    from rlhfkit.config.fields import deep_merge, from_dict, parse_overrides
    from rlhfkit.config.ppo_schema import PPOConfig

    if args.task == "calculator":
        from rlhfkit.config.schema import SFTConfig
        from rlhfkit.demo import agent_run

        size = agent_run.SIZES["quick" if args.quick else "full"]
        from_dict(SFTConfig, agent_run.sft_dict(Path(args.output), Path(SUBSTITUTED), size, args.seed))
        from_dict(PPOConfig, deep_merge(agent_run.ppo_dict(Path(args.output), size, args.seed),
                                        parse_overrides(overrides)))
        return
    if args.task:
        from rlhfkit.demo import task_run

        base = task_run.ppo_dict(Path(args.output), Path(SUBSTITUTED), args.task,
                                 task_run.SIZES["quick" if args.quick else "full"], args.seed, args.algo)
        from_dict(PPOConfig, deep_merge(base, parse_overrides(overrides)))
        return
    from rlhfkit.demo import run
    from rlhfkit.demo.arena import parse_algos

    algos = parse_algos(args.algos) if args.algos else []
    run.check_config(run.Demo(Path(args.output), run.SIZES["quick" if args.quick else "full"], args.seed, overrides,
                              args.early_stop, algos=algos))


def all_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    found = []
    for page in PAGES:
        commands, written = shell_commands(page)
        for number, line in commands:
            for argv in rlhfkit_argvs(line):
                found.append((f"{_rel(page)}:{number}", argv, written))
    return found


COMMANDS = all_commands()


# ------------------------------------------------------------------------------------------------------- the tests

def test_configuration_reference_is_current():
    page = ROOT / "docs" / "configuration.md"
    assert page.is_file(), f"docs/configuration.md is missing: run `make docs` ({reference.REGENERATE})"
    assert page.read_text(encoding="utf-8") == reference.reference_markdown(), (
        f"docs/configuration.md is stale (an option's doc, type, default or choices changed): regenerate it with "
        f"`make docs` or `{reference.REGENERATE}` and commit it")


def test_reference_covers_every_training_verb():
    assert list(reference.SECTIONS) == list(train.TRAIN_VERBS)
    for verb, (cls, _) in reference.SECTIONS.items():
        assert train._load(train.TRAIN_VERBS[verb][0]) is cls, verb


def test_the_docs_have_commands_to_check():
    verbs = {argv[0] for _, argv, _ in COMMANDS if argv}
    assert {"sft", "rm", "ppo", "dpo", "pipeline", "demo", "chat", "score", "report", "fetch"} <= verbs, verbs
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo" in readme or "rlhfkit demo" in readme  # what CI greps for


@pytest.mark.parametrize("where,argv,written", COMMANDS, ids=[f"{w} {' '.join(a[:1])}" for w, a, _ in COMMANDS])
def test_every_command_in_the_docs_would_start(where, argv, written, tmp_path):
    command = " ".join(argv)
    reason = next((why for prefix, why in ALLOWED.items() if command.startswith(prefix)), None)
    if reason:
        pytest.skip(f"allow-listed: {reason}")
    try:
        check_command(argv, written, tmp_path)
    except AssertionError as exc:
        raise AssertionError(f"{where}: `rlhfkit {command}`: {exc}") from None


def test_no_page_points_at_the_projects_test_data():
    bad = [f"{_rel(page)}:{number}: {line.strip()}" for page in PAGES
           for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
           if any(marker in line for marker in TEST_DATA)]
    assert not bad, ("these lines point at this project's test data, which users do not have; use what a user has "
                     "(rlhfkit fetch, the demo's runs/demo files, or files the page writes):\n" + "\n".join(bad))


def run_folders(page: Path) -> tuple[set[str], set[str]]:
    """(the runs/NAME folders the page's blocks make: output_dir=, --output, `rlhfkit demo`; those they use:
    runs/NAME/... as a path of its own, not inside another folder)."""
    text = "\n".join(line for info, lines, _ in fenced_blocks(page.read_text(encoding="utf-8"))
                     if info in SHELL | {"yaml", ""} for line in lines)
    made = set(re.findall(r"(?:output_dir[=:]\s*|--output\s+)runs/([\w.-]+)", text))
    if re.search(r"rlhfkit demo\b|make demo", text):
        made.add("demo")
    return made, set(re.findall(r"(?<![\w/])runs/([\w.-]+)/", text))


def test_every_run_folder_a_page_uses_says_where_it_comes_from():
    """A command that reads runs/sft/final works only after the command that writes it: a page either writes the
    folder itself or links a page that does (the demo's runs/demo*: demo.md or getting-started.md)."""
    folders = {page: run_folders(page) for page in PAGES}
    makers: dict[str, set[str]] = {}
    for page, (made, _) in folders.items():
        for name in made:
            makers.setdefault(name, set()).add(page.name)
    unsaid = []
    for page, (made, used) in folders.items():
        links = set(re.findall(r"\]\(([\w.-]+\.md)", page.read_text(encoding="utf-8")))
        for name in sorted(used - made):
            sources = {"demo.md", "getting-started.md"} if name.startswith("demo") else makers.get(name, set())
            if not sources & links:
                unsaid.append(f"{_rel(page)}: runs/{name}/ comes from {sorted(sources) or 'no page'}, which it does "
                              f"not link")
    assert not unsaid, "\n".join(unsaid)


def github_anchor(heading: str, seen: dict[str, int]) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return slug if count == 0 else f"{slug}-{count}"


def headings(page: Path) -> set[str]:
    """The anchors of the page's headings (outside code blocks)."""
    seen: dict[str, int] = {}
    out, inside = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        match = None if inside else re.match(r"#{1,6} (.+)", line)
        if match:
            out.add(github_anchor(match.group(1).replace("`", ""), seen))
    return out


def test_every_relative_link_points_at_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{_rel(page)}: {target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in headings(resolved):
                broken.append(f"{_rel(page)}: {target}: no heading with that anchor in {resolved.name}")
    assert not broken, "\n".join(broken)


# dotted names in backticks that look like config keys and are not: a typo a page shows being refused, a method
NOT_KEYS = {"ppo.ppo.kl_coeff": "pipeline.md shows this typo failing at once", "engine.prepare_frozen": "a method"}
SECTIONS = {"data", "train", "load", "lora", "engine", "log", "gen", "ppo", "ptx", "ema", "dpo", "rm"}


def test_every_config_key_the_docs_name_exists():
    """`ppo.kl_coef`, `data.max_length=64`, `ppo.ppo.kl_coef` (a pipeline section): a key that was renamed or removed
    leaves a page that tells users to set something that no longer exists."""
    keys = {row[0] for _, (cls, _) in reference.SECTIONS.items() for row in help_rows(cls)}
    stale = []
    for page in PAGES:
        for match in re.finditer(r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:=[^`]*)?`", page.read_text(encoding="utf-8")):
            key = match.group(1)
            if key.split(".")[0] not in SECTIONS or re.search(r"\.(py|yaml|json|jsonl|txt|md)$", key):
                continue
            known = key in keys or key.split(".", 1)[1] in keys or any(k.startswith(key + ".") for k in keys)
            if not known and key not in NOT_KEYS:
                stale.append(f"{_rel(page)}: `{key}`")
    assert not stale, "config keys the docs name that no verb has (renamed or removed?):\n" + "\n".join(stale)
