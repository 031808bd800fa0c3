"""A `vllm serve` on other devices as the rollout engine (`rollout.engine=vllm rollout.server=URL`).

The trainer keeps its GPUs for training; a vLLM server elsewhere samples. Start it on the actor's starting folder
with `rlhfkit vllm-serve PATH/TO/ACTOR [--port P ...]` (rollout/serve.py: `vllm serve` with the development
endpoints on, for weight reloads and prefix-cache resets, and the log-probs rlhfkit compares; docs/vllm.md). Before training,
`check_server` asks it which model it serves and how it tokenizes, and stops with the difference when it is not the
actor's. Each iteration's requests go as token ids (`/v1/completions`, one request per response, each with its own
seed drawn from the torch RNG), so the server samples exactly the prompts the trainer rendered.

Weights: after every update the main rank writes the actor's weights (rollout/weights.py: LoRA merged, ZeRO-3
gathered a module at a time) as safetensors into `rollout.server_weights_dir`, a folder the server reads too, and
asks it to reload from there (`/collective_rpc` reload_weights) and to drop its prefix cache. The sync check then
proves on every iteration that the server samples from the trained weights.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlhfkit.config.vllm_checks import logprobs_mode
from rlhfkit.errors import RunError
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.rollout.generate import eos_token_ids
from rlhfkit.rollout.vllm_layout import rollout_batch
from rlhfkit.rollout.weights import hf_weights

SERVE_HINT = ("rlhfkit vllm-serve {actor} (or vLLM's own: VLLM_SERVER_DEV_MODE=1 vllm serve {actor} --logprobs-mode "
              "{mode} --generation-config vllm, on a CPU with --dtype float32 --enforce-eager "
              "--no-enable-chunked-prefill)")
PROBE = "The quick brown fox jumps over the lazy dog. 12 + 7 = 19."


def _request(url: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    """GET (no payload) or POST JSON to `url`; the decoded JSON answer ({} for an empty one)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if payload is None else "POST")
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        body = answer.read()
    return json.loads(body) if body.strip() else {}


def check_server(cfg, tokenizer) -> str:
    """The id of the model `rollout.server` serves, after checking that it is the actor's: it answers, it serves a
    folder of the actor's name, it tokenizes as the actor's tokenizer, it takes a prompt and its response. Run before
    any model loads; a RunError naming the difference and the serve command."""
    url, actor = cfg.rollout.server.rstrip("/"), str(cfg.actor)
    hint = SERVE_HINT.format(actor=actor, mode=logprobs_mode(cfg.gen))
    try:
        card = _request(f"{url}/v1/models", timeout=10)["data"][0]
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as exc:
        raise RunError(f"rollout.server: no vLLM server answers at {url} ({exc}); start one with: {hint}") from None
    served, root = card["id"], str(card.get("root") or card["id"])
    if Path(root.rstrip("/")).name != Path(actor.rstrip("/")).name:
        raise RunError(f"rollout.server: {url} serves {root!r}, not the actor {actor!r}; start it on the actor's "
                       f"folder: {hint}")
    ours = list(tokenizer(PROBE, add_special_tokens=False)["input_ids"])
    theirs = _request(f"{url}/tokenize", {"model": served, "prompt": PROBE, "add_special_tokens": False},
                      timeout=30).get("tokens")
    if ours != list(theirs or []):
        raise RunError(f"rollout.server: {url} tokenizes {PROBE!r} as {theirs}, the actor's tokenizer as {ours}: not "
                       f"the actor's tokenizer; start the server on the actor's folder: {hint}")
    needed = cfg.data.max_prompt_length + cfg.gen.max_new_tokens
    if card.get("max_model_len") and card["max_model_len"] < needed:
        raise RunError(f"rollout.server: {url} takes {card['max_model_len']} tokens, the run needs {needed} "
                       f"(data.max_prompt_length + gen.max_new_tokens); restart it with --max-model-len {needed}")
    return served


class VLLMServer:
    name, separate = "vllm", True

    def __init__(self, cfg, model, engine, tokenizer, output_dir: Path, served: str | None = None):
        """`served`: the model id `check_server` found (it runs before the models load); checked here otherwise."""
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.url = cfg.rollout.server.rstrip("/")
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.mode = logprobs_mode(cfg.gen)
        self.weights_dir = Path(cfg.rollout.server_weights_dir or Path(output_dir) / "engine-weights")
        self.served = served or check_server(cfg, tokenizer)

    def describe(self) -> str:
        return (f"rollout: the vLLM server at {self.url} ({self.served}, {self.mode}); the actor's weights reach it "
                f"after every update through {self.weights_dir} (time/sync) and every iteration compares its "
                f"log-probs with the trainer's (rollout/logprob_gap_*, stop past rollout.sync_max_gap="
                f"{self.cfg.rollout.sync_max_gap}); TIS cap {self.cfg.rollout.tis_cap}")

    # -- sampling ------------------------------------------------------------------------------------------
    def generate(self, rows: list[dict], gen, greedy: bool = False, group_size: int = 1) -> RolloutBatch:
        first = int(torch.randint(0, 2 ** 31 - 1 - len(rows), (1,)).item())  # the torch RNG: checkpointed
        common = {"model": self.served, "max_tokens": gen.max_new_tokens, "min_tokens": gen.min_new_tokens,
                  "temperature": 0.0 if greedy else gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k,
                  "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "stop_token_ids": list(self.eos_ids), "logprobs": 0, "return_token_ids": True,
                  "skip_special_tokens": False, "n": 1}

        def one(i: int):
            answer = _request(f"{self.url}/v1/completions",
                              {**common, "prompt": list(rows[i]["prompt_ids"]), "seed": first + i})
            choice = answer["choices"][0]
            return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])

        with ThreadPoolExecutor(max_workers=min(32, len(rows))) as pool:
            sampled = list(pool.map(one, range(len(rows))))
        return rollout_batch(rows, [ids for ids, _ in sampled], [lps for _, lps in sampled], self.eos_ids,
                             self.tokenizer, self.engine.device)

    # -- weights -------------------------------------------------------------------------------------------
    def sync(self, model) -> float:
        """Every rank walks the weights (ZeRO-3 gathers are collectives); the main rank writes and the server
        reloads; the others wait at a barrier so that none samples before the reload."""
        started = time.perf_counter()
        main = self.engine.is_main
        state = {}
        for name, tensor in hf_weights(model, self.engine):
            if main:
                state[name] = tensor.detach().to("cpu", copy=True).contiguous()
        failure = None
        if main:
            try:
                self._write_and_reload(state)
            except RunError as exc:
                failure = exc
        del state
        if self.engine.reduce_sum(1.0 if failure else 0.0):  # every rank stops, none samples before the reload
            raise failure or RunError(f"rollout.server: the main rank could not sync {self.url}: see its error")
        return time.perf_counter() - started

    def _write_and_reload(self, state: dict) -> None:
        from safetensors.torch import save_file

        self.weights_dir.mkdir(parents=True, exist_ok=True)
        partial = self.weights_dir / "model.safetensors.partial"
        save_file(state, str(partial), metadata={"format": "pt"})
        partial.replace(self.weights_dir / "model.safetensors")  # the server never reads a half-written file
        try:
            _request(f"{self.url}/collective_rpc", {"method": "reload_weights",
                                                   "kwargs": {"weights_path": str(self.weights_dir.resolve())}})
            _request(f"{self.url}/reset_prefix_cache", {})
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise RunError(f"rollout.server: {self.url} has no weight-reload endpoint (HTTP 404 on "
                               f"/collective_rpc); start it with VLLM_SERVER_DEV_MODE=1: "
                               f"{SERVE_HINT.format(actor=self.cfg.actor, mode=self.mode)}") from None
            raise RunError(f"rollout.server: {self.url} could not reload the weights from {self.weights_dir} "
                           f"(HTTP {exc.code}: {exc.read()[:500]!r}); the server must be able to read that folder "
                           f"(rollout.server_weights_dir)") from None
        except (urllib.error.URLError, OSError) as exc:
            raise RunError(f"rollout.server: {self.url} stopped answering during a weight sync ({exc})") from None

    def close(self) -> None:
        pass  # the server is the user's: it keeps running
