"""Tasks with a verifiable reward for the real-model demo (`rlhfkit demo --task NAME`).

A task is a set of prompts with one exact answer each and a reward that checks a response against it: a Python
function of the kind `rlhfkit ppo reward=module:function` takes, so the demo trains through the same code path a
user's verifiable reward would. The answer is recomputed from the prompt text itself, so the reward needs no
side channel.

`arithmetic`: "What is A + B?" with A, B in 1..9 (81 questions). Correct means the first number in the response
that is not one of the two operands equals A + B: "The answer is 12.", "5 + 7 = 12" and "12" are correct;
"5 + 7 = 13" is not, and neither is a list of numbers that merely contains 12 later ("10, 11, 12"). SmolLM2-135M-
Instruct sampled at temperature 1 rambles ("What a classic problem...") and is right about one time in ten;
the answer it needs is one it can already compute, so RL has to teach it to answer, and answer first.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

_QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")
_NUMBER = re.compile(r"-?\d+(?:[.,/]\d+)*")  # a number as written: 12, -3, 12.5, 12,000, 12/5
_INTEGER = re.compile(r"-?\d{1,18}(?:\.0+)?")  # one that is an integer: 12, 12.0


def arithmetic_prompts(seed: int, heldout: int = 21) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts): all 81 questions A + B with A, B in 1..9, `heldout` of them kept
    out of training (chosen by `seed`). "3 + 5" and "5 + 3" are different questions."""
    questions = [f"What is {a} + {b}?" for a in range(1, 10) for b in range(1, 10)]
    random.Random(seed).shuffle(questions)
    return sorted(questions[heldout:]), sorted(questions[:heldout])


def arithmetic_correct(prompt: str, response: str) -> float:
    """1.0 when the first number of `response` that is not an operand equals A + B, else 0.0. Numbers are read
    whole: "12.5", "12,000" and "12/5" are not 12.

    `prompt` may be the rendered chat prompt: the last "What is A + B?" in it is the question."""
    found = _QUESTION.findall(prompt)
    if not found:
        raise ValueError(f"no 'What is A + B?' question in the prompt {prompt[-80:]!r}")
    a, b = (int(x) for x in found[-1])
    operands = [a, b]
    for token in _NUMBER.findall(response):
        number = int(token.split(".")[0]) if _INTEGER.fullmatch(token) else None
        if number is not None and number in operands:
            operands.remove(number)  # restating the question ("5 + 7 = ...") is allowed, once per operand
            continue
        return float(number == a + b)
    return 0.0


def arithmetic_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The PPO reward (`reward=rlhfkit.demo.tasks:arithmetic_reward`): 1 for a correct answer, else 0."""
    return [arithmetic_correct(p, r) for p, r in zip(prompts, responses)]


@dataclass(frozen=True)
class Task:
    prompts: Callable[[int], tuple[list[str], list[str]]]  # seed -> (training, held-out) prompts
    correct: Callable[[str, str], float]  # (prompt, response) -> 1.0 / 0.0
    reward: str  # the same check as `rlhfkit ppo`'s reward spec
    description: str


TASKS = {
    "arithmetic": Task(arithmetic_prompts, arithmetic_correct, "rlhfkit.demo.tasks:arithmetic_reward",
                       "single-digit addition with an exact answer, answered first"),
}
