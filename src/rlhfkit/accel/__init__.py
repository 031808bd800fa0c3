"""CPU kernels: the speed paths that only pay on a CPU (oneDNN linear layers, C kernels for RMSNorm, SwiGLU and
the rotary embedding, a streaming decode GEMM, lean activations, gradients added in place). Nothing here runs on a
CUDA device. `models/` (loading, LoRA, forwards) and `algos/` (pure math) do not depend on it being installed.
"""
