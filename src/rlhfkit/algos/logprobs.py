"""Per-token log-probabilities, entropy and the summed causal-LM loss from logits.

Logits are ``(B, T, V)`` with V up to ~256k, so a full ``(B, T, V)`` float32 copy can dominate memory. The
functions below avoid materialising one where they can.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F


_FULL_PRECISION = (torch.float32, torch.float64)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] for every position.

    Args:
        logits: ``(B, T, V)``, already aligned with ``labels`` (the caller shifts).
        labels: ``(B, T)`` integer token ids.

    Returns:
        ``(B, T)`` log-probabilities, float32 (or float64 for float64 logits).
    """
    if logits.dtype in _FULL_PRECISION:
        # log p(y) = z_y - logsumexp(z): only (B, T) outputs, no (B, T, V) log-softmax copy.
        picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    # bf16/fp16 logsumexp loses too much precision for PPO ratios; upcast one row at a time so the float32
    # copy is (T, V), not (B, T, V).
    rows = []
    for row_logits, row_labels in zip(logits, labels):
        row_logp = F.log_softmax(row_logits.float(), dim=-1)
        rows.append(torch.gather(row_logp, -1, row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at every position.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, which avoids log(0) for tiny probabilities.

    Args:
        logits: ``(B, T, V)``.

    Returns:
        ``(B, T)`` entropies in nats.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def lm_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> Tuple[torch.Tensor, int]:
    """Summed token negative log-likelihood and the number of tokens it covers.

    Returning the sum (not the mean) lets the SFT loop divide by the token count of the whole accumulated
    batch, so micro-batch 1 x accumulation 8 equals micro-batch 8 x accumulation 1.

    Args:
        logits: ``(B, T, V)``, already aligned with ``labels`` (the caller shifts).
        labels: ``(B, T)`` integer token ids; ``ignore_index`` marks positions without a loss.
        ignore_index: label value to skip (prompt tokens, padding).

    Returns:
        ``(nll_sum, n_tokens)``: a scalar tensor and a Python int.
    """
    vocab = logits.size(-1)
    # Upcast as Hugging Face models do for their own loss: a bf16 cross-entropy is noticeably off.
    nll_sum = F.cross_entropy(
        logits.reshape(-1, vocab).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    n_tokens = int((labels != ignore_index).sum().item())
    return nll_sum, n_tokens


# Rows of logits one chunk of the fused loss holds at a time: ~64 MiB of float32 for any vocabulary.
_CHUNK_ELEMENTS = 1 << 24


def _add_weight_grad(grad_weight: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight (V, H) float32 += dz.T @ h for a chunk: (c, V) float32 logit gradients, (c, H) hidden states.
    With `h` in a half dtype (the head under bf16 autocast) the product runs in that dtype, as autocast runs the
    model's own head's weight gradient, and is added in float32; with float32 `h`, in float32 throughout."""
    if h.dtype in _FULL_PRECISION:
        grad_weight.addmm_(dz.T, h.float())
    else:
        grad_weight.add_(dz.T.to(h.dtype) @ h)


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum_k CE(hidden_k @ weight.T, label_k), in chunks of rows, never holding (K, V) logits.

    The loss is a plain sum, so its gradient is known in the forward up to the one scalar the backward brings:
    d/dz_k = softmax(z_k) - onehot(label_k). Each chunk's logits become that gradient in place, give their
    contribution to d/dhidden and d/dweight, and are freed; the backward only scales the two by grad_output.
    Same arithmetic as logits + cross-entropy (no recomputation), one chunk of logits at a time.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, dtype, grad_hidden_needed, grad_weight_needed):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grad_hidden_needed else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if grad_weight_needed else None
        w, h_all = weight.to(dtype), hidden.to(dtype)
        for start in range(0, hidden.size(0), chunk):
            h, y = h_all[start:start + chunk], labels[start:start + chunk]
            z = (h @ w.T).float()  # (c, V), upcast as the model's own loss does
            lse = torch.logsumexp(z, dim=-1)
            total += (lse - z.gather(1, y[:, None]).squeeze(1)).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            dz = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            dz[torch.arange(y.numel(), device=y.device), y] -= 1.0
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = dz.to(w.dtype) @ w
            if grad_weight is not None:
                _add_weight_grad(grad_weight, dz, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        # scaled in place: the buffers are this node's own and are used once (no second backward through it)
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_lm_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       chunk: int = 0) -> torch.Tensor:
    """Summed token negative log-likelihood of an LM head without bias, ``sum_k CE(hidden_k @ weight.T,
    labels_k)``, equal to ``lm_loss_sum`` on the head's logits but holding one chunk of them at a time.

    Args:
        hidden: ``(K, H)`` final hidden states of the K positions that have a label (no ignored ones).
        weight: ``(V, H)`` the LM head's weight.
        labels: ``(K,)`` the token each position predicts.
        chunk: rows of logits per chunk; 0 picks ~64 MiB of float32.

    Returns:
        A scalar float32 tensor; its gradient reaches ``hidden`` and ``weight`` (those that require one). Under
        autocast the head's GEMMs run in the autocast dtype, as the model's own head would; else in ``hidden``'s.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden (K, H) and labels (K,) expected, got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    chunk = chunk or max(64, _CHUNK_ELEMENTS // weight.size(0))
    grads = torch.is_grad_enabled()
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropySum.apply(hidden, weight, labels, chunk, dtype, grads and hidden.requires_grad,
                                            grads and weight.requires_grad)


# Rows of logits one chunk of the fused log-probs holds at a time: ~32 MiB of float32 (measured on SmolLM2's
# 49,152-token head, 2 threads: chunks of ~170 rows beat 32 and 512, where the element-wise passes leave the cache
# or the GEMMs get thin).
_LOGPROB_CHUNK_ELEMENTS = 1 << 23


class _LinearTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden_k @ weight.T / T)[label_k] and the entropy of that distribution, chunk by chunk.

    Each chunk's logits are turned in place into their log-softmax, the picked log-prob and the entropy are read
    from it, and, when a gradient is wanted, the chunk is kept as its softmax p: d logp_k / d z_k = onehot - p_k, so
    the backward needs p and nothing else (the same memory autograd would keep for the logits, without the extra
    (K, V) tensors of a log-softmax, a gather's and a slice's gradients). The entropy carries no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk, linear, dtype, entropy, wanted, grad_target):
        w = weight.to(dtype)
        h_all = hidden.to(dtype)
        logps, entropies, probs = [], [], []
        for start in range(0, hidden.size(0), chunk):
            h, y = h_all[start:start + chunk], labels[start:start + chunk]
            z = linear(h, w).float()  # (c, V), upcast as the loss of the model's own logits is
            if temperature != 1.0:
                z.div_(temperature)
            lse = torch.logsumexp(z, dim=-1)
            logps.append(z.gather(1, y[:, None]).squeeze(1) - lse)
            if not (wanted or entropy):
                continue
            z.sub_(lse[:, None])  # log-softmax, in place
            p = z.exp()
            if entropy:  # -sum_v p_v log p_v, as one dot product per row (no (c, V) product tensor)
                entropies.append(-torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).flatten())
            if wanted:
                probs.append(p)
        ctx.temperature, ctx.chunk, ctx.linear, ctx.weight_dtype = temperature, chunk, linear, weight.dtype
        ctx.grad_target = grad_target
        ctx.weight = weight if grad_target is not None and grad_target(weight) is not None else None
        ctx.save_for_backward(h_all, w, labels, *probs)
        empty = hidden.new_zeros(0, dtype=torch.float32)  # no positions (every response masked out)
        logp = torch.cat(logps) if logps else empty
        ent = torch.cat(entropies) if entropy and entropies else torch.zeros_like(logp)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, _grad_entropy):
        h_all, w, labels, *probs = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty(h_all.shape, dtype=h_all.dtype, device=h_all.device) if need_hidden else None
        into = ctx.grad_target(ctx.weight) if need_weight and ctx.weight is not None else None
        grad_weight = into if into is not None else \
            torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_weight else None
        scale = grad_logp.float() / ctx.temperature  # d z / d logits = 1 / T
        for i, start in enumerate(range(0, h_all.size(0), ctx.chunk)):
            g = scale[start:start + ctx.chunk]
            dz = probs[i].mul_(-g[:, None])  # g (onehot - p) / T, in place of the kept softmax
            dz[torch.arange(g.numel(), device=dz.device), labels[start:start + ctx.chunk]] += g
            if need_hidden:
                grad_hidden[start:start + ctx.chunk] = ctx.linear(dz.to(w.dtype), w.t())  # dz @ W
            if need_weight:
                _add_weight_grad(grad_weight, dz, h_all[start:start + ctx.chunk])
            probs[i] = None
        if into is not None:
            grad_weight = None  # added into the parameter's .grad already
        elif grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                          entropy: bool = False, chunk: int = 0, linear=None, grad_target=None
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities (and entropies) of a bias-free LM head, ``log softmax(hidden_k @ weight.T /
    temperature)[labels_k]``: equal to ``token_logprobs`` of the head's logits, holding one chunk of logits at a
    time (and, with a gradient, the softmax of each chunk for the backward instead of the logits).

    Args:
        hidden: ``(K, H)`` final hidden states of the K positions wanted.
        weight: ``(V, H)`` the LM head's weight.
        labels: ``(K,)`` the token whose log-probability each position gives.
        temperature: the logits are divided by it (the sampling temperature).
        entropy: also return each position's entropy (without a gradient); else zeros.
        chunk: rows of logits per chunk; 0 picks ~32 MiB of float32.
        linear: ``linear(x, w) = x @ w.T``, the GEMM to use (default ``F.linear``).
        grad_target: ``grad_target(weight)`` -> a tensor the weight's gradient is added into in place (then autograd
            gets none for it), or None for autograd's own accumulation (`accel.grad_in_place.target`); default None.

    Returns:
        ``(logp, entropy)``, each ``(K,)`` float32; the gradient of ``logp`` reaches ``hidden`` and ``weight``.
        Under autocast the head's GEMMs run in the autocast dtype, as the model's own head would.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.dim() != 2:
        raise ValueError(f"hidden (K, H), weight (V, H) and labels (K,) expected, got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(labels.shape)}")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    chunk = chunk or max(16, _LOGPROB_CHUNK_ELEMENTS // weight.size(0))
    wanted = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device, enabled=False):
        return _LinearTokenLogprobs.apply(hidden, weight, labels, float(temperature), chunk,
                                          linear or F.linear, dtype, entropy, wanted, grad_target)
