"""Multi-turn episodes: a rollout engine that plays each prompt row out against an environment (`env=`).

`EpisodeRollout` wraps the run's rollout engine (native or vLLM: it only asks it for one model turn at a time)
and returns an ordinary RolloutBatch whose response is the whole trajectory after the opening prompt:

    [model turn 1 | environment turn 1 | model turn 2 | ... | model turn k]

- The model's turns are its sampled ids exactly as sampled, with the sampler's log-probs; nothing the model wrote
  is decoded and re-encoded (the text goes to the environment only). The environment's turns are rendered by the
  chat template and appended as ids (rollout/turns.py).
- `response_mask` is 1 on the model's tokens only, so the losses, the KL, entropy, values and advantages cover
  them alone (GAE and the returns pass through the environment's tokens as holes: algos/advantages.py);
  `response_attention` is 1 on every token, so the trainer's forwards see the context the sampler saw.
- The episode's return (the environment's final reward plus its per-turn rewards) is `episode_rewards`, which the
  environment's reward part (`EnvironmentReward`) hands to PPO as the sequence score.

Each turn samples every still-running episode at once; the environment's calls (reset, step, reward) run
`episode.workers` at a time in threads, each under `episode.timeout` (envs/calls.py). An episode whose environment
raises, overruns or returns something unusable ends there, unjudged, counted by reason; when more than
`episode.max_failed` of an iteration's episodes failed so, the run stops with the first failure's message.
A single-turn task is the one-turn case of the same loop (`episode.max_turns=1`, or an environment that is done
after the first turn): the batch is then the engine's own.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from rlhfkit.data.tokenize import cut_prompt, pad_sequences
from rlhfkit.envs.base import BadValue, as_messages, as_reward, as_step
from rlhfkit.envs.calls import Outcome, run_calls
from rlhfkit.errors import ConfigError, RunError
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.rollout.turns import TurnRenderer

FAILURES = ("raised", "timeout", "bad_value")


class Episode:
    """One episode's state: its environment, the opening's ids, the trajectory so far."""

    def __init__(self, env, row: dict):
        self.env, self.row = env, row
        self.prompt_ids, self.prompt_text, self.messages = row["prompt_ids"], row["prompt_text"], row.get("messages")
        self.ids: list[int] = []  # the trajectory after the prompt
        self.model: list[int] = []  # 1 where the model sampled the token
        self.logprobs: list[float] = []  # the sampler's log-prob of each model token (0 on the environment's)
        self.turn_rewards: list[float] = []
        self.turns = 0
        self.last_token: int | None = None  # the model's last sampled id, and its turn as text (for the environment)
        self.text = ""
        self.done = False
        self.unjudged = False  # over with no reward at all (not a failure)
        self.ended = ""  # why: done, max_turns, max_tokens, or a failure reason
        self.opening_cut = False  # its opening (with the tools' description) was past data.max_prompt_length
        self.failure: str | None = None  # raised, timeout, bad_value
        self.detail = ""

    def fail(self, reason: str, detail: str) -> None:
        self.done, self.ended, self.failure, self.detail = True, reason, reason, detail


def checked(outcome: Outcome, check, what: str) -> Outcome:
    """`outcome` with its value passed through `check` (BadValue becomes a bad_value failure); a failure's detail
    names the call (`what`)."""
    if outcome.failure is not None:
        return Outcome(failure=outcome.failure, detail=f"{what}: {outcome.detail}")
    try:
        return Outcome(check(outcome.value, what))
    except BadValue as exc:
        return Outcome(failure="bad_value", detail=str(exc))


class EpisodeRollout:
    """A RolloutEngine (rollout/engines.py) that samples episodes against `env_class` through `inner`."""

    def __init__(self, inner, env_class, cfg, template, engine, tools: list | None = None, env_args: dict | None = None,
                 spec: str = "", max_prompt_length: int | None = None):
        self.inner, self.env_class, self.cfg, self.engine = inner, env_class, cfg, engine
        self.max_prompt_length = max_prompt_length  # data.max_prompt_length: an opening longer is cut, and counted
        self.env_args, self.spec = dict(env_args or {}), spec or env_class.__name__
        self.tokenizer = template.tokenizer
        self.tools = list(tools or [])
        self.renderer = TurnRenderer(template, self.tools)
        self.name, self.separate = inner.name, inner.separate
        # the tokenizer's own tool-call parser where its folder defines one (transformers' response template)
        own = getattr(self.tokenizer, "response_template", None) or getattr(self.tokenizer, "response_schema", None)
        self.parser = _own_parser(self.tokenizer) if own and hasattr(self.tokenizer, "parse_response") else None

    # -- the RolloutEngine protocol -------------------------------------------------------------------------
    def sync(self, model) -> float:
        return self.inner.sync(model)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        cfg = self.cfg
        return (f"{self.inner.describe()}; episodes against env {self.spec}: up to {cfg.max_turns} turns, "
                f"{cfg.max_tokens} tokens after the prompt, {cfg.workers} environment calls at once "
                f"({cfg.timeout:g} s each); {self.renderer.describe()}")

    def generate(self, rows: list[dict], gen, greedy: bool = False, group_size: int = 1) -> RolloutBatch:
        episodes = self._start(rows)
        for turn in range(self.cfg.max_turns):
            running = [e for e in episodes if not e.done]
            if not self._anyone(bool(running)):
                break
            self._model_turn(running, gen, greedy, group_size if turn == 0 else 1, rows)
            self._environment_turn([e for e in running if not e.done], last=turn == self.cfg.max_turns - 1)
        for e in episodes:
            if not e.done:
                e.done, e.ended = True, "max_turns"
        returns = self._returns(episodes)
        self._check_failures(episodes)
        return self._batch(episodes, returns)

    # -- the steps of an episode ----------------------------------------------------------------------------
    def _call(self, calls, check, what: str) -> list[Outcome]:
        outcomes = run_calls(calls, self.cfg.workers, self.cfg.timeout)
        return [checked(o, check, what) for o in outcomes]

    def _start(self, rows: list[dict]) -> list[Episode]:
        episodes = []
        for row in rows:
            env = self.env_class(**self.env_args)
            env.tools = self.tools
            if self.parser is not None:
                env.parser = self.parser
            episodes.append(Episode(env, row))
        name = f"{self.spec}.reset"
        opening = lambda value, what: None if value is None else as_messages(value, what)  # noqa: E731
        outcomes = self._call([lambda e=e: e.env.reset(dict(e.row.get("fields") or {})) for e in episodes],
                              opening, name)
        for e, outcome in zip(episodes, outcomes):
            if outcome.failure is not None:
                e.fail(outcome.failure, outcome.detail)
                continue
            messages = outcome.value
            if messages is None and self.tools and e.messages:  # the row's own prompt, with the tools described
                messages = e.messages
            if messages is not None:
                e.prompt_ids, e.prompt_text = self.renderer.opening(messages)
                e.messages = messages
                budget = self.max_prompt_length
                if budget and len(e.prompt_ids) > budget:  # as a long prompt row: its start and its end kept
                    e.prompt_ids = cut_prompt(e.prompt_ids, self.renderer.fixed_length(messages, e.prompt_ids),
                                              budget)
                    e.opening_cut = True
        return episodes

    def _anyone(self, local: bool) -> bool:
        """Whether any rank has a running episode (every rank samples each turn together: ZeRO-3's forwards are
        collective)."""
        if self.engine is None or self.engine.world_size == 1:
            return local
        return self.engine.reduce_max(1.0 if local else 0.0) > 0

    def _model_turn(self, running: list[Episode], gen, greedy: bool, group_size: int, rows: list[dict]) -> None:
        """One turn of every running episode, sampled together; a rank with none samples one stand-in row
        (its result unused) so that it keeps step with the others."""
        remaining = [self.cfg.max_tokens - len(e.ids) for e in running]
        budget = min(gen.max_new_tokens, max(remaining, default=gen.max_new_tokens))
        turn_gen = replace(gen, max_new_tokens=budget, min_new_tokens=min(gen.min_new_tokens, budget))
        contexts = [{"prompt_ids": e.prompt_ids + e.ids, "prompt_text": e.prompt_text, "messages": None,
                     "fields": e.row.get("fields", {})} for e in running] or [dict(rows[0], messages=None)]
        if group_size > 1 and any(contexts[i]["prompt_ids"] != contexts[i - i % group_size]["prompt_ids"]
                                  for i in range(len(contexts))):
            group_size = 1  # the environment opened copies of one row differently: not a group of one prompt
        batch = self.inner.generate(contexts, turn_gen, greedy=greedy, group_size=group_size)
        for k, e in enumerate(running):
            valid = batch.response_mask[k].bool()
            ids = batch.response_ids[k][valid].tolist()[:max(remaining[k], 0)]
            logprobs = batch.sample_logprobs[k][valid].tolist()[:len(ids)]
            e.ids += ids
            e.model += [1] * len(ids)
            e.logprobs += logprobs
            e.turns += 1
            e.last_token = ids[-1] if ids else None
            e.text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if len(e.ids) >= self.cfg.max_tokens:
                e.done, e.ended = True, "max_tokens"

    def _environment_turn(self, running: list[Episode], last: bool) -> None:
        """Each environment answers its model's turn; the answer's ids are appended unless the episode ends."""
        name = f"{self.spec}.step"
        outcomes = self._call([lambda e=e: e.env.step(e.text) for e in running], as_step, name)
        for e, outcome in zip(running, outcomes):
            if outcome.failure is not None:
                e.fail(outcome.failure, outcome.detail)
                continue
            step = outcome.value
            if step.reward is not None:
                e.turn_rewards.append(step.reward)
            if step.done or last:
                e.done, e.ended = True, "done" if step.done else "max_turns"
                continue
            try:
                ids = self.renderer.followup(step.messages, e.last_token)
            except Exception as exc:  # noqa: BLE001 - a message the template refuses fails its episode alone
                e.fail("bad_value", f"{name}: its messages could not be rendered: {exc}")
                continue
            if len(e.ids) + len(ids) >= self.cfg.max_tokens:  # no room left for the model to answer
                e.done, e.ended = True, "max_tokens"
                continue
            e.ids += ids
            e.model += [0] * len(ids)
            e.logprobs += [0.0] * len(ids)

    def _returns(self, episodes: list[Episode]) -> list[float]:
        """Each episode's return: the final reward plus the per-turn ones; NaN where unjudged (a failure, or no
        reward at all)."""
        name = f"{self.spec}.reward"
        live = [e for e in episodes if e.failure is None]
        outcomes = dict(zip(map(id, live), self._call([lambda e=e: e.env.reward() for e in live], as_reward, name)))
        returns = []
        for e in episodes:
            outcome = outcomes.get(id(e))
            if outcome is not None and outcome.failure is not None:
                e.fail(outcome.failure, outcome.detail)
            if e.failure is not None:
                returns.append(math.nan)
                continue
            final = outcome.value
            if final is None and not e.turn_rewards:
                returns.append(math.nan)  # nothing judged it: unjudged, as a reward function's None
                e.unjudged = True
                continue
            returns.append((final or 0.0) + sum(e.turn_rewards))
        return returns

    def _check_failures(self, episodes: list[Episode]) -> None:
        """RunError when the share of episodes whose environment failed, over every rank, passes episode.max_failed."""
        local = {reason: float(sum(e.failure == reason for e in episodes)) for reason in FAILURES}
        total = float(len(episodes))
        if self.engine is not None and self.engine.world_size > 1:
            local = {reason: self.engine.reduce_sum(count) for reason, count in local.items()}
            total = self.engine.reduce_sum(total)
        failed = sum(local.values())
        if total and failed / total > self.cfg.max_failed:
            first = next((e.detail for e in episodes if e.failure is not None), "on another rank")
            counts = ", ".join(f"{int(n)} {reason}" for reason, n in local.items() if n)
            raise RunError(f"env {self.spec}: {int(failed)} of {int(total)} episodes failed ({counts}), more than "
                           f"episode.max_failed={self.cfg.max_failed:g} of them; first: {first}")

    # -- the batch ------------------------------------------------------------------------------------------
    def _batch(self, episodes: list[Episode], returns: list[float]) -> RolloutBatch:
        pad = self.tokenizer.pad_token_id
        width = max(1, max(len(e.ids) for e in episodes))

        def right(values, fill):
            return [v + [fill] * (width - len(v)) for v in values]

        response_ids = torch.tensor(right([e.ids for e in episodes], pad), dtype=torch.long)
        model = torch.tensor(right([e.model for e in episodes], 0), dtype=torch.float32)
        attention = torch.tensor(right([[1] * len(e.ids) for e in episodes], 0), dtype=torch.long)
        logprobs = torch.tensor(right([e.logprobs for e in episodes], 0.0), dtype=torch.float32)
        prompt_ids = pad_sequences([e.prompt_ids for e in episodes], pad, side="left")
        prompt_mask = pad_sequences([[1] * len(e.prompt_ids) for e in episodes], 0, side="left")
        texts = [self.tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes]
        stats = [{"turns": e.turns, "tool_calls": getattr(e.env, "tool_calls", 0), "ended": e.ended,
                  "env_tokens": len(e.ids) - sum(e.model), "failure": e.failure, "detail": e.detail,
                  "opening_cut": e.opening_cut,
                  "unjudged": e.unjudged or e.failure is not None} for e in episodes]
        device = self.engine.device if self.engine is not None else "cpu"
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                            response_mask=model, prompt_texts=[e.prompt_text for e in episodes], response_texts=texts,
                            messages=[e.messages for e in episodes],
                            fields=[e.row.get("fields", {}) for e in episodes], sample_logprobs=logprobs,
                            response_attention=attention, episode_rewards=torch.tensor(returns, dtype=torch.float32),
                            episodes=stats).to(device)


def _own_parser(tokenizer):
    """The tokenizer's own tool-call parser (transformers' `parse_response`), as (calls, errors)."""
    from rlhfkit.tools.format import ToolCall

    def parse(text: str):
        try:
            parsed = tokenizer.parse_response(text)
        except Exception as exc:  # noqa: BLE001 - a turn the parser cannot read: told to the model as an error
            return [], [f"the tool call could not be read: {exc}"]
        calls = []
        for call in (parsed or {}).get("tool_calls") or []:
            function = call.get("function", call)
            calls.append(ToolCall(function.get("name", ""), function.get("arguments") or {}))
        return calls, []

    return parse


class EnvironmentReward:
    """The reward part of an `env=` run: each episode's return, as its environment judged it (NaN: unjudged)."""

    stats = None  # no stored mean/std to normalise with

    def __call__(self, batch: RolloutBatch, finished: torch.Tensor | None = None) -> torch.Tensor:
        if batch.episode_rewards is None:
            raise RunError("an env= run's rollout carried no episode rewards")
        return batch.episode_rewards.float().cpu()


def episode_metrics(batch: RolloutBatch) -> dict:
    """The rollout's episodes at a glance: mean turns, tool calls and environment tokens per episode, the share
    that called a tool, the share whose opening was cut to data.max_prompt_length, and the share of each way an
    episode ended (done, max_turns, max_tokens, failures)."""
    stats = getattr(batch, "episodes", None)
    if not stats:
        return {}
    n = len(stats)
    out = {"episode/turns": sum(s["turns"] for s in stats) / n,
           "episode/tool_calls": sum(s["tool_calls"] for s in stats) / n,
           "episode/used_tool": sum(s["tool_calls"] > 0 for s in stats) / n,
           "episode/env_tokens": sum(s["env_tokens"] for s in stats) / n,
           "episode/opening_cut": sum(s.get("opening_cut", False) for s in stats) / n}
    for ended in ("done", "max_turns", "max_tokens", *FAILURES):
        out[f"episode/ended_{ended}"] = sum(s["ended"] == ended for s in stats) / n
    return out


def check_opening(data_cfg, tokenizer, tools: list, model_config) -> None:
    """ConfigError, before any model loads, when the tools' description alone (in every episode's opening) fills
    data.max_prompt_length or the model's positions (`model_config.max_position_embeddings`): no opening fits."""
    from rlhfkit.data.templates import Template

    template = Template.for_tokenizer(tokenizer, data_cfg.template, None)
    length, budget = TurnRenderer(template, tools).tools_length(), data_cfg.max_prompt_length
    context = getattr(model_config, "max_position_embeddings", None)
    if length and length >= budget:
        raise ConfigError(f"config key 'data.max_prompt_length': the tools' description alone takes {length} tokens "
                          f"of every episode's opening, and data.max_prompt_length={budget} leaves no room for the "
                          f"question; raise it (the model reads {context or 'an unknown number of'} positions) or "
                          f"list fewer tools")
    if length and context and length >= context:
        raise ConfigError(f"config key 'episode.tools': the tools' description alone takes {length} tokens, past "
                          f"the model's {context} positions")
