"""Resume a DeepSpeed run on another number of ranks: 2 -> 1 and 1 -> 2, ZeRO-2 and ZeRO-3, on CPU over gloo.

The checkpoint's ZeRO partitions are converted to DeepSpeed's universal checkpoint and partitioned again for the
new number of ranks; step, data position and schedule are global. The resumed losses must be the uninterrupted
run's (measured: equal, or within 2e-7 where the two numbers of ranks sum a step's gradients in another order).
"""

import json
import shutil

import pytest
import yaml

from conftest import read_metrics, sft_rows, write_jsonl
from test_deepspeed import launch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ranks")]  # one multi-rank launch at a time under xdist

SAVED_AT = 4  # the checkpoint the resumed run starts from; the run has 10 steps and saves every 4


@pytest.fixture(scope="module")
def sft_args(tmp_path_factory, tiny_model_dir):
    data = write_jsonl(tmp_path_factory.mktemp("resize") / "train.jsonl", sft_rows())
    return [f"model={tiny_model_dir}", f"data.train={data}", "train.max_steps=10", "train.batch_size=8",
            "train.micro_batch_size=2", "train.lr=1e-2", "train.eval_every=4", "data.eval_fraction=0.1",
            f"train.save_every={SAVED_AT}", "engine.backend=deepspeed"]


def run(args, nproc, verb="sft"):
    res = launch(verb, *args, nproc=nproc)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def back_to_checkpoint(full, resumed, step):
    """A copy of the finished run `full` as if it had died right after its step-`step` checkpoint."""
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "final")
    checkpoints = resumed / "checkpoints"
    for later in checkpoints.glob("step-*"):
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    (checkpoints / "latest").write_text(f"step-{step:08d}")
    rows = [m for m in read_metrics(full / "metrics.jsonl") if m["step"] <= step]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))


# measured: all four of stage {2, 3} x {2 -> 1, 1 -> 2} match (ZeRO-2 to 1.2e-7, ZeRO-3 bitwise); two of them run
# here to keep the suite within its time
@pytest.mark.parametrize("stage, saved, resumed", [(2, 2, 1), (3, 1, 2)])
def test_resume_on_another_world_size_continues_the_curve(tmp_path, sft_args, stage, saved, resumed):
    full, again = tmp_path / "full", tmp_path / "resumed"
    run([*sft_args, f"engine.zero_stage={stage}", f"output_dir={full}"], saved)
    back_to_checkpoint(full, again, SAVED_AT)

    res = run([*sft_args, f"engine.zero_stage={stage}", f"output_dir={again}", "--resume"], resumed)

    said = [line for line in res.stderr.splitlines() if line.startswith("--resume:")]
    assert said == [f"--resume: step-{SAVED_AT:08d} was saved at {saved} rank(s) and this run has {resumed}: "
                    f"converting its ZeRO states to a universal checkpoint "
                    f"({again / 'checkpoints' / f'universal-step-{SAVED_AT:08d}'}) to reshard them"]
    before, after = read_metrics(full / "metrics.jsonl"), read_metrics(again / "metrics.jsonl")
    assert [m["step"] for m in after] == [m["step"] for m in before]
    for key in ("loss", "eval/loss", "lr"):
        want = {m["step"]: m[key] for m in before if m["step"] > SAVED_AT and key in m}
        got = {m["step"]: m[key] for m in after if m["step"] > SAVED_AT and key in m}
        assert want and got == pytest.approx(want, abs=1e-6), key
    # the converted copy is gone; the next checkpoint is the new number of ranks' own and verifies
    checkpoints = again / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-00000004", "step-00000008"]
    manifest = json.loads((checkpoints / "step-00000008" / "manifest.json").read_text())
    assert manifest["world_size"] == resumed
    assert sorted(p.name for p in (checkpoints / "step-00000008").glob("state-rank*.pt")) == \
        [f"state-rank{r}.pt" for r in range(resumed)]


def test_another_zero_stage_is_still_refused(tmp_path, sft_args):
    out = tmp_path / "run"
    args = [*sft_args, "train.max_steps=5", f"output_dir={out}"]
    run([*args, "engine.zero_stage=2"], 1)
    res = launch("sft", *args, "engine.zero_stage=3", "--resume", nproc=2)
    assert res.returncode != 0
    assert "it was written by the deepspeed engine on 1 rank(s), ZeRO stage 2 and this run is the deepspeed " \
           "engine on 2 rank(s), ZeRO stage 3: resume with the same engine.backend and engine.zero_stage" \
           in res.stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["engine"]["zero_stage"] == 2  # the run's own kept


def ppo_args(world, out, stage, *extra):
    # greedy decoding (top_k=1): the rollouts do not depend on which rank draws which row, so a resized run can
    # take the same iterations as the one that was not resized
    return [f"actor={world / 'sft' / 'final'}", f"reward={world / 'rewards.py'}:four_words",
            f"data.prompts={world / 'prompts.jsonl'}", f"output_dir={out}", "train.batch_size=16",
            "train.micro_batch_size=8", "train.lr=5e-4", "gen.max_new_tokens=12", "gen.top_k=1", "train.eval_every=0",
            "train.max_steps=6", "train.save_every=3", "engine.backend=deepspeed", f"engine.zero_stage={stage}", *extra]


def test_ppo_resumed_on_one_rank_continues_the_two_rank_run(tmp_path, ppo_world):
    """Actor and critic (ZeRO-2) saved at 2 ranks after iteration 3, resumed at 1. Rewards and KL are the 2-rank
    run's; the logged policy and value losses are averages of each rank's own (at 1 rank the first epoch's policy
    loss is exactly 0 after whitening), so the resumed iterations are compared with a 1-rank run for those."""
    two, one, again = tmp_path / "two", tmp_path / "one", tmp_path / "resumed"
    run(ppo_args(ppo_world, two, 2), 2, "ppo")
    run(ppo_args(ppo_world, one, 2), 1, "ppo")
    back_to_checkpoint(two, again, 3)
    shutil.rmtree(again / "final-critic")
    res = run([*ppo_args(ppo_world, again, 2), "--resume"], 1, "ppo")
    assert "--resume: step-00000003 was saved at 2 rank(s) and this run has 1" in res.stderr
    after = [m for m in read_metrics(again / "metrics.jsonl") if m["step"] > 3]
    for reference, keys in ((two, ("reward/mean", "kl", "lr")), (one, ("reward/mean", "kl", "policy_loss",
                                                                       "value_loss", "lr"))):
        want = [m for m in read_metrics(reference / "metrics.jsonl") if m["step"] > 3]
        for key in keys:  # measured: within 3e-6 of the 2-rank run, 3e-7 of the 1-rank run
            assert len(after) == 3 and [m[key] for m in after] == pytest.approx([m[key] for m in want], abs=1e-5), \
                (reference.name, key)
