"""The torch references of the CPU linear and fused ops: what ``linear.c`` and ``fused.c``
compute, written in plain torch, and the bounds the kernels keep to. The tests hold each
kernel to its reference. (The attention ops' reference is :mod:`batchgen.kernels.torch_attention`,
shared with the CUDA kernels.)

* :func:`linear` / :func:`linear_error_bound`: ``x W^T + b`` exactly (float64), rounded once to
  the output dtype; the kernel's float32 sum stays within ``(k + 2) eps32 |x| |W|^T`` of the
  exact value, plus the output's own rounding in a 16-bit dtype.
* :func:`rms_norm`, :func:`gated_mul`: HF's ``LlamaRMSNorm`` and the gated MLP's ``act(g) * u``
  (SiLU, or GELU's tanh form), with torch's roundings in bfloat16 / float16.
* :func:`greedy`: each row's argmax (first index on ties) and its log-probability.
* :func:`rope_and_cache`: HF's ``apply_rotary_pos_emb`` (rotate-half) on the query and key heads
  of a fused q/k/v projection, then the key and value heads written into the paged cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.kernels.torch_attention import reshape_and_cache

EPS32 = torch.finfo(torch.float32).eps


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` computed in float64 from the given (possibly 16-bit) values, then
    rounded once to ``x.dtype``."""
    exact = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    return exact.to(x.dtype)


def linear_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on ``|kernel - exact|`` before the output is rounded: a float32 chain of
    ``k`` multiply-adds (plus the bias) errs by at most ``(k + 2) eps32 sum_k |x_k w_k|``."""
    k = x.shape[-1]
    return (k + 2) * EPS32 * F.linear(x.double().abs(), weight.double().abs())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm``: in float32, ``t = x * rsqrt(mean(x²) + eps)``, rounded to the input
    dtype, then ``weight * t`` (rounded again, for a 16-bit weight)."""
    dtype = x.dtype
    xf = x.float()
    t = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * t.to(dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``: in float32, ``x * rsqrt(mean(x²) + eps)``
    times ``1 + weight`` (the weight in float32), rounded once to the input dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def gated_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(g) * u`` for ``gate_up = cat([g, u], -1)``, as two torch ops (each rounding to the
    tensor's dtype)."""
    g, u = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](g) * u


def greedy(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's argmax (the first index on ties) and ``log_softmax`` at it, in float64."""
    ids = logits.argmax(-1)
    logprobs = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, None])[:, 0]
    return ids.tolist(), logprobs.tolist()


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> None:
    """``qkv`` ``[num_tokens, (num_heads + 2 kv_heads) * head_size]``: the query and key heads
    rotated in place as HF's ``q * cos + rotate_half(q) * sin`` (torch ops, each rounding to
    the tensor's dtype), then key and value heads copied to the cache rows ``slot_mapping``."""
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    t = qkv.shape[0]
    heads = qkv.view(t, -1, head_size)
    rotated = heads[:, : num_heads + num_kv_heads]
    c, s = cos.reshape(t, 1, head_size), sin.reshape(t, 1, head_size)
    half = head_size // 2
    rotate_half = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    rotated.copy_((rotated * c) + (rotate_half * s))
    reshape_and_cache(heads[:, num_heads: num_heads + num_kv_heads], heads[:, num_heads + num_kv_heads:],
                      k_cache, v_cache, slot_mapping)
