"""A chat with any stage's output (SFT or PPO final/, or any HF causal LM): what `rlhfkit chat MODEL_DIR` runs.

Turns are rendered with the same `Template` as training (the tokenizer's chat template, else rlhfkit's plain
`User: ...\n\nAssistant:` one), so a model is asked exactly as it was taught. The conversation is kept and re-sent
each turn; when it no longer fits the model's context, the oldest turns are dropped. `--compare OTHER_DIR` asks a
second model the same things (each keeps its own history of its own answers) and prints the answers side by side.
torch and transformers are imported where a model is loaded or asked, not at module level.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import textwrap

DEFAULT_CONTEXT = 2048  # when a config names no context length


class ChatModel:
    """A causal LM, its tokenizer and template; `reply(messages)` answers the last user message."""

    def __init__(self, name: str, mode: str = "auto"):
        from rlhfkit.data.templates import Template
        from rlhfkit.models import ModelError, load_causal_lm, load_tokenizer
        from rlhfkit.models.loading import check_model_source, template_mode
        from rlhfkit.rollout.generate import eos_token_ids

        check_model_source(None, name)  # a name that is no folder: one line now, not the hub's retries
        self.name = name
        self.tokenizer = load_tokenizer(name, padding_side="left")
        self._refuse_scalar_head(name, ModelError)
        self.model = load_causal_lm(name, None, self.tokenizer).eval()
        try:
            self.template = Template.for_tokenizer(self.tokenizer, template_mode(mode, name, None, self.tokenizer))
        except ValueError as exc:
            raise ModelError(f"--template: {exc}") from None
        self.eos_ids = eos_token_ids(self.tokenizer, self.model)
        config = self.model.config
        self.context = getattr(config, "max_position_embeddings", None) or DEFAULT_CONTEXT

    @staticmethod
    def _refuse_scalar_head(name: str, error) -> None:
        from transformers import AutoConfig

        try:
            archs = getattr(AutoConfig.from_pretrained(name), "architectures", None) or []
        except (OSError, ValueError):
            return  # load_causal_lm reports what is wrong with the folder
        if any("SequenceClassification" in a for a in archs):
            raise error(f"'{name}' is a reward model or critic (a scalar head), not a chat model: score responses "
                        f"with `rlhfkit score {shlex.quote(name)} --data FILE`, or chat with an sft/ppo final/ folder")

    def prompt_ids(self, messages: list[dict], max_new_tokens: int) -> list[int]:
        """Token ids of the rendered conversation, dropping the oldest turns until the answer fits the context."""
        from rlhfkit.data.templates import encode_prompt

        system = [m for m in messages[:1] if m["role"] == "system"]
        turns = messages[len(system):]
        budget = max(1, self.context - max_new_tokens)
        while True:
            ids = encode_prompt(self.tokenizer, self.template.prompt(system + turns))
            if len(ids) <= budget:
                return ids
            if len(turns) <= 1:  # one message longer than the context: keep its end (the question), and say so
                print(f"rlhfkit chat: the message is {len(ids)} tokens, more than the {budget} that "
                      f"'{self.name}''s context of {self.context} leaves beside --max-new-tokens {max_new_tokens}: "
                      f"only its last {budget} are read", file=sys.stderr)
                return ids[-budget:]
            turns = turns[2:]  # drop the oldest user/assistant exchange

    def reply(self, messages: list[dict], args) -> str:
        import torch

        ids = torch.tensor([self.prompt_ids(messages, args.max_new_tokens)])
        sampling = {"do_sample": False} if args.greedy else {"do_sample": True, "temperature": args.temperature,
                                                              "top_p": args.top_p, "top_k": 0}
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=args.max_new_tokens, eos_token_id=self.eos_ids,
                                      pad_token_id=self.tokenizer.pad_token_id, **sampling)
        return self.tokenizer.decode(out[0, ids.size(1):], skip_special_tokens=True).strip()


def side_by_side(left_title: str, left: str, right_title: str, right: str, width: int) -> str:
    """Two texts in two wrapped columns under their one-line titles, separated by ' | '. A title longer than its
    column keeps its end (a model folder's path differs from the other's at the end, not at the start)."""
    col = max(10, (width - 3) // 2)

    def lines(title: str, text: str) -> list[str]:
        body = [w for para in (text or "(empty)").splitlines() for w in (textwrap.wrap(para, col) or [""])]
        title = title if len(title) <= col else "…" + title[-(col - 1):]
        return [title, "-" * min(col, max(len(title), 3))] + body

    a, b = lines(left_title, left), lines(right_title, right)
    a += [""] * (len(b) - len(a))
    b += [""] * (len(a) - len(b))
    return "\n".join(f"{x:<{col}} | {y}".rstrip() for x, y in zip(a, b))


class Conversation:
    """One history per model: each model sees its own earlier answers, as in a real chat with it."""

    def __init__(self, models: list[ChatModel], system: str | None):
        self.models, self.system = models, system
        self.reset()

    def reset(self) -> None:
        start = [{"role": "system", "content": self.system}] if self.system else []
        self.histories = [list(start) for _ in self.models]

    def ask(self, text: str, args) -> list[str]:
        """Each model's answer to `text`. A turn that fails or is interrupted (Ctrl-C) leaves every history as it
        was; a conversation the chat template refuses is a ModelError naming the model."""
        from rlhfkit.errors import ModelError, TemplateRefused

        lengths = [len(history) for history in self.histories]
        answers = []
        try:
            for model, history in zip(self.models, self.histories):
                history.append({"role": "user", "content": text})
                try:
                    answer = model.reply(history, args)
                except TemplateRefused as exc:
                    system = " (it may not take --system's system message)" if self.system else ""
                    why = str(exc).removeprefix("the chat template refuses this conversation: ")
                    raise ModelError(f"the chat template of '{model.name}' refuses this conversation{system}: "
                                     f"{why}") from None
                history.append({"role": "assistant", "content": answer})
                answers.append(answer)
        except BaseException:
            for history, n in zip(self.histories, lengths):
                del history[n:]
            raise
        return answers


def show(models: list[ChatModel], answers: list[str], out) -> None:
    if len(answers) == 1:
        print(answers[0], file=out)
        return
    width = shutil.get_terminal_size((120, 20)).columns
    print(side_by_side(models[0].name, answers[0], models[1].name, answers[1], width), file=out)


def interact(conv: Conversation, args, read=input, out=sys.stdout) -> None:
    """The read-answer loop: /reset, /quit, Ctrl-D; an empty line is ignored; Ctrl-C while a model answers drops
    that turn and goes on, as does a turn the chat template refuses (its error printed)."""
    from rlhfkit.errors import ModelError

    print("chat: /reset forgets the conversation, /quit leaves", file=out)
    while True:
        try:
            text = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=out)
            return
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return
        if text == "/reset":
            conv.reset()
            print("(conversation reset)", file=out)
            continue
        try:
            show(conv.models, conv.ask(text, args), out)
        except KeyboardInterrupt:
            print("(interrupted: that turn is dropped)", file=out)
        except ModelError as exc:
            print(f"rlhfkit chat: error: {exc}", file=sys.stderr)
