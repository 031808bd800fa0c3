"""rlhfkit's rollout (rollout.generate.generate_rollout) against a plain `model.generate` on the same batch.

    python benchmarks/bench_rollout.py            # both sizes, batch {16, 64} x response {32, 64}
    python benchmarks/bench_rollout.py --quick    # 5M, batch 16, response 32

Both sample (temperature 1, no top-k/top-p) exactly R new tokens per prompt (EOS forbidden before R), from the
same left-padded prompts and the same model folder, in the same process, alternating call by call; tokens/s =
batch x R / seconds, median. rlhfkit's rollout runs as in `rlhfkit ppo` (the actor's speed plan, its CPU kernels
included: speed/registry.py); "loop alone" runs it on the plain model that generate() gets without any speed path
(`speed.plan.REFERENCE`), to isolate the sampling loop. The rollout also returns the sampled tokens' log-probs, masks and decoded texts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def measure(size: str, batch: int, response: int, iters: int, world: Path) -> dict:
    import torch

    from rlhfkit.config.ppo_schema import GenConfig
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.rollout.generate import eos_token_ids, generate_rollout
    from rlhfkit.models.plan import REFERENCE
    from rlhfkit.speed.registry import Target, plan_model

    tok = load_tokenizer(str(world / size / "policy"), padding_side="left")
    model = load_causal_lm(str(world / size / "policy"), tokenizer=tok).eval()
    actor = load_causal_lm(str(world / size / "policy"), tokenizer=tok).eval()
    plan = plan_model(Target(actor, "actor", "ppo", None, LocalEngine()))  # as load_ppo_models decides it
    prompt_ids = json.loads(harness.tokenized_prompts(world, 64).read_text())[:batch]
    rows = [{"prompt_ids": ids, "prompt_text": "", "messages": None} for ids in prompt_ids]
    cfg = GenConfig(max_new_tokens=response, min_new_tokens=response)
    engine, eos = LocalEngine(), eos_token_ids(tok, model)
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])

    def plain():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=response,
                           min_new_tokens=response, eos_token_id=eos, pad_token_id=tok.pad_token_id, top_k=0,
                           top_p=1.0, temperature=1.0)

    def rollout():
        generate_rollout(actor, engine, tok, rows, cfg, plan)

    def loop_alone():
        generate_rollout(model, engine, tok, rows, cfg, REFERENCE)

    calls = [("rlhfkit", rollout), ("generate", plain), ("loop", loop_alone)]
    times = {name: [] for name, _ in calls}
    for i in range(iters + 1):  # the first round warms up
        for name, fn in calls[i % 3:] + calls[:i % 3]:  # each goes first in turn
            start = time.perf_counter()
            fn()
            if i > 0:
                times[name].append(time.perf_counter() - start)
    tokens = batch * response
    mine, theirs, loop = (harness.median(times[k]) for k in ("rlhfkit", "generate", "loop"))
    return {"size": size, "batch": batch, "response": response, "rlhfkit_tokens_s": tokens / mine,
            "generate_tokens_s": tokens / theirs, "speedup": theirs / mine, "loop_speedup": theirs / loop}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", default="5M,20M")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    harness.reexec_in_project_venv()
    import torch

    torch.set_num_threads(args.threads)
    world = harness.build_world()
    configs = [("5M", 16, 32)] if args.quick else [
        (s, b, r) for s in args.sizes.split(",") for b in (16, 64) for r in (32, 64)]
    print("| model | batch | response | rlhfkit tokens/s | model.generate tokens/s | rlhfkit / generate | "
          "loop alone / generate |")
    print("|---|---|---|---|---|---|---|")
    for size, batch, response in configs:
        r = measure(size, batch, response, 3 if args.quick else args.iters, world)
        print(f"| {size} | {batch} | {response} | {r['rlhfkit_tokens_s']:.0f} | {r['generate_tokens_s']:.0f} | "
              f"**{r['speedup']:.2f}x** | {r['loop_speedup']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
