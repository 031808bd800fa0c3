"""Step 1 end to end: the CLI on tiny and real models, accumulation invariance, LoRA export."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfkit.config import SFTConfig, load_config
from rlhfkit.stages.sft import run_sft

from conftest import ALPACA, STORIES, needs_shared, read_metrics, run_cli, sft_rows, write_jsonl


def eval_losses(metrics):
    return [(m["step"], m["eval/loss"]) for m in metrics if "eval/loss" in m]


def test_sft_cli_learns_and_exports(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    out = tmp_path / "run"
    res = run_cli("sft", f"model={tiny_model_dir}", f"data.train={data}", f"output_dir={out}",
                  "train.max_steps=60", "train.batch_size=8", "train.micro_batch_size=4", "train.lr=1e-2",
                  "train.eval_every=10", "train.save_every=10", "data.eval_fraction=0.1")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 60 and summary["train_rows"] == 72 and summary["eval_rows"] == 8
    from rlhfkit.accel.cpu_linear import onednn_weight_grads  # Zen 5: every GEMM of the step in oneDNN

    plan = next(line for line in res.stderr.splitlines() if line.startswith("speed plan: "))
    on = plan.split("; off: ")[0]
    assert ("oneDNN linears" in on) == onednn_weight_grads(), plan
    evals = eval_losses(read_metrics(out / "metrics.jsonl"))
    assert [s for s, _ in evals] == [0, 10, 20, 30, 40, 50, 60]
    assert evals[-1][1] < 0.5 * evals[0][1], evals  # measured 5.8 -> 1.7 on this echo task
    assert (out / "config.yaml").is_file() and (out / "tensorboard").is_dir()
    assert (out / "checkpoints" / "latest").read_text() == "step-00000050"
    # final/ is a plain transformers folder that generates the learned answer
    tok = AutoTokenizer.from_pretrained(out / "final")
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    ids = tok("User: say river\n\nAssistant:", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids["input_ids"].shape[1]

    def nll(name, answer):  # loss of the answer's tokens given the prompt, in plain transformers
        prompt = tok(f"User: say {name}\n\nAssistant:")["input_ids"]
        full = torch.tensor([prompt + tok(f" {answer} {answer} {answer}</s>", add_special_tokens=False)["input_ids"]])
        labels = full.clone()
        labels[0, :len(prompt)] = -100
        with torch.no_grad():
            return model(input_ids=full, labels=labels).loss.item()

    pairs = [("river", "apple"), ("stone", "honey"), ("tiger", "lemon"), ("music", "coral")]
    assert sum(nll(a, a) for a, _ in pairs) < sum(nll(a, b) for a, b in pairs)  # it learned to echo


def test_sft_in_bf16_mixed_precision_learns_like_float32(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    finals, losses = {}, {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        res = run_cli("sft", f"model={tiny_model_dir}", f"data.train={data}", f"output_dir={out}",
                      "train.max_steps=30", "train.batch_size=8", "train.micro_batch_size=8", "train.lr=1e-2",
                      "train.eval_every=30", "data.eval_fraction=0.1", "log.tensorboard=false",
                      f"engine.precision={precision}")
        assert res.returncode == 0, res.stderr
        finals[precision] = eval_losses(read_metrics(out / "metrics.jsonl"))
        losses[precision] = [m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
    # bf16 did compute in bf16: its curve is not float32's (which it would be, were the setting lost)
    assert max(abs(a - b) for a, b in zip(losses["bf16"], losses["fp32"])) > 1e-3
    (_, start), (_, end) = finals["bf16"]
    assert end < 0.6 * start, finals  # measured 5.77 -> 3.04
    assert abs(end - finals["fp32"][-1][1]) < 0.05 * finals["fp32"][-1][1], finals  # float32: 3.05
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16" / "final")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_finished_run_is_not_overwritten(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    args = [f"model={tiny_model_dir}", f"data.train={data}", f"output_dir={tmp_path / 'run'}", "train.max_steps=1",
            "train.batch_size=4"]
    assert run_cli("sft", *args).returncode == 0
    res = run_cli("sft", *args)
    assert res.returncode == 2 and "already holds a finished run" in res.stderr and "--force" in res.stderr
    assert run_cli("sft", *args, "--force").returncode == 0


def test_bad_config_key_exits_before_writing(tmp_path, tiny_model_dir):
    res = run_cli("sft", f"model={tiny_model_dir}", "data.train=x.jsonl", f"output_dir={tmp_path / 'run'}",
                  "train.lrr=1")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("rlhfkit sft: error: unknown config key 'train.lrr'")
    assert not (tmp_path / "run").exists()


def _one_update(tmp_path, model_dir, data, micro, name, *extra):
    cfg = load_config(SFTConfig, None, [f"model={model_dir}", f"data.train={data}", f"output_dir={tmp_path / name}",
                                        "train.max_steps=1", "train.batch_size=4", f"train.micro_batch_size={micro}",
                                        "train.lr=1e-2", "data.eval_fraction=0", "log.tensorboard=false",
                                        "log.progress=false", *extra])
    run_sft(cfg)
    return AutoModelForCausalLM.from_pretrained(tmp_path / name / "final").state_dict()


def test_micro_batch_times_accumulation_is_invariant(tmp_path, tiny_model_dir):
    # rows of different lengths, so a per-micro-batch mean would NOT match: the loss is normalised by the
    # token count of the whole batch
    rows = [{"prompt": "say apple", "response": "apple"}, {"prompt": "say river", "response": "river river river"},
            {"prompt": "say stone", "response": "stone stone"}, {"prompt": "say cloud", "response": "cloud " * 6}]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    a = _one_update(tmp_path, tiny_model_dir, data, 1, "m1")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = max((a[k] - base[k]).abs().max().item() for k in a)
    assert moved > 1e-4  # the update did something
    # micro 2 regroups the rows (balanced token totals when packed, similar lengths together when padded)
    for name, micro, extra in (("m4", 4, ()), ("m2", 2, ()), ("m2-padded", 2, ("packing=false",))):
        b = _one_update(tmp_path, tiny_model_dir, data, micro, name, *extra)
        for key in a:  # Adam amplifies float noise in ~0 grads
            torch.testing.assert_close(a[key], b[key], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name} {key}: {m}")


def test_lora_export_is_merged_and_matches_unmerged_logits(tmp_path, tiny_model_dir):
    from rlhfkit.config import LoraConfig
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.lora import apply_lora

    tok = load_tokenizer(str(tiny_model_dir))
    model = apply_lora(load_causal_lm(str(tiny_model_dir)), LoraConfig(rank=4, alpha=8))
    torch.manual_seed(0)
    with torch.no_grad():  # LoRA B starts at zero; give it weight so merging has something to merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = tok(["User: say apple\n\nAssistant: apple", "User: say stone"], return_tensors="pt", padding=True)
    with torch.no_grad():
        before = model(**ids).logits
    LocalEngine().export_hf(model, tok, tmp_path / "final")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not any("lora" in k for k in plain.state_dict())
    with torch.no_grad():
        after = plain(**ids).logits
    assert (before - AutoModelForCausalLM.from_pretrained(tiny_model_dir)(**ids).logits).abs().max() > 1e-2
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_lora_sft_run_exports_loadable_folder(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    out = tmp_path / "run"
    res = run_cli("sft", f"model={tiny_model_dir}", f"data.train={data}", f"output_dir={out}", "lora.rank=8",
                  "train.max_steps=30", "train.batch_size=8", "train.lr=1e-2", "train.eval_every=0")
    assert res.returncode == 0, res.stderr
    evals = eval_losses(read_metrics(out / "metrics.jsonl"))
    assert evals[-1][1] < evals[0][1] - 0.3  # measured 5.80 -> 5.23 (LoRA on a random tiny model)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert not any("lora" in k for k in model.state_dict())


@needs_shared
@pytest.mark.slow
def test_sft_on_real_model_and_alpaca(tmp_path):
    out = tmp_path / "run"
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"model: {STORIES}\noutput_dir: {out}\ndata: {{train: {ALPACA}, max_length: 192, "
                   f"eval_max_rows: 48}}\ntrain: {{batch_size: 16, micro_batch_size: 8, lr: 1.0e-3, "
                   f"warmup_steps: 3, eval_every: 20}}\n")
    res = run_cli("sft", "--config", str(cfg), "train.max_steps=25")
    assert res.returncode == 0, res.stderr
    evals = eval_losses(read_metrics(out / "metrics.jsonl"))
    first, last = evals[0][1], evals[-1][1]
    assert last < first - 0.5, evals  # measured: 4.2 -> ~3.3
    assert math.isfinite(last)
    tok = AutoTokenizer.from_pretrained(out / "final")
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    msgs = [{"role": "user", "content": "Give three tips for staying healthy."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=20, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]
