"""Typed config machinery: dataclasses with one-line docs, YAML values, dotted overrides, validation.

Every config field is declared with `option(default, doc)`. From that single declaration we get the
YAML loader (unknown keys and wrong types are errors naming the dotted key), the `--help` listing and the
resolved `config.yaml`. Values are never silently rewritten: a wrong value is an error, not a fix-up.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Union

import yaml

from rlhfkit.errors import ConfigError


def option(default: Any, doc: str | Callable[[], str], *, choices: Iterable | None = None):
    """Declare a config field with its default and the one-line doc `--help` shows.

    A doc or choices derived from a registry (`rlhfkit.registry`) stay live: `doc` may be a function returning the
    text, `choices` a view of the registry's names (`ESTIMATORS.keys()`), both read when help is shown or a value
    checked, so an entry registered later is offered too."""
    meta = {"doc": doc}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    if dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=type(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return origin.__name__
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, root: tuple | None = None) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected. `root` is the
    outermost (config class, prefix), for naming a key of another section in an unknown-key error."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, root)
            except ConfigError:
                continue
        raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"config key '{key}': expected one of {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"config key '{key}': expected null, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=key + ".", root=root)
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}': expected a list, got {value!r}")
        args = typing.get_args(tp)
        return [_coerce(v, args[0], f"{key}[{i}]", root) for i, v in enumerate(value)] if args else value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            name, colon, rest = str(value).partition(":")
            hint = f"; write it in braces and {QUOTE}: '{key}={{{name.strip()}: {rest.strip()}}}'" if colon else ""
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}{hint}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Path):
            return str(value)
    raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}")


def home_expanded(value):
    """`value` with every string that starts with `~/` made a full path (`~/models/x` -> `/home/me/models/x`), in
    lists and mappings too: paths in a config file mean what they mean in a shell, for every library that opens
    them."""
    if isinstance(value, str) and value.startswith("~/"):
        return os.path.expanduser(value)
    if isinstance(value, list):
        return [home_expanded(v) for v in value]
    if isinstance(value, dict):
        return {k: home_expanded(v) for k, v in value.items()}
    return value


def from_dict(cls, data: dict, prefix: str = "", root: tuple | None = None):
    """Build dataclass `cls` from a nested dict; unknown keys and wrong types raise ConfigError."""
    if data is None:
        data = {}
    root = root or (cls, prefix)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(_unknown_key(str(key), prefix, names, root))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = _coerce(home_expanded(data[f.name]), hints[f.name], prefix + f.name, root)
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ConfigError(f"config key '{prefix}{f.name}': expected one of {tuple(choices)}, got {value!r}")
            kwargs[f.name] = value
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check(prefix)
    return obj


def _unknown_key(key: str, prefix: str, names: set[str], root: tuple) -> str:
    """One line for a key that no field of its section has, naming the likeliest meant key: the same name in another
    section (`train.rank`: `lora.rank`), else a near spelling here (`train.max_step`), else a near name elsewhere;
    the section's keys only when nothing is near."""
    root_cls, root_prefix = root
    leaves = {}  # last part -> dotted keys, over the whole config
    for dotted, *_ in help_rows(root_cls):
        leaves.setdefault(dotted.rsplit(".", 1)[-1], []).append(root_prefix + dotted)
    meant = leaves.get(key) or [prefix + name for name in difflib.get_close_matches(key, sorted(names), n=1)]
    if not meant:
        near = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.8)
        meant = leaves[near[0]] if near else []
    if meant:
        return f"unknown config key '{prefix}{key}': did you mean {' or '.join(repr(m) for m in meant[:2])}?"
    return f"unknown config key '{prefix}{key}' (known keys here: {', '.join(sorted(names))})"


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


QUOTE = "quote the whole override so the shell keeps it one word"
_CLOSING = {"{": "}", "[": "]"}
_NEW_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


def _open_brackets(value: str) -> str:
    """The brackets a `{...}` or `[...]` value leaves open, innermost last ('' when closed, when a bracket closes
    the wrong one (YAML's error says where), or when the value is not such a value)."""
    if not value.lstrip().startswith(("{", "[")):
        return ""
    stack = []
    for char in value:
        if char in _CLOSING:
            stack.append(char)
        elif char in "}]":
            if not stack or _CLOSING[stack.pop()] != char:
                return ""
    return "".join(stack)


def rejoin_words(words: list[str]) -> list[str]:
    """Put back the overrides the shell split at their spaces: typed unquoted, `data.fields={prompt: question,
    response: answer}` arrives as four words. A word whose value opens a bracket takes the words after it until
    its brackets close, stopping at a flag or the next key=value (the error then says how to quote)."""
    out: list[str] = []
    for word in words:
        if out and _open_brackets(out[-1].partition("=")[2]) and not word.startswith("--") \
                and not _NEW_OVERRIDE.match(word):
            out[-1] += " " + word
        else:
            out.append(word)
    return out


def _check_brace_expansion(items: list[str]) -> None:
    """bash expands `data.fields={prompt:question,response:answer}` (braces and a comma in one word) into
    `data.fields=prompt:question data.fields=response:answer`: the same key twice in a row, each value a name:value."""
    for key, group in itertools.groupby(items, key=lambda item: item.partition("=")[0]):
        group = list(group)
        values = [item.partition("=")[2] for item in group]
        if len(group) > 1 and all(":" in v and " " not in v and not v.startswith(("{", "[")) for v in values):
            pairs = ", ".join(f"{name}: {value}" for name, value in (v.split(":", 1) for v in values))
            raise ConfigError(f"override '{key}' arrived as {len(group)} words ({' '.join(group)}): the shell expanded "
                              f"its braces; {QUOTE}: '{key}={{{pairs}}}'")


def _quote_hint(key: str, raw: str) -> str:
    start = raw.lstrip()[:1]
    if start == "{":
        example = "{prompt: question, response: answer}" if key.endswith("fields") else "{name: value, other: value}"
    elif start == "[":
        example = "[first, second]"
    else:
        return f"{QUOTE}, and a text value in double quotes inside it: '{key}=\"{raw.strip()}\"'"
    return f"{QUOTE}, e.g. '{key}={example}'"


def _unspaced_colons(node):
    """YAML reads `{prompt:question}` as {'prompt:question': None}; people mean {prompt: question}."""
    if isinstance(node, list):
        return [_unspaced_colons(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if value is None and isinstance(key, str) and ":" in key:
            key, text = key.split(":", 1)
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                value = text
        out[key] = _unspaced_colons(value)
    return out


def _parse_override(item: str) -> tuple[str, Any]:
    """`key=value` -> (key, value read as YAML); a mistake is a ConfigError saying what to type."""
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq:
        hint = f"; a config file is passed as --config {item}" if item.endswith((".yaml", ".yml")) else \
            " (one word, no spaces around '=')"
        raise ConfigError(f"override '{item}' is not of the form dotted.key=value{hint}")
    if not key:
        raise ConfigError(f"override '{item}' has no key before '='")
    if "" in key.split("."):
        raise ConfigError(f"override '{item}': the key '{key}' has an empty part")
    still_open = _open_brackets(raw)
    if still_open:
        closed = raw.strip() + "".join(_CLOSING[c] for c in reversed(still_open))
        raise ConfigError(f"override '{item}' leaves a '{still_open[-1]}' open; {QUOTE}: '{key}={closed}'")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = f"{exc.problem}, column {mark.column + 1}" if mark else str(exc).splitlines()[0]
        raise ConfigError(f"override '{item}': not valid YAML ({problem}); {_quote_hint(key, raw)}") from None
    # YAML 1.1 reads 1e-5 as a string (it wants 1.0e-5); accept the form people type.
    return key, _fix_yaml_floats(_unspaced_colons(value))


def parse_overrides(items: list[str]) -> dict:
    """`["train.lr=1e-5", "lora.rank=8"]` -> nested dict; values are read as YAML (`1e-5`, `{prompt: question}`,
    `[a.jsonl, b.jsonl]`), a value the shell split at its spaces put back together first (`rejoin_words`)."""
    items = rejoin_words(items)
    _check_brace_expansion(items)
    out: dict = {}
    for item in items:
        key, value = _parse_override(item)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        node[parts[-1]] = value
    return out


def _fix_yaml_floats(node):
    """PyYAML follows YAML 1.1, where `1e-5` is a string; users mean a float."""
    if isinstance(node, dict):
        return {k: _fix_yaml_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_yaml_floats(v) for v in node]
    if isinstance(node, str):
        try:
            if any(c in node for c in "eE") and node[:1] in "0123456789.-+":
                return float(node)
        except ValueError:
            return node
    return node


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}".replace("\n", " ")) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return _fix_yaml_floats(data)


def load_config(cls, path: str | None, overrides: list[str] | None = None, base: dict | None = None):
    data = dict(base or {})
    if path:
        data = deep_merge(data, read_yaml(path))
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
    return from_dict(cls, data)


def help_rows(cls, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every leaf field, for `--help`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        doc = f.metadata.get("doc", "")
        doc = doc() if callable(doc) else doc
        if dataclasses.is_dataclass(tp):
            rows.extend(help_rows(tp, prefix + f.name + "."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        choices = f.metadata.get("choices")
        rows.append((prefix + f.name, "|".join(map(str, choices)) if choices else _type_name(tp), repr(default), doc))
    return rows


def help_text(cls) -> str:
    lines = []
    for key, tp, default, doc in help_rows(cls):
        lines.append(f"  {key}  ({tp}, default {default})\n      {doc}")
    return "\n".join(lines)


def dump_yaml(cfg, path: Path) -> None:
    """Write the config as YAML, atomically (other ranks of a resumed run read the file while it is replaced)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
    tmp.replace(path)
