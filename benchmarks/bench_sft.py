"""rlhfkit's SFT and reward-model steps against TRL 1.16.0's SFTTrainer and RewardTrainer on identical work.

    python benchmarks/bench_sft.py            # 20M model, SFT then RM, 16 rows per step in micro-batches of 4
    python benchmarks/bench_sft.py --quick    # the same config, 1 warm-up + 4 measured iterations
    python benchmarks/bench_sft.py --sizes 5M,20M --stages sft
    python benchmarks/bench_sft.py --sizes SmolLM2   # SmolLM2-135M-Instruct (rlhfkit fetch) and its scalar twin
    python benchmarks/bench_sft.py --check    # the first step's loss (and gradient norm) of both, per stage (no timing)
    python benchmarks/bench_sft.py --trl-batches padded   # TRL's padded micro-batches instead of padding-free
    python benchmarks/bench_sft.py --gpu --sizes 1B --rows 64 --micro 8 --trl-python PY
                                              # on a CUDA GPU: a ~1B random-init Llama built there, both systems
                                              # in bf16 mixed precision, one after the other, peak GPU memory;
                                              # PY imports TRL 1.16.0 (no venv is made)
    --threads N sets torch's threads for both systems (default 1: steadier on a shared machine)

Printed per stage and model: trained tokens per second (the real tokens of a step, padding excluded, over the
median seconds per optimizer step) and peak RSS of each system, their ratios, and the targets (rlhfkit >= 1.5x
TRL's tokens/s, <= 0.8x its peak memory). TRL runs in benchmarks/.venv-trl-grpo (trl==1.16.0, transformers 5.23,
the same torch as rlhfkit's venv; harness.ensure_trl_venv), the venv bench_dpo and bench_grpo use.

Identical work, per iteration (one optimizer step):
  model       the harness's random-init Llama world (benchmarks/.cache/<size>): SFT trains the causal LM folder
              `policy`, RM the scalar-head twin `reward` (both sides load its saved head, so both start from the
              same weights; rlhfkit reloads a reward folder's head rather than drawing a fresh one); float32,
              dropout off, no gradient checkpointing (TRL's defaults bf16=True and gradient_checkpointing=True
              switched off), sdpa attention on both sides (the folders' default);
  rows        ROWS seeded rows (the whole data set is one batch, so every step of both trains on the same rows,
              each system shuffling them into its own micro-batches): SFT {prompt, response} rows in
              benchmarks/.cache/sft-rows-ROWS.jsonl, RM {prompt, chosen, rejected} rows in rm-pairs-ROWS.jsonl;
              prompts "Tell a story about" + 3-14 words, responses 4-100 words, so lengths vary ~6x and a padded
              micro-batch carries much padding (the share is printed). rlhfkit tokenises them with its data layer
              (plain template, EOS appended, max length MAX_LENGTH: nothing is truncated, checked) and TRL gets those
              very token ids as a pre-tokenised data set, so no rendering or tokenizer difference can enter: SFT
              {input_ids, completion_mask} (mask = rlhfkit's labels != -100), RM {chosen_ids, rejected_ids}. Each TRL
              worker checks that its prepared rows (SFT input_ids and labels, RM chosen/rejected ids) are rlhfkit's;
  loss        SFT: the summed next-token NLL over the response tokens (EOS included) of the whole step divided by
              their count (rlhfkit: data.loss_on=response, the default; stages.sft.train_step normalises by the
              step's label count; TRL: completion_only_loss=True builds labels -100 on the prompt, and its loss is
              normalised by Trainer's num_items_in_batch, the labelled tokens of the accumulated step). RM: the
              Bradley-Terry loss -log sigmoid(r_c - r_r), mean over the step's pairs, no margin (rlhfkit
              rm.margin=0; TRL: no margin column, center_rewards_coefficient=None), scores read at each
              sequence's last token;
  batch       ROWS rows (SFT) or pairs (RM) per optimizer step in micro-batches of MICRO (rlhfkit train.batch_size /
              micro_batch_size; TRL per_device_train_batch_size = MICRO, gradient_accumulation_steps = ROWS / MICRO);
  optimizer   AdamW, fused on both sides (TRL optim="adamw_torch_fused"), lr 1e-5 constant, betas (0.9, 0.95),
              eps 1e-8, no weight decay, grad-norm clip 1.0;
  --gpu       both on the CUDA GPU in bf16 mixed precision (float32 weights and AdamW; rlhfkit engine.precision=bf16,
              TRL bf16=True), peak memory the GPU's (torch.cuda.max_memory_allocated), one system after the other;
  not timed   loading, tokenising, rlhfkit's one-off packing check; no evaluation, no checkpoints.

How a micro-batch goes through the model is each system's own, in its best CPU configuration:
  rlhfkit     its defaults: `packing` (null = on after a check that packed rows give the padded loss): SFT rows and
              RM chosen+rejected sequences concatenated into bins as long as the longest one, positions restarting
              per sequence, no padding computed (data/tokenize.py collate_packed, collate_packed_pairs);
  TRL SFT     padding_free=True, packing=False, max_length=None (`--trl-batches padding_free`, the default): the
              micro-batch flattened into one row with position_ids and no attention mask. TRL documents it for
              FlashAttention, but on transformers 5.23 sdpa builds the block-diagonal packed-sequence mask from the
              position ids (masking_utils.find_packed_sequence_indices), so the loss is the padded batch's (shown by
              --check). packing=True is not used: it would pack the data set into max_length blocks before
              batching, so a step would no longer be ROWS rows. max_length=None because TRL refuses padding_free
              with a max_length and no packing; no row reaches MAX_LENGTH anyway. loss_type="nll" (TRL's default:
              its fused LM head computes the log-probs in chunks without the full logits).
              `--trl-batches padded`: right-padded micro-batches (max_length=MAX_LENGTH), TRL's default;
  TRL RM      RewardTrainer has no padding-free mode (RewardConfig has no padding_free or packing): chosen and
              rejected right-padded in one (2 x MICRO, T) batch, its only configuration.

Each system runs in its own subprocess and the two advance one optimizer step at a time in turn (harness.Lockstep):
rlhfkit runs its real loop (stages.sft.run_sft / stages.reward.run_rm through harness.rlhfkit_lockstep with
stage="sft" / "rm") with a timing hook on its metrics logger; TRL runs SFTTrainer / RewardTrainer.train() with a
callback (on_train_begin / on_step_end). The first iterations are warm-up, the medians of the rest are compared.

--check: both systems run their real loop for one optimizer step on the same rows from the same weights and print
the step's loss (rlhfkit's metrics.jsonl, TRL's log_history) and gradient norm before clipping; the losses must
agree within 1e-5. That the two compute the same work is then shown, not assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_ppo import thread_env  # noqa: E402

TRL_VERSION = "1.16.0"
TRL_VENV = harness.HERE / ".venv-trl-grpo"
ROWS, MICRO = 16, 4  # rows (SFT) or pairs (RM) per optimizer step, per forward
MAX_LENGTH = 768  # tokens per sequence; every row is shorter (checked, SmolLM2 included), so nothing is truncated
LR = 1e-5
TARGET_SPEED, TARGET_MEMORY = 1.5, 0.8  # rlhfkit >= 1.5x TRL's tokens/s, <= 0.8x its peak RSS
CHECK_TOLERANCE = 1e-5
STAGES = ("sft", "rm")
FOLDER = {"sft": "policy", "rm": "reward"}  # stage -> the model folder it trains


# ------------------------------------------------------------------------------------------ the data


def rows_file(world: Path, stage: str, n: int, length: int = 0, size: str = "5M") -> Path:
    """n seeded rows in the world's pseudo-language: SFT {prompt, response}, RM {prompt, chosen, rejected};
    prompts "Tell a story about" + 3-14 words, responses 4-100 words (lengths vary, so padding matters), or with
    `length` every response just reaches `length` tokens of `size`'s tokenizer (the cost curves' rows)."""
    sides = ("response",) if stage == "sft" else ("chosen", "rejected")
    name = f"sft-rows-{n}" if stage == "sft" else f"rm-pairs-{n}"
    if length:
        name += f"-{length}-tokens" + ("" if size in harness.SIZES else f"-{size}")
    target = world / f"{name}.jsonl"
    if not target.is_file():
        words = harness._lexicon(random.Random(0))  # the words the world's tokenizer was trained on
        rng = random.Random(23 if stage == "sft" else 29)
        if length:
            from rlhfkit.models import load_tokenizer

            tok = load_tokenizer(str(world / ("5M" if size in harness.SIZES else size) / "policy"))

            def response() -> str:  # words until the text is `length` tokens or just over
                text = harness._sentence(rng, words, 1)
                while len(tok(text, add_special_tokens=False)["input_ids"]) < length:
                    text += " " + harness._sentence(rng, words, max(1, (length - len(tok(text)["input_ids"])) // 3))
                return text
        else:
            def response() -> str:
                return harness._sentence(rng, words, rng.randint(4, 100))
        rows = [{"prompt": "Tell a story about " + harness._sentence(rng, words, rng.randint(3, 14)),
                 **{side: response() for side in sides}} for _ in range(n)]
        target.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return target


EXTRA: list[str] = []  # `--rlhfkit-set` settings (e.g. packing=false), after the identical work's own


def rlhfkit_overrides(stage: str, model: Path, data: Path, out, batch: int, steps: int = 100000) -> list[str]:
    """The `rlhfkit sft` / `rlhfkit rm` settings of the identical work (see the module docstring)."""
    common = [f"model={model}", f"data.train={data}", "data.eval_fraction=0", "data.template=plain",
              f"data.max_length={MAX_LENGTH}", "data.cache=false", f"output_dir={out}", f"train.batch_size={batch}",
              f"train.micro_batch_size={MICRO}", f"train.max_steps={steps}", f"train.lr={LR}", "train.warmup_steps=0",
              "train.scheduler=constant", "train.weight_decay=0", "train.betas=[0.9,0.95]", "train.max_grad_norm=1.0",
              "train.save_every=0", "train.eval_every=0", "train.log_every=1", "log.tensorboard=false",
              "log.progress=false"]
    return common + (["rm.norm_samples=0"] if stage == "rm" else []) + \
        (["engine.precision=bf16"] if harness.on_gpu() else []) + EXTRA


def rlhfkit_rows(stage: str, world: Path, size: str, data: Path) -> list[dict]:
    """`data` tokenised by rlhfkit's data layer as run_sft / run_rm do: SFT [{input_ids, labels}], RM
    [{chosen_ids, rejected_ids, prompt_len}]. Refuses a truncated or dropped row."""
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.schema import RMConfig, SFTConfig
    from rlhfkit.data.loader import load_stage_data
    from rlhfkit.data.templates import end_token_ids
    from rlhfkit.models import load_tokenizer
    from rlhfkit.models.loading import load_generation_config

    folder = str(world / size / FOLDER[stage])
    cfg = load_config(SFTConfig if stage == "sft" else RMConfig, None,
                      rlhfkit_overrides(stage, Path(folder), data, "unused", MICRO))
    tok = load_tokenizer(folder, cfg.load)
    loaded = load_stage_data(stage, cfg.data, tok, cfg.train.seed,
                             end_ids=end_token_ids(tok, load_generation_config(folder, cfg.load)), main=False)
    n = len(data.read_text().splitlines())
    if loaded.info["truncated"] or loaded.info["dropped"] or len(loaded.train) != n:
        raise SystemExit(f"rlhfkit truncated or dropped rows at max_length {MAX_LENGTH}: {loaded.info}")
    keys = ("input_ids", "labels") if stage == "sft" else ("chosen_ids", "rejected_ids", "prompt_len")
    return [{k: row[k] for k in keys} for row in loaded.train]


def sequences(stage: str, rows: list[dict]) -> list[list[int]]:
    """The token sequences one step runs through the model: SFT rows, RM chosen and rejected sides."""
    return [r["input_ids"] for r in rows] if stage == "sft" else \
        [r[side] for r in rows for side in ("chosen_ids", "rejected_ids")]


def padding_share(stage: str, rows: list[dict]) -> float:
    """The share of pad tokens in right-padded micro-batches of MICRO rows taken in file order (what a padded
    forward would compute in vain; each system's own shuffle changes it a little)."""
    real = padded = 0
    for i in range(0, len(rows), MICRO):
        seqs = sequences(stage, rows[i:i + MICRO])
        real += sum(len(s) for s in seqs)
        padded += len(seqs) * max(len(s) for s in seqs)
    return 1 - real / padded


def trl_rows(stage: str, rows: list[dict]) -> list[dict]:
    """rlhfkit's token ids as TRL's pre-tokenised data set."""
    if stage == "sft":
        return [{"input_ids": r["input_ids"], "completion_mask": [int(t != -100) for t in r["labels"]]} for r in rows]
    return [{"chosen_ids": r["chosen_ids"], "rejected_ids": r["rejected_ids"]} for r in rows]


def check_same_ids(stage: str, prepared: list[dict], expected: list[dict]) -> None:
    """TRL's prepared rows must be rlhfkit's, row for row (SFT: input_ids and labels; RM: both sides)."""
    keys = ("input_ids", "labels") if stage == "sft" else ("chosen_ids", "rejected_ids")
    if len(prepared) != len(expected):
        raise SystemExit(f"TRL kept {len(prepared)} rows, rlhfkit {len(expected)}")
    for i, (theirs, mine) in enumerate(zip(prepared, expected)):
        if any(list(theirs[k]) != list(mine[k]) for k in keys):
            raise SystemExit(f"{stage} row {i}: TRL's {'/'.join(keys)} differ from rlhfkit's")


# ------------------------------------------------------------------------------------------ workers


def rlhfkit_worker(args) -> None:
    """rlhfkit's real loop (run_sft / run_rm), in lock-step with the parent (harness.rlhfkit_lockstep)."""
    world = Path(args.world)
    overrides = rlhfkit_overrides(args.stage, world / args.size / FOLDER[args.stage],
                                  rows_file(world, args.stage, args.rows, args.length, args.size), args.out, args.rows)
    harness.rlhfkit_lockstep(overrides, args.threads, report={"loss": "loss"}, stage=args.stage)


def trl_trainer(stage: str, world: Path, size: str, rows: list[dict], out, steps: int, padding_free: bool,
                callbacks=()):
    """SFTTrainer or RewardTrainer of the identical work on rlhfkit's token ids (see the module docstring)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    folder = world / size / FOLDER[stage]
    common = dict(
        output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=len(rows) // MICRO,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, optim="adamw_torch_fused", max_grad_norm=1.0, max_steps=steps,
        bf16=harness.on_gpu(), fp16=False, gradient_checkpointing=False, use_cpu=not harness.on_gpu(), report_to=[],
        save_strategy="no",
        eval_strategy="no", logging_steps=1, disable_tqdm=True, seed=1234, dataloader_num_workers=0)
    data = Dataset.from_list(trl_rows(stage, rows))
    tok = AutoTokenizer.from_pretrained(folder)
    if stage == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common, completion_only_loss=True, packing=False, padding_free=padding_free,
                           max_length=None if padding_free else MAX_LENGTH, loss_type="nll")
        return SFTTrainer(model=AutoModelForCausalLM.from_pretrained(folder), args=config, train_dataset=data,
                          processing_class=tok, callbacks=list(callbacks))
    from trl import RewardConfig, RewardTrainer

    config = RewardConfig(**common, max_length=MAX_LENGTH, disable_dropout=True, center_rewards_coefficient=None)
    return RewardTrainer(model=AutoModelForSequenceClassification.from_pretrained(folder), args=config,
                         train_dataset=data, processing_class=tok, callbacks=list(callbacks))


def trl_worker(args) -> None:
    """TRL's trainer.train(); a callback waits for "go" at train begin and after each optimizer step."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import TrainerCallback

    step = harness.Lockstep()

    class Timing(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            step.wait()

        def on_step_end(self, *a, **kw):
            step.report()
            step.wait()

    rows = json.loads(Path(args.spec).read_text())
    trainer = trl_trainer(args.stage, Path(args.world), args.size, rows, args.out, 100000,
                          args.trl_batches == "padding_free", callbacks=[Timing()])
    check_same_ids(args.stage, list(trainer.train_dataset), rows)
    trainer.train()


def report_check(**numbers) -> None:
    sys.stdout.write(harness.MARK + json.dumps(numbers) + "\n")
    sys.stdout.flush()


def rlhfkit_check(args) -> None:
    """One optimizer step of rlhfkit's real loop; its loss and gradient norm from metrics.jsonl."""
    import torch

    torch.set_num_threads(args.threads)
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.schema import RMConfig, SFTConfig
    from rlhfkit.stages.reward import run_rm
    from rlhfkit.stages.sft import run_sft

    world = Path(args.world)
    overrides = rlhfkit_overrides(args.stage, world / args.size / FOLDER[args.stage],
                                  rows_file(world, args.stage, args.rows, args.length, args.size), args.out, args.rows,
                                  steps=1)
    config_class, run = (SFTConfig, run_sft) if args.stage == "sft" else (RMConfig, run_rm)
    run(load_config(config_class, None, overrides), force=True)
    first = json.loads((Path(args.out) / "metrics.jsonl").read_text().splitlines()[0])
    report_check(loss=first["loss"], grad_norm=first["grad_norm"])


def trl_check(args) -> None:
    """One optimizer step of TRL's trainer.train(); its loss and gradient norm from log_history."""
    import torch

    torch.set_num_threads(args.threads)
    rows = json.loads(Path(args.spec).read_text())
    trainer = trl_trainer(args.stage, Path(args.world), args.size, rows, args.out, 1,
                          args.trl_batches == "padding_free")
    check_same_ids(args.stage, list(trainer.train_dataset), rows)
    trainer.train()
    first = next(entry for entry in trainer.state.log_history if "loss" in entry)
    report_check(loss=first["loss"], grad_norm=first["grad_norm"])


# ------------------------------------------------------------------------------------------ parent


def worker_cmd(system: str, python: Path, world: Path, size: str, stage: str, args, out: Path, spec: Path) -> list:
    return [str(python), str(Path(__file__).resolve()), "--worker", system, "--world", str(world), "--size", size,
            "--stage", stage, "--rows", str(args.rows), "--threads", str(args.threads), "--out", str(out),
            "--spec", str(spec), "--trl-batches", args.trl_batches, "--length", str(args.length),
            "--micro", str(MICRO), *(f"--rlhfkit-set={item}" for item in EXTRA)]


def write_spec(stage: str, world: Path, size: str, args, tmp: Path) -> tuple[list[dict], Path]:
    """rlhfkit's tokenised rows, written for the TRL worker to train on and check against."""
    rows = rlhfkit_rows(stage, world, size, rows_file(world, stage, args.rows, args.length, size))
    spec = tmp / f"rows-{stage}-{size}.json"
    spec.write_text(json.dumps(rows))
    return rows, spec


def compare(world: Path, trl_python: Path, size: str, stage: str, args, tmp: Path) -> dict:
    rows, spec = write_spec(stage, world, size, args, tmp)
    tokens = sum(len(s) for s in sequences(stage, rows))
    what = "rows" if stage == "sft" else "pairs"
    print(f"\n== {stage}, {size} model: {args.rows} {what} per step in micro-batches of {MICRO}, {tokens} real tokens "
          f"per step ({padding_share(stage, rows):.0%} of a padded micro-batch would be padding), max length "
          f"{MAX_LENGTH}; TRL {'padding-free' if stage == 'sft' and args.trl_batches == 'padding_free' else 'padded'}"
          f" ({args.warmup} warm-up + {args.iters} measured iterations each, {args.threads} thread(s))"
          f"{'; rlhfkit with ' + ' '.join(EXTRA) if EXTRA else ''}", flush=True)
    harness.uncache_libraries(Path(sys.prefix), trl_python.parent.parent)  # the same start for both (peak RSS)

    def starter(name: str, py: Path):
        return lambda: harness.Worker(name, worker_cmd(name, py, world, size, stage, args,
                                                       tmp / f"{name}-{stage}-{size}", spec),
                                      tmp / f"{name}-{stage}-{size}.log", thread_env(args.threads))

    results = harness.run_workers({"rlhfkit": starter("rlhfkit", Path(sys.executable)),
                                   "trl": starter("trl", trl_python)}, args.warmup, args.iters)
    mine, theirs = harness.summarise(results["rlhfkit"]), harness.summarise(results["trl"])
    for summary, reports in ((mine, results["rlhfkit"]), (theirs, results["trl"])):
        summary["cpu_seconds"] = harness.median(r["cpu_seconds"] for r in reports)
        summary["tokens_per_s"] = tokens / summary["seconds"]
    # the same iteration of both runs back to back: their ratio sees the same background load
    paired = [b["seconds"] / a["seconds"] for a, b in zip(results["rlhfkit"], results["trl"])]
    row = {"stage": stage, "size": size, "rows": args.rows, "micro": MICRO, "tokens": tokens,
           "threads": args.threads, "trl_version": TRL_VERSION, "trl_batches": args.trl_batches, "rlhfkit": mine,
           "trl": theirs, "speed_ratio": mine["tokens_per_s"] / theirs["tokens_per_s"],
           "cpu_speed_ratio": theirs["cpu_seconds"] / mine["cpu_seconds"], "paired_speed_ratio": harness.median(paired),
           "memory_ratio": mine["peak_mb"] / theirs["peak_mb"]}
    if harness.on_gpu():  # one system after the other: iteration i of each is no pair
        spread = [b["seconds"] / a["seconds"] for a in results["rlhfkit"] for b in results["trl"]]
        print(f"  rlhfkit / TRL tokens/s: {row['speed_ratio']:.2f}x (ratio of the medians; of any two iterations "
              f"{min(spread):.2f}-{max(spread):.2f}x)")
    else:
        print(f"  rlhfkit / TRL tokens/s per iteration (each pair of iterations back to back): median "
              f"{row['paired_speed_ratio']:.2f}x, range {min(paired):.2f}-{max(paired):.2f}x; CPU time per step "
              f"{mine['cpu_seconds']:.3f} vs {theirs['cpu_seconds']:.3f} s: {row['cpu_speed_ratio']:.2f}x")
    return row


def print_table(rows: list[dict]) -> None:
    memory = "GPU memory" if harness.on_gpu() else "RSS"
    print(f"\n| stage | model | rows x micro | real tokens/step | rlhfkit s/step | TRL {TRL_VERSION} s/step | "
          f"rlhfkit tokens/s | TRL tokens/s | tokens/s ratio | CPU-time ratio | rlhfkit peak {memory} MiB | "
          f"TRL peak {memory} MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, t = r["rlhfkit"], r["trl"]
        print(f"| {r['stage']} | {r['size']} | {r['rows']} x {r['micro']} | {r['tokens']} | {a['seconds']:.3f} | "
              f"{t['seconds']:.3f} | {a['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | **{r['speed_ratio']:.2f}x** | "
              f"{r['cpu_speed_ratio']:.2f}x | {a['peak_mb']:.0f} | {t['peak_mb']:.0f} | **{r['memory_ratio']:.2f}x** |")
    print()
    for r in rows:
        speed = "met" if r["speed_ratio"] >= TARGET_SPEED else "not met"
        print(f"targets, {r['stage']} {r['size']}: tokens/s {r['speed_ratio']:.2f}x >= {TARGET_SPEED}x TRL: {speed}; "
              f"peak memory {r['memory_ratio']:.2f}x <= {TARGET_MEMORY}x TRL: "
              f"{harness.met(r['memory_ratio'], TARGET_MEMORY)}")


def check(args, trl_python: Path, world: Path) -> None:
    """The first optimizer step's loss and gradient norm of both systems, per stage (see the module docstring)."""
    size = args.sizes.split(",")[0]
    print(f"\n== --check: {size} model, one optimizer step of {args.rows} rows in micro-batches of {MICRO}, "
          f"each system's real loop (rlhfkit packed, TRL {args.trl_batches} for SFT, padded for RM)", flush=True)
    print("| stage | rlhfkit loss | TRL loss | abs. diff | <= 1e-5 | rlhfkit grad norm | TRL grad norm | rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    with tempfile.TemporaryDirectory(prefix="bench_sft_check_") as tmp:
        for stage in args.stages.split(","):
            _, spec = write_spec(stage, world, size, args, Path(tmp))
            results = {}
            for name, python in (("rlhfkit", Path(sys.executable)), ("trl", trl_python)):
                cmd = worker_cmd(f"{name}-check", python, world, size, stage, args, Path(tmp) / f"{name}-{stage}", spec)
                done = subprocess.run(cmd, capture_output=True, text=True,
                                      env={**os.environ, **thread_env(args.threads)})
                lines = [line for line in done.stdout.splitlines() if line.startswith(harness.MARK)]
                if done.returncode != 0 or not lines:
                    raise SystemExit(f"{name} {stage} check failed ({done.returncode}):\n{done.stderr[-3000:]}")
                results[name] = json.loads(lines[-1][len(harness.MARK):])
            m, t = results["rlhfkit"], results["trl"]
            dl, dg = abs(m["loss"] - t["loss"]), abs(m["grad_norm"] - t["grad_norm"]) / t["grad_norm"]
            failed |= dl > CHECK_TOLERANCE
            print(f"| {stage} | {m['loss']:.8f} | {t['loss']:.8f} | {dl:.1e} | {harness.met(dl, CHECK_TOLERANCE)} | "
                  f"{m['grad_norm']:.6f} | {t['grad_norm']:.6f} | {dg:.1e} |", flush=True)
    print("  grad norms: torch's float32 clip_grad_norm_ on both sides, before clipping")
    if failed:
        raise SystemExit("the first step's losses differ by more than 1e-5: the two do not compute the same work")


def main() -> None:
    global MICRO
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the default config, 1 warm-up + 4 measured iterations")
    p.add_argument("--sizes", default="20M", help=f"comma-separated model sizes (5M, 20M, {harness.REAL_SIZE})")
    p.add_argument("--stages", default="sft,rm", help="comma-separated stages (sft, rm)")
    p.add_argument("--iters", type=int, default=8, help="measured iterations per system (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=ROWS, help="rows (SFT) or pairs (RM) per optimizer step: the data set")
    p.add_argument("--length", type=int, default=0, help="responses of this many tokens instead of 4-100 words")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, the same for both systems (1: steadier on a shared machine)")
    p.add_argument("--trl-batches", choices=("padding_free", "padded"), default="padding_free",
                   help="TRL SFT's micro-batches: padding-free (default: its fastest) or right-padded (its default)")
    p.add_argument("--check", action="store_true", help="compare the first step's loss of both instead of timing")
    p.add_argument("--micro", type=int, default=MICRO, help="rows (pairs) per forward of both systems")
    p.add_argument("--gpu", action="store_true", help="on the machine's CUDA GPU, bf16 mixed precision, sizes "
                                                       f"from {sorted(harness.GPU_SIZES)} built there")
    p.add_argument("--trl-python", help="an interpreter that imports TRL 1.16.0 (instead of "
                                        "benchmarks/.venv-trl-grpo)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--rlhfkit-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an rlhfkit setting beyond the identical work's (repeatable), e.g. packing=false to time "
                        "its padded batches")
    # worker mode (internal)
    p.add_argument("--worker", choices=("rlhfkit", "trl", "rlhfkit-check", "trl-check"))
    p.add_argument("--world"), p.add_argument("--size"), p.add_argument("--stage"), p.add_argument("--out")
    p.add_argument("--spec")
    args = p.parse_args()
    MICRO = args.micro
    EXTRA[:] = args.rlhfkit_set
    if args.worker:
        {"rlhfkit": rlhfkit_worker, "trl": trl_worker, "rlhfkit-check": rlhfkit_check,
         "trl-check": trl_check}[args.worker](args)
        return
    harness.reexec_in_project_venv()
    if args.rows % MICRO or not set(args.stages.split(",")) <= set(STAGES):
        raise SystemExit(f"--rows must be a multiple of the micro-batch size {MICRO}; --stages from {STAGES}")

    if args.gpu:
        harness.enter_gpu_mode()
    trl_python = harness.ensure_trl_venv(venv=TRL_VENV, version=TRL_VERSION, python=args.trl_python)
    world = harness.build_world()
    if harness.REAL_SIZE in args.sizes.split(","):
        harness.add_real_model(world)
    for size in set(args.sizes.split(",")) & set(harness.GPU_SIZES):
        if not args.gpu:
            raise SystemExit(f"size {size} is built on a GPU: add --gpu")
        harness.add_gpu_model(world, size)
    if args.check:
        check(args, trl_python, world)
        return
    harness.run_comparisons(args, "bench_sft_", lambda tmp: [
        compare(world, trl_python, size, stage, args, tmp)
        for size in args.sizes.split(",") for stage in args.stages.split(",")], print_table)


if __name__ == "__main__":
    main()
