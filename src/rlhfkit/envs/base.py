"""The environment of a multi-turn episode: what a user writes to train an agent (docs/agents.md).

An episode starts from a dataset row, and then alternates: the model writes a turn, the environment answers.

    class Guess(Environment):
        def reset(self, row):                 # the row's dataset fields
            self.target = int(row["answer"])
            return "Guess my number (1-100)."  # the opening: a user message (or a list of messages)
        def step(self, text):                 # the model's turn, as text
            guess = int(text.split()[-1]) if text.split() and text.split()[-1].isdigit() else None
            if guess == self.target:
                return Step(done=True, reward=1.0)
            return "higher" if guess is None or guess < self.target else "lower"   # the next user message

One instance per episode: its attributes are the episode's state. The run calls `reset` once, `step` once per model
turn until it answers `done` (or `episode.max_turns` / the token budgets end the episode), then `reward` once. Each
call runs in a worker thread, several episodes at once (`episode.workers`), under `episode.timeout`.

What `step` may return: a `Step`; a string (one user message; the episode goes on); a list of messages; or None
(the episode is over). The episode's return is `reward()` (None: no final reward) plus every `Step.reward`; an
episode that earned no reward at all is left unjudged, like a reward function's None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

ROLES = ("user", "tool", "system")


@dataclass
class Step:
    """The environment's answer to one model turn."""

    messages: list = field(default_factory=list)  # the next messages, {"role": "user" | "tool", "content": str}
    reward: Optional[float] = None  # a reward for this turn (added to the episode's return)
    done: bool = False  # the episode is over: no further model turn


class Environment:
    """Subclass it and write `reset` and `step` (and `reward` for a final reward); see the module docstring.

    The run sets `self.tools` (the tools of `episode.tools` and the class's own `tools`, rlhfkit.tools.Tool
    objects) before `reset`; `ToolEnvironment` calls them for the model."""

    tools: list = []  # tool specs the environment brings: "calculator", "python", module:function, Tool objects

    @classmethod
    def check_args(cls, **env_args) -> None:
        """Check `episode.env_args` once, before any model loads: raise a ConfigError naming the key, or a
        ValueError saying what is wrong. The default checks nothing beyond the constructor's signature."""

    def reset(self, row: dict) -> Any:
        """Start the episode from a dataset row (its fields). Return the opening: a user message (str), a list of
        messages, or None to open with the row's own prompt."""
        return None

    def step(self, text: str) -> Any:
        """React to the model's turn `text`: a Step, a user message (str), a list of messages, or None (done)."""
        raise NotImplementedError(f"{type(self).__name__}.step: write how the environment answers a model turn")

    def reward(self) -> Optional[float]:
        """The episode's final reward, once it is over (None: none beyond the per-turn rewards)."""
        return None


class BadValue(ValueError):
    """An environment returned something the run cannot use (the episode is left unjudged, reason bad_value)."""


def as_messages(value: Any, what: str) -> list[dict]:
    """A str (a user message) or a list of {"role", "content"} messages, checked; BadValue naming `what`."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)):
        raise BadValue(f"{what} returned {type(value).__name__} ({value!r:.60}); expected a message string or a "
                       f"list of {{'role', 'content'}} messages")
    out = []
    for i, message in enumerate(value):
        if isinstance(message, str):
            message = {"role": "user", "content": message}
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or message.get("role") not in ROLES + ("assistant",):
            raise BadValue(f"{what} returned message {i} = {message!r:.80}; expected {{'role': one of "
                           f"{', '.join(ROLES)}, 'content': str}}")
        out.append(dict(message))
    return out


def as_step(value: Any, what: str) -> Step:
    """What `Environment.step` returned, as a checked Step."""
    if value is None:
        return Step(done=True)
    if isinstance(value, Step):
        step = Step(as_messages(value.messages or [], what), value.reward, bool(value.done))
    else:
        step = Step(as_messages(value, what))
    if step.reward is not None:
        step.reward = as_reward(step.reward, what)
    if not step.done and not step.messages:
        raise BadValue(f"{what} returned no message and done=False: the model would have nothing to answer")
    return step


def as_reward(value: Any, what: str) -> Optional[float]:
    """A finite float (or None); BadValue otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise BadValue(f"{what} returned reward {value!r:.60}; expected a number or None")
    number = float(value)
    if not math.isfinite(number):
        raise BadValue(f"{what} returned reward {number}; expected a finite number or None")
    return number
