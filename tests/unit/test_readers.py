"""read_rows: every supported source gives the same rows with correct 1-based lines; bad input names file:line."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

from rlhfkit.errors import DataError, where
from rlhfkit.data.readers import Row, read_rows

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
ROWS = [
    {"prompt": "What is the capital of France?", "response": "Paris."},
    {"prompt": "Add 2 and 3.", "response": " 5 "},
]


def test_where_formats_path_and_line():
    assert where("data/train.jsonl", 17) == "data/train.jsonl:17"
    assert where("data/train.jsonl", None) == "data/train.jsonl"


def test_jsonl_rows_keep_source_and_line_and_skip_blank_lines(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n  \n" + json.dumps(ROWS[1]) + "\n")
    assert read_rows(str(path)) == [Row(ROWS[0], str(path), 1), Row(ROWS[1], str(path), 4)]


def test_fixture_jsonl_and_gzip_give_the_same_rows(tmp_path):
    plain = read_rows(str(FIXTURES / "prompt_response.jsonl"))
    packed = tmp_path / "prompt_response.jsonl.gz"
    packed.write_bytes(gzip.compress((FIXTURES / "prompt_response.jsonl").read_bytes()))
    assert [row.data for row in plain] == ROWS
    assert [(row.data, row.line) for row in read_rows(str(packed))] == [(row.data, row.line) for row in plain]


def test_json_array_wrapper_and_json_lines_content(tmp_path):
    alpaca = read_rows(str(FIXTURES / "alpaca.json"))
    assert [row.line for row in alpaca] == [2, 7]  # the line each record starts on
    assert alpaca[1].data == {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"version": 2, "data": ROWS}))
    assert [row.data for row in read_rows(str(wrapped))] == ROWS
    lines = tmp_path / "lines.json"
    lines.write_text("\n".join(json.dumps(row) for row in ROWS))
    assert [(row.data, row.line) for row in read_rows(str(lines))] == [(ROWS[0], 1), (ROWS[1], 2)]
    # A one-row file whose only list is a row field stays one row, not a wrapper.
    single = tmp_path / "single.json"
    single.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    assert [row.data for row in read_rows(str(single))] == [{"messages": [{"role": "user", "content": "hi"}]}]
    # ... and so does one whose only list holds no objects (an Alpaca record with its history of turns)
    record = {"instruction": "And in French?", "output": "Bonjour", "history": [["Say hello.", "Hello"]]}
    single.write_text(json.dumps(record))
    assert [row.data for row in read_rows(str(single))] == [record]


def test_csv_rows_are_file_lines_with_multiline_cells_and_blank_lines(tmp_path):
    rows = read_rows(str(FIXTURES / "prompt_response.csv"))
    assert [(row.data, row.line) for row in rows] == [
        ({"prompt": "What is the capital of Italy?", "response": "Rome."}, 2),  # line 1: the header
        ({"prompt": "List two colours.", "response": "Red,\nblue."}, 3),
    ]
    path = tmp_path / "more.csv"
    path.write_text('a,b\n"x\ny\nz",1\n\n2,3,4\n')
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}:6: 1 more cells than header columns$"):
        read_rows(str(path))


def test_csv_cells_longer_than_the_csv_modules_default_limit_are_read(tmp_path):
    """A long document or response is valid data (the csv module refuses cells over 131,072 characters unless told)."""
    long = "word " * 60_000  # 300,000 characters
    path = tmp_path / "long.csv"
    path.write_text(f'prompt,response\nsummarise,"{long}"\nshort,ok\n')
    rows = read_rows(str(path))
    assert [(len(row.data["response"]), row.line) for row in rows] == [(300_000, 2), (2, 3)]


def test_json_array_records_start_lines_whatever_the_layout(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[\n  {"a": 1},\n\n  {"a": "x\\ny",\n   "b": [1,\n 2]}, {"a": 3}\n]\n')
    assert [(row.data, row.line) for row in read_rows(str(path))] == [
        ({"a": 1}, 2), ({"a": "x\ny", "b": [1, 2]}, 4), ({"a": 3}, 6)]
    path.write_text(json.dumps({"data": [{"a": 1}, {"a": 2}]}, indent=2))
    assert [row.line for row in read_rows(str(path))] == [1, 2]  # a wrapped array: record numbers


def test_parquet_via_datasets(tmp_path):
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    assert [(row.data, row.line) for row in read_rows(str(path))] == [(ROWS[0], 1), (ROWS[1], 2)]


def test_text_documents_split_on_endoftext_or_blank_lines(tmp_path):
    marked = tmp_path / "corpus.txt"
    marked.write_text("One day.\n\nThe end.\n<|endoftext|>\nSecond story.\n<|endoftext|>\n")
    assert [(row.data["text"], row.line) for row in read_rows(str(marked))] == [
        ("One day.\n\nThe end.", 1),
        ("Second story.", 5),
    ]
    blank = tmp_path / "paragraphs.txt"
    blank.write_text("First doc\nline two\n\n\nSecond doc\n")
    assert [(row.data["text"], row.line) for row in read_rows(str(blank))] == [
        ("First doc\nline two", 1),
        ("Second doc", 5),
    ]


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert [row.data for row in read_rows(str(tmp_path / "single"))] == ROWS
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    test_rows = read_rows(str(tmp_path / "dict"), split="test")
    assert [(row.data, row.line) for row in test_rows] == [(ROWS[0], 1)]
    with pytest.raises(DataError, match=r"dict: no split 'validation' \(available: train, test\)"):
        read_rows(str(tmp_path / "dict"), split="validation")


def test_folder_of_split_files_and_shards(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    rows = read_rows(str(tmp_path), split="test")
    assert [(row.data, row.source) for row in rows] == [(ROWS[1], str(tmp_path / "test.jsonl"))]
    shards = tmp_path / "snapshot" / "data"
    shards.mkdir(parents=True)
    for index, row in enumerate(ROWS):
        (shards / f"train-0000{index}-of-00002.jsonl").write_text(json.dumps(row) + "\n")
    assert [row.data for row in read_rows(str(tmp_path / "snapshot"))] == ROWS
    with pytest.raises(DataError, match=r"no data file for split 'validation' \(data files found: .*test.jsonl"):
        read_rows(str(tmp_path), split="validation")


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + '\n{"prompt": "x", "response": }\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: invalid JSON: Expecting value \(column 29\)$"):
        read_rows(str(path))


def test_non_object_line_is_an_error(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('["a", "b"]\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:1: expected a JSON object, got list$"):
        read_rows(str(path))


def test_non_utf8_bytes_name_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: not UTF-8 text \(byte b'\\xe9'\)"):
        read_rows(str(path))


def test_empty_file_missing_path_and_unsupported_type(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(empty))}: no rows$"):
        read_rows(str(empty))
    with pytest.raises(DataError, match=r"^data/missing\.jsonl: no such file or folder$"):
        read_rows("data/missing.jsonl")
    with pytest.raises(DataError, match=r"^\./nowhere: no such file or folder$"):
        read_rows("./nowhere")
    odd = tmp_path / "x.xml"
    odd.write_text("<a/>")
    with pytest.raises(DataError, match=r"unsupported file type '\.xml' \(supported: \.csv, \.json, \.jsonl"):
        read_rows(str(odd))


@pytest.mark.parametrize("variable", ["HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"])
def test_hub_id_offline_says_how_to_pass_a_local_copy(monkeypatch, variable):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv(variable, "1")
    expected = (
        "cannot fetch dataset 'Dahoas/rm-static' (offline): download it elsewhere and pass a local copy: "
        "a .jsonl/.json/.parquet/.csv file or a save_to_disk folder"
    )
    with pytest.raises(DataError) as info:
        read_rows("Dahoas/rm-static")
    assert str(info.value) == expected


def test_hub_connection_failure_is_reported_as_offline(tmp_path):
    """The real datasets / huggingface_hub stack, online but with no hub to reach (a closed local port): what it
    raises after its retries (~25 s of back-off, no work) is read as "offline". In a subprocess: the hub client
    reads its endpoint when imported."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), HF_HUB_ETAG_TIMEOUT="2",
               HF_HUB_DOWNLOAD_TIMEOUT="2", PYTHONPATH=str(ROOT / "src"))
    code = ("from rlhfkit.data.readers import read_rows\n"
            "from rlhfkit.errors import DataError\n"
            "try:\n    read_rows('owner/name')\nexcept DataError as exc:\n    print('DataError:', exc)\n")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert res.stdout.startswith("DataError: cannot fetch dataset 'owner/name' (offline): download it elsewhere"), \
        res.stdout + res.stderr[-2000:]


def test_hub_rows_come_from_load_dataset(monkeypatch):
    import datasets

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def fake_load(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    rows = read_rows("owner/name", split="test")
    assert calls == [("owner/name", "test")]
    assert rows[1] == Row(ROWS[1], "owner/name", 2)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"shared data folder {SHARED_DATA} is absent")
def test_real_files_read_completely():
    assert len(read_rows(str(SHARED_DATA / "preference" / "hh-rlhf-helpful-online.test.jsonl.gz"))) == 1137
    assert len(read_rows(str(SHARED_DATA / "sft" / "alpaca_en_demo.json"))) == 999
    stories = read_rows(str(SHARED_DATA / "text" / "tinystories-2MiB.txt"))
    # 2,316 complete stories plus the cut-off tail of the 2 MiB sample.
    assert len(stories) == 2317 and stories[0].data["text"].startswith("One day, a little girl named Lily")


def test_damaged_save_to_disk_folders_are_one_data_error(tmp_path):
    import datasets

    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a b"}])}).save_to_disk(str(folder))
    assert [row.data for row in read_rows(str(folder))] == [{"text": "a b"}]
    (folder / "dataset_dict.json").write_text('{"splits": ["train"')  # cut short
    with pytest.raises(DataError, match=f"^{re.escape(str(folder / 'dataset_dict.json'))}: not a readable "
                                        r"dataset_dict.json \(JSONDecodeError: "):
        read_rows(str(folder))
    (folder / "dataset_dict.json").write_text('{"splits": ["train"]}')
    for file in (folder / "train").glob("*.arrow"):
        file.write_bytes(b"not arrow")
    with pytest.raises(DataError, match=f"^{re.escape(str(folder / 'train'))}: not a readable save_to_disk dataset"):
        read_rows(str(folder))


@pytest.mark.parametrize("orient", ["columns", "index"])
def test_a_pandas_to_json_file_reads_as_its_rows(tmp_path, orient):
    """`df.to_json(path)` writes {column: {index: value}} by default (orient="columns"), not a list of records:
    read as one record it made an error about the wrong thing. Its rows come back in index order."""
    import pandas

    frame = pandas.DataFrame({"prompt": [f"say {i}" for i in range(12)], "response": [str(i) for i in range(12)]})
    path = tmp_path / "frame.json"
    frame.to_json(path, orient=orient)
    rows = read_rows(str(path))
    assert [r.data for r in rows] == frame.to_dict(orient="records")
    assert [r.line for r in rows] == list(range(1, 13))
    # a single record whose fields are objects stays one record
    (tmp_path / "one.json").write_text(json.dumps({"prompt": {"text": "hi"}, "meta": {"source": "x"}}))
    assert len(read_rows(str(tmp_path / "one.json"))) == 1
