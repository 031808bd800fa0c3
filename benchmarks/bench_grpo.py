"""rlhfkit's GRPO against the newest TRL's GRPOTrainer (1.16.0) on identical work, side by side.

    python benchmarks/bench_grpo.py            # 5M model, 8 prompts x 4 samples, 32-token responses, 2 + 8 iterations
    python benchmarks/bench_grpo.py --quick    # the same config, 1 warm-up + 4 measured iterations
    python benchmarks/bench_grpo.py --sizes 5M,20M --iters 6
    python benchmarks/bench_grpo.py --check    # the loss of one fixed batch, computed by both (no timing)
    python benchmarks/bench_grpo.py --gpu --sizes 1B --vllm --trl-python PY   # on a CUDA GPU (bf16), both
                                               # sampling with a colocated vLLM (benchmarks/gpu_run.sh: grpo-vllm)
    --threads N sets torch's threads for both systems (default 1: steadier on a shared machine)

TRL runs in its own venv, benchmarks/.venv-trl-grpo (torch 2.13.0 pinned first, then trl==1.16.0), built once by
harness.ensure_trl_venv; bench_ppo's benchmarks/.venv-trl keeps TRL 1.12.0 (the last TRL with PPO).

Identical work, per iteration (one optimizer step): P prompts (the dataset is exactly one batch, so every
iteration rolls out the same prompt set; TRL gets rlhfkit's rendered prompt text, checked to tokenise to the
same ids), G samples per prompt (P x G samples), responses of exactly R tokens (rlhfkit: gen.min_new_tokens =
gen.max_new_tokens = R; TRL: generation_kwargs min_new_tokens = max_completion_length = R, so EOS cannot end a
response early), temperature 1, the same model folder as actor and frozen reference, float32, no gradient
checkpointing, micro-batches of 8 for the forward + backward (TRL: per_device_train_batch_size 8,
gradient_accumulation_steps = steps_per_generation = P x G / 8, one generate() call for the whole generation
batch, as rlhfkit's default). The reference's no-grad forward: rlhfkit takes the whole batch at once
(ppo.forward_batch_size = P x G, its own setting for that pass); TRL ties it to per_device_train_batch_size.
one optimizer step per rollout (TRL num_iterations=1; rlhfkit ppo.epochs=1, mini-batch = the whole batch), AdamW
with lr 1e-6 constant, betas (0.9, 0.95), no weight decay, grad-norm clip 1.0. The reward is `length_reward`
below, the same Python function for both (characters of the decoded response / 100).

The objective, the same math on both sides:
  advantages  (r - group mean) / (group std + eps), unbiased std (rlhfkit ppo.advantage_estimator=grpo with
              ppo.grpo_scale_by_std=true; TRL scale_rewards="group"), no reward clipping (ppo.score_clip=null);
  policy      PPO clipped surrogate, eps 0.2 both sides, token-level ratio (TRL importance_sampling_level=token);
  KL          a k3 KL-to-reference loss term with coefficient beta = 0.04 (rlhfkit ppo.kl_loss_coef, no KL in the
              reward: ppo.kl_coef=0; TRL beta, with use_bias_correction_kl=False, since rlhfkit's k3 term is not
              multiplied by the importance ratio: TRL's default True changes the KL gradient, not its value);
  aggregation the sum over all valid tokens of the step's batch / their number: rlhfkit
              ppo.loss_aggregation=token-mean (normalised over the whole mini-batch, not per micro-batch) and TRL
              loss_type="dapo" (normalised by the generation batch's token count); both add the KL per token
              before that mean. With fixed-length responses every aggregation gives the same value anyway.
Left different: the eps in the advantage's denominator (TRL hard-codes 1e-4, rlhfkit's loop uses
grpo_advantages' 1e-6; it only matters for groups with a std near 0), and the sampled tokens themselves (each
system draws its own random numbers).

Each system runs in its own subprocess; the two advance one iteration at a time in turn (harness.Lockstep), the
first iterations are warm-up and the medians of the rest are compared. rlhfkit runs its real loop
(stages.ppo.run_ppo with ppo.advantage_estimator=grpo) with a timing hook on its metrics logger, TRL runs
GRPOTrainer.train() with a callback (on_train_begin / on_step_end).

--check: one fixed batch, made in the parent (seeded): P prompts (rlhfkit's token ids) x G completions of R token
ids drawn uniformly from the non-special tokens, rewards = length_reward of the decoded completions, and a
seeded per-token shift d ~ N(0, 0.1^2). Each system, at the models' step-0 weights, takes log pi of the
completions with grad, old log-probs = those values detached (ratio 1), reference log-probs = those values + d
(so the k3 term is not 0), and prints its loss and the global gradient norm of the actor after backward:
  rlhfkit  rlhfkit.algos.group.grpo_advantages + rlhfkit.algos.losses.policy_loss(aggregation="token-mean")
           + beta * token mean of rlhfkit.algos.kl.kl_penalty(kind="k3"), log-probs from rlhfkit's causal_logits
           (printed with TRL's eps 1e-4, and with rlhfkit's default 1e-6);
  TRL      GRPOTrainer._generate_and_score_completions on the batch (generate() replaced by the fixed completion
           ids; TRL tokenises the prompts, runs length_reward, computes the group advantages and the reference's
           log-probs itself), the reference log-probs then shifted by the same d, then GRPOTrainer._compute_loss
           on the whole batch as one micro-batch (the loss.backward() of a training step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_ppo import thread_env  # noqa: E402

TRL_VERSION = "1.16.0"  # the newest TRL on the registry when this was written
TRL_VENV = harness.HERE / ".venv-trl-grpo"
PROMPTS, GROUP, RESPONSE = 8, 4, 32  # P prompts x G samples each, R-token responses
MICRO = 8
LR = 1e-6
BETA = 0.04
VLLM_MEMORY = 0.2  # --vllm: the GPU memory share of each colocated engine (both systems are loaded at once)
CLIP = 0.2
PHASES = ("generate", "reward", "reference", "actor_update")
TARGET_TIME, TARGET_MEMORY = 0.5, 0.8


def length_reward(prompts, completions, **kwargs) -> list[float]:
    """The reward of both systems: characters of the decoded response / 100. rlhfkit calls it as
    `fn(prompt_texts, response_texts, **row_fields)`, TRL as `fn(prompts=, completions=, completion_ids=, ...)`."""
    return [len(text) / 100 for text in completions]


# ------------------------------------------------------------------------------------------ workers


def rlhfkit_worker(args) -> None:
    """rlhfkit's real loop (run_ppo, GRPO estimator), in lock-step with the parent (harness.rlhfkit_lockstep)."""
    overrides = rlhfkit_overrides(Path(args.world), args.size, args.prompts, args.group, args.response, args.out)
    harness.rlhfkit_lockstep(overrides + args.extra, args.threads,
                             report={"reward": "reward/mean", "response_length": "response_length"})


def rlhfkit_overrides(world: Path, size: str, prompts: int, group: int, response: int, out) -> list[str]:
    """The `rlhfkit ppo` settings of the identical work (see the module docstring)."""
    return [f"actor={world / size / 'policy'}", f"reward={Path(__file__).resolve()}:length_reward",
            f"data.prompts={harness.prompt_rows(world, prompts)}", "data.eval_fraction=0", f"output_dir={out}",
            f"train.batch_size={prompts}", f"train.micro_batch_size={MICRO}", "train.max_steps=100000",
            f"train.lr={LR}", "train.warmup_steps=0", "train.scheduler=constant", "train.weight_decay=0",
            "train.max_grad_norm=1.0", "train.save_every=0", "train.eval_every=0", "train.log_every=1",
            f"gen.max_new_tokens={response}", f"gen.min_new_tokens={response}", "gen.temperature=1.0",
            "ppo.advantage_estimator=grpo", f"ppo.n_samples_per_prompt={group}", "ppo.grpo_scale_by_std=true",
            "ppo.kl_coef=0", f"ppo.kl_loss_coef={BETA}", f"ppo.clip_eps={CLIP}", "ppo.epochs=1",
            "ppo.mini_batch_size=0", "ppo.loss_aggregation=token-mean", "ppo.score_clip=null",
            "ppo.sample_every=0", "log.tensorboard=false", "log.progress=false",
            f"ppo.forward_batch_size={prompts * group}"]


def trl_prompts(world: Path, prompts: int, tok) -> list[str]:
    """rlhfkit's rendered prompts as text that TRL's tokenizer call turns back into exactly rlhfkit's ids."""
    ids = json.loads(harness.tokenized_prompts(world, prompts).read_text())
    texts = [tok.decode(row, skip_special_tokens=True) for row in ids]
    again = tok(texts)["input_ids"]
    bad = [i for i, (a, b) in enumerate(zip(again, ids)) if list(a) != list(b)]
    if bad:
        raise SystemExit(f"prompt(s) {bad} do not tokenise back to rlhfkit's ids in TRL's venv")
    return texts


def trl_config(args, out, batch: int, accumulation: int):
    """GRPOConfig of the identical work; `batch` per micro-batch, `accumulation` micro-batches per step."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=args.group, max_completion_length=args.response,
        generation_kwargs={"min_new_tokens": args.response}, temperature=1.0, top_p=1.0, top_k=0,
        beta=BETA, use_bias_correction_kl=False, loss_type="dapo", scale_rewards="group", num_iterations=1,
        epsilon=CLIP, importance_sampling_level="token", mask_truncated_completions=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, max_grad_norm=1.0, max_steps=100000, bf16=harness.on_gpu(), fp16=False,
        gradient_checkpointing=False, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=1234,
        use_cpu=not harness.on_gpu(), dataloader_num_workers=0, log_completions=False,
        # --vllm: TRL's colocated vLLM (its own weight sync), the share of GPU memory rlhfkit's engine gets too
        use_vllm=args.vllm, **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": VLLM_MEMORY}
                               if args.vllm else {}))


def trl_trainer(args, config, callbacks=()):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    world = Path(args.world)
    policy = world / args.size / "policy"
    tok = AutoTokenizer.from_pretrained(policy, padding_side="left")
    data = Dataset.from_dict({"prompt": trl_prompts(world, args.prompts, tok)})
    return GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(policy), reward_funcs=[length_reward],
                       args=config, train_dataset=data, processing_class=tok, callbacks=list(callbacks))


def trl_worker(args) -> None:
    """TRL's GRPOTrainer.train(); a callback waits for "go" at train begin and after each optimizer step."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import TrainerCallback

    step = harness.Lockstep()

    trainer = None

    class Timing(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            step.wait()

        def on_step_end(self, *a, **kw):
            metrics = trainer._metrics["train"]  # this step's, until the log() that follows on_step_end
            step.report(reward=metrics["reward"][-1], response_length=metrics["completions/mean_length"][-1])
            step.wait()

    samples = args.prompts * args.group
    config = trl_config(args, args.out, MICRO, samples // MICRO)
    trainer = trl_trainer(args, config, [Timing()])
    trainer.train()


# ------------------------------------------------------------------------------------------ --check workers


def report_check(**numbers) -> None:
    sys.stdout.write(harness.MARK + json.dumps(numbers) + "\n")
    sys.stdout.flush()


def grad_norm(model) -> float:
    import torch

    return torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()


def rlhfkit_check(args) -> None:
    """The GRPO loss of the fixed batch from rlhfkit's algos (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhfkit.algos import broadcast_to_tokens, masked_mean, token_logprobs
    from rlhfkit.algos.group import grpo_advantages
    from rlhfkit.algos.kl import kl_penalty
    from rlhfkit.algos.losses import policy_loss
    from rlhfkit.data.tokenize import pad_sequences
    from rlhfkit.models.forward import causal_logits

    torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.spec).read_text())
    model = AutoModelForCausalLM.from_pretrained(Path(args.world) / args.size / "policy")
    model.train()
    n = spec["group"]
    prompts = [row for row in spec["prompt_ids"] for _ in range(n)]  # G consecutive samples per prompt
    prompt_ids = pad_sequences(prompts, spec["pad_id"], side="left")
    prompt_mask = pad_sequences([[1] * len(p) for p in prompts], 0, side="left")
    completion = torch.tensor(spec["completion_ids"])  # (B, R)
    mask = torch.ones_like(completion, dtype=torch.float32)
    width = completion.size(1)
    logits = causal_logits(model, torch.cat([prompt_ids, completion], 1),
                           torch.cat([prompt_mask, torch.ones_like(completion)], 1), keep=width + 1)[:, :-1]
    logp = token_logprobs(logits, completion)  # (B, R), with grad
    ref = logp.detach() + torch.tensor(spec["ref_shift"])
    rewards = torch.tensor(spec["rewards"])
    out = {}
    for eps in (1e-4, 1e-6):  # TRL's hard-coded eps, then grpo_advantages' default (rlhfkit's loop)
        advantages = broadcast_to_tokens(grpo_advantages(rewards, n, eps=eps), mask)
        pg, _ = policy_loss(logp, logp.detach(), advantages, mask, CLIP, aggregation="token-mean")
        kl = masked_mean(kl_penalty(logp, ref, "k3"), mask)
        loss = pg + BETA * kl
        model.zero_grad()
        loss.backward(retain_graph=True)
        out[f"eps{eps:g}"] = {"loss": loss.item(), "policy_loss": pg.item(), "kl": kl.item(),
                              "grad_norm": grad_norm(model)}
    report_check(rewards=rewards.tolist(), **out)


def trl_check(args) -> None:
    """The GRPO loss of the fixed batch from TRL's own code path (see the module docstring)."""
    import torch

    torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.spec).read_text())
    samples = args.prompts * args.group
    trainer = trl_trainer(args, trl_config(args, args.out, samples, 1))
    completions = spec["completion_ids"]

    def fixed_generation(prompt_ids, *a, **kw):
        expected = [row for row in spec["prompt_ids"] for _ in range(args.group)]
        if [list(p) for p in prompt_ids] != expected:
            raise SystemExit("TRL tokenised the prompts differently from rlhfkit")
        return [list(c) for c in completions], None

    trainer._generate_single_turn = fixed_generation
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # the whole batch is one micro-batch of one step
    texts = trl_prompts(Path(args.world), args.prompts, trainer.processing_class)
    inputs = [{"prompt": text} for text in texts for _ in range(args.group)]
    batch = trainer._generate_and_score_completions(inputs)
    batch["ref_per_token_logps"] = batch["ref_per_token_logps"] + torch.tensor(spec["ref_shift"])
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    metrics = trainer._metrics["train"]
    report_check(loss=loss.item(), kl=metrics["kl"][-1], grad_norm=grad_norm(trainer.model),
                 rewards=list(trainer._logs["rewards"]["length_reward"])[-samples:],
                 advantages=batch["advantages"].tolist())


def make_check_spec(world: Path, size: str, prompts: int, group: int, response: int, target: Path) -> Path:
    """The fixed batch: prompt ids, uniformly drawn completion ids, their rewards, the reference shift."""
    import torch
    from rlhfkit.models import load_tokenizer

    tok = load_tokenizer(str(world / size / "policy"), padding_side="left")
    prompt_ids = json.loads(harness.tokenized_prompts(world, prompts).read_text())
    g = torch.Generator().manual_seed(0)
    special = max(tok.all_special_ids) + 1
    completion = torch.randint(special, len(tok), (prompts * group, response), generator=g)
    texts = tok.batch_decode(completion.tolist(), skip_special_tokens=True)
    shift = 0.1 * torch.randn(prompts * group, response, generator=g)
    target.write_text(json.dumps({"prompt_ids": prompt_ids, "completion_ids": completion.tolist(),
                                  "rewards": length_reward(None, texts), "ref_shift": shift.tolist(),
                                  "group": group, "pad_id": tok.pad_token_id}))
    return target


def check(args, trl_python: Path, world: Path) -> None:
    size = args.sizes.split(",")[0]
    print(f"\n== --check: {size} model, one fixed batch of {args.prompts} prompts x {args.group} completions of "
          f"{args.response} tokens, beta {BETA}, clip {CLIP}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_grpo_check_") as tmp:
        spec = make_check_spec(world, size, args.prompts, args.group, args.response, Path(tmp) / "batch.json")
        results = {}
        for name, python in (("rlhfkit", Path(sys.executable)), ("trl", trl_python)):
            cmd = worker_cmd(f"{name}-check", python, world, size, args, Path(tmp) / name) + ["--spec", str(spec)]
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **thread_env(args.threads)})
            lines = [line for line in done.stdout.splitlines() if line.startswith(harness.MARK)]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"{name} check failed ({done.returncode}):\n{done.stderr[-3000:]}")
            results[name] = json.loads(lines[-1][len(harness.MARK):])
    mine, theirs = results["rlhfkit"], results["trl"]
    reward_gap = max(abs(a - b) for a, b in zip(mine["rewards"], theirs["rewards"]))
    print(f"  rewards: max |rlhfkit - TRL| = {reward_gap:.2e} over {len(mine['rewards'])} samples")
    print("| computed by | loss | k3 KL (token mean) | actor grad norm |")
    print("|---|---|---|---|")
    for key, label in (("eps0.0001", "rlhfkit, advantage eps 1e-4 (TRL's)"),
                       ("eps1e-06", "rlhfkit, advantage eps 1e-6 (its loop's)")):
        m = mine[key]
        print(f"| {label} | {m['loss']:.8f} | {m['kl']:.8f} | {m['grad_norm']:.8f} |")
    print(f"| TRL {TRL_VERSION} GRPOTrainer._compute_loss | {theirs['loss']:.8f} | {theirs['kl']:.8f} | "
          f"{theirs['grad_norm']:.8f} |")
    same = mine["eps0.0001"]
    print(f"  |loss difference| {abs(same['loss'] - theirs['loss']):.2e}, relative grad-norm difference "
          f"{abs(same['grad_norm'] - theirs['grad_norm']) / theirs['grad_norm']:.2e} (same eps)")


# ------------------------------------------------------------------------------------------ parent


def worker_cmd(system: str, python: Path, world: Path, size: str, args, out: Path) -> list[str]:
    extra = list(args.extra)
    if harness.on_gpu() and system == "rlhfkit":
        extra.append("engine.precision=bf16")  # TRL: bf16=True (trl_config)
    if args.vllm and system == "rlhfkit":
        extra += ["rollout.engine=vllm", f"rollout.memory={VLLM_MEMORY}"]
    return [str(python), str(Path(__file__).resolve()), "--worker", system, "--world", str(world), "--size", size,
            "--prompts", str(args.prompts), "--group", str(args.group), "--response", str(args.response),
            "--threads", str(args.threads), "--out", str(out)] + [f"--extra={e}" for e in extra] + \
        (["--vllm"] if args.vllm else [])


def compare(world: Path, trl_python: Path, size: str, args, tmp: Path) -> dict:
    samples = args.prompts * args.group
    print(f"\n== {size} model, {args.prompts} prompts x {args.group} samples = {samples} per step, response "
          f"{args.response} ({args.warmup} warm-up + {args.iters} measured iterations each, {args.threads} "
          f"thread(s))", flush=True)
    harness.uncache_libraries(Path(sys.prefix), trl_python.parent.parent)  # the same start for both (peak RSS)
    workers = [harness.Worker(name, worker_cmd(name, py, world, size, args, tmp / f"{name}-{size}"),
                              tmp / f"{name}-{size}.log", thread_env(args.threads))
               for name, py in (("rlhfkit", Path(sys.executable)), ("trl", trl_python))]
    results = harness.run_lockstep(workers, args.warmup, args.iters)
    mine, theirs = harness.summarise(results["rlhfkit"]), harness.summarise(results["trl"])
    row = {"size": size, "prompts": args.prompts, "group": args.group, "samples": samples,
           "response": args.response, "threads": args.threads, "trl_version": TRL_VERSION, "rlhfkit": mine,
           "trl": theirs, "time_ratio": mine["seconds"] / theirs["seconds"],
           "memory_ratio": mine["peak_mb"] / theirs["peak_mb"]}
    work = {name: {k: harness.median(r[k] for r in results[name] if r.get(k) is not None)
                   for k in ("response_length", "reward")} for name in results}
    print(f"  the work (medians): response tokens rlhfkit {work['rlhfkit']['response_length']:.1f}, TRL "
          f"{work['trl']['response_length']:.1f}; mean reward rlhfkit {work['rlhfkit']['reward']:.3f}, TRL "
          f"{work['trl']['reward']:.3f}")
    phases = mine["phases"]
    if phases:
        total = phases.get("iteration", mine["seconds"])
        print("  rlhfkit phases (median s): " + ", ".join(
            f"{k} {phases[k]:.3f} ({100 * phases[k] / total:.0f}%)" for k in PHASES if k in phases))
    return row


def print_table(rows: list[dict]) -> None:
    print(f"\n| model | prompts x samples | response | rlhfkit s/step | TRL {TRL_VERSION} s/step | time ratio | "
          "rlhfkit samples/s | TRL samples/s | rlhfkit peak RSS MiB | TRL peak RSS MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, t, n = r["rlhfkit"], r["trl"], r["samples"]
        print(f"| {r['size']} | {r['prompts']} x {r['group']} | {r['response']} | {a['seconds']:.3f} | "
              f"{t['seconds']:.3f} | **{r['time_ratio']:.2f}x** | {n / a['seconds']:.1f} | {n / t['seconds']:.1f} | "
              f"{a['peak_mb']:.0f} | {t['peak_mb']:.0f} | **{r['memory_ratio']:.2f}x** |")
    print()
    harness.print_targets(rows, TARGET_TIME, TARGET_MEMORY)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the default config, 1 warm-up + 4 measured iterations")
    p.add_argument("--sizes", default="5M", help="comma-separated model sizes (5M, 20M)")
    p.add_argument("--iters", type=int, default=8, help="measured iterations per system (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per step (P)")
    p.add_argument("--group", type=int, default=GROUP, help="samples per prompt (G)")
    p.add_argument("--response", type=int, default=RESPONSE, help="response tokens (R, fixed length)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, the same for both systems (1: steadier on a shared machine)")
    p.add_argument("--check", action="store_true", help="compare the loss of one fixed batch instead of timing")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--gpu", action="store_true", help="on the machine's CUDA GPU, bf16 mixed precision (sizes 1B)")
    p.add_argument("--vllm", action="store_true", help="both sample with a colocated vLLM engine: rlhfkit "
                                                       "rollout.engine=vllm, TRL use_vllm with vllm_mode=colocate")
    p.add_argument("--trl-python", help="an interpreter that imports TRL 1.16.0 (instead of its venv)")
    # worker mode (internal)
    p.add_argument("--worker", choices=("rlhfkit", "trl", "rlhfkit-check", "trl-check"))
    p.add_argument("--world"), p.add_argument("--size"), p.add_argument("--out"), p.add_argument("--spec")
    p.add_argument("--extra", action="append", default=[])
    args = p.parse_args()
    if args.worker:
        {"rlhfkit": rlhfkit_worker, "trl": trl_worker, "rlhfkit-check": rlhfkit_check,
         "trl-check": trl_check}[args.worker](args)
        return
    harness.reexec_in_project_venv()
    if (args.prompts * args.group) % MICRO:
        raise SystemExit(f"prompts x group must be a multiple of the micro-batch size {MICRO}")

    if args.gpu:
        harness.enter_gpu_mode()
    trl_python = Path(args.trl_python) if args.trl_python else harness.ensure_trl_venv(venv=TRL_VENV,
                                                                                       version=TRL_VERSION)
    world = harness.build_world()
    for size in args.sizes.split(","):
        if size in harness.GPU_SIZES:
            if not args.gpu:
                raise SystemExit(f"size {size} is built on a GPU: add --gpu")
            harness.add_gpu_model(world, size)
        harness.tokenized_prompts(world, args.prompts, size)
    if args.check:
        check(args, trl_python, world)
        return
    harness.run_comparisons(args, "bench_grpo_", lambda tmp: [
        compare(world, trl_python, size, args, tmp) for size in args.sizes.split(",")], print_table)


if __name__ == "__main__":
    main()
