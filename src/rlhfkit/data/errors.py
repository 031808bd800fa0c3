"""The one error type for bad input data.

A user who gets a `DataError` should be able to fix their file from the message alone, so every message is one
line that starts with where the problem is (`path:line`) and, for a row, names the field:

    data/train.jsonl:17: field 'chosen': missing (row has keys: prompt, response)
"""

from __future__ import annotations


class DataError(ValueError):
    """Raised for input data that cannot be read or converted; the message is one line naming file, line, field."""


def where(source: str, line: int | None) -> str:
    """`path:line` (1-based line or row), or just `path` when the source has no lines (e.g. a whole file)."""
    return f"{source}:{line}" if line is not None else str(source)
