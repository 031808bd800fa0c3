"""A mistyped local model path is reported as missing at once, not looked up on the hub (where, offline, it
waited ~50 s on retries and then blamed the tokenizer)."""

import os
import subprocess
import sys
import time

import pytest

from rlhfkit.models import ModelError, load_causal_lm, load_tokenizer

from conftest import ROOT, STORIES, needs_shared


@pytest.mark.parametrize("name", ["runs/nope", "runs/sft/final", "out/ppo/final-critic", "./nope"])
def test_a_missing_local_path_fails_at_once_naming_it(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # "runs/nope": its first part is a local folder, so it is a path, not a hub id
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the hub would be tried if the name were taken for an id
    for load in (load_tokenizer, load_causal_lm):
        start = time.monotonic()
        with pytest.raises(ModelError, match=f"^model folder '{name}' does not exist$"):
            load(name)
        assert time.monotonic() - start < 5  # no network retries


def test_a_run_folder_given_for_a_model_points_at_its_final_folder(tmp_path, tiny_model_dir, capsys):
    import shutil

    from rlhfkit.cli import main as cli_main

    run = tmp_path / "runs" / "sft"
    shutil.copytree(tiny_model_dir, run / "final")
    (run / "config.yaml").write_text("model: x\n")
    expected = f"'{run}' is a run folder, not a model folder: pass '{run / 'final'}', the model the run exported"
    with pytest.raises(ModelError) as err:
        load_tokenizer(str(run))
    assert str(err.value) == expected
    assert cli_main(["chat", str(run), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip().endswith(expected)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "say a", "chosen": "a", "rejected": "b"}\n')
    assert cli_main(["score", str(run), "--data", str(pairs)]) == 2
    assert capsys.readouterr().err.strip().endswith(expected)
    load_tokenizer(str(run / "final"))


def test_a_hub_id_shape_is_still_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no "HuggingFaceTB/" folder here: the name is a hub id, refused offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="is not a folder, and HF_HUB_OFFLINE is set"):
        load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")


@needs_shared
def test_a_row_longer_than_the_tokenizers_maximum_is_encoded_without_a_misleading_warning():
    """Rows are cut to data.max_length after encoding; transformers' 'indexing errors' warning does not apply.
    (A subprocess: transformers' log handler writes to the stderr it found at import.)"""
    script = (f"from rlhfkit.models import load_tokenizer\n"
              f"tok = load_tokenizer({str(STORIES)!r})\n"
              f"assert len(tok('Once upon a time ' * 400)['input_ids']) > tok.model_max_length == 512\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Token indices sequence length" not in res.stderr


def test_exported_folders_keep_the_dropout_and_cache_settings_they_were_loaded_with(tmp_path, tiny_model_dir):
    """Dropout off and no KV cache are settings of the run (PPO's ratio needs deterministic forwards; gradient
    checkpointing cannot cache): the model trains with them, final/config.json keeps the folder's own."""
    import json
    import shutil

    from rlhfkit.config.schema import LoadConfig
    from rlhfkit.engine.storage import write_hf_folder

    folder = tmp_path / "with-dropout"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1, "use_cache": True}))
    model = load_causal_lm(str(folder), LoadConfig(disable_dropout=True, gradient_checkpointing=True))
    assert (model.config.attention_dropout, model.config.use_cache) == (0.0, False)
    for name in ("final", "again"):  # an export leaves the run's settings in place for the next one
        write_hf_folder(model, load_tokenizer(str(folder)), tmp_path / name)
        saved = json.loads((tmp_path / name / "config.json").read_text())
        assert (saved["attention_dropout"], saved["use_cache"]) == (0.1, True)
        assert not any(key.startswith("_rlhfkit") for key in saved)
        assert (model.config.attention_dropout, model.config.use_cache) == (0.0, False)
