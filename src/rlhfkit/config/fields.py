"""Typed config machinery: dataclasses with one-line docs, YAML values, dotted overrides, validation.

Every config field is declared with `option(default, doc)`. From that single declaration we get the
YAML loader (unknown keys and wrong types are errors naming the dotted key), the `--help` listing and the
resolved `config.yaml`. Values are never silently rewritten: a wrong value is an error, not a fix-up.
"""

from __future__ import annotations

import dataclasses
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


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
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
        return from_dict(tp, value, prefix=key + ".")
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}': expected a list, got {value!r}")
        args = typing.get_args(tp)
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
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


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict; unknown keys and wrong types raise ConfigError."""
    if data is None:
        data = {}
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"unknown config key '{prefix}{key}' (known keys here: {known})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = _coerce(data[f.name], hints[f.name], prefix + f.name)
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ConfigError(f"config key '{prefix}{f.name}': expected one of {tuple(choices)}, got {value!r}")
            kwargs[f.name] = value
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check(prefix)
    return obj


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def parse_overrides(items: list[str]) -> dict:
    """`["train.lr=1e-5", "lora.rank=8"]` -> nested dict; values are parsed as YAML scalars."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw.strip() else ""
        # YAML reads 1e-5 as a string (it wants 1.0e-5); accept the form people type.
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") and value.strip() else value
            except ValueError:
                pass
        node = out
        parts = key.strip().split(".")
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
