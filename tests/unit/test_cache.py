"""The tokenised-data cache: a hit skips reading and tokenising, every key ingredient invalidates it, a broken
file is ignored and rewritten, and writes are atomic."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

import rlhfkit
from rlhfkit.config import DataConfig
from rlhfkit.data import cache, loader
from rlhfkit.data.loader import load_stage_data
from rlhfkit.models import load_tokenizer

from conftest import sft_rows, write_jsonl


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture
def data(tmp_path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", sft_rows())


def config(tmp_path: Path, data: Path, **options) -> DataConfig:
    return DataConfig(**{"train": str(data), "cache_dir": str(tmp_path / "cache"), "max_length": 64, **options})


def entries(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "cache" / "data"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def without_cache(info: dict) -> dict:
    return {k: v for k, v in info.items() if k != "cache"}


def test_a_second_load_is_a_hit_that_neither_reads_nor_tokenises(tmp_path, data, tok, monkeypatch, capsys):
    first = load_stage_data("sft", config(tmp_path, data), tok, seed=0)
    assert first.info["cache"] == "miss"
    [entry] = entries(tmp_path)
    assert entry.name.startswith("sft-") and entry.suffix == ".json"

    def must_not_run(*args, **kwargs):
        raise AssertionError("a cache hit must not read or tokenise")

    monkeypatch.setattr(loader, "read_examples", must_not_run)
    monkeypatch.setattr(loader, "_tokenize", must_not_run)
    second = load_stage_data("sft", config(tmp_path, data), tok, seed=0)
    assert second.info["cache"] == "hit"
    assert (second.train, second.eval, without_cache(second.info)) == (first.train, first.eval,
                                                                         without_cache(first.info))
    err = capsys.readouterr().err
    assert f"data: cache hit: {len(first.train)} train / {len(first.eval)} eval rows from {entry}" in err


def _touch_source(tmp_path, data, tok, cfg):  # same bytes, newer modification time
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    return cfg, tok


def _other_tokenizer(tmp_path, data, tok, cfg):
    other = copy.deepcopy(tok)
    other.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    return cfg, other


def _chat_template(tmp_path, data, tok, cfg):
    other = copy.deepcopy(tok)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return cfg, other


def _option(**options):
    return lambda tmp_path, data, tok, cfg: (config(tmp_path, data, **options), tok)


# every ingredient of the key: changing it must give a miss (a new entry), never the old rows
CHANGES = {
    "source file modified": _touch_source,
    "tokenizer vocabulary": _other_tokenizer,
    "tokenizer chat template": _chat_template,
    "template mode": _option(template="plain"),
    "format": _option(format="prompt_response"),
    "fields": _option(fields={"response": "response"}),
    "max_length": _option(max_length=65),
    "loss_on": _option(loss_on="all"),
    "eval_fraction": _option(eval_fraction=0.25),
    "split_fractions": _option(split_fractions=[1, 1]),
    "split_index": _option(split_fractions=[1, 1], split_index=1),
    "max_rows": _option(max_rows=10),
    "on_long_prompt": _option(on_long_prompt="error"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_key_ingredient_invalidates(tmp_path, data, tok, change):
    base = config(tmp_path, data)
    assert load_stage_data("sft", base, tok, seed=0).info["cache"] == "miss"
    cfg, other_tok = CHANGES[change](tmp_path, data, tok, base)
    assert load_stage_data("sft", cfg, other_tok, seed=0).info["cache"] == "miss"
    assert len(entries(tmp_path)) == 2
    assert load_stage_data("sft", cfg, other_tok, seed=0).info["cache"] == "hit"


def test_the_tokenizer_fingerprint_sees_vocabulary_specials_and_chat_template(tok):
    base = cache.tokenizer_fingerprint(tok)
    assert cache.tokenizer_fingerprint(copy.deepcopy(tok)) == base
    for change in (_other_tokenizer, _chat_template):
        assert cache.tokenizer_fingerprint(change(None, None, tok, None)[1]) != base
    no_pad = copy.deepcopy(tok)
    no_pad.pad_token = no_pad.eos_token
    assert cache.tokenizer_fingerprint(no_pad) != base


def test_seed_stage_and_version_are_keyed(tmp_path, data, tok, monkeypatch):
    cfg = config(tmp_path, data)
    assert load_stage_data("sft", cfg, tok, seed=0).info["cache"] == "miss"
    assert load_stage_data("sft", cfg, tok, seed=1).info["cache"] == "miss"  # mixing and eval rows are seeded
    assert load_stage_data("prompts", cfg, tok, seed=0).info["cache"] == "miss"
    monkeypatch.setattr(rlhfkit, "__version__", "9.9.9")
    assert load_stage_data("sft", cfg, tok, seed=0).info["cache"] == "miss"
    assert len(entries(tmp_path)) == 4


@pytest.mark.parametrize("broken", [b"\x00\xff garbage", b'{"key": "abc", "train": [', b"[1, 2, 3]",
                                    b'{"key": "another key", "info": {}, "train": [], "eval": []}'])
def test_a_broken_cache_file_is_ignored_and_rewritten(tmp_path, data, tok, capsys, broken):
    first = load_stage_data("sft", config(tmp_path, data), tok, seed=0)
    [entry] = entries(tmp_path)
    entry.write_bytes(broken)
    again = load_stage_data("sft", config(tmp_path, data), tok, seed=0)
    assert again.info["cache"] == "miss" and again.train == first.train
    assert f"data: ignoring a broken cache file {entry} (it will be rewritten)" in capsys.readouterr().err
    assert json.loads(entry.read_text())["train"] == first.train
    assert load_stage_data("sft", config(tmp_path, data), tok, seed=0).info["cache"] == "hit"


def test_a_failed_write_leaves_no_file_and_the_run_goes_on(tmp_path, data, tok, monkeypatch, capsys):
    def disk_full(payload, fh, **kwargs):
        fh.write('{"key": "half a file')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.json, "dump", disk_full)
    result = load_stage_data("sft", config(tmp_path, data), tok, seed=0)
    assert result.train and entries(tmp_path) == []  # neither the entry nor its temporary file
    assert "cannot write the cache file" in capsys.readouterr().err
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.undo()
    cfg = DataConfig(train=str(data), cache_dir=str(blocked), max_length=64)
    assert load_stage_data("sft", cfg, tok, seed=0).train == result.train


def test_cache_off_writes_nothing(tmp_path, data, tok):
    info = load_stage_data("sft", config(tmp_path, data, cache=False), tok, seed=0).info
    assert info["cache"] == "off" and entries(tmp_path) == []


def test_source_identity(tmp_path, data, monkeypatch):
    ident = cache.source_identity(str(data))
    assert ident == {"file": str(data.resolve()), "stat": [data.stat().st_size, data.stat().st_mtime_ns]}
    (tmp_path / "folder" / "data").mkdir(parents=True)
    (tmp_path / "folder" / "data" / "train.jsonl").write_text("{}\n")
    assert [f[0] for f in cache.source_identity(str(tmp_path / "folder"))["files"]] == ["data/train.jsonl"]
    assert cache.source_identity("owner/name") is None  # offline: no revision, so not cached at all
    monkeypatch.setattr(cache, "hub_commit", lambda name: "0123abcd")
    assert cache.source_identity("owner/name") == {"hub": "owner/name", "commit": "0123abcd"}


def test_default_folder_and_pruning(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(tmp_path / "env"))
    assert cache.default_cache_dir(None) == tmp_path / "env"
    assert cache.default_cache_dir(str(tmp_path / "cfg")) == tmp_path / "cfg"
    monkeypatch.delenv("RLHFKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_cache_dir(None) == tmp_path / "xdg" / "rlhfkit"
    folder = tmp_path / "entries"
    for i in range(cache.KEEP_ENTRIES + 3):
        assert cache.save(folder / f"sft-{i:02d}.json", "k", [], [], {})
        os.utime(folder / f"sft-{i:02d}.json", (i, i))  # entry i used at time i
    kept = sorted(p.name for p in folder.iterdir())
    assert len(kept) == cache.KEEP_ENTRIES and "sft-00.json" not in kept and "sft-34.json" in kept


def test_an_eval_share_that_rounds_to_no_rows_is_said_on_miss_and_hit(tmp_path, tok, capsys):
    data = write_jsonl(tmp_path / "few.jsonl", sft_rows()[:8])
    expected = ("data: no evaluation rows: data.eval_fraction 0.05 of 8 rows rounds to none, so the run logs no eval "
                "metrics; pass data.eval (ppo: data.eval_prompts) or raise data.eval_fraction")
    for _ in ("miss", "hit"):
        assert load_stage_data("sft", config(tmp_path, data), tok, seed=0).eval == []
        assert expected in capsys.readouterr().err.splitlines()
    assert load_stage_data("sft", config(tmp_path, data, eval_fraction=0.25), tok, seed=0).info["eval_rows"] == 2
    assert load_stage_data("sft", config(tmp_path, data, eval_fraction=0.0), tok, seed=0).eval == []
    assert "no evaluation rows" not in capsys.readouterr().err  # asked for none, or got some: nothing to say


def test_eval_rows_all_too_long_are_said_as_such(tmp_path, tok, capsys):
    rows = sft_rows()[:40]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    long = write_jsonl(tmp_path / "long.jsonl", [{**row, "prompt": row["prompt"] + " word" * 200} for row in rows[:3]])
    got = load_stage_data("sft", config(tmp_path, data, eval=str(long), on_long_prompt="drop"), tok,
                          seed=0)
    assert got.eval == [] and got.train
    assert ("data: no evaluation rows: all 3 were skipped or dropped (too long for data.max_length=64, or empty), "
            "so the run logs no eval metrics") in capsys.readouterr().err.splitlines()
