"""A request to `rlhfkit serve-reward` read and checked: its Content-Length, its body's size and shape before it
is parsed, then the contract's fields (remote/client.py has the contract; docs/remote.md). Standard library only.

A body is measured on its bytes before `json.loads` builds anything: its count of JSON values and its nesting
depth. Parsed, 8 MiB of `{},` is 2.8 million dicts (+210 MB), and 100,000 `[` a RecursionError; refused here, a
request costs a few times its bytes at most.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

DEFAULT_MAX_JSON_VALUES = 2 ** 18
MAX_DEPTH = 64  # JSON nesting; the contract itself needs 4 (an object, messages, a sample's turns, a turn)
MAX_LENGTH_DIGITS = 15  # a Content-Length of more digits (a petabyte) is no byte count anyone sends
KEYS = ("prompts", "responses", "messages", "finished", "fields")


class ContractError(ValueError):
    """A request the server refuses: `status` (400, 411 or 413) and a one-line message naming the field."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Samples:
    """One request's samples (or several pooled), read as a reward reads a rollout batch (rollout/batch.py)."""

    prompt_texts: list  # B prompts
    response_texts: list  # B responses
    messages: list  # B prompt turn lists ([{role, content}]), a reward model re-renders
    fields: list  # B dicts: the request's columns, row by row
    finished: list  # B bools: the response ended with EOS

    @property
    def size(self) -> int:
        return len(self.prompt_texts)

    @property
    def columns(self) -> tuple:
        """The field names: requests pool only with requests of the same columns."""
        return tuple(sorted(self.fields[0])) if self.fields else ()


def read_request(body: bytes, max_samples: int, max_values: int = DEFAULT_MAX_JSON_VALUES) -> Samples:
    """The samples of a request body; ContractError naming the field when it breaks the contract."""
    check_structure(body, max_values)
    try:  # UTF-8 only (RFC 8259), the encoding check_structure read it in; json.loads would guess UTF-16 or 32
        document = json.loads(body.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError too
        raise ContractError(f"malformed JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ContractError('expected a JSON object {"prompts": [...], "responses": [...]}')
    unknown = sorted(set(document) - set(KEYS))
    if unknown:
        raise ContractError(f"unknown field '{unknown[0]}' (the contract's fields: {', '.join(KEYS)})")
    prompts, responses = _strings(document, "prompts", max_samples), _strings(document, "responses", max_samples)
    n = len(prompts)
    if len(responses) != n:
        raise ContractError(f"field 'responses': {len(responses)} responses for {n} prompts")
    messages = _listed(document, "messages", n, [None] * n)
    messages = [_messages(m, i) if m is not None else [{"role": "user", "content": p}]
                for i, (m, p) in enumerate(zip(messages, prompts))]
    finished = _listed(document, "finished", n, [True] * n)
    if not all(isinstance(f, bool) for f in finished):
        raise ContractError("field 'finished': expected true or false per sample")
    columns = document.get("fields") or {}
    if not isinstance(columns, dict):
        raise ContractError("field 'fields': expected an object {column: [one value per sample]}")
    for name, values in columns.items():
        if not isinstance(values, list) or len(values) != n:
            raise ContractError(f"field 'fields.{name}': expected a list of {n} values, one per sample")
    rows = [{name: values[i] for name, values in columns.items()} for i in range(n)]
    return Samples(prompts, responses, messages, rows, finished)


JSON_STRING = re.compile(rb'"[^"]*(?:"|\Z)')  # once escapes are gone; an unterminated one runs to the end
NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
SQUARE = bytes.maketrans(b"{}", b"[]")


def check_structure(body: bytes, max_values: int) -> None:
    """ContractError unless `body` holds at most `max_values` JSON values nested at most MAX_DEPTH deep, measured
    on its bytes before it is parsed. Brackets, commas and colons inside strings do not count: a response may hold
    any text."""
    # 1. the bytes outside strings: escaped backslashes and quotes dropped first, so every `"` left opens or
    #    closes a string (a backslash outside a string is malformed JSON anyway, which json.loads says)
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = text.count(b'"') // 2
    if strings > max_values:  # before the regex below runs once per string
        raise ContractError(f"the request holds {strings} JSON strings, more than this server's --max-json-values "
                            f"{max_values}", 413)
    bare = JSON_STRING.sub(b"", text)  # the same object, no copy, when nothing is removed
    # 2. its values and keys: the first, then one after each `,` and `:`, and after each `[` or `{` but an empty one
    #    (written `[ ]`, one is counted too many: a bound, not a census)
    values = 1 + sum(bare.count(c) for c in (b",", b":", b"[", b"{")) - bare.count(b"[]") - bare.count(b"{}")
    if values > max_values:
        raise ContractError(f"the request holds {values} JSON values, more than this server's --max-json-values "
                            f"{max_values}", 413)
    # 3. its depth: the brackets alone, all made square (a mismatched pair is json.loads' to refuse), then each
    #    pass drops the innermost pairs, one level, so a document MAX_DEPTH deep is gone in as many passes
    brackets = bare.translate(SQUARE, NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
    if brackets:
        raise ContractError(f"malformed JSON: brackets unbalanced or nested more than {MAX_DEPTH} deep")


def content_length(headers, limit: int) -> int:
    """The body's size from the request's one Content-Length of ASCII digits; ContractError with 400 (malformed:
    '²', '-1', '5, 5', two headers, a number of 5,000 digits), 411 (none, or a Transfer-Encoding) or 413 (over
    `limit`)."""
    values = headers.get_all("Content-Length") or []
    if headers.get("Transfer-Encoding") is not None or not values:
        raise ContractError("a request needs its Content-Length (Transfer-Encoding is not taken)", 411)
    if len(values) > 1:
        raise ContractError(f"{len(values)} Content-Length headers: a request has one")
    text = values[0].strip(" \t")
    if not re.fullmatch(r"[0-9]+", text):
        raise ContractError(f"Content-Length {text[:20]!r} is not a byte count (ASCII digits)")
    digits = text.lstrip("0") or "0"
    if len(digits) > MAX_LENGTH_DIGITS:
        raise ContractError(f"Content-Length of {len(digits)} digits is not a byte count this server takes "
                            f"(--max-request-bytes {limit})")
    if int(digits) > limit:
        raise ContractError(f"the request is {int(digits)} bytes, more than this server's --max-request-bytes "
                            f"{limit}", 413)
    return int(digits)


def _strings(document: dict, key: str, max_samples: int) -> list:
    values = document.get(key)
    if values is None:
        raise ContractError(f"field '{key}': required, a list of strings")
    if isinstance(values, list) and len(values) > max_samples:  # counted before any sample is looked at
        raise ContractError(f"too many samples: {len(values)}, more than this server's --max-batch {max_samples}",
                            413)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ContractError(f"field '{key}': expected a list of strings")
    return values


def _listed(document: dict, key: str, n: int, default: list) -> list:
    values = document.get(key)
    if values is None:
        return default
    if not isinstance(values, list) or len(values) != n:
        raise ContractError(f"field '{key}': expected a list of {n} entries, one per sample")
    return values


def _messages(turns, i: int) -> list:
    ok = isinstance(turns, list) and turns and all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns)
    if not ok:
        raise ContractError(f"field 'messages'[{i}]: expected a list of {{\"role\": str, \"content\": str}} or null")
    return turns
