"""`rlhfkit dpo` on tiny models: it learns a rule, its reference log-probs (precomputed and cached, on the fly,
LoRA's disabled adapter) agree, every loss trains, the export loads in plain transformers, kill -9 then --resume
reproduces the uninterrupted run."""

from __future__ import annotations

import json
import math
import random
import signal

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfkit.cli import main as cli_main
from rlhfkit.config import DPOConfig, LoraConfig, load_config
from rlhfkit.data.loader import load_stage_data
from rlhfkit.algos import masked_sum, token_logprobs
from rlhfkit.data.templates import Template, encode_prompt, encode_response
from rlhfkit.data.tokenize import collate_preferences, collate_prompt_sharing_pairs
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.models.forward import causal_logits
from rlhfkit.lora import apply_lora
from rlhfkit.models.plan import ModelPlan
from rlhfkit.stages.dpo import Reference, logprob_forward, run_dpo, sequence_logprobs

# what a DPO policy's speed plan has on an sdpa model: each pair packed under a custom mask, else its prompt through a
# KV cache once
DPO = ModelPlan(pair_packing=True, shared_prompt=True)

from conftest import read_metrics, run_cli, sharpened, write_jsonl
from test_reliability import comparable, start, wait_for_step
from test_rm import rule_rows  # the labellers prefer responses that contain "honey"

BETA = 0.1
TINY_RUN = ["train.batch_size=16", "train.micro_batch_size=8", "train.lr=1e-2", "train.eval_every=10",
            "train.save_every=2", "train.max_steps=30", f"dpo.beta={BETA}"]


@pytest.fixture(scope="module")
def rule_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dpo_rule")
    return write_jsonl(folder / "train.jsonl", rule_rows(256, 0)), write_jsonl(folder / "eval.jsonl", rule_rows(64, 1))


def dpo_args(model_dir, data, out, *extra) -> list[str]:
    return [f"model={model_dir}", f"data.train={data[0]}", f"data.eval={data[1]}", f"output_dir={out}", *TINY_RUN,
            *extra]


@pytest.fixture(scope="module")
def dpo_run(tiny_model_dir, rule_data, tmp_path_factory):
    """Through the CLI, as a user runs it: 30 steps, eval every 10, a checkpoint every 2 (the resume test's
    uninterrupted run)."""
    out = tmp_path_factory.mktemp("dpo") / "run"
    proc = run_cli("dpo", *dpo_args(tiny_model_dir, rule_data, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout.strip().splitlines()[-1]), read_metrics(out / "metrics.jsonl")


def in_process(model_dir, data, out, *extra) -> tuple[dict, list[dict]]:
    cfg = load_config(DPOConfig, None, dpo_args(model_dir, data, out, "log.tensorboard=false", "log.progress=false",
                                                "train.save_every=0", *extra))
    result = run_dpo(cfg)
    return result, read_metrics(out / "metrics.jsonl")


def assert_same_metrics(got: list[dict], want: list[dict], tol: float) -> None:
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=tol, abs=tol), (key, a["step"])
            else:
                assert a[key] == b[key], (key, a["step"])


def encode_pair_rows(tok, rows: list[dict]) -> list[dict]:
    """Held-out pairs tokenised as plain transformers users would: the plain template, EOS-terminated responses."""
    tpl = Template.for_tokenizer(tok, "plain")
    out = []
    for row in rows:
        messages = [{"role": "user", "content": row["prompt"]}]
        prompt = encode_prompt(tok, tpl.prompt(messages))
        sides = [prompt + encode_response(tok, tpl.response(messages, row[k])) for k in ("chosen", "rejected")]
        out.append({"chosen_ids": sides[0], "rejected_ids": sides[1], "prompt_len": len(prompt)})
    return out


def response_logprob(model, ids: list[int], prompt_len: int) -> float:
    """log pi(response | prompt) of one unpadded sequence, the plain way: log-softmax at every position."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logp[prompt_len - 1:].sum().item()


# ---------------------------------------------------------------- end to end


def test_dpo_learns_the_rule_and_raises_held_out_implicit_reward_accuracy(dpo_run):
    out, result, metrics = dpo_run
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 10, 20, 30]  # step 0, every eval_every, and the end
    # step 0: the policy is its own reference, so every implicit reward is exactly 0 (a tie counts as wrong)
    assert evals[0]["eval/accuracy"] == 0.0 and evals[0]["eval/margin"] == 0.0
    assert evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[-1]["eval/accuracy"] >= 0.9 and evals[-1]["eval/margin"] > 1.0
    assert evals[-1]["eval/loss"] < 0.3 * evals[0]["eval/loss"]
    last = evals[-1]
    assert last["eval/margin"] == pytest.approx(last["eval/reward/chosen"] - last["eval/reward/rejected"], abs=1e-5)
    steps = [m for m in metrics if "loss" in m]
    # the precomputed reference is grouped as the first step's micro-batches: exact zeros there too
    assert steps[0]["margin"] == 0.0 and steps[0]["accuracy"] == 0.0
    assert {"loss", "accuracy", "margin", "reward/chosen", "reward/rejected", "logps/chosen", "logps/rejected", "lr",
            "grad_norm"} <= set(steps[-1])
    assert steps[-1]["accuracy"] >= 0.9 and steps[-1]["loss"] < steps[0]["loss"]
    assert {m["stage"] for m in metrics} == {"dpo"}
    assert result["eval/accuracy"] == evals[-1]["eval/accuracy"] and result["train_rows"] == 256
    assert "precomputed by the policy before its first step" in result["reference"]
    assert any((out / "tensorboard").iterdir())


def test_final_loads_in_plain_transformers_and_prefers_the_rule(dpo_run, tiny_model_dir, rule_data):
    """The exported policy against its start, both read by plain transformers, one unpadded sequence at a time:
    the implicit rewards agree with the run's held-out eval."""
    out, result, _ = dpo_run
    tok = AutoTokenizer.from_pretrained(out / "final")
    policy = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    start_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rows = encode_pair_rows(tok, [json.loads(line) for line in rule_data[1].read_text().splitlines()])
    margins = []
    for row in rows:
        reward = {k: BETA * (response_logprob(policy, row[f"{k}_ids"], row["prompt_len"])
                             - response_logprob(start_model, row[f"{k}_ids"], row["prompt_len"]))
                  for k in ("chosen", "rejected")}
        margins.append(reward["chosen"] - reward["rejected"])
    accuracy = sum(m > 0 for m in margins) / len(margins)
    assert accuracy == result["eval/accuracy"] >= 0.9
    assert sum(margins) / len(margins) == pytest.approx(result["eval/margin"], abs=1e-3)
    assert cli_main(["report", str(out)]) == 0 and (out / "report.html").is_file()


def test_kill_9_then_resume_reproduces_the_uninterrupted_run(dpo_run, tiny_model_dir, rule_data, tmp_path):
    """The killed run precomputes its reference with the policy and caches it; the resumed one, with the cache
    off, has to compute it again from a frozen copy of the SFT weights (its policy has moved)."""
    _, _, reference = dpo_run
    out = tmp_path / "killed"
    args = dpo_args(tiny_model_dir, rule_data, out)
    proc = start(["dpo", *args, f"data.cache_dir={tmp_path / 'cache'}"])
    wait_for_step(proc, out / "metrics.jsonl", random.Random("dpo").randint(5, 12))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()
    saved = int((out / "checkpoints" / "latest").read_text().split("-")[1])
    assert saved >= 2

    # the resume in this process (a Python start saved): the same run_dpo the CLI calls
    result = run_dpo(load_config(DPOConfig, None, [*args, "data.cache=false", "log.progress=false"]), resume=True)
    assert "precomputed by a frozen copy" in result["reference"]
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]  # no step lost or logged twice
    assert_same_metrics(comparable(resumed, saved), comparable(reference, saved), tol=1e-5)


# ---------------------------------------------------------------- the reference


def test_sequence_logprobs_sum_response_tokens_only_whatever_the_padding(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir)).eval()
    rows = encode_pair_rows(tok, [{"prompt": "say apple", "chosen": "apple apple apple", "rejected": "river"},
                                  {"prompt": "say honey please now", "chosen": "honey", "rejected": "stone stone"}])
    with torch.no_grad():
        logps, lengths = sequence_logprobs(model, rows, tok.pad_token_id, torch.device("cpu"), DPO)  # (4,): c1 c2 r1 r2
    want = [response_logprob(model, r[f"{k}_ids"], r["prompt_len"]) for k in ("chosen", "rejected") for r in rows]
    counts = [len(r[f"{k}_ids"]) - r["prompt_len"] for k in ("chosen", "rejected") for r in rows]
    torch.testing.assert_close(logps.double(), torch.tensor(want, dtype=torch.float64), atol=2e-5, rtol=0)
    assert lengths.tolist() == counts


def padded_full_logprobs(model, rows, pad_id):
    """Each sequence alone in one right-padded (2B, T) forward: summed response log-probs, (2B,)."""
    batch = collate_preferences(rows, pad_id)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logp = token_logprobs(causal_logits(model, ids, mask)[:, :-1], ids[:, 1:])  # (2B, T - 1)
    prompt_len = torch.tensor([r["prompt_len"] for r in rows] * 2)
    valid = (torch.arange(1, ids.size(1))[None] >= prompt_len[:, None]) & mask[:, 1:].bool()
    return masked_sum(logp, valid, dim=-1)


def assert_same_logps_and_grads(model, compute, expected):
    """`compute()` and `expected()` give the same (2B,) log-probs of 3 pairs and the same gradients of a sum
    weighting each sequence differently."""
    results = []
    for fn in (compute, expected):
        model.zero_grad()
        logps = fn()
        (logps * torch.arange(1.0, 7.0)).sum().backward()  # a different weight per sequence
        results.append((logps.detach(), [p.grad.clone() for p in model.parameters()]))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert (want[:3] - want[3:]).abs().min() > 0.1  # the sequences differ: a swap would show
    # float32 with sharpened weights: gradients up to ~5e3; the paths agree to ~1e-7 of each parameter's largest
    # (measured), a response that saw the other would be off by its whole size
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("attention, checkpointing", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_packed_prompt_sharing_pairs_give_the_full_forward_values_and_gradients(tiny_model_dir, attention,
                                                                                 checkpointing):
    """Pairs packed as [prompt | chosen | rejected] segments under the custom mask (DPO's forward wherever the model
    takes one): the same log-probs and gradients as every sequence alone in a padded batch. The weights are
    sharpened so that a response that saw the other response, or another pair, would show."""
    tok = load_tokenizer(str(tiny_model_dir))
    rows = encode_pair_rows(tok, [{"prompt": "say apple", "chosen": "apple apple apple", "rejected": "river"},
                                  {"prompt": "say honey please now", "chosen": "honey", "rejected": "stone stone"},
                                  {"prompt": "say stone", "chosen": "stone stone stone stone", "rejected": "apple"}])
    model = sharpened(AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention))
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    assert logprob_forward(model, DPO) == "packed"
    packed = collate_prompt_sharing_pairs(rows, tok.pad_token_id)
    assert packed["input_ids"].numel() < collate_preferences(rows, tok.pad_token_id)["input_ids"].numel()
    device = torch.device("cpu")
    assert_same_logps_and_grads(model, lambda: sequence_logprobs(model, rows, tok.pad_token_id, device, DPO)[0],
                                lambda: padded_full_logprobs(model, rows, tok.pad_token_id))


@pytest.mark.parametrize("path", ["packed", "shared-prompt", "full"])
def test_the_lm_head_in_chunks_gives_the_full_forward_values_and_gradients(tiny_model_dir, monkeypatch, path):
    """`dpo.chunked_logprobs`: each of the three forwards takes the hidden states and runs the LM head in chunks on
    the response tokens (chunks of 5 rows here, so a response spans several): the same log-probs and gradients,
    the tied embedding/head weight's included, as every sequence alone in a padded batch with full logits."""
    from rlhfkit.algos import logprobs as logprob_module
    from rlhfkit.models.forward import head_logprobs_weight

    tok = load_tokenizer(str(tiny_model_dir))
    rows = encode_pair_rows(tok, [{"prompt": "say apple", "chosen": "apple apple apple", "rejected": "river"},
                                  {"prompt": "say honey please now", "chosen": "honey", "rejected": "stone stone"},
                                  {"prompt": "say stone", "chosen": "stone stone stone stone", "rejected": "apple"}])
    model = sharpened(AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa"))
    # "shared-prompt": as the plan of a model that takes no custom attention mask
    plan = ModelPlan(pair_packing=path == "packed", shared_prompt=True, head_chunks=True)
    if path == "full":
        model.gradient_checkpointing_enable()
    model.train()
    assert logprob_forward(model, plan) == path
    vocab = model.get_output_embeddings().weight.size(0)
    monkeypatch.setattr(logprob_module, "_LOGPROB_CHUNK_ELEMENTS", 5 * vocab)

    def chunked():
        assert head_logprobs_weight(model, plan) is not None
        return sequence_logprobs(model, rows, tok.pad_token_id, torch.device("cpu"), plan)[0]

    def full():
        return padded_full_logprobs(model, rows, tok.pad_token_id)

    assert_same_logps_and_grads(model, chunked, full)


def test_a_model_without_custom_masks_takes_the_shared_prompt_forward(tiny_model_dir):
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.speed.registry import BY_NAME, Target, _decide

    model = load_causal_lm(str(tiny_model_dir))
    model.config._attn_implementation = "flash_attention_2"  # takes no custom 4D mask
    target = Target(model, "policy", "dpo", None, LocalEngine())
    assert _decide(BY_NAME["pair_packing"], target, {}) == "attention flash_attention_2 takes no custom mask"
    assert _decide(BY_NAME["shared_prompt"], target, {}) is None
    plan = ModelPlan(shared_prompt=True)
    assert logprob_forward(model, plan) == "shared-prompt"
    model.gradient_checkpointing_enable()
    assert logprob_forward(model, plan) == "full"


def test_lora_reference_equals_the_frozen_copy(tiny_model_dir):
    """The LoRA policy with its adapter disabled computes exactly what a separate frozen copy computes, though
    its adapter (made non-zero here, as after training) changes the policy's own log-probs."""
    tok = load_tokenizer(str(tiny_model_dir))
    rows = encode_pair_rows(tok, rule_rows(6, 2))
    frozen = load_causal_lm(str(tiny_model_dir)).eval()
    policy = apply_lora(load_causal_lm(str(tiny_model_dir)), LoraConfig(rank=8))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    policy.train()
    device = torch.device("cpu")
    lora_ref = Reference(policy, lora=True, plan=DPO).logprobs(rows, tok.pad_token_id, device)
    copy_ref = Reference(frozen, plan=DPO).logprobs(rows, tok.pad_token_id, device)
    for a, b in zip(lora_ref, copy_ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert policy.training  # back in the mode it was in
    with torch.no_grad():
        own, _ = sequence_logprobs(policy, rows, tok.pad_token_id, device, DPO)
    assert (own[:6] - lora_ref[0]).abs().max() > 1e-2  # the adapter is active outside the reference's block


def test_a_resumed_runs_reference_has_the_fresh_runs_precision(tiny_model_dir):
    """load.dtype=bfloat16: a fresh run's reference is the policy before its first step, float32 (a trained model
    keeps float32 weights); a resumed run without cached log-probs loads a copy in its place, which must be float32
    too, or its reference log-probs (and so every later step) differ from the uninterrupted run's."""
    from rlhfkit.config import DPOConfig, load_config
    from rlhfkit.config.schema import TrainConfig
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.stages.dpo import reference_model

    cfg = load_config(DPOConfig, None, [f"model={tiny_model_dir}", "data.train=unused.jsonl", "load.dtype=bfloat16"])
    tok = load_tokenizer(str(tiny_model_dir))
    engine = LocalEngine()
    policy = engine.prepare(load_causal_lm(str(tiny_model_dir), cfg.load, tok), TrainConfig(), 1)
    fresh = reference_model(cfg, policy, DPO, engine, tok, fresh=True)
    resumed = reference_model(cfg, policy, DPO, engine, tok, fresh=False)
    assert fresh.model is policy.module and "before its first step" in fresh.note
    assert {p.dtype for p in resumed.model.parameters()} == {torch.float32}
    for a, b in zip(resumed.model.parameters(), policy.module.parameters()):
        assert torch.equal(a, b)  # the same values: the loaded bf16 weights, upcast


def test_cached_reference_logprobs_equal_on_the_fly(tiny_model_dir, rule_data, tmp_path):
    """Run 1 precomputes and caches, run 2 reads the cache (same numbers to the bit), run 3 runs a frozen copy
    in every micro-batch (the same up to float rounding); the cached values are the frozen copy's."""
    short = ["train.max_steps=6", "train.eval_every=3", f"data.cache_dir={tmp_path / 'cache'}"]
    first, m1 = in_process(tiny_model_dir, rule_data, tmp_path / "a", *short)
    second, m2 = in_process(tiny_model_dir, rule_data, tmp_path / "b", *short)
    third, m3 = in_process(tiny_model_dir, rule_data, tmp_path / "c", *short, "dpo.precompute_reference=false")
    assert "cached at" in first["reference"] and "read from" in second["reference"]
    assert third["reference"] == f"a frozen copy of {tiny_model_dir}, every micro-batch"
    assert comparable(m1, -1) == comparable(m2, -1)
    assert_same_metrics(comparable(m3, -1), comparable(m1, -1), tol=1e-5)

    [entry] = (tmp_path / "cache" / "data").glob("dpo-reference-*.json")
    cached = json.loads(entry.read_text())
    cfg = load_config(DPOConfig, None, dpo_args(tiny_model_dir, rule_data, tmp_path / "x",
                                                f"data.cache_dir={tmp_path / 'cache'}"))
    tok = load_tokenizer(str(tiny_model_dir))
    data = load_stage_data("rm", cfg.data, tok, cfg.train.seed)
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.speed.registry import Target, plan_model

    model = LocalEngine().prepare_frozen(load_causal_lm(str(tiny_model_dir)))
    frozen = Reference(model, plan=plan_model(Target(model, "reference", "dpo", cfg, LocalEngine())))
    for rows, values in ((data.train[:24], cached["train"][:24]), (data.eval, cached["eval"])):
        chosen, rejected = frozen.logprobs(rows, tok.pad_token_id, torch.device("cpu"))
        torch.testing.assert_close(torch.stack([chosen, rejected], 1), torch.tensor(values), atol=1e-5, rtol=0)


def test_micro_batch_times_accumulation_is_invariant(tiny_model_dir, rule_data, tmp_path):
    """micro-batch 4 x accumulation 4 == micro-batch 16 x accumulation 1: per-pair losses summed, divided once."""
    runs = [in_process(tiny_model_dir, rule_data, tmp_path / str(micro), f"train.micro_batch_size={micro}",
                       "train.max_steps=4", "train.eval_every=0", "data.cache=false")[1] for micro in (4, 16)]
    strip = [[{k: v for k, v in row.items() if k != "grad_norm"} for row in comparable(rows, -1)] for rows in runs]
    assert_same_metrics(strip[0], strip[1], tol=1e-5)
    norms = [[row["grad_norm"] for row in rows if "grad_norm" in row] for rows in runs]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)


def test_lora_dpo_uses_the_disabled_adapter_and_exports_merged(tiny_model_dir, rule_data, tmp_path):
    result, metrics = in_process(tiny_model_dir, rule_data, tmp_path / "lora", "lora.rank=8", "train.lr=3e-2",
                                 "train.max_steps=10", "train.eval_every=0", "data.cache=false")
    assert result["reference"].startswith("precomputed by the policy with its LoRA adapter disabled")
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert evals[0]["eval/margin"] == 0.0 and evals[-1]["eval/accuracy"] > 0.8
    weights = load_file(str(tmp_path / "lora" / "final" / "model.safetensors"))
    assert not [k for k in weights if "lora_" in k]
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[key], base[key])  # the adapter was merged


@pytest.mark.parametrize("loss, extra", [
    ("ipo", []),
    ("cdpo", ["dpo.label_smoothing=0.1"]),
    ("simpo", ["dpo.beta=2.0", "dpo.simpo_gamma=1.0", "dpo.rpo_alpha=1.0"]),
])
def test_every_loss_trains_on_the_rule(tiny_model_dir, rule_data, tmp_path, loss, extra):
    result, metrics = in_process(tiny_model_dir, rule_data, tmp_path / loss, f"dpo.loss={loss}", *extra,
                                 "train.max_steps=10", "train.eval_every=0", "data.cache=false")
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 10]
    assert evals[-1]["eval/accuracy"] >= 0.9 and evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert result["loss_type"] == loss
    if loss == "simpo":  # reference-free: nothing loaded or computed; RPO's NLL term is logged
        assert result["reference"] == "none (simpo is reference-free)"
        assert "nll" in metrics[-1] and "eval/nll" in evals[-1]


def test_dpo_refuses_rows_without_pairs_before_writing_anything(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "say apple", "response": "apple"}] * 4)
    code = cli_main(["dpo", f"model={tiny_model_dir}", f"data.train={data}", f"output_dir={tmp_path / 'out'}"])
    assert code == 2 and "cannot detect a preference format" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
