"""The DPO family (algos/preference.py, registered in registry/preference.py) against hand-computed values, the
identities between the losses, and the config derived from the registry.

One 2-pair batch throughout (summed response log-probs):
    pair 1: policy chosen -3.0, rejected -5.0; reference chosen -4.0, rejected -4.5
            rho_c = 1.0, rho_r = -0.5, h = rho_c - rho_r = 1.5
    pair 2: policy chosen -6.0, rejected -2.0; reference chosen -5.0, rejected -2.5
            rho_c = -1.0, rho_r = 0.5, h = -1.5
response lengths: chosen [2, 3], rejected [4, 1].
"""

import math
import re

import pytest
import torch

from rlhfkit.algos import PairLogps, cdpo_loss, dpo_loss, ipo_loss, nll_term, pairwise_loss, simpo_loss
from rlhfkit.config import ConfigError, DPOConfig, load_config
from rlhfkit.registry.preference import PREFERENCE_LOSSES, preference_loss

SMOOTHED_LOSSES = tuple(name for name, entry in PREFERENCE_LOSSES.items() if "label_smoothing" in entry.settings)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # -log sigmoid(-x)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def batch(requires_grad: bool = False) -> PairLogps:
    chosen = torch.tensor([-3.0, -6.0], dtype=torch.float64, requires_grad=requires_grad)
    rejected = torch.tensor([-5.0, -2.0], dtype=torch.float64, requires_grad=requires_grad)
    return PairLogps(chosen, rejected, torch.tensor([2.0, 3.0], dtype=torch.float64),
                     torch.tensor([4.0, 1.0], dtype=torch.float64), torch.tensor([-4.0, -5.0], dtype=torch.float64),
                     torch.tensor([-4.5, -2.5], dtype=torch.float64))


def args(p: PairLogps) -> tuple:
    return p.chosen, p.rejected, p.ref_chosen, p.ref_rejected


# ---------------------------------------------------------------- hand-computed values


def test_dpo_sigmoid_loss_and_implicit_rewards():
    losses, chosen, rejected = dpo_loss(*args(batch()), beta=0.5)
    # beta h = [0.75, -0.75]; -log sigmoid(z) = softplus(-z)
    close(losses, [softplus(-0.75), softplus(0.75)])
    close(losses, [0.386871, 1.136871])
    close(chosen, [0.5, -0.5])  # beta rho_c
    close(rejected, [-0.25, 0.25])  # beta rho_r


def test_cdpo_loss():
    losses, chosen, rejected = cdpo_loss(*args(batch()), beta=0.5, label_smoothing=0.1)
    # 0.9 softplus(-z) + 0.1 softplus(z), z = [0.75, -0.75]
    close(losses, [0.9 * softplus(-0.75) + 0.1 * softplus(0.75), 0.9 * softplus(0.75) + 0.1 * softplus(-0.75)])
    close(losses, [0.461871, 1.061871])
    close(chosen, [0.5, -0.5])


def test_ipo_loss():
    losses, chosen, rejected = ipo_loss(*args(batch()), beta=0.5)
    # target gap 1 / (2 * 0.5) = 1: (1.5 - 1)^2, (-1.5 - 1)^2
    close(losses, [0.25, 6.25])
    close(rejected, [-0.25, 0.25])


def test_simpo_loss_is_reference_free_and_length_normalised():
    p = batch()
    losses, chosen, rejected = simpo_loss(p.chosen, p.rejected, p.chosen_lengths, p.rejected_lengths, beta=2.0,
                                          gamma=0.5)
    # s_c = [-3/2, -6/3] = [-1.5, -2.0], s_r = [-5/4, -2/1] = [-1.25, -2.0]; rewards 2 s
    close(chosen, [-3.0, -4.0])
    close(rejected, [-2.5, -4.0])
    # z = 2 (s_c - s_r) - 0.5 = [-1.0, -0.5]
    close(losses, [softplus(1.0), softplus(0.5)])
    smoothed, _, _ = simpo_loss(p.chosen, p.rejected, p.chosen_lengths, p.rejected_lengths, beta=2.0, gamma=0.5,
                                label_smoothing=0.2)
    close(smoothed, [0.8 * softplus(1.0) + 0.2 * softplus(-1.0), 0.8 * softplus(0.5) + 0.2 * softplus(-0.5)])


def test_rpo_adds_the_chosen_nll_per_token():
    p = batch()
    close(nll_term(p.chosen, p.chosen_lengths), [1.5, 2.0])  # -(-3)/2, -(-6)/3
    losses, _, _ = preference_loss("sigmoid", p, beta=0.5, rpo_alpha=0.5)
    close(losses, [softplus(-0.75) + 0.75, softplus(0.75) + 1.0])


def test_dpo_gradient_is_beta_times_the_wrong_side_probability():
    # d/d log pi(y_c) of -log sigmoid(beta h) = -beta sigmoid(-beta h); the rejected side gets the opposite sign
    p = batch(requires_grad=True)
    losses, _, _ = preference_loss("sigmoid", p, beta=0.5)
    losses.sum().backward()
    sig = [1 / (1 + math.exp(0.75)), 1 / (1 + math.exp(-0.75))]  # sigmoid(-z)
    close(p.chosen.grad, [-0.5 * sig[0], -0.5 * sig[1]])
    close(p.rejected.grad, [0.5 * sig[0], 0.5 * sig[1]])


# ---------------------------------------------------------------- identities


def test_label_smoothing_zero_is_dpo():
    for beta in (0.05, 0.5, 3.0):
        dpo = dpo_loss(*args(batch()), beta=beta)
        cdpo = cdpo_loss(*args(batch()), beta=beta, label_smoothing=0.0)
        for a, b in zip(dpo, cdpo):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_dpo_with_small_beta_is_linear_in_the_log_ratio_gap():
    # -log sigmoid(beta h) = log 2 - beta h / 2 + O(beta^2 h^2): the loss tends to log 2 and its slope to -h/2
    beta = 1e-4
    losses, _, _ = dpo_loss(*args(batch()), beta=beta)
    close((losses - math.log(2)) / beta, [-0.75, 0.75], atol=1e-4)


def test_dpo_is_the_reward_models_bradley_terry_loss_on_implicit_rewards():
    losses, chosen, rejected = dpo_loss(*args(batch()), beta=0.5)
    close(losses.mean(), pairwise_loss(chosen, rejected))


def test_simpo_without_margin_on_unit_lengths_is_reference_free_dpo():
    p = batch()
    ones = torch.ones(2, dtype=torch.float64)
    simpo, _, _ = simpo_loss(p.chosen, p.rejected, ones, ones, beta=0.7, gamma=0.0)
    free, _, _ = preference_loss("sigmoid", PairLogps(p.chosen, p.rejected, ones, ones), beta=0.7)  # ref = 0
    close(simpo, free)
    zeros = torch.zeros(2, dtype=torch.float64)
    close(free, dpo_loss(p.chosen, p.rejected, zeros, zeros, beta=0.7)[0])
    # SimPO never reads the reference: the same losses with or without one
    with_ref, _, _ = preference_loss("simpo", p, beta=2.0, simpo_gamma=0.5)
    without, _, _ = preference_loss("simpo", PairLogps(p.chosen, p.rejected, p.chosen_lengths, p.rejected_lengths),
                                    beta=2.0, simpo_gamma=0.5)
    close(with_ref, without)


def test_ipo_is_zero_with_zero_gradient_at_its_target_gap():
    beta = 0.25  # target gap 1 / (2 beta) = 2
    chosen = torch.tensor([0.0], dtype=torch.float64, requires_grad=True)
    losses, _, _ = ipo_loss(chosen, torch.tensor([-2.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                            torch.zeros(1, dtype=torch.float64), beta)
    losses.sum().backward()
    close(losses, [0.0])
    close(chosen.grad, [0.0])


def test_label_smoothing_bounds_the_loss_by_the_label_entropy():
    # min over z of -(1-e) log sigmoid(z) - e log sigmoid(-z) is the binary entropy H(e), at sigmoid(z) = 1 - e
    eps = 0.1
    gaps = torch.linspace(-20, 60, 8001, dtype=torch.float64)
    zeros = torch.zeros_like(gaps)
    losses, _, _ = cdpo_loss(gaps, zeros, zeros, zeros, beta=1.0, label_smoothing=eps)
    entropy = -(1 - eps) * math.log(1 - eps) - eps * math.log(eps)
    assert losses.min().item() == pytest.approx(entropy, abs=1e-4)
    assert gaps[losses.argmin()].item() == pytest.approx(math.log((1 - eps) / eps), abs=0.02)


def test_losses_are_per_pair():
    # each pair's loss depends on that pair only: a batch is the concatenation of its halves
    p = batch()
    for name in PREFERENCE_LOSSES:
        whole, _, _ = preference_loss(name, p, beta=0.5, label_smoothing=0.1 if name in SMOOTHED_LOSSES else 0.0)
        for i in range(2):
            one = PairLogps(*(t[i:i + 1] for t in (p.chosen, p.rejected, p.chosen_lengths, p.rejected_lengths,
                                                   p.ref_chosen, p.ref_rejected)))
            part, _, _ = preference_loss(name, one, beta=0.5, label_smoothing=0.1 if name in SMOOTHED_LOSSES else 0.0)
            close(part, whole[i:i + 1])


def test_preference_loss_refuses_unknown_names_and_non_positive_beta():
    with pytest.raises(ValueError, match="unknown preference loss 'kto'"):
        preference_loss("kto", batch(), beta=0.1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss("sigmoid", batch(), beta=0.0)


# ---------------------------------------------------------------- the config offers exactly the table


def test_dpo_loss_choices_are_the_table():
    assert SMOOTHED_LOSSES == ("cdpo", "simpo")
    assert [n for n, e in PREFERENCE_LOSSES.items() if not e.reference] == ["simpo"]


@pytest.mark.parametrize("overrides, message", [
    (["dpo.loss=sigmoid", "dpo.label_smoothing=0.1"], "config key 'dpo.label_smoothing': loss sigmoid does not read"),
    (["dpo.loss=cdpo", "dpo.label_smoothing=0.5"], "config key 'dpo.label_smoothing': must be in [0, 0.5)"),
    (["dpo.beta=0"], "config key 'dpo.beta': must be > 0"),
    (["dpo.loss=kto"], "config key 'dpo.loss': expected one of"),
    (["dpo.rpo_alpha=-1"], "config key 'dpo.rpo_alpha': must be >= 0"),
    (["dpo.loss=simpo", "reference=some/folder"], "config key 'reference': no reference model is used (loss simpo"),
    (["dpo.reference_free=true", "reference=some/folder"], "dpo.reference_free is true"),
])
def test_dpo_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(DPOConfig, None, ["model=m", "data.train=t.jsonl", *overrides])
    assert message in str(err.value)


def test_dpo_config_defaults():
    cfg = load_config(DPOConfig, None, ["model=m", "data.train=t.jsonl"])
    assert (cfg.dpo.loss, cfg.dpo.beta, cfg.dpo.precompute_reference, cfg.output_dir) == ("sigmoid", 0.1, True,
                                                                                          "runs/dpo")
    assert cfg.dpo.uses_reference()
    assert not load_config(DPOConfig, None, ["model=m", "data.train=t", "dpo.loss=simpo"]).dpo.uses_reference()


def dpo_help() -> str:
    """What `rlhfkit dpo --help` prints."""
    import contextlib
    import io

    from rlhfkit.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["dpo", "--help"])
    return out.getvalue()


def test_every_registered_loss_is_a_choice_in_help_and_every_choice_is_registered():
    import dataclasses

    from rlhfkit.config.dpo_schema import DPOSection
    from rlhfkit.config.fields import help_rows

    field = {f.name: f for f in dataclasses.fields(DPOSection)}["loss"]
    assert tuple(field.metadata["choices"]) == tuple(PREFERENCE_LOSSES)
    rows = {key: (tp, doc) for key, tp, _, doc in help_rows(DPOConfig)}
    assert rows["dpo.loss"][0].split("|") == list(PREFERENCE_LOSSES)
    text = dpo_help()
    for name, entry in PREFERENCE_LOSSES.items():
        assert load_config(DPOConfig, None, ["model=m", "data.train=t", f"dpo.loss={name}"]).dpo.loss == name
        assert f"{name} ({entry.doc})" in rows["dpo.loss"][1]
        assert entry.doc.split(":")[0] in text
        for key, meaning in entry.settings.items():  # what a setting means for this loss is in that setting's help
            if meaning:
                assert f"{name}: {meaning}" in rows[f"dpo.{key}"][1]


def test_each_entry_holds_its_settings_and_its_function_takes_exactly_those_by_keyword():
    """The settings an entry reads are dpo.* fields with LOSS_SETTINGS' defaults, and its function's parameters
    after `pairs` are those settings, keyword-only (no positional (pairs, beta, eps, gamma))."""
    import dataclasses
    import inspect

    from rlhfkit.config.dpo_schema import DPOSection
    from rlhfkit.registry.preference import LOSS_SETTINGS

    defaults = DPOSection()
    for key, setting in LOSS_SETTINGS.items():
        assert getattr(defaults, key) == setting.default and setting.valid(setting.default), key
    assert set(LOSS_SETTINGS) <= {f.name for f in dataclasses.fields(DPOSection)}
    for name, entry in PREFERENCE_LOSSES.items():
        params = list(inspect.signature(entry.loss).parameters.values())
        assert params[0].name == "pairs", name
        assert {p.name for p in params[1:]} == set(entry.settings), name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:]), name


def test_validation_follows_each_entrys_settings():
    """For every loss and every loss setting: a changed value of a setting the loss reads passes, one it does not
    read is refused naming the losses that do, and an out-of-range value is refused whatever the loss."""
    from rlhfkit.registry.preference import LOSS_SETTINGS

    changed = {"beta": 0.3, "label_smoothing": 0.2, "simpo_gamma": 1.5}
    out_of_range = {"beta": -1.0, "label_smoothing": 0.5, "simpo_gamma": -0.5}
    assert set(changed) == set(LOSS_SETTINGS) == set(out_of_range)
    for name, entry in PREFERENCE_LOSSES.items():
        base = ["model=m", "data.train=t", f"dpo.loss={name}"]
        for key in LOSS_SETTINGS:
            if key in entry.settings:
                cfg = load_config(DPOConfig, None, [*base, f"dpo.{key}={changed[key]}"])
                assert cfg.dpo.loss_settings()[key] == changed[key]
            else:
                readers = " or ".join(f"dpo.loss={n}" for n, e in PREFERENCE_LOSSES.items() if key in e.settings)
                with pytest.raises(ConfigError, match=rf"^config key 'dpo\.{key}': loss {name} does not read it; "
                                                      rf"use {readers}, or leave it at"):
                    load_config(DPOConfig, None, [*base, f"dpo.{key}={changed[key]}"])
            with pytest.raises(ConfigError, match=rf"^config key 'dpo\.{key}': {re.escape(LOSS_SETTINGS[key].rule)}"):
                load_config(DPOConfig, None, [*base, f"dpo.{key}={out_of_range[key]}"])
        assert load_config(DPOConfig, None, base).dpo.uses_reference() == entry.reference


def test_preference_loss_refuses_a_changed_setting_the_loss_does_not_read():
    with pytest.raises(ValueError, match="loss sigmoid does not read label_smoothing"):
        preference_loss("sigmoid", batch(), beta=0.5, label_smoothing=0.1)
    with pytest.raises(TypeError, match="unknown setting 'gamma'"):
        preference_loss("simpo", batch(), beta=2.0, gamma=0.5)


def test_a_contradictory_loss_entry_is_refused_at_registration():
    from rlhfkit.registry.preference import register_loss

    with pytest.raises(ValueError, match="'sigmoid' is registered twice"):
        register_loss("sigmoid", doc="d", reference=True, settings={"beta": ""})(lambda pairs, *, beta: None)
    with pytest.raises(ValueError, match=r"'toy' reads \['kto_lambda'\], not in LOSS_SETTINGS"):
        register_loss("toy", doc="d", reference=True, settings={"kto_lambda": ""})(lambda pairs, *, kto_lambda: None)
    assert "toy" not in PREFERENCE_LOSSES


@pytest.fixture
def toy_loss():
    """A preference loss registered for one test, the way a contributor adds one: SLiC's hinge on the log-ratio gap
    (Zhao et al. 2023), max(0, 1 - beta (rho_c - rho_r)), reading beta only."""
    from rlhfkit.registry.preference import register_loss

    @register_loss("toy_hinge", reference=True, settings={"beta": "the hinge's slope (toy)"},
                   doc="toy SLiC hinge: max(0, 1 - beta (rho_c - rho_r))")
    def toy_hinge(pairs, *, beta):
        ref_chosen, ref_rejected = pairs.reference()
        chosen, rejected = pairs.chosen - ref_chosen, pairs.rejected - ref_rejected
        return (1 - beta * (chosen - rejected)).clamp(min=0), beta * chosen.detach(), beta * rejected.detach()

    yield PREFERENCE_LOSSES["toy_hinge"]
    del PREFERENCE_LOSSES["toy_hinge"]


def test_a_registered_loss_reaches_choices_help_validation_and_the_loss_with_no_other_edit(toy_loss):
    from rlhfkit.config.fields import help_text
    from rlhfkit.stages.dpo import LossFn

    text = help_text(DPOConfig)
    assert "|toy_hinge, default 'sigmoid')" in text and "toy_hinge (toy SLiC hinge: max(0" in text
    assert "toy_hinge: the hinge's slope (toy)" in text  # in dpo.beta's help
    assert "toy SLiC hinge" in dpo_help()
    cfg = load_config(DPOConfig, None, ["model=m", "data.train=t", "dpo.loss=toy_hinge", "dpo.beta=0.5"])
    assert cfg.dpo.uses_reference() and cfg.dpo.loss_settings() == {"beta": 0.5}
    with pytest.raises(ConfigError, match=r"'dpo\.label_smoothing': loss toy_hinge does not read it; use "
                                          r"dpo\.loss=cdpo or dpo\.loss=simpo"):
        load_config(DPOConfig, None, ["model=m", "data.train=t", "dpo.loss=toy_hinge", "dpo.label_smoothing=0.1"])
    # beta h = 0.5 x [1.5, -1.5]: hinge [1 - 0.75, 1 + 0.75]; RPO's NLL term added as for any loss
    losses, chosen, _ = LossFn(cfg.dpo)(batch())
    close(losses, [0.25, 1.75])
    close(chosen, [0.5, -0.5])
    with_nll, _, _ = preference_loss("toy_hinge", batch(), beta=0.5, rpo_alpha=1.0)
    close(with_nll, [0.25 + 1.5, 1.75 + 2.0])


def test_the_toy_loss_is_gone_after_its_test():
    assert "toy_hinge" not in PREFERENCE_LOSSES
    with pytest.raises(ConfigError, match="expected one of"):
        load_config(DPOConfig, None, ["model=m", "data.train=t", "dpo.loss=toy_hinge"])
