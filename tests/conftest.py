"""Shared test fixtures: tiny locally built models and data, paths to the real files in ../shared/data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# 2 cores shared with other test workers: one thread per process keeps runs predictable
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RLHFKIT_NO_BAR", "1")
os.environ.setdefault("RLHFKIT_NO_REPORT", "1")  # the end-of-run report is tested where it is asserted on
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
STORIES = SHARED_DATA / "stories260K-hf"
ALPACA = SHARED_DATA / "sft" / "alpaca_en_demo.json"
HH = SHARED_DATA / "preference" / "hh-rlhf-helpful-online.test.jsonl.gz"

needs_shared = pytest.mark.skipif(not STORIES.is_dir(), reason="../shared/data is absent (real model and data)")

# A tiny world with a learnable rule: the response to "say NAME" is "NAME NAME NAME".
NAMES = ["apple", "river", "stone", "cloud", "green", "tiger", "music", "paper", "light", "honey",
         "ocean", "maple", "piano", "candy", "frost", "lemon", "zebra", "amber", "coral", "daisy"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def sft_rows() -> list[dict]:
    return [{"prompt": f"say {n}", "response": f"{n} {n} {n}"} for n in NAMES for _ in range(4)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a BPE tokenizer trained on the test world's text (no chat template)."""
    from rlhfkit.demo.tiny import build_tiny_llama, build_tokenizer, save_model_folder

    texts = [f"User: say {n}\n\nAssistant: {n} {n} {n}" for n in NAMES] * 5
    tok = build_tokenizer(texts, vocab_size=320)
    model = build_tiny_llama(len(tok), hidden=64, layers=2, heads=4)
    return save_model_folder(model, tok, tmp_path_factory.mktemp("tiny") / "model")


def sharpened(model, factor: float = 6.0):
    """`model` with every weight scaled by `factor`: a random tiny model's outputs then depend on the context,
    so a test can see one sequence leak into another (at init they are nearly uniform whatever it reads)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
    return model


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None):
    """Run `python -m rlhfkit ...` in a subprocess, as a user would; returns CompletedProcess."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "rlhfkit", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def assert_bars_passed(res, summary: dict) -> None:
    """A demo's bars all passed, but its wall-time bar, which the tests do not hold it to (time is measured in
    benchmarks/, and a loaded machine may be slow): the demo then exits 1 for that bar alone."""
    failed = [r["name"] for r in summary["rows"] if r["passed"] is False]
    assert set(failed) <= {"wall time, seconds"}, (failed, res.stdout[-3000:], res.stderr[-3000:])
    assert res.returncode == (1 if failed else 0), res.stdout[-3000:] + res.stderr[-3000:]
    assert bool(failed) != ("rlhfkit demo: every bar passed" in res.stdout)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def ppo_world(tiny_model_dir, tmp_path_factory) -> Path:
    """An SFT actor (trained in-process, ~5 s), prompts, held-out prompts, pretraining text, a reward file."""
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.schema import SFTConfig
    from rlhfkit.stages.sft import run_sft

    root = tmp_path_factory.mktemp("ppo_world")
    write_jsonl(root / "sft.jsonl", [{"prompt": f"say {n}", "response": " ".join([n] * k)}
                                     for n in NAMES for k in range(1, 5)])
    write_jsonl(root / "prompts.jsonl", [{"prompt": f"say {n}"} for n in NAMES[:16]] * 2)
    write_jsonl(root / "eval.jsonl", [{"prompt": f"say {n}"} for n in NAMES[16:]] * 8)
    (root / "ptx.txt").write_text("\n\n".join(f"User: say {n}\n\nAssistant: {n} {n}" for n in NAMES))
    (root / "rewards.py").write_text("def four_words(prompts, responses):\n"
                                     "    return [1 - abs(len(r.split()) - 4) / 4 for r in responses]\n")
    cfg = load_config(SFTConfig, None, [f"model={tiny_model_dir}", f"output_dir={root / 'sft'}",
                                        f"data.train={root / 'sft.jsonl'}", "data.eval_fraction=0",
                                        "train.max_steps=800", "train.batch_size=16", "train.micro_batch_size=16",
                                        "train.lr=3e-3", "train.eval_every=0", "log.tensorboard=false",
                                        # the starting model of every pinned RM/PPO curve: padded, the model's own
                                        # logits and modules, as they were recorded (packing's, the chunked loss's
                                        # and the lean modules' rounding differ by ~1e-6; 800 steps amplify it)
                                        "packing=false", "chunked_loss=false", "load.lean_activations=false"])
    run_sft(cfg)
    return root


# Loss curves pinned before a refactor (tests/fixtures/pinned_losses-*.json): a change meant to keep behaviour
# must reproduce them. RLHFKIT_RECORD_PINS=1 writes the current values instead of checking them (only for a
# change that is meant to alter the numbers, and said so in its commit, or for a CPU without pins yet).
FIXTURES = ROOT / "tests" / "fixtures"
# the pinned SFT and RM runs split each step's rows into micro-batches in order, as when they were recorded: the
# default length-balanced split (train.balance_micro_batches) sums the same gradient in another order
PLAIN_SPLIT = "train.balance_micro_batches=false"


def pins_file() -> Path:
    """The pins of this kind of CPU: its vendor and vector instruction set
    (`torch.backends.cpu.get_cpu_capability()`). AVX-512's and AVX2's kernels round differently, and so do the
    GEMMs an AMD CPU runs (oneDNN's, `accel.cpu_linear`) and an Intel one (MKL's); over tens of steps the curves
    part by more than the tolerance. `pinned_losses-<vendor>-<capability>.json`, e.g. `-AuthenticAMD-AVX512`,
    with `-onednn-all` where every training GEMM goes to oneDNN (`accel.cpu_linear.gemm_policy`: Zen 5)."""
    from rlhfkit.accel.cpu_linear import cpu_vendor, gemm_policy

    policy = gemm_policy()
    return FIXTURES / (f"pinned_losses-{cpu_vendor()}-{torch.backends.cpu.get_cpu_capability()}"
                       f"{'-' + policy if policy not in ('', 'onednn') else ''}.json")


def check_pinned(name: str, values: dict, tol: float = 1e-4) -> None:
    """`values`: {metric: [one value per logged step]}; each series must equal the pinned one within `tol`."""
    values = {key: [float(v) for v in series] for key, series in values.items()}
    assert all(series for series in values.values()), f"{name}: an empty series {values}"
    path = pins_file()
    pins = json.loads(path.read_text()) if path.is_file() else {}
    if os.environ.get("RLHFKIT_RECORD_PINS") == "1":
        pins[name] = values
        path.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
        return
    assert name in pins, (f"no pinned losses for {name!r} in {path} (this CPU's vendor and instruction set); "
                          f"record them with RLHFKIT_RECORD_PINS=1 at a commit whose curves are trusted")
    for key, series in pins[name].items():
        assert values.get(key) == pytest.approx(series, abs=tol, rel=tol), (name, key)


def series_of(rows: list[dict], *keys: str) -> dict:
    """{key: [value of each row that has it]} from metrics.jsonl rows."""
    return {key: [r[key] for r in rows if key in r and r[key] is not None] for key in keys}


def speed_plan(output: str) -> tuple[dict, dict]:
    """The first two log lines of a stage (`speed.registry.plan_line`), parsed: ({label: models it is on for ('' for
    a one-model stage)}, {label: why it is off}). Asserts that they are the first lines the stage's logger wrote."""
    lines = [line for line in output.splitlines() if line.startswith(("speed plan: ", "sft: ", "rm: ", "dpo: ",
                                                                       "ppo: "))]
    assert lines and lines[0].startswith("speed plan: on: ") and lines[1].startswith("speed plan: off: "), lines[:3]
    on_text, off_text = lines[0][len("speed plan: on: "):], lines[1][len("speed plan: off: "):]
    on = {}
    for group in on_text.split("; "):  # "actor, critic: A, B" (several models) or "A, B" (one)
        models, _, labels = group.rpartition(": ")
        on.update({label: models for label in labels.split(", ") if label != "none"})

    def entries(text: str) -> dict:
        out, depth, start = {}, 0, 0
        for i, c in enumerate(text + ","):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if c == "," and depth == 0:
                item = text[start:i].strip()
                start = i + 1
                if item and item != "none":
                    label, _, rest = item.partition(" (")
                    out[label] = rest[:-1] if rest else ""
        return out

    return on, entries(off_text)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, materialised once by `rlhfkit fetch` (the real-model and vLLM tiers); a skip where it
    cannot be, except under CI (`CI` set), where that fails."""
    from rlhfkit.errors import ModelError
    from rlhfkit.models.fetch import fetch

    try:
        return fetch("smollm2-135m-instruct", log=lambda line: None)
    except ModelError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2-135M-Instruct cannot be materialised here: {exc}")


@pytest.fixture(scope="session")
def task_files(tmp_path_factory) -> Path:
    """The arithmetic task's training prompts and 8 held-out ones (prompts.jsonl, eval.jsonl), for runs on SmolLM2."""
    from rlhfkit.demo.tasks import arithmetic_prompts

    root = tmp_path_factory.mktemp("smol_task")
    train, heldout = arithmetic_prompts(0)
    write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in train])
    write_jsonl(root / "eval.jsonl", [{"prompt": p} for p in heldout[:8]])
    return root
