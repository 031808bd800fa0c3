"""`rlhfkit score RM_DIR --data FILE`: a reward model's accuracy on preference pairs, or the scores of responses.

- Preference data (any format `rlhfkit rm` reads) -> one JSON line on stdout: pairs, accuracy (r_c > r_r, a tie
  counts as wrong), mean chosen / rejected score, mean margin. With `--output`, also one line per pair.
- Prompt/response data (any SFT format) -> one JSON line per row in `--output` (required: data folders are
  often read-only and silently writing next to them would surprise), and a summary line on stdout.

Rows are rendered exactly as in training: the RM folder's own tokenizer, and the template and max_length that
`rlhfkit rm` recorded in final/config.json; the scoring itself is score.py's. Only argparse is imported at module
level so `rlhfkit score --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EPILOG = """\
data kinds (detected from the first row, or set with --format):
  preference rows ({prompt, chosen, rejected}, HH dialogues, chat pairs, SHP, WebGPT)
      -> prints {"pairs", "accuracy", "chosen", "rejected", "margin"}; --output FILE adds
         {"source", "line", "chosen_score", "rejected_score"} per pair
  prompt/response rows ({prompt, response}, {messages}, Alpaca)
      -> --output FILE (required) gets {"source", "line", "prompt", "response", "score"} per row
         (score is null for a row whose prompt alone exceeds --max-length); prints a summary line
  rows with nothing to score (an empty response, chosen the same as rejected, ...) are left out of both and
  counted in the summary's "skipped", by reason

examples:
  rlhfkit score runs/rm/final --data data/eval_pairs.jsonl
  rlhfkit score runs/rm/final --data samples.jsonl --output samples.scores.jsonl --batch-size 32
"""


def add_parser(sub, verb: str, summary: str) -> argparse.ArgumentParser:
    p = sub.add_parser(verb, help=summary, description=summary, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rm_dir", metavar="RM_DIR", help="a reward-model folder (an `rlhfkit rm` run's final/)")
    p.add_argument("--data", required=True, help="a .jsonl/.json/.parquet/.csv file, save_to_disk folder, hub or "
                                                 "seed-dataset name (read from its local copy when there is one)")
    p.add_argument("--output", help="JSONL of per-row scores (required for prompt/response data)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per forward pass (default 16)")
    p.add_argument("--max-length", type=int, help="tokens per sequence; default: the RM's training data.max_length")
    p.add_argument("--template", choices=("auto", "chat", "plain"),
                   help="prompt rendering; default: the one the RM was trained with")
    p.add_argument("--format", default="auto", help="row format name (default: auto-detected)")
    p.add_argument("--field", action="append", default=[], metavar="CANONICAL=COLUMN",
                   help="rename a column, e.g. --field prompt=question (repeatable)")
    p.add_argument("--split", help="split to score; default: the dataset's own eval split (a seed dataset's, or a "
                                   "test / validation split) when it has one, else train")
    p.add_argument("--local-dir", help="where local copies of hub datasets are (as data.local_dir; default "
                                       "$RLHFKIT_DATA_DIR)")
    return p


def _fields(items: list[str]) -> dict:
    from rlhfkit.errors import DataError

    pairs = [item.split("=", 1) for item in items]
    if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
        raise DataError(f"--field: expected CANONICAL=COLUMN, got {items}")
    return dict(pairs)


def _task(rows, fields: dict, fmt: str) -> str:
    """"preference" when the rows are pairs (they are tried first: SFT reads pairs too, as their chosen side)."""
    from rlhfkit.errors import DataError
    from rlhfkit.data.formats import FORMATS, detect_format, renamed_columns

    if fmt != "auto":
        return "preference" if fmt in FORMATS["preference"] else "sft"
    first = renamed_columns(rows[0].data, fields)
    try:
        detect_format(first, "preference")
        return "preference"
    except DataError:
        return "sft"


def _with_field_flags(exc):
    """A format error's `data.fields={...}` hint as this command's `--field` flags."""
    import re

    from rlhfkit.errors import DataError

    text = str(exc).replace("config key 'data.fields': ", "--field: ").replace("e.g. {response: answer}",
                                                                             "e.g. --field response=answer")
    hint = re.search(r"map columns with data\.fields, e\.g\. 'data\.fields=\{(.*)\}'$", text)
    if not hint:
        return DataError(text)
    flags = " ".join(f"--field {pair.replace(': ', '=', 1)}" for pair in hint.group(1).split(", "))
    return DataError(f"{text[:hint.start()]}map columns with --field, e.g. {flags}")


def _check_output(path: str | None) -> None:
    """--output checked before the model loads: a file in a folder that exists or can be made, and writable."""
    from rlhfkit.errors import RunError

    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise RunError(f"--output '{path}' is a folder: name a file, e.g. {target / 'scores.jsonl'}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(f"--output '{path}': cannot create its folder: {exc.strerror or exc}") from None
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise RunError(f"--output '{path}': not writable")


def _write_jsonl(path: str, records: list[dict]) -> None:
    """Written whole or not at all (a temporary file beside it, renamed)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    tmp.replace(target)


def run_score(args) -> dict:
    """The summary `rlhfkit score` prints; a DataError, ModelError or RunError naming the flag at fault."""
    import torch

    from rlhfkit.config.schema import LoadConfig
    from rlhfkit.errors import DataError
    from rlhfkit.data.formats import to_preference_examples, to_sft_examples
    from rlhfkit.data.loader import eval_split_of, format_and_fields
    from rlhfkit.data.presets import read_source, resolve_source
    from rlhfkit.data.templates import Template
    from rlhfkit.models import ModelError, load_scalar_model, load_tokenizer
    from rlhfkit.models.loading import has_trained_score_head
    from rlhfkit.score import score_pairs, score_responses
    from rlhfkit.stages.reward import END_IDS_KEY, MAX_LENGTH_KEY, TEMPLATE_KEY

    if args.batch_size < 1:
        raise DataError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_length is not None and args.max_length < 1:
        raise DataError(f"--max-length must be >= 1, got {args.max_length}")
    # 1. the data first (cheap), so a wrong file fails before a model is loaded
    fields = _fields(args.field)
    source = resolve_source(args.data, 1.0, None, args.local_dir)
    split = args.split or eval_split_of(source, "train") or "train"
    rows = read_source(source, split)
    fmt, fields = format_and_fields(source, args.format, fields)
    task = _task(rows, fields, fmt)
    if task == "sft" and not args.output:
        raise DataError(f"{args.data}: prompt/response rows get one score each: pass --output FILE for them")
    stats = {}
    try:
        examples = (to_preference_examples if task == "preference" else to_sft_examples)(rows, fields or None, fmt,
                                                                                          stats=stats)
    except DataError as exc:
        raise _with_field_flags(exc) from None
    skipped = {k: v for k, v in stats.items() if v and k != "empty_rejected"}  # rows left out, by reason
    if not examples:
        what = "pairs" if task == "preference" else "prompt/response rows"
        raise DataError(f"{args.data}: none of its {len(rows)} rows is one of the {what} there are to score "
                        f"(skipped: {', '.join(f'{k} {v}' for k, v in skipped.items()) or 'none'})")
    if not Path(args.rm_dir).is_dir():  # before --output's folder is made
        raise ModelError(f"RM_DIR '{args.rm_dir}' is not a folder: pass an `rlhfkit rm` run's final/ folder")
    _check_output(args.output)

    # 2. the reward model with its own tokenizer; refuse anything without a trained scalar head
    tokenizer = load_tokenizer(args.rm_dir)
    model = load_scalar_model(args.rm_dir, LoadConfig(), tokenizer)
    if not has_trained_score_head(model):
        raise ModelError(f"'{args.rm_dir}' is not a reward model (architectures: {model.config.architectures}); "
                         f"pass an `rlhfkit rm` run's final/ folder")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    try:
        template = Template.for_tokenizer(tokenizer, args.template or getattr(model.config, TEMPLATE_KEY, "auto"),
                                          getattr(model.config, END_IDS_KEY, None))
    except ValueError as exc:
        raise DataError(f"--template: {exc}") from None
    max_length = args.max_length or getattr(model.config, MAX_LENGTH_KEY, None) or 512

    # 3. score: accuracy for pairs, one score per row for prompt/response data
    if task == "preference":
        scores, summary = score_pairs(model, tokenizer, template, examples, max_length, args.batch_size, device)
        if not summary["pairs"]:
            raise DataError(f"{args.data}: none of its {len(examples)} pairs could be scored within max_length "
                            f"{max_length} tokens (each prompt at or over it, or chosen and rejected the same once "
                            f"cut): pass a larger --max-length")
        if args.output:
            _write_jsonl(args.output, [{"source": ex.source, "line": ex.line, "chosen_score": s and s[0],
                                        "rejected_score": s and s[1]} for ex, s in zip(examples, scores)])
        return {**summary, "split": split, "template": template.name, "max_length": max_length,
                **({"skipped": skipped} if skipped else {}), **({"output": args.output} if args.output else {})}
    scores = score_responses(model, tokenizer, template, examples, max_length, args.batch_size, device)
    if all(score is None for score in scores):
        raise DataError(f"{args.data}: none of its {len(examples)} rows could be scored within max_length "
                        f"{max_length} tokens (each prompt at or over it): pass a larger --max-length")
    _write_jsonl(args.output, [{"source": ex.source, "line": ex.line, "prompt": ex.prompt, "response": ex.response,
                                "score": s} for ex, s in zip(examples, scores)])
    valid = torch.tensor([s for s in scores if s is not None], dtype=torch.float64)
    return {"rows": len(examples), "split": split, "scored": len(valid),
            "mean": valid.mean().item() if len(valid) else None, "std": valid.std().item() if len(valid) > 1 else None,
            "template": template.name, "max_length": max_length, **({"skipped": skipped} if skipped else {}),
            "output": args.output}


def main(args) -> int:
    """Run `rlhfkit score`; print the summary as one JSON line, or one error line (exit 2)."""
    from rlhfkit.errors import USER_ERRORS

    try:
        result = run_score(args)
    except USER_ERRORS as exc:
        print(f"rlhfkit score: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
