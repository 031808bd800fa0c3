"""Decoding's linear layers on CPU as one stream over each weight: a skinny float32 GEMM in C.

A decode step multiplies a few rows (one per sequence being sampled) by every weight matrix of the model, so it is
bound by reading the weights from memory. For 8-16 rows MKL's sgemm reads them on the benchmarks' 2-core VM well
under the rate the memory gives (what a plain sum over memory reaches there). Here each output is the dot product
of a weight row with an input row: a few weight rows at a time, each loaded once into AVX-512 registers and
multiplied with up to 8 input rows held in L1, while the next weight rows are prefetched. The weights are read
once, in order, much nearer the memory's rate (most for 8 rows; the measurements: docs/performance.md). Threads
(OpenMP, torch's thread count) take blocks of 24 output rows.

Values: every output is one 16-lane sum of fused multiply-adds over the input width in order, its lanes then added
in a fixed tree, so a row's outputs are the same bits for any number of rows, any thread count and any position of
the row in the batch (a sequence decodes alike whatever decodes beside it). They differ from MKL's by float
rounding, as MKL's own one-row and many-row products do from each other.

Where: `streaming_decode(model, plan.streaming_decode)`, opened by `rollout.generate.generate_rollout` around its
sampling loop, switches the model's plain float32 `nn.Linear` layers with at least `kernels.MIN_WIDTH` inputs (the
benchmark and real models' widths; the tests' tiny models stay on MKL, as with the fused element-wise kernels) to
`DecodeLinear` while it is open. A call without autograd of at most `MAX_ROWS` rows takes the kernel; anything
else (the prefill, grad mode, other dtypes, ZeRO-3 partitions, autocast) is `F.linear`. Above `MAX_ROWS` rows MKL's
blocked GEMM is as fast or faster (measured on the 5M model's layers: docs/performance.md). Built
like `accel/kernels.py` (the same cache folder; `engine.fused_kernels` switches both in the speed plan), with
-fopenmp: GCC's libgomp, the OpenMP runtime PyTorch's CPU wheel has already loaded under the same name, so both
share one thread pool.
On CPUs without AVX-512, or where it does not build, decoding stays on MKL.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch
import torch.nn.functional as F

from rlhfkit.accel import kernels

MAX_ROWS = 32  # rows per call up to which the kernel beats MKL (5M, 20M and SmolLM2 layers measured at 1-64 rows)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]

SOURCE = r"""
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>

/* y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for MC input rows and up to RR weight rows from n0: each weight row's
   16 floats loaded once per k step against every input row, the same k offset of the next RR rows prefetched */
#define KERNEL(NAME, RR, MC)                                                                                       \
static void NAME(const float *x, int64_t xs, const float *w, int64_t K, float *y, int64_t ys, const float *b,      \
                 int64_t n0, int64_t nr) {                                                                         \
    __m512 acc[RR][MC];                                                                                            \
    const float *wr[RR];                                                                                           \
    for (int r = 0; r < RR; r++) {                                                                                 \
        wr[r] = w + (n0 + (r < nr ? r : 0)) * K;                                                                   \
        for (int m = 0; m < MC; m++) acc[r][m] = _mm512_setzero_ps();                                              \
    }                                                                                                              \
    int64_t k = 0;                                                                                                 \
    for (; k + 16 <= K; k += 16) {                                                                                 \
        __m512 a[RR];                                                                                              \
        for (int r = 0; r < RR; r++) {                                                                             \
            a[r] = _mm512_loadu_ps(wr[r] + k);                                                                     \
            _mm_prefetch((const char *)(wr[r] + k + RR * K), _MM_HINT_T0);                                         \
        }                                                                                                          \
        for (int m = 0; m < MC; m++) {                                                                             \
            __m512 xv = _mm512_loadu_ps(x + m * xs + k);                                                           \
            for (int r = 0; r < RR; r++) acc[r][m] = _mm512_fmadd_ps(a[r], xv, acc[r][m]);                         \
        }                                                                                                          \
    }                                                                                                              \
    if (k < K) {                                                                                                   \
        __mmask16 t = (__mmask16)((1u << (K - k)) - 1);                                                            \
        __m512 a[RR];                                                                                              \
        for (int r = 0; r < RR; r++) a[r] = _mm512_maskz_loadu_ps(t, wr[r] + k);                                   \
        for (int m = 0; m < MC; m++) {                                                                             \
            __m512 xv = _mm512_maskz_loadu_ps(t, x + m * xs + k);                                                  \
            for (int r = 0; r < RR; r++) acc[r][m] = _mm512_fmadd_ps(a[r], xv, acc[r][m]);                         \
        }                                                                                                          \
    }                                                                                                              \
    for (int r = 0; r < nr; r++)                                                                                   \
        for (int m = 0; m < MC; m++)                                                                               \
            y[m * ys + n0 + r] = _mm512_reduce_add_ps(acc[r][m]) + (b ? b[n0 + r] : 0.0f);                          \
}

/* RR x MC accumulators + RR weight vectors + 1 input vector fit the 32 vector registers */
KERNEL(rows8, 3, 8)
KERNEL(rows7, 3, 7)
KERNEL(rows6, 4, 6)
KERNEL(rows5, 4, 5)
KERNEL(rows4, 6, 4)
KERNEL(rows3, 6, 3)
KERNEL(rows2, 8, 2)
KERNEL(rows1, 8, 1)

typedef void (*kernel_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *, int64_t,
                          int64_t);
static const kernel_fn KERNELS[9] = {0, rows1, rows2, rows3, rows4, rows5, rows6, rows7, rows8};
static const int WEIGHT_ROWS[9] = {0, 8, 8, 6, 6, 4, 4, 3, 3};
#define BLOCK 24 /* output rows per thread task: a multiple of every WEIGHT_ROWS */

int decode_gemm_ready(void) { return 1; }

void decode_gemm(const float *x, int64_t xs, const float *w, const float *b, float *y, int64_t ys, int64_t M,
                 int64_t N, int64_t K, int threads) {
    int64_t blocks = (N + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t i = 0; i < blocks; i++) {
        int64_t start = i * BLOCK, end = start + BLOCK < N ? start + BLOCK : N;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {  /* input rows in chunks of 8; the block's weights stay in cache */
            int mc = M - m0 < 8 ? (int)(M - m0) : 8, rr = WEIGHT_ROWS[mc];
            for (int64_t n0 = start; n0 < end; n0 += rr)
                KERNELS[mc](x + m0 * xs, xs, w, K, y + m0 * ys, ys, b, n0, end - n0 < rr ? end - n0 : rr);
        }
    }
}
#else
int decode_gemm_ready(void) { return 0; }
void decode_gemm(const float *x, int64_t xs, const float *w, const float *b, float *y, int64_t ys, int64_t M,
                 int64_t N, int64_t K, int threads) {}
#endif
"""

_STATE: dict = {"lib": None, "failed": False}
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _load():
    lib = ctypes.CDLL(str(kernels.build(source=SOURCE, flags=FLAGS, name="rlhfkit_decode_gemm")))
    lib.decode_gemm.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]
    lib.decode_gemm.restype = None
    lib.decode_gemm_ready.restype = ctypes.c_int
    return lib if lib.decode_gemm_ready() else None  # built without AVX-512: MKL, silently


def _library():
    """The loaded library, or None where it cannot be built or loaded (said once) or the CPU lacks AVX-512."""
    return kernels.load_once(_STATE, _load, "decoding GEMM kernel", "decoding uses MKL")


def available() -> bool:
    """Built for this CPU (AVX-512) and loaded."""
    return _library() is not None


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `decode_linear` computes x @ weight.T + bias: float32 CPU tensors, a whole contiguous weight (not a
    ZeRO-3 partition), at most `MAX_ROWS` rows, no autocast."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2
            or weight.device.type != "cpu" or not weight.is_contiguous() or x.shape[-1] != weight.shape[1]
            or torch.is_autocast_enabled("cpu")):
        return False
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != weight.shape[0]):
        return False
    rows = x.numel() // max(weight.shape[1], 1)
    return 0 < rows <= MAX_ROWS and _library() is not None


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias by the kernel (no autograd node; check `takes` first)."""
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], n, dtype=torch.float32)
    _library().decode_gemm(flat.data_ptr(), flat.stride(0), weight.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), flat.shape[0], n,
                           k, torch.get_num_threads())
    return out.view(*x.shape[:-1], n)


class DecodeLinear(torch.nn.Linear):
    """An `nn.Linear` (same parameters and state dict) whose no-grad calls of at most `MAX_ROWS` rows run the
    streaming kernel; set by `streaming_decode` for the length of a rollout only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and takes(x, self.weight, self.bias):
            return decode_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def decode_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The layers `streaming_decode` switches: plain float32 CPU `nn.Linear`s with at least `kernels.MIN_WIDTH`
    inputs (LoRA's base layers and A factors among them; its B factors, r inputs wide, are not)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear and m.in_features >= kernels.MIN_WIDTH
            and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


@contextlib.contextmanager
def streaming_decode(model: torch.nn.Module, enabled: bool = True):
    """While open, `model`'s decode-sized linear calls run the streaming kernel (see the module) where `enabled`
    (its speed plan's `streaming_decode`); yields how many layers were switched (0 where the kernel is off or
    unavailable). The layers are plain `nn.Linear`s again after."""
    layers = decode_layers(model) if enabled and available() else []
    for layer in layers:
        layer.__class__ = DecodeLinear
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.__class__ = torch.nn.Linear
