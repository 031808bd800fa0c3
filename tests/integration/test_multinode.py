"""Two "nodes" on this machine and the faults of a scaled-out run, on 2 CPU ranks over gloo.

A node is one `torchrun --nnodes 2 --node_rank R --nproc_per_node 1` invocation, rendezvous on 127.0.0.1: the
launch a real multi-node run makes, with a process per node. Two nodes give the losses pinned for one node with
two ranks; a rank killed with `kill -9` or hung (SIGSTOP) makes the other exit within the collective timeout
with one clear error line, its last checkpoint verifies by its manifest and `--resume` continues the curve; a
SIGTERM to the launcher reaches both ranks, which save one checkpoint together and stop.
"""

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from rlhfkit.cli import main as cli_main

from conftest import ROOT, check_pinned, read_metrics, series_of, sft_rows, write_jsonl
from test_deepspeed import _pairs

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ranks")]  # one multi-rank launch at a time under xdist

ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(args, logs, port=None, node_args=((), ())) -> list[subprocess.Popen]:
    """Two single-rank "nodes" of one run, each its own torchrun; their output goes to logs[0], logs[1]."""
    port = port or free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "rlhfkit", *args, *node_args[node]]
        procs.append(subprocess.Popen(cmd, env=ENV, stdout=open(logs[node], "w"), stderr=subprocess.STDOUT))
    return procs


def run_nodes(args, tmp_path, name="nodes", timeout=600, code=0, node_args=((), ())) -> list[str]:
    """Run both nodes to the end (`node_args`: extra arguments of each); each must exit with `code`."""
    logs = [tmp_path / f"{name}{node}.log" for node in (0, 1)]
    port = free_port()
    procs = start_nodes(args, logs, port, node_args)
    for proc in procs:
        proc.wait(timeout=timeout)
    texts = [log.read_text() for log in logs]
    for proc, text in zip(procs, texts):
        assert proc.returncode == code, text[-3000:]
    return texts


def worker_of(launcher: subprocess.Popen) -> psutil.Process:
    """The rank a launcher started (its python child running rlhfkit)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        ranks = [c for c in psutil.Process(launcher.pid).children() if "rlhfkit" in " ".join(c.cmdline())]
        if ranks:
            return ranks[0]
        time.sleep(0.05)
    raise AssertionError("no rank process under the launcher")


def wait_for_step(metrics, step, procs, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a node ended before step {step}")
        if metrics.is_file():
            done = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]
            if done and max(done) >= step:
                return
        time.sleep(0.01)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rlhfkit sft: error:")]


def checkpoints_tool(*args) -> tuple[int, str]:
    """`rlhfkit checkpoints ARGS` (in this process): its exit code and output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli_main(["checkpoints", *map(str, args)])
    return code, out.getvalue()


# -- two nodes give the losses of one node with two ranks -------------------------------------------------------
def sft_zero3(tmp_path, ppo_world, tiny_model_dir):
    """The pinned zero3/sft run of test_deepspeed.py (its sft_args, on ZeRO-3)."""
    data = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    return ["sft", f"model={tiny_model_dir}", f"data.train={data}", "train.max_steps=12", "train.batch_size=8",
            "train.micro_batch_size=2", "train.lr=1e-2", "train.eval_every=6", "data.eval_fraction=0.1",
            f"output_dir={tmp_path / 'run'}", "engine.backend=deepspeed", "engine.zero_stage=3"], ("loss", "eval/loss")


def rm_zero2(tmp_path, ppo_world, tiny_model_dir):
    """The pinned zero2/rm run of test_deepspeed.py."""
    return ["rm", f"model={ppo_world / 'sft' / 'final'}", f"data.train={_pairs(tmp_path / 'pairs.jsonl')}",
            f"output_dir={tmp_path / 'run'}", "train.batch_size=16", "train.micro_batch_size=4", "train.lr=5e-3",
            "train.max_steps=6", "train.eval_every=3", "data.eval_fraction=0.2", "rm.norm_samples=16",
            "engine.backend=deepspeed", "engine.zero_stage=2"], ("loss", "eval/loss", "accuracy")


def ppo_zero3(tmp_path, ppo_world, tiny_model_dir):
    """The pinned zero3/ppo run of test_deepspeed.py."""
    return ["ppo", f"actor={ppo_world / 'sft' / 'final'}", f"reward={ppo_world / 'rewards.py'}:four_words",
            f"data.prompts={ppo_world / 'prompts.jsonl'}", f"data.eval_prompts={ppo_world / 'eval.jsonl'}",
            f"output_dir={tmp_path / 'run'}", "train.batch_size=16", "train.micro_batch_size=8", "train.lr=5e-4",
            "gen.max_new_tokens=20", "train.eval_every=0", "train.max_steps=20", "engine.backend=deepspeed",
            "engine.zero_stage=3", "engine.critic_zero_stage=2"], ("reward/mean", "kl", "policy_loss", "value_loss")


# every stage once and both ZeRO stages: the nodes differ from one node's ranks only in the rendezvous
@pytest.mark.parametrize("pin, make_args", [("zero3/sft", sft_zero3), ("zero2/rm", rm_zero2),
                                            ("zero3/ppo", ppo_zero3)])
def test_two_nodes_give_the_losses_of_one_node_with_two_ranks(tmp_path, ppo_world, tiny_model_dir, pin, make_args):
    args, keys = make_args(tmp_path, ppo_world, tiny_model_dir)
    run_nodes(args, tmp_path)
    out = tmp_path / "run"
    check_pinned(pin, series_of(read_metrics(out / "metrics.jsonl"), *keys))
    assert (out / "final" / "model.safetensors").is_file()


# -- a dead rank, a hung rank ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory, tiny_model_dir):
    """40 SFT steps (long enough to be interrupted), and the same run on one process to compare with."""
    from rlhfkit.config import SFTConfig, load_config
    from rlhfkit.stages.sft import run_sft

    root = tmp_path_factory.mktemp("faults")
    args = [f"model={tiny_model_dir}", f"data.train={write_jsonl(root / 'train.jsonl', sft_rows())}",
            "train.max_steps=40", "train.batch_size=8", "train.micro_batch_size=2", "train.lr=1e-2",
            "train.eval_every=10", "data.eval_fraction=0.1", "train.save_every=2", "train.keep_checkpoints=2",
            "log.tensorboard=false"]
    run_sft(load_config(SFTConfig, None, [*args, f"output_dir={root / 'local'}", "log.progress=false"]))
    return args, read_metrics(root / "local" / "metrics.jsonl")


def test_a_killed_rank_ends_the_other_with_a_clear_error_and_resume_continues(tmp_path, sft_setup):
    base, reference = sft_setup
    out = tmp_path / "run"
    args = ["sft", *base, f"output_dir={out}", "engine.backend=deepspeed", "engine.zero_stage=3",
            "engine.collective_timeout_s=30"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = start_nodes(args, logs)
    rank1 = worker_of(nodes[1])
    wait_for_step(out / "metrics.jsonl", 5, nodes)
    rank1.send_signal(signal.SIGKILL)  # mid-run, usually mid-step
    killed = time.time()
    nodes[0].wait(timeout=120)
    elapsed = time.time() - killed
    nodes[1].wait(timeout=120)
    text = logs[0].read_text()
    assert nodes[0].returncode != 0 and elapsed < 30, (elapsed, text[-3000:])  # measured: ~2 s (gloo sees the reset)
    [line] = error_lines(text)
    saved = (out / "checkpoints" / "latest").read_text()
    assert "rank 0 of 2" in line and "another rank died or stopped responding" in line
    assert f"the last checkpoint is {saved}" in line and "--resume" in line
    assert not (out / "final").exists()

    # the last checkpoint verifies by its manifest, which lists both ranks' shards
    code, listing = checkpoints_tool(out)
    assert code == 0, listing
    [row] = [line for line in listing.splitlines() if line.startswith(f"* {saved}")]
    assert row.split()[3:5] == ["2", "3"] and row.endswith("OK")
    manifest = json.loads((out / "checkpoints" / saved / "manifest.json").read_text())
    files = [entry["path"] for entry in manifest["files"]]
    assert {"state-rank0.pt", "state-rank1.pt"} <= set(files)
    assert any("zero_pp_rank_0_" in f for f in files) and any("zero_pp_rank_1_" in f for f in files)

    # damaged after the fact, it is refused by both ranks, which name the previous good one
    shard = next(out / "checkpoints" / saved / f for f in files if "zero_pp_rank_1_" in f)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    previous = f"step-{int(saved.split('-')[1]) - 2:08d}"
    for text in run_nodes([*args, "--resume"], tmp_path, "refused", code=1):  # torchrun's code when a rank fails
        [line] = error_lines(text)
        assert f"{saved}' is damaged: {shard.relative_to(shard.parents[1])}: sha256" in line
        assert f"the previous good checkpoint is {previous}: point `latest` at it with `rlhfkit checkpoints " \
               f"{out} --use {previous}`" in line
    code, listing = checkpoints_tool(out, "--use", previous)
    assert code == 0 and "DAMAGED" in listing  # latest moved to a sound one; the damaged one is still listed

    # --resume on both nodes continues to the end, on the curve of an uninterrupted run
    run_nodes([*args, "--resume"], tmp_path, "resume")
    assert checkpoints_tool(out)[0] == 0  # the damaged checkpoint was written again
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    for key in ("loss", "eval/loss"):
        got, want = series_of(resumed, key)[key], series_of(reference, key)[key]
        assert got == pytest.approx(want, abs=2e-4), key


def test_a_hung_rank_fails_the_other_after_the_collective_timeout(tmp_path, sft_setup):
    base, _ = sft_setup
    out = tmp_path / "run"
    args = ["sft", *base, f"output_dir={out}", "engine.backend=deepspeed", "engine.zero_stage=2",
            "engine.collective_timeout_s=10"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = start_nodes(args, logs)
    rank1 = worker_of(nodes[1])
    wait_for_step(out / "metrics.jsonl", 3, nodes)
    rank1.send_signal(signal.SIGSTOP)  # alive but silent: only the timeout can tell
    stopped = time.time()
    try:
        nodes[0].wait(timeout=120)
        elapsed = time.time() - stopped
    finally:
        rank1.send_signal(signal.SIGKILL)
        nodes[1].wait(timeout=120)
    text = logs[0].read_text()
    assert nodes[0].returncode != 0 and elapsed < 10 + 15, (elapsed, text[-3000:])  # measured: ~11 s
    [line] = error_lines(text)
    assert "(engine.collective_timeout_s=10): Timed out waiting 10000ms" in line


def test_nodes_that_do_not_share_output_dir_stop_at_the_first_save(tmp_path, sft_setup):
    """Each node with its own folder at the same path (no shared filesystem): simulated by one output_dir each."""
    base, _ = sft_setup
    args = ["sft", *base, "engine.backend=deepspeed", "engine.zero_stage=2"]
    texts = run_nodes(args, tmp_path, code=1, node_args=([f"output_dir={tmp_path / 'a'}"],
                                                         [f"output_dir={tmp_path / 'b'}"]))
    [line] = error_lines(texts[0])
    assert line.startswith("rlhfkit sft: error: checkpoints need output_dir on a filesystem every node shares: "
                           "rank 1 (")
    assert f"cannot see '{tmp_path / 'a' / 'checkpoints' / 'step-00000002.tmp'}', which rank 0 created" in line
    assert "train.save_every=0" in line
    assert not (tmp_path / "a" / "checkpoints" / "step-00000002.tmp").exists()  # rank 0 cleaned up


# -- SIGTERM to the launcher -----------------------------------------------------------------------------------
def test_sigterm_to_the_launcher_reaches_both_ranks_which_save_once(tmp_path, sft_setup):
    base, _ = sft_setup
    out = tmp_path / "run"
    args = [a for a in base if not a.startswith("train.save_every")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "rlhfkit", "sft", *args, f"output_dir={out}", "train.save_every=0", "engine.backend=deepspeed",
           "engine.zero_stage=2"]
    launcher = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(out / "metrics.jsonl", 5, [launcher])
    launcher.send_signal(signal.SIGTERM)
    text, _ = launcher.communicate(timeout=120)
    stops = [line for line in text.splitlines() if line.startswith("rlhfkit sft: stopped by SIGTERM after step")]
    assert len(stops) == 2, text[-3000:]  # each rank got the signal and stopped, each line whole (one write each)
    steps = {line.split("after step ")[1].split(";")[0] for line in stops}
    assert len(steps) == 1  # ... after the same step
    step = int(steps.pop())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", f"step-{step:08d}"]  # saved once
    manifest = json.loads((out / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())
    assert manifest["step"] == step and manifest["world_size"] == 2
    assert not (out / "final").exists()


def test_rank0_exporting_for_longer_than_the_collective_timeout_does_not_fail_the_others(tmp_path, sft_setup):
    """Rank 0 writes the ZeRO-3 export alone (here slowed by 8 s, standing for a large model) while rank 1 waits
    with a 3 s collective timeout: the wait is not a training collective, and the run ends well."""
    from safetensors.torch import load_file

    base, _ = sft_setup
    out = tmp_path / "run"
    args = [a for a in base if not a.startswith(("train.max_steps", "train.save_every", "train.eval_every"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "integration" / "slow_rank0.py"), "sft", *args, f"output_dir={out}",
           "train.max_steps=2", "train.save_every=1", "train.eval_every=0", "engine.backend=deepspeed",
           "engine.zero_stage=3", "engine.collective_timeout_s=3"]
    res = subprocess.run(cmd, env={**ENV, "SLOW_EXPORT_S": "8"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    # the export is whole: the gathered weights, tied embeddings stored once, loadable by plain transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    saved = load_file(out / "final" / "model.safetensors")
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert set(saved) == {k for k in model.state_dict() if k != "lm_head.weight"}
