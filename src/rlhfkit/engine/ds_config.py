"""The DeepSpeed configs rlhfkit generates from `engine.*` and `train.*`, and the check of a user's
`engine.deepspeed_config` against them. Pure dictionaries: no deepspeed import, so it is tested anywhere.

rlhfkit owns the keys that say what `config.yaml` records (the ZeRO stage, offload, precision) and the ones its
loop relies on (batching and accumulation, gradient clipping, the optimizer and schedule). A user JSON may add
anything else (bucket sizes, communication overlap, ...); setting an owned key to another value than the one
rlhfkit derives is a ConfigError naming both, never a silent override.
"""

from __future__ import annotations

from rlhfkit.config.fields import deep_merge
from rlhfkit.config.schema import EngineConfig, TrainConfig
from rlhfkit.errors import ConfigError

# DeepSpeed key (dotted) -> the rlhfkit key that decides it
OWNED = {
    "zero_optimization.stage": "engine.zero_stage",
    "zero_optimization.offload_optimizer.device": "engine.offload_optimizer",
    "zero_optimization.offload_param.device": "engine.offload_params",
    "bf16.enabled": "engine.precision",
    "fp16.enabled": "engine.precision",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "train_batch_size": "train.batch_size (rlhfkit's loop accumulates micro-batches itself)",
    "gradient_accumulation_steps": "train.batch_size (rlhfkit's loop accumulates micro-batches itself)",
    "gradient_clipping": "train.max_grad_norm",
}
# sections rlhfkit builds itself: any value in the user JSON contradicts them
BUILT = {"optimizer": "train.lr, train.betas, train.weight_decay (and engine.offload_optimizer)",
         "scheduler": "train.scheduler, train.warmup_steps, train.min_lr_ratio"}
# DeepSpeed's other spellings of the owned settings: its "bfloat16" alias of "bf16", mixed-precision modes rlhfkit
# leaves off, and ZeRO's deprecated offload flags
ALIASES = {"bfloat16.enabled": "engine.precision", "torch_autocast.enabled": "engine.precision",
           "amp.enabled": "engine.precision"}
DEPRECATED = {"zero_optimization.cpu_offload": "engine.offload_optimizer",
              "zero_optimization.cpu_offload_param": "engine.offload_params",
              "zero_optimization.cpu_offload_use_pin_memory": "engine.offload_optimizer / engine.offload_params"}
# sections that DeepSpeed reads as objects (true / false / null there are other, older forms)
SECTIONS = ("zero_optimization", "bf16", "bfloat16", "fp16", "torch_autocast", "amp")


def stage_of(cfg: EngineConfig, role: str) -> int:
    """The ZeRO stage of a model role: the critic's own when `engine.critic_zero_stage` is set, else
    `engine.zero_stage` (the policy's, which frozen models follow)."""
    if role == "critic" and cfg.critic_zero_stage is not None:
        return cfg.critic_zero_stage
    return cfg.zero_stage


def precision(cfg: EngineConfig) -> dict:
    return {"bf16": {"enabled": cfg.precision == "bf16"},
            "fp16": {"enabled": cfg.precision == "fp16", "auto_cast": False}}


def train_config(cfg: EngineConfig, train: TrainConfig, stage: int, world_size: int, pin_memory: bool) -> dict:
    """A trained model's config. Accumulation is the loop's (`managed_gradient_accumulation: false`): it calls
    backward once per micro-batch with a normalised loss and step once per optimizer step."""
    zero: dict = {"stage": stage}
    if cfg.offload_optimizer and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if cfg.offload_params and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": train.micro_batch_size * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": train.max_grad_norm if train.max_grad_norm > 0 else 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
        **precision(cfg),
    }


# the keys of a user JSON that concern training only: a frozen model's config leaves them out
TRAINING_ONLY = ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps", "gradient_clipping", "zero_optimization.offload_optimizer")


def eval_config(cfg: EngineConfig, stage: int, world_size: int, user: dict | None = None) -> dict:
    """A frozen model's config: partitioned with ZeRO-3 when the trained models are, else whole on each rank; the
    user's JSON merged over it but for the training keys (`TRAINING_ONLY`), so its ZeRO-3 tuning (live parameters,
    prefetch and bucket sizes, ...) reaches the frozen models too."""
    zero = {"stage": 3 if stage == 3 else 0}
    if cfg.offload_params and stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    generated = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world_size, "zero_optimization": zero,
                 "steps_per_print": 10**12, **precision(cfg)}
    frozen = {key: value for key, value in (user or {}).items() if key not in TRAINING_ONLY}
    if isinstance(frozen.get("zero_optimization"), dict):
        # its stage is the trained models' (checked); a frozen model's is 3 or 0, as generated
        frozen["zero_optimization"] = {key: value for key, value in frozen["zero_optimization"].items()
                                       if f"zero_optimization.{key}" not in TRAINING_ONLY and key != "stage"}
    return merged_config(generated, frozen)


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _same(ours, theirs) -> bool:
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return bool(ours) == bool(theirs)
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)):
        return float(ours) == float(theirs)
    return ours == theirs


def _offload_device(value) -> str:
    return "none" if value in (None, "none") else str(value)


def check_user_config(user: dict, source: str, cfg: EngineConfig, train: TrainConfig | None,
                      world_size: int) -> None:
    """ConfigError when the user's JSON sets an owned key to something else than what `engine.*` / `train.*`
    give (for every trained role's stage); silent when it only adds other keys or repeats ours."""
    problems = [f"'{key}' (rlhfkit builds it from {owner})" for key, owner in BUILT.items() if key in user]
    problems += [f"'{key}' = {user[key]!r} (rlhfkit sets this section from engine.*; give it as an object of other "
                 f"keys)" for key in SECTIONS if key in user and not isinstance(user[key], dict)]
    problems += [f"'{key}' (an old form of offload: rlhfkit sets offload from {owner})" for key, owner in
                 DEPRECATED.items() if _get(user, key) is not None]
    for key, owner in ALIASES.items():  # ours: the bf16 alias follows engine.precision, the others are off
        theirs, ours = _get(user, key), key == "bfloat16.enabled" and cfg.precision == "bf16"
        if theirs is not None and not _same(ours, theirs):
            problems.append(f"{key} = {theirs!r}, but {owner} gives {ours!r}")
    for key in ("zero_optimization.offload_optimizer", "zero_optimization.offload_param"):
        if isinstance(user.get("zero_optimization"), dict) and key.split(".")[1] in user["zero_optimization"] \
                and _get(user, key) is None:
            user = deep_merge(user, {"zero_optimization": {key.split(".")[1]: {"device": "none"}}})  # null: off
    roles = ("policy", "critic")
    generated = [train_config(cfg, train, stage_of(cfg, role), world_size, False) if train is not None
                 else {"zero_optimization": {"stage": stage_of(cfg, role)}, **precision(cfg)} for role in roles]
    for key, owner in OWNED.items():
        theirs = _get(user, key)
        if theirs is None:
            continue
        for role, ours_config in zip(roles, generated):
            ours = _get(ours_config, key)
            if key.endswith(".device"):
                ours, theirs = _offload_device(ours), _offload_device(theirs)
            elif ours is None:
                continue  # a training key when no train config is known
            if not _same(ours, theirs):
                name = "engine.critic_zero_stage" if role == "critic" and key == "zero_optimization.stage" \
                    and cfg.critic_zero_stage is not None else owner
                problems.append(f"{key} = {theirs!r}, but {name} gives {ours!r}")
                break
    if problems:
        raise ConfigError(f"config key 'engine.deepspeed_config': {source} contradicts rlhfkit's settings: "
                          f"{'; '.join(problems)}. Remove those keys from the JSON or change the rlhfkit keys "
                          f"(config.yaml records the rlhfkit keys, so they must be what runs)")


def merged_config(generated: dict, user: dict) -> dict:
    """The user's JSON merged over a generated config (only keys `check_user_config` let through)."""
    return deep_merge(generated, user)
