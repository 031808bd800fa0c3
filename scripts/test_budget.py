"""Each test tier's wall time against its budget, and its slowest tests (CI runs it after `make test`).

    python scripts/test_budget.py test-results/fast.xml test-results/real.xml test-results/vllm.xml [--strict]

Reads the JUnit XML files pytest writes (`make test` writes one per tier into test-results/: every test's duration,
kept with the run's output) and prints, per tier, its wall time against its budget and its ten slowest tests (their
call, setup and teardown together). With --strict it exits 1 when a tier is over its budget. A tier whose file is
missing (it did not run) is said so. The budgets: the whole of CI (three tiers) under 30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

BUDGET_MINUTES = {"fast": 14.0, "real": 10.0, "vllm": 5.0}
SLOWEST = 10


def tier_times(path: Path) -> tuple[float, dict[str, float]]:
    """(the tier's wall seconds, {test id: seconds}) from a JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    wall = sum(float(s.get("time", 0.0)) for s in suites)
    tests: dict[str, float] = defaultdict(float)
    for case in root.iter("testcase"):
        tests[f"{case.get('classname', '')}::{case.get('name', '')}"] += float(case.get("time", 0.0))
    return wall, dict(tests)


def report(paths: list[Path]) -> list[str]:
    """The tiers over budget; prints each tier's lines."""
    over = []
    for path in paths:
        tier = path.stem
        budget = BUDGET_MINUTES.get(tier)
        if not path.is_file():
            print(f"{tier}: no {path} (the tier did not run)")
            continue
        wall, tests = tier_times(path)
        minutes = wall / 60
        verdict = "" if budget is None else (f" (budget {budget:g} min: {'OVER' if minutes > budget else 'within'})")
        print(f"{tier}: {minutes:.1f} min, {len(tests)} tests, {sum(tests.values()) / 60:.1f} min of test time"
              f"{verdict}; the slowest:")
        for name, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:SLOWEST]:
            print(f"  {seconds:7.1f} s  {name}")
        if budget is not None and minutes > budget:
            over.append(tier)
    return over


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="JUnit XML files, one per tier, named TIER.xml")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a tier is over its budget")
    args = parser.parse_args(argv)
    over = report(args.files)
    if over:
        print(f"over budget: {', '.join(over)}")
    return 1 if over and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
