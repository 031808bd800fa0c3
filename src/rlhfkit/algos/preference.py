"""Offline preference losses (the DPO family): the math. `dpo.loss` names an entry of
`registry.preference.PREFERENCE_LOSSES`, which calls one of these with the settings it reads.

Every loss reads the summed log-probabilities of the chosen and rejected responses (prompt tokens excluded)
under the policy and, unless it is reference-free, under the frozen reference:

    rho_c = log pi(y_c | x) - log pi_ref(y_c | x)        rho_r = the same for y_r

and returns per-pair losses together with the implicit rewards it optimises, so a loop can log the rewards,
their margin and how often the chosen one wins whatever the loss. Per-pair losses (not a mean) let a loop
sum over micro-batches and ranks and divide once by the pairs of the whole step.

- `sigmoid` (DPO): -log sigmoid(beta (rho_c - rho_r)); implicit reward beta · rho
- `cdpo` (conservative DPO): (1 - eps) · that + eps · the same with the labels swapped; reward beta · rho
- `ipo`: (rho_c - rho_r - 1 / (2 beta))^2; reward beta · rho
- `simpo` (no reference): -log sigmoid(beta (s_c - s_r) - gamma), s = log pi(y | x) / len(y), label smoothing
  eps as cdpo; reward beta · s

plus, for any of them, RPO's NLL term alpha · (-log pi(y_c | x) / |y_c|) on the chosen response (`nll_term`).
Imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

LossOutput = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (losses, chosen_rewards, rejected_rewards), (B,)


def _smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - eps) log sigmoid(z) - eps log sigmoid(-z): the expected Bradley-Terry loss when each label is
    flipped with probability eps. `F.logsigmoid` stays finite for large |z|."""
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> LossOutput:
    """DPO (Rafailov et al. 2023, eq. 7): -log sigmoid(beta (rho_c - rho_r)).

    The Bradley-Terry loss of the reward model, applied to the implicit reward beta · log(pi / pi_ref): the
    policy is the reward model. beta is the strength of the KL constraint to the reference (eq. 3): small beta
    lets the policy move far, large beta keeps it close.

    Args:
        policy_chosen, policy_rejected: ``(B,)`` summed response log-probs under the policy (with grad).
        ref_chosen, ref_rejected: ``(B,)`` the same under the reference (zeros: reference-free).
        beta: > 0.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(B,)``; the rewards are detached.
    """
    return cdpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, 0.0)


def cdpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
              ref_rejected: torch.Tensor, beta: float, label_smoothing: float) -> LossOutput:
    """Conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"): DPO's loss with labels that are
    wrong with probability eps = `label_smoothing` (0 <= eps < 0.5):
    -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h), h = rho_c - rho_r. eps = 0 is DPO; eps > 0 bounds
    the loss from below, so the margin stops growing once sigmoid(beta h) = 1 - eps.

    Args: as `dpo_loss`, plus ``label_smoothing``. Returns: as `dpo_loss`.
    """
    chosen_ratio = policy_chosen - ref_chosen  # (B,) rho_c
    rejected_ratio = policy_rejected - ref_rejected  # (B,) rho_r
    losses = _smoothed_sigmoid_loss(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def ipo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> LossOutput:
    """IPO (Azar et al. 2023, eq. 17): (rho_c - rho_r - 1 / (2 tau))^2 with tau = `beta`.

    A squared loss regresses the log-ratio gap to a finite target instead of pushing it to infinity as DPO's
    sigmoid does on deterministic preferences; a larger beta means a smaller target gap. The paper's sequence
    log-ratios are used (summed log-probs; TRL divides them by the response length first).

    Args: as `dpo_loss` (``beta`` is tau). Returns: as `dpo_loss`, rewards beta · rho.
    """
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    losses = (chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def simpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, chosen_lengths: torch.Tensor,
               rejected_lengths: torch.Tensor, beta: float, gamma: float, label_smoothing: float = 0.0) -> LossOutput:
    """SimPO (Meng et al. 2024, eq. 6): -log sigmoid(beta/|y_c| log pi(y_c) - beta/|y_r| log pi(y_r) - gamma).

    Reference-free: the implicit reward is the policy's mean token log-prob scaled by beta, which is also what
    generation ranks by, and it does not favour long responses; gamma is the target reward margin (the paper
    uses beta 2-2.5 and gamma/beta around 0.5). Label smoothing as in `cdpo_loss`.

    Args:
        policy_chosen, policy_rejected: ``(B,)`` summed response log-probs under the policy.
        chosen_lengths, rejected_lengths: ``(B,)`` response token counts (>= 1).
        beta, gamma, label_smoothing: floats.

    Returns: ``(losses, beta · s_c, beta · s_r)``, each ``(B,)``, s = summed log-prob / length.
    """
    chosen_rewards = beta * policy_chosen / chosen_lengths
    rejected_rewards = beta * policy_rejected / rejected_lengths
    losses = _smoothed_sigmoid_loss(chosen_rewards - rejected_rewards - gamma, label_smoothing)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def nll_term(policy_chosen: torch.Tensor, chosen_lengths: torch.Tensor) -> torch.Tensor:
    """RPO's NLL on the chosen response (Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 1):
    -log pi(y_c | x) / |y_c| per pair, ``(B,)``; added to the preference loss with weight alpha, it keeps the
    chosen responses likely while DPO pushes the two apart (DPO alone can lower both)."""
    return -policy_chosen / chosen_lengths


@dataclass(frozen=True)
class PairLogps:
    """Summed response log-probs of B pairs and their response lengths (prompt tokens excluded).

    `ref_chosen` / `ref_rejected` are None when no reference is used (a reference-free loss, or
    `reference_free`): the reference then counts as log pi_ref = 0 for every response.
    """

    chosen: torch.Tensor  # (B,) log pi(y_c | x), with grad
    rejected: torch.Tensor  # (B,) log pi(y_r | x), with grad
    chosen_lengths: torch.Tensor  # (B,) response tokens of y_c, float
    rejected_lengths: torch.Tensor  # (B,) response tokens of y_r, float
    ref_chosen: Optional[torch.Tensor] = None  # (B,) log pi_ref(y_c | x)
    ref_rejected: Optional[torch.Tensor] = None  # (B,) log pi_ref(y_r | x)

    def reference(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.ref_chosen is None or self.ref_rejected is None:
            return torch.zeros_like(self.chosen), torch.zeros_like(self.rejected)
        return self.ref_chosen, self.ref_rejected
