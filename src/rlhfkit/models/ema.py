"""Exponential moving average of a model's trainable parameters (DeepSpeed-Chat's actor EMA, beta 0.992).

An averaged policy is smoother than the last iterate of noisy PPO updates (cf. Polyak averaging). Only
trainable parameters are tracked: with LoRA that is the adapter, so the EMA costs the adapter's size. Each rank
averages what it holds of each parameter (`engine.held_parameters`: under ZeRO-3 its partition), so the EMA is
partitioned as the model is, and needs no communication to update.
"""

from __future__ import annotations

import contextlib

import torch


class EMA:
    def __init__(self, module: torch.nn.Module, engine, beta: float = 0.992):
        self.beta, self.engine = beta, engine
        self.shadow = {name: t.detach().clone().float() for name, t in engine.held_parameters(module).items()}

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        """shadow <- beta * shadow + (1 - beta) * param, after each optimizer step."""
        for name, t in self.engine.held_parameters(module).items():
            if name in self.shadow:
                self.shadow[name].lerp_(t.detach().float(), 1.0 - self.beta)

    @contextlib.contextmanager
    def swapped_in(self, module: torch.nn.Module):
        """Context in which `module` holds the averaged parameters (e.g. to export them); restored after. Every
        rank enters it at the same point (under ZeRO-3 it gathers)."""
        held = {name: t for name, t in self.engine.held_parameters(module).items() if name in self.shadow}
        saved = {}
        with torch.no_grad():
            for name, t in held.items():
                saved[name] = t.detach().clone()
                t.copy_(self.shadow[name].to(t.dtype))
        self.engine.parameters_written(module)
        try:
            yield module
        finally:
            with torch.no_grad():
                for name, t in held.items():
                    t.copy_(saved[name])
            self.engine.parameters_written(module)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        """The averaged parameters from the checkpoint; beta stays the configured one (`ema.beta` may change on a
        resume)."""
        # each shadow on the device of the parameter it averages (a checkpoint's tensors load on the CPU)
        self.shadow = {k: v.float().to(self.shadow[k].device if k in self.shadow else v.device)
                       for k, v in state["shadow"].items()}
