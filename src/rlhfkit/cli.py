"""`rlhfkit` command line: one verb per stage, YAML config + dotted overrides, one clear line per error."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from rlhfkit.config.fields import help_text, load_config, rejoin_words
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


def _train_parser(sub, verb: str):
    cfg_path, _, doc = TRAIN_VERBS[verb]
    fields = help_text(_load(cfg_path))
    p = sub.add_parser(verb, help=doc, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhfkit", description="RLHF for Hugging Face causal LMs: "
                                     "SFT -> reward model -> PPO, on one CPU or many GPUs.")
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb in TRAIN_VERBS:
        _train_parser(sub, verb)
    rep = sub.add_parser("report", help="write report.html with plots for a run folder",
                         description="write RUN_DIR/report.html: the curves of each stage's metrics.jsonl (plots/ "
                                     "PNGs beside it, a pipeline's steps in order), with no scripts or network "
                                     "(a finished run writes it by itself; this redraws it, e.g. during a run)")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir (one stage's, or a pipeline's)")
    rep.add_argument("--title", help="the page's title (default: summary.json's, else the folder's name)")
    ckpt = sub.add_parser("checkpoints", help="list a run's checkpoints and verify them against their manifests",
                          description="list a run's checkpoints (step, ranks, ZeRO stage, size) and verify each "
                                      "against its manifest.json (sizes and sha256); exit 1 when one is damaged")
    ckpt.add_argument("run_dir", help="a run's output_dir (or its checkpoints/ folder)")
    ckpt.add_argument("--quick", action="store_true", help="check sizes only, not sha256 hashes")
    ckpt.add_argument("--use", metavar="CHECKPOINT", help="point `latest` at this checkpoint (step-00000040 or 40) "
                                                          "if it verifies, so that --resume continues from it")
    _load("rlhfkit.score:add_score_parser")(sub)
    _load("rlhfkit.demo.cli:add_demo_parser")(sub)
    _load("rlhfkit.chat:add_chat_parser")(sub)
    _load("rlhfkit.models.fetch:add_fetch_parser")(sub)
    _load("rlhfkit.rollout.serve:add_serve_parser")(sub)
    _load("rlhfkit.remote.server:add_serve_reward_parser")(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not _is_terminal(sys.stderr):  # a log file or pipe: the libraries' own bars (loading weights, writing
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # shards) would land in it as fragments;
        # read when huggingface_hub is imported, which building the parser does
    # the `deepspeed` launcher appends --local_rank=N; the rank comes from the environment anyway
    argv = [a for i, a in enumerate(argv) if not a.startswith("--local_rank")
            and not (i > 0 and argv[i - 1] == "--local_rank")]
    # `data.fields={prompt: question}` typed unquoted arrives as two words; argparse would take `question}` for a
    # stray argument, so the words go back together first
    argv = rejoin_words(argv)
    parser = build_parser()
    # overrides may come before or after flags (`--force k=v` or `k=v --force`): argparse stops collecting a
    # positional list at the first flag, so gather the stragglers here
    args, extra = parser.parse_known_args(argv)
    if args.verb == "vllm-serve":  # its options after MODEL are vLLM's own
        return _load("rlhfkit.rollout.serve:main")(args)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra and not hasattr(args, "overrides"):  # chat, score, report, fetch, checkpoints, serve-reward: none
        parser.error(f"unrecognized arguments: {' '.join(extra)} (rlhfkit {args.verb} takes no key=value "
                     f"overrides; see rlhfkit {args.verb} --help)")
    if extra:
        args.overrides = list(getattr(args, "overrides", []) or []) + extra
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.verb == "report":
        from rlhfkit.report import main as report_main

        return report_main([args.run_dir] + (["--title", args.title] if args.title else []))
    if args.verb == "score":
        return _load("rlhfkit.score:main")(args)
    if args.verb == "fetch":
        return _load("rlhfkit.models.fetch:main")(args)
    if args.verb == "checkpoints":
        return _load("rlhfkit.engine.manifest:main")(args)
    if args.verb == "serve-reward":
        return _load("rlhfkit.remote.server:main")(args)
    if args.verb in ("demo", "chat"):
        return _load(f"rlhfkit.{'demo.cli' if args.verb == 'demo' else 'chat'}:main")(args)
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


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


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


if __name__ == "__main__":
    raise SystemExit(main())
