"""The tool-call format for chat templates that define none: Hermes style, which the Qwen, Hermes and SmolLM3
templates also use. The model writes one block per call,

    <tool_call>{"name": "calculator", "arguments": {"expression": "347*829"}}</tool_call>

and each call's result comes back as a message of role "tool". The system prompt `tools_system_prompt` writes
tells a model without tool-use training the same, in a few lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rlhfkit.tools.function import Tool

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and its arguments object."""

    name: str
    arguments: dict = field(default_factory=dict)


def format_tool_call(name: str, arguments: dict) -> str:
    """The exact text of one call (JSON with non-ASCII characters kept as they are)."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CALL_CLOSE}"


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Every well-formed call block in `text`, in order, and one error string per malformed block (bad JSON, not
    an object, a missing or non-string "name", "arguments" not an object, no closing tag). A block without
    "arguments" calls the tool with none. Text outside the blocks is ignored."""
    calls, errors = [], []
    start, number = text.find(CALL_OPEN), 0
    while start != -1:
        number += 1
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
        if end == -1:
            errors.append(f"tool call {number}: no closing {CALL_CLOSE}")
            break
        call = read_call(text[start + len(CALL_OPEN):end])
        if isinstance(call, str):
            errors.append(f"tool call {number}: {call}")
        else:
            calls.append(call)
        start = text.find(CALL_OPEN, end + len(CALL_CLOSE))
    return calls, errors


def read_call(body: str) -> ToolCall | str:
    """The call one block's JSON describes, or why it describes none."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(data, dict):
        return "expected a JSON object with \"name\" and \"arguments\""
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return "missing \"name\" (a string)"
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return f"\"arguments\" of '{name}' must be a JSON object"
    return ToolCall(name, arguments)


def tools_system_prompt(tools: list[Tool]) -> str:
    """Plain-text instructions for a model: each tool's name, description and JSON parameters, the call format,
    and where results come back. Short: it goes into small models' prompts."""
    listed = "\n".join(f"- {t.name}: {t.description} Parameters: {json.dumps(t.parameters, ensure_ascii=False)}"
                       for t in tools)
    example = format_tool_call("TOOL_NAME", {"ARGUMENT": "VALUE"})
    return (f"You can call these tools:\n{listed}\n\n"
            f"To call a tool, write exactly one line per call:\n{example}\n"
            f"Each result comes back in a message of role \"tool\". Then continue, or give your final answer.")
