"""An environment for tasks the model may solve with tools: it runs the model's tool calls and judges its answer.

    class Multiply(ToolEnvironment):
        tools = ["calculator"]
        def reset(self, row):
            self.answer = str(row["answer"])
            return row["question"]
        def score(self, answer):          # the model's first turn without a tool call
            return float(answer.strip() == self.answer)

Each model turn that calls tools gets one message of role "tool" per call, holding the tool's result (or an
"error: ..." line: an unknown tool, malformed arguments); the first turn without a call is the answer, and the
episode ends there with `score(answer)` as its reward. Calls are read in the documented fallback format
(`rlhfkit.tools.format`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of the Qwen, Hermes
and SmolLM3 templates) unless the tokenizer brings its own response parser (transformers' `parse_response`).
"""

from __future__ import annotations

from typing import Optional

from rlhfkit.envs.base import Environment, Step


class ToolEnvironment(Environment):
    parser = None  # set by the run: the tokenizer's own tool-call parser where it has one, else the fallback format

    def score(self, answer: str) -> Optional[float]:
        """The reward of the model's final answer (its first turn without a tool call); None: unjudged."""
        raise NotImplementedError(f"{type(self).__name__}.score: write how the answer is judged")

    def step(self, text: str) -> Step:
        from rlhfkit.tools.format import parse_tool_calls

        calls, errors = (self.parser or parse_tool_calls)(text)
        if not calls and not errors:
            self.final = self.score(text.strip())
            return Step(done=True)
        by_name = {tool.name: tool for tool in self.tools}
        self.tool_calls = getattr(self, "tool_calls", 0) + len(calls) + len(errors)
        messages = [{"role": "tool", "content": f"error: {error}"} for error in errors]
        for call in calls:
            tool = by_name.get(call.name)
            result = tool(call.arguments) if tool is not None else \
                f"error: no tool named {call.name!r} (tools: {', '.join(by_name) or 'none'})"
            messages.append({"role": "tool", "name": call.name, "content": result})
        return Step(messages)

    def reward(self) -> Optional[float]:
        return getattr(self, "final", None)
