"""`rlhfkit checkpoints RUN_DIR [--quick] [--use CHECKPOINT]`: a run's checkpoints checked against their manifests
(engine/manifest.py), as a table; --use points `latest` at one."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhfkit.engine.manifest import status_rows, use_checkpoint
from rlhfkit.errors import RunError
from rlhfkit.run_files import CHECKPOINTS_DIR, LATEST_POINTER


def add_parser(sub, verb: str, summary: str) -> argparse.ArgumentParser:
    p = sub.add_parser(verb, help=summary,
                       description="list a run's checkpoints (step, ranks, ZeRO stage, size) and verify each "
                                   "against its manifest.json (sizes and sha256); exit 1 when one is damaged")
    p.add_argument("run_dir", help="a run's output_dir (or its checkpoints/ folder)")
    p.add_argument("--quick", action="store_true", help="check sizes only, not sha256 hashes")
    p.add_argument("--use", metavar="CHECKPOINT", help="point `latest` at this checkpoint (step-00000040 or 40) "
                                                       "if it verifies, so that --resume continues from it")
    return p


def main(args) -> int:
    """A table of the run's checkpoints with their step, ranks, ZeRO stage, size and status; exit 1 when one is
    damaged or `latest` names none (with --use: when the checkpoint it switched to is)."""
    folder = _checkpoints_folder(Path(args.run_dir))
    if not folder.is_dir():
        print(f"rlhfkit checkpoints: error: no checkpoints folder in '{args.run_dir}'", file=sys.stderr)
        return 2
    if args.use:
        try:
            print(use_checkpoint(folder, args.use))
        except RunError as exc:
            print(f"rlhfkit checkpoints: error: {exc}", file=sys.stderr)
            return 2
    pointer = folder / LATEST_POINTER
    latest = pointer.read_text().strip() if pointer.is_file() else None
    rows = status_rows(folder, hashes=not args.quick)
    print(f"checkpoints in {folder} ({'sizes' if args.quick else 'sizes and sha256'} checked against each "
          f"manifest)")
    print(f"  {'checkpoint':<18} {'step':>8} {'ranks':>5} {'zero':>4} {'size':>9}  status")
    for row in rows:
        mark = "*" if row["name"] == latest else " "
        cells = [str(row[k]) if row[k] is not None else "-" for k in ("step", "world_size", "zero_stage")]
        print(f"{mark} {row['name']:<18} {cells[0]:>8} {cells[1]:>5} {cells[2]:>4} {_size(row['size']):>9}  "
              f"{row['status']}")
    missing = latest is not None and not (folder / latest).is_dir()
    print(f"* latest: {latest}{' (MISSING)' if missing else ''}" if latest else "no 'latest' pointer: "
          "--resume has nothing to load")
    if args.use:  # the switch succeeded: the exit says whether what --resume loads now is sound
        return 1 if missing or not all(row["ok"] for row in rows if row["name"] == latest) else 0
    return 1 if missing or not all(row["ok"] for row in rows) else 0


def _checkpoints_folder(run_dir: Path) -> Path:
    """RUN_DIR's checkpoints/, or RUN_DIR itself when it is one (it holds `latest`, or has the name)."""
    return run_dir if (run_dir / LATEST_POINTER).is_file() or run_dir.name == CHECKPOINTS_DIR \
        else run_dir / CHECKPOINTS_DIR


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
