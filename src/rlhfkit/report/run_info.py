"""What ran in a stage's folder, for the report's "what ran" table: the verb and its algorithm (PPO's advantage
estimator, DPO's loss), the models, the data, the key settings and the duration.

Everything is read from what the stage wrote: `config.yaml` (the resolved config, every key filled in), the rows of
`metrics.jsonl` (each step's own seconds) and the times of its files. A folder without config.yaml (a run from
before it was written, a demo's base model) has no table. Settings are shown as `key=value`, as a command line
takes them, so a row can be pasted to run it again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from pathlib import Path

import yaml

from rlhfkit.config.ppo_schema import reward_kind
from rlhfkit.metric_names import TIME_ITERATION, TIME_STEP
from rlhfkit.registry.estimators import ESTIMATORS
from rlhfkit.registry.preference import PREFERENCE_LOSSES
from rlhfkit.report.metrics import series
from rlhfkit.run_files import CONFIG_FILE, FINAL_DIR, METRICS_FILE, RESULT_FILE, SAMPLES_FILE, final_dir

SEP = " · "


@dataclass(frozen=True)
class WhatRan:
    """`algorithm`: what the page calls the run ("GRPO", "IPO", "SFT"); `verb`: the command (`rlhfkit ppo`);
    `rows`: (what, text) in table order; `config`: the config.yaml they were read from."""

    algorithm: str
    verb: str
    rows: list[tuple[str, str]]
    config: dict = field(default_factory=dict)


def read_config(folder: Path) -> dict | None:
    """The folder's config.yaml as a dict (None when there is none); ValueError when it is not YAML."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    return data if isinstance(data, dict) else None


def what_ran(stage: str, folder: Path, rows: list[dict]) -> WhatRan | None:
    """The table of the stage run in `folder` (its metrics `rows`); None without config.yaml or for a stage
    rlhfkit has no verb for."""
    describe = VERBS.get(stage)
    cfg = read_config(folder) if describe else None
    if cfg is None:
        return None
    algorithm, table = describe(cfg)
    took = duration(folder, rows, "iterations" if stage == "ppo" else "steps")
    return WhatRan(algorithm, f"rlhfkit {stage}", table + ([("duration", took)] if took else []), cfg)


def _get(cfg: dict, key: str):
    """`cfg["a"]["b"]` for "a.b"; None where a level is missing (a config.yaml of an older version)."""
    for part in key.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def _value(value) -> str:
    """A value as a dotted override takes it (YAML's spelling of booleans and null)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _settings(cfg: dict, *keys: str) -> str:
    """"k=v · k=v" for the keys present in the config."""
    return SEP.join(f"{key}={_value(_get(cfg, key))}" for key in keys if _get(cfg, key) is not None)


def _source(value) -> str:
    """A data source: a path or hub name, or a mix [{path, weight}, ...]."""
    if isinstance(value, list):
        return ", ".join(f"{item.get('path')} × {_value(item.get('weight', 1))}" if isinstance(item, dict)
                         else str(item) for item in value)
    return _value(value)


def _train_source(cfg: dict, key: str) -> str:
    """What the step trained on: `key`'s source, else (no source of its own) the task's generated rows."""
    if _get(cfg, key) is None and _get(cfg, "task.name"):
        return f"{_settings(cfg, 'task.name', 'task.size')} questions (reasoning-gym)"
    return _source(_get(cfg, key))


def _eval_source(cfg: dict, key: str, train_key: str) -> str:
    """Where this run's eval rows came from: none, `key`'s source, the task's held-out questions, the training
    source's own eval split, or a share of it held out."""
    if not _get(cfg, "data.eval_max_rows"):
        return "none (data.eval_max_rows=0)"
    if _get(cfg, key):
        return _source(_get(cfg, key))
    if _get(cfg, train_key) is None and _get(cfg, "task.name"):
        return f"the task's {_settings(cfg, 'task.eval_size')} held-out questions"
    spec = _get(cfg, train_key)
    names = [item.get("path") if isinstance(item, dict) else item for item in spec] if isinstance(spec, list) \
        else [spec]
    return SEP.join(_held_out(cfg, str(name), len(names) > 1) for name in names)


def _held_out(cfg: dict, name: str, mixed: bool) -> str:
    """A training source's eval rows: its own eval split (a folder's test.jsonl, a DatasetDict's test split), else
    data.eval_fraction of it. Said as the data loader decides it (`eval_split_of`) where the source is on this
    machine; a hub dataset the report does not ask about."""
    from rlhfkit.data.presets import resolve_source

    src = resolve_source(name, 1.0, _get(cfg, "data.preset"), _get(cfg, "data.local_dir"))
    whose = f"{name}'s" if mixed else "its"
    if not Path(src.location).exists():
        return f"not known here: {name} is not on this machine to tell whether it has an eval split of its own"
    # the data loader imports torch; loaded only here, for a run whose eval rows hang on its source's splits
    from rlhfkit.data.loader import eval_split_of

    split = eval_split_of(src, _get(cfg, "data.split") or "train")
    if split:
        return f"{whose} own {split} split"
    return f"{_settings(cfg, 'data.eval_fraction')} of {name if mixed else 'it'}, held out"


def _steps(cfg: dict) -> str:
    steps = _get(cfg, "train.max_steps") or 0
    return _settings(cfg, "train.max_steps" if steps > 0 else "train.epochs")


def _lora(cfg: dict) -> tuple[str, str]:
    if not _get(cfg, "lora.rank"):
        return "LoRA", "off (lora.rank=0: full fine-tuning)"
    return "LoRA", _settings(cfg, "lora.rank", "lora.alpha")


def _engine(cfg: dict, *deepspeed_keys: str) -> tuple[str, str]:
    """The distributed engine: its backend and precision; with DeepSpeed its ZeRO stage and the offloads on."""
    if _get(cfg, "engine.backend") != "deepspeed":
        return "engine", _settings(cfg, "engine.backend", "engine.precision")
    offloads = [key for key in ("engine.offload_optimizer", "engine.offload_params") if _get(cfg, key)]
    return "engine", _settings(cfg, "engine.backend", "engine.zero_stage", *deepspeed_keys, *offloads,
                               "engine.precision")


def _default(name, default: str) -> str:
    return _value(name) if name else f"{default} (default)"


def _sft(cfg: dict) -> tuple[str, list]:
    return "SFT", [
        ("model", _value(cfg.get("model"))),
        ("data", f"train: {_train_source(cfg, 'data.train')}{SEP}eval: {_eval_source(cfg, 'data.eval', 'data.train')}"),
        ("training", _settings(cfg, "train.lr", "train.batch_size", "train.micro_batch_size") + SEP + _steps(cfg)),
        _lora(cfg), _engine(cfg),
    ]


def _rm(cfg: dict) -> tuple[str, list]:
    _, rows = _sft(cfg)
    if _get(cfg, "rm.margin"):
        rows[2] = ("training", rows[2][1] + SEP + _settings(cfg, "rm.margin"))
    return "RM", rows


def _dpo(cfg: dict) -> tuple[str, list]:
    name = _get(cfg, "dpo.loss")
    loss = PREFERENCE_LOSSES.get(name)
    reads = [f"dpo.{key}" for key in (loss.settings if loss else ())]
    extra = [key for key in ("dpo.rpo_alpha",) if _get(cfg, key)]  # RPO's NLL term, any loss; off at 0
    described = f"dpo.loss={name} — {loss.doc}" if loss else f"dpo.loss={name}"
    if not (loss and loss.reference):
        reference = f"none ({name} needs no reference)" if loss else "?"
    elif _get(cfg, "dpo.reference_free"):
        reference = "none (dpo.reference_free=true)"
    else:
        reference = _default(cfg.get("reference"), _with_lora(cfg, "the model"))
    _, rows = _sft(cfg)
    return (loss.doc.split(":")[0] if loss else str(name)), [
        ("loss", SEP.join(filter(None, [described, _settings(cfg, *reads, *extra)]))),
        rows[0], ("reference", reference), *rows[1:],
    ]


def _with_lora(cfg: dict, model: str) -> str:
    return f"{model} with its LoRA adapter disabled" if _get(cfg, "lora.rank") else model


REWARD_KINDS = {"function": "a Python function", "url": "a reward server", "model": "a reward model"}


def _reward(spec) -> str:
    if isinstance(spec, list):  # a weighted sum: [{reward, weight, name}, ...]
        return SEP.join(f"{_reward(p.get('reward'))} × {_value(p.get('weight', 1))}" if isinstance(p, dict)
                        else _reward(p) for p in spec)
    if not isinstance(spec, str):
        return _value(spec)
    return f"{spec} ({REWARD_KINDS[reward_kind(spec)]})"


def _reward_row(cfg: dict) -> str:
    """What judged this run's samples: the environment, the task's scorer, or the `reward` spec(s)."""
    if cfg.get("env"):
        return "the episode's return, from the environment (below)"
    if cfg.get("reward") is None and _get(cfg, "task.name"):
        return f"the task's own scorer ({_settings(cfg, 'task.name')}, reasoning-gym)"
    return _reward(cfg.get("reward"))


def _reward_models(cfg: dict) -> list[str]:
    """The reward-model folders among the `reward` parts (none for an env run or a task's scorer)."""
    if cfg.get("env"):
        return []
    specs = cfg.get("reward") if isinstance(cfg.get("reward"), list) else [cfg.get("reward")]
    specs = [s.get("reward") if isinstance(s, dict) else s for s in specs]
    return [s for s in specs if isinstance(s, str) and reward_kind(s) == "model"]


def _critic(cfg: dict, name: str, estimator) -> str:
    if estimator is not None and not estimator.critic:
        return f"none ({name} needs no critic)"
    if cfg.get("critic"):
        return _value(cfg["critic"])
    models = _reward_models(cfg)
    start = _critic_start(cfg, models) if models else ""
    if start is None:
        return (f"not known here: the run chose between {', '.join(models)} and the actor by their tokenizers, "
                f"which cannot be read on this machine")
    if start:
        return f"{start} (the reward model reads the actor's tokens: its score head starts the value head; default)"
    differs = f"; {', '.join(models)} tokenizes differently" if models else ""
    return f"the actor with a fresh value head (default{differs})"


def _critic_start(cfg: dict, models: list[str]) -> str | None:
    """The reward model the run's critic started from, as `stages.ppo_setup.critic_source` chose it: the first
    whose tokenizer reads the actor's token ids ("" for none: the actor). None where a tokenizer is not a folder
    on this machine (a hub id is not fetched for a report)."""
    actor = _get(cfg, "load.tokenizer") or cfg.get("actor")
    if not all(isinstance(f, str) and Path(f).expanduser().is_dir() for f in [actor, *models]):
        return None
    # transformers loads only here, for a run whose critic hangs on its tokenizers
    from rlhfkit.config.schema import LoadConfig
    from rlhfkit.errors import ModelError
    from rlhfkit.models.loading import load_tokenizer
    from rlhfkit.models.reward_fn import same_tokenization

    known = {f.name for f in fields(LoadConfig)}
    opts = LoadConfig(**{k: v for k, v in (_get(cfg, "load") or {}).items() if k in known})
    try:
        actor_tok = load_tokenizer(cfg["actor"], opts)
        return next((spec for spec in models
                     if same_tokenization(load_tokenizer(spec, replace(opts, tokenizer=None)), actor_tok)), "")
    except (ModelError, OSError, ValueError):
        return None


def _environment(cfg: dict) -> list[tuple[str, str]]:
    """An env run's environment, the tools its model was given and the episode's limits."""
    if not cfg.get("env"):
        return []
    tools = _get(cfg, "episode.tools") or []
    sandbox = ("episode.code_sandbox",) if "python" in tools else ()  # where model-written code ran
    return [
        ("environment", _settings(cfg, "env", *(("episode.env_args",) if _get(cfg, "episode.env_args") else ()))),
        ("tools", _settings(cfg, "episode.tools", *sandbox) if tools else "none listed (episode.tools=[])"),
        ("turns", _settings(cfg, "episode.max_turns", "episode.max_tokens")),
    ]


def _judge(cfg: dict) -> list[tuple[str, str]]:
    """The held-out evaluation's second judge, when the run had one."""
    judge = _get(cfg, "eval.judge")
    return [("judge", f"eval.judge={_reward(judge)}: scores the held-out responses as eval/gold")] if judge else []


def _rollout(cfg: dict) -> list[tuple[str, str]]:
    """What sampled the responses: rlhfkit's decoder, or vLLM in the trainer's process or at a server."""
    engine = _get(cfg, "rollout.engine")
    if engine is None:  # a config.yaml from before rollout.* (the native decoder was all there was)
        return []
    if engine != "vllm":
        return [("rollout", f"rollout.engine={engine} (rlhfkit's decoder on the actor)")]
    where = _settings(cfg, "rollout.server") if _get(cfg, "rollout.server") else \
        f"colocated in the trainer's process{SEP}{_settings(cfg, 'rollout.memory')}"
    tis = _settings(cfg, "rollout.tis_cap") if _get(cfg, "rollout.tis_cap") is not None else "rollout.tis_cap=null"
    return [("rollout", f"rollout.engine=vllm{SEP}{where}{SEP}{tis}")]


def _kl(cfg: dict, estimator) -> str:
    in_loss = "ppo.kl_loss_coef=" + _value(_get(cfg, "ppo.kl_loss_coef")) + " (a k3 term in the loss)"
    if estimator is not None and estimator.kl_in == "loss":
        return in_loss if _get(cfg, "ppo.kl_loss_coef") else "none (ppo.kl_loss_coef=0)"
    adaptive = ("ppo.adaptive_kl", "ppo.kl_target") if _get(cfg, "ppo.adaptive_kl") else ()
    in_reward = _settings(cfg, "ppo.kl_coef", "ppo.kl_estimator", *adaptive) + " (in the reward)"
    return in_reward + (SEP + in_loss if _get(cfg, "ppo.kl_loss_coef") else "")


def _ppo(cfg: dict) -> tuple[str, list]:
    name = _get(cfg, "ppo.advantage_estimator")
    estimator = ESTIMATORS.get(name)
    # an estimator with a critic is PPO proper; a critic-free one is the method its entry names first
    algorithm = "PPO" if estimator is None or estimator.critic else estimator.doc.split()[0]
    prompts = (f"prompts: {_train_source(cfg, 'data.prompts')}{SEP}"
               f"eval: {_eval_source(cfg, 'data.eval_prompts', 'data.prompts')}")
    if _get(cfg, "ptx.coef"):
        prompts += f"{SEP}ptx: {_source(_get(cfg, 'data.ptx'))} ({_settings(cfg, 'ptx.coef')})"
    update = [key for key, off in (("ppo.mini_batch_size", 0), ("ppo.epochs", 1)) if _get(cfg, key) not in (off, None)]
    sampling = [key for key, off in (("gen.top_p", 1), ("gen.top_k", 0)) if _get(cfg, key) not in (off, None)]
    return algorithm, [
        ("estimator", f"ppo.advantage_estimator={name}" + (f" — {estimator.doc}" if estimator else "")),
        ("actor", _value(cfg.get("actor"))),
        ("reward", _reward_row(cfg)),
        *_environment(cfg), *_judge(cfg),
        ("critic", _critic(cfg, name, estimator)),
        ("reference", _default(cfg.get("reference"), _with_lora(cfg, "the actor"))),
        ("data", prompts),
        ("training", _settings(cfg, "train.lr", "train.batch_size", "ppo.n_samples_per_prompt",
                               "train.micro_batch_size", *update, "train.max_steps")),
        ("generation", _settings(cfg, "gen.max_new_tokens", "gen.temperature", *sampling)),
        ("KL", _kl(cfg, estimator)),
        *_rollout(cfg), _lora(cfg),
        _engine(cfg, *(("engine.critic_zero_stage",) if estimator and estimator.critic
                       and _get(cfg, "engine.critic_zero_stage") is not None else ())),
    ]


VERBS = {"sft": _sft, "rm": _rm, "dpo": _dpo, "ppo": _ppo}  # a stage's metrics "stage" -> its table


def _one_update(cfg: dict) -> str | None:
    """Why PPO's clip fraction and approx. KL are 0: the one update of each iteration is computed before the policy
    moves (its ratio to the sampling policy is 1, to float rounding). None where the run made more updates per
    iteration."""
    samples = (_get(cfg, "train.batch_size") or 0) * (_get(cfg, "ppo.n_samples_per_prompt") or 1)
    if _get(cfg, "ppo.epochs") == 1 and (_get(cfg, "ppo.mini_batch_size") or samples) == samples:
        return ("one update per iteration (ppo.epochs=1, one mini-batch) never moves the policy away from the one "
                "that sampled")
    return None


# why a metric is 0 at every step, where this run's config says: metric -> (config -> reason or None)
ZERO_BECAUSE = {
    "clip_fraction": _one_update,
    "approx_kl": _one_update,
    "kl_coef": lambda cfg: "ppo.kl_coef=0 (no KL penalty in the reward)" if _get(cfg, "ppo.kl_coef") == 0 else None,
}


def zero_note(cfg: dict, keys: list[str]) -> str:
    """One line naming the metrics the plots leave out for being 0 at every step, and why where `cfg` (the run's
    config.yaml, {} without one) says: "clip_fraction and approx_kl are 0 at every step: one update ..."."""
    by_reason: dict[str | None, list[str]] = {}
    for key in keys:
        because = ZERO_BECAUSE.get(key)
        by_reason.setdefault(because(cfg) if because and cfg else None, []).append(key)
    parts = []
    for reason, names in sorted(by_reason.items(), key=lambda item: item[0] is None):  # explained ones first
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        verb = "is" if len(names) == 1 else "are"
        parts.append(f"{listed} {verb} 0 at every step" + (f": {reason}" if reason else ""))
    return "; ".join(parts)


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        minutes, seconds = divmod(round(s), 60)
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(round(s / 60), 60)
    return f"{hours} h {minutes} min"


def _span(start: float, end: float) -> str:
    """"2026-01-02 03:04:05 → 03:04:47 CET" in local time (the end's date only when it is another day)."""
    a, b = datetime.fromtimestamp(start).astimezone(), datetime.fromtimestamp(end).astimezone()
    return f"{a:%Y-%m-%d %H:%M:%S} → {b:{'%H:%M:%S' if a.date() == b.date() else '%Y-%m-%d %H:%M:%S'}} {b:%Z}"


def _written_by_run(folder: Path) -> list[Path]:
    """The files a stage writes as it trains and at its end (not the report, nor the pipeline's log.txt, which
    later commands append to)."""
    files = [folder / name for name in (METRICS_FILE, SAMPLES_FILE)]
    files += [p for final in folder.glob(f"{FINAL_DIR}*") if final.is_dir() for p in final.iterdir()]
    return [p for p in files if p.is_file()]


def duration(folder: Path, rows: list[dict], unit: str) -> str | None:
    """How long the run took, from what it wrote.

    - the pipeline's result.json: the whole step's seconds, model loading included;
    - the clock: config.yaml is written once the models loaded, then metrics.jsonl, samples.jsonl and final/ as it
      trains and ends, so their times span the training (a resumed run's config.yaml: from the resume);
    - the steps' own seconds (`time/step`, PPO's `time/iteration`) summed: they survive a copy of the folder.
    A copy that did not keep the files' times shows a clock shorter than the steps took: the clock is left out.
    """
    parts = []
    result = folder / RESULT_FILE
    if result.is_file():
        try:
            seconds = json.loads(result.read_text(encoding="utf-8")).get("seconds")
        except (json.JSONDecodeError, AttributeError):
            seconds = None
        if isinstance(seconds, (int, float)):
            parts.append(f"{_seconds(seconds)} in all (loading included)")
    steps, step_seconds = series(rows, TIME_ITERATION if unit == "iterations" else TIME_STEP)
    in_steps = float(step_seconds.sum())
    written = _written_by_run(folder)
    if (folder / CONFIG_FILE).is_file() and written:
        start = (folder / CONFIG_FILE).stat().st_mtime
        end = max(p.stat().st_mtime for p in written)
        if end - start >= 0.9 * in_steps and end > start:
            how = "" if final_dir(folder).is_dir() else " (no final/: stopped early, or still running)"
            parts.append(f"{_seconds(end - start)}: {_span(start, end)}{how}")
    if len(steps):
        parts.append(f"{_seconds(in_steps)} in the {len(steps)} {unit}")
    return SEP.join(parts) or None
