"""docs/newcomer-mistakes.md's tables typed as written: each row's command through bash, on the files of
docs/own-data.md (field names of their own) and a tiny model as `$MODEL`; the exit code and the message (the
last stderr line for an error, a log line for a note) must be the table's, `...` matching anything."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NAMES, ROOT, write_jsonl

PAGE = ROOT / "docs" / "newcomer-mistakes.md"
ROW = re.compile(r"^\| (?P<mistake>[^|]+) \| `(?P<typed>[^`]+)`[^|]* \| `(?P<message>[^`]+)` \| (?P<exit>\d) \|$")


def table_rows() -> list[dict]:
    rows = [m.groupdict() for line in PAGE.read_text(encoding="utf-8").splitlines() if (m := ROW.match(line))]
    assert len(rows) >= 12, "the page's rows did not parse"
    return rows


def as_pattern(message: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in message.split("...")))


@pytest.fixture
def first_hour(tiny_model_dir, tmp_path) -> Path:
    """The own-data page's files, with the wrong reward parameter the table's row names."""
    write_jsonl(tmp_path / "sft.jsonl", [{"question": f"say {n}", "answer": f"{n} {n} {n}"} for n in NAMES])
    write_jsonl(tmp_path / "pairs.jsonl", [{"question": f"say {n}", "better": f"{n} {n} {n}", "worse": "no"}
                                           for n in NAMES])
    write_jsonl(tmp_path / "prompts.jsonl", [{"question": f"say {n}", "keyword": n} for n in NAMES])
    (tmp_path / "reward.py").write_text("def pirate(prompts, responses, answer):\n"
                                        "    return [float(a in r) for r, a in zip(responses, answer)]\n")
    return tmp_path


@pytest.mark.parametrize("row", table_rows(), ids=lambda row: row["mistake"][:50])
def test_each_newcomer_mistake_gives_the_tables_message_and_exit_code(row, first_hour, tiny_model_dir):
    env = dict(os.environ, MODEL=str(tiny_model_dir), RLHFKIT_CACHE_DIR=str(first_hour / "cache"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(ROOT / "src"))
    if "runs/done" in row["typed"]:  # a finished run first, by the same command
        done = subprocess.run(["bash", "-c", row["typed"] + " train.max_steps=1"], cwd=first_hour, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (first_hour / "runs" / "done" / "final").is_dir()
    before = sorted(p.relative_to(first_hour) for p in first_hour.rglob("*") if "cache" not in p.parts)
    proc = subprocess.run(["bash", "-c", row["typed"]], cwd=first_hour, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == int(row["exit"]), proc.stderr[-3000:]
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith("rlhfkit "), lines[-1]
        assert as_pattern(row["message"]).fullmatch(lines[-1].split(": error: ", 1)[1]), lines[-1]
        assert "Traceback" not in proc.stderr
        after = sorted(p.relative_to(first_hour) for p in first_hour.rglob("*") if "cache" not in p.parts)
        assert after == before, "an error wrote files"
    else:
        assert any(as_pattern(row["message"]).fullmatch(line) for line in proc.stderr.splitlines()), proc.stderr
        assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 2
