"""Offline preference losses (the DPO family), one registered entry each; `dpo.loss` names one.

Each entry holds its own hyperparameters, as torchtune's loss classes do: the dpo.* settings it reads (from
LOSS_SETTINGS, where each has its default, range and doc) with what each means for this loss, and its function
takes exactly those by keyword. The config is derived from the entries: `dpo.loss`'s choices and `--help`, each
setting's `--help` (which losses read it, what it means for each), and `DPOSection.validate` (a setting out of
range, or changed from its default while the chosen loss does not read it, is refused).

To add a loss, register its function here and test it in tests/unit/test_preference_losses.py: the config picks
it up with no other edit (a test registers a toy one to show it). A loss with a hyperparameter no loss reads yet
also adds it to LOSS_SETTINGS and its field to `DPOSection` (config/dpo_schema.py, one line).

Nothing is imported at module level (the config reads this module, and `rlhfkit --help` must not import torch):
each function imports the math it calls from `rlhfkit.algos.preference`, where the losses are written out with
their papers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping


@dataclass(frozen=True)
class LossSetting:
    """A dpo.* hyperparameter that some preference losses read."""

    default: float
    rule: str  # the range in words, for errors: "must be > 0"
    valid: Callable[[float], bool]
    doc: str  # its meaning, for --help; an entry may add what it means for that loss


LOSS_SETTINGS: dict[str, LossSetting] = {
    "beta": LossSetting(0.1, "must be > 0", lambda v: v > 0,
                        "beta: the implicit reward is beta · log(pi/pi_ref) and larger beta keeps the policy closer "
                        "to the reference (DPO: 0.1-0.5)"),
    "label_smoothing": LossSetting(0.0, "must be in [0, 0.5)", lambda v: 0 <= v < 0.5,
                                   "the probability eps that a pair's label is wrong; loss -(1-eps) log sigmoid(z) - "
                                   "eps log sigmoid(-z), 0 <= eps < 0.5 (0 = DPO)"),
    "simpo_gamma": LossSetting(0.5, "must be >= 0", lambda v: v >= 0,
                               "the target reward margin gamma between chosen and rejected (in reward units; the "
                               "paper: gamma/beta around 0.5)"),
}


@dataclass(frozen=True)
class PreferenceLoss:
    name: str
    loss: Callable[..., tuple]  # (pairs: PairLogps, **settings) -> (losses, chosen_rewards, rejected_rewards), (B,)
    doc: str  # one line for --help; rho = log pi/pi_ref of a response
    reference: bool  # reads the reference's log-probs; False: no reference model is loaded at all
    settings: Mapping[str, str]  # the LOSS_SETTINGS it reads -> what each means for it ("": the setting's own doc)


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {}


def register_loss(name: str, *, doc: str, reference: bool, settings: Mapping[str, str]):
    """Decorator: enter `fn(pairs, **settings) -> (losses, chosen_rewards, rejected_rewards)` in PREFERENCE_LOSSES
    as `name` (fields: `PreferenceLoss`). A name taken, or a setting not in LOSS_SETTINGS, is refused here."""

    def add(fn):
        unknown = sorted(set(settings) - set(LOSS_SETTINGS))
        if name in PREFERENCE_LOSSES or unknown:
            why = "is registered twice" if name in PREFERENCE_LOSSES else f"reads {unknown}, not in LOSS_SETTINGS"
            raise ValueError(f"preference loss {name!r} {why}")
        PREFERENCE_LOSSES[name] = PreferenceLoss(name, fn, doc, reference, dict(settings))
        return fn

    return add


def preference_loss(name: str, pairs, *, rpo_alpha: float = 0.0, **settings: float):
    """The loss `name` per pair, with `settings` (LOSS_SETTINGS by name; one left out takes its default), plus
    `rpo_alpha` times RPO's NLL term when > 0. A setting the loss does not read must be left at its default, as
    the config requires.

    Args:
        pairs: a `PairLogps` of B pairs.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(B,)``; sum or average the losses.
    """
    try:
        entry = PREFERENCE_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown preference loss {name!r}; valid: {list(PREFERENCE_LOSSES)}") from None
    for key, value in settings.items():
        if key not in LOSS_SETTINGS:
            raise TypeError(f"preference_loss: unknown setting {key!r}; known: {list(LOSS_SETTINGS)}")
        if not LOSS_SETTINGS[key].valid(value):
            raise ValueError(f"{key} {LOSS_SETTINGS[key].rule}, got {value}")
        if key not in entry.settings and value != LOSS_SETTINGS[key].default:
            raise ValueError(f"loss {name} does not read {key} (got {value}); leave it at its default")
    losses, chosen_rewards, rejected_rewards = entry.loss(
        pairs, **{key: settings.get(key, LOSS_SETTINGS[key].default) for key in entry.settings})
    if rpo_alpha:
        from rlhfkit.algos.preference import nll_term

        losses = losses + rpo_alpha * nll_term(pairs.chosen, pairs.chosen_lengths)
    return losses, chosen_rewards, rejected_rewards


@register_loss("sigmoid", reference=True, settings={"beta": ""}, doc="DPO: -log sigmoid(beta (rho_c - rho_r))")
def sigmoid(pairs, *, beta: float):
    from rlhfkit.algos.preference import dpo_loss

    return dpo_loss(pairs.chosen, pairs.rejected, *pairs.reference(), beta)


@register_loss("cdpo", reference=True, settings={"beta": "", "label_smoothing": ""},
               doc="conservative DPO: the DPO loss with labels flipped with probability label_smoothing")
def cdpo(pairs, *, beta: float, label_smoothing: float):
    from rlhfkit.algos.preference import cdpo_loss

    return cdpo_loss(pairs.chosen, pairs.rejected, *pairs.reference(), beta, label_smoothing)


@register_loss("ipo", reference=True, settings={"beta": "its tau, the target gap is 1/(2 beta)"},
               doc="IPO: (rho_c - rho_r - 1/(2 beta))^2")
def ipo(pairs, *, beta: float):
    from rlhfkit.algos.preference import ipo_loss

    return ipo_loss(pairs.chosen, pairs.rejected, *pairs.reference(), beta)


@register_loss("simpo", reference=False,
               settings={"beta": "the scale of the mean token log-prob (the paper: 2-2.5)", "simpo_gamma": "",
                         "label_smoothing": ""},
               doc="SimPO: -log sigmoid(beta (mean token log pi(y_c) - mean token log pi(y_r)) - simpo_gamma), "
                   "length-normalised, no reference")
def simpo(pairs, *, beta: float, simpo_gamma: float, label_smoothing: float):
    from rlhfkit.algos.preference import simpo_loss

    return simpo_loss(pairs.chosen, pairs.rejected, pairs.chosen_lengths, pairs.rejected_lengths, beta, simpo_gamma,
                      label_smoothing)
