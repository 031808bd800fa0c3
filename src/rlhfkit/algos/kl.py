"""Per-token KL estimators and the controllers that set the KL coefficient.

The estimators follow http://joschu.net/blog/kl-approx.html. Each estimates KL(pi || ref) from tokens sampled
from pi, using only the log-probabilities of the sampled token under both models; with r = ref/pi:
  k1 = -log r                unbiased, high variance, can be negative per token;
  k2 = (log r)^2 / 2         biased, low variance, always >= 0;
  k3 = (r - 1) - log r       unbiased and always >= 0 (since log x <= x - 1).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch


def _kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - 1 - log_ratio


KL_ESTIMATORS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
}


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1", *, clamp: Optional[float] = None
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi.

    Args:
        logp: ``(B, T)`` log-probabilities of the sampled tokens under the policy pi.
        ref_logp: ``(B, T)`` log-probabilities of the same tokens under the reference model.
        kind: ``"k1"``, ``"k2"`` or ``"k3"`` (see the module docstring).
        clamp: if given, the estimate is clamped to ``[-clamp, clamp]``. Meant for k3, whose exp(ref - logp)
            explodes on tokens the reference finds far likelier than the policy (verl clamps k3 at 10); it
            applies to whichever ``kind`` is chosen. None (the default) leaves the estimate as is.

    Returns:
        ``(B, T)`` per-token estimates (not masked; the caller masks).
    """
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {sorted(KL_ESTIMATORS)}") from None
    if clamp is not None and clamp <= 0:
        raise ValueError(f"KL clamp must be > 0, got {clamp}")
    kl = estimator(logp, ref_logp)
    return kl if clamp is None else kl.clamp(-clamp, clamp)


class FixedKLController:
    """A constant KL coefficient (``update`` does nothing)."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so PPO code can call ``update`` on either controller."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the coefficient is the configured one (a resumed run that changed ``ppo.kl_coef``
        uses its new value, as it says)."""


class AdaptiveKLController:
    """KL coefficient adapted towards a target KL (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences", section 2.2).

    A proportional controller: e = clip(KL / target - 1, -0.2, 0.2), coef *= 1 + e * n_steps / horizon. The clip
    bounds how fast the coefficient can move after one noisy KL measurement.

    Args:
        init_coef: starting coefficient.
        target: the KL (nats per sequence, as measured by the caller) to steer towards.
        horizon: number of samples over which a full proportional correction is applied.
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after observing ``current_kl`` over ``n_steps`` samples."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        """The adapted coefficient from a checkpoint of an adaptive run; the target and horizon stay the configured
        ones (a resumed run may change them). A run that kept a fixed coefficient until the resume starts adapting
        from the configured ``ppo.kl_coef``."""
        if "target" in state:
            self.value = float(state["value"])
