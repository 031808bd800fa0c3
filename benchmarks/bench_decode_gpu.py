"""Where a GPU rollout's time goes: rlhfkit's sampling loop against `model.generate`, dynamic and static KV cache.

    python benchmarks/bench_decode_gpu.py --gpu [--batch 16] [--response 128] [--iters 3] [--json OUT]

On the H200 generation was 80% of a PPO iteration of the ~1B Llama and 51x its memory bound (RESULTS.md,
"One GPU"): a launch-bound decode. This times, on the same left-padded prompts of that world, exactly
`response` sampled tokens per prompt (EOS forbidden before), median of `iters` after one warm-up call:

- `rlhfkit-autocast`: rlhfkit's loop (`rollout.generate.sample_tokens`) on float32 weights inside one bf16
  autocast context, as `rlhfkit ppo` samples on a GPU;
- `rlhfkit-bf16`: the same loop on bf16 weights;
- `generate-dynamic`: transformers' `generate` on bf16 weights, its default dynamic cache;
- `generate-static`: `generate(cache_implementation="static")` on bf16 weights, which transformers compiles
  (`torch.compile`, CUDA graphs) on a CUDA device; its first call, the compilation, is reported apart.

Without --gpu it runs the 5M model on the CPU (a check that the script works; `generate-static` is skipped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the ~1B Llama on the CUDA GPU")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the medians here")
    args = parser.parse_args()
    harness.reexec_in_project_venv()
    import torch

    from rlhfkit.config.ppo_schema import GenConfig
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.rollout.generate import eos_token_ids, sample_tokens
    from rlhfkit.models.plan import REFERENCE

    world = harness.build_world()
    size, device = "5M", torch.device("cpu")
    if args.gpu:
        harness.enter_gpu_mode()
        size, device = "1B", torch.device("cuda")
        harness.add_gpu_model(world)
    folder = str(world / size / "policy")
    tok = load_tokenizer(folder, padding_side="left")
    fp32 = load_causal_lm(folder, tokenizer=tok).to(device).eval()
    bf16 = load_causal_lm(folder, tokenizer=tok).to(device, torch.bfloat16).eval()
    prompts = json.loads(harness.tokenized_prompts(world, 64).read_text())[:args.batch]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    cfg = GenConfig(max_new_tokens=args.response, min_new_tokens=args.response)
    eos = eos_token_ids(tok, fp32)

    def loop(model, autocast: bool):
        def run():
            with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
                out, _ = sample_tokens(model, ids, mask, cfg, eos, tok.pad_token_id, REFERENCE)
            assert out.size(1) == args.response
        return run

    def generate(cache: str | None):
        def run():
            with torch.no_grad():
                out = bf16.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=args.response,
                                    min_new_tokens=args.response, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                                    top_k=0, top_p=1.0, temperature=1.0, cache_implementation=cache)
            assert out.size(1) == width + args.response
        return run

    variants = [("rlhfkit-autocast", loop(fp32, device.type == "cuda")), ("rlhfkit-bf16", loop(bf16, False)),
                ("generate-dynamic", generate(None))]
    if args.gpu:
        variants.append(("generate-static", generate("static")))

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    tokens = args.batch * args.response
    print(f"{size} on {device}: batch {args.batch}, {args.response} new tokens each, prompts up to {width} tokens",
          flush=True)
    results = {}
    for name, fn in variants:
        first = timed(fn)
        times = [timed(fn) for _ in range(args.iters)]
        results[name] = {"first_s": first, "median_s": statistics.median(times), "times": times,
                         "tokens_per_s": tokens / statistics.median(times)}
        print(f"{name:18s} first call {first:7.2f} s, median {statistics.median(times):6.3f} s "
              f"({tokens / statistics.median(times):8.0f} tokens/s) of {[round(t, 3) for t in times]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"size": size, "device": str(device), "batch": args.batch,
                                         "response": args.response, "results": results}, indent=1))


if __name__ == "__main__":
    main()
