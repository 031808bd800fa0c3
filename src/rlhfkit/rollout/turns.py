"""The ids of an episode's environment turns, rendered by the chat template and appended after the model's own.

The model's turns are never decoded and re-encoded into the trajectory: its sampled ids stay as they are, and
only what the environment says is rendered. The chat template decides that text: for messages `new` after a model
turn, the renderer lays out a fixed conversation whose assistant turn is a placeholder, renders it alone and then
with `new` and the next generation prompt, and keeps what the second writes after the placeholder: the template's
end of the assistant turn (ChatML's `<|im_end|>\\n`), the new turns, and the header the model answers after
(`<|im_start|>assistant\\n`). Where the model ended its turn with the template's end token, that token is the
model's and is not appended again; a turn cut at the token limit gets the whole closing.

Without a chat template (the plain template of data/templates.py) the new turns are "\\n\\nUser: ..." blocks and
"\\n\\nAssistant:", after the model's EOS.

Tools: where the chat template takes `tools` (transformers' `apply_chat_template(tools=...)`), the opening is
rendered with them, in the template's own words; else the fallback format's instructions
(`rlhfkit.tools.format.tools_system_prompt`) join the system turn.
"""

from __future__ import annotations

from rlhfkit.data.templates import ROLE_NAMES, Template, encode_prompt
from rlhfkit.data.tokenize import shared_opening
from rlhfkit.errors import TemplateRefused

PLACEHOLDER, CONTEXT = "rlhfkit-placeholder-turn", "rlhfkit-context"


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads a `tools` variable."""
    source = getattr(tokenizer, "chat_template", None)
    return isinstance(source, str) and "tools" in source


class TurnRenderer:
    def __init__(self, template: Template, tools: list | None = None):
        self.template, self.tokenizer = template, template.tokenizer
        self.tools = list(tools or [])
        self.native_tools = bool(self.tools) and template.use_chat and template_takes_tools(self.tokenizer)
        self.end_ids = set(template.end_ids)

    def describe(self) -> str:
        if not self.tools:
            return "no tools"
        where = "in the chat template's own format" if self.native_tools else \
            "in rlhfkit's fallback format (rlhfkit.tools.format; the chat template has none)"
        return f"tools {', '.join(t.name for t in self.tools)} {where}"

    # -- the opening ---------------------------------------------------------------------------------------
    def opening_messages(self, messages: list[dict]) -> list[dict]:
        """`messages` with the fallback format's tool instructions joined to the system turn (the template's own
        system text kept, SmolLM2's), where the tools are described that way; else as they are. SFT rows that
        teach the format start from the same messages (demo/agent.py)."""
        if not self.tools or self.native_tools:
            return messages
        from rlhfkit.tools.format import tools_system_prompt

        own = self.template.added_system_prompt()
        if own and not (messages and messages[0]["role"] == "system"):
            messages = [{"role": "system", "content": own}, *messages]
        return with_system_text(messages, tools_system_prompt(self.tools))

    def opening(self, messages: list[dict]) -> tuple[list[int], str]:
        """(ids, text) of the episode's first prompt: `messages` rendered with the generation prompt, the tools
        described."""
        if self.native_tools:
            schemas = [tool.schema() for tool in self.tools]
            text = self.tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                                      add_generation_prompt=True)
        else:
            text = self.template.prompt(self.opening_messages(messages))
        return encode_prompt(self.tokenizer, text), text

    def fixed_length(self, messages: list[dict], ids: list[int]) -> int:
        """How many of an opening's `ids` come before its first non-system content (BOS, the system turn with the
        tools' description, the first header): what the opening of any other conversation shares with it."""
        return shared_opening(messages, ids, lambda other: self.opening(other)[0])

    def tools_length(self) -> int:
        """Tokens the tools' description adds to an opening (0 without tools): every episode's opening carries
        them, whatever its row."""
        if not self.tools:
            return 0
        bare = TurnRenderer(self.template)
        question = [{"role": "user", "content": "?"}]
        return len(self.opening(question)[0]) - len(bare.opening(question)[0])

    # -- a turn of the environment -------------------------------------------------------------------------
    def followup(self, messages: list[dict], last_token: int | None) -> list[int]:
        """The ids to append after a model turn whose last sampled id is `last_token`: the turn's closing (unless
        the model wrote it), `messages`, and the generation prompt of the next model turn."""
        text = self._followup_text(messages)
        ended = last_token in self.end_ids
        if ended:
            closing = self.tokenizer.decode([last_token])
            if text.startswith(closing):
                text = text[len(closing):]
        elif not self.template.use_chat:  # a turn cut at the limit: the plain template's turns end with EOS
            text = (self.tokenizer.eos_token or "") + text
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _followup_text(self, messages: list[dict]) -> str:
        if not self.template.use_chat:
            turns = [f"{ROLE_NAMES.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
            return "".join(f"\n\n{turn}" for turn in turns) + "\n\nAssistant:"
        try:
            return self._chat_suffix(messages)
        except TemplateRefused:
            if not any(m["role"] == "tool" for m in messages):
                raise
        # a template without a tool role: the results as user turns, named
        return self._chat_suffix([{"role": "user", "content": f"[{m.get('name', 'tool')} result] {m['content']}"}
                                  if m["role"] == "tool" else m for m in messages])

    def _chat_suffix(self, messages: list[dict]) -> str:
        base = [{"role": "user", "content": CONTEXT}, {"role": "assistant", "content": PLACEHOLDER}]
        alone = self.template.apply_chat(base)
        after = self.template.apply_chat(base + messages, add_generation_prompt=True)
        at = alone.rfind(PLACEHOLDER)
        head = alone[:at + len(PLACEHOLDER)]
        if at < 0 or not after.startswith(head):
            raise TemplateRefused("the chat template rewrites the assistant turn when messages follow it, so the "
                                  "environment's turns cannot be appended to the model's sampled ids")
        return after[len(head):]


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` at the end of their system turn (a new system turn first where there is none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"].rstrip() + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
