"""What the code tool's sandbox costs per call (issue 63): milliseconds of wall time for a program that prints one
line, behind the kernel boundary with the audit hook (the default), the kernel boundary alone, the audit hook alone
(`episode.code_sandbox=hook`), and a bare `python -I -S -c` process as the floor that any separate process pays.

    .venv/bin/python benchmarks/bench_sandbox.py [--calls 40]

Each way runs --calls times after two warm-up calls, interleaved so that the machine's drift falls on all of them
alike; it prints the median and the 90th percentile.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from rlhfkit.tools import boundary, run_sandboxed

CODE = "print(6 * 7)"


def bare() -> None:
    subprocess.run([boundary.interpreter(), "-I", "-S", "-c", CODE], check=True, capture_output=True)


WAYS = {
    "bare python -I -S (the floor)": bare,
    "kernel boundary + audit hook (default)": lambda: run_sandboxed(CODE),
    "kernel boundary alone": lambda: run_sandboxed(CODE, audit_hook=False),
    "audit hook alone (code_sandbox=hook)": lambda: run_sandboxed(CODE, sandbox="hook"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    times = {name: [] for name in WAYS}
    for _ in range(2):
        for run in WAYS.values():
            run()
    for _ in range(args.calls):
        for name, run in WAYS.items():
            start = time.perf_counter()
            run()
            times[name].append(1000 * (time.perf_counter() - start))
    print(f"| way | median ms | p90 ms |\n|---|---|---|")
    for name, values in times.items():
        values.sort()
        print(f"| {name} | {statistics.median(values):.1f} | {values[int(0.9 * (len(values) - 1))]:.1f} |")


if __name__ == "__main__":
    main()
