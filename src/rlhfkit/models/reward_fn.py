"""The frozen reward of PPO: a reward-model folder, or a Python function `(prompts, responses) -> list[float]`.

Both are callables taking a rollout batch (prompt_texts, response_texts, messages, input_ids, attention_mask)
and returning a (B,) float tensor of sequence scores.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Callable

import torch

from rlhfkit.data.templates import Template, encode_prompt, encode_response
from rlhfkit.data.tokenize import cut_prompt, opening_length, pad_sequences
from rlhfkit.accel.cpu_linear import packed_weights
from rlhfkit.models.forward import sequence_scores
from rlhfkit.models.plan import REFERENCE
from rlhfkit.lora import base_model
from rlhfkit.errors import ModelError, TemplateRefused


def field_parameters(fn: Callable) -> tuple[list[str], list[str], bool]:
    """The keyword parameters `fn` takes after (prompts, responses), those of them without a default, and
    whether it takes **kwargs."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: call it with the two lists only
        return [], [], False
    named = [p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return ([p.name for p in named], [p.name for p in named if p.default is p.empty],
            any(p.kind == p.VAR_KEYWORD for p in params))


def defined_at(fn: Callable) -> str:
    """'file.py:LINE' where `fn` (a function, or a callable object's class) is defined; '?' when unknown."""
    target = fn if inspect.isroutine(fn) else type(fn)
    try:
        return f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):  # a builtin, or code with no source file
        return "?"


def call_problem(fn: Callable, name: str, fields: list[str]) -> str | None:
    """Why `fn(prompts, responses, **columns)` cannot be called with the columns of prompt rows that have `fields`
    (what `FunctionReward.columns` passes: the named parameters those rows have, or every field for **kwargs);
    None when it can."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return None
    params = list(signature.parameters.values())
    wanted, required, takes_all = field_parameters(fn)
    passed = list(fields) if takes_all else [p for p in wanted if p in fields]
    call = f"{name}(prompts, responses{''.join(f', {p}=...' for p in passed)})"
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        return f"takes {len(positional)} positional parameter{'s' * (len(positional) != 1)}, but is called as {call}"
    twice = [(i, p) for i, p in enumerate(positional[:2]) if p in passed]
    if twice:
        i, param = twice[0]
        return (f"gets the {('prompts', 'responses')[i]} as its {('first', 'second')[i]} parameter, '{param}', and "
                f"the prompt rows' field '{param}' too: it is called as {call}")
    missing = [p for p in required if p not in fields]
    if missing:
        listed = ", ".join(f"'{p}'" for p in missing)
        return (f"takes {'a parameter' if len(missing) == 1 else 'parameters'} {listed} that the prompt rows do not "
                f"have (they have: {', '.join(fields) or 'no fields'}): rename {'it' if len(missing) == 1 else 'them'} "
                f"to one of those, or give {'it' if len(missing) == 1 else 'them'} a default")
    try:
        signature.bind(None, None, **dict.fromkeys(passed))
    except TypeError as exc:
        return f"cannot be called as {call}: {exc}"
    return None


class FunctionReward:
    """Calls `fn(prompts, responses, **fields)` with the rendered prompts, the decoded responses (special tokens
    skipped) and, for each further parameter the function names (or all of them for **kwargs), that column of
    the prompt rows as a list (e.g. `answer=[...]`: a verifiable reward checks against the dataset's answer).
    Checks it returned one finite number per response."""

    def __init__(self, fn: Callable, spec: str):
        self.fn, self.spec = fn, spec
        self.stats = None  # no stored mean/std to normalise with
        self.wanted, self.required, self.takes_all = field_parameters(fn)

    def check_fields(self, rows: list[dict]) -> None:
        """ModelError naming the function's file and line when it cannot be called with the columns `rows` have
        (a parameter no row has, too few positional parameters, a field that would fill the responses' slot too):
        said when the prompts are read, before any model loads, and again per batch."""
        name = self.spec.rsplit(":", 1)[-1]  # "file.py:fn", or a bare name
        problem = call_problem(self.fn, name, sorted({k for row in rows for k in row}))
        if problem:
            raise ModelError(f"reward function '{name}' ({defined_at(self.fn)}) {problem}")

    def columns(self, batch) -> dict:
        rows = batch.fields or [{} for _ in range(batch.size)]
        names = sorted({k for row in rows for k in row}) if self.takes_all else self.wanted
        self.check_fields(rows)
        return {name: [row.get(name) for row in rows] for name in names if any(name in row for row in rows)}

    def __call__(self, batch, finished: torch.Tensor | None = None) -> torch.Tensor:
        columns = self.columns(batch)
        try:
            scores = self.fn(list(batch.prompt_texts), list(batch.response_texts), **columns)
        except Exception as exc:  # the user's code: one clear error naming it, not a traceback from our loop
            raise ModelError(f"reward '{self.spec}' raised {type(exc).__name__}: {exc} "
                             f"({raised_at(exc, self.fn)})") from exc
        listed = None
        if not isinstance(scores, (str, bytes, bytearray, Mapping)):
            try:
                listed = list(scores)  # a generator or a map is read once: every check below sees the same values
            except TypeError:  # not iterable (a number, a 0-d tensor)
                pass
        if listed is None:
            raise ModelError(f"reward '{self.spec}' returned a {type(scores).__name__} ({scores!r:.80}): return a list "
                             f"of numbers, one per response (None for a response it cannot judge)")
        scores = listed
        text = next(((i, s) for i, s in enumerate(scores) if isinstance(s, (str, bytes))), None)
        if text:  # float() would read "1" as 1.0: a label or a parsed answer passed on by mistake
            shown = text[1] if isinstance(text[1], bytes) else str(text[1])  # NumPy's str_ as a plain str
            raise ModelError(f"reward '{self.spec}' returned a string ({shown!r:.40}) for response {text[0]}: "
                             f"return a number, or None for a response it cannot judge")
        try:  # None: a response the function cannot judge (NaN here; left out of the update, counted)
            values = [math.nan if s is None else _number(s) for s in scores]
        except (TypeError, ValueError):
            raise ModelError(f"reward '{self.spec}' must return a list of numbers (or None), got {scores!r:.200}") \
                from None
        if len(values) != batch.size:
            raise ModelError(f"reward '{self.spec}' returned {len(values)} values for {batch.size} responses "
                             f"(one number, or None for a response it cannot judge, per response)")
        bad = [i for i, (v, s) in enumerate(zip(values, scores)) if s is not None and not math.isfinite(v)]
        if bad:
            raise ModelError(f"reward '{self.spec}' returned {values[bad[0]]} for response {bad[0]} "
                             f"({batch.response_texts[bad[0]]!r:.80}) and {len(bad) - 1} more non-finite values: "
                             f"return a finite number, or None for a response it cannot judge")
        return torch.tensor(values, dtype=torch.float32)


def _number(value) -> float:
    """float(value), an int too large for a float as inf (reported as a non-finite score, not a type error)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def raised_at(exc: BaseException, fn: Callable) -> str:
    """'file.py:LINE in name' of the line of the user's reward that raised (the deepest frame in its file; the
    deepest frame at all when the error came from elsewhere)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    home = getattr(code, "co_filename", None)  # a function's file, or a callable object's class's
    own = [f for f in frames if f.filename == home]
    frame = (own or frames)[-1] if frames else None
    return f"at {frame.filename}:{frame.lineno} in {frame.name}" if frame else "no traceback"


class CombinedReward:
    """Several rewards (models and functions) summed with their weights: `parts` are (name, reward, weight).
    A response any part cannot judge (NaN) stays unjudged. `last` holds each part's mean over the responses it
    judged, for the metrics (reward/<name>); `counts` the counts the parts report of their last call, summed over
    the parts (a reward server's `reward/remote_failed`)."""

    def __init__(self, parts: list[tuple[str, Callable, float]]):
        self.parts = parts
        # one part: its stored mean/std standardise the weighted score as w * (s - mean) / std
        stats, weight = (parts[0][1].stats, parts[0][2]) if len(parts) == 1 else (None, 1.0)
        self.stats = {"mean": weight * stats["mean"], "std": stats["std"]} if stats is not None else None
        self.models = [getattr(reward, "model", None) for _, reward, _ in parts]
        self.last: dict = {}
        self.counts: dict = {}

    def __call__(self, batch, finished: torch.Tensor | None = None) -> torch.Tensor:
        total, self.last, self.counts = None, {}, {}
        for name, reward, weight in self.parts:
            scores = reward(batch, finished).float().cpu()
            judged = torch.isfinite(scores)
            self.last[name] = scores[judged].mean().item() if judged.any() else math.nan
            for key, count in getattr(reward, "counts", {}).items():
                self.counts[key] = self.counts.get(key, 0.0) + count
            total = weight * scores if total is None else total + weight * scores
        return total


def same_tokenization(a, b) -> bool:
    """Can token ids from `a` be fed to a model trained with `b` (and rendered the same way)?"""
    return (type(a) is type(b) and len(a) == len(b) and a.get_vocab() == b.get_vocab()
            and getattr(a, "chat_template", None) == getattr(b, "chat_template", None))


class ModelReward:
    """A reward model scoring prompt + response at the last real token.

    With the actor's tokenizer, template and end ids the rollout's token ids are scored as they are. Otherwise
    the response is decoded and prompt + response re-rendered with the RM's own template and re-tokenised, since
    its scores only mean something on text laid out as in its training (TRL #1674, OpenRLHF #242):
    - an RM `rlhfkit rm` trained (it recorded `rlhfkit_end_ids`) sees the response end at its end token, as in
      its training; any other RM with a chat template (a hub RM) sees the assistant turn exactly as its template
      writes it (`Template.written_turn`: ChatML's `<|im_end|>\n`), what `apply_chat_template` gave it in its
      training; a response cut at the token limit ends after its content, with no end-of-turn marker;
    - the sequence is cut to the RM's length (`rlhfkit_max_length`, else its position limit): the prompt's
      middle first (`cut_prompt`), as for the actor, then the response's end;
    - a prompt the RM's template refuses (Gemma's refuses system turns) leaves its response unjudged (NaN), as
      a reward function's None does; so does a response whose text spells one of the RM tokenizer's control
      tokens (`<|im_end|>` written with ordinary tokens would become the real one when re-tokenised: a forged
      end of turn, or a whole new turn, for the RM to score).
    """

    def __init__(self, model, tokenizer, actor_template: Template, template_mode: str, micro_batch_size: int,
                 device, plan=REFERENCE):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.plan = plan  # the model's speed plan (default: the plain transformers path)
        self.micro = micro_batch_size
        # render as in the RM's training when `rlhfkit rm` recorded it (rlhfkit_template: chat|plain)
        # and with the end ids its training responses ended with (rlhfkit_end_ids; else the tokenizer's EOS)
        # (the transformers config: under ZeRO-3 `model` is DeepSpeed's engine, whose own `.config` is its dict)
        config = base_model(model).config
        self.template = Template.for_tokenizer(tokenizer, getattr(config, "rlhfkit_template", None)
                                               or template_mode, getattr(config, "rlhfkit_end_ids", None))
        self.native = getattr(config, "rlhfkit_end_ids", None) is None and self.template.use_chat
        self.retokenize = self.native or not (same_tokenization(tokenizer, actor_template.tokenizer)
                                              and self.template.name == actor_template.name
                                              and self.template.end_ids == actor_template.end_ids)
        self.max_length = getattr(config, "rlhfkit_max_length", None) or \
            getattr(config, "max_position_embeddings", None)
        self.refused = 0  # responses left unjudged because the RM's template refused their prompt
        # the RM tokenizer's control tokens as text: a decoded response that spells one (out of ordinary tokens)
        # would become that control token when re-tokenised, e.g. a forged end of turn and a new assistant turn
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.controls = sorted({*getattr(tokenizer, "all_special_tokens", []),
                                *(str(t) for t in added.values() if getattr(t, "special", False))} - {""})
        self.forged = 0  # responses left unjudged because they spell one of them
        mean = getattr(config, "rlhfkit_reward_mean", None)
        std = getattr(config, "rlhfkit_reward_std", None)
        self.stats = {"mean": float(mean), "std": float(std)} if mean is not None and std is not None else None

    def _rm_inputs(self, batch, finished: list[bool]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(B, T) right-padded ids and mask of prompt + response re-rendered as in the RM's training (see the
        class), and the rows it cannot judge: its template refused the prompt, or the response spells one of its
        tokenizer's control tokens (each such row gets a one-token stand-in to score, so every rank still runs
        the same forwards; counted in `refused` and `forged`)."""
        seqs, unjudged = [], []
        for row, (messages, response, done) in enumerate(zip(batch.messages, batch.response_texts, finished)):
            sequence = None
            if any(control in response for control in self.controls):
                self.forged += 1
            else:
                try:
                    sequence = self._rm_sequence(messages, response, done)
                except TemplateRefused:
                    self.refused += 1
            if sequence is None:
                unjudged.append(row)
            seqs.append(sequence or [self.tokenizer.eos_token_id])
        ids = pad_sequences(seqs, self.tokenizer.pad_token_id)
        return ids, pad_sequences([[1] * len(s) for s in seqs], 0), unjudged

    def _rm_sequence(self, messages: list[dict], response: str, done: bool) -> list[int]:
        prompt = self.template.prompt(messages)
        ids = encode_prompt(self.tokenizer, prompt)
        if self.native:  # as its template writes the turn: nothing appended
            text = self.template.written_turn(messages, response, finished=done)
            response_ids = encode_response(self.tokenizer, text, finished=False, after=(prompt, ids))
        else:
            text = self.template.response(messages, response, finished=done)
            response_ids = encode_response(self.tokenizer, text, self.template.end_ids, finished=done,
                                           after=(prompt, ids))
        limit = self.max_length
        if limit and len(ids) + len(response_ids) > limit:
            budget = max(limit - len(response_ids), limit // 2)
            if len(ids) > budget:
                ids = cut_prompt(ids, opening_length(self.tokenizer, self.template, messages, ids), budget)
            response_ids = response_ids[:limit - len(ids)]
        return ids + response_ids

    @torch.no_grad()
    def __call__(self, batch, finished: torch.Tensor | None = None) -> torch.Tensor:
        if self.retokenize:
            if not all(batch.messages):
                raise ModelError("the reward model's tokenizer differs from the actor's, and the prompts carry no "
                                 "messages to re-render")
            done = finished.tolist() if finished is not None else [True] * batch.size
            ids, mask, unjudged = self._rm_inputs(batch, done)
        else:
            ids, mask, unjudged = batch.input_ids, batch.attention_mask, []
        scores = []
        with packed_weights(self.model, self.plan.onednn_linear):  # oneDNN's weight layout once for all micro-batches
            for start in range(0, ids.size(0), self.micro):
                chunk = slice(start, start + self.micro)
                scores.append(sequence_scores(self.model, ids[chunk].to(self.device), mask[chunk].to(self.device),
                                              self.plan))
        # identical sequences get the very score of their first copy: scored in other rows of a batch they can
        # differ in the last bits, which a group-relative estimator turns into advantages and DAPO's filter reads
        # as different (every row is still scored, so every rank runs the same forwards, a ZeRO-3 collective)
        first: dict = {}
        same = [first.setdefault(tuple(row[m.bool()].tolist()), i) for i, (row, m) in enumerate(zip(ids, mask))]
        scores = torch.cat(scores).float()
        scores = scores[torch.tensor(same, device=scores.device)]
        if unjudged:
            scores[unjudged] = math.nan
        return scores
