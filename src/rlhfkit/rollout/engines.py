"""The rollout engine: what samples the responses of an RL iteration and of the held-out evaluation.

One interface, two kinds of engine (`rollout.engine`):
- `NativeRollout`, the embedded default: rlhfkit's own decoder (rollout/generate.py) on the actor itself, so it
  always samples from the weights being trained and there is nothing to sync;
- vLLM: `VLLMRollout` (rollout/vllm_engine.py), colocated in the trainer's process, or `VLLMServer`
  (rollout/vllm_server.py), a `vllm serve` elsewhere (`rollout.server`). Each holds its own copy of the policy;
  the actor's weights reach it after every update (`sync`) and the log-prob check (rollout/sync_check.py) proves
  on every iteration that they did.

All return the same RolloutBatch: left-padded prompts, responses padded after their first end id, the response
mask, and the sampler's own log-probs of the sampled tokens (`sample_logprobs`, at the sampling temperature).
"""

from __future__ import annotations

from typing import Protocol

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.rollout.evaluate import generate_all


class RolloutEngine(Protocol):
    name: str
    # whether the sampler is not the trainer's model itself: the old log-probs then come from a trainer forward,
    # the sampler's own are checked against them (sync check) and corrected for (TIS)
    separate: bool

    def generate(self, rows: list[dict], gen: GenConfig, greedy: bool = False, group_size: int = 1) -> RolloutBatch:
        """One response per row; rows holding `group_size` copies of each prompt in a row are sampled as groups.
        Seeded from the torch RNG, so a run (and its resume) draws the same samples."""

    def sync(self, model) -> float:
        """Hand `model`'s current weights to the engine (every rank calls it at the same point); returns the
        seconds it took (0 where there is nothing to hand over)."""

    def close(self) -> None:
        """Stop the engine and free what it holds (idempotent)."""

    def describe(self) -> str:
        """One log line: which engine samples and how its weights are kept in step."""


class NativeRollout:
    """rlhfkit's own decoder on the actor (KV cache, left padding, the speed plan's fast paths)."""

    name, separate = "native", False

    def __init__(self, model, engine, tokenizer, plan):
        self.model, self.engine, self.tokenizer, self.plan = model, engine, tokenizer, plan

    def generate(self, rows, gen, greedy=False, group_size=1):
        return generate_all(self.model, self.engine, self.tokenizer, rows, gen, self.plan, greedy, group_size)

    def sync(self, model) -> float:
        return 0.0  # it samples with the trained module itself

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return "rollout: rlhfkit's own decoder on the actor (nothing to sync)"


def make_rollout_engine(cfg, model, engine, tokenizer, plan, served: str | None = None) -> RolloutEngine:
    """The engine of `cfg.rollout.engine` for the actor `model` (a PPOConfig's rollout section); `served`: what
    `vllm_server.check_server` found, when `rollout.server` is set."""
    if cfg.rollout.engine == "native":
        return NativeRollout(model, engine, tokenizer, plan)
    if cfg.rollout.server:
        from rlhfkit.rollout.vllm_server import VLLMServer

        return VLLMServer(cfg, model, engine, tokenizer, cfg.output_dir, served)
    from rlhfkit.rollout.vllm_engine import VLLMRollout

    return VLLMRollout(cfg, model, engine, tokenizer)
