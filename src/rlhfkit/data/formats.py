"""Detect a dataset's format and convert its rows into canonical examples.

Canonical form: a prompt is a list of messages `{"role": "system"|"user"|"assistant"|"tool", "content": str}` with at
least one user message and a non-empty last message; a response is a string. Roles need not alternate and the
prompt may end with an assistant turn, as in real Anthropic HH rows, whose convention is kept: the prompt is the
text up to the LAST `\n\nAssistant:`, the response everything after it (a typo "Humans:" leaves two Assistant turns
in a row; some Assistant turns are split in two). Rendering (chat templates, tokenisation) happens elsewhere; a
template that needs alternating roles gets same-role turns merged (templates.py).

Each format is one entry of `_FORMATS` with how to recognise it from the first row's keys and how to extract, per
task, the prompt / the SFT pair / the preference triple. `FORMATS[task]` maps format names to those parsers; the
detection order is the table's order (more specific layouts first). Every later row is validated with the same
parser, and every error names `path:line` and the field. All text is stripped of surrounding whitespace.

A row that is well formed but unusable (no user turn, an empty turn to answer, an empty response or chosen reply)
is skipped and counted by reason in `stats` (ROW_SKIPS); with `strict=True` (`data.strict_rows`) it is the
DataError it would otherwise be. Structural problems (a missing field, a wrong type, an undetectable format) are
always errors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhfkit.data.readers import Row
from rlhfkit.errors import DataError, where

ROLES = ("system", "user", "assistant", "tool")  # tool: a tool's result in an agent's conversation


@dataclass
class SFTExample:
    prompt: list[dict]
    response: str
    source: str
    line: int | None


@dataclass
class PreferenceExample:
    prompt: list[dict]
    chosen: str
    rejected: str
    source: str
    line: int | None


@dataclass
class PromptExample:
    prompt: list[dict]
    source: str
    line: int | None
    fields: dict = field(default_factory=dict)  # the row's own fields (e.g. a reference `answer`) for rewards


def _json_fields(data: dict) -> dict:
    """The row's fields that survive JSON (the tokenised-data cache), for reward functions to read."""
    out = {}
    for key, value in data.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[str(key)] = value
    return out


# stats key -> why a well-formed row was left out: what `strict` turns into an error
ROW_SKIPS = {
    "no_user_turn": "no user message in the prompt",
    "empty_prompt": "the turn to answer is empty",
    "empty_response": "the response (or chosen reply) is empty",
}


class _Skip(Exception):
    """A well-formed row left out and counted under `reason` (its stats key). `error`: the DataError that
    `strict` raises instead, for rows with nothing to learn from (ROW_SKIPS); None for rows skipped in any mode
    (a tie, differing prompts)."""

    def __init__(self, reason: str, error: DataError | None = None):
        super().__init__(reason)
        self.reason, self.error = reason, error


class _Fields:
    """One row's fields, with accessors whose errors name `path:line` and the field."""

    def __init__(self, row: Row, data: dict):
        self.row, self.data = row, data

    def error(self, name: str, problem: str) -> DataError:
        return DataError(f"{where(self.row.source, self.row.line)}: field '{name}': {problem}")

    def unusable(self, name: str, reason: str, problem: str) -> _Skip:
        """Skip this row under ROW_SKIPS key `reason`; strict mode raises the field error `problem` instead."""
        return _Skip(reason, self.error(name, problem))

    def get(self, name: str):
        if name not in self.data:
            raise self.error(name, f"missing (row has keys: {', '.join(map(str, self.data))})")
        if self.data[name] is None:
            raise self.error(name, "is null")
        return self.data[name]

    def number(self, name: str) -> float:
        """A number; text such as "1" (CSV cells) is accepted."""
        value = self.get(name)  # outside the try: its DataError (a ValueError) for a missing field must pass
        try:
            return float(value)
        except (TypeError, ValueError):
            raise self.error(name, f"expected a number, got {value!r:.40}") from None

    def text(self, name: str, value=None, allow_empty: bool = False, part: str = "response") -> str:
        """Stripped text; empty (unless allowed) skips the row as `empty_{part}` (part: response or prompt)."""
        value = self.get(name) if value is None else value
        if not isinstance(value, str):
            raise self.error(name, f"expected a string, got {type(value).__name__}")
        if not value.strip() and not allow_empty:
            raise self.unusable(name, f"empty_{part}", "empty")
        return value.strip()

    def messages(self, name: str, value=None) -> list[dict]:
        value = self.get(name) if value is None else value
        if not isinstance(value, list) or not value:
            raise self.error(name, "expected a non-empty list of {role, content} messages")
        out = []
        for index, message in enumerate(value, start=1):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise self.error(name, f"message {index}: expected an object with 'role' and 'content'")
            if message["role"] not in ROLES:
                raise self.error(name, f"message {index}: role {message['role']!r} is not one of {', '.join(ROLES)}")
            if not isinstance(message["content"], str):
                raise self.error(name, f"message {index}: content is {type(message['content']).__name__}, not a string")
            out.append({"role": message["role"], "content": message["content"].strip()})
        return out

    def prompt(self, name: str, value=None) -> list[dict]:
        """A prompt given as messages or as a string (HH-formatted dialogue, or plain text = one user turn)."""
        value = self.get(name) if value is None else value
        if isinstance(value, str):
            messages = _parse_prompt_text(self.text(name, value, part="prompt"))
        else:
            messages = self.messages(name, value)
        return _checked_prompt(self, name, messages)


def _checked_prompt(fields: _Fields, name: str, messages: list[dict]) -> list[dict]:
    """A usable prompt has a user turn and a non-empty last turn (the one the response follows). Earlier turns
    may be empty, roles need not alternate, and the last turn may be the assistant's (real HH rows do all three)."""
    if not any(message["role"] == "user" for message in messages):
        raise fields.unusable(name, "no_user_turn", "the prompt has no user message")
    if not messages[-1]["content"]:
        raise fields.unusable(name, "empty_prompt", "empty")
    return messages


# ---------------------------------------------------------------- Anthropic HH dialogue strings

_HH_ROLE = {"Human": "user", "Assistant": "assistant"}
_HH_MARKER = re.compile(r"\n\n(Human|Assistant):")
# Some copies (yitingxie/rlhf-reward-datasets) collapsed the blank lines: "Human: hi Assistant: hello".
_HH_MARKER_LOOSE = re.compile(r"(?:^|\s)(Human|Assistant):")


def is_hh(text: str) -> bool:
    return text.lstrip().startswith("Human:")


def parse_hh(text: str) -> list[dict]:
    """Split an HH dialogue into messages; a trailing empty `Assistant:` (the generation cue) is kept as ''."""
    body = "\n\n" + text.lstrip()  # so a leading "Human:" without blank lines is a marker too
    strict = "\n\nAssistant:" in body or body.count("\n\nHuman:") > 1
    parts = (_HH_MARKER if strict else _HH_MARKER_LOOSE).split(body)
    turns = zip(parts[1::2], parts[2::2], strict=True)  # split() alternates marker names and turn texts
    return [{"role": _HH_ROLE[name], "content": content.strip()} for name, content in turns]


def _parse_prompt_text(text: str) -> list[dict]:
    if not is_hh(text):
        return [{"role": "user", "content": text.strip()}]
    messages = parse_hh(text)
    if messages and messages[-1] == {"role": "assistant", "content": ""}:
        messages.pop()  # "...\n\nAssistant:" ends a prompt: the cue for the response, not a turn
    return messages


def _split_dialogue(fields: _Fields, name: str, allow_empty: bool = False) -> tuple[list[dict], str]:
    """A full HH dialogue -> (prompt = turns before the LAST `Assistant:`, response = all text after it).

    The response is everything after the marker, as in the HH paper's setup: a sampled reply that went on to
    invent a `Human:` turn keeps it (and was rightly rejected). The prompt keeps the turns as they are, so it may
    end with an assistant turn ("...\n\nAssistant: a\n\nAssistant: b": prompt up to a, response b)."""
    text = fields.text(name, part="prompt")
    if not is_hh(text):
        raise fields.error(name, "expected an HH dialogue starting with 'Human:'")
    marker = "\n\nAssistant:" if "\n\nAssistant:" in text else "Assistant:"
    cut = text.rfind(marker)
    if cut < 0:
        raise fields.error(name, "the dialogue has no 'Assistant:' turn")
    response = fields.text(name, text[cut + len(marker) :], allow_empty=allow_empty)
    return _checked_prompt(fields, name, _parse_prompt_text(text[:cut])), response


def _split_chat(fields: _Fields, name: str, allow_empty: bool = False) -> tuple[list[dict], str]:
    """A message list ending with the assistant's reply -> (the messages before it, the reply)."""
    messages = fields.messages(name)
    if messages[-1]["role"] != "assistant":
        raise fields.error(
            name, f"the last message must be the assistant's response (got role {messages[-1]['role']!r})"
        )
    return messages[:-1], fields.text(name, messages[-1]["content"], allow_empty=allow_empty)


def _shared(prompt_a: list[dict], prompt_b: list[dict]) -> list[dict]:
    if prompt_a != prompt_b:
        raise _Skip("no_shared_prompt")
    return prompt_a


# ---------------------------------------------------------------- formats
# Each parser takes a row's _Fields. Preference parsers return (prompt, chosen, rejected) and let the
# rejected side be empty: real HH data has empty replies that labellers rejected, a useful signal for the RM.


def _sft_from_pair(pair):
    """A preference format's SFT view: its chosen side (both sides are parsed so layouts are validated alike)."""
    return lambda f: pair(f)[:2]


def _prompt_field(f):
    return f.prompt("prompt")


def _prompt_response(f):
    return f.prompt("prompt"), f.text("response")


def _messages_sft(f):
    prompt, response = _split_chat(f, "messages")
    return _checked_prompt(f, "messages", prompt), response


def _messages_prompt(f):
    messages = f.messages("messages")
    prompt = messages[:-1] if messages[-1]["role"] == "assistant" else messages
    return _checked_prompt(f, "messages", prompt)


# ShareGPT's speaker names (FastChat, LLaMA-Factory's "sharegpt" layout) -> chat roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "system": "system"}


def _sharegpt_turn(f, name: str, index: int | None, turn) -> dict:
    where_in = f"turn {index}: " if index is not None else ""
    if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
        raise f.error(name, f"{where_in}expected an object with 'from' and 'value'")
    role = SHAREGPT_ROLES.get(turn["from"])
    if role is None:
        raise f.error(name, f"{where_in}'from' {turn['from']!r} is not one of {', '.join(SHAREGPT_ROLES)}")
    return {"role": role, "content": turn["value"]}


def _sharegpt_messages(f) -> list[dict]:
    """`conversations: [{from, value}, ...]` (and an optional top-level `system`) as {role, content} messages."""
    turns = f.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise f.error("conversations", "expected a non-empty list of {from, value} turns")
    system = f.data.get("system")
    messages = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    messages += [_sharegpt_turn(f, "conversations", i, turn) for i, turn in enumerate(turns, start=1)]
    return f.messages("conversations", messages)


def _sharegpt_prompt(f):
    messages = _sharegpt_messages(f)
    return _checked_prompt(f, "conversations", messages[:-1] if messages[-1]["role"] == "assistant" else messages)


def _sharegpt_sft(f):
    messages = _sharegpt_messages(f)
    if messages[-1]["role"] != "assistant":
        raise f.error("conversations", f"the last turn must be the assistant's response (got from "
                                       f"{f.data['conversations'][-1].get('from')!r})")
    return _checked_prompt(f, "conversations", messages[:-1]), f.text("conversations", messages[-1]["content"])


def _sharegpt_pairs(f):
    """LLaMA-Factory's ShareGPT preference rows: `conversations` is the prompt, `chosen` / `rejected` are turns."""
    prompt = _checked_prompt(f, "conversations", _sharegpt_messages(f))
    replies = []
    for side in ("chosen", "rejected"):
        reply = _sharegpt_turn(f, side, None, f.get(side))["content"]
        if not isinstance(reply, str):
            raise f.error(side, f"'value' is {type(reply).__name__}, not a string")
        replies.append(f.text(side, reply, allow_empty=side == "rejected"))
    return prompt, replies[0], replies[1]


def _alpaca_prompt(f):
    instruction = f.text("instruction", part="prompt")
    extra = f.text("input", f.data.get("input") or "", allow_empty=True)
    system = f.text("system", f.data.get("system") or "", allow_empty=True)
    messages = [{"role": "system", "content": system}] if system else []
    # LLaMA-Factory's alpaca files may carry earlier turns as [[query, answer], ...].
    for turn in f.data.get("history") or []:
        if not (isinstance(turn, list) and len(turn) == 2 and all(isinstance(text, str) for text in turn)):
            raise f.error("history", f"expected [query, answer] string pairs, got {turn!r:.60}")
        messages += [{"role": "user", "content": turn[0].strip()}, {"role": "assistant", "content": turn[1].strip()}]
    content = f"{instruction}\n\n{extra}" if extra else instruction
    return messages + [{"role": "user", "content": content}]


def _alpaca_sft(f):
    return _alpaca_prompt(f), f.text("output")


def _strip_assistant_cue(text: str) -> str:
    # yitingxie/rlhf-reward-datasets stores the reply as "Assistant: ..." after a prompt without the cue.
    return text[len("Assistant:") :].strip() if text.startswith("Assistant:") else text


def _prompt_chosen_rejected(f):
    prompt = f.prompt("prompt")
    chosen = _strip_assistant_cue(f.text("chosen"))
    rejected = _strip_assistant_cue(f.text("rejected", allow_empty=True))
    return prompt, f.text("chosen", chosen), rejected


def _chat_pairs(f):
    """{chosen: [msgs], rejected: [msgs]} sharing a prefix, or with the prompt in `prompt` (TRL, UltraFeedback)."""
    prefix_c, chosen = _split_chat(f, "chosen")
    prefix_r, rejected = _split_chat(f, "rejected", allow_empty=True)
    prompt = _shared(prefix_c, prefix_r)
    return (_checked_prompt(f, "chosen", prompt) if prompt else f.prompt("prompt")), chosen, rejected


def _chat_pairs_sft(f):
    prefix, chosen = _split_chat(f, "chosen")  # SFT needs only the chosen side, so no shared-prefix check
    return (_checked_prompt(f, "chosen", prefix) if prefix else f.prompt("prompt")), chosen


def _chat_pairs_prompt(f):
    return f.prompt("prompt") if "prompt" in f.data else _checked_prompt(f, "chosen", _split_chat(f, "chosen")[0])


def _hh_dialogue(f):
    prompt_c, chosen = _split_dialogue(f, "chosen")
    prompt_r, rejected = _split_dialogue(f, "rejected", allow_empty=True)
    return _shared(prompt_c, prompt_r), chosen, rejected


def _shp(f):
    """stanfordnlp/SHP: prompt = the post's `history`; labels == 1 means comment A was preferred."""
    label = f.number("labels")
    if label not in (0, 1):
        raise f.error("labels", f"expected 0 or 1, got {label:g}")
    a, b = f.text("human_ref_A", allow_empty=not label), f.text("human_ref_B", allow_empty=bool(label))
    return f.prompt("history"), *((a, b) if label == 1 else (b, a))


def _webgpt_question(f):
    question = f.get("question")
    if isinstance(question, dict):  # {"dataset": ..., "id": ..., "full_text": ...}
        if "full_text" not in question:
            raise f.error("question", f"expected a 'full_text' key (question has keys: {', '.join(question)})")
        question = question["full_text"]
    return f.prompt("question", question)


def _webgpt(f):
    """openai/webgpt_comparisons: the answer with the higher score is chosen; equal scores carry no preference."""
    scores = (f.number("score_0"), f.number("score_1"))
    if scores[0] == scores[1]:
        raise _Skip("dropped_ties")
    first = 0 if scores[0] > scores[1] else 1
    chosen = f.text(f"answer_{first}")
    return _webgpt_question(f), chosen, f.text(f"answer_{1 - first}", allow_empty=True)


@dataclass(frozen=True)
class _Format:
    matches: Callable[[dict], bool]  # recognises the format from the first row
    prompt: Callable
    sft: Callable | None = None
    preference: Callable | None = None


def _has(*keys):
    return lambda row: all(key in row for key in keys)


def _is_list(*keys):
    return lambda row: all(isinstance(row.get(key), list) for key in keys)


_FORMATS: dict[str, _Format] = {
    "webgpt": _Format(
        _has("question", "answer_0", "answer_1", "score_0", "score_1"),
        _webgpt_question,
        _sft_from_pair(_webgpt),
        _webgpt,
    ),
    "shp": _Format(
        _has("history", "human_ref_A", "human_ref_B", "labels"),
        lambda f: f.prompt("history"),
        _sft_from_pair(_shp),
        _shp,
    ),
    "chat_pairs": _Format(_is_list("chosen", "rejected"), _chat_pairs_prompt, _chat_pairs_sft, _chat_pairs),
    "prompt_chosen_rejected": _Format(
        lambda row: _has("prompt", "rejected")(row) and isinstance(row.get("chosen"), str),
        _prompt_field,
        _sft_from_pair(_prompt_chosen_rejected),
        _prompt_chosen_rejected,
    ),
    "hh_dialogue": _Format(
        lambda row: isinstance(row.get("chosen"), str) and is_hh(row["chosen"]),
        lambda f: _split_dialogue(f, "chosen", allow_empty=True)[0],  # prompts: the reply is not needed
        lambda f: _split_dialogue(f, "chosen"),
        _hh_dialogue,
    ),
    "sharegpt_pairs": _Format(
        lambda row: isinstance(row.get("conversations"), list) and isinstance(row.get("chosen"), dict)
        and isinstance(row.get("rejected"), dict),
        _sharegpt_prompt,
        _sft_from_pair(_sharegpt_pairs),
        _sharegpt_pairs,
    ),
    "messages": _Format(_is_list("messages"), _messages_prompt, _messages_sft),
    "sharegpt": _Format(_is_list("conversations"), _sharegpt_prompt, _sharegpt_sft),
    "alpaca": _Format(_has("instruction", "output"), _alpaca_prompt, _alpaca_sft),
    "prompt_response": _Format(_has("prompt", "response"), _prompt_field, _prompt_response),
    "prompt_only": _Format(_has("prompt"), _prompt_field),
}

TASKS = ("sft", "preference", "prompt")
# task -> {format name -> parser}, in detection order.
FORMATS: dict[str, dict[str, Callable]] = {
    task: {name: getattr(spec, task) for name, spec in _FORMATS.items() if getattr(spec, task) is not None}
    for task in TASKS
}
# Every field name the formats read: the targets `fields` may map a column to.
CANONICAL_FIELDS = tuple(
    "prompt response chosen rejected messages conversations instruction input output system history question "
    "answer_0 answer_1 "
    "score_0 score_1 human_ref_A human_ref_B labels".split()
)
_FIELDS_EXAMPLE = {
    "sft": "{prompt: question, response: answer}",
    "prompt": "{prompt: question}",
    "preference": "{prompt: question, chosen: better, rejected: worse}",
}
# Columns people often use for a response; the detection error suggests mapping them.
_RESPONSE_ALIASES = ("completion", "output", "answer", "target")


def detect_format(row: dict, task: str) -> str:
    """The first format of FORMATS[task] whose layout matches `row`; DataError with a `fields` hint if none."""
    if task not in FORMATS:
        raise DataError(f"unknown task {task!r} (known: {', '.join(TASKS)})")
    for name in FORMATS[task]:
        if _FORMATS[name].matches(row):
            return name
    alias = next((key for key in _RESPONSE_ALIASES if key in row), None)
    example = f"{{response: {alias}}}" if task == "sft" and "prompt" in row and alias else _FIELDS_EXAMPLE[task]
    # quoted whole, so that it pastes into a shell as one word
    hint = f"map columns with data.fields, e.g. 'data.fields={example}'"
    if "text" in row and task != "prompt":
        hint = "plain {text} rows are pretraining text, not prompt/response data; " + hint
    keys = ", ".join(map(str, row)) or "none"
    raise DataError(
        f"cannot detect a {task} format from keys ({keys}); known formats: {', '.join(FORMATS[task])}; {hint}"
    )


def renamed_columns(data: dict, fields: dict[str, str] | None) -> dict:
    """`data` with the user's columns under their canonical names (`{"prompt": "question"}`: column question
    becomes prompt), all read from the original row, so mappings may swap or share columns
    (`{chosen: rejected, rejected: chosen}`); a mapped column missing from the row is left out."""
    fields = fields or {}
    mapped = set(fields.values())
    out = {key: value for key, value in data.items() if key not in mapped}
    out.update({canonical: data[column] for canonical, column in fields.items() if column in data})
    return out


def _apply_fields(row: Row, fields: dict[str, str] | None) -> _Fields:
    """Rename the user's columns to canonical names (`renamed_columns`); a mapped column the row lacks is an error."""
    for canonical, column in (fields or {}).items():
        if column not in row.data:
            problem = f"missing (mapped to '{canonical}' by fields; row has keys: {', '.join(map(str, row.data))})"
            raise DataError(f"{where(row.source, row.line)}: field '{column}': {problem}")
    return _Fields(row, renamed_columns(row.data, fields))


def _parse_rows(rows: list[Row], fields, format: str, task: str, stats: dict, strict: bool = False):
    """Yield (row, parsed) for every row, skipping rows that raise _Skip (counted in `stats`); with `strict`, an
    unusable row (ROW_SKIPS) raises its DataError instead."""
    if not rows:
        raise DataError("no rows to convert")
    unknown = sorted(set(fields or {}) - set(CANONICAL_FIELDS))
    if unknown:
        raise DataError(
            f"config key 'data.fields': unknown canonical field(s) {', '.join(unknown)} (known: "
            f"{', '.join(CANONICAL_FIELDS)}; each maps a canonical field to your column, e.g. {{response: answer}})"
        )
    first = _apply_fields(rows[0], fields)
    if format == "auto":
        try:
            format = detect_format(first.data, task)
        except DataError as exc:
            raise DataError(f"{where(rows[0].source, rows[0].line)}: {exc}") from None
    elif format not in FORMATS[task]:
        raise DataError(f"unknown {task} format {format!r} (known: auto, {', '.join(FORMATS[task])})")
    parse = FORMATS[task][format]
    for row in rows:
        try:
            yield row, parse(_apply_fields(row, fields))
        except _Skip as skip:
            if strict and skip.error is not None:
                raise skip.error from None
            stats[skip.reason] = stats.get(skip.reason, 0) + 1


def to_sft_examples(
    rows: list[Row],
    fields: dict[str, str] | None = None,
    format: str = "auto",
    stats: dict | None = None,
    strict: bool = False,
) -> list[SFTExample]:
    """Rows -> (prompt messages, response) demonstrations; preference rows give their chosen side (rows without
    one, webgpt ties, are skipped and counted in `stats["dropped_ties"]`; unusable rows under their ROW_SKIPS
    key, or a DataError when `strict`)."""
    stats = {} if stats is None else stats
    stats.setdefault("dropped_ties", 0)
    return [
        SFTExample(prompt, response, row.source, row.line)
        for row, (prompt, response) in _parse_rows(rows, fields, format, "sft", stats, strict)
    ]


def to_preference_examples(
    rows: list[Row],
    fields: dict[str, str] | None = None,
    format: str = "auto",
    stats: dict | None = None,
    strict: bool = False,
) -> list[PreferenceExample]:
    """Rows -> (prompt, chosen, rejected) pairs. Rows without a usable preference are skipped and counted in
    `stats`: dropped_ties (equal scores), no_shared_prompt (the two sides' prompts differ), identical (chosen ==
    rejected), and the ROW_SKIPS keys when they occur (a DataError instead when `strict`); empty_rejected counts
    kept pairs whose rejected reply is empty. Counts add up over calls that share one `stats` dict (several
    sources)."""
    stats = {} if stats is None else stats
    for key in ("dropped_ties", "no_shared_prompt", "identical", "empty_rejected"):
        stats.setdefault(key, 0)
    examples = []
    for row, (prompt, chosen, rejected) in _parse_rows(rows, fields, format, "preference", stats, strict):
        if chosen == rejected:
            stats["identical"] += 1
            continue
        stats["empty_rejected"] += not rejected
        examples.append(PreferenceExample(prompt, chosen, rejected, row.source, row.line))
    return examples


def to_prompt_examples(
    rows: list[Row],
    fields: dict[str, str] | None = None,
    format: str = "auto",
    stats: dict | None = None,
    strict: bool = False,
) -> list[PromptExample]:
    """Rows -> prompts for PPO rollouts: the prompt part of any SFT or preference format, or `{prompt}` alone
    (unusable rows are counted in `stats` under their ROW_SKIPS key, or a DataError when `strict`)."""
    stats = {} if stats is None else stats
    return [
        PromptExample(prompt, row.source, row.line, _json_fields(row.data))
        for row, prompt in _parse_rows(rows, fields, format, "prompt", stats, strict)
    ]
