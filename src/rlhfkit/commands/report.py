"""`rlhfkit report RUN_DIR [--title T]`: (re)draw a run's report.html from its metrics.jsonl (report/)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub, verb: str, summary: str) -> argparse.ArgumentParser:
    p = sub.add_parser(verb, help=summary,
                       description="write RUN_DIR/report.html: the curves of each stage's metrics.jsonl (plots/ "
                                   "PNGs beside it, a pipeline's steps in order), with no scripts or network "
                                   "(a finished run writes it by itself; this redraws it, e.g. during a run)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir (one stage's, or a pipeline's)")
    p.add_argument("--title", help="the page's title (default: summary.json's, else the folder's name)")
    return p


def main(args) -> int:
    """Write the report and print the path of report.html; one error line and exit 2 when it cannot be drawn."""
    from rlhfkit.report import write_report

    try:
        path = write_report(args.run_dir, title=args.title)
    except (OSError, ValueError) as err:  # no metrics.jsonl, a malformed file, a folder it cannot write to
        print(f"rlhfkit report: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0
