"""`rlhfkit pipeline` on tiny models: one dataset split 2:4:4, outputs chained, complete steps skipped, --force."""

import json

import yaml

from conftest import NAMES, read_metrics, run_cli, write_jsonl


def preference_rows() -> list[dict]:
    """The echo world as pairs: the right answer to "say X" beats another name's."""
    return [{"prompt": f"say {n}", "chosen": f"{n} {n} {n}", "rejected": f"{NAMES[(i + k) % len(NAMES)]}"}
            for k in range(1, 4) for i, n in enumerate(NAMES)] * 2  # 120 rows


def write_config(tmp_path, tiny_model_dir, **extra) -> tuple:
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows())
    out = tmp_path / "run"
    cfg = {
        "model": str(tiny_model_dir), "output_dir": str(out), "dataset": str(data), "data_split": [2, 4, 4],
        "train": {"batch_size": 8, "micro_batch_size": 8, "lr": 5.0e-3, "save_every": 0, "eval_every": 0},
        "log": {"tensorboard": False, "progress": False},
        "sft": {"train": {"max_steps": 3}},
        "rm": {"train": {"max_steps": 3}, "rm": {"norm_samples": 16}},
        "ppo": {"train": {"max_steps": 2, "batch_size": 4, "micro_batch_size": 4},
                "gen": {"max_new_tokens": 6}, "data": {"eval_max_rows": 4}},
        **extra,
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, out


def test_pipeline_chains_splits_logs_and_summarises(tmp_path, tiny_model_dir):
    path, out = write_config(tmp_path, tiny_model_dir)
    res = run_cli("pipeline", "--config", str(path), "rm.train.lr=1e-3")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["sft"] == result["rm"] == result["ppo"] == "ran"

    # one dataset cut 2:4:4: each step reads its own share (the loader's data.split_fractions / split_index)
    results = {s: json.loads((out / s / "result.json").read_text()) for s in ("sft", "rm", "ppo")}
    assert {s: r["rows_read"] for s, r in results.items()} == {"sft": 24, "rm": 48, "ppo": 48}

    # outputs chained: SFT final -> RM start and PPO actor (reference by default); RM final -> PPO reward
    sft_cfg, rm_cfg, ppo_cfg = (yaml.safe_load((out / s / "config.yaml").read_text()) for s in ("sft", "rm", "ppo"))
    assert sft_cfg["model"] == str(tiny_model_dir) and rm_cfg["model"] == str(out / "sft" / "final")
    assert ppo_cfg["actor"] == str(out / "sft" / "final") and ppo_cfg["reward"] == str(out / "rm" / "final")
    data = str(tmp_path / "pairs.jsonl")
    assert [(c["data"]["split_fractions"], c["data"]["split_index"]) for c in (sft_cfg, rm_cfg, ppo_cfg)] == \
        [([2, 4, 4], 0), ([2, 4, 4], 1), ([2, 4, 4], 2)]
    assert sft_cfg["data"]["train"] == rm_cfg["data"]["train"] == ppo_cfg["data"]["prompts"] == data
    # shared keys reach every step, a section's own keys and the command line win
    assert sft_cfg["train"]["lr"] == ppo_cfg["train"]["lr"] == 5.0e-3 and rm_cfg["train"]["lr"] == 1e-3
    assert ppo_cfg["train"]["batch_size"] == 4 and sft_cfg["train"]["batch_size"] == 8
    assert "critic: " + str(out / "rm" / "final") in (out / "ppo" / "log.txt").read_text()  # PPO's default critic

    # each step logs into its own folder; the summary is written in the report's format and printed
    for step, stage in (("sft", "sft"), ("rm", "rm"), ("ppo", "ppo")):
        assert (out / step / "final").is_dir() and (out / step / "log.txt").stat().st_size > 0
        assert {m["stage"] for m in read_metrics(out / step / "metrics.jsonl")} == {stage}
        assert results[step]["output_dir"] == str(out / step)
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["rows"][:3]] == ["sft: ran", "rm: ran", "ppo: ran"]
    assert "rm eval/accuracy (first -> last)" in res.stdout and (out / "ppo" / "final-critic").is_dir()
    assert run_cli("report", str(out)).returncode == 0 and (out / "report.html").is_file()


def test_complete_steps_are_skipped_and_force_reruns(tmp_path, tiny_model_dir):
    path, out = write_config(tmp_path, tiny_model_dir, steps=["sft", "rm"])
    assert run_cli("pipeline", "--config", str(path)).returncode == 0
    stamp = (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns

    again = run_cli("pipeline", "--config", str(path))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["sft"] == "skipped (complete)"
    assert "sft: " in again.stderr and "exists, skipped" in again.stderr
    assert (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns == stamp
    row = json.loads((out / "summary.json").read_text())["rows"][0]
    assert row["name"] == "sft: skipped (complete)"  # with the seconds it took when it ran, not 0
    assert row["value"] == json.loads((out / "sft" / "result.json").read_text())["seconds"] > 0

    # a finished step made with other settings is not skipped silently (nor are the steps built on it)
    changed = run_cli("pipeline", "--config", str(path), "sft.train.lr=1e-3")
    assert changed.returncode == 2
    assert changed.stderr.strip().splitlines()[-1] == (
        f"rlhfkit pipeline: error: pipeline: sft: '{out / 'sft'}' holds a finished run made with other settings "
        f"(train.lr: 0.005 -> 0.001); pass --rerun sft to rerun it (and the steps built on it) with these, or put "
        f"back the settings of '{out / 'sft' / 'config.yaml'}'")
    assert (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns == stamp

    # a step a killed run left unfinished (a checkpoint, no final/) is neither restarted nor resumed unasked
    (out / "rm" / "final").rename(out / "rm" / "final-old")
    (out / "rm" / "checkpoints").mkdir()
    (out / "rm" / "checkpoints" / "latest").write_text("step-00000002")
    unfinished = run_cli("pipeline", "--config", str(path))
    assert unfinished.returncode == 2
    assert unfinished.stderr.strip().splitlines()[-1].endswith(
        f"pipeline: rm: '{out / 'rm'}' holds an unfinished run (checkpoint step-00000002): pass --resume to "
        f"continue it, or --rerun rm to start it over")
    assert (out / "rm" / "checkpoints" / "latest").is_file()

    # --rerun rm starts rm over and keeps sft; --rerun sft reruns sft and rm, which is built on sft's final/
    rm_only = run_cli("pipeline", "--config", str(path), "--rerun", "rm")
    assert rm_only.returncode == 0, rm_only.stderr[-2000:]
    assert json.loads(rm_only.stdout.strip().splitlines()[-1]) == {
        "output_dir": str(out), "sft": "skipped (complete)", "rm": "ran",
        "final": {"sft": str(out / "sft" / "final"), "rm": str(out / "rm" / "final")}}
    assert (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns == stamp
    latest = out / "rm" / "checkpoints" / "latest"  # started over: the killed run's checkpoints were removed
    assert (out / "rm" / "final").is_dir() and (not latest.is_file() or latest.read_text() != "step-00000002")
    rm_stamp = (out / "rm" / "final" / "model.safetensors").stat().st_mtime_ns
    # a complete step's data may be gone since it ran: only the steps that will run have theirs checked
    skipped = run_cli("pipeline", "--config", str(path), f"sft.data.train={tmp_path / 'gone.jsonl'}",
                      "sft.data.split_fractions=[2, 4, 4]")
    assert skipped.returncode == 2 and "other settings (data.train:" in skipped.stderr  # not "no such file"
    both = run_cli("pipeline", "--config", str(path), "--rerun", "sft", "sft.train.lr=1e-3")
    assert both.returncode == 0, both.stderr[-2000:]
    result = json.loads(both.stdout.strip().splitlines()[-1])
    assert (result["sft"], result["rm"]) == ("ran", "ran")
    assert "pipeline: rm: built on sft, which ran again: its earlier run is replaced" in both.stderr
    assert (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns != stamp
    assert (out / "rm" / "final" / "model.safetensors").stat().st_mtime_ns != rm_stamp
    bad = run_cli("pipeline", "--config", str(path), "--rerun", "ppo")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "rlhfkit pipeline: error: --rerun: 'ppo' is not one of the pipeline's steps ['sft', 'rm']")
    stamp = (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns

    forced = run_cli("pipeline", "--config", str(path), "steps=[sft]", "--force", "sft.train.lr=1e-3")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout.strip().splitlines()[-1])["sft"] == "ran"
    assert (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns != stamp


def test_a_wrong_key_in_a_later_section_fails_before_anything_runs(tmp_path, tiny_model_dir):
    path, out = write_config(tmp_path, tiny_model_dir)
    res = run_cli("pipeline", "--config", str(path), "ppo.ppo.kl_coeff=0.1")
    assert res.returncode == 2 and "ppo.ppo.kl_coeff" in res.stderr
    assert not (out / "sft").exists()
    res = run_cli("pipeline", "--config", str(path), "data_split=[1, 1]")
    assert res.returncode == 2 and "data_split" in res.stderr
    # ppo's reward chained from an rm step that steps leave out: said before SFT trains
    res = run_cli("pipeline", "--config", str(path), "steps=[sft, ppo]")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        f"rlhfkit pipeline: error: config key 'ppo.reward': '{out / 'rm' / 'final'}' is the rm step's output, but "
        f"steps ['sft', 'ppo'] run no rm before ppo and it does not exist: add rm to steps, or set ppo.reward")
    assert not (out / "sft").exists()
    # a later step's data that cannot be read: said before SFT trains
    res = run_cli("pipeline", "--config", str(path), f"ppo.data.prompts={tmp_path / 'nofile.jsonl'}")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        f"rlhfkit pipeline: error: pipeline: ppo: data.prompts: {tmp_path / 'nofile.jsonl'}: no such file or folder")
    assert not (out / "sft").exists()
    # bad rows in the first step's data: the step's folder (its log so far) is not left behind
    (tmp_path / "bad.jsonl").write_text('{"prompt": "say apple", "response": }\n')
    res = run_cli("pipeline", "--config", str(path), f"sft.data.train={tmp_path / 'bad.jsonl'}")
    assert res.returncode == 2 and f"{tmp_path / 'bad.jsonl'}:1: invalid JSON" in res.stderr.strip().splitlines()[-1]
    assert not (out / "sft").exists()


def test_pipeline_sft_then_grpo_with_a_python_reward_and_no_rm_step(tmp_path, tiny_model_dir):
    (tmp_path / "rewards.py").write_text("def three(prompts, responses):\n"
                                        "    return [1 - abs(len(r.split()) - 3) / 3 for r in responses]\n")
    path, out = write_config(tmp_path, tiny_model_dir, steps=["sft", "ppo"])
    res = run_cli("pipeline", "--config", str(path), f"ppo.reward={tmp_path / 'rewards.py'}:three",
                  "ppo.ppo.advantage_estimator=grpo", "ppo.ppo.n_samples_per_prompt=2", "ppo.ppo.kl_coef=0")
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["sft"] == result["ppo"] == "ran" and "rm" not in result
    log = (out / "ppo" / "log.txt").read_text()
    assert "no critic (grpo: 2 samples per prompt)" in log and not (out / "ppo" / "final-critic").exists()
    assert not (out / "rm").exists()


def test_pipeline_sft_then_dpo_chains_the_sft_output_and_reads_the_preference_share(tmp_path, tiny_model_dir):
    path, out = write_config(tmp_path, tiny_model_dir, steps=["sft", "dpo"],
                             dpo={"train": {"max_steps": 3}, "dpo": {"beta": 0.2}})
    res = run_cli("pipeline", "--config", str(path))
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["sft"] == result["dpo"] == "ran" and "rm" not in result and "ppo" not in result
    dpo_cfg = yaml.safe_load((out / "dpo" / "config.yaml").read_text())
    assert dpo_cfg["model"] == str(out / "sft" / "final") and dpo_cfg["dpo"]["beta"] == 0.2
    # DPO trains on pairs: it reads the RM's share of data_split (DeepSpeed-Chat's phase 2)
    assert (dpo_cfg["data"]["split_fractions"], dpo_cfg["data"]["split_index"]) == ([2, 4, 4], 1)
    assert json.loads((out / "dpo" / "result.json").read_text())["rows_read"] == 48
    assert "the policy before its first step" in (out / "dpo" / "log.txt").read_text()
    assert {m["stage"] for m in read_metrics(out / "dpo" / "metrics.jsonl")} == {"dpo"}
    assert (out / "dpo" / "final" / "model.safetensors").is_file()
    assert "dpo eval/accuracy (first -> last)" in res.stdout


def test_a_stopped_pipeline_says_its_own_command_to_resume_and_that_command_finishes(tmp_path, tiny_model_dir):
    import signal

    from test_reliability import start, wait_for_step

    path, out = write_config(tmp_path, tiny_model_dir, steps=["sft", "rm"], sft={"train": {"max_steps": 150}})
    proc = start(["pipeline", "--config", str(path)])
    wait_for_step(proc, out / "sft" / "metrics.jsonl", 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("rlhfkit pipeline: sft: stopped by SIGINT after step ") and "Traceback" not in err
    assert line.endswith(f"; checkpoint saved in '{out / 'sft' / 'checkpoints'}'. Resume with: rlhfkit pipeline "
                         f"--config {path} --resume")
    again = run_cli(*line.split("Resume with: rlhfkit ")[1].split())
    assert again.returncode == 0, again.stderr[-2000:]
    result = json.loads(again.stdout.strip().splitlines()[-1])
    assert result["sft"] == result["rm"] == "ran"  # sft resumed from its checkpoint, then rm
    assert [m["step"] for m in read_metrics(out / "sft" / "metrics.jsonl") if "loss" in m][-1] == 150
