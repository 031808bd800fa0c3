"""docs/own-data.md run as written: its bash blocks, in order, in one shell, on SmolLM2-135M-Instruct.

The page is a new user's first hour (issue 51): rows typed by hand with field names of their own, SFT with LoRA,
DPO, GRPO with a ten-line reward function, and the reports. The test runs the page's text itself (nothing
copied into the test) and then checks what each step learned.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "own-data.md"


def bash_blocks(page: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.timeout(1800)  # a few minutes alone on 2 cores; beside other work, several times that
def test_the_own_data_walkthrough_runs_as_written_and_each_step_learns(smollm2, tmp_path):
    blocks = bash_blocks(PAGE)
    assert len(blocks) == 5, "the page's steps: set-up, sft, dpo, grpo, reports"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), RLHFKIT_NO_BAR="1")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(blocks)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "my-first-run" / "runs"
    log = proc.stdout + proc.stderr

    # SFT with LoRA at the page's learning rate: the loss fell and the greedy answer changed into the pirate's
    sft = [r["loss"] for r in metrics(out / "sft") if "loss" in r]
    assert sft[-1] < 0.5 * sft[0], sft
    # `chat --compare` prints the two answers side by side: the trained model's on the left of each "|"
    trained_side = " ".join(line.split("|")[0] for line in proc.stdout.splitlines() if "|" in line)
    assert re.search(r"\barr\b", trained_side.lower()), proc.stdout
    assert "adds its own system prompt" in log
    learned = r"^sft: after 20 steps: loss [\d.e+-]+ -> [\d.e+-]+$"  # the end says what it learned
    assert re.search(learned, log, flags=re.M), log[-3000:]

    # DPO: the implicit reward prefers the better answers by the end
    dpo = [r for r in metrics(out / "dpo") if "accuracy" in r]
    assert dpo and dpo[-1]["accuracy"] >= 0.75 and dpo[-1]["margin"] > dpo[0]["margin"], dpo

    # GRPO with the ten-line reward ran its iterations, scored by name
    grpo = [r for r in metrics(out / "grpo") if any(k.startswith("reward") for k in r)]
    assert len({r["step"] for r in grpo}) == 3, grpo

    # the reports say what ran
    for run, words in (("sft", ["sft", "lora"]), ("dpo", ["dpo", "sigmoid"]), ("grpo", ["grpo", "pirate"])):
        html = (out / run / "report.html").read_text(encoding="utf-8").lower()
        assert all(w in html for w in words), (run, words)
