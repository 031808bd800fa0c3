"""Read any supported data source into a list of rows, each remembering where it came from.

Sources: a local file (`.jsonl`, `.json`, `.parquet`, `.csv`, `.txt`, each optionally `.gz`), a folder written by
`datasets.save_to_disk`, a folder of data files named after their split (`train.jsonl`, `data/train-0000.parquet`)
or inside a folder named after it (a lone unsplit file is the train split), or a Hugging Face hub id (`owner/name`)
when online (presets.py looks for a local copy of a hub id first). Every row keeps its file and the 1-based file line it
starts on (JSON lines, a JSON array, CSV; a record number where a source has no lines: parquet, datasets, a wrapped
JSON array) so that the format converters (formats.py) can name `path:line` and the field in their errors. Text files are parsed with the stdlib so
a bad line is reported with its real line number; `datasets` is imported only when a source needs it (it is slow to
import and not needed for plain files).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlhfkit.errors import DataError, OfflineError, where


@dataclass(frozen=True)
class Row:
    """One record of a data source: its fields, the source it came from, and the 1-based file line it starts on
    (a record number where the source has no lines)."""

    data: dict
    source: str
    line: int | None


# The text-document separator used by TinyStories/GPT-2 style pretraining dumps.
END_OF_TEXT = "<|endoftext|>"
OFFLINE_HINT = "download it elsewhere and pass a local copy: a .jsonl/.json/.parquet/.csv file or a save_to_disk folder"
# owner/name, as on the hub; a path with a data-file extension is never a hub id (a missing local file is meant).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A one-key object such as {"data": [...]} wraps a list of rows, unless the key is a row field of its own
# (a one-row JSON-lines file {"messages": [...]} must stay one row).
_ROW_LIST_FIELDS = {"messages", "chosen", "rejected", "prompt", "conversations"}


def read_rows(source: str, split: str = "train") -> list[Row]:
    """Read `source` (file, folder or hub id) into rows; raises DataError for anything unreadable or empty."""
    source = str(source)
    path = Path(source)
    if path.is_file():
        rows = _read_file(path, source)
    elif path.is_dir():
        rows = _read_folder(path, source, split)
    elif looks_like_hub_id(source):
        rows = _read_hub(source, split)
    else:
        raise DataError(f"{source}: no such file or folder")
    if not rows:
        raise DataError(f"{source}: no rows")
    return rows


# ---------------------------------------------------------------- files


def _read_file(path: Path, source: str) -> list[Row]:
    name = path.name.lower()
    compressed = name.endswith(".gz")
    kind = Path(name[:-3] if compressed else name).suffix
    reader = _FILE_READERS.get(kind)
    if reader is None:
        known = ", ".join(sorted(_FILE_READERS))
        raise DataError(f"{source}: unsupported file type '{kind or name}' (supported: {known}, each optionally .gz)")
    try:
        raw = gzip.decompress(path.read_bytes()) if compressed else path.read_bytes()
    except (OSError, EOFError) as exc:  # a truncated or non-gzip .gz file
        raise DataError(f"{source}: cannot read: {exc}") from None
    return reader(raw, source)


def _decode(raw: bytes, source: str) -> str:
    """UTF-8 text (a BOM is dropped); bad bytes name the line they are on, so a user can find them."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        bad = raw[exc.start : exc.start + 1]
        raise DataError(f"{where(source, line)}: not UTF-8 text (byte {bad!r}); re-save the file as UTF-8") from None


def _as_object(value, source: str, line: int) -> Row:
    if not isinstance(value, dict):
        raise DataError(f"{where(source, line)}: expected a JSON object, got {type(value).__name__}")
    return Row(value, source, line)


def _read_jsonl(raw: bytes, source: str) -> list[Row]:
    return _parse_json_lines(_decode(raw, source), source)


def _parse_json_lines(text: str, source: str) -> list[Row]:
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where(source, number)}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        rows.append(_as_object(value, source, number))
    return rows


def _read_json(raw: bytes, source: str) -> list[Row]:
    """A list of objects, an object wrapping one list ({"data": [...]}), or JSON-lines content in a .json file."""
    text = _decode(raw, source)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # several top-level values: JSON lines
            return _parse_json_lines(text, source)
        raise DataError(f"{where(source, exc.lineno)}: invalid JSON: {exc.msg} (column {exc.colno})") from None
    if isinstance(value, dict) and _pandas_table(value) is not None:
        return [Row(row, source, i) for i, row in enumerate(_pandas_table(value), 1)]  # record numbers
    if isinstance(value, dict):
        # a wrapper holds its records as one list of objects; a record's own list fields hold other things
        # (Alpaca's history of [query, answer] pairs, tags) or are named as row fields
        lists = [key for key, item in value.items() if isinstance(item, list)]
        if (len(lists) == 1 and lists[0] not in _ROW_LIST_FIELDS
                and all(isinstance(item, dict) for item in value[lists[0]])):
            value = value[lists[0]]
        else:
            return [Row(value, source, 1)]  # a single record
    if not isinstance(value, list):
        raise DataError(f"{source}: expected a list of JSON objects, got {type(value).__name__}")
    # the line each record starts on, for a top-level array; a wrapped one ({"data": [...]}) gets record numbers
    lines = _array_record_lines(text, len(value)) or range(1, len(value) + 1)
    return [_as_object(item, source, line) for line, item in zip(lines, value)]


def _pandas_table(value: dict) -> list[dict] | None:
    """The rows of a pandas `DataFrame.to_json()` file (its default orient="columns": {column: {index: value}},
    or orient="index": {index: {column: value}}), in index order; None for anything else. Every key at the
    index level is a row number, which a record's own field names are not."""
    if not value or not all(isinstance(item, dict) and item for item in value.values()):
        return None
    inner = [list(item) for item in value.values()]
    if all(keys == inner[0] for keys in inner) and all(key.isdigit() for key in inner[0]):  # columns
        return [{column: value[column][index] for column in value} for index in inner[0]]
    if all(key.isdigit() for key in value) and all(set(keys) == set(inner[0]) for keys in inner):  # index
        return [dict(item) for item in value.values()]
    return None


def _array_record_lines(text: str, n: int) -> list[int] | None:
    """The 1-based line on which each of the n records of a top-level JSON array starts (None: not one)."""
    decoder, i, line, last = json.JSONDecoder(), 0, 1, 0
    skip = re.compile(r"[\s,]*")
    i = skip.match(text, i).end()
    if not text.startswith("[", i):
        return None
    i += 1
    lines = []
    while len(lines) < n:
        i = skip.match(text, i).end()
        line += text.count("\n", last, i)
        last = i
        lines.append(line)
        _, i = decoder.raw_decode(text, i)
    return lines


def _read_csv(raw: bytes, source: str) -> list[Row]:
    text = _decode(raw, source)
    # the csv module refuses cells over 131,072 characters by default (a long document or response is valid data);
    # no cell is longer than its file
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = []
    try:
        for record in reader:
            # the file line the record starts on: reader.line_num is the line it ends on, and a quoted cell may
            # span lines
            line = reader.line_num - _newlines(record)
            if None in record:  # more cells than header columns
                raise DataError(f"{where(source, line)}: {len(record[None])} more cells than header columns")
            rows.append(Row(dict(record), source, line))
    except csv.Error as exc:
        raise DataError(f"{where(source, reader.line_num)}: invalid CSV: {exc}") from None
    return rows


def _newlines(record: dict) -> int:
    """Line breaks inside a CSV record's quoted cells (each adds a file line to it)."""
    return sum(v.count("\n") for v in record.values() if isinstance(v, str))


def _read_parquet(raw: bytes, source: str) -> list[Row]:
    import pyarrow.parquet as pq  # comes with `datasets`

    try:
        table = pq.read_table(io.BytesIO(raw))
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DataError(f"{source}: cannot read parquet: {exc}") from None
    return [Row(record, source, index) for index, record in enumerate(table.to_pylist(), start=1)]


def _read_text(raw: bytes, source: str) -> list[Row]:
    """Pretraining text: documents split by `<|endoftext|>` lines when the marker occurs, else by blank lines."""
    lines = _decode(raw, source).split("\n")
    marker = any(line.strip() == END_OF_TEXT for line in lines)
    rows, current, start = [], [], 1

    def flush():
        text = "\n".join(current).strip()
        if text:
            rows.append(Row({"text": text}, source, start))

    for number, line in enumerate(lines, start=1):
        is_break = line.strip() == END_OF_TEXT if marker else not line.strip()
        if is_break:
            flush()
            current, start = [], number + 1
        else:
            if not current and not line.strip():
                start = number + 1  # a document starts at its first non-blank line
                continue
            current.append(line)
    flush()
    return rows


_FILE_READERS: dict[str, Callable[[bytes, str], list[Row]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
    ".txt": _read_text,
}
# The data file extensions read_rows understands (each also gzipped: `.jsonl.gz`).
FILE_TYPES = tuple(sorted(_FILE_READERS))


# ---------------------------------------------------------------- folders


def _read_folder(path: Path, source: str, split: str) -> list[Row]:
    if (path / "dataset_dict.json").is_file():  # a DatasetDict from save_to_disk: one sub-folder per split
        splits = _dict_splits(path)
        if split not in splits:
            raise DataError(f"{source}: no split '{split}' (available: {', '.join(splits)})")
        return _from_dataset(_load_from_disk(path / split), os.path.join(source, split))
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():  # a Dataset from save_to_disk
        return _from_dataset(_load_from_disk(path), source)
    return _read_split_files(path, source, split)


def _dict_splits(path: Path) -> list[str]:
    """The split names a save_to_disk DatasetDict's dataset_dict.json lists."""
    file = path / "dataset_dict.json"
    try:
        splits = json.loads(file.read_text(encoding="utf-8")).get("splits")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise DataError(f"{file}: not a readable dataset_dict.json ({type(exc).__name__}: {exc})") from None
    if not (isinstance(splits, list) and all(isinstance(name, str) for name in splits)):
        raise DataError(f"{file}: field 'splits': expected a list of split names, got {splits!r:.60}")
    return splits


def _load_from_disk(path: Path):
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - a damaged folder raises whatever its missing or cut file causes
        raise DataError(f"{path}: not a readable save_to_disk dataset ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def _split_files(path: Path, split: str) -> tuple[list[Path], list[Path]]:
    """(the data files of `split` under `path`, every data file there).

    A file belongs to the split when its name starts with it (`train.jsonl`, `data/train-00000-of-00002.parquet`
    as in a hub snapshot, `askacademia/train.json` as in stanfordnlp/SHP) or when a folder on its path is named
    after it (`default/train/0000.parquet`, the hub's parquet conversion). A folder holding a single data file
    whose name names no split (`comparisons.jsonl`) serves it as the train split: hub repos of one-split datasets
    often look like that."""
    candidates = [file for file in sorted(path.rglob("*")) if file.is_file() and _data_suffix(file.name)]
    split = split.lower()

    def belongs(file: Path) -> bool:
        folders = [part.lower() for part in file.relative_to(path).parts[:-1]]
        return bool(re.match(rf"{re.escape(split)}([.-]|$)", file.name.lower())) or split in folders

    chosen = [file for file in candidates if belongs(file)]
    if not chosen and split == "train" and len(candidates) == 1 and not _names_a_split(candidates[0].name):
        chosen = candidates
    return chosen, candidates


def _names_a_split(name: str) -> bool:
    return bool(re.match(r"(train|test|validation|valid|dev|eval)([.-]|$)", name.lower()))


def has_split(source: str, split: str) -> bool:
    """Whether `source` (a folder, or a hub id when online) holds a split named `split`; a plain file has none.
    Used to find a dataset's own test split before falling back to holding out a fraction of train."""
    path = Path(source)
    if path.is_file():
        return False
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            return split in _dict_splits(path)
        if (path / "state.json").is_file():  # a single save_to_disk Dataset: one split only
            return False
        return bool(_split_files(path, split)[0])
    if not looks_like_hub_id(source) or hub_offline():
        return False
    try:
        import datasets

        return split in datasets.get_dataset_split_names(source)
    except Exception:  # unreachable or unknown: behave as if the split were absent, reading will tell
        return False


def _read_split_files(path: Path, source: str, split: str) -> list[Row]:
    """The data files of the split (see _split_files), concatenated in name order."""
    chosen, candidates = _split_files(path, split)
    if not chosen:
        found = ", ".join(str(file.relative_to(path)) for file in candidates[:10]) or "none"
        raise DataError(f"{source}: no data file for split '{split}' (data files found: {found})")
    rows = []
    for file in chosen:
        rows += _read_file(file, os.path.join(source, str(file.relative_to(path))))
    return rows


def _data_suffix(name: str) -> bool:
    name = name.lower().removesuffix(".gz")
    return Path(name).suffix in _FILE_READERS


# ---------------------------------------------------------------- hub


def looks_like_hub_id(source: str) -> bool:
    return bool(_HUB_ID.match(source)) and not _data_suffix(source)


def _read_hub(name: str, split: str) -> list[Row]:
    offline_error = OfflineError(f"cannot fetch dataset '{name}' (offline): {OFFLINE_HINT}")
    # Checked before importing `datasets` so an offline run fails at once, without network timeouts.
    if hub_offline():
        raise offline_error
    import datasets

    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as exc:  # the hub stack raises many types; classify them by their cause chain
        if _is_connection_error(exc):
            raise offline_error from None
        raise DataError(f"cannot load dataset '{name}' split '{split}' from the hub: {_one_line(exc)}") from None
    return _from_dataset(dataset, name)


def hub_offline() -> bool:
    """True when the environment forbids hub access (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
    return any(
        os.environ.get(var, "").lower() in {"1", "true", "yes", "on"}
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _is_connection_error(exc: BaseException | None) -> bool:
    while exc is not None:
        kind = type(exc).__name__
        if isinstance(exc, ConnectionError) or "Connect" in kind or "Offline" in kind or "Timeout" in kind:
            return True
        if "offline" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _from_dataset(dataset, source: str) -> list[Row]:
    return [Row(record, source, index) for index, record in enumerate(dataset.to_list(), start=1)]
