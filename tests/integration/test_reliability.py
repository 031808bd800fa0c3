"""Reliability: kill -9 and --resume, SIGTERM, a kill during a save, non-finite steps, unwritable checkpoints."""

import errno
import html
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlhfkit.config import SFTConfig, load_config
from rlhfkit.errors import RunError

from conftest import ROOT, read_metrics, run_cli, sft_rows, write_jsonl


def comparable(rows, after):
    """Metric rows after a step, without wall-clock timings."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows if r["step"] > after]


def tensorboard_steps(folder, tag):
    """The steps of `tag` as TensorBoard shows them (its reader drops a killed run's events past a restart)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def start(args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, "-m", "rlhfkit", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_step(proc, metrics, step, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}: {proc.stderr.read()[-2000:]}")
        if metrics.is_file():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
                     if line.strip().endswith("}")]
            if steps and max(steps) >= step:
                return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.fixture(scope="module")
def stage_args(tmp_path_factory, tiny_model_dir, ppo_world):
    root = tmp_path_factory.mktemp("rel")
    sft_data = write_jsonl(root / "sft.jsonl", sft_rows())
    pairs = [{"prompt": r["prompt"], "chosen": r["response"], "rejected": r["response"].split()[0]}
             for r in sft_rows()]
    rm_data = write_jsonl(root / "pairs.jsonl", pairs)
    common = ["train.save_every=2", "train.keep_checkpoints=2", "log.tensorboard=false"]
    return {
        "sft": [f"model={tiny_model_dir}", f"data.train={sft_data}", "train.max_steps=24", "train.batch_size=8",
                "train.lr=5e-3", "train.eval_every=6", *common],
        "rm": [f"model={tiny_model_dir}", f"data.train={rm_data}", "train.max_steps=24", "train.batch_size=8",
               "train.lr=5e-3", "train.eval_every=6", *common],
        "ppo": [f"actor={ppo_world / 'sft' / 'final'}", f"reward={ppo_world / 'rewards.py'}:four_words",
                f"data.prompts={ppo_world / 'prompts.jsonl'}", "train.max_steps=16", "train.batch_size=8",
                "train.micro_batch_size=4", "train.lr=5e-4", "gen.max_new_tokens=12", "train.eval_every=0",
                "ppo.adaptive_kl=true", "ema.enabled=true", *common],
    }


@pytest.mark.parametrize("stage", ["sft", "rm", "ppo"])
def test_kill_9_then_resume_reproduces_the_uninterrupted_run(tmp_path, stage_args, stage):
    args = stage_args[stage]
    ref = tmp_path / "ref"
    assert run_cli(stage, *args, f"output_dir={ref}").returncode == 0
    reference = read_metrics(ref / "metrics.jsonl")

    out = tmp_path / "killed"
    kill_at = random.Random(stage).randint(5, 12)
    args = [*args, "log.tensorboard=true"]
    proc = start([stage, *args, f"output_dir={out}"])
    wait_for_step(proc, out / "metrics.jsonl", kill_at)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()
    saved = int((out / "checkpoints" / "latest").read_text().split("-")[1])
    assert saved >= 2

    res = run_cli(stage, *args, f"output_dir={out}", "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]  # no step lost or logged twice
    # TensorBoard held the steps after the checkpoint twice (killed run, resumed run): it shows each once
    key = "loss" if stage != "ppo" else "reward/mean"
    assert tensorboard_steps(out / "tensorboard", f"{stage}/{key}") == [r["step"] for r in reference if key in r]
    got, want = comparable(resumed, saved), comparable(reference, saved)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, a["step"])
            else:
                assert a[key] == b[key], (key, a["step"])


def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(tmp_path, stage_args):
    args = [a for a in stage_args["sft"] if not a.startswith("train.save_every")] + ["train.save_every=0"]
    out = tmp_path / "run"
    proc = start(["sft", *args, f"output_dir={out}"])
    wait_for_step(proc, out / "metrics.jsonl", 4)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    message = err.strip().splitlines()[-1]
    assert message.startswith("rlhfkit sft: stopped by SIGTERM after step") and "--resume" in message  # said once
    stopped = int(message.split("after step ")[1].split(";")[0])
    assert (out / "checkpoints" / "latest").read_text() == f"step-{stopped:08d}"
    res = run_cli("sft", *args, f"output_dir={out}", "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1] == 24


def test_force_starts_over_and_resume_cannot_reach_the_replaced_run(tmp_path, stage_args):
    """--force removes the earlier run's checkpoints and events: a later --resume cannot continue the old run."""
    base = [a for a in stage_args["sft"] if not a.startswith(("train.max_steps", "log.tensorboard"))]
    out = tmp_path / "run"
    first = run_cli("sft", *base, "train.max_steps=6", "log.tensorboard=true", f"output_dir={out}")
    assert first.returncode == 0 and (out / "checkpoints" / "latest").read_text() == "step-00000004"

    refused = run_cli("sft", *base, "train.max_steps=6", f"output_dir={out}")
    assert refused.returncode == 2 and "already holds a finished run" in refused.stderr

    second = run_cli("sft", *base, "train.max_steps=3", "train.save_every=0", "log.tensorboard=true",
                     f"output_dir={out}", "--force")
    assert second.returncode == 0, second.stderr[-2000:]
    assert not (out / "checkpoints").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]  # 0: the first eval
    assert tensorboard_steps(out / "tensorboard", "sft/loss") == [1, 2, 3]
    resumed = run_cli("sft", *base, "train.max_steps=6", f"output_dir={out}", "--resume")
    assert resumed.returncode == 2 and "--resume: no checkpoint in" in resumed.stderr


def _config(tmp_path, stage_args, *extra):
    return load_config(SFTConfig, None, [*stage_args["sft"], f"output_dir={tmp_path / 'run'}", "log.progress=false",
                                         *extra])


def test_crash_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, stage_args, monkeypatch):
    import rlhfkit.engine.local as local
    from rlhfkit.stages import sft

    real_save = local.save_model
    calls = {"n": 0}

    def dies_on_third_save(model, filename, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # half a file, then the process "dies"
            open(filename, "wb").write(b"partial")
            raise SystemExit("killed during save")
        return real_save(model, filename, *a, **k)

    monkeypatch.setattr(local, "save_model", dies_on_third_save)
    with pytest.raises(SystemExit):
        sft.run_sft(_config(tmp_path, stage_args))
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step-00000004"
    monkeypatch.setattr(local, "save_model", real_save)
    res = run_cli("sft", *stage_args["sft"], f"output_dir={tmp_path / 'run'}", "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not list(ckpt.glob("*.tmp"))  # the half-written folder was cleaned up by a later save


def test_unwritable_checkpoint_fails_cleanly_and_keeps_the_previous_one(tmp_path, stage_args, monkeypatch):
    import rlhfkit.engine.local as local
    from rlhfkit.stages import sft

    real_save = local.save_model
    calls = {"n": 0}

    def disk_full_on_second_save(model, filename, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real_save(model, filename, *a, **k)

    monkeypatch.setattr(local, "save_model", disk_full_on_second_save)
    with pytest.raises(RunError, match=r"cannot write the checkpoint of step 4 .*No space left on device; the "
                                       r"previous checkpoint \(step-00000002\) is intact"):
        sft.run_sft(_config(tmp_path, stage_args))
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step-00000002"
    assert not (ckpt / "step-00000004").exists() and not (tmp_path / "run" / "final").exists()


def test_non_finite_loss_is_skipped_and_counted_then_stops_the_run(tmp_path, stage_args, monkeypatch):
    from rlhfkit.stages import sft

    real_forward = sft.lm_forward
    calls = {"n": 0}
    bad_calls = {3}  # the third training forward: step 3, with one micro-batch per step

    def poisoned(model, batch, device, *args, **kwargs):
        nll, n = real_forward(model, batch, device, *args, **kwargs)
        if not model.training:  # eval forwards are not counted
            return nll, n
        calls["n"] += 1
        if calls["n"] in bad_calls:
            nll = nll * float("nan")
        return nll, n

    monkeypatch.setattr(sft, "lm_forward", poisoned)
    # micro = batch: one training forward per step; eval forwards run with model.eval()
    cfg = _config(tmp_path, stage_args, "train.micro_batch_size=8", "train.eval_every=0", "train.save_every=0")
    sft.run_sft(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    skipped = [r["step"] for r in rows if r.get("skipped")]
    assert skipped == [3]
    # logged as null at step 3 (metrics.jsonl holds no NaN), finite everywhere else
    assert next(r for r in rows if r["step"] == 3)["loss"] is None
    others = [r["loss"] for r in rows if "loss" in r and r["step"] != 3]
    assert len(others) >= 2 and all(isinstance(v, float) and math.isfinite(v) for v in others)

    bad_calls.update(range(1, 100))  # every step from now on: five in a row stop the run
    calls["n"] = 0
    with pytest.raises(RunError, match="5 consecutive steps with a non-finite loss"):
        sft.run_sft(_config(tmp_path, stage_args, "train.micro_batch_size=8", "output_dir=" + str(tmp_path / "r2")))
    assert not (tmp_path / "r2" / "final").exists()


def test_a_resumed_run_goes_on_counting_the_non_finite_steps_in_a_row(tmp_path, stage_args, monkeypatch, capsys):
    """Three bad steps before a checkpoint and two after a resume are five in a row: the resumed run stops (the
    count was checkpointed, not restarted at 0)."""
    from rlhfkit.stages import sft

    real_forward = sft.lm_forward
    calls = {"n": 0, "bad": {2, 3, 4}, "crash_at": 5}

    class Killed(Exception):
        pass

    def poisoned(model, batch, device, *args, **kwargs):
        nll, n = real_forward(model, batch, device, *args, **kwargs)
        if not model.training:
            return nll, n
        calls["n"] += 1
        if calls["n"] == calls["crash_at"]:
            raise Killed  # the run dies during step 5, after step 4's checkpoint
        return (nll * float("nan") if calls["n"] in calls["bad"] else nll), n

    monkeypatch.setattr(sft, "lm_forward", poisoned)
    extra = ("train.micro_batch_size=8", "train.eval_every=0", "train.save_every=4")
    with pytest.raises(Killed):
        sft.run_sft(_config(tmp_path, stage_args, *extra))
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step-00000004"

    capsys.readouterr()
    calls.update(n=0, bad={1, 2}, crash_at=0)  # steps 5 and 6 bad: the fourth and fifth in a row
    with pytest.raises(RunError, match=r"5 consecutive steps with a non-finite loss or gradient \(last at step 6\)"):
        sft.run_sft(load_config(SFTConfig, None, [*stage_args["sft"], f"output_dir={tmp_path / 'run'}",
                                                  "log.progress=false", *extra]), resume=True)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if r.get("skipped")] == [2, 3, 4, 5]  # the stopping step raises unlogged
    assert "step 6: non-finite loss or gradient, update skipped (5 in a row, 5 in all)" in capsys.readouterr().err


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused_and_changes_nothing(tmp_path, stage_args):
    """A finished 8-step run (checkpoint at step 4) resumed with train.max_steps=3 would have exported the step-4
    weights over the finished ones and cut metrics.jsonl back: it is an error, and every file stays."""
    from rlhfkit.stages import sft

    extra = ("train.eval_every=0", "train.save_every=4", "train.max_steps=8")
    sft.run_sft(_config(tmp_path, stage_args, *extra))
    before = {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()}
    with pytest.raises(RunError, match=r"^--resume: the checkpoint in '.*' is at step 4, past this run's 3 steps"):
        sft.run_sft(_config(tmp_path, stage_args, *extra, "train.max_steps=3"), resume=True)
    assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == before


def test_skipped_step_leaves_weights_untouched(tiny_model_dir):
    from rlhfkit.config import TrainConfig
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.models import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    trainable = LocalEngine().prepare(model, TrainConfig(lr=1e-2), total_steps=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[1, 5, 6, 7]])
    good = model(input_ids=ids, labels=ids).loss
    trainable.backward(good, 1)
    trainable.backward(good * float("inf"), 1)
    stats = trainable.step()
    assert stats["skipped"] == 1.0 and trainable.lr == pytest.approx(1e-2)  # no update, no schedule step
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    trainable.backward(model(input_ids=ids, labels=ids).loss, 1)
    assert "skipped" not in trainable.step()  # the next good step updates normally


def test_sigint_and_sigterm_together_are_one_stop_request_a_later_second_signal_quits(tmp_path, monkeypatch):
    """DeepSpeed's launcher passes one Ctrl-C on to each rank as SIGINT and SIGTERM: the run must still save
    and stop (one request), while a second Ctrl-C some seconds later means 'out now'."""
    import rlhfkit.stages.guard as guard
    from rlhfkit.engine.local import LocalEngine

    clock = [100.0]
    monkeypatch.setattr(guard.time, "monotonic", lambda: clock[0])
    g = guard.RunGuard(LocalEngine(), tmp_path, "sft")
    try:
        g._on_signal(signal.SIGINT, None)
        clock[0] += 0.1
        g._on_signal(signal.SIGTERM, None)  # the launcher's second signal: no KeyboardInterrupt
        assert g.signum == signal.SIGINT and g.stop_requested()
        clock[0] += guard.REPEAT_SECONDS + 1
        with pytest.raises(KeyboardInterrupt):
            g._on_signal(signal.SIGINT, None)
    finally:
        g.close()


def test_ppo_resume_applies_changed_kl_and_ema_settings_and_drops_later_samples(tmp_path, stage_args):
    """A PPO run resumed with other settings uses them: a fixed KL coefficient that changed is the one in the
    reward (it was the checkpoint's), an EMA switched on at the resume averages from the resumed weights (it began
    at the initial actor's), and samples.jsonl holds each sampled step once."""
    from safetensors.torch import load_file

    base = [a for a in stage_args["ppo"] if not a.startswith(("train.max_steps", "ppo.adaptive_kl", "ema.enabled"))]
    out = tmp_path / "run"
    args = [*base, "train.max_steps=4", "ppo.kl_coef=0.05", "ppo.sample_every=1", "ppo.num_samples=2",
            f"output_dir={out}"]
    assert run_cli("ppo", *args).returncode == 0
    full = read_metrics(out / "metrics.jsonl")
    for name in ("final", "final-critic"):  # as if the run died after its step-2 checkpoint
        shutil.rmtree(out / name)
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in full if m["step"] <= 2))
    checkpoint = load_file(str(out / "checkpoints" / "step-00000002" / "actor.safetensors"))
    res = run_cli("ppo", *args, "ppo.kl_coef=0.2", "ema.enabled=true", "ema.beta=0.999999", "--resume",
                  env={"RLHFKIT_NO_REPORT": "0"})  # as a user runs it: the report at the end
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ppo.kl_coef: 0.05 -> 0.2" in res.stderr
    # the coefficient that add_rewards weighs the KL with
    coefs = {r["step"]: r["kl_coef"] for r in read_metrics(out / "metrics.jsonl") if "kl_coef" in r}
    assert coefs == {1: 0.05, 2: 0.05, 3: 0.2, 4: 0.2}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2, 3, 3, 4, 4]
    report = (out / "report.html").read_text()  # written by the run: its curves and the samples with their reward
    assert (out / "plots").is_dir() and "Responses sampled during training" in report
    assert html.escape(samples[-1]["response"]) in report
    ema = load_file(str(out / "final-ema" / "model.safetensors"))
    initial = load_file(str(stage_args["ppo"][0].split("=", 1)[1] + "/model.safetensors"))
    moved = max((checkpoint[k] - initial[k]).abs().max().item() for k in checkpoint if k in initial)
    assert moved > 1e-4
    for k in checkpoint:
        if k in ema:
            torch.testing.assert_close(ema[k], checkpoint[k], atol=moved * 1e-3, rtol=0)


def test_a_stop_at_a_save_step_writes_that_checkpoint_once(tmp_path, monkeypatch):
    """A signal that lands on a train.save_every step: the step's checkpoint is written once, then the run stops
    (writing it again rewrote the folder `latest` names, doubling the time left in a preemption's grace period);
    at another step the stop writes the checkpoint itself."""
    from rlhfkit.config.schema import TrainConfig
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.errors import RunStopped
    from rlhfkit.stages.loop import TrainLoop

    class Log:  # the loop's logger, for the lines it writes
        def log(self, *a, **kw):
            pass

        def advance(self):
            pass

    engine, saves = LocalEngine(), []
    monkeypatch.setattr(engine, "save_checkpoint", lambda folder, step, *a: saves.append(step))
    for step, expected in ((2, [2]), (3, [3])):
        saves.clear()
        with TrainLoop(engine, tmp_path, "sft", 10, TrainConfig(save_every=2), Log(), {}) as loop:
            loop.guard._on_signal(signal.SIGTERM, None)
            with pytest.raises(RunStopped, match=f"stopped by SIGTERM after step {step}"):
                loop.end_step(step, {})
        assert saves == expected


def test_resume_refuses_another_stages_checkpoints(tmp_path, stage_args, capsys):
    """`rlhfkit dpo --resume` in an SFT run's folder (same model, its data read as pairs): refused before anything
    is loaded into training or written, naming the stage that wrote the checkpoints; the SFT run's files are
    untouched (its metrics after the checkpoint were dropped before)."""
    from rlhfkit.cli import main as cli_main

    out = tmp_path / "sft"
    pairs = next(a for a in stage_args["rm"] if a.startswith("data.train="))  # SFT reads them as prompt + chosen
    sft = [a for a in stage_args["sft"] if not a.startswith(("train.max_steps", "train.eval_every", "data.train"))]
    assert cli_main(["sft", *sft, pairs, "train.max_steps=3", "train.eval_every=0", f"output_dir={out}"]) == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    model = next(a for a in stage_args["sft"] if a.startswith("model="))
    code = cli_main(["dpo", model, pairs, "train.batch_size=8", "train.max_steps=3", "log.tensorboard=false",
                     f"output_dir={out}", "--resume"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"rlhfkit dpo: error: --resume: the checkpoints in '{out / 'checkpoints'}' were written by `rlhfkit sft`, "
        f"not `rlhfkit dpo`; resume that run with `rlhfkit sft`, or pass --force to start a new dpo run there")
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


def test_resume_on_changed_data_says_so(tmp_path, tiny_model_dir, capsys):
    """The data file rewritten between the kill and the resume (same path, other rows): the resumed run says that
    its rows now come in another order than the killed run's; on the same data it says nothing of the kind."""
    from rlhfkit.cli import main as cli_main

    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    args = [f"model={tiny_model_dir}", f"data.train={data}", f"output_dir={tmp_path / 'out'}", "train.batch_size=8",
            "train.save_every=1", "train.eval_every=0", "data.eval_fraction=0", "log.tensorboard=false"]
    assert cli_main(["sft", *args, "train.max_steps=2"]) == 0
    assert cli_main(["sft", *args, "train.max_steps=3", "--resume"]) == 0
    assert "rows come in another order" not in capsys.readouterr().err
    write_jsonl(data, sft_rows()[:60])
    assert cli_main(["sft", *args, "train.max_steps=4", "--resume"]) == 0
    assert ("resume: the training data has 60 rows, the checkpointed run's had 80: from here on the rows come in "
            "another order than that run's") in capsys.readouterr().err
    # as many rows, one of them edited
    rows = sft_rows()[:60]
    rows[7] = {**rows[7], "response": rows[7]["response"] + " again"}
    write_jsonl(data, rows)
    assert cli_main(["sft", *args, "train.max_steps=5", "--resume"]) == 0
    assert ("resume: the training data's 60 rows are not the checkpointed run's (as many, other contents): from "
            "here on the steps see other rows than that run's") in capsys.readouterr().err
