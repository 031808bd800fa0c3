"""Checkpoint manifests (local engine): every checkpoint lists its files, sizes and sha256; --resume refuses a
damaged, truncated or partial one naming the file and the previous good checkpoint; `rlhfkit checkpoints` lists
and verifies them, and `--use` points `latest` at a good one from which --resume continues the same curve."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from rlhfkit import __version__
from rlhfkit.cli import main as cli_main
from rlhfkit.config import SFTConfig, load_config
from rlhfkit.engine.manifest import MANIFEST, checkpoint_files, verified_latest
from rlhfkit.errors import RunError
from rlhfkit.stages.sft import run_sft

from conftest import read_metrics, sft_rows, write_jsonl


def config(run, tiny_model_dir, data):
    return load_config(SFTConfig, None, [f"model={tiny_model_dir}", f"data.train={data}", f"output_dir={run}",
                                         "train.max_steps=6", "train.batch_size=8", "train.lr=5e-3",
                                         "train.save_every=2", "train.keep_checkpoints=2", "train.eval_every=0",
                                         "log.tensorboard=false", "log.progress=false"])


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """A 6-step SFT run with checkpoints at steps 2 and 4 (latest: step 4)."""
    root = tmp_path_factory.mktemp("manifest")
    data = write_jsonl(root / "train.jsonl", sft_rows())
    run = root / "run"
    run_sft(config(run, tiny_model_dir, data))
    return run, data


@pytest.fixture
def run(tmp_path, finished):
    """A copy of the finished run, as if it died after its step-4 checkpoint (no final/)."""
    source, _ = finished
    copy = tmp_path / "run"
    shutil.copytree(source, copy)
    shutil.rmtree(copy / "final")
    return copy


def resume(run, tiny_model_dir, finished):
    return run_sft(config(run, tiny_model_dir, finished[1]), resume=True)


def test_every_checkpoint_carries_a_manifest_of_its_files(finished):
    folder = finished[0] / "checkpoints"
    assert (folder / "latest").read_text() == "step-00000004"
    for step in (2, 4):
        ckpt = folder / f"step-{step:08d}"
        manifest = json.loads((ckpt / MANIFEST).read_text())
        assert {k: manifest[k] for k in ("step", "engine", "world_size", "zero_stage", "rlhfkit_version")} == \
            {"step": step, "engine": "local", "world_size": 1, "zero_stage": None, "rlhfkit_version": __version__}
        listed = [entry["path"] for entry in manifest["files"]]
        assert listed == checkpoint_files(ckpt) == ["model.optim.pt", "model.safetensors", "state.pt"]
        for entry in manifest["files"]:
            data = (ckpt / entry["path"]).read_bytes()
            assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_changed_byte_is_refused_naming_the_file_and_the_previous_good_checkpoint(run, tiny_model_dir, finished):
    weights = run / "checkpoints" / "step-00000004" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: same size, different content
    weights.write_bytes(bytes(data))
    with pytest.raises(RunError) as err:
        resume(run, tiny_model_dir, finished)
    message = str(err.value)
    assert f"checkpoint '{run / 'checkpoints' / 'step-00000004'}' is damaged: model.safetensors: sha256" in message
    assert "the file changed after it was saved" in message
    assert f"the previous good checkpoint is step-00000002: point `latest` at it with `rlhfkit checkpoints " \
           f"{run} --use step-00000002`, then resume again" in message
    assert not (run / "final").exists()


@pytest.mark.parametrize("damage, says", [
    ("remove", "model.optim.pt: missing"),
    ("truncate", "model.optim.pt: 100 bytes, the manifest says"),
])
def test_a_missing_or_truncated_file_is_refused(run, damage, says):
    optim = run / "checkpoints" / "step-00000004" / "model.optim.pt"
    if damage == "remove":
        optim.unlink()
    else:
        optim.write_bytes(optim.read_bytes()[:100])
    with pytest.raises(RunError, match=f"is damaged: {says}.*previous good checkpoint is step-00000002"):
        verified_latest(run / "checkpoints", {"engine": "local", "world_size": 1, "zero_stage": None}, print)


def test_without_a_good_earlier_checkpoint_the_error_says_to_start_again(run):
    folder = run / "checkpoints"
    shutil.rmtree(folder / "step-00000002")
    (folder / "step-00000004" / "state.pt").unlink()
    with pytest.raises(RunError, match="state.pt: missing; no earlier checkpoint verifies: start the run again "
                                       "without --resume"):
        verified_latest(folder, {"engine": "local", "world_size": 1, "zero_stage": None}, print)


def test_latest_naming_a_vanished_folder_points_to_the_previous_good_one(run):
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    with pytest.raises(RunError, match="step-00000004' named by .* is missing; the previous good checkpoint is "
                                       "step-00000002"):
        verified_latest(run / "checkpoints", {"engine": "local", "world_size": 1, "zero_stage": None}, print)


def test_a_checkpoint_of_another_engine_or_world_size_is_refused(run):
    path = run / "checkpoints" / "step-00000004" / MANIFEST
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "engine": "deepspeed", "world_size": 2, "zero_stage": 2}))
    with pytest.raises(RunError, match=r"cannot be loaded by this run: it was written by the deepspeed engine on 2 "
                                       r"rank\(s\), ZeRO stage 2 and this run is the local engine on 1 rank\(s\)"):
        verified_latest(run / "checkpoints", {"engine": "local", "world_size": 1, "zero_stage": None}, print)


def test_a_checkpoint_whose_critic_had_another_zero_stage_is_refused(run):
    """engine.critic_zero_stage is recorded too: resumed at another stage, DeepSpeed failed in its loader with a
    traceback; now the check names it, and the same stages pass."""
    path = run / "checkpoints" / "step-00000004" / MANIFEST
    manifest = {**json.loads(path.read_text()), "engine": "deepspeed", "world_size": 1, "zero_stage": 1,
                "critic_zero_stage": 2}
    path.write_text(json.dumps(manifest))
    same = {"engine": "deepspeed", "world_size": 1, "zero_stage": 1, "critic_zero_stage": 2}
    with pytest.raises(RunError, match=r"ZeRO stage 1 \(critic 2\) and this run is the deepspeed engine on 1 "
                                       r"rank\(s\), ZeRO stage 1 \(critic 3\): resume with the same .*critic's stage"):
        verified_latest(run / "checkpoints", {**same, "critic_zero_stage": 3}, print)
    assert verified_latest(run / "checkpoints", same, print).name == "step-00000004"


def test_an_old_checkpoint_without_a_manifest_loads_with_a_warning(run):
    (run / "checkpoints" / "step-00000004" / MANIFEST).unlink()
    said = []
    target = verified_latest(run / "checkpoints", {"engine": "local", "world_size": 1, "zero_stage": None},
                             said.append)
    assert target.name == "step-00000004"
    assert len(said) == 1 and "has no manifest.json" in said[0] and "loading it unverified" in said[0]


def test_listing_verifies_each_checkpoint_and_use_then_resume_continues_the_curve(run, tiny_model_dir, finished,
                                                                                    capsys):
    folder = run / "checkpoints"
    assert cli_main(["checkpoints", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"checkpoints in {folder} (sizes and sha256 checked against each manifest)"
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in out[2:-1]}
    assert rows["step-00000002"].split()[1:4] == ["2", "1", "-"] and rows["step-00000002"].endswith("OK")
    assert rows["step-00000004"].startswith("* step-00000004") and rows["step-00000004"].endswith("OK")
    assert out[-1] == "* latest: step-00000004"

    (folder / "step-00000004" / "model.safetensors").write_bytes(b"garbage")
    (folder / "step-00000006.tmp").mkdir()  # a save that never finished
    assert cli_main(["checkpoints", str(run)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED: model.safetensors: 7 bytes, the manifest says" in out
    assert "step-00000006.tmp" in out and "incomplete: a save that did not finish" in out

    assert cli_main(["checkpoints", str(run), "--use", "step-00000004"]) == 2  # a damaged one is not chosen
    assert "rlhfkit checkpoints: error: checkpoint" in capsys.readouterr().err
    assert cli_main(["checkpoints", str(run), "--use", "step-00000006.tmp"]) == 2  # nor an unfinished save
    assert "'step-00000006.tmp' in" in capsys.readouterr().err and (folder / "latest").read_text() == "step-00000004"
    # the switch succeeded, so exit 0 (`... --use 2 && rlhfkit sft --resume ...` goes on); still lists the damaged
    assert cli_main(["checkpoints", str(run), "--use", "2"]) == 0
    out = capsys.readouterr().out
    assert "latest -> step-00000002: --resume continues from step 2" in out and "DAMAGED" in out
    assert (folder / "latest").read_text() == "step-00000002"

    resume(run, tiny_model_dir, finished)
    reference = read_metrics(finished[0] / "metrics.jsonl")
    resumed = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    for got, want in zip(resumed, reference):
        assert got.keys() == want.keys()
        for key in ("loss", "eval/loss"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (key, got["step"])
    # the damaged step-4 checkpoint was replaced by the resumed run's own, which verifies
    assert cli_main(["checkpoints", str(run)]) == 0
    assert "DAMAGED" not in capsys.readouterr().out


def test_replacing_a_folder_moves_the_old_one_aside_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """replace_folder never deletes the old folder before the new one has its name (a kill in that gap lost the
    checkpoint `latest` named); a `.old` left by a kill between the two renames is no checkpoint."""
    import os

    from rlhfkit.engine import storage
    from rlhfkit.engine.manifest import checkpoint_folders

    target, tmp = tmp_path / "step-00000004", tmp_path / "step-00000004.tmp"
    target.mkdir()
    (target / "w").write_text("old")
    tmp.mkdir()
    (tmp / "w").write_text("new")
    seen = []
    real = os.replace

    def replace(src, dst):  # at each rename, one of the two folders holds a complete checkpoint
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        real(src, dst)

    monkeypatch.setattr(storage.os, "replace", replace)
    storage.replace_folder(tmp, target)
    assert (target / "w").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
    assert len(seen) == 2  # the old folder aside, the new one into place
    assert all("step-00000004" in names or "step-00000004.old" in names for names in seen)
    (tmp_path / "step-00000002.old").mkdir()
    assert [p.name for p in checkpoint_folders(tmp_path)] == ["step-00000004"]


def test_a_manifest_with_malformed_entries_lists_as_damaged(run, capsys):
    """A manifest.json that is JSON but whose 'files' entries are not {path, size, sha256}: a DAMAGED row (and
    --resume's refusal), not a TypeError."""
    (run / "checkpoints" / "step-00000004" / MANIFEST).write_text(json.dumps({"files": ["model.bin"]}))
    assert cli_main(["checkpoints", str(run), "--quick"]) == 1
    assert "DAMAGED: manifest.json: not a checkpoint manifest (a 'files' entry without a path and a size" in \
        capsys.readouterr().out
