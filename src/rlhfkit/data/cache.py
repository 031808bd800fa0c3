"""A disk cache of tokenised stage data, so that a re-run neither reads nor tokenises its data again.

The key is a SHA-256 over everything the tokenised rows depend on:
- the rlhfkit version and this file's CACHE_FORMAT;
- the stage (sft / rm / prompts) and the seed (mixing and the held-out eval rows are seeded);
- every `data.*` option but the cache's own: format, fields, template, max_length, loss_on, split, eval options,
  weights, split_fractions / split_index, on_long_prompt, preset, max_rows ...;
- each source's identity: a local file's resolved path, size and modification time; the same for every file of
  a local folder; a hub dataset's name and current commit (asked from the hub; when it cannot be had nothing is
  cached, rather than risk serving rows of an older revision);
- the tokenizer: its full serialisation (vocabulary, merges, normaliser, post-processor), special tokens and
  chat template, and the template mode in use.

Where: `data.cache_dir`, else $RLHFKIT_CACHE_DIR, else $XDG_CACHE_HOME/rlhfkit, else ~/.cache/rlhfkit, as
`data/<stage>-<key>.json`. A per-user folder rather than one under output_dir: runs with other output folders
(and the three steps of a pipeline over one dataset) share entries, and `--force` does not discard them.
Files are written to a temporary name and renamed, so a crash never leaves half a file under the real name; a
file that does not parse or holds another key is ignored and rewritten. The cache is an optimisation only: an
unwritable folder is reported and the run goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

import rlhfkit
from rlhfkit.data.readers import hub_offline

CACHE_FORMAT = 6  # 2: prompt rows carry their dataset fields; 3: responses encoded after their prompt;
# 4: a source's own test / validation split is its eval rows without a preset too; 5: long prompts keep the
# template's opening (BOS, system turn, first header) besides their end; 6: held-out rows past
# data.eval_max_rows (all of them at 0) train
CACHE_DIR_ENV = "RLHFKIT_CACHE_DIR"
# Entries kept per cache folder, the most recently used first: bounds the folder without any bookkeeping file.
KEEP_ENTRIES = 32


def default_cache_dir(configured: str | None = None) -> Path:
    if configured:
        return Path(configured).expanduser()
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlhfkit"


def _stat(path: Path) -> list:
    info = path.stat()
    return [info.st_size, info.st_mtime_ns]


def hub_commit(name: str) -> str | None:
    """The current commit of a hub dataset, or None when the hub cannot be asked."""
    if hub_offline():
        return None
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(name, timeout=10).sha
    except Exception:  # any failure means "unknown revision": the caller then does not cache
        return None


def source_identity(location: str) -> dict | None:
    """What identifies a source's content without reading it; None when it cannot be known (an unreachable hub)."""
    path = Path(location)
    if path.is_file():
        return {"file": str(path.resolve()), "stat": _stat(path)}
    if path.is_dir():
        files = [[str(f.relative_to(path)), *_stat(f)] for f in sorted(path.rglob("*")) if f.is_file()]
        return {"folder": str(path.resolve()), "files": files}
    commit = hub_commit(location)
    return {"hub": location, "commit": commit} if commit else None


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides how the tokenizer turns text into ids."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizers serialise completely: vocab, merges, normaliser, post-processor
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        vocab_file = getattr(tokenizer, "vocab_file", None)
        if vocab_file and Path(vocab_file).is_file():  # a sentencepiece model holds more than its vocabulary
            digest.update(Path(vocab_file).read_bytes())
    extras = {"class": type(tokenizer).__name__, "special": tokenizer.special_tokens_map,
              "added": sorted(tokenizer.get_added_vocab().items()),
              "chat_template": getattr(tokenizer, "chat_template", None),
              "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]}
    digest.update(json.dumps(extras, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def make_key(parts: dict) -> str:
    parts = {"rlhfkit": rlhfkit.__version__, "cache_format": CACHE_FORMAT, **parts}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def entry_path(cache_dir: Path, stage: str, key: str) -> Path:
    return cache_dir / "data" / f"{stage}-{key[:32]}.json"


def load(path: Path, key: str, warn=lambda text: None) -> dict | None:
    """The cached {"train", "eval", "info"} under `path` if it is intact and holds `key`; else None (a broken
    file is reported through `warn`)."""
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        ok = (isinstance(payload, dict) and payload.get("key") == key and isinstance(payload.get("info"), dict)
              and all(isinstance(payload.get(part), list) for part in ("train", "eval")))
    except (OSError, ValueError):  # ValueError covers bad JSON and bad UTF-8
        ok = False
    if not ok:
        warn(f"ignoring a broken cache file {path} (it will be rewritten)")
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # "recently used" for prune()
    return payload


def save(path: Path, key: str, train: list, evals: list, info: dict, warn=lambda text: None) -> bool:
    """Write atomically: a temporary file in the same folder, then a rename. False (said through `warn`) on
    failure."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"key": key, "info": info, "train": train, "eval": evals}, fh, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        warn(f"cannot write the cache file {path} ({exc.strerror or exc}); continuing without it")
        return False
    prune(path.parent)
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile by another process
        return 0.0


def prune(folder: Path, keep: int = KEEP_ENTRIES) -> None:
    """Delete all but the `keep` most recently used entries, and temporary files a killed writer left (after a
    day, so a concurrent writer's file is never taken)."""
    entries = sorted(folder.glob("*.json"), key=_mtime, reverse=True)
    stale = [tmp for tmp in folder.glob(".*.tmp") if time.time() - _mtime(tmp) > 86400]
    for old in entries[keep:] + stale:
        with contextlib.suppress(OSError):
            old.unlink()
