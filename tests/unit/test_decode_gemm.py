"""The decoding GEMM kernel (`accel/decode_gemm.py`): values against float64 matmuls, the same bits for a row
whatever the batch and thread count, where it applies, and a rollout through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.config.ppo_schema import GenConfig
from rlhfkit.data.templates import Template, encode_prompt
from rlhfkit.engine.local import LocalEngine
from rlhfkit.accel import decode_gemm, kernels
from rlhfkit.models import load_tokenizer
from rlhfkit.accel.decode_gemm import DecodeLinear, decode_linear, streaming_decode, takes
from rlhfkit.rollout import generate_rollout
from rlhfkit.models.plan import ModelPlan


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture
def switched(monkeypatch, cache):
    """The kernels on, built into this module's own cache; both modules' state restored afterwards."""
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(cache))
    monkeypatch.setattr(kernels, "_STATE", {"lib": None, "failed": False, "pool": None})
    monkeypatch.setattr(decode_gemm, "_STATE", {"lib": None, "failed": False})
    if not decode_gemm.available():
        if "avx512f" in cpu_flags():
            pytest.fail("the decoding kernel did not build on a CPU with AVX-512")
        pytest.skip("no AVX-512 on this CPU: decoding stays on MKL")


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def reference(x, w, b=None):
    out = x.double() @ w.double().T
    return (out if b is None else out + b.double()).float()


@pytest.mark.parametrize("k", [256, 270, 576])
@pytest.mark.parametrize("n", [1, 5, 24, 50, 193])
def test_values_equal_a_float64_matmul(switched, k, n):
    """Every row count up to MAX_ROWS (each kernel width 1-8 and the 8-row chunks), widths with a tail that is not
    a multiple of 16 lanes, output counts that do not fill a 24-row block, with and without bias."""
    g = torch.Generator().manual_seed(k * 1000 + n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for m in list(range(1, 18)) + [decode_gemm.MAX_ROWS]:
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            got = decode_linear(x, w, bias)
            expected = reference(x, w, bias)
            assert got.shape == (m, n)
            assert float((got - expected).abs().max()) <= 2e-6 * float(expected.abs().max()) + 1e-6


def test_hand_computed_values(switched):
    # x = (1, 2, ..., 300) and (1, 1, ..., 1); w rows: all ones, 2 on the first 17 inputs and 0 elsewhere
    k = 300
    x = torch.stack([torch.arange(1, k + 1, dtype=torch.float32), torch.ones(k)])
    w = torch.zeros(2, k)
    w[0] = 1.0
    w[1, :17] = 2.0
    out = decode_linear(x, w, torch.tensor([0.5, -1.0]))
    # sum 1..300 = 45150; 2 * (1 + ... + 17) = 306; exact in float32
    assert out.tolist() == [[45150.5, 305.0], [300.5, 33.0]]


def test_a_rows_outputs_are_the_same_bits_whatever_else_is_in_the_batch(switched):
    """Batch invariance: a row computed alone, as row 5 of 13, in a batch of 32, and on 1 or 2 threads."""
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(100, 576, generator=g), torch.randn(100, generator=g)
    batch = torch.randn(32, 576, generator=g)
    alone = decode_linear(batch[5:6].clone(), w, b)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(decode_linear(batch[:13].clone(), w, b)[5:6], alone)
            assert torch.equal(decode_linear(batch, w, b)[5:6], alone)
    finally:
        torch.set_num_threads(threads)


def test_strided_inputs_and_leading_dimensions(switched):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 256, generator=g)
    wide = torch.randn(6, 300, generator=g)
    x = wide[:, :256]  # rows 300 apart
    assert not x.is_contiguous()
    torch.testing.assert_close(decode_linear(x, w), reference(x, w), rtol=1e-5, atol=1e-5)
    steps = torch.randn(3, 1, 512, generator=g)[..., ::2]  # every other element: copied to rows first
    torch.testing.assert_close(decode_linear(steps, w), reference(steps.reshape(3, 256), w).view(3, 1, 40),
                               rtol=1e-5, atol=1e-5)


def test_where_the_kernel_applies(switched):
    w = torch.randn(8, 256)
    assert takes(torch.randn(decode_gemm.MAX_ROWS, 256), w, None)
    assert not takes(torch.randn(decode_gemm.MAX_ROWS + 1, 256), w, None)  # MKL's blocked GEMM is faster there
    assert not takes(torch.randn(2, 256, dtype=torch.float64), w.double(), None)
    assert not takes(torch.randn(2, 256), w.t().contiguous().t(), None)  # a transposed weight
    assert not takes(torch.randn(0, 256), w, None)
    assert not takes(torch.randn(2, 256), w, torch.randn(8, dtype=torch.float64))


def test_the_layers_switch_for_the_rollout_only_and_grad_mode_keeps_autograd(switched, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    real = decode_gemm.decode_linear
    monkeypatch.setattr(decode_gemm, "decode_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(4, 256)
    with torch.no_grad():
        plain = model(x)
    with streaming_decode(model) as switched_layers:
        assert switched_layers == 2  # the 64-input layer is too narrow
        assert [type(m) for m in model] == [DecodeLinear, torch.nn.Linear, DecodeLinear]
        with torch.no_grad():
            fast = model(x)
        assert calls == [(4, 256), (4, 256)]
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)
        y = model(x.requires_grad_())  # grad mode: F.linear and its autograd, not the kernel
        assert len(calls) == 2 and y.requires_grad
        y.sum().backward()
        assert model[0].weight.grad is not None
        with torch.no_grad():
            model(torch.randn(decode_gemm.MAX_ROWS + 1, 256))  # a prefill's many rows: MKL
        assert len(calls) == 2
    assert all(type(m) is torch.nn.Linear for m in model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError), streaming_decode(model):  # restored after an error too
        raise RuntimeError
    assert all(type(m) is torch.nn.Linear for m in model)


def test_switched_off_it_changes_nothing(monkeypatch, cache):
    """A plan without `streaming_decode` (engine.fused_kernels=false, a GPU, the reference path) opens it off."""
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(cache))
    model = torch.nn.Sequential(torch.nn.Linear(256, 256))
    with streaming_decode(model, enabled=False) as n:
        assert n == 0 and type(model[0]) is torch.nn.Linear


def test_a_rollout_decodes_through_it_with_mkls_tokens_and_log_probs(switched, tiny_model_dir, monkeypatch):
    """A width-256 Llama samples greedily the same tokens with the kernel as with MKL, log-probs to float
    rounding, and its decode steps (not its prefill) ran on the kernel."""
    from rlhfkit.demo.tiny import build_tiny_llama

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model = build_tiny_llama(len(tok), hidden=256, layers=2, heads=4).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # outputs that depend on the context
    template = Template.for_tokenizer(tok)
    rows = []
    for p in ["say apple", "say a very long river stone cloud green", "say honey"]:
        text = template.prompt([{"role": "user", "content": p}])
        rows.append({"prompt_ids": encode_prompt(tok, text), "prompt_text": text})
    cfg = GenConfig(max_new_tokens=6, min_new_tokens=6)
    rows_seen = []
    real = decode_gemm.decode_linear
    monkeypatch.setattr(decode_gemm, "decode_linear", lambda *a: rows_seen.append(a[0].numel() // a[0].shape[-1])
                        or real(*a))
    fast = generate_rollout(model, LocalEngine(), tok, rows, cfg, ModelPlan(streaming_decode=True), greedy=True)
    # the prefill's head on the prompts' last positions, then 5 decode steps x (2 layers x 7 linears + the head),
    # each of 3 rows; the prefill's layers (all the prompts' tokens) took MKL
    assert rows_seen == [3] * (1 + 5 * 15)
    monkeypatch.setattr(decode_gemm, "MAX_ROWS", 0)
    plain = generate_rollout(model, LocalEngine(), tok, rows, cfg, ModelPlan(streaming_decode=True), greedy=True)
    assert len(rows_seen) == 76
    assert fast.response_ids.tolist() == plain.response_ids.tolist()
    torch.testing.assert_close(fast.sample_logprobs, plain.sample_logprobs, rtol=1e-4, atol=1e-5)
    assert all(type(m) is not DecodeLinear for m in model.modules())


def test_a_failing_build_leaves_decoding_on_mkl_with_one_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_STATE", {"lib": None, "failed": False, "pool": None})
    monkeypatch.setattr(decode_gemm, "_STATE", {"lib": None, "failed": False})
    monkeypatch.setattr(decode_gemm, "FLAGS", [*decode_gemm.FLAGS, "-Wl,--no-such-linker-option"])
    model = torch.nn.Sequential(torch.nn.Linear(256, 256))
    x = torch.randn(2, 256)
    with streaming_decode(model) as n, torch.no_grad():
        assert n == 0 and type(model[0]) is torch.nn.Linear
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias))
    with streaming_decode(model) as n:
        assert n == 0
    assert not takes(x, model[0].weight, None)
    err = capsys.readouterr().err
    assert err.count("rlhfkit: decoding GEMM kernel unavailable") == 1 and "decoding uses MKL" in err
    assert not list(tmp_path.glob("kernels/*.so"))


def test_a_lora_model_decodes_with_its_adapter_through_the_kernel(switched):
    """peft's LoRA layers keep working with their base layer (and A factor) switched: the adapter's output is
    added as before, and the wrapped model's decode-step logits equal MKL's to float rounding."""
    from rlhfkit.config.schema import LoraConfig
    from rlhfkit.demo.tiny import build_tiny_llama
    from rlhfkit.lora import apply_lora

    model = apply_lora(build_tiny_llama(300, hidden=256, layers=2, heads=4), LoraConfig(rank=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # an adapter that changes the output (B starts at zero)
        ids = torch.randint(3, 300, (3, 1), generator=torch.Generator().manual_seed(0))
        plain = model(input_ids=ids).logits
        with streaming_decode(model) as n:
            assert n > 0
            switched_types = {type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)}
            fast = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert "DecodeLinear" in switched_types
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-5)
    assert float((plain - base).abs().max()) > 1e-2  # the adapter is in the compared output
