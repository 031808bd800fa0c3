"""The config of each stage, as typed dataclasses. Every field's doc is shown by `rlhfkit CMD --help`."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

from rlhfkit.config.fields import option
from rlhfkit.config.task_schema import TaskConfig
from rlhfkit.errors import ConfigError


@dataclass
class SourceOptions:
    """How a stage reads its data source: one block shared by every stage's `data` section (SFT and RM rows in
    DataConfig, PPO prompts in PPODataConfig); each adds its source keys and its token budget."""

    eval_fraction: float = option(0.05, "fraction of the training rows held out for evaluation when no eval source "
                                        "is set")
    eval_max_rows: int = option(512, "at most this many evaluation rows (keeps eval fast; 0: no evaluation); "
                                     "from a mix, a seeded sample across its sources")
    format: str = option("auto", "row format: auto (detected) or a format name (docs/data.md)")
    fields: dict = option({}, "rename fields, canonical->yours, e.g. {prompt: question, response: answer}")
    template: str = option("auto", "auto: the tokenizer's chat template if it has one, else plain (plain too when "
                                   "the model folder was trained plain by rlhfkit); or chat|plain",
                           choices=("auto", "chat", "plain"))
    split: str = option("train", "split to read from a save_to_disk DatasetDict or a hub dataset")
    max_rows: int = option(-1, "use at most this many training rows (-1 or 0: all): a source's first rows, or "
                                "from a mix a seeded sample across its sources")
    preset: Optional[str] = option(None, "seed-dataset preset for a local path, e.g. Dahoas/rm-static (docs/data.md: "
                                         "Seed datasets): sets format and eval split; implied when the source is "
                                         "a preset's name")
    local_dir: Optional[str] = option(None, "folder of local dataset copies: hub name owner/name is read from "
                                            "<local_dir>/owner/name (folder) or <local_dir>/owner/name.jsonl when "
                                            "present; default: $RLHFKIT_DATA_DIR")
    split_fractions: list = option([], "DeepSpeed-Chat's data_split: relative shares of every source's rows for "
                                       "the steps, e.g. [2, 4, 4]; this step reads share data.split_index "
                                       "(fixed shuffle, same in every step); [] = all rows")
    split_index: int = option(0, "which share of data.split_fractions this step reads (0-based; pipeline: 0 sft, "
                                 "1 rm, 2 ppo)")
    strict_rows: bool = option(False, "a row with nothing to learn from (no user turn, an empty turn to answer or "
                                      "reply, a chat template that refuses it) is an error naming file:line, "
                                      "instead of skipped and counted in the log")
    cache: bool = option(True, "cache tokenised rows under data.cache_dir; a re-run with the same data, tokenizer "
                               "and data options skips reading and tokenising")
    cache_dir: Optional[str] = option(None, "tokenised-data cache folder; default: $RLHFKIT_CACHE_DIR, else "
                                            "$XDG_CACHE_HOME/rlhfkit, else ~/.cache/rlhfkit")

    def validate(self, prefix: str = "") -> None:
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"config key '{prefix}eval_fraction': must be in [0, 1), got {self.eval_fraction:g}")
        if self.eval_max_rows < 0:
            raise ConfigError(f"config key '{prefix}eval_max_rows': must be >= 0 (0: no evaluation), got "
                              f"{self.eval_max_rows}")


def check_lora_dropout(load: "LoadConfig", lora: "LoraConfig", prefix: str = "") -> None:
    """PPO and DPO compare log-probs of forwards with and without gradients (rollout or reference against the
    update): LoRA's dropout, active only in training forwards, would make the first update off-policy."""
    if lora.dropout > 0 and load.disable_dropout:
        raise ConfigError(f"config key '{prefix}lora.dropout': {lora.dropout:g} while load.disable_dropout is true "
                          f"(every dropout probability 0: the update's log-probs must be the rollout's and the "
                          f"reference's); set lora.dropout=0, or load.disable_dropout=false for dropout everywhere")


def source_options(cfg: SourceOptions) -> dict:
    """The shared block's values, to build one data section from another."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(SourceOptions)}


@dataclass
class DataConfig(SourceOptions):
    train: Any = option(None, "training data: a .jsonl/.json/.parquet/.csv file, a save_to_disk folder, a hub "
                              "name, or a list of {path, weight} to mix")
    eval: Optional[str] = option(None, "evaluation data (same kinds as train); default: the source's own eval "
                                       "split (a preset's, or a test/validation split beside train) when it has "
                                       "one, else data.eval_fraction of train")
    max_length: int = option(512, "tokens per sequence (prompt + response); longer rows are truncated")
    loss_on: str = option("response", "sft: train on response tokens only, or on the whole sequence",
                          choices=("response", "all"))
    on_long_prompt: str = option("drop", "a row whose prompt alone fills max_length: drop it (counted in the log) "
                                         "or error (names file:line)", choices=("drop", "error"))

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        if self.max_length < 2:
            raise ConfigError(f"config key '{prefix}max_length': must be >= 2 (a prompt token and a token to "
                              f"learn), got {self.max_length}")


@dataclass
class TrainConfig:
    epochs: int = option(1, "passes over the training data (ignored when max_steps > 0; ppo: unused)")
    max_steps: int = option(-1, "optimizer steps to run; -1 (or 0) = from epochs (ppo: iterations, required)")
    batch_size: int = option(16, "examples per optimizer step, over all ranks (ppo: prompts per iteration)")
    micro_batch_size: int = option(4, "examples per forward pass per rank; batch_size/micro/world = accumulation")
    balance_micro_batches: bool = option(True, "sft, rm: a step's rows into micro-batches by length (packed: even "
                                         "token totals, a lower peak; padded: similar lengths, less padding); the "
                                         "same step up to float rounding. false: the shuffled order")
    lr: float = option(1.0e-5, "peak learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay (not applied to biases and norms)")
    betas: list = option([0.9, 0.95], "AdamW betas")
    scheduler: str = option("cosine", "learning-rate schedule after warmup", choices=("cosine", "linear", "constant"))
    warmup_steps: int = option(0, "linear warmup steps")
    min_lr_ratio: float = option(0.0, "final lr as a fraction of lr (cosine/linear)")
    max_grad_norm: float = option(1.0, "clip the global gradient norm to this (0 = off)")
    seed: int = option(1234, "random seed (data order, init of new heads, sampling)")
    log_every: int = option(1, "log metrics every N steps")
    eval_every: int = option(50, "evaluate every N steps (0 = only at the end)")
    save_every: int = option(100, "save a resumable checkpoint every N steps (0 = never)")
    keep_checkpoints: int = option(2, "keep the last K checkpoints")

    def validate(self, prefix: str = "") -> None:
        for key in ("batch_size", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{prefix}{key}': must be >= 1, got {getattr(self, key)}")
        if self.lr < 0:
            raise ConfigError(f"config key '{prefix}lr': must be >= 0")
        if self.epochs < 1 and self.max_steps <= 0:
            raise ConfigError(f"config key '{prefix}epochs': {self.epochs} would train nothing: must be >= 1 "
                              f"(or set max_steps)")
        betas = self.betas
        if not (isinstance(betas, list) and len(betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"config key '{prefix}betas': expected two numbers in [0, 1) (AdamW's beta1, beta2), "
                              f"got {betas!r}")
        # (key, lowest allowed, what it means): a value below silently did something else (a modulo, a clamp)
        for key, low, meaning in (("weight_decay", 0, ""), ("warmup_steps", 0, ""), ("max_grad_norm", 0, " (0 = off)"),
                                  ("log_every", 1, ""), ("eval_every", 0, " (0 = only at the end)"),
                                  ("save_every", 0, " (0 = never)"), ("keep_checkpoints", 1, "")):
            value = getattr(self, key)
            if value < low:
                raise ConfigError(f"config key '{prefix}{key}': must be >= {low}{meaning}, got {value:g}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"config key '{prefix}min_lr_ratio': must be in [0, 1] (the final lr as a fraction of "
                              f"lr), got {self.min_lr_ratio:g}")


@dataclass
class LoadConfig:
    dtype: str = option("float32", "parameter dtype of the frozen models and a LoRA base (a model trained in "
                                   "full keeps float32 weights; engine.precision sets the compute)",
                        choices=("float32", "bfloat16", "float16", "auto"))
    trust_remote_code: bool = option(False, "allow model repos to run their own Python code (off: safer)")
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    lean_activations: bool = option(True, "Llama-family RMSNorm and SwiGLU MLP keep fewer tensors for backward and "
                                          "recompute the element-wise rest, their outputs included (bit for bit "
                                          "the same values; SmolLM2 keeps 47% fewer bytes for backward; no "
                                          "matmul recomputed); checked per module on a random input")
    disable_dropout: bool = option(True, "set every dropout probability to 0 (stable RLHF; PPO needs it); ppo "
                                         "and dpo refuse a lora.dropout > 0 while it is on")
    tokenizer: Optional[str] = option(None, "tokenizer folder or hub id; default: the model's")
    pad_token: Optional[str] = option(None, "pad token to use when the tokenizer has none; default: EOS")


@dataclass
class LoraConfig:
    rank: int = option(0, "LoRA rank; 0 = full fine-tuning. LoRA needs a larger train.lr than full fine-tuning "
                          "(its adapters start at zero), usually 1e-4 to 2e-4: train.lr keeps its default, 1e-5, "
                          "and the log notes LoRA at a rate below 5e-5")
    alpha: float = option(16.0, "LoRA alpha (scale = alpha / rank)")
    dropout: float = option(0.0, "dropout on the LoRA input")
    target_modules: Optional[list] = option(None, "module names to adapt; default: per architecture (all "
                                                  "attention and MLP projections)")

    def validate(self, prefix: str = "") -> None:
        if self.rank < 0:
            raise ConfigError(f"config key '{prefix}rank': must be >= 0 (0 = full fine-tuning), got {self.rank}")
        if self.rank > 0 and self.alpha <= 0:
            raise ConfigError(f"config key '{prefix}alpha': must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"config key '{prefix}dropout': must be in [0, 1), got {self.dropout}")


@dataclass
class EngineConfig:
    backend: str = option("local", "local (one process) or deepspeed", choices=("local", "deepspeed"))
    zero_stage: int = option(0, "DeepSpeed ZeRO stage", choices=(0, 1, 2, 3))
    offload_optimizer: bool = option(False, "DeepSpeed: keep optimizer states on CPU")
    offload_params: bool = option(False, "DeepSpeed ZeRO-3: keep parameters on CPU")
    precision: str = option("fp32", "training precision: fp32; bf16 (local: float32 weights, forwards under "
                                    "torch.autocast; deepspeed: its bf16 mode); fp16 (deepspeed, loss-scaled)",
                            choices=("fp32", "bf16", "fp16"))
    deepspeed_config: Optional[str] = option(None, "a DeepSpeed JSON merged over the generated config")
    critic_zero_stage: Optional[int] = option(None, "ppo: the critic's ZeRO stage (default: zero_stage, which the "
                                                    "actor uses; frozen models follow the actor)")
    offload_reference_model: bool = option(False, "ppo: keep the frozen reference and reward models on CPU "
                                                  "between uses (saves accelerator memory, costs transfers)")
    gather_for_generation: bool = option(True, "ZeRO-3: gather the actor's parameters once per rollout "
                                               "instead of once per generated token (faster, more memory)")
    keep_freed_memory: bool = option(True, "CPU runs on Linux: glibc's malloc keeps freed memory for reuse instead "
                                           "of returning it (no page faults per step, ~5-10% faster; the "
                                           "resident memory stays at its peak)")
    speed: str = option("auto", "the optional speed paths (first log line: which are on, why others are off): "
                                "auto, each where it applies and its one-off check passes; reference, none: plain "
                                "transformers forwards, padded batches, no CPU kernels", choices=("auto", "reference"))
    fused_kernels: bool = option(True, "CPU runs: the lean RMSNorm and SwiGLU (load.lean_activations) and the "
                                       "Llama rotary embedding run fused element-wise loops in C, built once per "
                                       "machine by the system's C compiler (cached; without one, PyTorch's "
                                       "operators); same values to float rounding, ~8% faster SFT steps at 20M; "
                                       "on CPUs with AVX-512 also the rollout's decode-step linear layers "
                                       "(one stream over each weight; ~45% less time than MKL at 8 rows)")
    collective_timeout_s: float = option(300.0, "deepspeed: seconds a rank waits in a training collective "
                                                "(all-reduce, barrier) for the others before it fails with an "
                                                "error: how long a run can hang on a dead or stuck rank. Waits for "
                                                "rank 0's file work alone (the HF export, checkpoint conversion) "
                                                "are bounded by 2 hours, or this if longer")

    def validate(self, prefix: str = "") -> None:
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"config key '{prefix}collective_timeout_s': expected a number of seconds > 0")
        if self.critic_zero_stage not in (None, 0, 1, 2, 3):
            raise ConfigError(f"config key '{prefix}critic_zero_stage': expected 0, 1, 2 or 3")
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError(f"config key '{prefix}offload_params': parameter offload needs zero_stage 3")
        if self.precision == "fp16" and self.backend == "local":
            raise ConfigError(f"config key '{prefix}precision': fp16 needs loss scaling, which DeepSpeed does: use "
                              f"engine.backend=deepspeed (one GPU works too), or bf16 with the local engine")
        if self.backend == "local":  # DeepSpeed's keys would be recorded in config.yaml and do nothing
            given = [key for key, value in (("zero_stage", self.zero_stage), ("critic_zero_stage",
                     self.critic_zero_stage), ("offload_optimizer", self.offload_optimizer), ("offload_params",
                     self.offload_params), ("deepspeed_config", self.deepspeed_config)) if value not in (None, 0, False)]
            if given:
                raise ConfigError(f"config key '{prefix}{given[0]}': a DeepSpeed setting, and engine.backend is local; "
                                  f"use engine.backend=deepspeed (one process works too), or unset it")
            return
        stages = [self.zero_stage] + ([self.critic_zero_stage] if self.critic_zero_stage is not None else [])
        if self.offload_optimizer and 0 in stages:
            raise ConfigError(f"config key '{prefix}offload_optimizer': optimizer offload needs ZeRO stage 1 or more "
                              f"for every trained model (zero_stage={self.zero_stage}, critic_zero_stage="
                              f"{self.critic_zero_stage})")
        if self.precision != "fp32" and 0 in stages:
            key = "zero_stage" if self.zero_stage == 0 else "critic_zero_stage"
            raise ConfigError(f"config key '{prefix}{key}': DeepSpeed's stage-0 {self.precision} optimizer "
                              f"accumulates gradients in {self.precision} and takes one Adam step on zero gradients "
                              f"as it starts (bias correction one step late, one weight decay step); use stage 1 "
                              f"(on one rank it holds what stage 0 holds) or engine.precision=fp32")


@dataclass
class LogConfig:
    tensorboard: bool = option(True, "write TensorBoard logs to output_dir/tensorboard")
    progress: bool = option(True, "show a progress bar")
    wandb: bool = option(False, "also log to Weights & Biases (needs `wandb` installed)")
    wandb_project: str = option("rlhfkit", "Weights & Biases project")
    report: bool = option(True, "write output_dir/report.html (plots of metrics.jsonl, samples) when the run "
                                "finishes; `rlhfkit report OUTPUT_DIR` redraws it any time")

    def validate(self, prefix: str = "") -> None:
        # with the config, not when the logger opens: by then the output folder was prepared (a --force run's
        # earlier outputs cleared)
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"config key '{prefix}wandb': true, but wandb is not installed (pip install wandb)")


@dataclass
class StepConfig:
    """The sections of the steps that train on a dataset (sft, rm, dpo); `SFTConfig` adds `task`."""

    model: Optional[str] = option(None, "the starting model: a local folder or a hub id")
    output_dir: str = option("runs/sft", "where final/, checkpoints/, metrics.jsonl and config.yaml go")
    data: DataConfig = option(DataConfig(), "data")
    train: TrainConfig = option(TrainConfig(), "optimisation")
    load: LoadConfig = option(LoadConfig(), "model loading")
    lora: LoraConfig = option(LoraConfig(), "LoRA")
    engine: EngineConfig = option(EngineConfig(), "backend")
    log: LogConfig = option(LogConfig(), "logging")
    packing: Optional[bool] = option(None, "sft and rm: padding-free micro-batches: rows concatenated, positions "
                                           "restarting per row, attention run per sequence (sdpa models) or kept "
                                           "inside each row by transformers' packed-sequence mask (same loss, no "
                                           "compute on padding or across sequences); null = on "
                                           "when a check on the first rows finds the padded batch's loss (dpo "
                                           "does not read it: it packs each pair itself where the model takes a "
                                           "custom attention mask)")
    chunked_loss: Optional[bool] = option(None, "sft: the LM head runs on the labelled positions only and its "
                                                "cross-entropy in chunks, gradients formed chunk by chunk, never "
                                                "holding the (tokens x vocabulary) logits (same loss, less memory "
                                                "and no head compute on prompt tokens); null = on when the head is "
                                                "a plain linear layer held on this rank (not a ZeRO-3 shard, not "
                                                "LoRA-adapted itself) and a check on the first rows finds the "
                                                "model's own loss")

    def validate(self, prefix: str = "") -> None:
        if not self.model:
            raise ConfigError(f"config key '{prefix}model': required (a model folder or hub id)")
        if self.data.train is None and not getattr(getattr(self, "task", None), "name", None):
            raise ConfigError(f"config key '{prefix}data.train': required (a data file, folder or hub name"
                              f"{'; or task.name: a reasoning-gym task' if hasattr(self, 'task') else ''})")
        if self.train.batch_size % self.train.micro_batch_size:  # ppo counts samples, checked in PPOConfig
            raise ConfigError(f"config key '{prefix}train.batch_size': {self.train.batch_size} is not a multiple of "
                              f"micro_batch_size {self.train.micro_batch_size}")


@dataclass
class SFTConfig(StepConfig):
    task: TaskConfig = option(TaskConfig(), "a reasoning-gym task's question -> answer rows, when data.train is "
                                            "unset (docs/tasks.md)")


@dataclass
class RewardOptions:
    margin: float = option(0.0, "ask for r_chosen - r_rejected > margin, loss -log sigmoid(gap - margin) "
                                "(Llama 2 eq. 2); 0 = off")
    norm_samples: int = option(512, "after training, the reward's mean/std over this many training responses "
                                    "(chosen and rejected) is saved in final/config.json for PPO; 0 = skip, else >= 2")

    def validate(self, prefix: str = "") -> None:
        if self.margin < 0:
            raise ConfigError(f"config key '{prefix}margin': must be >= 0")
        if self.norm_samples < 0 or self.norm_samples == 1:
            raise ConfigError(f"config key '{prefix}norm_samples': must be 0 (skip) or >= 2 (a standard deviation "
                              f"needs two scores), got {self.norm_samples}")


@dataclass
class RMConfig(StepConfig):
    """The SFT sections (same meaning) plus `rm`; validation is inherited."""

    model: Optional[str] = option(None, "the backbone: a causal LM folder or hub id (usually the SFT output's "
                                        "final/); a fresh scalar head is added, seeded by train.seed")
    output_dir: str = option("runs/rm", "where final/, checkpoints/, metrics.jsonl and config.yaml go")
    rm: RewardOptions = option(RewardOptions(), "reward model")
