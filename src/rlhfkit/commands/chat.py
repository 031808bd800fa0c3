"""`rlhfkit chat MODEL_DIR`: talk to a model folder through its training template (the chat itself: chat.py), or
ask it one --prompt; --compare asks a second model the same things."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhfkit.chat import ChatModel, Conversation, interact, show
from rlhfkit.errors import USER_ERRORS, ModelError

EPILOG = """\
in the interactive chat: /reset forgets the conversation, /quit (or Ctrl-D) leaves

examples:
  rlhfkit chat runs/demo/ppo/final
  rlhfkit chat runs/demo/ppo/final --prompt "describe the river" --greedy
  rlhfkit chat runs/demo/sft/final --compare runs/demo/ppo/final --temperature 0.7
"""


def add_parser(sub, verb: str, summary: str) -> argparse.ArgumentParser:
    p = sub.add_parser(verb, help=summary, description=summary, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a causal-LM folder (an sft/ppo run's final/) or hub id")
    p.add_argument("--prompt", help="print the answer to this one message and exit (no interaction)")
    p.add_argument("--compare", metavar="OTHER_DIR", help="a second model that answers the same messages")
    p.add_argument("--system", help="a system message at the start of the conversation")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest answer in tokens (default 128)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (deterministic) instead of sampling")
    p.add_argument("--seed", type=int, default=None, help="seed the sampler (reproducible answers)")
    p.add_argument("--template", choices=("auto", "chat", "plain"), default="auto",
                   help="prompt rendering, as data.template in training (default auto: the tokenizer's chat "
                        "template, or plain when rlhfkit trained the folder plain)")
    return p


def main(args) -> int:
    if args.max_new_tokens < 1 or args.temperature <= 0 or not 0 < args.top_p <= 1:
        print("rlhfkit chat: error: need --max-new-tokens >= 1, --temperature > 0, 0 < --top-p <= 1", file=sys.stderr)
        return 2
    try:
        import torch

        if args.seed is not None:
            torch.manual_seed(args.seed)
        names = [args.model_dir] + ([args.compare] if args.compare else [])
        models = [ChatModel(str(Path(n)) if Path(n).exists() else n, args.template) for n in names]
        for model in models:
            if args.max_new_tokens >= model.context:
                raise ModelError(f"--max-new-tokens {args.max_new_tokens} leaves no room for the conversation in "
                                 f"'{model.name}''s context of {model.context} tokens: use fewer (at most "
                                 f"{model.context // 2} leaves it half)")
        conv = Conversation(models, args.system)
        if args.prompt is not None:
            show(models, conv.ask(args.prompt, args), sys.stdout)
        else:
            interact(conv, args)
    except USER_ERRORS as exc:
        print(f"rlhfkit chat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlhfkit chat: interrupted", file=sys.stderr)
        return 130
    return 0
