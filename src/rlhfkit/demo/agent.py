"""The agent task of `rlhfkit demo --task calculator`: 3-digit multiplication, which SmolLM2-135M-Instruct cannot do
in its head, with a calculator it may call.

`MultiplyEnv` is an ordinary environment (rlhfkit.envs.ToolEnvironment), named in the PPO config as
`env=rlhfkit.demo.agent:MultiplyEnv` exactly as a user's would be: the question is the prompt row's own, the model
may call the calculator (its result comes back as a tool turn), and its first turn without a call is the answer,
right when the first number in it equals the product (commas allowed: "287,663").

The demonstrations that teach the call format are generated here too: for a question, the conversation system
(the template's own text and the tool instructions) -> user question -> assistant call -> tool result -> assistant
answer, as two SFT rows (the call; the answer after the result), rendered from the same messages an episode opens
with (`TurnRenderer.opening_messages`). Half the answers are the bare product ("287663"), half restate the question
first ("347 * 829 = 287663"), which the reward counts as wrong (its first number is not the product): the SFT
model calls the calculator and then answers either way, and RL has to learn, from the reward alone, to answer with
the result first.
"""

from __future__ import annotations

import random
import re

from rlhfkit.envs import ToolEnvironment

_QUESTION = re.compile(r"What is (\d+) \* (\d+)\?")
_NUMBER = re.compile(r"-?\d[\d,]*")


def questions(seed: int, train: int = 256, heldout: int = 48) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(training, held-out) pairs of 3-digit factors, disjoint, chosen by `seed`."""
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    seen = set()
    while len(pairs) < train + heldout:
        pair = (rng.randint(100, 999), rng.randint(100, 999))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs[heldout:], pairs[:heldout]


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def prompt_row(a: int, b: int) -> dict:
    """A prompt row of the task: the question and its answer (a dataset field the environment reads)."""
    return {"prompt": question(a, b), "answer": a * b}


def first_number(text: str) -> int | None:
    """The first integer written in `text` (thousands separators allowed), or None."""
    match = _NUMBER.search(text)
    if not match:
        return None
    digits = match.group().replace(",", "")
    return int(digits) if digits.lstrip("-").isdigit() else None


class MultiplyEnv(ToolEnvironment):
    """The question is the row's prompt; the answer is right when its first number is the product."""

    tools = ["calculator"]

    def reset(self, row: dict):
        self.answer = int(row["answer"])
        return None  # open with the row's own prompt (the tools described beside it)

    def score(self, answer: str) -> float:
        return float(first_number(answer) == self.answer)


def demonstration_rows(pairs: list[tuple[int, int]], renderer) -> list[dict]:
    """SFT rows teaching the tool format: per question, the call after the question, and the answer after the
    calculator's result (every other one restating the question first). `renderer`: the TurnRenderer of the run's
    template and tools."""
    from rlhfkit.tools.format import format_tool_call

    calculator = next(tool for tool in renderer.tools if tool.name == "calculator")
    rows = []
    for i, (a, b) in enumerate(pairs):
        opening = renderer.opening_messages([{"role": "user", "content": question(a, b)}])
        arguments = {"expression": f"{a} * {b}"}
        call = [{"role": "assistant", "content": format_tool_call("calculator", arguments)}]
        result = calculator(arguments)
        answer = result if i % 2 == 0 else f"{a} * {b} = {result}"
        rows.append({"messages": opening + call})
        rows.append({"messages": opening + call + [{"role": "tool", "content": result},
                                                   {"role": "assistant", "content": answer}]})
    return rows
