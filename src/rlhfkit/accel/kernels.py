"""Fused element-wise kernels on CPU, in C: the lean RMSNorm and SwiGLU (`accel/lean.py`) and the rotary
embedding (`accel/rotary.py`).

PyTorch's eager element-wise operators each read and write whole tensors: the SwiGLU's backward is seven passes
over (tokens x MLP) tensors, the RMSNorm's about as many over (tokens x hidden). They are memory-bound, and in an
SFT step of the benchmark's 20M model they are a sizeable share of the time. Here each is one loop that reads its
inputs once and writes its outputs once (what that saves: docs/performance.md).

The C source below is compiled once per machine by the system's C compiler (`$CC`, else `cc`, `gcc` or `clang`)
into a shared library cached under `$RLHFKIT_CACHE_DIR/kernels` (else `~/.cache/rlhfkit/kernels`), named by
a hash of the source, the flags and the CPU, and called through ctypes on the tensors' memory. Where no compiler
runs, the build fails or the library does not load, rlhfkit says so once and the lean modules keep PyTorch's
operators. Only float32 CPU tensors whose rows are at least `MIN_WIDTH` wide take these kernels (the hidden or MLP
width of a model; heads x head size for the rotation): whether they run depends on the model, never on the batch,
so a run's arithmetic is the same for every micro-batch size and sequence length (the tests' tiny models stay on
PyTorch's operators, the benchmarks' and real models take the kernels).

Values: the element-wise results use the same formulas in float32 (SiLU's exp from the C library, vectorised by
glibc's libmvec on x86-64, so within a few ulp of PyTorch's); the RMS sums in another order and the norm's weight
gradient sums over tokens in double, so those differ from PyTorch's by float rounding. The norm's output is
computed by one routine both in the forward and where `lean` recomputes it for backward: the same bits.

With several torch threads, a tensor of at least 2 x `MIN_SPLIT` elements is split over up to that many threads
(ctypes releases the GIL); smaller ones run on the calling thread, which is faster there (memory-bound loops:
below that size handing part of one to another thread costs more than it saves; timings in docs/performance.md).
Whether a model's modules call them is its speed plan's (`plan.fused_kernels`, `engine.fused_kernels`): the lean
modules and the rotation that `accel.install` puts in are made to use them or not; nothing here is switched per
process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MIN_WIDTH = 256  # rows narrower than this (tiny models) stay on PyTorch's operators
MIN_SPLIT = 1 << 20  # elements per thread: below this a kernel runs on the calling thread alone (a handoff costs more)

SOURCE = r"""
#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__)
/* glibc's vector expf (libmvec), which <math.h> only declares under -ffast-math */
__attribute__((__simd__("notinbranch"))) extern float expf(float);
#endif

/* one row of the norm's output: y = w * (x * inv), the forward's and the recomputation's one routine */
static __attribute__((noinline)) void norm_row(const float *restrict x, const float *restrict w, float inv,
                                               float *restrict y, int64_t h) {
    #pragma omp simd
    for (int64_t j = 0; j < h; j++) y[j] = w[j] * (x[j] * inv);
}

void rms_forward(const float *restrict x, const float *restrict w, float *restrict y, float *restrict inv,
                 float eps, int64_t h, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * h;
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t j = 0; j < h; j++) ss += xr[j] * xr[j];
        inv[r] = 1.0f / sqrtf(ss / (float)h + eps);
        norm_row(xr, w, inv[r], y + r * h, h);
    }
}

void rms_output(const float *restrict x, const float *restrict w, const float *restrict inv, float *restrict y,
                int64_t h, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) norm_row(x + r * h, w, inv[r], y + r * h, h);
}

/* dx = (g - n * mean(g * n)) * inv with n = x * inv, g = d * w; dw += d * n (double, summed over the rows) */
void rms_backward(const float *restrict d, const float *restrict x, const float *restrict w,
                  const float *restrict inv, float *restrict dx, double *restrict dw, int64_t h, int64_t r0,
                  int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *dr = d + r * h, *xr = x + r * h;
        float *dxr = dx + r * h;
        const float s = inv[r];
        float dot = 0.0f;
        #pragma omp simd reduction(+:dot)
        for (int64_t j = 0; j < h; j++) dot += (dr[j] * w[j]) * (xr[j] * s);
        const float mean = dot / (float)h;
        #pragma omp simd
        for (int64_t j = 0; j < h; j++) {
            const float n = xr[j] * s;
            dxr[j] = (dr[j] * w[j] - n * mean) * s;
            dw[j] += (double)(dr[j] * n);
        }
    }
}

void silu_mul_forward(const float *restrict g, const float *restrict u, float *restrict y, int64_t i0, int64_t i1) {
    #pragma omp simd
    for (int64_t i = i0; i < i1; i++) {
        const float s = 1.0f / (1.0f + expf(-g[i]));
        y[i] = (g[i] * s) * u[i];
    }
}

/* rotary embedding of x (B, H, T, D) with cos, sin (B, T, D), any strides but a unit one for D (x is usually the
   (B, T, H, D) projection seen through a transpose): y1 = x1 * c1 - x2 * s1, y2 = x2 * c2 + x1 * s2 for the halves
   of D, transformers' x * cos + rotate_half(x) * sin; `transpose` applies the map's transpose (backward):
   y1 = x1 * c1 + x2 * s2, y2 = x2 * c2 - x1 * s1. Rows r0..r1 of the B * T * H rows, in (b, t, h) order. */
void rope(const float *restrict x, const float *restrict cos, const float *restrict sin, float *restrict y,
          int transpose, int64_t heads, int64_t t_len, int64_t d, int64_t xb, int64_t xh, int64_t xt, int64_t yb,
          int64_t yh, int64_t yt, int64_t cb, int64_t ct, int64_t r0, int64_t r1) {
    const int64_t half = d / 2;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / (t_len * heads), t = (r / heads) % t_len, h = r % heads;
        const float *xr = x + b * xb + h * xh + t * xt, *c = cos + b * cb + t * ct, *s = sin + b * cb + t * ct;
        float *yr = y + b * yb + h * yh + t * yt;
        if (transpose) {
            #pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                yr[j] = xr[j] * c[j] + xr[j + half] * s[j + half];
                yr[j + half] = xr[j + half] * c[j + half] - xr[j] * s[j];
            }
        } else {
            #pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                yr[j] = xr[j] * c[j] - xr[j + half] * s[j];
                yr[j + half] = xr[j + half] * c[j + half] + xr[j] * s[j + half];
            }
        }
    }
}

/* d/dgate = d * u * SiLU'(g), SiLU'(g) = s + silu - silu * s; d/dup = d * silu */
void silu_mul_backward(const float *restrict d, const float *restrict g, const float *restrict u,
                       float *restrict dg, float *restrict du, int64_t i0, int64_t i1) {
    #pragma omp simd
    for (int64_t i = i0; i < i1; i++) {
        const float s = 1.0f / (1.0f + expf(-g[i]));
        const float silu = g[i] * s;
        du[i] = d[i] * silu;
        dg[i] = (d[i] * u[i]) * (s + silu - silu * s);
    }
}
"""

BUILD_TIMEOUT_S = 120
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp-simd", "-fPIC", "-shared"]

_STATE: dict = {"lib": None, "failed": False, "pool": None}
_LOCK = threading.Lock()
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {"rms_forward": [_P, _P, _P, _P, _F, _I, _I, _I], "rms_output": [_P, _P, _P, _P, _I, _I, _I],
               "rms_backward": [_P, _P, _P, _P, _P, _P, _I, _I, _I], "silu_mul_forward": [_P, _P, _P, _I, _I],
               "silu_mul_backward": [_P, _P, _P, _P, _P, _I, _I],
               "rope": [_P, _P, _P, _P, ctypes.c_int] + [_I] * 13}


def cache_dir() -> Path:
    root = os.environ.get("RLHFKIT_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "rlhfkit") / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared by different machines)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def build(folder: Path | None = None, source: str | None = None, flags: list[str] | None = None,
          name: str = "rlhfkit_kernels") -> Path:
    """Compile `source` (default `SOURCE`, with `FLAGS`) into the cache as `name`_<hash>.so (once per source,
    flags, compiler and CPU); returns the library's path. Raises RuntimeError when no compiler runs or it fails."""
    source, flags = (SOURCE if source is None else source), (FLAGS if flags is None else flags)
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
    key = hashlib.sha256("\0".join([source, " ".join(flags), compiler, _cpu()]).encode()).hexdigest()[:16]
    folder = folder or cache_dir()
    path = folder / f"{name}_{key}.so"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # ranks building at once each write their own, then swap
        file, target = Path(tmp) / f"{name}.c", Path(tmp) / path.name
        file.write_text(source)
        try:
            done = subprocess.run([compiler, *flags, str(file), "-o", str(target), "-lm"], capture_output=True,
                                  text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{Path(compiler).name} took more than {BUILD_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {(done.stderr or done.stdout).strip()[-500:]}")
        os.replace(target, path)
    return path


def load_once(state: dict, load, what: str, instead: str):
    """`state["lib"]`: the library `load()` returns, made once per process (checked again under the lock, so
    threads do not build it twice); None when `load()` returns None (nothing to say: a CPU it is not for) or fails
    (said once on stderr: "rlhfkit: `what` unavailable (why); `instead`")."""
    if state["lib"] is None and not state["failed"]:
        with _LOCK:
            if state["lib"] is None and not state["failed"]:
                try:
                    state["lib"] = load()
                    state["failed"] = state["lib"] is None
                except (OSError, RuntimeError, AttributeError) as exc:
                    state["failed"] = True
                    print(f"rlhfkit: {what} unavailable ({exc}); {instead} (engine.fused_kernels=false silences "
                          f"this)", file=sys.stderr)
    return state["lib"]


def _load():
    lib = ctypes.CDLL(str(build()))
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, None
    return lib


def _library():
    """The loaded library, or None where it cannot be built or loaded (said once, on stderr)."""
    return load_once(_STATE, _load, "fused CPU kernels", "using PyTorch's operators")


def available() -> bool:
    """Whether the library builds and loads here (built on the first call; a failure is said once)."""
    return _library() is not None


def usable(*tensors: torch.Tensor, width: int | None = None) -> bool:
    """Whether the kernels take these tensors: float32 on CPU, rows at least `MIN_WIDTH` wide (`width`, else the
    first tensor's last dimension), and the library built."""
    return ((tensors[0].shape[-1] if width is None else width) >= MIN_WIDTH
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and _library() is not None)


def _split(fn, total: int, unit: int = 1) -> None:
    """fn(start, end) over [0, total) (units of `unit` elements), on up to torch's thread count of threads, each
    with at least `MIN_SPLIT` elements."""
    threads = max(1, min(torch.get_num_threads(), total * unit // MIN_SPLIT))
    if threads <= 1:
        fn(0, total)
        return
    pool = _STATE["pool"]
    if pool is None or pool[0] != os.getpid() or pool[1] < threads - 1:  # none yet, too small, or a forked parent's
        _STATE["pool"] = pool = (os.getpid(), threads - 1,
                                 ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="rlhfkit-kernels"))
    bounds = [total * i // threads for i in range(threads + 1)]
    futures = [pool[2].submit(fn, bounds[i], bounds[i + 1]) for i in range(1, threads)]
    fn(bounds[0], bounds[1])
    for future in futures:
        future.result()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's RMSNorm in float32: (weight * x / rms(x), 1 / rms(x) with a trailing dim of 1)."""
    x, weight = x.contiguous(), weight.contiguous()
    h = x.shape[-1]
    rows = x.numel() // h
    y = torch.empty_like(x)
    inv = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    lib = _library()
    _split(lambda a, b: lib.rms_forward(_ptr(x), _ptr(weight), _ptr(y), _ptr(inv), eps, h, a, b), rows, h)
    return y, inv


def norm_output(x: torch.Tensor, weight: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """weight * x * inv, bit for bit `rms_norm_forward`'s output given its `inv`."""
    x, weight, inv = x.contiguous(), weight.contiguous(), inv.contiguous()
    h = x.shape[-1]
    y = torch.empty_like(x)
    lib = _library()
    _split(lambda a, b: lib.rms_output(_ptr(x), _ptr(weight), _ptr(inv), _ptr(y), h, a, b), x.numel() // h, h)
    return y


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d/dx, d/dweight) of `rms_norm_forward` given its output's gradient."""
    grad, x, weight, inv = grad.contiguous(), x.contiguous(), weight.contiguous(), inv.contiguous()
    h = x.shape[-1]
    rows = x.numel() // h
    dx = torch.empty_like(x)
    parts: list[torch.Tensor] = []
    lib = _library()

    def chunk(a: int, b: int) -> None:
        dw = torch.zeros(h, dtype=torch.float64)
        parts.append(dw)  # list.append is atomic under the GIL
        lib.rms_backward(_ptr(grad), _ptr(x), _ptr(weight), _ptr(inv), _ptr(dx), _ptr(dw), h, a, b)

    _split(chunk, rows, h)
    return dx, torch.stack(parts).sum(0).to(weight.dtype) if len(parts) > 1 else parts[0].to(weight.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up."""
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    lib = _library()
    _split(lambda a, b: lib.silu_mul_forward(_ptr(gate), _ptr(up), _ptr(y), a, b), gate.numel())
    return y


def silu_mul_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d/dgate, d/dup) of SiLU(gate) * up."""
    grad, gate, up = grad.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    lib = _library()
    _split(lambda a, b: lib.silu_mul_backward(_ptr(grad), _ptr(gate), _ptr(up), _ptr(dg), _ptr(du), a, b),
           gate.numel())
    return dg, du


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """transformers' rotary embedding `x * cos + rotate_half(x) * sin` (`transpose`: the map's transpose, the
    backward of it), x (B, H, T, D), cos and sin (B or 1, T, D); the output has x's layout."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    batch, heads, t_len, d = x.shape
    y = torch.empty_like(x)
    cb = cos.stride(0) if cos.shape[0] == batch else 0
    lib = _library()
    _split(lambda a, b: lib.rope(_ptr(x), _ptr(cos), _ptr(sin), _ptr(y), int(transpose), heads, t_len, d,
                                 x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2), cb,
                                 cos.stride(1), a, b), batch * t_len * heads, d)
    return y
