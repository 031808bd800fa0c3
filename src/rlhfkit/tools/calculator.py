"""The calculator tool: arithmetic evaluated by walking the parsed expression (never eval or exec).

Accepted: int and float literals (1e3 and 0x1F too), + - * / // % **, unary + and -, parentheses, with Python's
precedence (-3**2 is -9). Refused with "error: ...": anything else (names, calls, attributes, strings,
comparisons...), input over MAX_CHARS characters, an exponent above MAX_EXPONENT in size or a result over
MAX_DIGITS digits (work and memory stay small), division by zero, a complex or infinite result.

Results: an int prints as an int ("347*829" -> "287663"); a float with 15 significant digits, which drops the
binary noise repr shows and a whole float's ".0": "0.1+0.2" -> "0.3", "6/3" -> "2", "7/2" -> "3.5",
"1/3" -> "0.333333333333333"; from 1e15 on a float prints in exponent form ("1e20*1.0" -> "1e+20").
"""

from __future__ import annotations

import ast
import math
import operator

from rlhfkit.tools.function import Tool

MAX_CHARS = 200
MAX_EXPONENT = 1000
MAX_DIGITS = 1000
MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))  # an int of more bits has more than MAX_DIGITS digits


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message says why in a few words."""


def power(base, exponent):
    """base ** exponent, refused before it is computed when the exponent or the result would be huge."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent:g} is too large (at most {MAX_EXPONENT} in size)")
    if isinstance(base, int) and isinstance(exponent, int) and (abs(base).bit_length() - 1) * exponent > MAX_BITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return base ** exponent


BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: power}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# what a refused node is called in the error
REFUSED = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes", ast.Subscript: "subscripts",
           ast.Compare: "comparisons", ast.And: "'and'", ast.Or: "'or'", ast.Lambda: "lambdas",
           ast.JoinedStr: "strings",
           ast.BitAnd: "bit operators", ast.BitOr: "bit operators", ast.BitXor: "bit operators",
           ast.LShift: "shifts", ast.RShift: "shifts", ast.MatMult: "'@'", ast.Invert: "'~'", ast.Not: "'not'",
           ast.List: "lists", ast.Tuple: "tuples"}
CONSTANTS = {str: "strings", bytes: "strings", bool: "True/False", complex: "complex numbers"}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything the module docstring refuses."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not a valid arithmetic expression") from None
    return value_of(tree.body)


def value_of(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = value_of(node.left), value_of(node.right)
        try:
            return checked(BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:  # a float overflow, or an int too large for a float
            raise CalculatorError("the result is too large") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](value_of(node.operand))
    if isinstance(node, ast.Constant):
        what = CONSTANTS.get(type(node.value), repr(node.value))
    else:
        refused = getattr(node, "op", node)  # a BinOp/UnaryOp/BoolOp is refused for its operator
        what = REFUSED.get(type(refused), type(refused).__name__)
    raise CalculatorError(f"not allowed: {what} (only numbers, + - * / // % ** and parentheses)")


def checked(value) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is too large")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def format_number(value: float) -> str:
    """An int as is; a float with 15 significant digits (see the module docstring)."""
    if isinstance(value, int):
        return str(value)
    return "0" if value == 0 else format(value, ".15g")  # -0.0 too


def calculate(expression: str) -> str:
    """The calculator's function: the formatted value, or "error: ..."."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"


calculator = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string", "description": "for example (347*829)/3"}},
                "required": ["expression"]},
    fn=calculate,
)
