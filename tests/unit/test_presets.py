"""Seed datasets by name from local copies laid out as users get them, mixing by weight, and the DeepSpeed-Chat
split of one dataset across the steps. Every fixture is written in that dataset's real field layout."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from rlhfkit.config import DataConfig
from rlhfkit.errors import DataError
from rlhfkit.data.formats import FORMATS
from rlhfkit.data.loader import load_stage_data, partition, read_examples, resolve_sources
from rlhfkit.data.presets import PRESETS, find_preset, read_named
from rlhfkit.models import load_tokenizer

from conftest import HH, needs_shared, write_jsonl

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TASK = {"sft": "sft", "rm": "preference", "prompts": "prompt"}


def fixture_rows(name: str) -> list[dict]:
    folder = "presets" if name == "full_hh_rlhf.jsonl" else "formats"
    return [json.loads(line) for line in (FIXTURES / folder / name).read_text().splitlines() if line.strip()]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------- local copies, one layout each


def _parquet(path: Path, rows: list[dict]) -> None:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))


def _jsonl(path: Path, rows: list[dict], gz: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_bytes(gzip.compress(text.encode())) if gz else path.write_text(text)


def _save_to_disk(path: Path, splits: dict) -> None:
    import datasets

    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))


@pytest.fixture(scope="module")
def local_dir(tmp_path_factory) -> Path:
    """RLHFKIT_DATA_DIR as a user fills it: each preset's copy in a different layout; the last row of a dataset
    with a test split goes to test, so the tests can see which split a row came from."""
    root = tmp_path_factory.mktemp("datasets")
    rm_static = fixture_rows("rm_static.jsonl")  # the hub's parquet shards (snapshot_download)
    _parquet(root / "Dahoas/rm-static/data/train-00000-of-00001-2a1df75c6bce91ab.parquet", rm_static[:-1])
    _parquet(root / "Dahoas/rm-static/data/test-00000-of-00001-8c7c51afc6d45980.parquet", rm_static[-1:])
    full = fixture_rows("full_hh_rlhf.jsonl")  # datasets' save_to_disk of the DatasetDict
    _save_to_disk(root / "Dahoas/full-hh-rlhf", {"train": full[:-1], "test": full[-1:]})
    _jsonl(root / "Dahoas/synthetic-instruct-gptj-pairwise.jsonl", fixture_rows("synthetic_gptj.jsonl"))  # one file
    yiting = fixture_rows("yitingxie.jsonl")  # split files
    _jsonl(root / "yitingxie/rlhf-reward-datasets/train.jsonl", yiting[:-1])
    _jsonl(root / "yitingxie/rlhf-reward-datasets/test.jsonl", yiting[-1:])
    _jsonl(root / "openai/webgpt_comparisons/comparisons.jsonl", fixture_rows("webgpt.jsonl"))  # one unsplit file
    shp = fixture_rows("shp.jsonl")  # the hub's per-domain JSON-lines files
    _jsonl(root / "stanfordnlp/SHP/askacademia/train.json", shp[:-1])
    _jsonl(root / "stanfordnlp/SHP/askacademia/validation.json", shp[-1:])
    hh = fixture_rows("hh_rlhf.jsonl")  # the hub's per-subset gzipped JSON lines
    _jsonl(root / "Anthropic/hh-rlhf/helpful-base/train.jsonl.gz", hh[:-1], gz=True)
    _jsonl(root / "Anthropic/hh-rlhf/helpful-base/test.jsonl.gz", hh[-1:], gz=True)
    _jsonl(root / "Anthropic/hh-rlhf/red-team-attempts/red_team_attempts.jsonl.gz", [{"transcript": "x"}], gz=True)
    return root


def read(stage: str, local_dir: Path | None = None, seed: int = 0, **options):
    cfg = DataConfig(local_dir=str(local_dir) if local_dir else None, **options)
    train, evals, stats = read_examples(stage, cfg, seed, *resolve_sources(cfg))
    return train, evals, stats


def test_every_preset_names_a_format_for_each_of_its_steps():
    assert len(PRESETS) == 7
    for preset in PRESETS.values():
        for step in preset.steps:
            assert preset.format in FORMATS[TASK[step]], (preset.name, step)
        assert preset.train_split == "train" and preset.eval_split in (None, "test", "validation")
    assert find_preset("dahoas/RM-static") is PRESETS["Dahoas/rm-static"]


RM_STATIC_PROMPT = [user("What are some cuss words in english?"), assistant("Here is a list of some common ones."),
                    user("What is your favorite one?")]
# preset -> (first train pair (prompt, chosen, rejected), train rows, eval rows from the dataset's own split)
EXPECTED = {
    "Dahoas/rm-static": ((RM_STATIC_PROMPT, "I haven't even thought about it.", "Ass."), 1, 1),
    "Dahoas/full-hh-rlhf": (([user("Should you buy a case to protect your cell phone?"),
                              assistant("It depends on your circumstances.  If you carry your phone in a pocket or a "
                                        "purse then you probably want a case."), user("What harm could a case do?")],
                             "A bulky case can trap heat and dust, and some make the phone harder to hold.",
                             "I don't know."), 2, 1),
    "Dahoas/synthetic-instruct-gptj-pairwise": (([user("I was wondering if you could walk me through the process "
                                                       "of setting up a hydroponic garden for herbs.")],
                                                 "Sure! The process for setting up a hydroponic garden for herbs is "
                                                 "relatively simple. First, choose a container.",
                                                 "How do I store a bagels for eating at a later date?\n\n\nYou can "
                                                 "place the bagels in an airtight container."), 2, 0),
    "yitingxie/rlhf-reward-datasets": (([user("Do you know why turkeys became the official food of thanksgiving?"),
                                         assistant("I'm not sure, do you?"),
                                         user("I think it was because they were plentiful.")],
                                        "That makes sense, wild turkeys were common in New England.",
                                        "I don't know anything about that."), 1, 1),
    "openai/webgpt_comparisons": (([user("Why is the sky blue?")],
                                   "Rayleigh scattering makes blue light dominate the sky [1].",
                                   "Shorter wavelengths scatter more in air [1]."), None, 0),
    "stanfordnlp/SHP": (([user("In an interview right before receiving the 2013 Nobel prize in physics, Peter Higgs "
                               "said he wouldn't be productive enough for today's academic system. Is that true?")],
                         "Yes, publish or perish drives a lot of behaviour.", "Depends on the field."), 1, 1),
    "Anthropic/hh-rlhf": (([user("What kind of noises did dinosaurs make?"),
                            assistant("Humans and dinosaurs didn't live at the same time, so it's hard to say."),
                            user("yes they did")], "Fossils suggest some made low booming calls.",
                           "to guess, and that would probably require lots of reading"), 1, 1),  # 2 skipped
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_by_name_reads_its_local_copy_for_every_step(local_dir, name, monkeypatch):
    monkeypatch.setenv("RLHFKIT_DATA_DIR", str(local_dir))  # the documented default of data.local_dir
    (prompt, chosen, rejected), n_train, n_eval = EXPECTED[name]
    train, evals, _ = read("rm", train=name, eval_fraction=0.0)
    assert (train[0].prompt, train[0].chosen, train[0].rejected) == (prompt, chosen, rejected)
    if n_train is not None:
        assert len(train) == n_train
    assert len(evals) == n_eval  # the dataset's own test/validation split, when the copy has one
    sft, _, _ = read("sft", train=name, eval_fraction=0.0)
    assert (sft[0].prompt, sft[0].response) == (prompt, chosen)  # SFT trains on the chosen side
    prompts, _, _ = read("prompts", train=name, eval_fraction=0.0)
    assert prompts[0].prompt == prompt


def test_without_a_test_split_eval_is_held_out_of_train(local_dir):
    train, evals, _ = read("rm", local_dir, train="Dahoas/synthetic-instruct-gptj-pairwise", eval_fraction=0.5)
    assert len(train) == len(evals) == 1 and train[0].prompt != evals[0].prompt


def test_an_explicit_eval_wins_over_the_preset_split(local_dir, tmp_path):
    other = write_jsonl(tmp_path / "eval.jsonl", fixture_rows("synthetic_gptj.jsonl"))
    _, evals, _ = read("rm", local_dir, train="Dahoas/rm-static", eval=str(other))
    assert [e.chosen[:4] for e in evals] == ["Sure", "Avoc"]


def test_a_folder_or_dataset_dict_with_its_own_test_split_evaluates_on_it_without_a_preset(tmp_path):
    import datasets

    folder = tmp_path / "mine"
    folder.mkdir()
    _pairs(folder, "train", 12), _pairs(folder, "test", 3)  # mine/train.jsonl, mine/test.jsonl
    train, evals, stats = read("rm", train=str(folder), eval_fraction=0.5)
    assert len(train) == 12 and not stats["train"].get("held_out")  # nothing held out of train
    assert [e.prompt[0]["content"] for e in evals] == [f"test question {i}" for i in range(3)]
    rows = lambda name, n: [{"prompt": f"{name} {i}", "chosen": "yes", "rejected": "no"} for i in range(n)]  # noqa
    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows("t", 8)),
                          "validation": datasets.Dataset.from_list(rows("v", 2))}).save_to_disk(str(saved))
    train, evals, _ = read("rm", train=str(saved))
    assert len(train) == 8 and [e.prompt[0]["content"] for e in evals] == ["v 0", "v 1"]
    # an explicit eval folder is read at its own test split too; a plain file still holds out a fraction
    _, evals, _ = read("rm", train=_pairs(tmp_path, "plain", 10), eval=str(folder))
    assert len(evals) == 3
    train, evals, _ = read("rm", train=_pairs(tmp_path, "plain", 10), eval_fraction=0.2)
    assert len(train) == 8 and len(evals) == 2


def test_a_local_path_takes_a_preset_which_fixes_the_format(local_dir):
    copy = local_dir / "yitingxie/rlhf-reward-datasets"
    train, evals, _ = read("rm", train=str(copy), preset="yitingxie/rlhf-reward-datasets")
    assert len(train) == 1 and len(evals) == 1  # the preset's test split is found in the folder too
    # the preset's parser reads every row, so a file in another layout is an error, not another detected format
    with pytest.raises(DataError, match=r"rm_static\.jsonl:1: field 'labels': missing \(row has keys: prompt, "):
        read("rm", train=str(FIXTURES / "formats/rm_static.jsonl"), preset="stanfordnlp/SHP")
    with pytest.raises(DataError, match=r"^config key 'data.preset': unknown preset 'Dahoas/rm-statik' \(known: "
                                        r"Dahoas/rm-static, "):
        read("rm", train=str(copy), preset="Dahoas/rm-statik")


def test_offline_without_a_local_copy_says_exactly_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.delenv("RLHFKIT_DATA_DIR", raising=False)
    empty = tmp_path / "datasets"
    with pytest.raises(DataError) as info:
        read("rm", empty, train="Dahoas/rm-static")
    assert str(info.value) == (
        f"dataset 'Dahoas/rm-static' is not available offline and has no local copy in {empty}: put it at "
        f"{empty}/Dahoas/rm-static/ (a save_to_disk folder, or its split files: train.jsonl, test.jsonl, or the "
        f"hub's data/*.parquet) or at {empty}/Dahoas/rm-static.jsonl (one file: the train split)")
    with pytest.raises(DataError, match=r"no local copy folder is set: set data.local_dir \(or RLHFKIT_DATA_DIR\) "
                                        r"to a folder DIR and: put it at DIR/stanfordnlp/SHP/ .*validation\.jsonl"):
        read("rm", None, train="stanfordnlp/SHP")


def test_read_named_serves_callers_outside_a_stage(local_dir, tmp_path):
    rows = read_named("yitingxie/rlhf-reward-datasets", split="test", local_dir=str(local_dir))
    assert [row.data for row in rows] == fixture_rows("yitingxie.jsonl")[-1:]
    # a mistyped local folder that looks like owner/name: the error says it is no local folder either
    with pytest.raises(DataError, match=r"put it at .*/runs/dta/ .* \(and 'runs/dta' is no local file or folder "
                                        r"either\)$"):
        read_named("runs/dta", local_dir=str(tmp_path))


@needs_shared
def test_real_hh_rlhf_by_name_from_a_hub_like_copy(tmp_path):
    # the real helpful-online test file, placed as in the hub repo (a link: the shared data is never copied)
    (tmp_path / "Anthropic/hh-rlhf/helpful-online").mkdir(parents=True)
    os.symlink(HH, tmp_path / "Anthropic/hh-rlhf/helpful-online/test.jsonl.gz")
    train, evals, stats = read("rm", tmp_path, train="Anthropic/hh-rlhf", split="test", eval_fraction=0.0)
    assert stats["train"]["rows_read"] == 1137 and not evals
    assert len(train) + stats["train"]["identical"] + stats["train"]["no_shared_prompt"] == 1137
    assert all(ex.prompt[-1]["role"] == "user" and ex.chosen != ex.rejected for ex in train)


# ---------------------------------------------------------------- mixing


def _pairs(tmp_path: Path, name: str, n: int) -> str:
    rows = [{"prompt": f"{name} question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(n)]
    return str(write_jsonl(tmp_path / f"{name}.jsonl", rows))


def test_weights_subsample_and_repeat_deterministically_by_seed(tmp_path):
    a, b = _pairs(tmp_path, "a", 10), _pairs(tmp_path, "b", 4)
    mix = [{"path": a, "weight": 0.5}, {"path": b, "weight": 2.5}]
    train, _, _ = read("rm", train=mix, eval_fraction=0.0, seed=1)
    names = [ex.prompt[0]["content"] for ex in train]
    assert sum(n.startswith("a ") for n in names) == 5 and len(set(names[:5])) == 5  # subsampled, no repeats
    b_rows = [n for n in names if n.startswith("b ")]
    assert len(b_rows) == 10 and all(b_rows.count(f"b question {i}") >= 2 for i in range(4))  # 2 copies + 2
    again, _, _ = read("rm", train=mix, eval_fraction=0.0, seed=1)
    other, _, _ = read("rm", train=mix, eval_fraction=0.0, seed=2)
    assert [ex.prompt for ex in again] == [ex.prompt for ex in train]
    assert [ex.prompt for ex in other] != [ex.prompt for ex in train]


def test_held_out_rows_are_taken_per_source_before_repeating(tmp_path):
    mix = [{"path": _pairs(tmp_path, "a", 20), "weight": 3.0}, _pairs(tmp_path, "b", 20)]
    train, evals, _ = read("rm", train=mix, eval_fraction=0.1)
    held = {ex.prompt[0]["content"] for ex in evals}
    assert len(evals) == 4 and {h[0] for h in held} == {"a", "b"}  # 2 from each source
    assert not held & {ex.prompt[0]["content"] for ex in train}  # a repeated row never leaks into eval
    assert len(train) == 18 * 3 + 18


def test_max_rows_of_a_mix_samples_every_source_and_of_one_source_keeps_its_first(tmp_path):
    a, b = _pairs(tmp_path, "a", 30), _pairs(tmp_path, "b", 30)
    train, evals, _ = read("rm", train=[a, b], eval_fraction=0.2, max_rows=20, eval_max_rows=6, seed=3)
    names = [ex.prompt[0]["content"] for ex in train]
    assert len(names) == 20 and len(evals) == 6
    assert 5 <= sum(n.startswith("a ") for n in names) <= 15  # both sources (the first 20 were all of a's)
    assert {ex.prompt[0]["content"][0] for ex in evals} == {"a", "b"}
    order = [(n[0], int(n.split()[-1])) for n in names]
    assert order == sorted(order)  # in the mix's order: a's rows, then b's
    again, _, _ = read("rm", train=[a, b], eval_fraction=0.2, max_rows=20, eval_max_rows=6, seed=3)
    assert [ex.prompt for ex in again] == [ex.prompt for ex in train]
    one, _, _ = read("rm", train=a, eval_fraction=0.0, max_rows=4)
    assert [ex.prompt[0]["content"] for ex in one] == [f"a question {i}" for i in range(4)]
    _, none, _ = read("rm", train=[a, b], eval_fraction=0.2, eval_max_rows=0)
    assert none == []


def test_held_out_rows_past_eval_max_rows_train_and_none_are_held_out_without_evaluation(tmp_path):
    """eval_fraction holds rows out for evaluation; those eval_max_rows leaves out (all of them at 0: no
    evaluation) were neither trained nor evaluated: they train, in their file order."""
    a, b = _pairs(tmp_path, "a", 100), _pairs(tmp_path, "b", 30)
    for cap, n_train, n_eval in ((0, 100, 0), (3, 97, 3), (512, 95, 5)):
        train, evals, stats = read("rm", train=a, eval_fraction=0.05, eval_max_rows=cap)
        assert (len(train), len(evals), stats["train"].get("held_out", 0)) == (n_train, n_eval, n_eval)
        assert not {ex.prompt[0]["content"] for ex in train} & {ex.prompt[0]["content"] for ex in evals}
        numbers = [int(ex.prompt[0]["content"].split()[-1]) for ex in train]
        assert numbers == sorted(numbers)
    train, evals, _ = read("rm", train=[a, b], eval_fraction=0.2, eval_max_rows=6, seed=3)  # 20 + 6 held out
    assert (len(train), len(evals)) == (124, 6)


def test_a_bad_weight_names_its_key(tmp_path):
    with pytest.raises(DataError, match=r"config key 'data.train\[1\].weight': must be a positive number, got -1"):
        read("rm", train=[_pairs(tmp_path, "a", 4), {"path": "x.jsonl", "weight": -1}])
    with pytest.raises(DataError, match=r"^config key 'data.train\[1\].wieght': unknown \(a mix entry takes path "
                                         r"and weight\)$"):
        read("rm", train=[_pairs(tmp_path, "a", 4), {"path": "x.jsonl", "wieght": 2}])


# ---------------------------------------------------------------- one dataset split across the steps


def test_partition_is_disjoint_covering_and_proportional():
    shares = [partition(100, [2, 4, 4], i) for i in range(3)]
    assert [len(s) for s in shares] == [20, 40, 40]
    assert sorted(sum(shares, [])) == list(range(100))
    assert all(s == sorted(s) for s in shares) and shares[0] != list(range(20))  # shuffled, then in file order
    assert partition(100, [0.2, 0.4, 0.4], 1) == shares[1]  # only the ratios matter


def test_each_step_reads_its_own_share_of_one_dataset_whatever_its_seed(tmp_path):
    data = _pairs(tmp_path, "d", 50)
    seen = []
    for index, (stage, seed) in enumerate([("sft", 1), ("rm", 2), ("prompts", 3)]):
        train, _, stats = read(stage, train=data, eval_fraction=0.0, seed=seed, split_fractions=[2, 4, 4],
                               split_index=index)
        seen.append({ex.prompt[0]["content"] for ex in train})
        assert stats["train"]["rows_read"] == [10, 20, 20][index]
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert len(seen[0] | seen[1] | seen[2]) == 50


@pytest.mark.parametrize("options, message", [
    ({"split_fractions": [2, 4, 4], "split_index": 3},
     r"config key 'data.split_index': 3 is not a share of data.split_fractions \[2, 4, 4\] \(0 to 2\)"),
    ({"split_fractions": [2, 0, 4], "split_index": 1}, r"share 1 of data.split_fractions \[2, 0, 4\] is 0"),
    ({"split_fractions": [2, -1]}, r"config key 'data.split_fractions': expected relative shares >= 0"),
])
def test_bad_split_options_name_the_key(tmp_path, options, message):
    with pytest.raises(DataError, match=message):
        read("rm", train=_pairs(tmp_path, "d", 10), **options)


def test_loaded_by_name_through_load_stage_data(local_dir, tiny_model_dir, tmp_path):
    tok = load_tokenizer(str(tiny_model_dir))
    cfg = DataConfig(train="Dahoas/rm-static", local_dir=str(local_dir), cache_dir=str(tmp_path / "cache"))
    data = load_stage_data("rm", cfg, tok, seed=0)
    assert data.info["train_rows"] == 1 and data.info["eval_rows"] == 1 and data.info["cache"] == "miss"
