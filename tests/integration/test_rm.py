"""`rlhfkit rm` and `rlhfkit score` end to end through the CLI, on tiny models and on the real HH pairs."""

from __future__ import annotations

import json
import shutil
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhfkit.cli import main as cli_main
from rlhfkit.data.templates import Template, encode_prompt, encode_response
from rlhfkit.data.tokenize import pad_sequences
from rlhfkit.models import load_scalar_model
from rlhfkit.models.forward import sequence_scores
from rlhfkit.models.plan import REFERENCE

from conftest import HH, NAMES, STORIES, needs_shared, read_metrics, run_cli, write_jsonl

# The learnable rule: the labellers prefer responses that contain the word "honey" (anywhere in the reply).
WORD = "honey"
OTHERS = [n for n in NAMES if n != WORD]


def rule_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        chosen = rng.sample(OTHERS, 2)
        chosen.insert(rng.randrange(3), WORD)
        rows.append({"prompt": f"say {rng.choice(NAMES)}", "chosen": " ".join(chosen),
                     "rejected": " ".join(rng.sample(OTHERS, 3))})
    return rows


TINY_RUN = ["train.batch_size=16", "train.micro_batch_size=8", "train.lr=1e-2", "train.eval_every=10",
            "train.save_every=0", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def rule_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rule")
    return write_jsonl(folder / "train.jsonl", rule_rows(256, 0)), write_jsonl(folder / "eval.jsonl", rule_rows(64, 1))


def train_rm(model_dir, data, out, *extra):
    train, evals = data
    proc = run_cli("rm", f"model={model_dir}", f"data.train={train}", f"data.eval={evals}", f"output_dir={out}",
                   *TINY_RUN, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def rule_run(tiny_model_dir, rule_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "run"
    result, metrics = train_rm(tiny_model_dir, rule_data, out, "train.max_steps=40")
    return out, result, metrics


def encode_rows(tok, template_name: str, rows: list[tuple[str, str]]) -> list[list[int]]:
    tpl = Template.for_tokenizer(tok, template_name)
    out = []
    for prompt, response in rows:
        messages = [{"role": "user", "content": prompt}]
        out.append(encode_prompt(tok, tpl.prompt(messages)) + encode_response(tok, tpl.response(messages, response)))
    return out


def plain_and_rlhfkit_scores(final, seqs: list[list[int]]):
    """Scores from plain transformers (right-padded batch, HF's own pooling) and from rlhfkit's reader."""
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.pad_token_id != tok.eos_token_id  # HF pools at the last non-pad id: only safe when pad != eos
    plain = AutoModelForSequenceClassification.from_pretrained(final).eval()
    ids = pad_sequences(seqs, tok.pad_token_id, "right")
    mask = pad_sequences([[1] * len(s) for s in seqs], 0, "right")
    ours = load_scalar_model(str(final)).eval()
    with torch.no_grad():
        hf = plain(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        single = torch.cat([plain(input_ids=torch.tensor([s])).logits.squeeze(-1) for s in seqs])
        mine = sequence_scores(ours, ids, mask, REFERENCE)
    return hf, single, mine


def test_rm_learns_a_rule_and_reports_held_out_accuracy(rule_run):
    out, result, metrics = rule_run
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 10, 20, 30, 40]  # step 0, every eval_every, and the end
    assert evals[-1]["eval/accuracy"] >= 0.9
    assert evals[-1]["eval/loss"] < 0.5 * evals[0]["eval/loss"]
    assert evals[-1]["eval/margin"] == pytest.approx(evals[-1]["eval/chosen"] - evals[-1]["eval/rejected"], abs=1e-5)
    steps = [m for m in metrics if "loss" in m]
    assert {"loss", "accuracy", "margin", "lr", "grad_norm"} <= set(steps[-1])
    assert steps[-1]["accuracy"] >= 0.9 and steps[-1]["loss"] < steps[0]["loss"]
    assert result["eval/accuracy"] == evals[-1]["eval/accuracy"] and result["train_rows"] == 256


def test_final_is_a_plain_reward_model_with_stats(rule_run, rule_data):
    out, result, _ = rule_run
    config = json.loads((out / "final" / "config.json").read_text())
    # transformers 5 writes id2label, from which num_labels is derived: one label = one scalar output
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert config["pad_token_id"] == 0 and config["rlhfkit_template"] == "plain"
    assert config["rlhfkit_reward_samples"] == 512 and config["rlhfkit_reward_std"] > 0
    rows = [json.loads(line) for line in rule_data[1].read_text().splitlines()][:6]
    tok = AutoTokenizer.from_pretrained(out / "final")
    seqs = encode_rows(tok, "plain", [(r["prompt"], r["chosen"]) for r in rows] +
                       [(r["prompt"], r["rejected"]) for r in rows])
    hf, single, mine = plain_and_rlhfkit_scores(out / "final", seqs)
    torch.testing.assert_close(hf, mine, atol=1e-5, rtol=0)
    torch.testing.assert_close(single, mine, atol=1e-5, rtol=0)
    assert (mine[:6] > mine[6:]).all()  # the learnt rule, seen by plain transformers too


def score_in_process(capsys, *args: str) -> tuple[int, dict | None, str]:
    """`rlhfkit score` through the same entry point, in this process (saves a Python start per call)."""
    code = cli_main(["score", *args])
    captured = capsys.readouterr()
    return code, json.loads(captured.out.strip().splitlines()[-1]) if code == 0 else None, captured.err


def test_score_agrees_with_training_eval(rule_run, rule_data, tmp_path, capsys):
    out, result, _ = rule_run
    proc = run_cli("score", str(out / "final"), "--data", str(rule_data[1]), "--batch-size", "5",
                   "--output", str(tmp_path / "pairs.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["pairs"] == 64 and summary["accuracy"] == result["eval/accuracy"]
    for key in ("chosen", "rejected", "margin"):
        assert summary[key] == pytest.approx(result[f"eval/{key}"], abs=1e-4)
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]

    # a seed dataset by name is read from its local copy, at its own test split (here the same 64 eval pairs)
    copy = tmp_path / "datasets" / "Dahoas" / "rm-static"
    copy.mkdir(parents=True)
    shutil.copy(rule_data[0], copy / "train.jsonl")
    shutil.copy(rule_data[1], copy / "test.jsonl")
    code, named, err = score_in_process(capsys, str(out / "final"), "--data", "Dahoas/rm-static", "--local-dir",
                                        str(tmp_path / "datasets"))
    assert code == 0, err
    assert named["split"] == "test" and named["pairs"] == 64 and named["accuracy"] == summary["accuracy"]
    code, named, err = score_in_process(capsys, str(out / "final"), "--data", str(copy), "--split", "train")
    assert code == 0 and named["split"] == "train" and named["pairs"] == 256, err

    # the mean reward PPO will normalise with is the mean over the training responses (all 512 of them here)
    code, _, err = score_in_process(capsys, str(out / "final"), "--data", str(rule_data[0]),
                                    "--output", str(tmp_path / "t.jsonl"))
    assert code == 0, err
    train = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    every = torch.tensor([r[k] for r in train for k in ("chosen_score", "rejected_score")], dtype=torch.float64)
    assert every.mean().item() == pytest.approx(result["rlhfkit_reward_mean"], abs=1e-4)
    assert every.std().item() == pytest.approx(result["rlhfkit_reward_std"], abs=1e-4)

    # prompt/response rows: one score each, equal to the chosen side's score of the same pair
    rows = [json.loads(line) for line in rule_data[1].read_text().splitlines()]
    responses = write_jsonl(tmp_path / "responses.jsonl", [{"prompt": r["prompt"], "response": r["chosen"]}
                                                           for r in rows])
    code, _, err = score_in_process(capsys, str(out / "final"), "--data", str(responses))
    assert code == 2 and "pass --output FILE" in err
    code, summary, err = score_in_process(capsys, str(out / "final"), "--data", str(responses),
                                          "--output", str(tmp_path / "s.jsonl"))
    assert code == 0, err
    scored = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [s["line"] for s in scored] == list(range(1, 65)) and summary["scored"] == 64
    for s, p in zip(scored, pairs):
        assert s["score"] == pytest.approx(p["chosen_score"], abs=1e-5)

    # nothing scorable is an error, not an accuracy of 0 over 0 pairs; a folder as --output fails before the model
    code, _, err = score_in_process(capsys, str(out / "final"), "--data", str(rule_data[1]), "--max-length", "2")
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"rlhfkit score: error: {rule_data[1]}: none of its 64 pairs could be scored within max_length 2 tokens "
        f"(each prompt at or over it, or chosen and rejected the same once cut): pass a larger --max-length")
    code, _, err = score_in_process(capsys, str(out / "final"), "--data", str(rule_data[1]), "--output", str(tmp_path))
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"rlhfkit score: error: --output '{tmp_path}' is a folder: name a file, e.g. {tmp_path / 'scores.jsonl'}")
    assert "Loading weights" not in err  # refused before the model loaded

    # rows with nothing to score are counted by reason, not dropped unsaid; none at all is its own error
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": rows[0]["prompt"], "response": rows[0]["chosen"]},
                                                  {"prompt": rows[1]["prompt"], "response": ""},
                                                  {"prompt": rows[2]["prompt"], "response": "  "}])
    code, summary, err = score_in_process(capsys, str(out / "final"), "--data", str(mixed), "--output",
                                          str(tmp_path / "m.jsonl"))
    assert code == 0, err
    assert summary["rows"] == 1 and summary["skipped"] == {"empty_response": 2}
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": rows[1]["prompt"], "response": ""}])
    code, _, err = score_in_process(capsys, str(out / "final"), "--data", str(empty), "--output",
                                    str(tmp_path / "e.jsonl"))
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"rlhfkit score: error: {empty}: none of its 1 rows is one of the prompt/response rows there are to score "
        f"(skipped: empty_response 1)")
    code, _, err = score_in_process(capsys, str(out / "final"), "--data", str(rule_data[1]), "--max-length", "0")
    assert code == 2 and "--max-length must be >= 1, got 0" in err
    code, _, err = score_in_process(capsys, str(tmp_path / "missing-rm"), "--data", str(rule_data[1]), "--output",
                                    str(tmp_path / "new" / "x.jsonl"))
    assert code == 2 and not (tmp_path / "new").exists()  # no folder left behind by a refused run


def test_lora_rm_exports_a_merged_plain_folder(tiny_model_dir, rule_data, tmp_path):
    out = tmp_path / "lora"
    result, metrics = train_rm(tiny_model_dir, rule_data, out, "train.max_steps=20", "lora.rank=8",
                               "train.eval_every=0", "rm.norm_samples=32")
    assert result["eval/accuracy"] >= 0.9
    weights = load_file(str(out / "final" / "model.safetensors"))
    assert "score.weight" in weights
    assert not [k for k in weights if "lora_" in k or "modules_to_save" in k or "original_module" in k]
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[key], base[key])  # the adapter was merged into the base weights
    tok = AutoTokenizer.from_pretrained(out / "final")
    seqs = encode_rows(tok, "plain", [("say apple", "river honey stone"), ("say apple", "river stone cloud")])
    hf, single, mine = plain_and_rlhfkit_scores(out / "final", seqs)
    torch.testing.assert_close(hf, mine, atol=1e-5, rtol=0)
    assert mine[0] > mine[1]


@needs_shared
def test_rm_on_real_hh_pairs_with_a_real_backbone(tmp_path):
    """A 260K-parameter model learns no human preference in seconds, but it must fit the HH pairs it trains on:
    evaluated on those same pairs (data.eval = the training file), from chance to all of them."""
    out = tmp_path / "hh"
    proc = run_cli("rm", f"model={STORIES}", f"data.train={HH}", f"data.eval={HH}", f"output_dir={out}",
                   "data.max_length=256", "data.max_rows=64", "data.eval_max_rows=64", "train.batch_size=8",
                   "train.micro_batch_size=4", "train.max_steps=24", "train.lr=3e-3", "train.eval_every=0",
                   "log.tensorboard=false", "rm.norm_samples=64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["template"] == "chat"  # stories260K has a chat template
    assert result["eval_rows"] == result["train_rows"] >= 12  # the same pairs (17: most are over 256 tokens)
    assert "pairs" in proc.stderr and "dropped" in proc.stderr  # the data summary a user sees
    evals = [m for m in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 24]
    assert evals[0]["eval/accuracy"] <= 0.7 and evals[-1]["eval/accuracy"] >= 0.95  # measured 0.41 -> 1.0
    assert evals[-1]["eval/loss"] < 0.2 * evals[0]["eval/loss"]  # measured 0.72 -> 0.001
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["rlhfkit_reward_std"] > 0 and config["rlhfkit_template"] == "chat"
    assert AutoModelForSequenceClassification.from_pretrained(out / "final").config.num_labels == 1
