"""AWQ 4-bit weights in the AutoAWQ "gemm" format (docs/model_notes.md): packing, round-to-nearest
quantisation and dequantisation, plain torch. The checkpoint generator (model/checkpoint.py)
writes ``awq_quantize(weight [out, in])``; the modules of model/awq.py quantise a dense weight
with it and dequantise theirs with ``awq_dequantize``.

Format for a linear with in=K, out=N and groups of 128 along K:
``qweight int32 [K, N/8]``, ``qzeros int32 [K/128, N/8]`` (same packing), ``scales fp16|bf16
[K/128, N]``; nibble i (bits 4i..4i+3) of word c holds column ``8c + AWQ_ORDER[i]``,
``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``. ``W^T[k, n] = (q[k, n] - z[k//128, n]) * s[k//128, n]``
and ``y = x @ W^T``: the checkpoint is [in, out], the transpose of ``nn.Linear.weight``.
"""

from __future__ import annotations

import torch

from custom_ops.awq import awq_dequantize_t
from custom_ops.awq_format import AWQ_ORDER, GROUP, PACK


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """4-bit integers ``[..., K, N]`` (0..15) -> int32 words ``[..., K, N/8]`` in AWQ order."""
    n = values.shape[-1]
    if n % PACK:
        raise ValueError(f"awq_pack: the last dim ({n}) must be a multiple of {PACK}")
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise ValueError(f"awq_pack: values must be an integer tensor, got {values.dtype}")
    v = values.to(torch.int64)
    if v.numel() and (v.min() < 0 or v.max() > 15):
        raise ValueError(f"awq_pack: values must lie in 0..15, got [{v.min()}, {v.max()}]")
    v = v.unflatten(-1, (n // PACK, PACK))  # [..., K, N/8, 8]
    word = torch.zeros(v.shape[:-1], dtype=torch.int64, device=v.device)
    for i, ch in enumerate(AWQ_ORDER):
        word |= v[..., ch] << (4 * i)
    # [0, 2^32) -> the int32 with the same bits (words with nibble 7 >= 8 are negative)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def awq_quantize(
    weight: torch.Tensor, scales_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit quantisation of ``weight [out, in]`` per group of 128
    along ``in`` -> ``(qweight [in, out/8], qzeros [in/128, out/8], scales [in/128, out])``.

    The range of each group is widened to contain 0 (so the zero point is a 4-bit integer) and the
    scale is rounded *up* to ``scales_dtype``; then every element satisfies ``|w - w_hat| <= s/2``.
    """
    if weight.dim() != 2:
        raise ValueError(f"awq_quantize: weight must be 2-D [out, in], got {list(weight.shape)}")
    n, k = weight.shape
    if k % GROUP or n % PACK:
        raise ValueError(
            f"awq_quantize: need in % {GROUP} == 0 and out % {PACK} == 0, got [out={n}, in={k}]"
        )
    if scales_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"awq_quantize: scales_dtype must be float16 or bfloat16, got {scales_dtype}"
        )
    w = weight.float().t().reshape(k // GROUP, GROUP, n)  # [G, 128, N]
    wmax = w.amax(dim=1).clamp_min(0)  # [G, N]
    wmin = w.amin(dim=1).clamp_max(0)
    fi = torch.finfo(scales_dtype)
    # NOTE: divided by a device tensor, not a Python number: CUDA divides by a host scalar as a
    # multiply by its reciprocal (not correctly rounded), so GPU-quantised scales would differ in
    # the last bit from a CPU-written checkpoint's
    s = ((wmax - wmin) / torch.tensor(15.0, device=w.device)).clamp_min(fi.tiny)
    # NOTE: times (1 + eps) before round-to-nearest gives a stored scale >= s: the 16 levels cover
    # [wmin, wmax], so only the clamp of a .5 tie can touch 0 or 15 (still within s/2).
    scales = (s * (1 + fi.eps)).to(scales_dtype)  # [G, N]
    sf = scales.float()
    z = (-torch.round(wmin / sf)).clamp(0, 15)  # [G, N]
    q = (torch.round(w / sf.unsqueeze(1)) + z.unsqueeze(1)).clamp(0, 15)  # [G, 128, N]
    qweight = awq_pack(q.reshape(k, n).to(torch.int32))
    return qweight, awq_pack(z.to(torch.int32)), scales


def awq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The ``nn.Linear`` weight ``[..., out, in]`` in ``dtype`` (one rounding of the exact fp32
    values). Leading dims (experts) are kept. ``awq_dequantize_t`` gives fp32 ``[..., in, out]``."""
    return awq_dequantize_t(qweight, qzeros, scales).transpose(-1, -2).contiguous().to(dtype)
