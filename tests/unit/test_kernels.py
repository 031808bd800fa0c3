"""Fused CPU kernels (`accel/kernels.py`): PyTorch's values and gradients, one output for the norm's forward and
its recomputation, the same bits on several threads, the lean modules' training with them, the fallback."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from rlhfkit.accel import kernels
from rlhfkit.accel.lean import use_lean_activations


@pytest.fixture
def switched(monkeypatch, tmp_path):
    """The kernels built into a cache of this test's own, the module's state restored afterwards."""
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_STATE", {"lib": None, "failed": False, "pool": None})
    assert kernels.usable(torch.zeros(kernels.MIN_WIDTH)), "the C kernels did not build on this machine"
    return tmp_path / "cache"


def close(got, expected, tol=1e-5):
    assert float((got - expected).abs().max()) <= tol * float(expected.abs().max())


def rms_reference(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_kernels_give_pytorchs_values_and_gradients(switched):
    torch.manual_seed(0)
    x, d = torch.randn(2, 160, 256), torch.randn(2, 160, 256)
    w = torch.rand(256) + 0.5
    y, inv = kernels.rms_norm_forward(x, w, 1e-5)
    close(y, rms_reference(x, w, 1e-5))
    close(inv, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(kernels.norm_output(x, w, inv), y)  # lean's recomputation: the forward's bits
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    (rms_reference(xg, wg, 1e-5) * d).sum().backward()
    dx, dw = kernels.rms_norm_backward(d, x, w, inv)
    close(dx, xg.grad)
    close(dw, wg.grad)

    gate, up, d = torch.randn(2, 160, 256) * 4, torch.randn(2, 160, 256), torch.randn(2, 160, 256)
    close(kernels.silu_mul(gate, up), F.silu(gate) * up)
    gg, ug = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (F.silu(gg) * ug * d).sum().backward()
    d_gate, d_up = kernels.silu_mul_backward(d, gate, up)
    close(d_gate, gg.grad)
    close(d_up, ug.grad)


def test_hand_computed_values(switched):
    # rows of (3, 4, 0, 0): rms = sqrt(25 / 4) = 2.5; y = w * x / 2.5
    x = torch.tensor([3.0, 4.0, 0.0, 0.0]).repeat(3, 1)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    y, inv = kernels.rms_norm_forward(x, w, 0.0)
    assert torch.allclose(inv, torch.full((x.shape[0], 1), 0.4))
    assert torch.allclose(y[0], torch.tensor([1.2, 3.2, 0.0, 0.0]))
    # SiLU(0) * u = 0; SiLU'(0) = 1/2, so d/dgate = d * u / 2 and d/dup = 0
    zeros, ones = torch.zeros(5), torch.ones(5)
    assert torch.equal(kernels.silu_mul(zeros, ones), zeros)
    d_gate, d_up = kernels.silu_mul_backward(ones * 3, zeros, ones * 2)
    assert torch.equal(d_gate, ones * 3.0) and torch.equal(d_up, zeros)


def test_several_threads_give_the_same_bits(switched, monkeypatch):
    monkeypatch.setattr(kernels, "MIN_SPLIT", 1 << 16)
    torch.manual_seed(1)
    x, d, w = torch.randn(1024, 256), torch.randn(1024, 256), torch.rand(256)  # 4 x MIN_SPLIT elements
    gate, up = torch.randn(1024, 512), torch.randn(1024, 512)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y, inv = kernels.rms_norm_forward(x, w, 1e-6)
            results.append((y, inv, *kernels.rms_norm_backward(d, x, w, inv), kernels.silu_mul(gate, up),
                            *kernels.silu_mul_backward(d.repeat(1, 2), gate, up)))
    finally:
        torch.set_num_threads(before)
    assert kernels._STATE["pool"] is not None  # the second run split its rows over two threads
    one, two = results
    for index, (a, b) in enumerate(zip(one, two)):
        if index == 3:  # the weight gradient: partial sums per thread, added at the end
            close(b, a, 1e-6)
        else:
            assert torch.equal(a, b)


def llama(seed=0, fused=True):
    """A 256-wide Llama (wide enough for the kernels) with its lean modules, their element-wise work in C (`fused`,
    the speed plan's `fused_kernels`) or in PyTorch's operators."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    use_lean_activations(model, fused=fused)
    return model


@pytest.mark.parametrize("checkpointed", [False, True])
def test_lean_training_with_the_kernels_matches_pytorchs_operators(switched, monkeypatch, checkpointed):
    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(2))
    calls = []
    for name in ("rms_norm_forward", "rms_norm_backward", "silu_mul", "silu_mul_backward", "norm_output"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    results = []
    for on in (False, True):
        model = llama(fused=on)
        # use_lean_activations checked each module on a random input, with and without autograd: with the
        # kernels on, through them
        assert (calls.count("rms_norm_forward"), calls.count("silu_mul_backward")) == ((10, 2) if on else (0, 0))
        calls.clear()
        if checkpointed:  # backward recomputes each layer's forward, kernels included
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        if not on:
            assert calls == []
    # every norm (2 per layer and the final one) and MLP ran fused, forward and backward; the norm outputs that
    # q/k/v and gate/up keep were recomputed by the kernel
    # (checkpointed: each layer's two norms and MLP run forward twice; the norm outputs are kept, not recomputed)
    assert calls.count("rms_norm_forward") == (9 if checkpointed else 5) and calls.count("rms_norm_backward") == 5
    assert calls.count("silu_mul_backward") == 2 and calls.count("silu_mul") >= (4 if checkpointed else 2)
    assert checkpointed or calls.count("norm_output") >= 4
    (plain_loss, plain_grads), (fused_loss, fused_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=0)
    for name, grad in plain_grads.items():
        close(fused_grads[name], grad, 2e-5)


def test_narrow_models_and_other_dtypes_stay_on_pytorch(switched):
    assert kernels.usable(torch.zeros(1, kernels.MIN_WIDTH))  # one row of a wide model: yes, whatever the batch
    assert not kernels.usable(torch.zeros(10_000, kernels.MIN_WIDTH - 1))  # a narrow model: never
    assert not kernels.usable(torch.zeros(4, 64), width=kernels.MIN_WIDTH - 64)
    assert not kernels.usable(torch.zeros(kernels.MIN_WIDTH, dtype=torch.bfloat16))
    assert not kernels.usable(torch.zeros(kernels.MIN_WIDTH), torch.zeros(4, dtype=torch.float64))


def test_a_failing_compiler_falls_back_once_with_a_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_STATE", {"lib": None, "failed": False, "pool": None})
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, "-Wl,--no-such-linker-option"])
    x = torch.randn(kernels.MIN_WIDTH)
    assert not kernels.usable(x) and not kernels.usable(x)
    err = capsys.readouterr().err
    assert err.count("fused CPU kernels unavailable") == 1 and "engine.fused_kernels=false" in err
    model = llama()  # the lean modules train on PyTorch's operators
    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not list(tmp_path.glob("kernels/*.so"))  # nothing half-built left as if it were the library


def test_the_build_is_cached_per_source(switched):
    first = kernels.build()
    assert first.parent == switched / "kernels" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == stamp


def test_the_speed_plan_switches_them(switched):
    """`engine.fused_kernels` is the speed plan's switch: the lean modules and the rotation a wide model gets run in C
    with it on, PyTorch's operators with it off; a narrow model (the tests' tiny ones) never takes them."""
    import dataclasses

    from rlhfkit.config.schema import SFTConfig
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.speed.registry import Target, plan_model

    def plan(model, fused: bool):
        cfg = dataclasses.replace(SFTConfig(), engine=dataclasses.replace(SFTConfig().engine, fused_kernels=fused))
        return plan_model(Target(model, "policy", "sft", cfg, LocalEngine()))

    for fused in (True, False):
        model = llama(fused=False)
        model.model.layers[0].mlp.__class__ = type(model.model.layers[0].mlp).__mro__[1]  # one MLP left to switch
        assert plan(model, fused).fused_kernels is fused
        assert model.model.layers[0].mlp.fused is fused  # switched by the plan's installation
    narrow = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=4))
    decided = plan(narrow, True)
    assert not decided.fused_kernels and dict(decided.off)["fused_kernels"] == f"hidden size 64 < {kernels.MIN_WIDTH}"


def test_rotary_kernel_gives_transformers_rotation(switched):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(3)
    # q and k as the attention makes them: (B, T, H, D) projections seen as (B, H, T, D); cos/sin per row
    q = torch.randn(2, 300, 4, 64).transpose(1, 2)
    k = torch.randn(2, 300, 2, 64).transpose(1, 2)
    for batch in (2, 1):  # per-row positions (packed rows) or one set broadcast over the batch
        angles = torch.rand(batch, 300, 64) * 6
        cos, sin = angles.cos(), angles.sin()
        expected = apply_rotary_pos_emb(q, k, cos, sin)
        got = (kernels.rotary(q, cos, sin), kernels.rotary(k, cos, sin))
        for g, e in zip(got, expected):
            assert torch.equal(g, e)  # each product rounded, then the sum: transformers' own rounding
            assert g.stride() == q.stride() if g.shape == q.shape else g.stride() == k.stride()
        # backward: the transpose of the rotation, against autograd through transformers' function
        qg, kg = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        out = apply_rotary_pos_emb(qg, kg, cos, sin)
        (out[0] * dq).sum().add((out[1] * dk).sum()).backward()
        close(kernels.rotary(dq, cos, sin, transpose=True), qg.grad)
        close(kernels.rotary(dk, cos, sin, transpose=True), kg.grad)


def test_rotary_hand_computed(switched):
    # D = 2: y = (x1 c - x2 s, x2 c + x1 s), a rotation by the angle; its transpose rotates back
    rows = 3
    x = torch.tensor([1.0, 0.0]).repeat(1, 1, rows, 1)
    cos, sin = torch.zeros(1, rows, 2), torch.ones(1, rows, 2)  # a quarter turn
    y = kernels.rotary(x, cos, sin)
    assert torch.equal(y[0, 0, 0], torch.tensor([0.0, 1.0]))
    assert torch.equal(kernels.rotary(y, cos, sin, transpose=True), x)


def test_fused_rotary_in_a_model_and_only_there(switched, monkeypatch):
    from rlhfkit.accel.rotary import use_fused_rotary

    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(4))  # q: 4 heads x 64
    calls = []
    original = kernels.rotary
    monkeypatch.setattr(kernels, "rotary", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    plain = llama()
    import transformers.models.llama.modeling_llama as modeling

    transformers_rotation = modeling.apply_rotary_pos_emb
    plain_loss = plain(input_ids=ids, labels=ids).loss
    plain_loss.backward()
    fused = llama()
    assert use_fused_rotary(fused) == 2
    assert len(calls) == 4  # its check against transformers' function: q and k, forward and backward
    calls.clear()
    loss = fused(input_ids=ids, labels=ids).loss
    loss.backward()
    assert len(calls) == 2 * 2 * 2  # q and k, forward and backward, in 2 layers
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        close(p.grad, q.grad, 2e-5)
    calls.clear()
    assert modeling.apply_rotary_pos_emb is transformers_rotation  # only while the switched model's forward runs
    other = llama()  # not switched: the same transformers module, transformers' function
    other(input_ids=ids, labels=ids).loss.backward()
    assert calls == []
    with pytest.raises(RuntimeError):  # put back when the forward raises too
        fused(input_ids=ids[:, :0].float())
    assert modeling.apply_rotary_pos_emb is transformers_rotation


def test_a_hanging_compiler_is_given_up_on(monkeypatch, tmp_path, capsys):
    compiler = tmp_path / "slowcc"
    compiler.write_text("#!/bin/sh\nexec sleep 30\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "BUILD_TIMEOUT_S", 1)
    monkeypatch.setattr(kernels, "_STATE", {"lib": None, "failed": False, "pool": None})
    assert not kernels.usable(torch.zeros(kernels.MIN_WIDTH))
    assert "slowcc took more than 1 s" in capsys.readouterr().err


def test_forwards_without_autograd_take_the_same_arithmetic(switched):
    """A frozen copy or a no-grad pass (DPO's and PPO's reference computed by the policy, the rollout's
    log-probs) must give the training forward's values exactly."""
    from rlhfkit.accel.rotary import use_fused_rotary

    model = llama()
    use_fused_rotary(model)
    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        frozen = model(input_ids=ids).logits
    trained = model(input_ids=ids).logits
    assert trained.requires_grad and torch.equal(trained.detach(), frozen)
