"""Every optional speed path as one entry, and the plan each model gets from them, decided once at load.

An entry (`SpeedPath`) holds what a reader needs to know about a faster path: its name (a `ModelPlan` field) and
how the log names it; the setting that forces it (true: on wherever it can run; false: off; null, the default:
on where it applies and its check passes); the stages and model roles it serves; when it applies (`applies`: why
it cannot run for this model, e.g. "ZeRO-3"; `prefers`: why auto leaves it off though it could run, e.g. a CUDA
device); and its exactness check, with the tolerance it holds to. `plan_model` walks the entries in order for one
model: the CPU kernels first (installed into the model by `accel.install`, so that the forwards' checks run the
arithmetic the run will), then the forwards' paths, each check run with the paths decided before it.
`engine.speed=reference` turns every path off: plain transformers forwards, which the tests compare against.

Rules the entries keep: nothing of `accel/` and no per-sequence loop on a CUDA device (padded batches or
transformers' own masked attention there); every rank decides alike (a check's verdict is agreed over ranks, and
paths that change how many forwards a rank runs are off where forwards are collectives, ZeRO-3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from rlhfkit.accel import install
from rlhfkit.accel import kernels
from rlhfkit.accel.cpu_linear import onednn_is_faster, onednn_weight_grads
from rlhfkit.accel.decode_gemm import available as decode_kernel_available
from rlhfkit.accel.grad_in_place import MIN_ELEMENTS, takes as grad_in_place_takes
from rlhfkit.accel.lean import MLP_CLASSES, RMSNORM_CLASSES
from rlhfkit.models.forward import custom_mask_kind, lm_head_weight
from rlhfkit.lora import base_model, checkpointed
from rlhfkit.models.segments import full_attention_cache
from rlhfkit.rollout.group_decode import group_cache
from rlhfkit.speed import checks
from rlhfkit.models.plan import PATH_NAMES, ModelPlan

REFERENCE_SETTING = "engine.speed=reference"


@dataclass(frozen=True)
class Probe:
    """The run's first rows, for the checks that read data (SFT's and the RM's packed micro-batches)."""

    rows: list
    pad_id: int


@dataclass
class Target:
    """One model a plan is decided for: `role` names what it does in `stage` ("policy", "reward_model", "actor",
    "critic", "reference", "reward"); `cfg` is the stage's config (None: every setting null), `keep_grads` whether
    the engine keeps its gradients between steps, `probe` the rows a data check reads, `device` where it runs."""

    model: torch.nn.Module
    role: str
    stage: str
    cfg: object
    engine: object
    keep_grads: bool = False
    probe: Optional[Probe] = None
    device: Optional[torch.device] = None  # default: the engine's
    whole: bool = field(init=False)  # every rank holds every parameter (not ZeRO-3): agreed over ranks

    def __post_init__(self):
        self.device = torch.device(self.device) if self.device is not None else self.engine.device
        held = float(self.engine.holds_whole(self.model))
        self.whole = self.engine.reduce_sum(held) == self.engine.world_size

    @property
    def config(self):
        return base_model(self.model).config

    def setting(self, key: str | None):
        """The config value at dotted `key` (None: no key, or no config)."""
        if key is None or self.cfg is None:
            return None
        value = self.cfg
        for part in key.split("."):
            value = getattr(value, part)
        return value

    def rtol(self, pair: tuple[float, float]) -> float:
        return pair[0] if self.setting("engine.precision") in (None, "fp32") else pair[1]


Reason = Callable[[Target, dict], Optional[str]]  # why the path is off for this model, or None


@dataclass(frozen=True)
class SpeedPath:
    name: str  # the `ModelPlan` field
    label: str  # how the log line names it
    serves: dict  # stage -> the roles it may speed up there
    exact: str  # how it is known to give the plain path's values, and within what
    settings: dict = dataclasses.field(default_factory=dict)  # stage -> the config key forcing it (true/false)
    applies: Reason = lambda target, on: None  # why it cannot run for this model (forced on or not)
    prefers: Reason = lambda target, on: None  # why auto leaves it off (a forced true overrides)
    check: Optional[Callable[[Target, ModelPlan, float], bool]] = None  # run when the setting is null
    rtol: tuple = (1e-4, 2e-2)  # the check's tolerance: fp32, half precision
    accel: bool = False  # a CPU kernel of `accel/`, installed before the forwards' paths are checked


# ------------------------------------------------------------------------------------------ applicability

def _attention(target: Target) -> str:
    return getattr(target.config, "_attn_implementation", None) or "default"


def _cpu(target: Target, on: dict) -> str | None:
    return None if target.device.type == "cpu" else f"{target.device.type}: a CPU path"


def _padded_on_gpu(target: Target, on: dict) -> str | None:
    return None if target.device.type == "cpu" else f"{target.device.type}: padded batches"


def _whole(target: Target, on: dict) -> str | None:
    return None if target.whole else "ZeRO-3: forwards are collectives"


def _needs(path: str, why: str, roles: tuple = ()) -> Reason:
    """Off unless `path` is on for this model (only for `roles`, when given)."""
    def reason(target: Target, on: dict) -> str | None:
        if roles and target.role not in roles:
            return None
        return None if on.get(path) else why
    return reason


def _all(*reasons: Reason) -> Reason:
    def reason(target: Target, on: dict) -> str | None:
        return next((r for r in (f(target, on) for f in reasons) if r is not None), None)
    return reason


def _full_attention(target: Target, on: dict) -> str | None:
    if getattr(target.config, "attn_logit_softcapping", None) is not None:
        return "soft-capped attention"
    return None if full_attention_cache(target.model) is not None else "not every layer is full attention"


def _recomputed(target: Target, on: dict) -> str | None:
    """SFT and RM forward packed rows only to train: under gradient checkpointing the recomputation in backward runs
    after the attention switch is gone, so those forwards keep transformers' mask (PPO's no-grad forwards may not)."""
    training_only = target.stage in ("sft", "rm")
    return "gradient checkpointing" if training_only and checkpointed(target.model) else None


def _sdpa(target: Target, on: dict) -> str | None:
    return None if _attention(target) == "sdpa" else f"attention {_attention(target)}"


def _head(target: Target, on: dict) -> str | None:
    return None if lm_head_weight(target.model) is not None else "the LM head is not a plain linear layer held here"


def _onednn(target: Target, on: dict) -> str | None:
    if not onednn_is_faster():
        return "MKL is as fast on this CPU"
    if target.stage in ("sft", "rm", "dpo") and not onednn_weight_grads():
        return "training only: MKL's weight gradients are faster before Zen 5"
    return None


def _lean_modules(target: Target, on: dict) -> str | None:
    names = {type(m).__name__ for m in target.model.modules()}
    return None if names & set(RMSNORM_CLASSES + MLP_CLASSES) else "no Llama-family RMSNorm or SwiGLU"


def _wide(target: Target, on: dict) -> str | None:
    width = getattr(target.config, "hidden_size", 0) or 0
    return None if width >= kernels.MIN_WIDTH else f"hidden size {width} < {kernels.MIN_WIDTH}"


def _compiled(target: Target, on: dict) -> str | None:
    return None if kernels.available() else "the C kernels did not build"


def _decode_kernel(target: Target, on: dict) -> str | None:
    return None if decode_kernel_available() else "no AVX-512 kernel"


def _kept_grads(target: Target, on: dict) -> str | None:
    if not target.keep_grads:
        return "gradients freed between steps"
    if getattr(target.engine, "name", "") != "local":
        return "DeepSpeed owns the gradients"
    if not any(grad_in_place_takes(p) for p in target.model.parameters()):
        return f"no trainable matrix of {MIN_ELEMENTS >> 20}M elements"
    return None


def _group_attention(target: Target, on: dict) -> str | None:
    if target.engine.generation_kwargs(target.model).get("synced_gpus"):
        return "ZeRO-3: ranks decode in step"
    return None if group_cache(target.model, 1) is not None else f"attention {_attention(target)}"


def _custom_mask(target: Target, on: dict) -> str | None:
    return None if custom_mask_kind(target.model) else f"attention {_attention(target)} takes no custom mask"


POLICIES = ("actor", "reference")  # the models whose log-probs come from an LM head (not a scalar head)
READS_LOGITS = "reads logits (LM head not in chunks)"
ALL_ROLES = {"sft": ("policy",), "rm": ("reward_model",), "dpo": ("policy", "reference"),
             "ppo": ("actor", "critic", "reference", "reward")}
EVERY_STAGE = {stage: "load.lean_activations" for stage in ALL_ROLES}


def _check(fn) -> Callable[[Target, ModelPlan, float], bool]:
    """A check that takes (model, trial plan, rtol)."""
    return lambda target, trial, rtol: fn(target.model, trial, rtol)


def _packing_check(target: Target, trial: ModelPlan, rtol: float) -> bool:
    """The stage's packing check on the run's first rows (`Target.probe`)."""
    check = checks.sft_packing_is_exact if target.stage == "sft" else checks.rm_packing_is_exact
    probe = target.probe
    return probe is not None and check(target.model, trial, probe.rows, probe.pad_id, target.device, rtol)


def _probed(target: Target, on: dict) -> str | None:
    return None if target.probe else "no rows to check it on"


PATHS = (
    SpeedPath("onednn_linear", "oneDNN linears", ALL_ROLES, accel=True, applies=_cpu, prefers=_onednn,
              exact="GEMM rounding only (the pinned losses are kept per GEMM policy: tests/conftest.py pins_file)"),
    SpeedPath("lean_activations", "lean activations", ALL_ROLES, settings=EVERY_STAGE, accel=True,
              applies=_all(_cpu, _whole, _lean_modules),
              exact="each module's forward and gradients against its own on a random input at install "
                    "(accel.lean._same_values): 1e-5 of the largest, 2e-2 in half precision"),
    SpeedPath("fused_kernels", "fused kernels", ALL_ROLES, accel=True,
              settings={stage: "engine.fused_kernels" for stage in ALL_ROLES},
              applies=_all(_cpu, _wide, _compiled),
              exact="each kernel against autograd through the stock formulas (tests/unit/test_kernels.py): float "
                    "rounding; the rotation against transformers' at install (accel.rotary._same_values): 1e-5"),
    SpeedPath("streaming_decode", "streaming decode", {"ppo": ("actor",)}, accel=True,
              settings={"ppo": "engine.fused_kernels"}, applies=_all(_cpu, _wide, _decode_kernel),
              exact="the same bits for any batch; MKL's rounding apart (tests/unit/test_decode_gemm.py)"),
    SpeedPath("grad_in_place", "gradients in place", {"sft": ("policy",), "rm": ("reward_model",),
                                                      "dpo": ("policy",), "ppo": ("actor", "critic")},
              accel=True, applies=_all(_cpu, _kept_grads),
              exact="the same sum in another order (tests/unit/test_grad_in_place.py)"),
    SpeedPath("segment_attention", "per-sequence attention", {"sft": ("policy",), "rm": ("reward_model",),
                                                               "ppo": ("actor", "critic", "reference", "reward")},
              applies=_all(_cpu, _sdpa, _full_attention, _recomputed),
              exact="within the packing checks below (the same tokens attended, unmasked)"),
    SpeedPath("head_chunks", "LM head in chunks", {"sft": ("policy",), "dpo": ("policy", "reference"),
                                                   "ppo": POLICIES},
              settings={"sft": "chunked_loss", "dpo": "dpo.chunked_logprobs", "ppo": "ppo.chunked_logprobs"},
              applies=_all(_whole, _head), check=lambda t, trial, rtol: checks.head_gives_logits(t.model, rtol),
              exact="checks.head_gives_logits: logits = head(hidden) on 8 tokens, rtol = atol = 1e-4 (2e-2 bf16)"),
    SpeedPath("packing", "packed micro-batches", {"sft": ("policy",), "rm": ("reward_model",)},
              settings={"sft": "packing", "rm": "packing"},
              prefers=_all(_padded_on_gpu, _probed), check=_packing_check,
              exact="checks.sft_packing_is_exact / rm_packing_is_exact on the first rows: loss or scores, rtol "
                    "1e-4 (2e-2 bf16)"),
    SpeedPath("padding_free", "padding-free", {"ppo": ("actor", "critic", "reference", "reward")},
              settings={"ppo": "ppo.packing"}, applies=_needs("head_chunks", READS_LOGITS, POLICIES),
              prefers=_padded_on_gpu, check=_check(checks.packing_gives_padded_values),
              exact="checks.packing_gives_padded_values: two rows, one left-padded, rtol = atol = 1e-4 (2e-2 bf16)"),
    SpeedPath("packed_prefill", "packed prefill", {"ppo": ("actor",)}, settings={"ppo": "ppo.packing"},
              applies=_needs("segment_attention", "needs per-sequence attention"),
              check=lambda t, trial, rtol: checks.packed_prefill_is_exact(t.model, trial),
              exact="checks.packed_prefill_is_exact: prefill and one decode step, 1e-4 of the largest logit (5e-2 "
                    "half precision)"),
    SpeedPath("shared_prompt", "shared prompts once", {"dpo": ("policy", "reference"), "ppo": POLICIES},
              applies=_full_attention,
              exact="the same tokens and positions through a KV cache: float rounding (tests/unit/test_rollout.py, "
                    "tests/integration/test_dpo.py)"),
    SpeedPath("pair_packing", "prompt-sharing pairs", {"dpo": ("policy", "reference")}, applies=_custom_mask,
              exact="a custom mask over the same tokens and positions: float rounding "
                    "(tests/integration/test_dpo.py)"),
    SpeedPath("group_packing", "one packed row per group", {"ppo": ("actor", "critic", "reference")},
              settings={"ppo": "ppo.packing"},
              applies=_all(_whole, _needs("head_chunks", READS_LOGITS, POLICIES),
                           _needs("segment_attention", "needs per-sequence attention")),
              check=_check(checks.group_packing_gives_prefix_values),
              exact="checks.group_packing_gives_prefix_values against the two-forward paths, rtol = atol = 1e-4 "
                    "(2e-2 bf16)"),
    SpeedPath("common_prefix", "common prefix once", {"ppo": ("actor", "critic", "reference")},
              settings={"ppo": "ppo.shared_prefix"}, applies=_whole,
              check=_check(checks.common_prefix_gives_full_values),
              exact="checks.common_prefix_gives_full_values: three rows sharing 10 tokens, rtol = atol = 1e-4 "
                    "(2e-2 bf16)"),
    SpeedPath("group_decode", "group decode", {"ppo": ("actor",)}, applies=_group_attention,
              check=lambda t, trial, rtol: checks.group_decode_is_exact(t.model),
              exact="checks.group_decode_is_exact: 2 prompts x 2 samples x 3 steps, 1e-4 of the largest logit "
                    "(5e-2 half precision)"),
)
BY_NAME = {path.name: path for path in PATHS}


def plan_model(target: Target) -> ModelPlan:
    """The plan for `target`'s model: every entry that serves its stage and role, decided in registry order, the
    CPU kernels installed into the model (`accel.install`) before the forwards' paths are checked. Every rank calls
    it for the same models in the same order (checks' verdicts are agreed over ranks)."""
    autocast = getattr(target.engine, "autocast", None)
    on: dict = {}
    off: list = []
    installed = False
    for path in PATHS:
        roles = path.serves.get(target.stage, ())
        if target.role not in roles:
            continue
        if not path.accel and not installed:
            install(base_model(target.model), ModelPlan(**on))
            installed = True
        reason = _decide(path, target, on)
        if reason is None:
            on[path.name] = True
        else:
            off.append((path.name, reason))
    if not installed:
        install(base_model(target.model), ModelPlan(**on))
    return ModelPlan(**on, autocast=autocast.spec() if autocast is not None else None, off=tuple(off))


def _decide(path: SpeedPath, target: Target, on: dict) -> str | None:
    """Why `path` is off for `target` given the paths `on` so far, or None (on)."""
    if target.setting("engine.speed") == "reference":
        return REFERENCE_SETTING
    key = path.settings.get(target.stage)
    setting = target.setting(key)
    if setting is False:
        return f"{key}=false"
    reason = path.applies(target, on)
    if reason is not None or setting is True:
        return reason
    reason = path.prefers(target, on)
    if reason is not None or path.check is None:
        return reason
    rtol = target.rtol(path.rtol)
    failed = "its check found other values"
    try:
        passed = bool(path.check(target, ModelPlan(**on, **{path.name: True}), rtol))
    except Exception as exc:  # noqa: BLE001 - a check that cannot run (an attention kernel missing here): off
        passed, failed = False, f"its check could not run ({type(exc).__name__})"
    engine = target.engine
    if engine.reduce_sum(float(passed)) != engine.world_size:
        return failed if not passed else "its check failed on another rank"
    return None


def plan_line(plans: dict) -> str:
    """The first log lines of a stage: `speed plan: on: ...` and `speed plan: off: ...`, every path considered for
    the models in `plans` ({name: ModelPlan}), in registry order: those on grouped by the models they are on for
    ("actor, critic: A, B; actor: C"), and for each off, why. Names the models only when there are several."""
    several = len(plans) > 1
    on, off = {}, []  # on: the models -> the labels of the paths on for exactly those
    for name in PATH_NAMES:
        label = BY_NAME[name].label
        users = [model for model, plan in plans.items() if getattr(plan, name)]
        if users:
            on.setdefault(", ".join(users), []).append(label)
        reasons: dict = {}
        for model, plan in plans.items():
            why = dict(plan.off).get(name)
            if why is not None:
                reasons.setdefault(why, []).append(model)
        if not reasons:
            continue
        if len(reasons) == 1 and not users:
            off.append(f"{label} ({next(iter(reasons))})")
        else:
            off.append(f"{label} (" + "; ".join(f"{', '.join(models)}: {why}" if several else why
                                                for why, models in reasons.items()) + ")")
    shown = "; ".join(f"{models}: {', '.join(labels)}" if several else ", ".join(labels)
                      for models, labels in on.items())
    return f"speed plan: on: {shown or 'none'}\nspeed plan: off: {', '.join(off) or 'none'}"
