"""Decoding G samples of each prompt without copying the prompt's KV cache to every sample.

GRPO, RLOO and the other group estimators sample G responses per prompt. The rollout computes each distinct
prompt once (`generate.prefill`), but a plain KV cache then holds G copies of it, and every decoding step
reads all G: at each token the attention streams B x (prompt + response) keys and values where
U x prompt + B x response would do (U = B / G prompts). On a CPU that traffic is most of the attention's time
(5M Llama, 8 prompts x 4 samples, 58-token prompts: the attention is a third of the decode).

Here the cache keeps the U prompts' keys and values once (`GroupCacheLayer`) and each row's response part
apart. A decode step's attention (`group_attention`, registered with transformers' `AttentionInterface` and
switched in for the decode steps only) takes the G rows of a prompt as G queries of one matmul against the
prompt's keys, scores each row against its own response keys, and runs one softmax over both parts' scores
side by side. The result equals full attention over the concatenated cache up to float rounding (rollout on
the 5M Llama, 8 prompts x 4 samples x 32 tokens: 0.45-0.47 instead of 0.52-0.53 s).

A model's speed plan says whether its rollouts use it (`plan.group_decode`), decided once per model after
`speed.checks.group_decode_is_exact` compares it on a tiny random batch with the model's own attention. An
architecture with attention options this function does not apply (logit soft-capping, sliding windows, attention
sinks: it refuses them by name) or that does not pass the call's keyword arguments down to its attention function
fails the check and decodes the plain way.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlhfkit.models.forward import unpack_states
from rlhfkit.models.segments import full_attention_cache
from rlhfkit.lora import attention_implementation, base_model

NAME = "rlhfkit_group_decode"
_BASES = ("sdpa", "eager")  # the attention implementations this path stands in for (CPU and plain GPU)
_UNSUPPORTED = ("softcap", "sliding_window", "s_aux", "sinks")  # attention-function options it does not apply


class GroupCacheLayer(DynamicLayer):
    """One layer's cache for G consecutive rows per prompt: the U distinct prompts' keys, transposed once,
    (U, Hk, D, P), and values, (U, Hk, P, D), as the prefill wrote them, and the B = U x G rows' response keys
    and values in buffers of `capacity` positions written in place, laid out (U, Hk, G, capacity, D) so that a
    group's rows of one key/value head are one block. Once decoding has begun, `update` returns the response part as
    (U x Hk, G, t, D) views, which only `group_attention` reads."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0
        self.prompt_keys_t = self.prompt_values = self.key_buffer = self.value_buffer = None

    packed_where = None  # set by `generate.prefill` for a padding-free prefill (`forward.unpack_states`)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.prompt_keys_t is None:  # the prefill: the distinct prompts, attended the usual way
            self.dtype, self.device = key_states.dtype, key_states.device
            keys, values = key_states, value_states
            if self.packed_where is not None:  # packed rows: kept left-padded, attended as they came
                keys, values = unpack_states(keys, self.packed_where), unpack_states(values, self.packed_where)
                self.packed_where = None
            # half precision is kept in float32 here: the decode attention then multiplies in float32, as
            # the fused attention kernels accumulate (bf16 scores lose ~1e-2 of a logit)
            wide = torch.float32 if key_states.dtype in (torch.float16, torch.bfloat16) else key_states.dtype
            # the keys transposed once for all decode steps: a step's scores are then a batched GEMM of plain
            # operands (MKL's is ~2.5x slower on a transposed view at these sizes: 8 prompts x 4 heads, 58 tokens)
            self.prompt_keys_t = keys.to(wide).transpose(-1, -2).contiguous()
            self.prompt_values = values.to(wide).contiguous()
            self.is_initialized = True
            self.keys, self.values = keys, values
            return key_states, value_states
        prompts, kv_heads, dim, _ = self.prompt_keys_t.shape
        group = key_states.size(0) // prompts
        if self.key_buffer is None:
            shape = (prompts, kv_heads, group, self.capacity, dim)
            self.key_buffer = self.prompt_values.new_empty(shape)
            self.value_buffer = self.prompt_values.new_empty(shape)
        end = self.length + key_states.size(-2)
        for buffer, states in ((self.key_buffer, key_states), (self.value_buffer, value_states)):
            # rows (u, g) of head k go to buffer[u, k, g]
            buffer.transpose(1, 2)[:, :, :, self.length:end] = states.view(prompts, group, kv_heads, -1, dim)
        self.length = end
        self.keys, self.values = (buffer[:, :, :, :end].flatten(0, 1) for buffer in (self.key_buffer,
                                                                                      self.value_buffer))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return (0 if self.prompt_keys_t is None else self.prompt_keys_t.size(-1)) + self.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a group cache keeps its rows in prompt order")


class GroupCache:
    """What the decode steps' attention needs besides each layer's cache: the group size and the prompts'
    padding as an additive bias, (U, 1, 1, P): 0 on tokens, the dtype's minimum on left padding."""

    def __init__(self, cache, prompt_mask: torch.Tensor, group: int):
        self.cache, self.group = cache, group
        dtype = cache.layers[0].prompt_values.dtype  # the attention's (float32 for half-precision models)
        self.prompt_bias = torch.zeros(prompt_mask.shape, dtype=dtype, device=prompt_mask.device).masked_fill(
            prompt_mask == 0, torch.finfo(dtype).min)[:, None, None, :]
        self._block_bias = {}

    def block_bias(self, kv_heads: int) -> torch.Tensor:
        """`prompt_bias` for each (prompt, key/value head) block, (U x Hk, 1, P): made once, read by every layer
        and step."""
        if kv_heads not in self._block_bias:
            prompts, _, _, width = self.prompt_bias.shape
            self._block_bias[kv_heads] = self.prompt_bias.expand(prompts, kv_heads, 1, width).reshape(
                prompts * kv_heads, 1, width)
        return self._block_bias[kv_heads]


def group_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    dropout: float = 0.0, scaling: float | None = None, rlhfkit_groups: GroupCache | None = None,
                    **kwargs):
    """One decode step's attention for rows in groups (`GroupCache`): query (B, H, 1, D); key / value the
    rows' response parts as `GroupCacheLayer.update` returns them; the prompt part comes from the layer.
    Returns (B, 1, H, D) as transformers' attention functions do. `attention_mask` is not used: the prompts'
    padding is `prompt_bias`, and every response token is attended (finished rows only carry padding).

    The G x rep queries of a group on one key/value head (rep query heads share it) are one matrix: one
    matmul against the prompt's keys, one batch of matmuls against each row's response keys, one softmax
    over both parts' scores side by side, and the two parts' weighted values added."""
    if rlhfkit_groups is None or query.size(2) != 1 or dropout:
        raise RuntimeError("group_attention serves decode steps of a GroupCache only")
    unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported:  # attention options this function does not apply: the model decodes the plain way
        raise NotImplementedError(f"group_attention does not apply {', '.join(unsupported)}")
    layer = rlhfkit_groups.cache.layers[module.layer_idx]
    dtype, query = query.dtype, query.to(layer.prompt_values.dtype)
    rows, heads, _, dim = query.shape
    prompts, kv_heads, prompt_len, _ = layer.prompt_values.shape
    group, rep = rows // prompts, heads // kv_heads  # query head h reads key/value head h // rep
    blocks, length = prompts * kv_heads, key.size(2)
    scale = dim ** -0.5 if scaling is None else scaling
    # (U, G, Hk, rep, D) -> (U x Hk, G x rep, D): a group's queries of one key/value head
    q = query.reshape(prompts, group, kv_heads, rep, dim).transpose(1, 2).reshape(blocks, group * rep, dim)
    prompt_scores = torch.baddbmm(rlhfkit_groups.block_bias(kv_heads), q,
                                  layer.prompt_keys_t.view(blocks, dim, prompt_len), alpha=scale)
    # (reshape: with one prompt the transposed q above is a view that cannot be viewed so)
    response_scores = torch.bmm(q.reshape(blocks * group, rep, dim),
                                key.reshape(blocks * group, length, dim).transpose(1, 2)).mul_(scale)
    weights = torch.cat([prompt_scores, response_scores.view(blocks, group * rep, length)], dim=-1).softmax(-1)
    out = torch.bmm(weights[..., :prompt_len], layer.prompt_values.view(blocks, prompt_len, dim))
    out += torch.bmm(weights[..., prompt_len:].reshape(blocks * group, rep, length),
                     value.reshape(blocks * group, length, dim)).view(blocks, group * rep, dim)
    out = out.view(prompts, kv_heads, group, rep, dim).transpose(1, 2).reshape(rows, 1, heads, dim)
    return out.to(dtype), None


AttentionInterface.register(NAME, group_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # decode steps pass no mask; this only has to exist


def group_cache(model, capacity: int) -> object | None:
    """An empty cache of `GroupCacheLayer`s with room for `capacity` response tokens, for a model whose cache
    is plain full attention and whose attention this path can stand in for; otherwise None."""
    if getattr(base_model(model).config, "_attn_implementation", None) not in _BASES:
        return None
    cache = full_attention_cache(model)
    if cache is None:
        return None
    cache.layers = [GroupCacheLayer(capacity) for _ in cache.layers]
    return cache


def decoding_in_groups(model):
    """While active, the model's attention is `group_attention` (decode steps with a GroupCache); the
    configured implementation is restored on exit."""
    return attention_implementation(model, NAME)
