"""`ModelPlan`: which optional speed paths one model takes, decided once at load (`speed.registry.plan_model`).

Every function that can take a faster path for a model is passed that model's plan and reads its own flag; none
decides on its own or remembers a verdict anywhere else. `REFERENCE` (every path off) is the plain transformers
path: the model's own forward, its own attention implementation and modules, padded batches. `engine.speed=reference`
gives every model that plan, and the tests compare the others against it.

The fields name the registry's entries (`speed.registry.PATHS`, in the same order; a test ties the two).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPlan:
    # CPU kernels (accel/, installed by `accel.install` before the forwards' paths are checked)
    onednn_linear: bool = False  # float32 linear layers on oneDNN (AMD CPUs)
    lean_activations: bool = False  # RMSNorm and SwiGLU that keep fewer activations (accel/lean.py)
    fused_kernels: bool = False  # the lean modules' and the rotary embedding's element-wise work in C
    streaming_decode: bool = False  # the rollout's decode-step linear layers as one stream over each weight
    grad_in_place: bool = False  # the vocabulary matrices' gradients added into the kept .grad
    # packed rows and shared tokens (models/, rollout/)
    segment_attention: bool = False  # packed rows attended one sequence at a time, causally (models/segments.py)
    head_chunks: bool = False  # the LM head in chunks on the hidden states (algos.linear_token_logprobs, _lm_loss_sum)
    packing: bool = False  # sft, rm: micro-batches of packed rows instead of padded ones
    padding_free: bool = False  # ppo: forwards over padded rollout rows run on their real tokens packed
    packed_prefill: bool = False  # ppo: the rollout's prompts prefilled packed (rollout.generate._packed_prefill)
    shared_prompt: bool = False  # rows that share a prompt (a group; a DPO pair) compute it once, via a KV cache
    pair_packing: bool = False  # dpo: a pair's prompt and both responses in one packed row under a custom mask
    group_packing: bool = False  # ppo: shared prompts or prefixes and the rest of each row in one packed row
    common_prefix: bool = False  # ppo: the tokens every row begins with, computed once
    group_decode: bool = False  # ppo: decode steps read each group's prompt keys once (rollout/group_decode.py)
    # not a path: the autocast the engine runs this model's forward under, which the LM head in chunks matches
    autocast: tuple | None = None
    # (path, why) for each path the registry considered and left off, in registry order
    off: tuple = ()

    def on(self) -> list[str]:
        """The names of the paths on, in registry order."""
        return [name for name in PATH_NAMES if getattr(self, name)]


PATH_NAMES = tuple(f.name for f in dataclasses.fields(ModelPlan) if f.type in ("bool", bool))

REFERENCE = ModelPlan()  # every path off: plain transformers forwards
