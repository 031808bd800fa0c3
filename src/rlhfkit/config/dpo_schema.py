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
from rlhfkit.config.schema import SFTConfig, check_lora_dropout
from rlhfkit.errors import ConfigError

# the names of algos.preference.PREFERENCE_LOSSES (a unit test keeps the two equal; listed here so that --help does
# not import torch)
LOSSES = ("sigmoid", "cdpo", "ipo", "simpo")
REFERENCE_FREE_LOSSES = ("simpo",)
SMOOTHED_LOSSES = ("cdpo", "simpo")


@dataclass
class DPOSection:
    loss: str = option("sigmoid", "preference loss: sigmoid (DPO, -log sigmoid(beta (rho_c - rho_r)), rho = log "
                                  "pi/pi_ref of a response), cdpo (conservative DPO: label_smoothing), ipo ((rho_c - "
                                  "rho_r - 1/(2 beta))^2), simpo (reference-free, length-normalised, target margin "
                                  "simpo_gamma)", choices=LOSSES)
    beta: float = option(0.1, "beta: the implicit reward is beta · log(pi/pi_ref) and larger beta keeps the policy "
                              "closer to the reference (DPO: 0.1-0.5); ipo: its tau, the target gap is 1/(2 beta); "
                              "simpo: the scale of the mean token log-prob (the paper: 2-2.5)")
    label_smoothing: float = option(0.0, "cdpo and simpo: the probability eps that a pair's label is wrong; loss "
                                         "-(1-eps) log sigmoid(z) - eps log sigmoid(-z), 0 <= eps < 0.5 (0 = DPO)")
    simpo_gamma: float = option(0.5, "simpo: the target reward margin gamma between chosen and rejected (in reward "
                                     "units; the paper: gamma/beta around 0.5)")
    rpo_alpha: float = option(0.0, "RPO: add alpha x the chosen response's NLL per token (-log pi(y_c)/|y_c|) to "
                                   "the loss, which keeps chosen responses likely (Pang et al. 2024: 1.0); 0 = off")
    reference_free: bool = option(False, "sigmoid/cdpo/ipo: no reference model, log pi_ref = 0 for every response "
                                         "(a uniform reference); simpo is always reference-free")
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
        return not self.reference_free and self.loss not in REFERENCE_FREE_LOSSES

    def validate(self, prefix: str = "") -> None:
        if self.beta <= 0:
            raise ConfigError(f"config key '{prefix}beta': must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"config key '{prefix}label_smoothing': must be in [0, 0.5)")
        if self.label_smoothing and self.loss not in SMOOTHED_LOSSES:
            raise ConfigError(f"config key '{prefix}label_smoothing': loss {self.loss} does not read it; use "
                              f"{prefix}loss=cdpo (conservative DPO) or simpo, or leave it at 0")
        if self.simpo_gamma < 0:
            raise ConfigError(f"config key '{prefix}simpo_gamma': must be >= 0")
        if self.rpo_alpha < 0:
            raise ConfigError(f"config key '{prefix}rpo_alpha': must be >= 0")


@dataclass
class DPOConfig(SFTConfig):
    """The SFT sections (same meaning) plus `reference` and `dpo`; validation is inherited and extended."""

    model: Optional[str] = option(None, "the policy's starting model (an SFT output folder or hub id); also the "
                                        "frozen reference unless `reference` is set")
    reference: Optional[str] = option(None, "frozen reference model; default: `model` (with LoRA: the policy with "
                                            "its adapter disabled, no second copy)")
    output_dir: str = option("runs/dpo", "where final/, checkpoints/, metrics.jsonl and config.yaml go")
    dpo: DPOSection = option(DPOSection(), "preference optimisation")

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check_lora_dropout(self.load, self.lora, prefix)
        if self.reference and not self.dpo.uses_reference():
            why = "dpo.reference_free is true" if self.dpo.reference_free else f"loss {self.dpo.loss} uses none"
            raise ConfigError(f"config key '{prefix}reference': no reference model is used ({why}); unset it")
