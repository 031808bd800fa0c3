"""rlhfkit's DPO against the newest TRL's DPOTrainer (1.16.0) on identical work, side by side.

    python benchmarks/bench_dpo.py            # 5M model, 16 pairs per step in micro-batches of 4, 2 + 8 iterations
    python benchmarks/bench_dpo.py --quick    # the same config, 1 warm-up + 4 measured iterations
    python benchmarks/bench_dpo.py --sizes 5M,20M --iters 6
    python benchmarks/bench_dpo.py --reference frozen   # a frozen reference copy in every micro-batch, both sides
    python benchmarks/bench_dpo.py --check    # loss and gradient norm of one fixed batch, per loss (no timing)
    --threads N sets torch's threads for both systems (default 1: steadier on a shared machine)

TRL runs in benchmarks/.venv-trl-grpo (torch 2.13.0 pinned first, then trl==1.16.0, built by
harness.ensure_trl_venv), the venv bench_grpo uses.

Identical work, per iteration (one optimizer step):
  model       the same folder (harness's 5M Llama world, benchmarks/.cache/5M/policy) as the policy and as the
              reference, float32, dropout off, no gradient checkpointing (TRL's defaults bf16=True and
              gradient_checkpointing=True are switched off);
  pairs       PAIRS seeded prompt/chosen/rejected rows in benchmarks/.cache/pairs-PAIRS.jsonl, which both read. The
              data set is exactly one batch, so every step of both systems trains on the same pairs (each shuffles
              them into its own micro-batches). rlhfkit renders a row with its plain template, which TRL (given a
              plain-text data set) does not have, so TRL gets each row in that rendering, the same text:
              prompt "User: {prompt}\\n\\nAssistant:", responses " {response}"; TRL appends the EOS text itself, rlhfkit
              the EOS id. Each TRL worker checks that its tokenised rows (prompt ids, prompt + response ids) are
              exactly rlhfkit's (`check_same_ids`); no row is longer than MAX_LENGTH, so neither truncates;
  batch       PAIRS pairs per optimizer step in micro-batches of MICRO pairs (rlhfkit train.batch_size /
              micro_batch_size; TRL per_device_train_batch_size = MICRO, gradient_accumulation_steps = PAIRS /
              MICRO). How a micro-batch goes through the model is each system's own: TRL runs its 2 x MICRO
              sequences right-padded to the longest one; rlhfkit runs each pair's prompt once and both responses
              against its KV cache (stages.dpo.sequence_logprobs), padded to the longest prompt and response;
  loss        DPO's sigmoid loss, beta 0.1 (rlhfkit dpo.loss=sigmoid; TRL loss_type="sigmoid");
  optimizer   AdamW (fused on both sides), lr 1e-6 constant, betas (0.9, 0.95), no weight decay, grad-norm clip 1.0;
  reference   --reference precompute (default): log-probs precomputed once before training by both, one no-grad
              pass in micro-batches of MICRO pairs, no reference model held during training: rlhfkit's default
              (dpo.precompute_reference, the policy itself before its first step), TRL
              precompute_ref_log_probs=True (the policy itself too: no ref_model is loaded), TRL's fastest
              configuration; the pass is not in the timed iterations. --reference frozen: a frozen copy of the
              folder runs a no-grad forward in every micro-batch on both sides (TRL's default;
              rlhfkit dpo.precompute_reference=false);
  not timed   loading, tokenising and the reference pass (both do them before their first step); no evaluation,
              no checkpoints.

Each system runs in its own subprocess; the two advance one iteration at a time in turn (harness.Lockstep), the
first iterations are warm-up and the medians of the rest are compared. rlhfkit runs its real loop
(stages.dpo.run_dpo, through harness.rlhfkit_lockstep with stage="dpo") with a timing hook on its metrics logger,
TRL runs DPOTrainer.train() with a callback (on_train_begin / on_step_end).

--check: one fixed batch (the first CHECK_PAIRS pairs, as rlhfkit's data layer tokenises them) at the step-0
weights, for every loss both implement. The reference is a second folder: the policy with seeded noise added
to every weight matrix (`perturbed_reference`), so the log-ratios are not 0 and the loss is not log 2. Each side
prints its loss and the global gradient norm of the policy after backward (sqrt of the sum of squares in float64:
torch's float32 norm, which clip_grad_norm_ reports on both sides, is off by ~2e-5 here, see the output):
  rlhfkit  stages.dpo: the reference log-probs precomputed by `compute_reference_logprobs` from the perturbed
           folder, then `train_step` (micro-batches of MICRO pairs, its real accumulation); the gradient is
           measured when the step calls the engine's optimizer step, before clipping;
  TRL      DPOTrainer._compute_loss on the whole batch as one micro-batch, with the perturbed folder as ref_model
           (the reference forward inside the loss, TRL's path without precompute), then backward; SimPO is not in
           TRL 1.16's DPOTrainer but in trl.experimental.cpo.CPOTrainer (loss_type="simpo", cpo_alpha=0):
           get_batch_loss_metrics on the whole batch.
What each case compares (TRL 1.16.0's source, trainer/dpo_trainer.py and experimental/cpo/cpo_trainer.py):
  sigmoid  the same loss by definition;
  cdpo     TRL 1.16's "sigmoid" does not read label_smoothing (only "robust", "exo_pair" and "aot*" do; shown below by
           a row of its own) and it has no cDPO loss type. cDPO is TRL's own "sigmoid" and "robust" losses combined, an identity:
           with z = beta h, robust = (-(1-e) log s(z) + e log s(-z)) / (1-2e), so
           2(1-e) sigmoid - (1-2e) robust = -(1-e) log s(z) - e log s(-z) = cDPO (loss_weights [2(1-e), -(1-2e)]);
  ipo      different by definition: rlhfkit uses the paper's summed log-ratios, TRL divides each by its
           response's length first. On a batch where all 2B responses have the same length L (the fixed batch's
           responses cut to its shortest) TRL's IPO with beta equals rlhfkit's IPO with beta / L divided by L^2
           ((h/L - 1/(2 beta))^2 = (h - L/(2 beta))^2 / L^2), so that is compared;
  simpo    the same loss by definition (rlhfkit simpo; CPOTrainer loss_type="simpo"), with and without label
           smoothing.
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

TRL_VERSION = "1.16.0"  # the newest TRL on the registry when this was written
TRL_VENV = harness.HERE / ".venv-trl-grpo"
PAIRS, MICRO = 16, 4  # pairs per optimizer step, pairs per forward (2 x MICRO sequences)
MAX_LENGTH = 256  # tokens per sequence; every row is shorter (checked), so nothing is truncated
BETA = 0.1
LR = 1e-6
TARGET_TIME, TARGET_MEMORY = 0.6, 0.8
CHECK_PAIRS = 8
NOISE = 0.5  # the perturbed reference: each weight matrix + NOISE x its std x N(0, 1) (step-0 |beta h| up to ~0.7)


# ------------------------------------------------------------------------------------------ the data


def pairs_file(world: Path, n: int) -> Path:
    """n seeded preference pairs (prompt, chosen, rejected) in the world's pseudo-language: prompts of 3-14 words
    after "Tell a story about", responses of 8-40 words."""
    target = world / f"pairs-{n}.jsonl"
    if not target.is_file():
        words = harness._lexicon(random.Random(0))  # the words the world's tokenizer was trained on
        rng = random.Random(17)
        rows = [{"prompt": "Tell a story about " + harness._sentence(rng, words, rng.randint(3, 14)),
                 "chosen": harness._sentence(rng, words, rng.randint(8, 40)),
                 "rejected": harness._sentence(rng, words, rng.randint(8, 40))} for _ in range(n)]
        target.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return target


def plain_template(row: dict) -> dict:
    """A pair as rlhfkit's plain template renders it (data/templates.py), for TRL; TRL appends the EOS text."""
    return {"prompt": f"User: {row['prompt']}\n\nAssistant:", "chosen": " " + row["chosen"].strip(),
            "rejected": " " + row["rejected"].strip()}


def rlhfkit_rows(world: Path, size: str, pairs: Path) -> list[dict]:
    """`pairs` tokenised by rlhfkit's data layer as run_dpo does: [{chosen_ids, rejected_ids, prompt_len}], in the
    file's order (checked)."""
    from rlhfkit.config.dpo_schema import DPOConfig
    from rlhfkit.config.fields import load_config
    from rlhfkit.data.loader import load_stage_data
    from rlhfkit.data.templates import end_token_ids
    from rlhfkit.models import load_tokenizer
    from rlhfkit.models.loading import load_generation_config

    policy = str(world / size / "policy")
    cfg = load_config(DPOConfig, None, [f"model={policy}", f"data.train={pairs}", "data.eval_fraction=0",
                                        "data.template=plain", f"data.max_length={MAX_LENGTH}", "data.cache=false"])
    tok = load_tokenizer(policy, cfg.load)
    data = load_stage_data("rm", cfg.data, tok, cfg.train.seed, end_ids=end_token_ids(tok, load_generation_config(
        policy, cfg.load)), main=False)
    texts = [json.loads(line) for line in pairs.read_text().splitlines()]
    if data.info["truncated"] or data.info["dropped"] or len(data.train) != len(texts):
        raise SystemExit(f"rlhfkit truncated or dropped pairs at max_length {MAX_LENGTH}: {data.info}")
    rows = [{k: row[k] for k in ("chosen_ids", "rejected_ids", "prompt_len")} for row in data.train]
    for row, text in zip(rows, texts):  # the file's order: row i is pair i
        prompt = tok(plain_template(text)["prompt"])["input_ids"]
        if row["chosen_ids"][:row["prompt_len"]] != prompt:
            raise SystemExit("rlhfkit's data layer reordered the pairs")
    return rows


def check_same_ids(trl_rows: list[dict], expected: list[dict]) -> None:
    """TRL's tokenised rows ({prompt_ids, chosen_ids, rejected_ids}) must be rlhfkit's, row for row."""
    for i, (mine, theirs) in enumerate(zip(expected, trl_rows)):
        prompt = list(theirs["prompt_ids"])
        same = (len(prompt) == mine["prompt_len"] and prompt + list(theirs["chosen_ids"]) == mine["chosen_ids"]
                and prompt + list(theirs["rejected_ids"]) == mine["rejected_ids"])
        if not same:
            raise SystemExit(f"pair {i}: TRL's token ids differ from rlhfkit's")
    if len(trl_rows) != len(expected):
        raise SystemExit(f"TRL kept {len(trl_rows)} pairs, rlhfkit {len(expected)}")


def trl_dataset(pairs: Path):
    from datasets import Dataset

    return Dataset.from_list([plain_template(json.loads(line)) for line in pairs.read_text().splitlines()])


# ------------------------------------------------------------------------------------------ workers


def rlhfkit_overrides(model: Path, pairs: Path, out, batch: int, dpo: dict) -> list[str]:
    """The `rlhfkit dpo` settings of the identical work (see the module docstring); `dpo`: the dpo.* keys."""
    return [f"model={model}", f"data.train={pairs}", "data.eval_fraction=0", "data.template=plain",
            f"data.max_length={MAX_LENGTH}", "data.cache=false", f"output_dir={out}", f"train.batch_size={batch}",
            f"train.micro_batch_size={MICRO}", "train.max_steps=100000", f"train.lr={LR}", "train.warmup_steps=0",
            "train.scheduler=constant", "train.weight_decay=0", "train.betas=[0.9,0.95]", "train.max_grad_norm=1.0",
            "train.save_every=0", "train.eval_every=0", "train.log_every=1", "log.tensorboard=false",
            "log.progress=false"] + [f"dpo.{k}={v}" for k, v in dpo.items()]


def rlhfkit_worker(args) -> None:
    """rlhfkit's real loop (run_dpo), in lock-step with the parent (harness.rlhfkit_lockstep)."""
    world = Path(args.world)
    overrides = rlhfkit_overrides(world / args.size / "policy", pairs_file(world, args.pairs), args.out, args.pairs,
                                  {"loss": "sigmoid", "beta": BETA,
                                   "precompute_reference": str(args.reference == "precompute").lower()})
    harness.rlhfkit_lockstep(overrides, args.threads, report={"accuracy": "accuracy", "margin": "margin"},
                             stage="dpo")


def trl_config(out, batch: int, accumulation: int, precompute: bool = True):
    """DPOConfig of the identical work; `batch` pairs per micro-batch, `accumulation` micro-batches per step;
    `precompute`: precompute_ref_log_probs (False: a frozen copy of the policy runs in every micro-batch)."""
    from trl import DPOConfig

    return DPOConfig(
        output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
        max_length=MAX_LENGTH, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, max_steps=100000, bf16=False, fp16=False,
        gradient_checkpointing=False, use_cpu=True, report_to=[], save_strategy="no", eval_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=1234, dataloader_num_workers=0, loss_type=["sigmoid"], beta=BETA,
        precompute_ref_log_probs=precompute)


def trl_worker(args) -> None:
    """TRL's DPOTrainer.train(); a callback waits for "go" at train begin and after each optimizer step."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOTrainer

    step = harness.Lockstep()
    world = Path(args.world)
    policy = world / args.size / "policy"
    trainer = None

    class Timing(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            step.wait()

        def on_step_end(self, *a, **kw):
            metrics = trainer._metrics["train"]  # this step's micro-batches, until the log() after on_step_end
            step.report(**{key: sum(metrics[f"rewards/{name}"]) / len(metrics[f"rewards/{name}"])
                           for key, name in (("accuracy", "accuracies"), ("margin", "margins"))})
            step.wait()

    config = trl_config(args.out, MICRO, args.pairs // MICRO, precompute=args.reference == "precompute")
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(policy), args=config,
                         train_dataset=trl_dataset(pairs_file(world, args.pairs)),
                         processing_class=AutoTokenizer.from_pretrained(policy), callbacks=[Timing()])
    check_same_ids(list(trainer.train_dataset), json.loads(Path(args.spec).read_text()))
    trainer.train()


# ------------------------------------------------------------------------------------------ --check


def perturbed_reference(world: Path, size: str) -> Path:
    """The policy folder with seeded noise added to every weight matrix: a reference whose log-probs differ."""
    target = world / size / f"reference-noise{NOISE:g}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = world / size / "policy"
    model = AutoModelForCausalLM.from_pretrained(policy)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.add_(NOISE * p.std() * torch.randn(p.shape, generator=g))
    staging = target.with_name(target.name + ".tmp")
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(policy).save_pretrained(staging)
    staging.rename(target)
    return target


def equal_length_rows(rows: list[dict]) -> tuple[list[dict], int]:
    """`rows` with every response cut to the shortest one's length L (token ids, no EOS then), and L."""
    length = min(len(r[side]) - r["prompt_len"] for r in rows for side in ("chosen_ids", "rejected_ids"))
    return [{**r, "chosen_ids": r["chosen_ids"][:r["prompt_len"] + length],
             "rejected_ids": r["rejected_ids"][:r["prompt_len"] + length]} for r in rows], length


# name, rlhfkit dpo.* keys, TRL (trainer, its settings), batch ("pairs": the fixed batch, "equal": its responses cut
# to one length)
CHECK_CASES = (
    ("sigmoid", {"loss": "sigmoid", "beta": BETA}, ("dpo", {"loss_type": ["sigmoid"], "beta": BETA}), "pairs"),
    ("cdpo", {"loss": "cdpo", "beta": BETA, "label_smoothing": 0.1},
     ("dpo", {"loss_type": ["sigmoid", "robust"], "loss_weights": [2 * 0.9, -0.8], "label_smoothing": 0.1,
              "beta": BETA}), "pairs"),
    ("ipo", {"loss": "ipo", "beta": BETA}, ("dpo", {"loss_type": ["ipo"], "beta": BETA}), "equal"),
    ("simpo", {"loss": "simpo", "beta": 2.0, "simpo_gamma": 0.5},
     ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 0.5}), "pairs"),
    ("simpo-smoothed", {"loss": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "label_smoothing": 0.1},
     ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 0.5, "label_smoothing": 0.1}),
     "pairs"),
)
TRL_ONLY = ("sigmoid, label_smoothing 0.1", ("dpo", {"loss_type": ["sigmoid"], "beta": BETA, "label_smoothing": 0.1}))


def report_check(**numbers) -> None:
    sys.stdout.write(harness.MARK + json.dumps(numbers) + "\n")
    sys.stdout.flush()


def grad_norm(model) -> float:
    import torch

    return torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()


def rlhfkit_check(args) -> None:
    """Each case's loss and gradient norm from rlhfkit's DPO step (see the module docstring)."""
    import torch

    torch.set_num_threads(args.threads)
    from rlhfkit.config.dpo_schema import DPOConfig
    from rlhfkit.config.fields import load_config
    from rlhfkit.engine.backends import make_engine
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.speed.registry import Target, plan_model
    from rlhfkit.stages.dpo import LossFn, Reference, compute_reference_logprobs, train_step, with_reference

    spec = json.loads(Path(args.spec).read_text())
    world = Path(args.world)
    policy_folder, reference_folder = world / args.size / "policy", Path(spec["reference"])
    out = {}
    for name, dpo, _, batch in CHECK_CASES:
        rows, length = (spec["rows"], None) if batch == "pairs" else equal_length_rows(spec["rows"])
        if name == "ipo":  # TRL's per-token IPO with beta == rlhfkit's IPO with beta / L, divided by L^2
            dpo = {**dpo, "beta": dpo["beta"] / length}
        cfg = load_config(DPOConfig, None, rlhfkit_overrides(policy_folder, Path(spec["pairs"]), args.out, len(rows),
                                                             dpo))
        engine = make_engine(cfg.engine, cfg.train)
        tok = load_tokenizer(str(policy_folder), cfg.load)
        policy = engine.prepare(load_causal_lm(str(policy_folder), cfg.load, tok), cfg.train, 1)
        plan = plan_model(Target(policy.module, "policy", "dpo", cfg, engine))  # as run_dpo decides it
        if cfg.dpo.uses_reference():
            frozen = engine.prepare_frozen(load_causal_lm(str(reference_folder), cfg.load, tok))
            reference = Reference(frozen, plan=plan_model(Target(frozen, "reference", "dpo", cfg, engine)))
            rows = with_reference(rows, compute_reference_logprobs(reference, rows, tok.pad_token_id, MICRO,
                                                                   engine.device))
        accumulated = {}
        engine_step = policy.step

        def step_after_measuring():  # the accumulated gradient, in float64, before clipping and the update
            accumulated["norm"] = grad_norm(policy.module)
            return engine_step()

        policy.step = step_after_measuring
        metrics = train_step(policy, rows, len(rows) // MICRO, MICRO, len(rows), tok.pad_token_id, engine,
                             LossFn(cfg.dpo), plan, Reference())
        scale = 1.0 / length ** 2 if name == "ipo" else 1.0
        out[name] = {"loss": metrics["loss"] * scale, "grad_norm": accumulated["norm"] * scale,
                     "engine_grad_norm": metrics["grad_norm"] * scale, "margin": metrics["margin"], "length": length}
    report_check(**out)


def trl_trainer(kind: str, settings: dict, world: Path, size: str, reference: Path, texts, out):
    """A DPOTrainer (the perturbed folder as its frozen ref_model) or CPOTrainer on `texts`, whole batch per step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = world / size / "policy"
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy)
    data = Dataset.from_list(texts)
    common = dict(output_dir=str(out), per_device_train_batch_size=len(texts), gradient_accumulation_steps=1,
                  max_length=MAX_LENGTH, bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
                  report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    if kind == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        config = CPOConfig(**common, **settings)
        return CPOTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(**common, precompute_ref_log_probs=False, **settings)
    return DPOTrainer(model=model, ref_model=AutoModelForCausalLM.from_pretrained(reference), args=config,
                      train_dataset=data, processing_class=tok)


def trl_batch(kind: str, trainer, rows: list[dict], batch: str):
    """The fixed batch through the trainer's own collator, after checking its tokenisation against rlhfkit's."""
    data = list(trainer.train_dataset)
    if kind == "cpo":  # CPOTrainer's own tokenisation: {chosen,rejected}_input_ids with -100 labels on the prompt
        trl_rows = [{"prompt_ids": r["chosen_input_ids"][:r["chosen_labels"].count(-100)],
                     "chosen_ids": r["chosen_input_ids"][r["chosen_labels"].count(-100):],
                     "rejected_ids": r["rejected_input_ids"][r["rejected_labels"].count(-100):]} for r in data]
        check_same_ids(trl_rows, rows)
        return trainer.data_collator(data)
    check_same_ids(data, rows)
    if batch == "equal":  # the responses cut to one length: TRL's collator on the cut ids
        cut, _ = equal_length_rows(rows)
        data = [{"prompt_ids": r["chosen_ids"][:r["prompt_len"]], "chosen_ids": r["chosen_ids"][r["prompt_len"]:],
                 "rejected_ids": r["rejected_ids"][r["prompt_len"]:]} for r in cut]
    return trainer.data_collator([{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in data])


def trl_check(args) -> None:
    """Each case's loss and gradient norm from TRL's own code path (see the module docstring)."""
    import torch

    torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.spec).read_text())
    world = Path(args.world)
    texts = [plain_template(json.loads(line)) for line in Path(spec["pairs"]).read_text().splitlines()]
    out = {}
    cases = [(name, trl, batch) for name, _, trl, batch in CHECK_CASES] + [(*TRL_ONLY, "pairs")]
    for name, (kind, settings), batch in cases:
        trainer = trl_trainer(kind, settings, world, args.size, Path(spec["reference"]), texts, args.out)
        inputs = trl_batch(kind, trainer, spec["rows"], batch)
        trainer.model.train()
        if kind == "cpo":
            loss, _ = trainer.get_batch_loss_metrics(trainer.model, inputs, train_eval="train")
        else:
            loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
        loss.backward()
        out[name] = {"loss": loss.item(), "grad_norm": grad_norm(trainer.model)}
    report_check(**out)


def check(args, trl_python: Path, world: Path) -> None:
    size = args.sizes.split(",")[0]
    with tempfile.TemporaryDirectory(prefix="bench_dpo_check_") as tmp:
        pairs = Path(tmp) / "pairs.jsonl"
        pairs.write_text("".join(pairs_file(world, args.pairs).read_text().splitlines(True)[:CHECK_PAIRS]))
        rows = rlhfkit_rows(world, size, pairs)
        spec = Path(tmp) / "check.json"
        reference = perturbed_reference(world, size)
        spec.write_text(json.dumps({"rows": rows, "pairs": str(pairs), "reference": str(reference)}))
        print(f"\n== --check: {size} model, one fixed batch of {CHECK_PAIRS} pairs (rlhfkit: micro-batches of {MICRO}; "
              f"TRL: one micro-batch), reference = the policy + {NOISE} x std noise ({reference})", flush=True)
        results = {}
        for name, python in (("rlhfkit", Path(sys.executable)), ("trl", trl_python)):
            cmd = worker_cmd(f"{name}-check", python, world, size, args, Path(tmp) / name) + ["--spec", str(spec)]
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **thread_env(args.threads)})
            lines = [line for line in done.stdout.splitlines() if line.startswith(harness.MARK)]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"{name} check failed ({done.returncode}):\n{done.stderr[-3000:]}")
            results[name] = json.loads(lines[-1][len(harness.MARK):])
    mine, theirs = results["rlhfkit"], results["trl"]
    labels = {"sigmoid": ("sigmoid, beta 0.1", "DPOTrainer sigmoid"),
              "cdpo": ("cdpo, beta 0.1, eps 0.1", "DPOTrainer 1.8 sigmoid - 0.8 robust, eps 0.1"),
              "ipo": ("ipo, beta 0.1 / L, / L^2 (L = {L})", "DPOTrainer ipo, beta 0.1 (per-token log-ratios)"),
              "simpo": ("simpo, beta 2, gamma 0.5", "CPOTrainer simpo, cpo_alpha 0"),
              "simpo-smoothed": ("simpo, beta 2, gamma 0.5, eps 0.1", "CPOTrainer simpo, cpo_alpha 0, eps 0.1")}
    print("| loss | rlhfkit | TRL 1.16.0 | rlhfkit loss | TRL loss | rel. diff | rlhfkit grad norm | TRL grad norm | "
          "rel. diff | <= 1e-4 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, *_ in CHECK_CASES:
        m, t = mine[name], theirs[name]
        dl = abs(m["loss"] - t["loss"]) / abs(t["loss"])
        dg = abs(m["grad_norm"] - t["grad_norm"]) / t["grad_norm"]
        ours, trls = labels[name]
        print(f"| {name} | {ours.format(L=m['length'])} | {trls} | {m['loss']:.8f} | {t['loss']:.8f} | {dl:.1e} | "
              f"{m['grad_norm']:.8f} | {t['grad_norm']:.8f} | {dg:.1e} | {harness.met(max(dl, dg), 1e-4)} |")
    only = theirs[TRL_ONLY[0]]
    print(f"  TRL DPOTrainer sigmoid with label_smoothing 0.1: loss {only['loss']:.8f}, grad norm "
          f"{only['grad_norm']:.8f} (= its plain sigmoid: TRL 1.16 ignores label_smoothing there)")
    print(f"  rlhfkit's implicit-reward margin at step 0 (sigmoid): {mine['sigmoid']['margin']:.4f} "
          f"(0 would mean the reference equals the policy)")
    engine = mine["sigmoid"]["engine_grad_norm"]
    print(f"  grad norms above: sqrt(sum of squares) in float64 on both sides. The norm rlhfkit's step reports "
          f"(torch's float32 clip_grad_norm_, as TRL's Trainer logs it) is {engine:.8f} for sigmoid: "
          f"{abs(engine - mine['sigmoid']['grad_norm']) / mine['sigmoid']['grad_norm']:.1e} off, from float32 "
          f"accumulation over the 524k-entry embedding gradient")


# ------------------------------------------------------------------------------------------ parent


def worker_cmd(system: str, python: Path, world: Path, size: str, args, out: Path) -> list[str]:
    return [str(python), str(Path(__file__).resolve()), "--worker", system, "--world", str(world), "--size", size,
            "--pairs", str(args.pairs), "--threads", str(args.threads), "--out", str(out),
            "--reference", args.reference]


def compare(world: Path, trl_python: Path, size: str, args, tmp: Path) -> dict:
    print(f"\n== {size} model, {args.pairs} pairs per step in micro-batches of {MICRO} pairs, max length {MAX_LENGTH}, "
          f"reference: {args.reference} ({args.warmup} warm-up + {args.iters} measured iterations each, "
          f"{args.threads} thread(s))", flush=True)
    expected = tmp / f"rows-{size}.json"
    rows = rlhfkit_rows(world, size, pairs_file(world, args.pairs))
    expected.write_text(json.dumps(rows))
    harness.uncache_libraries(Path(sys.prefix), trl_python.parent.parent)  # the same start for both (peak RSS)
    workers = [harness.Worker(name, worker_cmd(name, py, world, size, args, tmp / f"{name}-{size}")
                              + ["--spec", str(expected)], tmp / f"{name}-{size}.log", thread_env(args.threads))
               for name, py in (("rlhfkit", Path(sys.executable)), ("trl", trl_python))]
    results = harness.run_lockstep(workers, args.warmup, args.iters)
    mine, theirs = harness.summarise(results["rlhfkit"]), harness.summarise(results["trl"])
    for summary, reports in ((mine, results["rlhfkit"]), (theirs, results["trl"])):
        summary["cpu_seconds"] = harness.median(r["cpu_seconds"] for r in reports)
    # the same iteration of both runs back to back: their ratio sees the same background load
    paired = [a["seconds"] / b["seconds"] for a, b in zip(results["rlhfkit"], results["trl"])]
    tokens = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)
    row = {"size": size, "pairs": args.pairs, "micro": MICRO, "tokens": tokens, "threads": args.threads,
           "trl_version": TRL_VERSION, "reference": args.reference, "rlhfkit": mine, "trl": theirs,
           "time_ratio": mine["seconds"] / theirs["seconds"], "cpu_time_ratio": mine["cpu_seconds"] /
           theirs["cpu_seconds"], "paired_ratio": harness.median(paired), "memory_ratio": mine["peak_mb"] /
           theirs["peak_mb"]}
    last = {name: results[name][-1] for name in results}
    print(f"  the work: {tokens} tokens per step ({len(rows)} pairs); after the last step, implicit-reward margin "
          f"rlhfkit {last['rlhfkit']['margin']:.4f}, TRL {last['trl']['margin']:.4f}")
    print(f"  rlhfkit / TRL per iteration (each pair of iterations back to back): median {row['paired_ratio']:.2f}x, "
          f"range {min(paired):.2f}-{max(paired):.2f}x; CPU time per step {mine['cpu_seconds']:.3f} vs "
          f"{theirs['cpu_seconds']:.3f} s: {row['cpu_time_ratio']:.2f}x")
    return row


def print_table(rows: list[dict]) -> None:
    print(f"\n| model | pairs x micro | tokens/step | rlhfkit s/step | TRL {TRL_VERSION} s/step | time ratio | "
          "CPU-time ratio | rlhfkit pairs/s | TRL pairs/s | rlhfkit peak RSS MiB | TRL peak RSS MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, t, n = r["rlhfkit"], r["trl"], r["pairs"]
        print(f"| {r['size']} | {n} x {r['micro']} | {r['tokens']} | {a['seconds']:.3f} | {t['seconds']:.3f} | "
              f"**{r['time_ratio']:.2f}x** | {r['cpu_time_ratio']:.2f}x | {n / a['seconds']:.1f} | "
              f"{n / t['seconds']:.1f} | {a['peak_mb']:.0f} | {t['peak_mb']:.0f} | **{r['memory_ratio']:.2f}x** |")
    print()
    harness.print_targets(rows, TARGET_TIME, TARGET_MEMORY)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the default config, 1 warm-up + 4 measured iterations")
    p.add_argument("--sizes", default="5M", help="comma-separated model sizes (5M, 20M)")
    p.add_argument("--iters", type=int, default=8, help="measured iterations per system (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pairs", type=int, default=PAIRS, help="pairs per optimizer step (the whole data set)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, the same for both systems (1: steadier on a shared machine)")
    p.add_argument("--reference", choices=("precompute", "frozen"), default="precompute",
                   help="both systems' reference: log-probs precomputed before training (default: rlhfkit's default, "
                        "TRL's fastest) or a frozen copy run in every micro-batch (TRL's default; rlhfkit "
                        "dpo.precompute_reference=false)")
    p.add_argument("--check", action="store_true", help="compare loss and gradient norm of one fixed batch instead")
    p.add_argument("--json", help="also write the results here")
    # worker mode (internal)
    p.add_argument("--worker", choices=("rlhfkit", "trl", "rlhfkit-check", "trl-check"))
    p.add_argument("--world"), p.add_argument("--size"), p.add_argument("--out"), p.add_argument("--spec")
    args = p.parse_args()
    if args.worker:
        {"rlhfkit": rlhfkit_worker, "trl": trl_worker, "rlhfkit-check": rlhfkit_check,
         "trl-check": trl_check}[args.worker](args)
        return
    harness.reexec_in_project_venv()
    if args.pairs % MICRO or args.pairs < CHECK_PAIRS:
        raise SystemExit(f"--pairs must be a multiple of the micro-batch size {MICRO}, at least {CHECK_PAIRS}")

    trl_python = harness.ensure_trl_venv(venv=TRL_VENV, version=TRL_VERSION)
    world = harness.build_world()
    if args.check:
        check(args, trl_python, world)
        return
    harness.run_comparisons(args, "bench_dpo_", lambda tmp: [
        compare(world, trl_python, size, args, tmp) for size in args.sizes.split(",")], print_table)


if __name__ == "__main__":
    main()
