"""Render canonical conversations to text, the same way in SFT, reward modelling and PPO.

With a chat template (the tokenizer's, `data.template: auto|chat`) the prompt is
`apply_chat_template(messages, add_generation_prompt=True)` and the response is what the template appends for
the assistant turn, cut right after its end-of-turn token (ChatML's `content<|im_end|>`, without the `\\n` the
template writes after it).

Without one (`plain`), the documented plain template is:

    User: {first user message}

    Assistant: {assistant message}

    User: {next user message}

    Assistant:{" " + response}{eos_token}

with `System: {content}` for system messages. It resembles the Anthropic HH layout that many preference
sets use, and needs no special tokens besides EOS. Turns are rendered as they come: an HH prompt that ends with
an assistant turn, or has two turns of one role in a row, keeps that layout.

Where a response ends is the same in every step: at the first of the END IDS, the tokenizer's EOS plus the
model folder's generation_config `eos_token_id` (`end_token_ids`), which are also the ids PPO rollouts stop at
(rollout/generate.py). A rendered response therefore ends with exactly one end token, EOS being appended only
when the template writes none; a response cut at the token limit is rendered without one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from jinja2 import TemplateError

from rlhfkit.errors import ConfigError, TemplateRefused

ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def end_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's `eos_token_id` (an int or
    a list). Chat models often stop on an end-of-turn token that is not the tokenizer's EOS, e.g. Llama 3's
    <|eot_id|> (generation_config eos [128001, 128008, 128009])."""
    ids = {tokenizer.eos_token_id}
    extra = getattr(generation_config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
    return sorted(i for i in ids if i is not None)


def merge_same_role_turns(messages: list[dict]) -> list[dict]:
    """Consecutive messages of one role as one message, their non-empty contents joined by a blank line: what a
    template that needs alternating roles (Llama-2, Mistral, Gemma) can render."""
    merged: list[dict] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"]:
            parts = [part for part in (merged[-1]["content"], message["content"]) if part]
            merged[-1] = {"role": message["role"], "content": "\n\n".join(parts)}
        else:
            merged.append(dict(message))
    return merged


@dataclass
class Template:
    """Turns prompt messages and a response into (prompt_text, response_text).

    `end_ids` are the token ids that end a response (see `end_token_ids`); they always include the tokenizer's
    EOS."""

    tokenizer: object
    use_chat: bool
    end_ids: tuple[int, ...] = ()

    def __post_init__(self):
        self.end_ids = tuple(sorted({self.tokenizer.eos_token_id, *self.end_ids} - {None}))

    @classmethod
    def for_tokenizer(cls, tokenizer, mode: str = "auto", end_ids: list[int] | None = None,
                      key: str | None = None) -> "Template":
        """`end_ids`: the ids rollouts stop at, `end_token_ids(tokenizer, generation_config)` where the model folder
        is known; default: the tokenizer's EOS only. `key`: the config key `mode` came from, for the error."""
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if mode == "chat" and not has_chat:
            raise ConfigError(f"{f'config key {key!r}: ' if key else ''}'chat' needs a chat template and the "
                              f"tokenizer has none; use 'plain' or 'auto'")
        return cls(tokenizer, use_chat=has_chat and mode != "plain", end_ids=tuple(end_ids or ()))

    @property
    def name(self) -> str:
        return "chat" if self.use_chat else "plain"

    @property
    def end_tokens(self) -> list[str]:
        """The end ids as the text a template writes for them (e.g. "<|im_end|>")."""
        return [token for token in self.tokenizer.convert_ids_to_tokens(list(self.end_ids)) if token]

    def prompt(self, messages: list[dict]) -> str:
        if self.use_chat:
            return self.apply_chat(messages, add_generation_prompt=True)
        turns = [f"{ROLE_NAMES.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
        return "\n\n".join(turns) + "\n\nAssistant:"

    def response(self, messages: list[dict], response: str, finished: bool = True) -> str:
        """The text that follows `prompt(messages)` for this response.

        finished: up to and including the first end token after the content (EOS appended when the template
        writes none); not finished (a rollout cut at the token limit): the same text without that end token."""
        content = response.strip()
        text = self._assistant_turn(messages, content) if self.use_chat else " " + content
        end = self._first_end_token(text, content)
        if end is None:
            return text + (self.tokenizer.eos_token or "") if finished else _through(text, content)
        start, stop = end
        return text[:stop] if finished else text[:start]

    def written_turn(self, messages: list[dict], response: str, finished: bool = True) -> str:
        """The assistant turn exactly as the chat template writes it after the prompt, its end-of-turn marker and
        what follows it included (ChatML's `<|im_end|>\n`): the text a reward model trained on
        `apply_chat_template` output outside rlhfkit scored. Not finished: up to the end of the content, so a
        response cut at the token limit does not look finished. Without a chat template: `response()`."""
        if not self.use_chat:
            return self.response(messages, response, finished)
        content = response.strip()
        text = self._assistant_turn(messages, content)
        return text if finished else _through(text, content)

    def _assistant_turn(self, messages: list[dict], content: str) -> str:
        """What the chat template writes after the prompt for an assistant reply `content`."""
        prompt = self.prompt(messages)
        full = self.apply_chat(messages + [{"role": "assistant", "content": content}])
        if full.startswith(prompt):
            return full[len(prompt):]
        # Templates that rewrite earlier turns (e.g. strip reasoning), or a prompt ending with an assistant turn
        # that an alternation-requiring template merged with the reply, break the prefix property; fall back to
        # the bare response so training still sees prompt + response.
        return content

    def _first_end_token(self, text: str, content: str) -> tuple[int, int] | None:
        """(start, stop) of the first end token after `content` in `text` (from its start when the template
        changed the content), or None when there is none."""
        at = text.find(content) if content else -1
        after = at + len(content) if at >= 0 else 0
        hits = [(text.find(token, after), -len(token)) for token in self.end_tokens]
        hits = [hit for hit in hits if hit[0] >= 0]
        if not hits:
            return None
        start, minus_length = min(hits)  # the earliest; the longest token at a tie
        return start, start - minus_length

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat template's text; when it refuses the conversation (jinja raises, e.g. Llama-2's "roles must
        alternate"), same-role turns are merged and rendering retried once. TemplateRefused if it still raises."""
        try:
            return self._render(messages, add_generation_prompt)
        except TemplateError as exc:
            merged = merge_same_role_turns(messages)
            if merged == messages:
                raise TemplateRefused(f"the chat template refuses this conversation: {exc}") from None
        try:
            return self._render(merged, add_generation_prompt)
        except TemplateError as exc:
            raise TemplateRefused(f"the chat template refuses this conversation, even with same-role turns "
                                  f"merged: {exc}") from None

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def added_system_prompt(self) -> str | None:
        """The system text the chat template writes into a conversation that has no system turn (SmolLM2's "You
        are a helpful AI assistant named SmolLM, ...", Qwen2.5's "You are Qwen, ..."), or None.

        One user turn is rendered twice, alone and after a system turn holding a marker: a template that adds its
        own system prompt renders the first as the second with its text in the marker's place. A template that
        writes the same header either way (Llama 3's dates) adds no text of its own here."""
        if not self.use_chat:
            return None
        marker, user = "\x00system\x00", [{"role": "user", "content": "\x00user\x00"}]
        try:
            alone = self._render(user, True)
            before, _, after = self._render([{"role": "system", "content": marker}] + user, True).partition(marker)
        except Exception:  # noqa: BLE001 - a template that refuses a system turn (Gemma's) has none of its own
            return None
        if not after or len(alone) <= len(before) + len(after) or not (alone.startswith(before)
                                                                       and alone.endswith(after)):
            return None
        return alone[len(before):len(alone) - len(after)].strip() or None


def _through(text: str, content: str) -> str:
    """`text` up to the end of `content` in it (all of it when `content` is not there)."""
    at = text.find(content) if content else -1
    return text[:at + len(content)] if at >= 0 else text


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt (or of prompt + response), with BOS added once (templates often write it
    themselves); an EOS that the tokenizer appends to every text (`add_eos_token`) is not kept: a prompt does not
    end there, and the response's own end is the template's."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    ids = list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
    if add_special and ids and _appends_eos(tokenizer):
        ids.pop()
    return ids


_APPENDS_EOS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _appends_eos(tokenizer) -> bool:
    """Whether `tokenizer` appends EOS to every text it encodes with special tokens (asked once per tokenizer)."""
    try:
        return _APPENDS_EOS[tokenizer]
    except KeyError:
        pass
    eos = getattr(tokenizer, "eos_token_id", None)
    special, bare = (tokenizer("a", add_special_tokens=flag)["input_ids"] for flag in (True, False))
    _APPENDS_EOS[tokenizer] = known = eos is not None and special[-1:] == [eos] and bare[-1:] != [eos]
    return known


def encode_response(tokenizer, text: str, end_ids=None, finished: bool = True,
                    after: tuple[str, list[int]] | None = None) -> list[int]:
    """Token ids of a rendered response. A finished one ends with one of `end_ids` (default: the tokenizer's
    EOS), EOS being appended only when the text does not already end with one, so the model learns to stop where
    rollouts stop; an unfinished one (`Template.response(..., finished=False)`) is encoded as it is.

    `after` = (the rendered prompt, its ids from `encode_prompt`): the response is encoded in context, as the ids
    that follow the prompt's in the encoding of prompt + response, which is how the model reads the whole text.
    Encoded alone, a SentencePiece tokenizer with a dummy prefix (Llama-2, Mistral) would start every response
    with an extra '▁' token. Where a token spans the boundary (the prompt's ids are not a prefix of the whole's),
    the response is encoded alone."""
    ids = None
    if after is not None:
        prompt_text, prompt_ids = after
        whole = encode_prompt(tokenizer, prompt_text + text)
        if whole[:len(prompt_ids)] == prompt_ids:
            ids = whole[len(prompt_ids):]
    if ids is None:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ends = set(end_ids or ()) | {tokenizer.eos_token_id}
    if finished and (not ids or ids[-1] not in ends):
        ids.append(tokenizer.eos_token_id)
    return ids
