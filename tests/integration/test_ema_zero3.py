"""The actor's EMA under ZeRO-3, where each rank holds a partition of every parameter: the averaged policy it
exports is the one ZeRO-2 (whole parameters on every rank) exports for the same run."""

import pytest
from safetensors.torch import load_file
from test_deepspeed import launch

pytestmark = pytest.mark.xdist_group("ranks")  # one multi-rank launch at a time under xdist


def ppo_with_ema(out, ppo_world, stage):
    res = launch("ppo", f"actor={ppo_world / 'sft' / 'final'}", f"reward={ppo_world / 'rewards.py'}:four_words",
                 f"data.prompts={ppo_world / 'prompts.jsonl'}", f"output_dir={out}", "train.batch_size=16",
                 "train.micro_batch_size=8", "train.lr=5e-4", "gen.max_new_tokens=12", "train.eval_every=0",
                 "train.max_steps=3", "ema.enabled=true", "ema.beta=0.5", "log.tensorboard=false",
                 "engine.backend=deepspeed", f"engine.zero_stage={stage}", "engine.critic_zero_stage=2")
    assert res.returncode == 0, res.stderr[-3000:]
    return load_file(out / "final-ema" / "model.safetensors"), load_file(out / "final" / "model.safetensors")


def test_ema_under_zero3_exports_what_zero2_exports(tmp_path, ppo_world):
    ema3, final3 = ppo_with_ema(tmp_path / "zero3", ppo_world, 3)
    ema2, final2 = ppo_with_ema(tmp_path / "zero2", ppo_world, 2)
    start = load_file(ppo_world / "sft" / "final" / "model.safetensors")
    assert set(ema3) == set(ema2) == set(final3)
    # the same average, partitioned or not: ZeRO-3's gathered and reduce-scattered arithmetic rounds otherwise than
    # ZeRO-2's, which three Adam steps of ~5e-4 carry to ~1e-5 (1.01e-5 on an Intel host): within 6% of one step
    for name in ema2:
        assert ema3[name].shape == ema2[name].shape
        assert (ema3[name] - ema2[name]).abs().max() <= 3e-5, name
        assert (final3[name] - final2[name]).abs().max() <= 3e-5, name
    # an average of the start and the steps' weights: neither the last iterate nor the start
    moved = [n for n in ema2 if (final2[n] - start[n]).abs().max() > 1e-4]
    assert moved and all((ema3[n] - final3[n]).abs().max() > 1e-6 for n in moved)
    assert all((ema3[n] - start[n]).abs().max() > 1e-6 for n in moved)
