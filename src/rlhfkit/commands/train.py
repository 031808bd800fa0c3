"""`rlhfkit sft | rm | ppo | dpo | pipeline`: the training verbs. Each reads a YAML config and dotted overrides into
its typed config (config/), runs its stage (stages/) and prints the stage's summary as one JSON line; a mistake is
one error line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from rlhfkit.config.fields import help_text, load_config
from rlhfkit.errors import USER_ERRORS, RunStopped

# the exit code of a run a monitor stopped (monitor.action=stop or stop_best): outputs exported as at a normal end,
# the JSON summary printed, but fewer steps ran than asked (2: bad input; 128 + N: stopped by signal N)
MONITOR_STOPPED = 3

# verb -> (config class path, runner path, one-line description); imported lazily so --help stays fast
TRAIN_VERBS = {
    "sft": ("rlhfkit.config.schema:SFTConfig", "rlhfkit.stages.sft:run_sft",
            "step 1: supervised fine-tuning on demonstrations"),
    "rm": ("rlhfkit.config.schema:RMConfig", "rlhfkit.stages.reward:run_rm",
           "step 2: reward model (scalar head) on preference pairs"),
    "ppo": ("rlhfkit.config.ppo_schema:PPOConfig", "rlhfkit.stages.ppo:run_ppo",
            "step 3: PPO with actor, critic, frozen reference and reward (LoRA, PPO-ptx, EMA), or critic-free "
            "GRPO / RLOO / REINFORCE++ (ppo.advantage_estimator)"),
    "dpo": ("rlhfkit.config.dpo_schema:DPOConfig", "rlhfkit.stages.dpo:run_dpo",
            "offline preference optimisation from an SFT model: DPO, cDPO, IPO, SimPO (+ RPO's NLL term)"),
    "pipeline": ("rlhfkit.config.pipeline_schema:PipelineConfig", "rlhfkit.stages.pipeline:run_pipeline",
                 "steps 1 -> 2 -> 3 (or sft -> dpo) from one config, outputs chained, complete steps skipped"),
}

EXAMPLES = {
    "sft": "rlhfkit sft --config configs/sft.yaml train.max_steps=40 lora.rank=8",
    "rm": "rlhfkit rm --config configs/rm.yaml model=runs/sft/final train.max_steps=200 rm.margin=0.5",
    "ppo": "rlhfkit ppo --config configs/ppo.yaml actor=runs/sft/final reward=runs/rm/final ppo.kl_coef=0.05",
    "dpo": "rlhfkit dpo model=runs/sft/final data.train=pairs.jsonl dpo.loss=sigmoid dpo.beta=0.1 lora.rank=16",
    "pipeline": "rlhfkit pipeline --config configs/pipeline.yaml ppo.train.max_steps=100 --force",
}


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def add_parser(sub, verb: str, summary: str) -> argparse.ArgumentParser:
    fields = help_text(_load(TRAIN_VERBS[verb][0]))
    p = sub.add_parser(verb, help=summary, description=summary, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"example:\n  {EXAMPLES.get(verb, '')}\n\nconfig fields (YAML keys; override any "
                              f"with dotted.key=value):\n{fields}")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=5e-6")
    if verb == "pipeline":
        p.add_argument("--resume", action="store_true", help="continue a step a killed run left unfinished from its "
                       "checkpoint (complete steps are skipped either way)")
        p.add_argument("--force", action="store_true", help="rerun every step, complete ones included, each from "
                       "scratch")
        p.add_argument("--rerun", metavar="STEP", help="rerun this step from scratch (e.g. after changing its "
                       "settings) and the steps built on it; the steps before it are kept")
        return p
    p.add_argument("--resume", action="store_true", help="continue from output_dir/checkpoints/latest (the same "
                   "model and data as its config.yaml; other changed settings are listed and used)")
    p.add_argument("--force", action="store_true", help="start over in an output_dir that holds a finished or "
                   "killed run: what that run wrote (final/, checkpoints/, tensorboard/, metrics) is removed first")
    return p


def main(args) -> int:
    """Load the verb's config, run its stage, print the summary (exit 0, or MONITOR_STOPPED); one error line and
    exit 2 on bad input, the signal's code when stopped by one."""
    cfg_path, runner_path, _ = TRAIN_VERBS[args.verb]
    if args.resume and (args.force or getattr(args, "rerun", None)):
        other = "--force" if args.force else "--rerun"
        _say(f"rlhfkit {args.verb}: error: --resume continues a run and {other} starts it over: pass one of them")
        return 2
    cfg = None
    try:
        cfg = load_config(_load(cfg_path), args.config, args.overrides)
        rerun = {"rerun": args.rerun} if args.verb == "pipeline" else {}
        result = _load(runner_path)(cfg, resume=args.resume, force=args.force, **rerun)
    except USER_ERRORS as exc:
        _say(f"rlhfkit {args.verb}: error: {exc}")
        return 2
    except RunStopped as exc:  # SIGTERM / SIGINT: a checkpoint was saved
        message = str(exc)  # "STAGE: stopped by ...": the stage said once (a pipeline's names its step)
        _say(f"rlhfkit {message}" if message.startswith(f"{args.verb}: ") else f"rlhfkit {args.verb}: {message}")
        return exc.exit_code
    except KeyboardInterrupt:
        _say(f"rlhfkit {args.verb}: interrupted")
        return 130
    except RuntimeError as exc:  # a collective failed because another rank died or hung: one line, then out
        _exit_on_lost_rank(args.verb, exc, getattr(cfg, "output_dir", None))
        raise
    from rlhfkit.engine.launch import is_main_process

    if is_main_process():
        print(json.dumps(result))
    return MONITOR_STOPPED if "stopped_by" in result else 0


def _say(line: str) -> None:
    """One line to stderr in one write, so that ranks sharing a terminal or pipe cannot splice their lines."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an in-memory stream (tests capturing output)
        sys.stderr.write(line + "\n")
        return
    os.write(fd, (line + "\n").encode())


def _exit_on_lost_rank(verb: str, exc: RuntimeError, output_dir) -> None:
    """When `exc` is a failed collective (a rank died or hung; only a multi-rank DeepSpeed run has them), print
    one error line and leave at once with code 1: the process group is broken, and tearing it down normally
    can abort or hang on the dead peer."""
    group = sys.modules.get("rlhfkit.engine.process_group")  # not loaded: no process group, not this case
    message = group.lost_rank_message(exc, output_dir) if group is not None else None
    if message is None:
        return
    _say(f"rlhfkit {verb}: error: {message}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
