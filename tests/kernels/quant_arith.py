"""The quantized kernel's arithmetic written out in torch, for the tests: the activations'
int8 quantization, the weights' integer fields read from the GGUF bytes (independently of
``kernels/cpu/quant.py``'s de-quantization), exact integer dot products, and the float32
combination of the block sums in ``quant.c``'s order. The kernel must equal it bit for bit.
Also the kernel's own activation quantization (``batchgen_quant_rows``, to compare with this
model) and the stated bound of the kernel's distance from the exact product
(:func:`activation_error_bound`, ``docs/kernels.md``).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from batchgen.kernels.cpu import quant


def quantize_activations(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [M, K] int32 values in [-127, 127], d [M, K / bk] float32, s16 [M, K / 16] int64)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // bk, bk)
    finite = torch.isfinite(xb).all(dim=2)
    amax = torch.where(finite, xb.abs().amax(dim=2), torch.zeros(()))
    d = amax / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones(())), torch.zeros(()))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    q = torch.where(finite[..., None], q, torch.zeros(())).to(torch.int32).reshape(m, k)
    d = torch.where(finite, d, torch.full((), float("nan")))
    s16 = q.reshape(m, k // 16, 16).sum(dim=2)
    return q, d, s16


def kernel_quantization(x: torch.Tensor, qtype: Q, isa: str = "native") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's (build ``isa``) int8 quantization of ``x`` [M, K] float32 for a weight of
    ``qtype``: ``(q [M, K] int8, d [M, K / block] float32, s16 [M, K / 16] int32)``."""
    x = x.float().contiguous()
    m, k = x.shape
    bs = GGML_QUANT_SIZES[Q(qtype)][0]
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // bs)
    s = torch.empty(m, k // 16, dtype=torch.int32)
    quant.load_quant(isa).batchgen_quant_rows(x.data_ptr(), k, m, k, bs, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


def activation_error_bound(x: torch.Tensor, weight: torch.Tensor, qtype: Q) -> torch.Tensor:
    """How far the kernel's output may lie from the exact product of ``x`` [M, K] with the
    de-quantized ``weight`` [N, K] (float64, [M, N]).

    The kernel rounds each block of ``x`` (32 values; 256 for the K-quants) to int8 with the
    scale ``amax / 127``: each value moves by at most half a step, ``amax_b / 254``. So an
    output moves by at most ``sum_b (amax_b / 254) sum_{k in b} |w_k|``; the float32
    combination of the block sums adds a sequential-sum rounding term,
    ``(n_blocks + 4) eps sum_k |x_k w_k|``, and the int8 values' own rounding of the products
    (``eps``-relative, absorbed by the 1 % margin).
    """
    bs = GGML_QUANT_SIZES[Q(qtype)][0]
    m, k = x.shape
    xd, wd = x.double(), weight.double()
    amax = xd.abs().reshape(m, k // bs, bs).amax(dim=2)                  # [M, B]
    wsum = wd.abs().reshape(weight.shape[0], k // bs, bs).sum(dim=2)     # [N, B]
    step = (amax / 254.0) @ wsum.T
    eps = torch.finfo(torch.float32).eps
    rounding = (k // bs + 4) * eps * (xd.abs() @ wd.abs().T)
    return 1.01 * step + 2 * rounding + 1e-30


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float().reshape(b.shape[:-1])


def weight_fields(raw: torch.Tensor, qtype: Q, in_features: int) -> dict[str, torch.Tensor]:
    """The integer quants ``u`` ([N, K], what the kernel's dot products use: Q8_0's w + 128)
    and the per-block scales, read from ``raw`` ([N, row_bytes] uint8)."""
    bk, ts = GGML_QUANT_SIZES[qtype]
    n = raw.shape[0]
    nb = in_features // bk
    blk = raw.reshape(n, nb, ts).to(torch.int64)
    out: dict[str, torch.Tensor] = {}
    if qtype in (Q.Q4_0, Q.Q4_1):
        off = 2 if qtype == Q.Q4_0 else 4
        qs = blk[..., off:off + 16]
        out["u"] = torch.cat([qs & 15, qs >> 4], dim=2).reshape(n, in_features)
        out["d"] = _f16(raw.reshape(n, nb, ts)[..., 0:2])
        if qtype == Q.Q4_1:
            out["m"] = _f16(raw.reshape(n, nb, ts)[..., 2:4])
    elif qtype == Q.Q5_0:  # d, 32 fifth bits (a little-endian uint32: bit j for value j), nibbles
        qh = sum(blk[..., 2 + i] << (8 * i) for i in range(4))                    # [N, B]
        qs = blk[..., 6:22]
        low = torch.cat([qs & 15, qs >> 4], dim=2)                                  # value j at j
        high = (qh[..., None] >> torch.arange(32)) & 1
        out["u"] = (low | (high << 4)).reshape(n, in_features)
        out["d"] = _f16(raw.reshape(n, nb, ts)[..., 0:2])
    elif qtype == Q.Q8_0:
        out["u"] = (raw.reshape(n, nb, ts)[..., 2:].contiguous().view(torch.int8).to(torch.int64) + 128).reshape(n, in_features)
        out["d"] = _f16(raw.reshape(n, nb, ts)[..., 0:2])
    elif qtype in (Q.Q4_K, Q.Q5_K):
        out["d"] = _f16(raw.reshape(n, nb, ts)[..., 0:2])
        out["dmin"] = _f16(raw.reshape(n, nb, ts)[..., 2:4])
        s = blk[..., 4:16]
        sc = torch.empty(n, nb, 8, dtype=torch.int64)
        mn = torch.empty(n, nb, 8, dtype=torch.int64)
        for j in range(4):
            sc[..., j] = s[..., j] & 63
            mn[..., j] = s[..., j + 4] & 63
            sc[..., j + 4] = (s[..., j + 8] & 15) | ((s[..., j] >> 6) << 4)
            mn[..., j + 4] = (s[..., j + 8] >> 4) | ((s[..., j + 4] >> 6) << 4)
        out["sc"], out["mn"] = sc, mn
        five = qtype == Q.Q5_K  # then 32 bytes of fifth bits first: bit j of byte l, value l of sub-block j
        qs = blk[..., 48 if five else 16:].reshape(n, nb, 4, 32)
        u = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, nb, 8, 32)
        if five:
            u = u | (((blk[..., None, 16:48] >> torch.arange(8)[:, None]) & 1) << 4)
        out["u"] = u.reshape(n, in_features)
    elif qtype == Q.Q6_K:
        ql = blk[..., :128].reshape(n, nb, 2, 64)
        qh = blk[..., 128:192].reshape(n, nb, 2, 32)
        low = torch.stack([ql & 15, ql >> 4], dim=3).reshape(n, nb, 2, 128)
        high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(n, nb, 2, 128)
        out["u"] = (low | (high << 4)).reshape(n, in_features)
        out["sc"] = raw.reshape(n, nb, ts)[..., 192:208].contiguous().view(torch.int8).to(torch.int64)
        out["d"] = _f16(raw.reshape(n, nb, ts)[..., 208:210])
    else:
        raise AssertionError(qtype)
    return out


def _dots(q: torch.Tensor, u: torch.Tensor, unit: int) -> torch.Tensor:
    """[M, N, K / unit] exact integer dot products over each unit of k (float64 is exact here)."""
    m, k = q.shape
    qd = q.double().reshape(m, k // unit, unit)
    ud = u.double().reshape(u.shape[0], k // unit, unit)
    return torch.einsum("mbk,nbk->mnb", qd, ud).round().to(torch.int64)


def quant_linear(x: torch.Tensor, raw: torch.Tensor, qtype: Q, in_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quant.c``'s result, [M, N] float32, from the raw GGUF rows [N, row_bytes]."""
    bk = GGML_QUANT_SIZES[qtype][0]
    q, dx, s16 = quantize_activations(x, bk)
    f = weight_fields(raw, qtype, in_features)
    m, n, nb = x.shape[0], raw.shape[0], in_features // bk
    acc = torch.zeros(m, n)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0):
        dots = _dots(q, f["u"], 32)
        sx = s16.reshape(m, nb, 2).sum(dim=2)                                     # [M, B]
        for b in range(nb):
            s = f["d"][None, :, b] * dx[:, b, None]                                # [M, N] float32
            if qtype == Q.Q4_1:
                t1 = s * dots[:, :, b].to(torch.int32).float()
                t2 = f["m"][None, :, b] * (dx[:, b] * sx[:, b].to(torch.int32).float())[:, None]
                acc = acc + (t1 + t2)
            else:
                off = {Q.Q4_0: 8, Q.Q5_0: 16, Q.Q8_0: 128}[qtype] * sx[:, b, None]
                acc = acc + s * (dots[:, :, b] - off).to(torch.int32).float()
    elif qtype in (Q.Q4_K, Q.Q5_K):
        dots = _dots(q, f["u"], 32).reshape(m, n, nb, 8)
        sx = s16.reshape(m, nb, 8, 2).sum(dim=3)                                  # [M, B, 8]
        isum = (dots * f["sc"][None]).sum(dim=3)                                  # [M, N, B]
        imin = (sx[:, None] * f["mn"][None]).sum(dim=3)
        for b in range(nb):
            t1 = (f["d"][None, :, b] * dx[:, b, None]) * isum[:, :, b].to(torch.int32).float()
            t2 = (f["dmin"][None, :, b] * dx[:, b, None]) * imin[:, :, b].to(torch.int32).float()
            acc = acc + (t1 - t2)
    else:  # Q6_K
        dots = _dots(q, f["u"], 16).reshape(m, n, nb, 16)
        sx = s16.reshape(m, nb, 16)
        isum = ((dots - 32 * sx[:, None]) * f["sc"][None]).sum(dim=3)
        for b in range(nb):
            acc = acc + (f["d"][None, :, b] * dx[:, b, None]) * isum[:, :, b].to(torch.int32).float()
    if bias is not None:
        acc = acc + bias.float()
    return acc
