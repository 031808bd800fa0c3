"""A tool an agent can call: a name, a description, a JSON schema of its arguments, and the Python function behind it.

A call never raises: a bad call (a missing or unknown argument, a wrong JSON type) or an exception inside the
function comes back as one line, "error: ...", which the model reads as the tool's result and can react to.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from transformers.utils import get_json_schema

# the Python types a JSON schema "type" accepts (bool is an int in Python, not a JSON number)
JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
              "array": (list, tuple), "object": (dict,), "null": (type(None),)}
ERROR_CHARS = 300  # an error line is cut here: it goes back into the model's context


@dataclass
class Tool:
    """`fn(**arguments)`, described for a chat template.

    name: what the model writes in a call; description: one or two sentences the model reads;
    parameters: a JSON schema of the arguments object ({"type": "object", "properties": ..., "required": [...]}).
    """

    name: str
    description: str
    parameters: dict
    fn: Callable[..., object]

    def schema(self) -> dict:
        """The entry `tokenizer.apply_chat_template(messages, tools=[...])` takes."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, arguments: dict) -> str:
        """str(fn(**arguments)), or "error: ..." (one line) for a bad call or an exception inside fn."""
        problem = argument_problem(self.parameters, arguments)
        if problem:
            return f"error: {problem}"
        try:
            return str(self.fn(**arguments))
        except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's observation, not a crash
            return error_line(exc)


def error_line(exc: BaseException) -> str:
    """'error: ExcType: message' on one line, cut to ERROR_CHARS."""
    text = " ".join(f"error: {type(exc).__name__}: {exc}".split())
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 3] + "..."


def argument_problem(parameters: dict, arguments) -> str | None:
    """Why `arguments` does not fit the schema's top level (not an object, a required key missing, a key it does not
    name, a value of the wrong JSON type); None when it fits. Nested values are the function's to check."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {json_type(arguments)}"
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}"
    unknown = [k for k in arguments if k not in properties]
    if unknown and parameters.get("additionalProperties") is not True:
        return (f"unknown argument{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} "
                f"(takes: {', '.join(properties) or 'none'})")
    for key, value in arguments.items():
        wanted = properties.get(key, {}).get("type")
        wanted = [wanted] if isinstance(wanted, str) else list(wanted or [])
        if properties.get(key, {}).get("nullable"):
            wanted.append("null")
        known = [t for t in wanted if t in JSON_TYPES]
        if known and not any(fits(value, t) for t in known):
            return f"argument {key!r} must be {' or '.join(known)}, got {json_type(value)}"
    return None


def fits(value, json_type_name: str) -> bool:
    if isinstance(value, bool) and json_type_name in ("integer", "number"):
        return False
    return isinstance(value, JSON_TYPES[json_type_name])


def json_type(value) -> str:
    """The JSON name of a Python value's type ('string', 'integer', ...), else the Python one."""
    for name in ("boolean", "null", "string", "integer", "number", "array", "object"):
        if fits(value, name):
            return name
    return type(value).__name__


def function_tool(fn: Callable, name: str | None = None) -> Tool:
    """A tool from a plain function with type hints and a Google-style docstring (a summary line, then `Args:`
    describing every argument), read by transformers' `get_json_schema`."""
    try:
        schema = get_json_schema(fn)["function"]
    except Exception as exc:  # noqa: BLE001 - transformers' Docstring/TypeHintParsingException, said with where
        raise ValueError(f"cannot make a tool of '{getattr(fn, '__name__', fn)}' ({defined_at(fn)}): {exc} "
                         f"(a tool function needs type hints and a docstring with an Args: section)") from None
    return Tool(name or schema["name"], schema.get("description", ""), schema["parameters"], fn)


def defined_at(fn: Callable) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return "?"


def load_tool(spec: str) -> Tool:
    """The Tool, or the function made a tool, that `module:name` or `path/to/file.py:name` names (imported as a
    reward function is: `user_code.load_user_object`). ValueError naming the spec when it cannot be."""
    from rlhfkit.errors import ModelError
    from rlhfkit.user_code import load_user_object

    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"tool '{spec}': expected 'module:function' or 'path/file.py:function'")
    try:
        found = load_user_object(spec, what="tool")
    except ModelError as exc:
        raise ValueError(str(exc)) from None
    return found if isinstance(found, Tool) else function_tool(found)
