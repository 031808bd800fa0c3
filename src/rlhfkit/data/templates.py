"""Render canonical conversations to text, the same way in SFT, reward modelling and PPO.

With a chat template (the tokenizer's, `data.template: auto|chat`) the prompt is
`apply_chat_template(messages, add_generation_prompt=True)` and the response is whatever the template
appends for the assistant turn (so it ends with the template's end-of-turn marker).

Without one (`plain`), the documented plain template is:

    User: {first user message}

    Assistant: {assistant message}

    User: {next user message}

    Assistant:{" " + response}{eos_token}

with `System: {content}` for system messages. It resembles the Anthropic HH layout that many preference
sets use, and needs no special tokens besides EOS.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


@dataclass
class Template:
    """Turns prompt messages and a response into (prompt_text, response_text)."""

    tokenizer: object
    use_chat: bool

    @classmethod
    def for_tokenizer(cls, tokenizer, mode: str = "auto") -> "Template":
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if mode == "chat" and not has_chat:
            raise ValueError("data.template is 'chat' but the tokenizer has no chat template; use 'plain' or 'auto'")
        return cls(tokenizer, use_chat=has_chat and mode != "plain")

    @property
    def name(self) -> str:
        return "chat" if self.use_chat else "plain"

    def prompt(self, messages: list[dict]) -> str:
        if self.use_chat:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        turns = [f"{ROLE_NAMES.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
        return "\n\n".join(turns) + "\n\nAssistant:"

    def response(self, messages: list[dict], response: str) -> str:
        """The text that follows `prompt(messages)` for this response, end-of-turn included."""
        if self.use_chat:
            prompt = self.prompt(messages)
            full = self.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}],
                                                      tokenize=False)
            if full.startswith(prompt):
                return full[len(prompt):]
            # Templates that rewrite earlier turns (e.g. strip reasoning) break the prefix property;
            # fall back to the bare response so training still sees prompt + response.
            return response + (self.tokenizer.eos_token or "")
        return " " + response.strip() + (self.tokenizer.eos_token or "")


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt, with BOS added once (templates often write it themselves)."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def encode_response(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered response, guaranteed to end with EOS so the model learns to stop."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if not ids or ids[-1] != eos:
        ids.append(eos)
    return ids
