"""Play an episode by hand, before any training: scripted model turns against an environment, as a run would.

    from rlhfkit.envs import play
    episode = play("my_env.py:Multiply", {"question": "What is 12 * 34?", "answer": 408},
                   ['<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>', "408"])
    print(episode.text())      # the conversation, turn by turn, and the return
    episode.reward             # 1.0 (None: the episode earned no reward, which a run leaves unjudged)

The environment is built, given its tools and called as in a run (`reset` with the row's fields, `step` with each
turn's text, `reward` at the end), and every value it returns is checked by the same code, so a mistake raises the
error a run would report. What it does not do: tokenise (the run renders every turn with the model's chat template
and ends an episode at `episode.max_tokens`), time the calls, or sample: the turns are yours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlhfkit.envs.base import as_messages, as_reward, as_step


@dataclass
class Transcript:
    """What happened in one played episode."""

    messages: list = field(default_factory=list)  # the opening, then each model turn and the environment's answer
    turn_rewards: list = field(default_factory=list)  # the rewards of `Step.reward`, in order
    final: Optional[float] = None  # what `reward()` returned
    ended: str = ""  # done (the environment said so), max_turns, or script_ended (no scripted turn left)

    @property
    def reward(self) -> Optional[float]:
        """The episode's return as a run computes it; None where nothing judged it (a run leaves it unjudged)."""
        if self.final is None and not self.turn_rewards:
            return None
        return (self.final or 0.0) + sum(self.turn_rewards)

    def text(self) -> str:
        lines = [f"[{m['role']}{' ' + m['name'] if m.get('name') else ''}] {m['content']}" for m in self.messages]
        shown = "unjudged" if self.reward is None else f"{self.reward:g}"
        return "\n".join(lines + [f"-- ended: {self.ended}; return {shown}"])


def play(env, row: dict | None = None, turns=(), env_args: dict | None = None, tools=(), max_turns: int = 4,
         code_sandbox: str = "kernel") -> Transcript:
    """Play `turns` (the model's turns, as text) against `env`: an Environment subclass, or its spec as a run
    takes it ("module:Class", "path/file.py:Class"), made with `env_args`. `row`: the dataset row's fields
    (`reset` gets them; a `prompt` or `messages` field opens the episode where `reset` returns None). `tools`:
    episode.tools's specs, added to the class's own; "python" runs in the `code_sandbox` a run would use."""
    env_class = env
    if isinstance(env, str):
        from rlhfkit.user_code import load_user_object

        env_class = load_user_object(env, what="env")
    name = env_class.__name__
    instance = env_class(**dict(env_args or {}))
    specs = list(getattr(env_class, "tools", None) or []) + list(tools)
    instance.tools = []
    if specs:
        from rlhfkit.tools import resolve_tools

        instance.tools = resolve_tools(specs, code_sandbox=code_sandbox)
    row = dict(row or {})
    episode = Transcript()
    opening = instance.reset(dict(row))
    if opening is not None:
        episode.messages += as_messages(opening, f"{name}.reset")
    elif row.get("messages") or row.get("prompt"):
        episode.messages += as_messages(row.get("messages") or row["prompt"], "the row's prompt")
    script = list(turns)
    for turn in range(max_turns):
        if turn >= len(script):
            episode.ended = "script_ended"
            break
        episode.messages.append({"role": "assistant", "content": script[turn]})
        step = as_step(instance.step(script[turn]), f"{name}.step")
        if step.reward is not None:
            episode.turn_rewards.append(step.reward)
        if step.done:
            episode.ended = "done"
            break
        if turn < max_turns - 1:  # a run renders no answer to the last turn: nothing would read it
            episode.messages += step.messages
    else:
        episode.ended = "max_turns"
    episode.final = as_reward(instance.reward(), f"{name}.reward")
    return episode
