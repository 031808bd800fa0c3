"""What the benchmarks share: the model world they run on, TRL's separate venv, lock-step workers, statistics.

Imported by the parent (rlhfkit's venv) and by the TRL worker (TRL's venv, where rlhfkit is not installed), so
the top level imports the standard library only; torch, transformers and rlhfkit are imported where used.

Lock-step protocol. Each system runs in its own subprocess and blocks before every iteration until the parent
writes "go" on its stdin; after the iteration it prints one `@@BENCH {json}` line on stdout. The parent hands
"go" to the two workers in turn, so at any moment only one of them computes (the 2 shared cores are not split
between them) and both see the same background load over the run, iteration by iteration.
"""

from __future__ import annotations

import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_VENV = HERE / ".venv-trl"
CACHE = HERE / ".cache"  # built models and prompts (git-ignored)
GPU_ENV = "RLHFKIT_BENCH_GPU"  # "1": the benchmarks' --gpu mode, seen by their workers too
TRL_VERSION = "1.12.0"  # the last TRL with PPO (trl.experimental.ppo)
TORCH_VERSION = "2.13.0"  # the same torch as rlhfkit's venv; installed first so pip never picks another

# name -> LlamaConfig sizes; ~5M and ~20M parameters with a 2048-token vocabulary (embeddings tied)
SIZES = {"5M": {"hidden": 256, "layers": 7, "heads": 4}, "20M": {"hidden": 512, "layers": 7, "heads": 8}}
VOCAB = 2048
# --gpu sizes: a ~1B Llama (Llama-3.2-1B's body: 16 layers of width 2048, MLP 8192, 32 query and 8 key-value heads;
# the world's 2048-token vocabulary), built at random on the GPU machine itself
GPU_SIZES = {"1B": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192}}
N_PROMPTS = 64
MARK = "@@BENCH "


# ------------------------------------------------------------------------------------------ TRL's venv


def trl_python(venv: Path = TRL_VENV) -> Path:
    return Path(venv) / "bin" / "python"


def ensure_trl_venv(log=print, venv: Path = TRL_VENV, version: str = TRL_VERSION, python: str | None = None) -> Path:
    """Create `venv` (default benchmarks/.venv-trl) with torch (pinned, first) and TRL `version` (default 1.12.0)
    when it is missing or holds another TRL. `python` (a benchmark's --trl-python): an interpreter that already
    imports TRL `version` (a machine with its own torch, such as a GPU's), used as it is."""
    probe = ["-c", "import trl, torch; print(trl.__version__, torch.__version__)"]
    if python:
        done = subprocess.run([python, *probe], capture_output=True, text=True)
        if done.returncode != 0 or done.stdout.split()[0] != version:
            raise SystemExit(f"--trl-python {python} does not import trl {version}: {(done.stdout + done.stderr)[-500:]}")
        return Path(python)
    python = trl_python(venv)
    probe = [str(python), *probe]
    if python.exists():
        done = subprocess.run(probe, capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.split()[0] == version:
            return python
    log(f"installing TRL {version} into {venv} (once) ...")
    if not python.exists():
        subprocess.run([sys.executable if _has_venv() else "python3", "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # torch first and pinned: trl's dependencies would otherwise pull the newest (GPU) wheel
    subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run(pip + [f"trl=={version}"], check=True)  # pip picks the transformers TRL accepts
    done = subprocess.run(probe, capture_output=True, text=True, check=True)
    log(f"TRL venv ready: trl {done.stdout.strip()}")
    return python


def ensure_trl_deepspeed(log=print) -> None:
    """DeepSpeed in TRL's venv for the ZeRO-3 comparison: the version rlhfkit's venv has."""
    from importlib.metadata import version

    python = str(trl_python())
    if subprocess.run([python, "-c", "import deepspeed"], capture_output=True).returncode == 0:
        return
    wanted = version("deepspeed")
    log(f"installing deepspeed {wanted} into {TRL_VENV} (once) ...")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    f"deepspeed=={wanted}"], check=True)


def _has_venv() -> bool:
    return subprocess.run([sys.executable, "-c", "import venv, ensurepip"], capture_output=True).returncode == 0


def reexec_in_project_venv() -> None:
    """`python benchmarks/...` with an interpreter that lacks rlhfkit: run again with the project's .venv."""
    try:
        import rlhfkit  # noqa: F401
    except ImportError:
        venv_python = ROOT / ".venv" / "bin" / "python"
        if not venv_python.exists():
            raise SystemExit("rlhfkit is not importable and there is no .venv: "
                             "run ./scripts/bootstrap.sh first") from None
        os.execv(str(venv_python), [str(venv_python), *sys.argv])


def on_gpu() -> bool:
    """The --gpu mode (parent and workers): both systems on the machine's one CUDA GPU in bf16 mixed precision,
    peak memory as the GPU's (torch.cuda.max_memory_allocated), the floor at its measured bf16 matmul rate."""
    return os.environ.get(GPU_ENV) == "1"


def enter_gpu_mode() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--gpu: torch sees no CUDA GPU here")
    os.environ[GPU_ENV] = "1"


# ------------------------------------------------------------------------------------------ the world


def _lexicon(rng: random.Random, n: int = 3000) -> list[str]:
    """Pseudo-words of 1-4 syllables: enough distinct pairs for BPE to fill a 2048-token vocabulary."""
    onsets, vowels, codas = "b c d f g h k l m n p r s t v w z br st tr pl ch sh".split(), "a e i o u ai ou".split(), \
        ["", "", "n", "r", "s", "l", "t"]
    return ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 4)))
            for _ in range(n)]


def _sentence(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def build_world(root: Path = CACHE, log=print) -> Path:
    """Tokenizer, a ~5M and a ~20M Llama (policy/reference folder) with a scalar-head twin (reward/value
    folder), and 64 prompts of ~16-48 tokens. Built once by code (seeded) and reused."""
    done = root / "world.json"
    if done.is_file():
        return root
    from rlhfkit.demo.tiny import build_tiny_llama, build_tokenizer, save_model_folder
    from transformers import AutoModelForSequenceClassification

    log(f"building the benchmark models in {root} (once) ...")
    rng = random.Random(0)
    words = _lexicon(rng)
    corpus = [_sentence(rng, words, rng.randint(4, 30)) for _ in range(20000)]
    tok = build_tokenizer(corpus, vocab_size=VOCAB)
    info = {"vocab": len(tok), "sizes": {}}
    for name, size in SIZES.items():
        model = build_tiny_llama(len(tok), hidden=size["hidden"], layers=size["layers"], heads=size["heads"],
                                 seed=1, max_positions=512)
        policy = save_model_folder(model, tok, root / name / "policy")
        scalar = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
        scalar.config.pad_token_id = tok.pad_token_id
        save_model_folder(scalar, tok, root / name / "reward")
        info["sizes"][name] = sum(p.numel() for p in model.parameters())
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(N_PROMPTS):
            f.write(json.dumps({"prompt": "Tell a story about " + _sentence(rng, words, rng.randint(3, 14))}) + "\n")
    done.write_text(json.dumps(info))
    return root


def add_gpu_model(world: Path, size: str = "1B", log=print) -> None:
    """world/<size>/policy (a random-init Llama of GPU_SIZES[size] with the world's tokenizer, float32 weights)
    and world/<size>/reward (its scalar-head twin: the same body, a seeded score head), built on the GPU."""
    target = world / size
    if (target / "reward" / "config.json").is_file():
        return
    import torch
    from rlhfkit.demo.tiny import save_model_folder
    from rlhfkit.models import load_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    shape = GPU_SIZES[size]
    tok = load_tokenizer(str(world / "5M" / "policy"))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    log(f"building the {size} model in {target} (once) ...")
    torch.manual_seed(1)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        policy = LlamaForCausalLM(config)
        save_model_folder(policy, tok, target / "policy")
        config.num_labels = 1
        scalar = LlamaForSequenceClassification(config)
    scalar.model.load_state_dict(policy.model.state_dict())
    save_model_folder(scalar, tok, target / "reward")
    log(f"{size}: {sum(p.numel() for p in policy.parameters()) / 1e9:.2f}B parameters")


REAL_SIZE = "SmolLM2"  # the real model as a size of the world: SmolLM2-135M-Instruct and its scalar-head twin


def add_real_model(world: Path, log=print) -> None:
    """world/SmolLM2/policy (SmolLM2-135M-Instruct, materialised by `rlhfkit fetch`; a link to its folder) and
    world/SmolLM2/reward (the same weights under a seeded scalar head, saved once), so that every
    `world / size / folder` path of the benchmarks works for the real model too."""
    target = world / REAL_SIZE
    if (target / "reward" / "config.json").is_file():
        return
    import torch
    from rlhfkit.demo.tiny import save_model_folder
    from rlhfkit.models import load_tokenizer
    from rlhfkit.models.fetch import fetch
    from transformers import AutoModelForSequenceClassification

    folder = fetch("smollm2-135m-instruct", log=log)
    target.mkdir(parents=True, exist_ok=True)
    if not (target / "policy").exists():
        (target / "policy").symlink_to(folder, target_is_directory=True)
    torch.manual_seed(1)
    scalar = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    tok = load_tokenizer(str(folder))
    scalar.config.pad_token_id = tok.pad_token_id
    save_model_folder(scalar, tok, target / "reward")


def prompt_rows(world: Path, n: int) -> Path:
    """A prompt file with the first n prompts (one iteration's batch: every iteration sees the same set)."""
    target = world / f"prompts-{n}.jsonl"
    if not target.is_file():
        lines = (world / "prompts.jsonl").read_text().splitlines()[:n]
        target.write_text("\n".join(lines) + "\n")
    return target


def tokenized_prompts(world: Path, n: int, size: str = "5M") -> Path:
    """The same n prompts rendered and tokenised by rlhfkit's own data layer with `size`'s tokenizer (the built
    sizes share one; the real model has its own), for TRL to use as they are."""
    own = size in SIZES
    target = world / (f"prompt-ids-{n}.json" if own else f"prompt-ids-{size}-{n}.json")
    if target.is_file():
        return target
    from rlhfkit.config.ppo_schema import PPODataConfig
    from rlhfkit.data.loader import load_stage_data
    from rlhfkit.models import load_tokenizer

    tok = load_tokenizer(str(world / ("5M" if own else size) / "policy"), padding_side="left")
    data_cfg = PPODataConfig(prompts=str(prompt_rows(world, n)), eval_fraction=0.0).as_prompt_data()
    data = load_stage_data("prompts", data_cfg, tok, seed=0)
    target.write_text(json.dumps([row["prompt_ids"] for row in data.train]))
    return target


def machine_line(threads: int = 1) -> str:
    """The CPU (under --gpu: the GPU, gpu_line) and its measured float32 matmul rate (1024^3, `threads` threads) through PyTorch's default path
    (MKL) and through oneDNN, the two libraries TRL's and rlhfkit's linear layers use on AMD CPUs. Matmuls are
    most of both iterations' time, so the time ratio between the two systems depends on these two rates:
    the same code measured 0.44-0.49x on a host where oneDNN reached ~235 GFLOP/s against MKL's ~105, and
    0.69-0.72x on one where they reached 106 and 91."""
    import platform
    import torch

    if on_gpu():
        return gpu_line()
    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            cpu.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = cpu.get("model name", platform.processor() or "unknown CPU")
    family = f" (family {cpu['cpu family']}, model {cpu.get('model', '?')})" if "cpu family" in cpu else ""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x, w = torch.randn(1024, 1024), torch.randn(1024, 1024)

    def rate(fn) -> float:
        fn()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.5:
            fn()
            n += 1
        return 2 * 1024**3 * n / (time.perf_counter() - start) / 1e9

    rates = f"MKL {rate(lambda: torch.nn.functional.linear(x, w)):.0f}"
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        rates += f", oneDNN {rate(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, 'none', [], '')):.0f}"
    torch.set_num_threads(before)
    return f"machine: {name}{family}, {os.cpu_count()} cores; float32 matmul, {threads} thread(s): {rates} GFLOP/s"


@functools.lru_cache(maxsize=1)
def gpu_rates() -> tuple[float, float]:
    """The GPU's measured bf16 matmul rate (8192^3, GFLOP/s) and memory read rate (a 2 GiB float32 sum, GB/s):
    medians of 10 timed runs after warm-up, timed with CUDA events; measured once per process (the floor's rate,
    its read rate and the printed line all use it)."""
    import torch

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return median(times)

    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * n**3 / timed(lambda: a @ b) / 1e9
    x = torch.randn(512 << 20, device="cuda")
    gbps = x.numel() * 4 / timed(lambda: x.sum()) / 1e9
    del a, b, x
    torch.cuda.empty_cache()
    return flops, gbps


def gpu_line() -> str:
    import torch

    p = torch.cuda.get_device_properties(0)
    return (f"machine: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}; {os.cpu_count()} CPU cores")


def peak_matmul_gflops(threads: int = 1) -> float:
    """This host's best measured float32 matmul rate at `threads` threads: the faster of MKL and oneDNN on
    1024 x 1024 x 1024, the GEMM size at which both reach their peak (GFLOP/s). Under --gpu: the GPU's bf16
    rate (gpu_rates)."""
    import torch

    if on_gpu():
        return gpu_rates()[0]

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x, w = torch.randn(1024, 1024), torch.randn(1024, 1024)
    fns = [lambda: torch.nn.functional.linear(x, w)]
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        fns.append(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    best = 0.0
    for fn in fns:
        fn()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.5:
            fn()
            n += 1
        best = max(best, 2 * 1024**3 * n / (time.perf_counter() - start) / 1e9)
    torch.set_num_threads(before)
    return best


def peak_read_gbps(threads: int = 1) -> float:
    """This host's best measured memory read rate at `threads` threads: `torch.sum` over a 256 MiB float32 tensor
    (far larger than any cache), best of five (GB/s)."""
    import torch

    if on_gpu():
        return gpu_rates()[1]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(64 << 20)
    x.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(before)
    return x.numel() * 4 / best / 1e9


def kv_floats_per_position(folder: Path) -> int:
    """Floats of keys and values one cached position holds across all layers of a model folder."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * head_dim


def generate_memory_bound(policy: dict, kv_floats: int, batch: int, prompt: float, response: int, gflops: float,
                          gbps: float, element_bytes: int = 4) -> float:
    """Seconds the generate phase of `ppo_floor` takes at best when memory is counted too: the prefill at its
    FLOP floor, then each of the R - 1 decode steps at the larger of its FLOP time and the time to read, once,
    every linear layer's weights (body and head) and the batch's cached keys and values (`kv_floats` per
    position, `kv_floats_per_position`) at `gbps`, `element_bytes` each (4: float32; 2 under bf16 autocast, whose
    rollout reads bf16 copies of the weights and writes a bf16 cache). A decode step multiplies one row per sequence by every
    weight, so below ~100 rows it waits on memory, not on arithmetic, on a CPU."""
    seconds = 2 * (policy["body"] * prompt + policy["head"]) * batch / (gflops * 1e9)  # prefill, the head on its last row
    for step in range(1, response):
        flops = 2 * (policy["body"] + policy["head"]) * batch
        read = element_bytes * (policy["body"] + policy["head"] + kv_floats * batch * (prompt + step))
        seconds += max(flops / (gflops * 1e9), read / (gbps * 1e9))
    return seconds


def linear_sizes(folder: Path) -> dict:
    """Multiply-accumulates per token of a model folder's linear layers: `body` (every nn.Linear of the
    transformer) and `head` (the LM head or the scalar head), counted on a meta-device copy (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(folder)
    scalar = any(a.endswith("SequenceClassification") for a in (config.architectures or []))
    with torch.device("meta"):
        model = (AutoModelForSequenceClassification if scalar else AutoModelForCausalLM).from_config(config)
    head = model.score if scalar else model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return {"body": body, "head": head.weight.numel()}


def ppo_floor(policy: dict, value: dict | None, reward: dict | None, batch: int, prompt: float, response: int,
              gflops: float, phases=("generate", "reward", "reference", "values", "actor_update",
                                     "critic_update")) -> dict:
    """Seconds each phase of one iteration would take if its linear layers' FLOPs ran at `gflops`: the floor
    that no implementation of the same work beats on this host without changing the arithmetic.

    `policy`/`value`/`reward`: `linear_sizes` of the actor (= reference), the critic and the reward model;
    `prompt`: mean prompt tokens; B samples of exactly R response tokens. The work, in token-forwards of the
    body (2 FLOPs per multiply-accumulate; a backward costs two forwards):
      generate      prefill B x P + decode B x (R - 1), the LM head on one position per step (B x R)
      reference     B x (P + R), the LM head on the R response positions
      reward        B x (P + R) through the reward model (its scalar head is negligible)
      values        B x (P + R) through the critic
      actor_update  3 x the reference's work;   critic_update: 3 x the values' work
    Phases not in `phases` (e.g. values when the critic's update computes them) count nothing.
    """
    tokens = batch * (prompt + response)
    work = {
        "generate": policy["body"] * (batch * prompt + batch * (response - 1)) + policy["head"] * batch * response,
        "reference": policy["body"] * tokens + policy["head"] * batch * response,
        "reward": (reward or {"body": 0})["body"] * tokens,
        "values": (value or {"body": 0})["body"] * tokens,
    }
    work["actor_update"] = 3 * work["reference"]
    work["critic_update"] = 3 * work["values"]
    floor = {k: 2 * v / (gflops * 1e9) for k, v in work.items() if k in phases}
    floor["iteration"] = sum(floor.values())
    return {**floor, "gflops": gflops}


def met(value: float, target: float) -> str:
    return "met" if value <= target else "not met"


def print_targets(rows: list[dict], time_target: float, memory_target: float) -> None:
    """One line per benchmark row: its time and memory ratios to the peer against the issue's targets."""
    for r in rows:
        print(f"targets, {r['size']}: time {r['time_ratio']:.2f}x <= {time_target}x TRL: "
              f"{met(r['time_ratio'], time_target)}; peak memory {r['memory_ratio']:.2f}x <= {memory_target}x TRL: "
              f"{met(r['memory_ratio'], memory_target)}")


def uncache_libraries(*venvs: Path) -> int:
    """Drop the venvs' shared libraries (torch's ~1 GB of .so files, ...) from the page cache, so both systems
    map them from the same state. Peak RSS counts the file pages a process maps, and how many pages one fault
    maps depends on how the file came into the cache: the same libtorch_cpu.so measured 133 MiB resident after
    `import torch` in the venv pip had just written it and 77 MiB in the other, 79 and 77 MiB once both were
    dropped and read back. Returns the number of files dropped (clean pages only; nothing is written)."""
    dropped = 0
    for venv in venvs:
        for path in Path(venv).glob("lib/python*/site-packages/**/*.so*"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            except (OSError, AttributeError):
                pass
            finally:
                os.close(fd)
    return dropped


# ------------------------------------------------------------------------------------------ worker side


def autocast_forwards(models, dtype_name: str = "bfloat16") -> None:
    """Run every forward of each of `models` (and of its base model and score head, which TRL's PPO calls
    directly for the value and reward passes) under `torch.autocast` of its device and `dtype_name`: a forward
    pre-hook enters the context, a forward hook (also on errors) leaves it. For TRL 1.12's PPOTrainer, which builds
    its own Accelerator without a mixed-precision setting and so ignores `bf16=True`: without this its whole
    iteration runs in float32 (checked: accelerate's mixed_precision "no", autocast off in every forward)."""
    import torch

    dtype = getattr(torch, dtype_name)
    stack = []

    def enter(module, _args):
        device = next(module.parameters()).device.type
        context = torch.autocast(device, dtype=dtype)
        context.__enter__()
        stack.append(context)

    def leave(_module, _args, _output):
        if stack:
            stack.pop().__exit__(None, None, None)

    for model in models:
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        for module in (model, base, getattr(model, "score", None)):
            if isinstance(module, torch.nn.Module):
                module.register_forward_pre_hook(enter)
                module.register_forward_hook(leave, always_call=True)


def peak_memory_mb() -> float:
    """The peak memory a worker reports: its peak RSS (since it started), or under --gpu its peak GPU allocation in
    the iteration (the memory torch's allocator handed out: weights, gradients, optimizer state, activations)."""
    if on_gpu():
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mb()


def peak_rss_mb() -> float:
    """The process's peak resident set (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Lockstep:
    """Worker side: `wait()` blocks until the parent says go; `report()` prints the iteration's numbers."""

    def __init__(self):
        self.started = self.cpu_started = None
        self.out = os.fdopen(os.dup(1), "w", buffering=1)  # our own handle: libraries may print on stdout

    def wait(self) -> None:
        line = sys.stdin.readline()
        if line.strip() != "go":
            sys.exit(0)  # the parent is done with us
        if on_gpu():  # each iteration's own peak (loading and one-off checks left out; summarise takes the max)
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()

    def report(self, **extra) -> None:
        """`seconds` (wall clock) and `cpu_seconds` (this process's CPU time: with 1 thread, the wall time less the
        waits for a core that other processes on a shared machine cause) of the iteration, peak RSS, `extra`."""
        if on_gpu():
            import torch

            torch.cuda.synchronize()  # the iteration's queued GPU work is part of it
        seconds, cpu_seconds = time.perf_counter() - self.started, time.process_time() - self.cpu_started
        self.out.write(MARK + json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mb": peak_memory_mb(),
                                          **extra}) + "\n")


# ------------------------------------------------------------------------------------------ parent side


class Worker:
    """A worker subprocess driven one iteration at a time."""

    def __init__(self, name: str, cmd: list[str], log_file: Path, env: dict | None = None):
        self.name = name
        self.log_file = log_file
        self.stderr = open(log_file, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env={**os.environ, **(env or {})}, cwd=ROOT)

    def step(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        self.proc.wait()
        tail = self.log_file.read_text()[-3000:]
        raise RuntimeError(f"{self.name} worker exited ({self.proc.returncode}) before reporting:\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


# stage -> (its module, its run function, its config module, its config class), for rlhfkit_lockstep
LOCKSTEP_STAGES = {"ppo": ("rlhfkit.stages.ppo", "run_ppo", "rlhfkit.config.ppo_schema", "PPOConfig"),
                   "dpo": ("rlhfkit.stages.dpo", "run_dpo", "rlhfkit.config.dpo_schema", "DPOConfig"),
                   "sft": ("rlhfkit.stages.sft", "run_sft", "rlhfkit.config.schema", "SFTConfig"),
                   "rm": ("rlhfkit.stages.reward", "run_rm", "rlhfkit.config.schema", "RMConfig")}


def rlhfkit_lockstep(overrides: list[str], threads: int, report: dict | None = None, stage: str = "ppo") -> None:
    """Worker side: rlhfkit's real loop (`stages.<stage>.run_<stage>` on `overrides`; `LOCKSTEP_STAGES`) with its
    metrics logger as the hook that waits for the parent's "go" and reports each iteration's `time/*` phases, plus
    `report` (report key -> metrics key)."""
    import importlib

    import torch

    torch.set_num_threads(threads)
    module_name, run_name, schema_name, config_name = LOCKSTEP_STAGES[stage]
    stage_module = importlib.import_module(module_name)
    config_class = getattr(importlib.import_module(schema_name), config_name)
    from rlhfkit.config.fields import load_config

    step = Lockstep()

    class TimedLogger(stage_module.MetricsLogger):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            step.wait()  # models are loaded: the first iteration starts on the parent's word

        def log(self, it, metrics, show=()):
            super().log(it, metrics, show)
            phases = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("time/")}
            step.report(phases=phases, **{name: metrics.get(key) for name, key in (report or {}).items()})
            step.wait()

    stage_module.MetricsLogger = TimedLogger
    getattr(stage_module, run_name)(load_config(config_class, None, overrides), force=True)


def run_lockstep(workers: list[Worker], warmup: int, iters: int, log=print) -> dict[str, list[dict]]:
    """Alternate the workers iteration by iteration; returns each one's measured (post-warm-up) reports."""
    results = {w.name: [] for w in workers}
    try:
        for i in range(warmup + iters):
            order = workers if i % 2 == 0 else workers[::-1]  # neither always goes first
            for w in order:
                report = w.step()
                if i >= warmup:
                    results[w.name].append(report)
            if i < warmup:
                log(f"  iteration {i + 1}: warm-up")
            else:
                log(f"  iteration {i + 1}: " + ", ".join(f"{w.name} {results[w.name][-1]['seconds']:.3f}s"
                                                        for w in workers))
    finally:
        for w in workers:
            w.close()
    return results


def run_workers(make: dict, warmup: int, iters: int, log=print) -> dict[str, list[dict]]:
    """`make`: name -> a function starting that system's Worker. On a CPU the workers run in lock-step
    (run_lockstep); under --gpu one after the other, each alone on the GPU from its start to its exit, so that
    neither's memory (two ~1B PPO setups at once would not fit an 80 GiB card) nor its queued kernels touch the
    other's numbers."""
    if not on_gpu():
        return run_lockstep([start() for start in make.values()], warmup, iters, log)
    results = {}
    for name, start in make.items():
        log(f"  {name}, alone on the GPU:")
        results.update(run_lockstep([start()], warmup, iters, log))
    return results


def run_comparisons(args, prefix: str, comparisons, print_table) -> list[dict]:
    """The timed part of a TRL comparison's main: the machine line, `--quick` (1 warm-up + at most 4 measured
    iterations), `comparisons(tmp)` (a list of table rows, run in a temporary folder), the table and `--json`."""
    import tempfile

    print(machine_line(args.threads), flush=True)
    if on_gpu():
        flops, gbps = gpu_rates()
        print(f"GPU measured: bf16 matmul {flops / 1e3:.0f} TFLOP/s, memory read {gbps:.0f} GB/s", flush=True)
    if args.quick:
        args.iters, args.warmup = min(args.iters, 4), 1
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        rows = comparisons(Path(tmp))
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def summarise(reports: list[dict]) -> dict:
    """Median seconds per iteration, the peak RSS (max over iterations) and the median of each phase."""
    phases = {}
    for r in reports:
        for k, v in r.get("phases", {}).items():
            phases.setdefault(k, []).append(v)
    return {"seconds": median(r["seconds"] for r in reports), "peak_mb": max(r["peak_mb"] for r in reports),
            "phases": {k: median(v) for k, v in phases.items()}, "n": len(reports)}
