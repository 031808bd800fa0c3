"""The speed plan (`speed/registry.py`): every registered path is decided and named for each model it serves, the
settings force it, `engine.speed=reference` turns everything off and installs nothing, a CUDA device gets no CPU
kernels and no per-sequence loops, the first log line says all of it, and nothing outside the plan remembers a
decision (no module-global caches, no attributes stuck on models)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from rlhfkit.config.dpo_schema import DPOConfig
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.config.schema import RMConfig, SFTConfig
from rlhfkit.engine.local import LocalEngine
from rlhfkit.models.plan import PATH_NAMES, REFERENCE, ModelPlan
from rlhfkit.speed.registry import ALL_ROLES, BY_NAME, PATHS, Probe, Target, plan_line, plan_model

SRC = Path(__file__).resolve().parents[2] / "src" / "rlhfkit"
CONFIGS = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "ppo": PPOConfig}
ACCEL = ("onednn_linear", "lean_activations", "fused_kernels", "streaming_decode", "grad_in_place")
PER_SEQUENCE = ("segment_attention", "packing", "padding_free", "packed_prefill", "group_packing")


def config(stage: str, **settings):
    """The stage's default config with `settings` replaced: `section__key` in a section (engine__speed="reference"),
    `key` at the top (packing=True)."""
    cfg = CONFIGS[stage]()
    for key, value in settings.items():
        if "__" not in key:
            cfg = dataclasses.replace(cfg, **{key: value})
            continue
        section, name = key.split("__")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})
    return cfg


def llama(scalar: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0, num_labels=1, attn_implementation="sdpa")
    return (LlamaForSequenceClassification if scalar else LlamaForCausalLM)(cfg)


def probe():
    ids = [[5, 9, 11, 3, 7, 2], [4, 6, 8, 2]]
    return Probe([{"input_ids": r, "labels": [-100] + r[1:], "chosen_ids": r, "rejected_ids": r[:3]} for r in ids], 0)


def target(stage: str, role: str, cfg=None, **kw) -> Target:
    scalar = role in ("critic", "reward", "reward_model")
    model = llama(scalar)
    return Target(model, role, stage, config(stage) if cfg is None else cfg, LocalEngine(),
                  probe=probe() if stage in ("sft", "rm") else None, **kw)


ROLES = [(stage, role) for stage, roles in ALL_ROLES.items() for role in roles]


def test_the_registry_and_the_plan_name_the_same_paths_and_real_settings():
    """One truth per name: the plan's fields are the registry's entries, in order; every setting an entry names is a
    config key of its stage; every entry says how it is known to be exact."""
    assert tuple(path.name for path in PATHS) == PATH_NAMES
    assert len({path.label for path in PATHS}) == len(PATHS)
    for path in PATHS:
        assert path.exact and set(path.serves) <= set(ALL_ROLES), path.name
        for stage, roles in path.serves.items():
            assert set(roles) <= set(ALL_ROLES[stage]), (path.name, stage)
        for stage, key in path.settings.items():
            value = CONFIGS[stage]()
            for part in key.split("."):
                value = getattr(value, part)  # AttributeError: a setting that does not exist
            assert value in (None, True), (path.name, key)  # null (auto) or true (allowed): never off by default
    assert ModelPlan().on() == [] and REFERENCE == ModelPlan()


@pytest.mark.parametrize("stage, role", ROLES)
def test_every_path_is_decided_and_named_for_every_model_it_serves(stage, role):
    plan = plan_model(target(stage, role))
    served = [p.name for p in PATHS if role in p.serves.get(stage, ())]
    off = dict(plan.off)
    assert set(plan.on()) | set(off) == set(served) and not set(plan.on()) & set(off)
    assert all(off.values())  # each off path says why
    on_part, off_part = plan_line({role: plan}).removeprefix("speed plan: on: ").split("\nspeed plan: off: ")
    for name in served:  # the first log line names each: among those on, or off with its reason
        label = BY_NAME[name].label
        assert (f"{label} ({off[name]})" in off_part) if name in off else (label in on_part), (label, on_part, off_part)
    # a plain CPU tiny Llama: attention per sequence, and the forwards' paths that serve this model after their checks
    assert plan.segment_attention == ("segment_attention" in served)
    if stage == "ppo" and role == "actor":
        assert {"head_chunks", "padding_free", "packed_prefill", "shared_prompt", "group_packing", "common_prefix",
                "group_decode"} <= set(plan.on())
    if stage in ("sft", "rm"):
        assert plan.packing
    assert not plan.fused_kernels and off["fused_kernels"] == "hidden size 64 < 256"  # narrow: PyTorch's operators


def test_settings_force_paths_off_and_on():
    off = plan_model(target("ppo", "actor", config("ppo", ppo__packing=False, ppo__chunked_logprobs=False)))
    reasons = dict(off.off)
    assert not (off.padding_free or off.packed_prefill or off.group_packing or off.head_chunks)
    assert reasons["packed_prefill"] == reasons["group_packing"] == "ppo.packing=false"
    assert reasons["head_chunks"] == "ppo.chunked_logprobs=false"
    # padding-free is off for its own reason first in the order: the setting
    assert reasons["padding_free"] == "ppo.packing=false"
    forced = plan_model(target("sft", "policy", config("sft", packing=True), device="cuda"))
    assert forced.packing and not forced.segment_attention  # true overrides auto's preference: transformers' mask
    auto = plan_model(target("sft", "policy", device="cuda"))
    assert not auto.packing and dict(auto.off)["packing"] == "cuda: padded batches"


@pytest.mark.parametrize("stage, role", ROLES)
def test_engine_speed_reference_turns_every_path_off_and_installs_nothing(stage, role):
    cfg = config(stage, engine__speed="reference")
    decided = target(stage, role, cfg)
    before = {name: type(m) for name, m in decided.model.named_modules()}
    plan = plan_model(decided)
    assert plan.on() == [] and set(dict(plan.off).values()) == {"engine.speed=reference"}
    assert {name: type(m) for name, m in decided.model.named_modules()} == before  # no accel class swaps
    assert not decided.model._forward_pre_hooks and not decided.model._forward_hooks  # no hooks on its forward
    assert decided.model.config._attn_implementation == "sdpa"


def test_the_reference_plan_runs_plain_transformers_forwards(tiny_model_dir):
    """With every path off, the forwards a stage runs never switch the attention implementation and never pass
    anything but transformers' own arguments: the attention sees sdpa and a plain call every time."""
    from rlhfkit.data.tokenize import collate_packed
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.models.stage_forward import lm_forward
    from rlhfkit.rollout.experience import response_logprobs
    from test_chunked_logprobs import _batch

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model = load_causal_lm(str(tiny_model_dir), tokenizer=tok)
    seen = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((model.config._attn_implementation,
                                                 tuple(k for k in kwargs if k.startswith("rlhfkit")))),
            with_kwargs=True)
    batch = _batch(tok, model.eval(), groups=True)
    with torch.no_grad():
        response_logprobs(model, batch, REFERENCE)
        rows = [{"input_ids": r, "labels": r} for r in ([5, 9, 14, 3], [8, 4, 30])]
        lm_forward(model, collate_packed(rows, tok.pad_token_id), torch.device("cpu"), REFERENCE)
    assert seen and set(seen) == {("sdpa", ())}


@pytest.mark.parametrize("stage, role", ROLES)
def test_a_cuda_plan_has_no_cpu_kernels_and_no_per_sequence_attention(stage, role):
    """Decided for a CUDA device (a pure decision: the model stays here): nothing of accel/, packed rows padded or
    under transformers' own attention, never attended one sequence at a time."""
    decided = target(stage, role, device="cuda")
    before = {name: type(m) for name, m in decided.model.named_modules()}
    plan = plan_model(decided)
    assert not any(getattr(plan, name) for name in ACCEL + PER_SEQUENCE), plan.on()
    assert {name: type(m) for name, m in decided.model.named_modules()} == before
    off = dict(plan.off)
    for name in ACCEL:
        if name in off:
            assert off[name].startswith("cuda") or off[name] == "gradients freed between steps", (name, off[name])


def test_the_first_line_names_the_paths_on_and_why_the_others_are_off():
    plans = {"actor": ModelPlan(padding_free=True, head_chunks=True,
                                off=(("group_decode", "ZeRO-3: ranks decode in step"),
                                     ("fused_kernels", "engine.speed=reference"))),
             "critic": ModelPlan(padding_free=True, off=(("head_chunks", "x"),)),
             "reference": ModelPlan(head_chunks=True)}
    # two lines: what is on, grouped by the models it is on for, and what is off, with why
    assert plan_line(plans) == ("speed plan: on: actor, reference: LM head in chunks; actor, critic: padding-free\n"
                                "speed plan: off: fused kernels (engine.speed=reference), LM head in chunks (critic: x), "
                                "group decode (ZeRO-3: ranks decode in step)")
    assert plan_line({"policy": ModelPlan(packing=True, off=(("head_chunks", "chunked_loss=false"),))}) == \
        "speed plan: on: packed micro-batches\nspeed plan: off: LM head in chunks (chunked_loss=false)"
    assert plan_line({"policy": REFERENCE}) == "speed plan: on: none\nspeed plan: off: none"


def test_no_fast_path_remembers_anything_outside_the_plan():
    """No module-global caches of verdicts (WeakKeyDictionary) and no `_rlhfkit_` attributes on models, tensors or
    functions in src/. The two that remain are not speed paths: the tokenizer's appended-EOS memo and the config's
    record of what training changed (for the export)."""
    allowed = {("data/templates.py", "WeakKeyDictionary"), ("engine/storage.py", "_rlhfkit_training_only")}
    found = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for match in re.findall(r"WeakKeyDictionary|_rlhfkit_\w+", text):
            found.add((str(path.relative_to(SRC)), match))
    assert found <= allowed, found - allowed
    # and no function of transformers' is replaced for longer than a switched model's forward (accel/rotary.py)
    for path in SRC.rglob("*.py"):
        assert not re.search(r"^\s*\w+\.apply_rotary_pos_emb\s*=", path.read_text(), re.M) or \
            path.name == "rotary.py", path


def test_gradient_checkpointing_keeps_sfts_packed_rows_under_transformers_mask():
    decided = target("sft", "policy")
    decided.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plan = plan_model(decided)
    assert not plan.segment_attention and dict(plan.off)["segment_attention"] == "gradient checkpointing"
    assert plan.packing  # still packed, under the block-diagonal mask
