"""Per-token log-probs with the LM head in chunks (`algos.linear_token_logprobs`) and their use in the RL loops
(`rollout.experience.response_logprobs`, the actor loss), against the model's own logits."""

import math

import pytest
import torch

from rlhfkit.algos import entropy_from_logits, linear_token_logprobs, token_logprobs


def test_hand_computed_value_entropy_and_gradients():
    # H = 1, V = 2, T = 1: logits (ln 3, 0), softmax (3/4, 1/4); label 0 -> logp ln(3/4), entropy -(3/4 ln 3/4 +
    # 1/4 ln 1/4); d logp / dz = onehot - softmax = (1/4, -1/4): dh = 1/4 * 1 + (-1/4) * 0, dW = (h/4, -h/4)
    hidden = torch.tensor([[math.log(3.0)]], requires_grad=True)
    weight = torch.tensor([[1.0], [0.0]], requires_grad=True)
    logp, ent = linear_token_logprobs(hidden, weight, torch.tensor([0]), entropy=True)
    assert logp.item() == pytest.approx(math.log(0.75), rel=1e-6)
    assert ent.item() == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), rel=1e-6)
    assert not ent.requires_grad
    (3 * logp.sum()).backward()  # the upstream gradient scales both
    assert hidden.grad.item() == pytest.approx(3 * 0.25, rel=1e-6)
    torch.testing.assert_close(weight.grad, 3 * torch.tensor([[math.log(3) / 4], [-math.log(3) / 4]]))


def _reference(hidden, weight, labels, temperature):
    logits = hidden @ weight.T / temperature
    return token_logprobs(logits[None], labels[None])[0], entropy_from_logits(logits.detach())


@pytest.mark.parametrize("chunk", [1, 3, 0])  # several chunks, a ragged last one, and the automatic size
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_token_logprobs_of_the_logits(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    labels = torch.randint(50, (10,), generator=g)
    upstream = torch.randn(10, generator=g)

    logp, ent = linear_token_logprobs(hidden, weight, labels, temperature, entropy=True, chunk=chunk)
    (upstream * logp).sum().backward()
    got = logp.detach(), ent, hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    expected, expected_ent = _reference(hidden, weight, labels, temperature)
    (upstream * expected).sum().backward()
    torch.testing.assert_close(got[0], expected.detach())
    torch.testing.assert_close(got[1], expected_ent)
    torch.testing.assert_close(got[2], hidden.grad)
    torch.testing.assert_close(got[3], weight.grad)


def test_frozen_head_no_grad_and_bf16():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, generator=g, requires_grad=True)
    weight = torch.randn(9, 4, generator=g)  # frozen head (LoRA): only the hidden states get a gradient
    labels = torch.randint(9, (6,), generator=g)
    linear_token_logprobs(hidden, weight, labels, chunk=4)[0].sum().backward()
    expected = torch.autograd.grad(_reference(hidden, weight, labels, 1.0)[0].sum(), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected)
    assert weight.grad is None
    with torch.no_grad():
        logp, ent = linear_token_logprobs(hidden, weight, labels)
    assert not logp.requires_grad and torch.equal(ent, torch.zeros(6))  # no entropy asked for
    torch.testing.assert_close(logp, _reference(hidden, weight, labels, 1.0)[0].detach())
    # a bf16 head: its logits rounded to bf16 as the model's own head gives them, then float32 log-probs
    h16, w16 = hidden.detach().bfloat16(), weight.bfloat16()
    logp16, _ = linear_token_logprobs(h16, w16, labels)
    assert logp16.dtype == torch.float32
    torch.testing.assert_close(logp16, token_logprobs((h16 @ w16.T)[None], labels[None])[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast the head's GEMM runs in bf16 too
        logp_auto, _ = linear_token_logprobs(hidden.detach(), weight, labels)
    torch.testing.assert_close(logp_auto, logp16)
    with pytest.raises(ValueError, match="labels"):
        linear_token_logprobs(hidden, weight, labels[:3])


def test_no_positions_give_empty_log_probs_that_still_take_a_backward():
    """A micro-batch whose responses are all masked out (DAPO's overlong filter) has no positions to score."""
    hidden = torch.randn(0, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    logp, ent = linear_token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), entropy=True)
    assert logp.shape == ent.shape == (0,) and logp.requires_grad
    logp.sum().backward()
    assert hidden.grad.shape == (0, 4) and torch.equal(weight.grad, torch.zeros(9, 4))


# ---------------------------------------------------------------- on a real (tiny) Llama

from rlhfkit.config.ppo_schema import GenConfig  # noqa: E402
from rlhfkit.engine.local import LocalEngine  # noqa: E402
from rlhfkit.models import load_causal_lm, load_tokenizer  # noqa: E402
from rlhfkit.models.forward import head_logprobs_weight  # noqa: E402
from rlhfkit.rollout import RolloutBatch, generate_rollout  # noqa: E402
from rlhfkit.rollout.experience import response_logprobs, response_logprobs_and_entropy  # noqa: E402
from rlhfkit.speed.checks import head_gives_logits  # noqa: E402
from rlhfkit.models.plan import REFERENCE, ModelPlan  # noqa: E402

CHUNKED = ModelPlan(head_chunks=True)  # the LM head in chunks on the hidden states, nothing else

from conftest import sharpened  # noqa: E402
from test_rollout import prompt_rows  # noqa: E402


def _batch(tok, model, groups: bool) -> RolloutBatch:
    """Three prompts of different lengths (left padding), two samples each, one response cut short (EOS)."""
    rows = prompt_rows(tok, ["say apple", "say a very long river stone cloud green", "say stone"])
    torch.manual_seed(0)
    batch = generate_rollout(model, LocalEngine(), tok, [r for r in rows for _ in range(2)],
                             GenConfig(max_new_tokens=7), REFERENCE)
    batch.response_mask[1, 3:] = 0
    batch.response_ids[1, 3:] = tok.pad_token_id
    if groups:
        batch = RolloutBatch(**{**batch.__dict__, "group": torch.arange(3).repeat_interleave(2),
                                "groups_share_prompts": True})
    return batch


@pytest.mark.parametrize("groups,fast_linear", [(False, False), (True, False), (False, True), (True, True)])
def test_response_logprobs_with_the_head_in_chunks_equal_the_logits_ones(tiny_model_dir, groups, fast_linear):
    """The same log-probs, entropies and every parameter's gradient as from the model's own logits, on valid
    response tokens (0 elsewhere), one forward per prompt + response or each group's prompt once, also with the
    linear layers on oneDNN (where it is faster) and with the head's packed weight (no-grad)."""
    from rlhfkit.accel.cpu_linear import packed_weights, use_fast_cpu_linear

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok))
    if fast_linear:
        use_fast_cpu_linear(model)
    shared = ModelPlan(shared_prompt=groups)  # each group's prompt once (a KV cache) where the rows come in groups
    batch = _batch(tok, model.eval(), groups)
    model.train()
    valid = batch.response_mask.bool()
    upstream = torch.randn(valid.shape, generator=torch.Generator().manual_seed(2))

    def run(chunked: bool):
        model.zero_grad()
        logp, ent = response_logprobs_and_entropy(model, batch, ModelPlan(head_chunks=chunked,
                                                                          shared_prompt=groups), temperature=0.8)
        torch.where(valid, logp * upstream, 0).sum().backward()
        return logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, chunked = run(False), run(True)
    assert head_logprobs_weight(model, CHUNKED) is model.lm_head.weight
    torch.testing.assert_close(chunked[0][valid], plain[0][valid], atol=1e-5, rtol=1e-5)
    assert torch.equal(chunked[0][~valid], torch.zeros(int((~valid).sum())))
    torch.testing.assert_close(chunked[1][valid], plain[1][valid], atol=1e-5, rtol=1e-5)
    for name, expected in plain[2].items():  # sharpened weights: large gradients, float32 rounding relative to them
        scale = float(expected.abs().max())
        torch.testing.assert_close(chunked[2][name], expected, atol=1e-5 * scale, rtol=1e-4, msg=name)
    with torch.no_grad(), packed_weights(model):  # the reference's and old log-probs' way: no grad, packed weights
        frozen = response_logprobs(model, batch, ModelPlan(head_chunks=True, shared_prompt=groups), temperature=0.8)
    torch.testing.assert_close(frozen[valid], plain[0][valid], atol=1e-5, rtol=1e-5)
    assert head_logprobs_weight(model, shared) is None


def test_a_model_that_changes_its_logits_after_the_head_keeps_its_logits(tiny_model_dir):
    """head_gives_logits: a plain Llama passes; a soft cap in the config (Gemma 2) or any change of the logits
    after the head that the config does not name is refused."""
    tok = load_tokenizer(str(tiny_model_dir))
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok))
    assert head_gives_logits(model)
    model.config.final_logit_softcapping = 30.0
    assert not head_gives_logits(model)
    model.config.final_logit_softcapping = None
    model.config.logit_scale = 1.0  # a scale of 1 changes nothing
    assert head_gives_logits(model)
    plain_forward = model.forward

    def scaled(**kw):
        out = plain_forward(**kw)
        out.logits = out.logits * 1.5
        return out

    model.forward = scaled
    assert not head_gives_logits(model)


def test_the_chunked_head_multiplies_at_the_forwards_precision(tiny_model_dir):
    """engine.precision=bf16 on the local engine (autocast hooks around each forward): the LM head run in chunks
    after the forward (PPO's and DPO's log-probs, SFT's fused loss) multiplies in bf16, as the model's own head does
    under that autocast, not in float32 (a ~3x slower head on a GPU, whose float32 GEMMs have no tensor cores)."""
    from rlhfkit.config.schema import EngineConfig
    from rlhfkit.data.tokenize import collate_sft
    from rlhfkit.models.forward import final_hidden, position_ids
    from rlhfkit.models.stage_forward import lm_forward
    from rlhfkit.rollout.experience import response_hidden

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model = sharpened(load_causal_lm(str(tiny_model_dir), tokenizer=tok))
    batch = _batch(tok, model.eval(), False)
    engine = LocalEngine(EngineConfig(precision="bf16"))
    model = engine.prepare_frozen(model)
    plan = ModelPlan(head_chunks=True, autocast=engine.autocast.spec())  # as the speed plan records the autocast
    weight = model.lm_head.weight

    def head_logprobs(hidden, ids, dtype):  # the head by hand at `dtype`, log-softmax in float32
        z = (hidden.to(dtype) @ weight.to(dtype).T).float()
        return z.log_softmax(-1).gather(1, ids[:, None])[:, 0]

    valid = batch.response_mask.bool()
    ids = batch.response_ids[valid]
    with torch.no_grad():
        logp = response_logprobs(model, batch, plan)[valid]
        hidden = response_hidden(model, batch, plan)[valid]  # the same forward, under the hooks' autocast
        bf16, fp32 = head_logprobs(hidden, ids, torch.bfloat16), head_logprobs(hidden, ids, torch.float32)
    torch.testing.assert_close(logp, bf16, atol=1e-5, rtol=1e-5)
    assert (logp - fp32).abs().max() > 1e-3  # bf16's rounding is visible: the float32 head is not what ran

    rows = [{"input_ids": r, "labels": r} for r in ([5, 9, 14, 3, 22, 7], [8, 4, 30, 2])]
    micro = collate_sft(rows, tok.pad_token_id)
    with torch.no_grad():
        loss, count = lm_forward(model, micro, torch.device("cpu"), plan)
        mask = micro["attention_mask"]
        hidden = final_hidden(model, micro["input_ids"], mask, position_ids(mask))[:, :-1]
        labels = micro["labels"][:, 1:]
        keep = labels != -100
        by_hand = {dtype: -head_logprobs(hidden[keep], labels[keep], dtype).sum()
                   for dtype in (torch.bfloat16, torch.float32)}
    assert count == int(keep.sum())
    torch.testing.assert_close(loss, by_hand[torch.bfloat16], atol=1e-4, rtol=1e-5)
    assert abs(float(loss - by_hand[torch.float32])) > 1e-3


@pytest.mark.parametrize("fn", ["loss_sum", "token_logprobs"])
def test_under_bf16_autocast_every_head_matmul_runs_in_bf16(fn):
    """Under bf16 autocast the chunked head's three GEMMs (logits, d hidden, d weight) all multiply bf16 operands,
    as autocast runs the model's own head: the weight gradient (V, H) too, added into its float32 buffer (it was a
    float32 GEMM, without tensor cores on a GPU); float32 outside autocast, with the same values to bf16 rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlhfkit.algos.logprobs import linear_lm_loss_sum, linear_token_logprobs

    V, H, K = 96, 16, 40

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_,
                                       torch.ops.aten.linear, torch.ops.aten.bmm):
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if any(V in a.shape for a in tensors):  # the head's GEMMs (the vocabulary on one side)
                    self.seen.append({a.dtype for a in tensors[-2:]})
            return func(*args, **(kwargs or {}))

    def run(autocast: bool):
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(K, H, generator=g, requires_grad=True)
        weight = torch.randn(V, H, generator=g, requires_grad=True)
        labels = torch.randint(V, (K,), generator=g)
        spy = Matmuls()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), spy:
            out = linear_lm_loss_sum(hidden, weight, labels) if fn == "loss_sum" else \
                linear_token_logprobs(hidden, weight, labels)[0].sum()
        with spy:
            out.backward()
        return spy.seen, hidden.grad, weight.grad

    seen, dh, dw = run(True)
    assert len(seen) == 3 and all(s == {torch.bfloat16} for s in seen), seen
    seen32, dh32, dw32 = run(False)
    assert all(s == {torch.float32} for s in seen32) and dw.dtype == torch.float32
    torch.testing.assert_close(dw, dw32, rtol=0.05, atol=0.05 * dw32.abs().max().item())
    torch.testing.assert_close(dh, dh32, rtol=0.05, atol=0.05 * dh32.abs().max().item())
