"""The engine protocol: both engines implement it side by side, the local engine's loss normalisation and
sharding, the DeepSpeed config check (pure dictionaries), and where backend knowledge may live."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from rlhfkit.config.schema import EngineConfig, TrainConfig
from rlhfkit.engine.local import LocalEngine
from rlhfkit.engine.protocol import Engine, Trainable
from rlhfkit.engine import ds_config
from rlhfkit.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src" / "rlhfkit"


def protocol_members(proto) -> list[str]:
    return [name for name in dir(proto) if not name.startswith("_") and name not in ("register",)]


def test_the_local_engine_and_its_trainable_implement_the_protocol():
    engine = LocalEngine(EngineConfig())
    assert isinstance(engine, Engine)
    trainable = engine.prepare(torch.nn.Linear(3, 1), TrainConfig(), total_steps=2, role="critic")
    assert isinstance(trainable, Trainable)


def test_the_deepspeed_engine_implements_the_protocol_without_subclassing():
    from rlhfkit.engine.deepspeed_engine import DeepSpeedEngine, DeepSpeedTrainable

    assert not issubclass(DeepSpeedEngine, LocalEngine)
    for proto, impls in ((Engine, (LocalEngine, DeepSpeedEngine)),
                         (Trainable, (type(LocalEngine().prepare(torch.nn.Linear(2, 1), TrainConfig(), 1)),
                                      DeepSpeedTrainable))):
        for name in protocol_members(proto):
            wanted = getattr(proto, name)
            for impl in impls:
                if callable(wanted) and not isinstance(wanted, property):
                    got = getattr(impl, name, None)
                    assert callable(got), (impl.__name__, name)
                    assert list(inspect.signature(got).parameters) == list(inspect.signature(wanted).parameters), \
                        (impl.__name__, name)


def test_backward_takes_a_loss_sum_and_the_global_count():
    """backward(sum over a micro-batch, count over the step) twice == one backward of the mean."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 3), torch.randn(3, 1)

    def grad(micro_batches: list) -> torch.Tensor:
        layer = torch.nn.Linear(3, 1, bias=False)
        layer.weight.data = w.T.clone()
        trainable = LocalEngine().prepare(layer, TrainConfig(), total_steps=1)
        for part in micro_batches:
            trainable.backward((trainable.module(part) ** 2).sum(), LocalEngine().total(6))
        return layer.weight.grad.clone()

    mean = torch.nn.Linear(3, 1, bias=False)
    mean.weight.data = w.T.clone()
    (mean(x) ** 2).mean().backward()
    torch.testing.assert_close(grad([x[:2], x[2:]]), mean.weight.grad)
    torch.testing.assert_close(grad([x]), mean.weight.grad)


def test_kept_gradients_are_zeroed_in_place_and_train_the_same():
    """keep_grads: the gradients and AdamW's moments exist from `prepare` on (zeros, step 0) and stay the same
    tensors through the steps, the gradients zeroed after each; the parameters and moments after three steps
    equal those of the default, which makes them lazily and frees the gradients."""
    torch.manual_seed(0)
    x, start = torch.randn(8, 3), torch.randn(2, 3)

    def train(keep: bool):
        layer = torch.nn.Linear(3, 2)
        layer.weight.data, layer.bias.data = start.clone(), torch.tensor([0.5, -0.5])
        trainable = LocalEngine().prepare(layer, TrainConfig(lr=0.1, weight_decay=0.1), total_steps=3,
                                          keep_grads=keep)
        state = trainable.optimizer.state.get(layer.weight, {})
        before = (layer.weight.grad, {k: (v, v.clone()) for k, v in state.items()})  # (tensor, its value now)
        grads = []
        for _ in range(3):
            trainable.backward((trainable.module(x) ** 2).sum(), 8)
            grads.append(layer.weight.grad)
            trainable.step()
        return layer, grads, before, trainable.optimizer.state[layer.weight]

    kept, kept_grads, (first_grad, first_state), kept_state = train(True)
    freed, freed_grads, (no_grad, no_state), freed_state = train(False)
    assert torch.equal(first_grad, torch.zeros(2, 3)) and first_grad is kept_grads[0] is kept_grads[2]
    assert float(first_state["step"][1]) == 0 and torch.equal(first_state["exp_avg_sq"][1], torch.zeros(2, 3))
    assert all(kept_state[k] is first_state[k][0] for k in ("step", "exp_avg", "exp_avg_sq"))
    assert torch.equal(kept.weight.grad, torch.zeros(2, 3))
    assert no_grad is None and no_state == {}
    assert freed.weight.grad is None and freed_grads[0] is not freed_grads[2]
    assert torch.equal(kept.weight, freed.weight) and torch.equal(kept.bias, freed.bias)
    assert float(kept_state["step"]) == float(freed_state["step"]) == 3
    assert torch.equal(kept_state["exp_avg"], freed_state["exp_avg"])
    assert torch.equal(kept_state["exp_avg_sq"], freed_state["exp_avg_sq"])


def test_one_rank_keeps_every_row_and_counts_at_least_one():
    engine = LocalEngine()
    assert engine.shard([3, 1, 2]) == [3, 1, 2] and engine.total(0) == 1 and engine.total(7) == 7
    assert engine.reduce_mean({"a": 1.0, "b": "x"}) == {"a": 1.0, "b": "x"}


def test_roles_get_their_zero_stage():
    cfg = EngineConfig(backend="deepspeed", zero_stage=3, critic_zero_stage=2)
    assert [ds_config.stage_of(cfg, r) for r in ("policy", "critic", "reference", "reward")] == [3, 2, 3, 3]
    assert ds_config.stage_of(EngineConfig(zero_stage=2), "critic") == 2


def check(user: dict, **engine):
    ds_config.check_user_config(user, "ds.json", EngineConfig(backend="deepspeed", **engine),
                                TrainConfig(micro_batch_size=2, max_grad_norm=1.0), world_size=2)


@pytest.mark.parametrize("user, engine, message", [
    ({"zero_optimization": {"stage": 3}}, {"zero_stage": 2},
     r"zero_optimization.stage = 3, but engine.zero_stage gives 2"),
    ({"zero_optimization": {"stage": 2}}, {"zero_stage": 2, "critic_zero_stage": 3},
     r"zero_optimization.stage = 2, but engine.critic_zero_stage gives 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, {"zero_stage": 2},
     r"offload_optimizer.device = 'cpu', but engine.offload_optimizer gives 'none'"),
    ({"bf16": {"enabled": True}}, {}, r"bf16.enabled = True, but engine.precision gives False"),
    ({"train_micro_batch_size_per_gpu": 8}, {}, r"= 8, but train.micro_batch_size gives 2"),
    ({"gradient_clipping": 0.5}, {}, r"gradient_clipping = 0.5, but train.max_grad_norm gives 1.0"),
    ({"optimizer": {"type": "Adam"}}, {}, r"'optimizer' \(rlhfkit builds it from train.lr"),
    # DeepSpeed's other spellings: sections as booleans, the bf16 alias, autocast modes, old offload flags, null
    ({"zero_optimization": False}, {"zero_stage": 2}, r"'zero_optimization' = False \(rlhfkit sets this section"),
    ({"zero_optimization": True}, {}, r"'zero_optimization' = True"),
    ({"bfloat16": {"enabled": True}}, {}, r"bfloat16.enabled = True, but engine.precision gives False"),
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, {},
     r"torch_autocast.enabled = True, but engine.precision gives False"),
    ({"zero_optimization": {"cpu_offload_param": True}}, {"zero_stage": 3},
     r"'zero_optimization.cpu_offload_param' \(an old form of offload: rlhfkit sets offload from "
     r"engine.offload_params\)"),
    ({"zero_optimization": {"offload_optimizer": None}}, {"zero_stage": 2, "offload_optimizer": True},
     r"offload_optimizer.device = 'none', but engine.offload_optimizer gives 'cpu'"),
])
def test_a_deepspeed_json_contradicting_rlhfkit_keys_is_an_error_naming_both(user, engine, message):
    with pytest.raises(ConfigError, match=r"^config key 'engine.deepspeed_config': ds.json contradicts .*" + message):
        check(user, **engine)


def test_a_deepspeed_json_adding_keys_or_repeating_ours_is_merged():
    user = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000, "offload_optimizer": {"device": "none"}},
            "bf16": {"enabled": False}, "gradient_clipping": 1, "communication_data_type": "fp32"}
    check(user, zero_stage=2)
    generated = ds_config.train_config(EngineConfig(zero_stage=2), TrainConfig(micro_batch_size=2), 2, 2, False)
    merged = ds_config.merged_config(generated, user)
    assert merged["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000, "offload_optimizer": {"device": "none"}}
    assert merged["communication_data_type"] == "fp32" and merged["train_batch_size"] == 4


def test_backend_knowledge_lives_in_engine_only():
    """Nothing outside engine/ reads RANK, checks a ZeRO-3 parameter or names a DeepSpeed class."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "engine":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"[\"']RANK[\"']|\bds_id\b|\bDeepSpeed(Engine|Trainable)\b|import deepspeed|from deepspeed",
                         code):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_a_deepspeed_json_reaches_the_frozen_models_but_for_its_training_keys():
    """ZeRO-3 tuning in engine.deepspeed_config (live parameters, prefetch, ...) applies to the frozen reference and
    reward models too; their batch, clipping, optimizer and optimizer offload stay out (a frozen model has none)."""
    user = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1000, "stage3_prefetch_bucket_size": 10,
                                  "offload_optimizer": {"device": "cpu"}},
            "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2, "communication_data_type": "fp32"}
    cfg = EngineConfig(backend="deepspeed", zero_stage=3, offload_optimizer=True)
    frozen = ds_config.eval_config(cfg, 3, 2, user)
    assert frozen["zero_optimization"] == {"stage": 3, "stage3_max_live_parameters": 1000,
                                           "stage3_prefetch_bucket_size": 10}
    assert (frozen["train_micro_batch_size_per_gpu"], frozen["train_batch_size"]) == (1, 2)
    assert "gradient_clipping" not in frozen and frozen["communication_data_type"] == "fp32"
    assert ds_config.eval_config(cfg, 3, 2) == ds_config.eval_config(cfg, 3, 2, {})


@pytest.mark.parametrize("lora", [False, True])
def test_the_zero3_export_twin_keeps_the_models_generation_config(tiny_model_dir, lora):
    """ZeRO-3 exports load the gathered weights into `clone_for_export`'s twin: it keeps the model's generation
    config (its end-of-turn tokens and sampling defaults), not a default one derived from config.json, which
    would make the exported folder's chat and generate() run past the end of a turn."""
    from rlhfkit.models import load_causal_lm
    from rlhfkit.lora import base_model, clone_for_export

    model = load_causal_lm(str(tiny_model_dir))
    model.generation_config.update(eos_token_id=[2, 5], temperature=0.6, top_p=0.9, do_sample=True)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    twin = base_model(clone_for_export(model))
    assert twin.generation_config.eos_token_id == [2, 5]
    assert (twin.generation_config.temperature, twin.generation_config.top_p) == (0.6, 0.9)
    assert twin.generation_config is not base_model(model).generation_config  # a copy: the export may change it


@pytest.mark.parametrize("lora", [False, True])
def test_the_zero3_export_twin_takes_the_gathered_tensors_without_initialising_its_own(tiny_model_dir, lora,
                                                                                      monkeypatch):
    """The twin is built without random initialisation (a 7B model's takes about a minute on rank 0 while the
    others wait) and holds the gathered tensors themselves (no second copy of the model in rank 0's memory),
    its tied embeddings one parameter again; its outputs are the model's."""
    from transformers import PreTrainedModel

    from rlhfkit.models import load_causal_lm
    from rlhfkit.lora import base_model, clone_for_export

    model = load_causal_lm(str(tiny_model_dir)).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    # the gathered state as the engine makes it: CPU copies, tied names sharing one tensor
    copies = {}
    state = {name: copies.setdefault(id(v), v.detach().clone()) for name, v in model.state_dict(keep_vars=True).items()}
    calls = []
    monkeypatch.setattr(PreTrainedModel, "_init_weights", lambda self, module: calls.append(module))
    twin = clone_for_export(model, state)
    assert calls == []  # nothing initialised
    assert all(twin.state_dict()[k].data_ptr() == v.data_ptr() for k, v in state.items())  # the tensors themselves
    inner = base_model(twin)
    assert inner.get_input_embeddings().weight is inner.get_output_embeddings().weight
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        assert torch.equal(twin.eval()(ids).logits, model(ids).logits)
