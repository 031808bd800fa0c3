"""docs/agents.md's example, run as written: its environment file and rows (the page's heredocs) and its
`rlhfkit ppo` command, on the test world's tiny SFT model in place of runs/demo/sft/final (at the tiny model's learning
rate, 5e-4); the episodes' reward rises (measured: the mean of the first five iterations 0.54, of the last five
0.76)."""

from __future__ import annotations

import re
import shlex

import pytest

from conftest import ROOT, read_metrics, run_cli

pytestmark = pytest.mark.slow


def heredocs(text: str) -> dict[str, str]:
    """{file name: content} of every `cat > NAME <<'EOF' ... EOF` on the page."""
    return {m.group(1): m.group(2) for m in re.finditer(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF\n", text, re.S)}


def test_the_agents_page_example_trains_as_written(ppo_world, tmp_path):
    text = (ROOT / "docs" / "agents.md").read_text()
    for name, content in heredocs(text).items():
        (tmp_path / name).write_text(content + "\n")
    assert {"two_asks.py", "asks.jsonl"} <= set(heredocs(text))
    command = re.search(r"^rlhfkit ppo (.*?)(?<!\\)\n", text.replace("\\\n", " "), re.M | re.S).group(1)
    args = [a.replace("runs/demo/sft/final", str(ppo_world / "sft" / "final")) for a in shlex.split(command)]
    proc = run_cli("ppo", *args, "log.tensorboard=false", "data.eval_fraction=0", "train.lr=5e-4",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "runs" / "agent" / "metrics.jsonl") if "reward/mean" in r]
    first, last = (sum(r["reward/mean"] for r in part) / len(part) for part in (rows[:5], rows[-5:]))
    assert last > first + 0.1, [round(r["reward/mean"], 3) for r in rows]
    assert rows[0]["episode/turns"] == pytest.approx(2.0)


def test_the_agents_page_play_example_prints_what_it_shows(tmp_path):
    """The "try it by hand" snippet, run in the folder of the page's files, prints the page's transcript."""
    import subprocess
    import sys

    text = (ROOT / "docs" / "agents.md").read_text()
    for name, content in heredocs(text).items():
        (tmp_path / name).write_text(content + "\n")
    snippet = re.search(r"```python\n(from rlhfkit.envs import play\n.*?)```", text, re.S).group(1)
    shown = re.search(r"```text\n(\[user\] .*?)```", text, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == shown, proc.stderr
