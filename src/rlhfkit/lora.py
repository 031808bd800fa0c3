"""LoRA through peft: the only module that imports peft.

peft is imported when a LoRA model is made (`apply_lora`), not before: a run without LoRA never loads it
(~9 MiB of resident memory and a second of start-up). Until then no model can be a PeftModel, which is how
the checks below answer without importing it.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings

import torch

from rlhfkit.config.schema import LoraConfig
from rlhfkit.errors import ConfigError

# Attention and MLP projections per architecture: adapting all of them is what QLoRA found to matter
# most (Dettmers et al. 2023). Unknown architectures fall back to peft's "all-linear".
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "bloom": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


def apply_lora(model, cfg: LoraConfig, task: str = "causal_lm"):
    """Wrap `model` with LoRA adapters (cfg.rank > 0); base weights are frozen by peft.

    For a scalar-head model (task="scalar") the fresh score head is trained in full (`modules_to_save`). What is
    trained is float32 whatever `load.dtype` loaded the frozen base in (peft upcasts its adapters, not the head:
    a bf16 head barely learned, and DeepSpeed refused the mixed dtypes); the head casts its input to its own
    dtype. Adapting an embedding matrix the model ties to its LM head is refused: merged into the one shared
    matrix for the export, the adapter would change the other use as well.
    """
    if cfg.rank <= 0:
        return model
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    targets = cfg.target_modules or TARGETS.get(model.config.model_type, "all-linear")
    _refuse_tied_targets(model, cfg.target_modules or [])
    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
        task_type=TaskType.SEQ_CLS if task == "scalar" else TaskType.CAUSAL_LM,
        modules_to_save=["score"] if task == "scalar" else None,
    )
    try:
        return _trained_in_float32(_peft_model(model, peft_cfg))
    except ValueError:  # peft's NoMatchingPeftModuleError: a name in target_modules matches no layer
        if not cfg.target_modules:
            raise
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise ConfigError(f"config key 'lora.target_modules': {cfg.target_modules} matches no layer of this "
                          f"{model.config.model_type} model; its linear layers are named {', '.join(linear)}") \
            from None


def _peft_model(model, peft_cfg):
    """peft's `get_peft_model`, without the FutureWarning transformers >= 5 gives when peft reads its deprecated
    `is_gradient_checkpointing` (peft's business, not the user's: it prints on every LoRA run)."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        return get_peft_model(model, peft_cfg)


def _refuse_tied_targets(model, targets: list) -> None:
    """ConfigError when a target names the input or output embedding of a model that ties the two."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or getattr(inputs, "weight", None) is not getattr(outputs, "weight", 0):
        return
    tied = {name for name, module in model.named_modules() if module is inputs or module is outputs}
    named = [t for t in targets if any(name == t or name.endswith("." + t) for name in tied)]
    if named:
        raise ConfigError(f"config key 'lora.target_modules': {', '.join(named)}: this model ties its input "
                          f"embeddings and its LM head to one matrix (tie_word_embeddings), and an adapter merged "
                          f"into it for the export would change both uses: the exported model would not be the "
                          f"trained one; leave {', '.join(named)} out of the targets")


def _trained_in_float32(model):
    """Every trainable half-precision parameter of a LoRA model (the scalar head peft trains in full) as float32,
    its module casting floating-point inputs to float32 first (the frozen base may compute in bf16)."""
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and p.dtype in (torch.bfloat16,
                                                                                               torch.float16)]
        if own:
            for p in own:
                p.data = p.data.float()
            module.register_forward_pre_hook(_inputs_to_float32)
    return model


def _inputs_to_float32(module, args):
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def is_peft_model(model) -> bool:
    """isinstance(model, peft.PeftModel), without importing peft when nothing has (then no model is one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def unwrap_engine(model):
    """The model inside an engine's wrapper (DeepSpeed's engine, like torch's DDP, holds it as `.module` and
    forwards calls to it, but hides it from isinstance checks)."""
    while not is_peft_model(model) and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def is_lora(model) -> bool:
    return is_peft_model(unwrap_engine(model))


def merged(model):
    """The plain transformers model with LoRA folded into the base weights (in place)."""
    if is_peft_model(model):
        return model.merge_and_unload()
    return model


def is_lora_layer(module) -> bool:
    """Whether `module` is one of peft's LoRA-adapted layers (a base layer with its adapter matrices)."""
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def merged_weight(layer, adapter: str) -> torch.Tensor:
    """A LoRA layer's weight as merging would make it, base + B A * scaling of `adapter` (peft's own delta), without
    merging it: the layer trains on unchanged. The base weight where the adapter is merged already or switched off."""
    weight = layer.get_base_layer().weight.detach()
    if layer.merged or layer.disable_adapters or adapter not in layer.lora_A:
        return weight
    return weight + layer.get_delta_weight(adapter).to(weight.dtype)


def adapter_disabled(model):
    """Context in which a LoRA model computes with its base weights: the frozen reference, no second copy."""
    model = unwrap_engine(model)
    if is_peft_model(model):
        return model.disable_adapter()
    return contextlib.nullcontext()


def base_model(model) -> torch.nn.Module:
    """The underlying transformers model (config, generation_config live there), also from inside an engine's
    wrapper (DeepSpeed's own `.config` is its dict)."""
    model = unwrap_engine(model)
    if is_peft_model(model):
        return model.get_base_model()
    return model


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """While open, the transformers model inside `model` runs the attention registered as `name` (transformers'
    `AttentionInterface`); the configured implementation is restored on exit."""
    config = base_model(model).config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def checkpointed(model) -> bool:
    """Whether `model` has gradient (activation) checkpointing switched on (it applies in training mode)."""
    plain = base_model(model)
    name = "is_activation_checkpointing" if hasattr(type(plain), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # transformers < 5.x's name
    return bool(getattr(plain, name, False))


def clone_for_export(model, state: dict | None = None) -> torch.nn.Module:
    """A CPU twin of `model` (same transformers class, same adapters) holding `state`, gathered weights.

    ZeRO-3 parameters live in shards; export gathers them into a state dict and builds this twin from it, which
    can then be merged and saved like any model. The twin is made without initialising its weights (a 7B model's
    random initialisation alone takes about a minute on rank 0 while every other rank waits) and takes `state`'s
    tensors as its own (`assign`: no second copy of the model in memory); tied weights are tied again after.
    Without `state` its weights are left uninitialised.
    """
    from transformers.initialization import no_init_weights

    plain = base_model(model)
    config = copy.deepcopy(plain.config)
    with no_init_weights():
        twin = type(plain)._from_config(config, dtype=getattr(plain, "dtype", torch.float32))
    if getattr(plain, "generation_config", None) is not None:  # its stop tokens and sampling defaults: _from_config
        twin.generation_config = copy.deepcopy(plain.generation_config)  # would derive a default from config.json
    if is_peft_model(model):
        twin = _peft_model(twin, copy.deepcopy(model.peft_config[model.active_adapter]))
    if state is not None:
        twin.load_state_dict(state, assign=True)
        base_model(twin).tie_weights()  # one Parameter again where the model ties two names to one
    return twin
