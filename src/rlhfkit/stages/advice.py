"""Lines for the run's log that a first run needs: a setting that runs but may not do what was meant, what a
confusing number means, how long the run will take. Each is said once; none changes a value (config.yaml says
what ran)."""

from __future__ import annotations

from rlhfkit.config.ppo_schema import KL_ESTIMATOR_DOCS
from rlhfkit.metric_names import EVAL_LOSS

# LoRA's B matrices start at zero (Hu et al. 2021), so at a full fine-tuning rate (1e-6 to 2e-5) a short run barely
# moves them: SFT of SmolLM2 with lora.rank=8 at 1e-5 answered exactly as the base model. LoRA recipes train at
# 1e-4 to 2e-4 (QLoRA, Dettmers et al. 2023); below this floor a rate is a full fine-tuning one.
LORA_LR_FLOOR = 5e-5


def lora_rate_note(rank: int, lr: float, key: str = "train.lr") -> str | None:
    """A note when LoRA (`rank` > 0) trains at a full fine-tuning learning rate `lr` (from config key `key`)."""
    if rank <= 0 or lr >= LORA_LR_FLOOR:
        return None
    return (f"note: LoRA (lora.rank={rank}) at {key}={lr:g}, a full fine-tuning rate: the adapters start at zero "
            f"and barely move at it (the answers may stay the base model's); LoRA usually trains at 1e-4 to 2e-4, "
            f"e.g. {key}=1e-4")


def kl_note(estimator: str) -> str:
    """What the `kl` on the bar and in metrics.jsonl is, and whether it can go below 0 (`ppo.kl_estimator`)."""
    formula, meaning = KL_ESTIMATOR_DOCS[estimator]
    return (f"kl (bar, metrics.jsonl): {estimator} = {formula}, summed over each response's tokens, averaged over "
            f"the responses, in nats; {meaning} (docs/ppo.md)")


def duration(seconds: float) -> str:
    """45 s, 12 min, 3.5 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def pace_line(stage: str, done: int, total: int, seconds: float, phases: dict[str, float]) -> str:
    """After the first iteration a process ran (`done`, 1-based, of `total`), in `seconds`: its time, where it went
    (`phases`: seconds by phase, the largest three shown) and how long the rest takes at this pace."""
    parts = ", ".join(f"{name} {secs:.1f} s" for name, secs in sorted(phases.items(), key=lambda kv: -kv[1])[:3])
    left = total - done
    rest = f"{left} more at this pace: about {duration(left * seconds)}" if left else "the last one"
    return f"{stage}: iteration {done} of {total} took {seconds:.1f} s ({parts}); {rest}"


# a loss that moved less than this (relative) from the run's first logged value to its last did not train visibly
BARELY = 0.01


def learned_line(stage: str, steps: int, seen: dict[str, tuple[float, float]], keys: tuple[str, ...]) -> str | None:
    """What the run changed, said at its end: each of `keys` (the bar's metrics) from its first logged value to its
    last (`seen`: key -> (first, last)); when the loss, held out if there is one, moved less than 1%, why that may
    be. None when nothing was logged twice."""
    moved = [(k, *seen[k]) for k in keys if k in seen and k != "lr"]
    if not moved:
        return None
    line = f"{stage}: after {steps} step{'s' * (steps != 1)}: " + ", ".join(f"{k} {a:.4g} -> {b:.4g}"
                                                                          for k, a, b in moved)
    loss = EVAL_LOSS if EVAL_LOSS in seen else "loss" if "loss" in seen else None
    if loss is not None:
        first, last = seen[loss]
        if abs(last - first) <= BARELY * abs(first):
            line += (f"; the {loss} barely moved (under {BARELY:.0%}): a higher train.lr (LoRA trains at 1e-4 or "
                     f"more) or more steps")
    return line
