"""Tools an agent can call during a rollout: the Tool type, the built-in calculator and (only when listed) the
sandboxed Python tool, the Hermes-style call format, and `resolve_tools`, which turns a config's list into tools.
"""

from __future__ import annotations

from collections.abc import Callable

from rlhfkit.tools.calculator import calculator
from rlhfkit.tools.format import ToolCall, format_tool_call, parse_tool_calls, tools_system_prompt
from rlhfkit.tools.function import Tool, function_tool, load_tool
from rlhfkit.tools.sandbox import SANDBOXES, SandboxResult, code_tool, kernel_boundary_problem, run_sandboxed

# the tools a spec names by a word, made with the code sandbox's kind; "python" runs model-written code (in the
# sandbox) and is never on by default
BUILT_IN: dict[str, Callable[[str], Tool]] = {"calculator": lambda sandbox: calculator,
                                             "python": lambda sandbox: code_tool(sandbox=sandbox)}


def resolve_tools(specs: list, code_sandbox: str = "kernel") -> list[Tool]:
    """Tools from specs, each a Tool, a plain function (made a tool by `function_tool`), a built-in's name
    ("calculator", "python": its sandbox is `code_sandbox`, tools/sandbox.py), or an import spec "module:function" /
    "path/to/file.py:function" naming a function or a Tool. Two tools with one name are a ValueError; "python"
    where the kernel boundary cannot be built is an OSError saying so."""
    tools = []
    for spec in specs:
        if isinstance(spec, Tool):
            tools.append(spec)
        elif isinstance(spec, str) and spec in BUILT_IN:
            tools.append(BUILT_IN[spec](code_sandbox))
        elif isinstance(spec, str) and ":" in spec:
            tools.append(load_tool(spec))
        elif callable(spec) and not isinstance(spec, str):
            tools.append(function_tool(spec))
        else:
            raise ValueError(f"tool {spec!r}: expected one of {', '.join(BUILT_IN)}, 'module:function', "
                             f"'path/file.py:function', a function or a Tool")
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools: more than one tool named {', '.join(map(repr, twice))}")
    return tools


__all__ = ["SANDBOXES", "SandboxResult", "Tool", "ToolCall", "calculator", "code_tool", "format_tool_call",
           "function_tool", "kernel_boundary_problem", "load_tool", "parse_tool_calls", "resolve_tools",
           "run_sandboxed", "tools_system_prompt"]
