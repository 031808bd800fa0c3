"""engine.precision=bf16 on the local engine: forwards under bfloat16 autocast, float32 weights and optimizer."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.config.fields import ConfigError
from rlhfkit.config.schema import EngineConfig, TrainConfig
from rlhfkit.engine.local import LocalEngine
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.accel.cpu_linear import FastCPULinear


@pytest.fixture()
def tiny(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    ids = tok(["User: say river\n\nAssistant: river river river"], return_tensors="pt")["input_ids"]
    return lambda: load_causal_lm(str(tiny_model_dir), tokenizer=tok), ids


def test_bf16_computes_in_bf16_and_keeps_float32_weights_and_gradients(tiny):
    load, ids = tiny
    with torch.no_grad():
        want = load()(input_ids=ids).logits  # float32 throughout
    engine = LocalEngine(EngineConfig(precision="bf16"))
    actor = engine.prepare(load(), TrainConfig(lr=1e-3), total_steps=10)
    out = actor.module(input_ids=ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")  # only inside the model's forward
    # bf16 rounding of the same model, not another computation (logits here are of order 1-10)
    assert (out.logits.float() - want).abs().max() < 0.05 * want.abs().max()
    actor.backward(out.loss, 1)
    params = [p for p in actor.module.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params)
    before = [p.detach().clone() for p in params]
    actor.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, params))  # the float32 weights moved
    frozen = engine.prepare_frozen(load())
    with torch.no_grad():
        assert frozen(input_ids=ids).logits.dtype == torch.bfloat16
        assert LocalEngine(EngineConfig()).prepare_frozen(load())(input_ids=ids).logits.dtype == torch.float32


def test_a_bf16_rollout_runs_in_one_autocast_context(tiny):
    """One context for all the token steps: autocast then casts the trained weights once, not at every step."""
    load, _ = tiny
    engine = LocalEngine(EngineConfig(precision="bf16"))
    actor = engine.prepare(load(), TrainConfig(), total_steps=1)
    with engine.gathered(actor.module) as model:
        assert model is actor.module and torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    with LocalEngine(EngineConfig()).gathered(actor.module) as model:
        assert model is actor.module and not torch.is_autocast_enabled("cpu")


def test_autocast_ends_with_a_forward_that_fails(tiny):
    load, _ = tiny
    model = LocalEngine(EngineConfig(precision="bf16")).prepare_frozen(load())
    with pytest.raises(IndexError):
        model(input_ids=torch.tensor([[10**6]]))  # no such token
    assert not torch.is_autocast_enabled("cpu")


def test_fp16_on_the_local_engine_is_a_config_error():
    with pytest.raises(ConfigError, match="engine.precision"):
        EngineConfig(precision="fp16").validate("engine.")
    EngineConfig(precision="fp16", backend="deepspeed", zero_stage=1).validate("engine.")


def test_fast_cpu_linear_under_autocast_is_autocasts_linear():
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(128, 64), torch.randn(32, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
        layer.__class__ = FastCPULinear
        got = layer(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_a_model_loaded_in_half_precision_and_trained_in_full_keeps_float32_weights(tiny_model_dir, capsys):
    """load.dtype=bfloat16 trained every weight in bfloat16 (updates below its precision lost, whatever
    engine.precision said); a fully trained model now gets float32 weights, a LoRA base stays as loaded."""
    from rlhfkit.config.schema import LoadConfig, LoraConfig
    from rlhfkit.lora import apply_lora

    load = LoadConfig(dtype="bfloat16")
    full = load_causal_lm(str(tiny_model_dir), load)
    assert next(full.parameters()).dtype == torch.bfloat16
    trainable = LocalEngine().prepare(full, TrainConfig(lr=1e-3), total_steps=4)
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    assert "weights are kept in float32" in capsys.readouterr().err
    before = [p.detach().clone() for p in full.parameters()]
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    trainable.backward(full(input_ids=ids, labels=ids).loss, 1)
    trainable.step()
    moved = sum(int((p != b).sum()) for p, b in zip(full.parameters(), before))
    assert moved > 0.9 * sum(b.numel() for b in before)  # Adam's first step at lr 1e-3 moves ~every weight
    lora = apply_lora(load_causal_lm(str(tiny_model_dir), load), LoraConfig(rank=4))
    LocalEngine().prepare(lora, TrainConfig(lr=1e-3), total_steps=4)
    assert {p.dtype for p in lora.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in lora.parameters() if p.requires_grad} == {torch.float32}


def test_a_lora_reward_models_head_on_a_half_precision_base_trains_in_float32(tiny_model_dir):
    """The score head peft trains in full (`modules_to_save`) stayed bfloat16 under load.dtype=bfloat16: at a small
    learning rate most of its weights never moved, and DeepSpeed refused the mixed dtypes. It is float32 now,
    taking the bf16 base's hidden states cast up, and every weight moves."""
    from rlhfkit.config.schema import LoadConfig, LoraConfig
    from rlhfkit.models import load_scalar_model
    from rlhfkit.lora import apply_lora

    tok = load_tokenizer(str(tiny_model_dir))
    rm = apply_lora(load_scalar_model(str(tiny_model_dir), LoadConfig(dtype="bfloat16"), tok), LoraConfig(rank=4),
                    task="scalar")
    head = {n: p for n, p in rm.named_parameters() if p.requires_grad and "score" in n}
    assert head and {p.dtype for p in head.values()} == {torch.float32}
    assert {p.dtype for p in rm.parameters() if not p.requires_grad} == {torch.bfloat16}
    trainable = LocalEngine().prepare(rm, TrainConfig(lr=1e-5), total_steps=4)
    before = {n: p.detach().clone() for n, p in head.items()}
    scores = rm(input_ids=torch.tensor([[1, 5, 6, 7, 8, 9], [1, 9, 8, 7, 6, 5]])).logits[:, 0]
    assert scores.dtype == torch.float32
    trainable.backward(-torch.nn.functional.logsigmoid(scores[0] - scores[1]), 1)
    trainable.step()
    assert all(bool((p != before[n]).all()) for n, p in head.items())  # bf16 at lr 1e-5: ~1 in 6 moved


def test_lora_on_an_embedding_tied_to_the_lm_head_is_refused(tiny_model_dir):
    """The tiny model ties its embeddings and LM head (as SmolLM2 does): an adapter on either, merged into the
    one matrix for the export, changed both uses, and final/ computed something else than the trained model."""
    from rlhfkit.config.schema import LoraConfig
    from rlhfkit.lora import apply_lora

    model = load_causal_lm(str(tiny_model_dir))
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    for target in ("lm_head", "embed_tokens"):
        with pytest.raises(ConfigError, match=f"'lora.target_modules': {target}: this model ties its input "
                                              f"embeddings and its LM head"):
            apply_lora(load_causal_lm(str(tiny_model_dir)), LoraConfig(rank=4, target_modules=["q_proj", target]))
    apply_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))  # the usual targets are fine
