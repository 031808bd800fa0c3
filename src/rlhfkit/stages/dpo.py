"""`rlhfkit dpo`: offline preference optimisation (DPO, cDPO, IPO, SimPO, + RPO's NLL) from an SFT model.

Read top to bottom: the pairs (the RM step's data layer and cache), the policy, the reference log-probs, the
loop, the export. The policy is trained on the preference pairs directly, with the loss `dpo.loss` names in
`registry.preference.PREFERENCE_LOSSES`; no reward model, no sampling. A pair's prompt goes through the model once
for both of its responses (`sequence_logprobs`).

Each loss reads, per pair, the summed log-probs of the chosen and rejected responses (prompt tokens excluded)
under the policy and under the frozen reference (the SFT weights). The reference is fixed, so its log-probs are
computed once, before training (`dpo.precompute_reference`), and cached next to the tokenised data, keyed by
the reference folder's files and the tokenised rows: the next run on the same data, and `--resume`, read them
back. Which model computes them, holding no second copy where it can:
- LoRA: the policy with its adapter disabled (it holds the base weights unchanged);
- no LoRA, a fresh run: the policy itself, before its first step (its weights are still the SFT weights);
- otherwise (no LoRA and a resumed run without a cache entry, or `dpo.precompute_reference=false`): a frozen
  copy (`engine.prepare_frozen`), dropped after the pass when precomputing.
With `dpo.precompute_reference=false` the reference runs in every micro-batch instead. Under DeepSpeed every
rank computes the reference log-probs of all rows (ZeRO-3 forwards are collectives, so all ranks must run the
same forwards); the pass is one forward over the data, once.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from rlhfkit.accel import grad_in_place
from rlhfkit.algos import PairLogps, linear_token_logprobs, masked_sum, token_logprobs
from rlhfkit.config.dpo_schema import DPOConfig, DPOSection
from rlhfkit.data import cache
from rlhfkit.data.loader import skipped_rows
from rlhfkit.data.tokenize import collate_preferences, collate_prompt_sharing_pairs, pad_sequences
from rlhfkit.errors import ModelError
from rlhfkit.metric_names import EVAL_ACCURACY, EVAL_PREFIX, TIME_STEP
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.models.forward import (causal_logits, final_hidden, head_logprobs_weight, head_matmul, masked_logits,
                                    mixed_precision, position_ids)
from rlhfkit.models.prefix import shared_prefix_logits
from rlhfkit.models.loading import causal_lm_config, record_template
from rlhfkit.lora import adapter_disabled, apply_lora, checkpointed, is_lora
from rlhfkit.registry.preference import preference_loss
from rlhfkit.run_files import final_dir
from rlhfkit.models.plan import ModelPlan
from rlhfkit.speed.registry import Target, plan_line, plan_model
from rlhfkit.stages.advice import lora_rate_note
from rlhfkit.stages.common import MetricsLogger, epoch_order, longest_first, plan_steps, write_run_report
from rlhfkit.stages.guard import resume_state
from rlhfkit.stages.loop import TrainLoop
from rlhfkit.stages.reward import pair_means
from rlhfkit.stages.run_dir import prepare_output_dir, resumed_from, undone_if_bad_input_at_start
from rlhfkit.stages.start import start_stage

REF_KEY = "ref"  # a row's reference log-probs [chosen, rejected], attached when precomputed


# ---------------------------------------------------------------------------------------------- log-probs


def logprob_forward(model, plan) -> str:
    """Which forward `sequence_logprobs` takes for `model` under its speed plan: "packed" where the plan packs a
    pair's sequences under a custom attention mask (`plan.pair_packing`), else "shared-prompt" where it shares the
    prompt through a KV cache (`plan.shared_prompt`, not under gradient checkpointing) and "full" otherwise. The
    reference cache's key names it: the forwards agree only up to float rounding, which step 0's exact zero rewards
    would show."""
    if plan.pair_packing:
        return "packed"
    return "shared-prompt" if plan.shared_prompt and not checkpointed(model) else "full"


def sequence_logprobs(model, rows: list[dict], pad_id: int, device, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the response tokens and their counts, each (2B,): chosen rows then rejected rows.
    A row's response is its tokens from `prompt_len` on. The forward is the one `model`'s speed plan takes
    (`logprob_forward`; the plain transformers forward of the whole sequences without one).

    A pair's chosen and rejected sequences share their prompt, which goes through the model once. Where the
    model takes a custom attention mask (sdpa, eager: `logprob_forward` "packed"), each pair is one
    `[prompt | chosen | rejected]` segment, segments are packed into rows without padding, and the mask keeps
    each response to its prompt and itself (`data.tokenize.collate_prompt_sharing_pairs`): every token once, no
    padding, the LM head on the scored positions only. Otherwise the B prompts run once and the 2B responses
    attend to their KV cache (`prefix.shared_prefix_logits`); the prompt's last token runs with the responses,
    so every scored logit comes from one LM-head matmul over all response rows, as in the full forward (a
    few-row matmul for the prompts' last positions rounds differently with the weights' memory alignment: a LoRA
    policy with its adapter disabled would differ from a frozen copy by an ulp). Under gradient checkpointing
    (`checkpointed`), or for a model without a plain full-attention cache, it is ONE (2B, T) right-padded forward
    of the whole sequences. All of them give the full forward's values and gradients up to float rounding.

    Where the plan runs the LM head in chunks (`forward.head_logprobs_weight`, the `dpo.chunked_logprobs` setting),
    each of them takes the hidden states instead of the logits, and the LM head runs in chunks on the response
    tokens only (`algos.linear_token_logprobs`): no (tokens x vocabulary) logits, log-softmax or logit gradient are
    held."""
    weight = head_logprobs_weight(model, plan)
    chunked = weight is not None
    grad_target = grad_in_place.target if plan.grad_in_place else None
    if logprob_forward(model, plan) == "packed" and min(r["prompt_len"] for r in rows) >= 1:
        packed = collate_prompt_sharing_pairs(rows, pad_id)
        # (K', V) logits or (K', H) hidden states: never None here, the model takes a custom mask ("packed")
        out = masked_logits(model, packed["input_ids"].to(device), packed["position_ids"].to(device),
                            packed["allowed"].to(device), packed["scored"].to(device), hidden=chunked)
        source, target, owner = (packed[k].to(device) for k in ("source", "target", "owner"))  # (K,) each
        if chunked:
            with mixed_precision(plan):  # the head at the forward's precision
                logps = linear_token_logprobs(out[source], weight, target, linear=head_matmul(model),
                                              grad_target=grad_target)[0]
        else:
            logps = token_logprobs(out[source][None], target[None])[0]  # (K,) one per response token
        sums = torch.zeros(2 * len(rows), dtype=logps.dtype, device=device).index_add(0, owner, logps)
        return sums, torch.bincount(owner, minlength=2 * len(rows)).float()
    prompts = [r["chosen_ids"][:r["prompt_len"] - 1] for r in rows] * 2  # (2B,) each pair's prompt twice
    # (2B,) the prompt's last token, then the response: position j predicts token j + 1
    tails = [r[key][r["prompt_len"] - 1:] for key in ("chosen_ids", "rejected_ids") for r in rows]
    if not checkpointed(model) and min(map(len, prompts)) and min(map(len, tails)) > 1:
        prompt_ids = pad_sequences(prompts, pad_id, side="left").to(device)  # (2B, P - 1)
        prompt_mask = pad_sequences([[1] * len(p) for p in prompts], 0, side="left").to(device)
        tail_ids = pad_sequences(tails, pad_id).to(device)  # (2B, 1 + R), right-padded
        tail_mask = pad_sequences([[1] * len(t) for t in tails], 0).to(device)
        # (2B, 1 + R, V) logits or (2B, 1 + R, H) hidden states, or None
        out = shared_prefix_logits(model, prompt_ids, prompt_mask, tail_ids, tail_mask, plan, hidden=chunked)
        if out is not None:
            valid = tail_mask[:, 1:].bool()  # (2B, R) response tokens, no pads
            return response_sums(model, plan, out[:, 1:], tail_ids[:, 1:], valid), valid.sum(-1).float()
    batch = collate_preferences(rows, pad_id)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)  # (2B, T)
    prompt_len = torch.tensor([r["prompt_len"] for r in rows] * 2, device=device)  # (2B,)
    first = max(1, int(prompt_len.min()))  # the earliest response token: positions first-1 .. T-2 are needed
    if chunked:
        out = final_hidden(model, ids, mask, position_ids(mask))[:, first - 1:-1]  # (2B, T - first, H)
    else:
        out = causal_logits(model, ids, mask, keep=ids.size(1) - first + 1)[:, :-1]  # (2B, T - first, V)
    targets = ids[:, first:]  # (2B, T - first): position first - 1 + j predicts token first + j
    positions = torch.arange(first, ids.size(1), device=device)
    valid = (positions[None, :] >= prompt_len[:, None]) & mask[:, first:].bool()  # response tokens, no pads
    return response_sums(model, plan, out, targets, valid), valid.sum(-1).float()


def response_sums(model, plan, out: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(N,) summed log-probs of `targets` (N, R) over the `valid` (N, R) positions, from `out`: (N, R, V) logits,
    or where the plan runs the LM head in chunks (N, R, H) hidden states, the head run on the valid positions
    only."""
    weight = head_logprobs_weight(model, plan)
    if weight is None:
        return masked_sum(token_logprobs(out, targets), valid, dim=-1)
    with mixed_precision(plan):  # the head at the forward's precision
        logps = linear_token_logprobs(out[valid], weight, targets[valid], linear=head_matmul(model),
                                      grad_target=grad_in_place.target if plan.grad_in_place else None)[0]  # (K,)
    return torch.zeros(valid.shape, dtype=logps.dtype, device=logps.device).masked_scatter(valid, logps).sum(-1)


@contextlib.contextmanager
def eval_mode(model):
    """`model` in eval mode for the block, back in the mode it was in after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@dataclass
class Reference:
    """Where a batch's reference log-probs come from: attached to the rows (precomputed, `REF_KEY`), from
    `model` per micro-batch (`lora`: the LoRA policy, run with its adapter disabled), or nowhere (reference-free:
    `model` None and no attached values)."""

    model: Optional[torch.nn.Module] = None
    lora: bool = False  # the model is the LoRA policy: disable its adapter for the reference forward
    note: str = ""
    on_device: Optional[Callable] = None  # engine.on_device for a frozen copy (engine.offload_reference_model)
    plan: Optional[ModelPlan] = None  # the speed plan of the model that computes (or computed) them

    @contextlib.contextmanager
    def active(self):
        """The reference model for a block of no-grad forwards."""
        adapter = adapter_disabled(self.model) if self.lora else contextlib.nullcontext()
        placed = self.on_device(self.model) if self.on_device else contextlib.nullcontext()
        with adapter, placed, eval_mode(self.model), torch.no_grad():
            yield self.model

    def logprobs(self, rows: list[dict], pad_id: int, device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(chosen, rejected) reference log-probs of `rows`, each (B,), or None (reference-free)."""
        if rows and REF_KEY in rows[0]:
            ref = torch.tensor([r[REF_KEY] for r in rows], dtype=torch.float32, device=device)  # (B, 2)
            return ref[:, 0], ref[:, 1]
        if self.model is None:
            return None
        with self.active() as model:
            logps, _ = sequence_logprobs(model, rows, pad_id, device, self.plan)
        return logps[:len(rows)], logps[len(rows):]


def pair_logps(model, rows: list[dict], pad_id: int, device, plan, reference: Reference) -> PairLogps:
    """Policy log-probs (with grad, on the paths of its speed plan) and reference log-probs of a micro-batch of
    pairs."""
    ref = reference.logprobs(rows, pad_id, device)
    logps, lengths = sequence_logprobs(model, rows, pad_id, device, plan)
    n = len(rows)
    return PairLogps(logps[:n], logps[n:], lengths[:n], lengths[n:], *(ref or (None, None)))


# ---------------------------------------------------------------------------------------- the reference


def _rows_digest(*row_lists: list) -> str:
    """A hash of the tokenised pairs, in order (ids as 64-bit integers: ~1 s for 200M tokens)."""
    digest = hashlib.sha256()
    for rows in row_lists:
        digest.update(b"rows")
        for r in rows:
            for ids in (r["chosen_ids"], r["rejected_ids"], [r["prompt_len"], -1]):
                digest.update(array("q", ids).tobytes() + b"\xff" * 8)
    return digest.hexdigest()


def reference_cache_path(cfg: DPOConfig, reference_name: str, tokenizer, train: list, evals: list, forward: str):
    """(path, key) of the reference log-probs' cache entry, next to the data cache's entries; (None, reason) when
    it cannot be keyed (data.cache off, or a reference that is not a local folder). `forward`: the forward that
    computes them (`logprob_forward`)."""
    if not cfg.data.cache:
        return None, "off (data.cache=false)"
    if not Path(reference_name).expanduser().is_dir():
        return None, "off (the reference is not a local folder)"
    identity = cache.source_identity(str(Path(reference_name).expanduser()))  # every file's size and mtime
    key = cache.make_key({"stage": "dpo-reference", "forward": forward, "reference": identity, "dtype": cfg.load.dtype,
                          "precision": cfg.engine.precision, "backend": cfg.engine.backend,
                          "tokenizer": cache.tokenizer_fingerprint(tokenizer), "rows": _rows_digest(train, evals)})
    return cache.entry_path(cache.default_cache_dir(cfg.data.cache_dir), "dpo-reference", key), key


@torch.no_grad()
def compute_reference_logprobs(reference: Reference, rows: list[dict], pad_id: int, micro: int, device,
                               order: Optional[list[int]] = None) -> list:
    """[[chosen, rejected], ...] for every row, in row order: one no-grad pass over consecutive micro-batches of
    `order` (default: the rows' own order).

    Any grouping gives the same values up to float rounding (~1e-7, from the padding width); grouping the rows as
    training and evaluation will (the first epoch's order: its micro-batches on every rank are consecutive chunks
    of it) makes them exact where it shows: at step 0, where the policy is the reference, every implicit reward is
    0, not rounding noise."""
    order = list(range(len(rows))) if order is None else order
    out: list = [None] * len(rows)
    with reference.active() as model:
        for start in range(0, len(order), micro):
            part = order[start:start + micro]
            logps, _ = sequence_logprobs(model, [rows[i] for i in part], pad_id, device, reference.plan)
            chosen, rejected = logps[:len(part)].tolist(), logps[len(part):].tolist()
            for k, i in enumerate(part):
                out[i] = [chosen[k], rejected[k]]
    return out


def pair_length(row: dict) -> int:
    """The tokens of a pair in `sequence_logprobs`' packed forward: the prompt once and both responses."""
    return len(row["chosen_ids"]) + len(row["rejected_ids"]) - row["prompt_len"]


def first_epoch_order(rows: list[dict], train) -> list[int]:
    """The rows in the order the first epoch's micro-batches take them: `TrainLoop.steps` cuts the epoch's
    permutation into steps of `train.batch_size` and orders each by `pair_length` (a partial last batch is not
    trained, but its reference log-probs are computed all the same)."""
    order = epoch_order(len(rows), train.seed, 0)
    size = train.batch_size
    return [i for s in range(0, len(order), size) for i in longest_first(order[s:s + size], rows, pair_length)]


def with_reference(rows: list[dict], values: list) -> list[dict]:
    return [{**row, REF_KEY: value} for row, value in zip(rows, values)]


def check_reference(cfg: DPOConfig, tokenizer) -> None:
    """A separate `reference` folder, checked with the data, before the output folder is touched: a causal LM's
    config (not a reward model's) and the policy's vocabulary (it reads the policy's token ids)."""
    if not (cfg.reference and cfg.reference != cfg.model and cfg.dpo.uses_reference()):
        return
    causal_lm_config(cfg.reference, cfg.load)
    if load_tokenizer(cfg.reference, cfg.load).get_vocab() != tokenizer.get_vocab():
        raise ModelError(f"reference '{cfg.reference}' has a different tokenizer from the policy's; it reads the "
                         f"policy's token ids, so it must share its vocabulary")


def reference_model(cfg: DPOConfig, policy, plan, engine, tokenizer, fresh: bool) -> Reference:
    """The model that computes the reference log-probs, holding no second copy where it can (module doc), with its
    speed plan (`plan`, the policy's, where it is the policy)."""
    same = cfg.reference in (None, cfg.model)
    if same and is_lora(policy.module):
        return Reference(policy.module, lora=True, note="the policy with its LoRA adapter disabled", plan=plan)
    if same and fresh and cfg.dpo.precompute_reference:
        return Reference(policy.module, note="the policy before its first step", plan=plan)
    name = cfg.reference or cfg.model
    model = load_causal_lm(name, cfg.load, tokenizer)
    if same and cfg.dpo.precompute_reference:  # a resumed run's stand-in for the policy before its first step: at
        model.to(next(policy.module.parameters()).dtype)  # that policy's precision (float32 over a half load.dtype)
    model = engine.prepare_frozen(model, role="reference")
    # its own plan, as the policy's is decided (the same GEMMs and head: rewards 0 before any step)
    copy_plan = plan_model(Target(model, "reference", "dpo", cfg, engine))
    return Reference(model, note=f"a frozen copy of {name}", on_device=engine.on_device, plan=copy_plan)


def setup_reference(cfg: DPOConfig, data, policy, plan, engine, tokenizer, fresh: bool, say) -> Reference:
    """Attach the reference log-probs to `data.train` / `data.eval` (precomputed: from the cache or one pass),
    or return the Reference that computes them per micro-batch. `plan`: the policy's speed plan; `fresh`: no
    checkpoint was loaded yet."""
    if not cfg.dpo.uses_reference():
        why = "dpo.reference_free" if cfg.dpo.reference_free else f"{cfg.dpo.loss} is reference-free"
        return Reference(note=f"none ({why})")
    if not cfg.dpo.precompute_reference:
        reference = reference_model(cfg, policy, plan, engine, tokenizer, fresh)
        reference.note += ", every micro-batch"
        return reference
    name = cfg.reference or cfg.model
    forward = logprob_forward(policy.module, plan)
    if head_logprobs_weight(policy.module, plan) is not None:
        forward += ", LM head in chunks"  # the same values to float rounding, which step 0 would show
    path, key = reference_cache_path(cfg, name, tokenizer, data.train, data.eval, forward)
    cached = cache.load(path, key, warn=say) if path is not None else None
    # every rank must take the same branch (ZeRO-3 forwards are collectives): a hit only when all ranks hit
    if engine.reduce_sum(1 if cached is not None else 0) == engine.world_size and cached is not None:
        data.train, data.eval = with_reference(data.train, cached["train"]), with_reference(data.eval, cached["eval"])
        return Reference(note=f"precomputed, read from {path}")
    reference = reference_model(cfg, policy, plan, engine, tokenizer, fresh)
    tick = time.perf_counter()
    micro, device, pad_id = cfg.train.micro_batch_size, engine.device, tokenizer.pad_token_id
    first_epoch = first_epoch_order(data.train, cfg.train)  # the first step's micro-batches, and so on
    train = compute_reference_logprobs(reference, data.train, pad_id, micro, device, first_epoch)
    evals = compute_reference_logprobs(reference, data.eval, pad_id, micro, device)  # as evaluate_dpo groups them
    data.train, data.eval = with_reference(data.train, train), with_reference(data.eval, evals)
    note = f"precomputed by {reference.note} in {time.perf_counter() - tick:.1f} s"
    if path is not None and engine.is_main:
        if cache.save(path, key, train, evals, {"reference": name, "pairs": len(train) + len(evals)}, warn=say):
            note += f", cached at {path}"
    used = reference.plan
    del reference
    gc.collect()  # a frozen copy's memory goes back before training
    return Reference(note=note, plan=used)


# ------------------------------------------------------------------------------------------------- steps

@dataclass
class LossFn:
    """The configured loss: PairLogps -> (losses, chosen rewards, rejected rewards), each (B,)."""

    cfg: DPOSection

    def __call__(self, pairs: PairLogps):
        d = self.cfg
        return preference_loss(d.loss, pairs, rpo_alpha=d.rpo_alpha, **d.loss_settings())


def pair_sums(pairs: PairLogps, losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor,
              nll: bool) -> dict:
    """Per-batch sums (not means), so micro-batches and ranks add up before one division; "accuracy" counts the
    pairs whose implicit reward prefers the chosen response (a tie counts as wrong)."""
    sums = {"loss": losses.detach().sum().item(), "accuracy": (chosen > rejected).sum().item(),
            "margin": (chosen - rejected).sum().item(), "reward/chosen": chosen.sum().item(),
            "reward/rejected": rejected.sum().item(), "logps/chosen": pairs.chosen.detach().sum().item(),
            "logps/rejected": pairs.rejected.detach().sum().item()}
    if nll:  # RPO: the chosen responses' NLL per token, mean over pairs
        sums["nll"] = (-pairs.chosen.detach() / pairs.chosen_lengths).sum().item()
    return sums


def add_sums(total: dict, part: dict) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + value


@torch.no_grad()
def evaluate_dpo(model, rows: list, pad_id: int, micro: int, device, engine, loss_fn: LossFn, plan,
                 reference: Reference) -> dict:
    """Held-out eval/loss, eval/accuracy, eval/margin, eval/reward/*, eval/logps/*. Every rank evaluates all rows
    (ZeRO-3 needs the same forwards on all ranks); the sums over ranks are divided by the rows over ranks."""
    sums: dict = {}
    with eval_mode(model):
        for i in range(0, len(rows), micro):
            pairs = pair_logps(model, rows[i:i + micro], pad_id, device, plan, reference)
            add_sums(sums, pair_sums(pairs, *loss_fn(pairs), loss_fn.cfg.rpo_alpha > 0))
    return pair_means(sums, engine.reduce_sum(len(rows)), engine, prefix=EVAL_PREFIX)


def train_step(policy, rows: list, accum: int, micro_size: int, batch_size: int, pad_id: int, engine,
               loss_fn: LossFn, plan, reference: Reference) -> dict:
    """One optimizer step over `rows` (this rank's share of `batch_size` pairs) in `accum` micro-batches."""
    sums: dict = {}
    for m in range(accum):
        micro = rows[m * micro_size:(m + 1) * micro_size]
        pairs = pair_logps(policy.module, micro, pad_id, engine.device, plan, reference)
        losses, chosen, rejected = loss_fn(pairs)
        # the micro-batch's summed loss over the pairs of the whole batch: micro 1 x accum 4 == micro 4 x accum 1
        policy.backward(losses.sum(), batch_size)
        add_sums(sums, pair_sums(pairs, losses, chosen, rejected, loss_fn.cfg.rpo_alpha > 0))
    lr = policy.lr
    return {**pair_means(sums, batch_size, engine), "lr": lr, **policy.step()}


def describe(info: dict, cfg: DPOConfig) -> str:
    """The data summary a user sees first (pairs kept, dropped, skipped) and the loss with its coefficients."""
    skipped, d = skipped_rows(info), cfg.dpo
    coefs = [f"{key} {value:g}" for key, value in d.loss_settings().items()]
    if d.rpo_alpha:
        coefs.append(f"rpo alpha {d.rpo_alpha:g}")
    loss = f"{d.loss} ({', '.join(coefs)})"
    return (f"dpo: {info['train_rows']} train / {info['eval_rows']} eval pairs, template {info['template']}, "
            f"{info['truncated']} truncated, {info['dropped']} dropped{'; skipped ' + skipped if skipped else ''}; "
            f"loss {loss}")


# -------------------------------------------------------------------------------------------------- run


def run_dpo(cfg: DPOConfig, resume: bool = False, force: bool = False) -> dict:
    # 1. engine, tokenizer and pairs first (the RM step's data layer and its cache): bad input fails before anything
    #    is written
    setup = start_stage(cfg, cfg.model, "rm", resume=resume, force=force)
    cfg, engine, tokenizer, data = setup.cfg, setup.engine, setup.tokenizer, setup.data
    model = apply_lora(load_causal_lm(cfg.model, cfg.load, tokenizer), cfg.lora)
    check_reference(cfg, tokenizer)
    _, accum, total = plan_steps(len(data.train), cfg.train, engine.world_size)
    out = prepare_output_dir(cfg, resume, force, engine.is_main)

    # 2. the optimizer; the reference log-probs (before a checkpoint is loaded: the policy may compute them); a
    #    reference that fails to load (a damaged weights file) leaves no half-written fresh run
    policy = engine.prepare(model, cfg.train, total, role="policy")
    # the fast paths the policy takes, decided once (speed/registry.py) before it computes any reference log-prob
    plan = plan_model(Target(policy.module, "policy", "dpo", cfg, engine))
    with undone_if_bad_input_at_start(out, not resume, engine.is_main):
        reference = setup_reference(cfg, data, policy, plan, engine, tokenizer, fresh=not resume, say=engine.say)
    copy = reference.plan is not None and reference.plan is not plan  # a frozen copy, planned on its own
    plans = {"policy": plan, **({"reference": reference.plan} if copy else {})}
    resumed = resume_state(engine, out, {"model": policy}, total, "dpo") if resume else {}
    start = resumed_from(cfg, out, resumed["step"], engine.is_main) if resume else 0
    pad_id, device, micro_size = tokenizer.pad_token_id, engine.device, cfg.train.micro_batch_size
    loss_fn = LossFn(cfg.dpo)
    evaluate = (lambda: evaluate_dpo(policy.module, data.eval, pad_id, micro_size, device, engine, loss_fn, plan,
                                     reference)) if data.eval else None

    with MetricsLogger(out, "dpo", total, cfg.log, engine.is_main, initial=start) as log:
        log.write(plan_line(plans))
        log.write(f"{describe(data.info, cfg)}; reference log-probs: {reference.note}; {total} steps of "
                  f"{cfg.train.batch_size} pairs (accumulation {accum})")
        if note := lora_rate_note(cfg.lora.rank, cfg.train.lr):
            log.write(note)
        if start == 0 and evaluate:  # the starting point (the policy is the reference: DPO's rewards are 0)
            log.log(0, evaluate())

        # 3. the loop: each step sees batch_size pairs over all ranks, in micro-batches
        with TrainLoop(engine, out, "dpo", total, cfg.train, log, {"model": policy}, evaluate=evaluate,
                       resumed=resumed, show=("loss", "accuracy", EVAL_ACCURACY), monitor=cfg.monitor) as loop:
            for step, epoch, rows in loop.steps(data.train, start, length=pair_length):
                tick = time.perf_counter()
                metrics = train_step(policy, rows, accum, micro_size, cfg.train.batch_size, pad_id, engine, loss_fn,
                                     plan, reference)
                loop.end_step(step + 1, {**metrics, "epoch": epoch, TIME_STEP: time.perf_counter() - tick})
        final_eval = loop.last_eval
        if not final_eval and evaluate:  # resumed from a run that had already finished its steps
            final_eval = evaluate()

    # 4. export a plain transformers folder (LoRA merged, ZeRO-3 gathered)
    record_template(policy.module, data.info["template"])
    engine.export_hf(policy.module, tokenizer, final_dir(out))
    write_run_report(out, cfg.log, engine.is_main)
    outcome = loop.outcome()
    # the steps that ran: a monitor's stop ends the run early (steps_planned says how many were asked)
    ran = {"steps": outcome["stopped_at_step"], "steps_planned": total} if "stopped_at_step" in outcome \
        else {"steps": total}
    return {"output_dir": str(out), **ran, "loss_type": cfg.dpo.loss, "reference": reference.note, **outcome,
            **final_eval, **data.info}

