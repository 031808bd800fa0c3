"""The output folder's rules: a fresh run clears an earlier run's outputs; --resume refuses another run's checkpoints."""

from pathlib import Path

import pytest
import yaml

from rlhfkit.config import SFTConfig, load_config
from rlhfkit.config.fields import to_dict
from rlhfkit.errors import RunError
from rlhfkit.stages.run_dir import changed_settings, prepare_output_dir, resumed_from


def config(out: Path, *extra: str):
    return load_config(SFTConfig, None, ["model=some/model", "data.train=data/sft.jsonl", f"output_dir={out}", *extra])


def old_run(out: Path, finished: bool, *extra: str) -> None:
    """The files an earlier run leaves: checkpoints, events, samples, metrics, a critic; its config.yaml."""
    for folder in ("checkpoints/step-00000020", "tensorboard", "final-critic", "plots") + (("final",) if finished else ()):
        (out / folder).mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-00000020")
    (out / "tensorboard" / "events.out.tfevents.1").write_bytes(b"old")
    for name in ("metrics.jsonl", "samples.jsonl", "result.json", "report.html"):
        (out / name).write_text("old")
    (out / "log.txt").write_text("old log\n")
    (out / "notes.md").write_text("the user's own file")
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(config(out, *extra))))


@pytest.mark.parametrize("finished", [True, False])
def test_force_clears_every_output_of_the_earlier_run_and_nothing_else(tmp_path, finished):
    out = tmp_path / "run"
    old_run(out, finished)
    prepare_output_dir(config(out, "train.lr=2e-5"), resume=False, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "log.txt", "notes.md"]
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == 2e-5
    # so --resume now finds nothing of the old run to continue
    with pytest.raises(RunError, match="no checkpoint"):
        prepare_output_dir(config(out), resume=True, force=False)


def test_a_fresh_run_into_an_unfinished_run_is_refused_without_force(tmp_path):
    out = tmp_path / "run"
    old_run(out, finished=False)
    with pytest.raises(RunError) as err:
        prepare_output_dir(config(out), resume=False, force=False)
    assert str(err.value) == (f"output_dir '{out}' holds an unfinished run (checkpoint step-00000020): pass --resume "
                              f"to continue it, --force to start over, or choose another output_dir")
    assert (out / "checkpoints" / "latest").is_file() and (out / "metrics.jsonl").read_text() == "old"


def test_a_fresh_run_into_an_empty_or_new_folder_needs_no_flag(tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "run"):
        prepare_output_dir(config(out), resume=False, force=False)
        assert (out / "config.yaml").is_file()


@pytest.mark.parametrize("key,value", [("model", "other/model"), ("data.train", "data/other.jsonl"),
                                       ("lora.rank", "8"), ("lora.alpha", "128"),
                                       ("data.fields", "{response: answer}")])
def test_resume_refuses_checkpoints_of_another_model_or_data(tmp_path, key, value):
    out = tmp_path / "run"
    old_run(out, finished=False)
    with pytest.raises(RunError) as err:
        prepare_output_dir(config(out, f"{key}={value}"), resume=True, force=False)
    before = (out / "config.yaml").read_bytes()
    message = str(err.value)
    assert message.startswith(f"--resume: the checkpoints in '{out / 'checkpoints'}' belong to a run with another "
                              f"model or data ({key}: ")
    assert message.endswith(f"resume with the settings in '{out / 'config.yaml'}', or pass --force to start a new "
                            f"run there")
    assert (out / "config.yaml").read_bytes() == before  # the old config kept


def test_resume_lists_other_changed_settings_and_uses_them(tmp_path, capsys):
    out = tmp_path / "run"
    old_run(out, finished=False)
    cfg = config(out, "train.lr=3e-5", "train.max_steps=50", "log.progress=false")
    prepare_output_dir(cfg, resume=True, force=False)
    err = capsys.readouterr().err
    assert err.strip() == ("resume: settings changed since the checkpointed run, the new ones are used: "
                           "train.lr: 1e-05 -> 3e-05")  # max_steps and log.* are routine, not listed
    # config.yaml changes only once the checkpoint loaded: a resume that fails there leaves the run's own
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == 1e-5
    assert resumed_from(cfg, out, 20, is_main=True) == 20
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == 3e-5
    assert (out / "metrics.jsonl").read_text() == "old"  # resume keeps what the run wrote


def test_the_same_file_written_another_way_is_the_same_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sft.jsonl").write_text("{}\n")
    old = to_dict(config(Path("run")))
    new = to_dict(load_config(SFTConfig, None, ["model=some/model", f"data.train={tmp_path / 'data' / 'sft.jsonl'}",
                                                "output_dir=run"]))
    assert changed_settings(old, new) == []
    new["data"]["train"] = "./data/other.jsonl"
    assert changed_settings(old, new) == [("data.train", "data/sft.jsonl", "./data/other.jsonl")]


def test_resume_refuses_to_add_or_drop_the_critic(tmp_path, capsys):
    """A critic-free run's checkpoints hold no critic (and a GAE run's one nothing would load): switching the
    estimator between the two kinds is another run; between critic-free estimators it is a listed change."""
    from rlhfkit.config.ppo_schema import PPOConfig

    def ppo(estimator: str):
        return load_config(PPOConfig, None, ["actor=some/model", "reward=r.py:f", "data.prompts=p.jsonl",
                                             f"output_dir={out}", "ppo.n_samples_per_prompt=2",
                                             f"ppo.advantage_estimator={estimator}", "ppo.kl_coef=0",
                                             "train.max_steps=4"])

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-00000002")
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(ppo("grpo"))))
    with pytest.raises(RunError) as err:
        prepare_output_dir(ppo("gae"), resume=True, force=False)
    assert str(err.value) == (f"--resume: the checkpoints in '{out / 'checkpoints'}' belong to a run without a critic "
                              f"(ppo.advantage_estimator: 'grpo' -> 'gae'); resume with 'grpo', or pass --force to "
                              f"start a new run there")
    prepare_output_dir(ppo("rloo"), resume=True, force=False)
    assert "ppo.advantage_estimator: 'grpo' -> 'rloo'" in capsys.readouterr().err
