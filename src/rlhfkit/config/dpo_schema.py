"""The config of `rlhfkit dpo`: the SFT sections (same meaning, same preference data as `rlhfkit rm`) plus `dpo`.

```yaml
model: runs/sft/final           # the policy's start, and the frozen reference
data: {train: pairs.jsonl}      # any preference format the RM step reads
dpo: {loss: sigmoid, beta: 0.1}
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhfkit.config.fields import option
from rlhfkit.config.monitor_schema import MonitorSection
from rlhfkit.config.schema import StepConfig, check_lora_dropout
from rlhfkit.errors import ConfigError
from rlhfkit.registry.preference import LOSS_SETTINGS, PREFERENCE_LOSSES


# The docs of `dpo.loss` and of the settings the losses read, written from their entries (registry/preference.py).
def _loss_doc() -> str:
    return "preference loss (rho = log pi/pi_ref of a response): " + "; ".join(
        f"{name} ({entry.doc})" for name, entry in PREFERENCE_LOSSES.items())


def _setting_doc(key: str) -> str:
    readers = [name for name, entry in PREFERENCE_LOSSES.items() if key in entry.settings]
    who = "" if len(readers) == len(PREFERENCE_LOSSES) else f"{', '.join(readers) or 'no loss'}: "
    meanings = [f"; {name}: {entry.settings[key]}" for name, entry in PREFERENCE_LOSSES.items()
                if entry.settings.get(key)]
    return who + LOSS_SETTINGS[key].doc + "".join(meanings)


def loss_setting(key: str):
    """The config field of LOSS_SETTINGS[key]: its default, and its doc written from the losses that read it."""
    return option(LOSS_SETTINGS[key].default, lambda: _setting_doc(key))


def _reference_free_doc() -> str:
    reads = {True: [], False: []}
    for name, entry in PREFERENCE_LOSSES.items():
        reads[entry.reference].append(name)
    return (f"{'/'.join(reads[True])}: no reference model, log pi_ref = 0 for every response (a uniform reference); "
            f"reference-free already: {', '.join(reads[False]) or 'none'}")


@dataclass
class DPOSection:
    loss: str = option("sigmoid", _loss_doc, choices=PREFERENCE_LOSSES.keys())
    beta: float = loss_setting("beta")
    label_smoothing: float = loss_setting("label_smoothing")
    simpo_gamma: float = loss_setting("simpo_gamma")
    rpo_alpha: float = option(0.0, "RPO: add alpha x the chosen response's NLL per token (-log pi(y_c)/|y_c|) to "
                                   "the loss, which keeps chosen responses likely (Pang et al. 2024: 1.0); 0 = off")
    reference_free: bool = option(False, _reference_free_doc)
    precompute_reference: bool = option(True, "compute the reference's log-probs of every train and eval pair once "
                                              "before training (one no-grad pass, then no reference model is held) "
                                              "and cache them next to the data cache for the next run or --resume; "
                                              "false: a reference forward in every step")
    chunked_logprobs: Optional[bool] = option(None, "response log-probs (policy and reference) with the LM head "
                                                    "run in chunks on the response tokens only, the gradient "
                                                    "formed from each chunk's softmax: no (tokens x vocabulary) "
                                                    "logits, log-softmax or logit gradient held (same values to "
                                                    "float rounding, less memory at large vocabularies); null = on "
                                                    "when the head is a plain linear layer held on this rank (not "
                                                    "a ZeRO-3 shard, not LoRA-adapted itself) and a one-off check "
                                                    "finds the model's own logits")

    def uses_reference(self) -> bool:
        return not self.reference_free and PREFERENCE_LOSSES[self.loss].reference

    def loss_settings(self) -> dict[str, float]:
        """The settings the loss reads, by name: `preference_loss(loss, pairs, **these)`."""
        return {key: getattr(self, key) for key in PREFERENCE_LOSSES[self.loss].settings}

    def validate(self, prefix: str = "") -> None:
        if self.loss not in PREFERENCE_LOSSES:
            raise ConfigError(f"config key '{prefix}loss': expected one of {tuple(PREFERENCE_LOSSES)}, got "
                              f"{self.loss!r}")
        for key, setting in LOSS_SETTINGS.items():
            value = getattr(self, key)
            if not setting.valid(value):
                raise ConfigError(f"config key '{prefix}{key}': {setting.rule}")
            if value != setting.default and key not in PREFERENCE_LOSSES[self.loss].settings:
                readers = " or ".join(f"{prefix}loss={name}" for name, e in PREFERENCE_LOSSES.items()
                                      if key in e.settings)
                raise ConfigError(f"config key '{prefix}{key}': loss {self.loss} does not read it; use {readers}, "
                                  f"or leave it at {setting.default:g}")
        if self.rpo_alpha < 0:
            raise ConfigError(f"config key '{prefix}rpo_alpha': must be >= 0")


@dataclass
class DPOConfig(StepConfig):
    """The SFT sections (same meaning) plus `reference` and `dpo`; validation is inherited and extended."""

    model: Optional[str] = option(None, "the policy's starting model (an SFT output folder or hub id); also the "
                                        "frozen reference unless `reference` is set")
    reference: Optional[str] = option(None, "frozen reference model; default: `model` (with LoRA: the policy with "
                                            "its adapter disabled, no second copy)")
    output_dir: str = option("runs/dpo", "where final/, checkpoints/, metrics.jsonl and config.yaml go")
    dpo: DPOSection = option(DPOSection(), "preference optimisation")
    monitor: MonitorSection = option(MonitorSection(), "run-time alarms on the logged metrics (docs/monitors.md)")

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check_lora_dropout(self.load, self.lora, prefix)
        if self.monitor.action == "stop_best":
            raise ConfigError(f"config key '{prefix}monitor.action': stop_best keeps best/, the policy of the best "
                              f"held-out reward, which rlhfkit ppo keeps; a DPO run has none: use stop")
        if self.reference and not self.dpo.uses_reference():
            why = "dpo.reference_free is true" if self.dpo.reference_free else f"loss {self.dpo.loss} uses none"
            raise ConfigError(f"config key '{prefix}reference': no reference model is used ({why}); unset it")
