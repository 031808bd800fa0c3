"""`rlhfkit demo`: the embedded default world (demo/run.py), its arena, or a --task demo. Only argparse and the
estimator registry (the algorithms to choose from; it imports nothing) at module level: the demo's modules import
torch."""

from __future__ import annotations

import argparse
import sys

from rlhfkit.registry.estimators import algorithms


def add_parser(sub, verb: str, summary: str) -> argparse.ArgumentParser:
    p = sub.add_parser(verb, help=summary, description=summary + " (exit code 0 when every bar passes, 1 otherwise)",
                       epilog="example:\n  rlhfkit demo --output runs/demo\n"
                              "  rlhfkit demo --quick ppo.train.max_steps=40\n"
                              "  rlhfkit demo --algos all         # and the arena: PPO, GRPO, RLOO, REINFORCE++, DPO\n"
                              "  rlhfkit demo --task arithmetic   # runs/demo-arithmetic\n"
                              "  rlhfkit demo --task calculator   # an agent learns to call a tool: runs/demo-calculator",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (for tests, ~2.5 minutes)")
    p.add_argument("--force", action="store_true", help="rebuild everything instead of reusing complete steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the world and of every step (default 0)")
    p.add_argument("--early-stop", action="store_true",
                   help="evaluate the PPO checkpoint of best gold reward on the validation prompts (exported to "
                        "OUTPUT/early-stop) instead of PPO's last policy")
    p.add_argument("--task", choices=("arithmetic", "calculator"), default=None,
                   help="instead of the toy world: SmolLM2-135M-Instruct (rlhfkit fetch) learns this task with a "
                        "verifiable reward by RL (~10 minutes on 2 cores; --quick: a shorter run); calculator: "
                        "3-digit multiplication in multi-turn episodes with a calculator tool (SFT on 12 "
                        "demonstrations, then GRPO)")
    p.add_argument("--algo", choices=tuple(algorithms()), default="ppo",
                   help="with --task: the RL algorithm (ppo: a critic; grpo, rloo: groups of 4 samples per prompt, "
                        "no critic; reinforce_pp: no critic); output runs/demo-TASK-ALGO")
    p.add_argument("--algos", default=None, metavar="A,B,...",
                   help="the arena: after the demo, also train these from the same SFT model and compare them on "
                        f"the gold reward ({', '.join(algorithms())}, dpo, or all; PPO is always in the table); "
                        "each must raise the gold by 3 standard errors (about a minute more per algorithm)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides of the pipeline config, e.g. ppo.ppo.kl_coef=0.1 (with --task: of the "
                        "ppo config, e.g. train.lr=2e-5)")
    return p


def main(args) -> int:
    from rlhfkit.demo.arena import parse_algos
    from rlhfkit.demo.run import run_demo
    from rlhfkit.demo.task_run import run_task_demo
    from rlhfkit.errors import USER_ERRORS, ConfigError, RunStopped

    try:
        if args.task and args.algos:
            raise ConfigError("--algos compares algorithms on the toy world; with --task choose one with --algo")
        if args.task and args.early_stop:
            raise ConfigError("--early-stop picks the toy world's PPO checkpoint of best gold reward; the --task "
                              "demo has no gold reward to pick by")
        if not args.task and args.algo != "ppo":
            raise ConfigError("--algo chooses the --task demo's algorithm; the toy world compares algorithms with "
                              "--algos")
        if args.task == "calculator":
            if args.algo != "ppo":
                raise ConfigError("--task calculator trains with GRPO (its own recipe); leave out --algo")
            from rlhfkit.demo.agent_run import run_agent_demo

            output = "runs/demo-calculator" if args.output == "runs/demo" else args.output
            return run_agent_demo(output, args.quick, args.overrides, args.force, args.seed)
        if args.task:
            suffix = "" if args.algo == "ppo" else f"-{args.algo}"
            output = f"runs/demo-{args.task}{suffix}" if args.output == "runs/demo" else args.output
            return run_task_demo(output, args.task, args.quick, args.overrides, args.force, args.seed, args.algo)
        algos = parse_algos(args.algos) if args.algos else None
        return run_demo(args.output, args.quick, args.overrides, args.force, args.seed, args.early_stop, algos)
    except USER_ERRORS as exc:
        print(f"rlhfkit demo: error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:  # SIGTERM / SIGINT in a step: it saved a checkpoint, and a rerun continues it
        print(f"rlhfkit demo: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("rlhfkit demo: interrupted (rerun the same command: complete steps are kept)", file=sys.stderr)
        return 130
