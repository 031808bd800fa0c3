"""Agent tools: the calculator's values and refusals, tools from plain functions and import specs, the
Hermes-style call format and the tools' system prompt."""

from __future__ import annotations

import json
import sys

import pytest

from rlhfkit.tools import Tool, ToolCall, calculator, function_tool, resolve_tools
from rlhfkit.tools.calculator import MAX_CHARS
from rlhfkit.tools.format import format_tool_call, parse_tool_calls, tools_system_prompt


def calc(expression) -> str:
    return calculator({"expression": expression})


@pytest.mark.parametrize("expression, expected", [
    ("347*829", "287663"),
    ("2**10", "1024"),
    ("(1+2)*3-4/2", "7"),  # 9 - 2.0: a whole float prints without ".0"
    ("-3**2", "-9"),  # Python's precedence: -(3**2)
    ("(-3)**2", "9"),
    ("6/3", "2"),
    ("7/2", "3.5"),
    ("1/3", "0.333333333333333"),  # 15 significant digits
    ("0.1+0.2", "0.3"),  # repr would show 0.30000000000000004
    ("7//2", "3"),
    ("-7//2", "-4"),
    ("7%3", "1"),
    ("-7%3", "2"),
    ("2**-1", "0.5"),
    ("+5 - -5", "10"),
    ("1e3+0.5", "1000.5"),
    ("0x10 + 1", "17"),
    ("1e20*1.0", "1e+20"),
    ("2**100", "1267650600228229401496703205376"),  # ints stay exact
    (" 12 * (3 + 4) ", "84"),
    ("-0.0", "0"),
])
def test_calculator_values(expression, expected):
    assert calc(expression) == expected


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os')", "function calls"),
    ("a+1", "names"),
    ("(1).real", "attributes"),
    ("'a'*3", "strings"),
    ("True+1", "True/False"),
    ("1<2", "comparisons"),
    ("[1, 2]", "lists"),
    ("1j", "complex numbers"),
    ("~1", "'~'"),
    ("9**99999", "exponent 99999 is too large"),
    ("10**(-2000)", "exponent -2000 is too large"),
    ("99999999**1000", "more than 1000 digits"),
    ("1/0", "division by zero"),
    ("5//0", "division by zero"),
    ("5%0", "division by zero"),
    ("0**-1", "division by zero"),
    ("1" * (MAX_CHARS + 1), f"longer than {MAX_CHARS} characters"),
    ("10.0**1000", "too large"),
    ("1e999", "too large"),
    ("(-8)**0.5", "not a real number"),
    ("1 +", "not a valid arithmetic expression"),
    ("", "not a valid arithmetic expression"),
])
def test_calculator_refusals(expression, reason):
    result = calc(expression)
    assert result.startswith("error: ") and reason in result, result


def test_calculator_is_a_tool_with_a_schema():
    assert calculator.schema() == {"type": "function", "function": {
        "name": "calculator", "description": calculator.description, "parameters": calculator.parameters}}
    assert calculator.parameters["required"] == ["expression"]
    assert calculator({}) == "error: missing required argument 'expression'"
    assert calculator({"expression": 12}) == "error: argument 'expression' must be string, got integer"
    assert calculator({"expression": "1", "x": 1}).startswith("error: unknown argument 'x'")
    assert calculator(["1+1"]) == "error: arguments must be a JSON object, got array"


def convert(amount: float, unit: str, exact: bool = False) -> str:
    """Convert a length to meters.

    Args:
        amount: how many units
        unit: the unit, "km" or "mile"
        exact: keep every digit instead of rounding to a whole meter
    """
    meters = amount * {"km": 1000.0, "mile": 1609.344}[unit]
    return str(meters if exact else round(meters))


def no_docstring(x: int) -> int:
    return x


def test_function_tool_reads_types_and_docstring():
    tool = function_tool(convert)
    assert (tool.name, tool.description) == ("convert", "Convert a length to meters.")
    params = tool.parameters
    assert {k: v["type"] for k, v in params["properties"].items()} == \
        {"amount": "number", "unit": "string", "exact": "boolean"}
    assert params["required"] == ["amount", "unit"]
    assert params["properties"]["unit"]["description"] == 'the unit, "km" or "mile"'
    assert tool.schema()["function"]["parameters"] == params
    assert function_tool(convert, name="to_meters").name == "to_meters"


def test_function_tool_calls_and_errors():
    tool = function_tool(convert)
    assert tool({"amount": 2, "unit": "km"}) == "2000"
    assert tool({"amount": 1, "unit": "mile", "exact": True}) == "1609.344"
    assert tool({"amount": 2}) == "error: missing required argument 'unit'"
    assert tool({"unit": "km"}) == "error: missing required argument 'amount'"
    assert tool({"amount": "two", "unit": "km"}) == "error: argument 'amount' must be number, got string"
    assert tool({"amount": True, "unit": "km"}) == "error: argument 'amount' must be number, got boolean"
    assert tool({"amount": 2, "unit": "km", "round": 1}) == \
        "error: unknown argument 'round' (takes: amount, unit, exact)"
    # an exception inside the function is the model's observation, on one line
    assert tool({"amount": 2, "unit": "parsec"}) == "error: KeyError: 'parsec'"


def test_function_tool_error_is_one_line():
    def fails(text: str) -> str:
        """Fail loudly.

        Args:
            text: what to say
        """
        raise RuntimeError(f"first line\nsecond line {text}")

    assert function_tool(fails)({"text": "x"}) == "error: RuntimeError: first line second line x"


def test_function_tool_without_docstring_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot make a tool of 'no_docstring' \(.*test_tools.py:\d+\).*docstring"):
        function_tool(no_docstring)


@pytest.fixture
def tool_module(tmp_path, monkeypatch):
    """A module 'agent_tools_for_test' on sys.path with a function and a Tool."""
    (tmp_path / "agent_tools_for_test.py").write_text(
        "from rlhfkit.tools import Tool\n\n"
        "def double(n: int) -> int:\n"
        "    '''Double a number.\n\n    Args:\n        n: the number\n    '''\n"
        "    return 2 * n\n\n"
        "echo = Tool('echo', 'Say it back.', {'type': 'object', 'properties': {'text': {'type': 'string'}},\n"
        "            'required': ['text']}, lambda text: text)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "agent_tools_for_test"
    sys.modules.pop("agent_tools_for_test", None)


def test_resolve_tools_every_kind_of_spec(tool_module, tmp_path):
    file = tmp_path / "more" / "triple_tool.py"
    file.parent.mkdir()
    file.write_text("def triple(n: int) -> int:\n    '''Triple a number.\n\n    Args:\n        n: the number\n"
                    "    '''\n    return 3 * n\n")
    tools = resolve_tools(["calculator", f"{tool_module}:double", f"{tool_module}:echo", f"{file}:triple", convert])
    assert [t.name for t in tools] == ["calculator", "double", "echo", "triple", "convert"]
    assert tools[0] is calculator
    assert [tools[1]({"n": 21}), tools[2]({"text": "hi"}), tools[3]({"n": 5})] == ["42", "hi", "15"]
    assert tools[1].parameters["properties"]["n"]["type"] == "integer"


def test_resolve_tools_python_only_when_listed():
    assert all(t.name != "python" for t in resolve_tools(["calculator"]))
    (python,) = resolve_tools(["python"])
    assert python.name == "python" and python.parameters["required"] == ["code"]


def test_resolve_tools_refusals(tool_module, tmp_path):
    with pytest.raises(ValueError, match="more than one tool named 'calculator'"):
        resolve_tools(["calculator", calculator])
    with pytest.raises(ValueError, match="more than one tool named 'double'"):
        resolve_tools([f"{tool_module}:double", f"{tool_module}:double"])
    with pytest.raises(ValueError, match="expected one of calculator, python"):
        resolve_tools(["abacus"])
    with pytest.raises(ValueError, match="has no function 'missing'"):
        resolve_tools([f"{tool_module}:missing"])
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_here'"):
        resolve_tools(["no_such_module_here:f"])
    with pytest.raises(ValueError, match="file '.*absent.py' does not exist"):
        resolve_tools([f"{tmp_path}/absent.py:f"])
    with pytest.raises(ValueError, match="cannot make a tool of 'no_docstring'"):
        resolve_tools([no_docstring])


def test_format_is_exact_and_round_trips():
    text = format_tool_call("calculator", {"expression": "347*829"})
    assert text == '<tool_call>{"name": "calculator", "arguments": {"expression": "347*829"}}</tool_call>'
    assert format_tool_call("say", {"text": "café ☕"}) == \
        '<tool_call>{"name": "say", "arguments": {"text": "café ☕"}}</tool_call>'
    for name, arguments in [("calculator", {"expression": "2**10"}), ("say", {"text": "a \"quoted\"\nline"}),
                            ("noop", {}), ("nested", {"a": [1, {"b": None}], "c": 1.5})]:
        assert parse_tool_calls(format_tool_call(name, arguments)) == ([ToolCall(name, arguments)], [])


def test_parse_several_calls_in_text():
    text = ("Let me compute both.\n" + format_tool_call("calculator", {"expression": "1+1"}) + "\nand\n"
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'  # Qwen's layout
            '<tool_call>{"name": "noop"}</tool_call> done')
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "1+1"}), ToolCall("calculator", {"expression": "2*3"}),
                     ToolCall("noop", {})]
    assert errors == []
    assert parse_tool_calls("no calls here, just an answer: 42") == ([], [])


def test_parse_reports_each_malformed_block():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>'  # bad JSON
            '<tool_call>{"arguments": {}}</tool_call>'  # no name
            '<tool_call>{"name": "calculator", "arguments": ["1+1"]}</tool_call>'  # arguments not an object
            '<tool_call>["calculator"]</tool_call>'  # not an object
            '<tool_call>{"name": "calculator", "arguments": {"expression": "5"}}</tool_call>'  # fine
            '<tool_call>{"name": "calculator", "argu')  # cut off
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "5"})]
    assert len(errors) == 5
    assert errors[0].startswith("tool call 1: invalid JSON (Expecting ',' delimiter")
    assert errors[1:] == ['tool call 2: missing "name" (a string)',
                          "tool call 3: \"arguments\" of 'calculator' must be a JSON object",
                          'tool call 4: expected a JSON object with "name" and "arguments"',
                          "tool call 6: no closing </tool_call>"]


def test_system_prompt_lists_tools_and_the_format():
    tools = [calculator, function_tool(convert)]
    prompt = tools_system_prompt(tools)
    for tool in tools:
        assert f"- {tool.name}: {tool.description}" in prompt
        assert json.dumps(tool.parameters, ensure_ascii=False) in prompt
    assert '<tool_call>{"name": "TOOL_NAME", "arguments": {"ARGUMENT": "VALUE"}}</tool_call>' in prompt
    assert 'role "tool"' in prompt
    without_tools = len(tools_system_prompt([]))
    assert without_tools < 300  # the fixed text stays short for small models' prompts


def test_tool_dataclass_by_hand():
    tool = Tool("add", "Add two integers.", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                            "b": {"type": "integer"}},
                                             "required": ["a", "b"]}, lambda a, b: a + b)
    assert tool({"a": 2, "b": 3}) == "5"
    assert tool({"a": 2, "b": 3.5}) == "error: argument 'b' must be integer, got number"
    assert tool({"a": 2}) == "error: missing required argument 'b'"
