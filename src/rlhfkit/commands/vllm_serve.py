"""`rlhfkit vllm-serve MODEL [vllm serve options]`: a vLLM server as `rollout.server` wants it, in one command
(rollout/serve.py runs it)."""

from __future__ import annotations

import argparse
import sys

from rlhfkit.config.vllm_checks import INSTALL_HINT

# the words after MODEL are vLLM's own options: the command line checks none of them
PASS_THROUGH = True


def add_parser(sub, verb: str, summary: str) -> argparse.ArgumentParser:
    doc = ("serve MODEL with vLLM for `rollout.engine=vllm rollout.server=URL` (docs/vllm.md): `vllm serve` with "
           "the development endpoints on, processed log-probs, no sampling defaults from the folder, and the CPU "
           "build's flags where there is no GPU; other `vllm serve` options pass through (--port, --host, "
           "--max-model-len, ...)")
    p = sub.add_parser(verb, help=summary, description=doc)
    p.add_argument("model", metavar="MODEL", help="the actor's starting folder (the run's `actor`)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="more `vllm serve` options, e.g. --port 8001")
    return p


def main(args) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(f"rlhfkit vllm-serve: error: vllm is not installed in this Python ({sys.executable}); {INSTALL_HINT}",
              file=sys.stderr)
        return 2
    import torch

    from rlhfkit.rollout.serve import prepare_server_environment, run_vllm_serve, serve_argv

    on_cpu = not torch.cuda.is_available()
    prepare_server_environment(on_cpu)
    argv = serve_argv(args.model, args.vllm_args, on_cpu)
    print("rlhfkit vllm-serve: " + " ".join(argv), file=sys.stderr, flush=True)
    run_vllm_serve(argv)
    return 0
