"""Exponential moving average of a model's trainable parameters (DeepSpeed-Chat's actor EMA, beta 0.992).

An averaged policy is smoother than the last iterate of noisy PPO updates (cf. Polyak averaging). Only
trainable parameters are tracked: with LoRA that is the adapter, so the EMA costs the adapter's size.
Under ZeRO-3 each rank averages its own shards (`param.data` is the local partition).
"""

from __future__ import annotations

import contextlib

import torch


class EMA:
    def __init__(self, module: torch.nn.Module, beta: float = 0.992):
        self.beta = beta
        self.shadow = {name: p.detach().clone().float() for name, p in module.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        """shadow <- beta * shadow + (1 - beta) * param, after each optimizer step."""
        for name, p in module.named_parameters():
            if name in self.shadow:
                self.shadow[name].lerp_(p.detach().float(), 1.0 - self.beta)

    @contextlib.contextmanager
    def swapped_in(self, module: torch.nn.Module):
        """Context in which `module` holds the averaged parameters (e.g. to export them); restored after."""
        saved = {}
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name in self.shadow:
                    saved[name] = p.detach().clone()
                    p.copy_(self.shadow[name].to(p.dtype))
        try:
            yield module
        finally:
            with torch.no_grad():
                for name, p in module.named_parameters():
                    if name in saved:
                        p.copy_(saved[name])

    def state_dict(self) -> dict:
        return {"beta": self.beta, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.beta = float(state["beta"])
        self.shadow = {k: v.float() for k, v in state["shadow"].items()}
