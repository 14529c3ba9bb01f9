"""``echo::fp8_linear``: a linear with FP8 block-scaled weights computed in FP8, as the DeepSeek
reference's ``linear`` does with ``gemm_impl="fp8"`` (docs/model_notes.md, FP8 checkpoints).

Weights: ``w8 float8_e4m3fn [N, K]`` and ``w_scale fp32 [ceil(N/128), K/128]`` (the checkpoint's
``weight_scale_inv``): ``W[n, k] = w8[n, k] * w_scale[n // 128, k // 128]``. Activations are
quantised per row and block of 128 along K (DeepSeek's ``act_quant``): ``amax = max(|x|, 1e-4)``,
``s = amax / 448`` (``ue8m0``: rounded up to a power of two, computed on the bits as DeepSeek's
kernel does: exact), ``x8 = e4m3(clamp(x / s, ±448))``. Then
``y[m, n] = sum_kb (x8[m, kb] . w8[n, kb]) * s[m, kb] * w_scale[n // 128, kb]``: one fp32 dot per
K block of 128, scaled and summed in fp32 (DeepSeek's ``fp8_gemm``), rounded once to bf16.

The reference below is that formula in plain torch (the CPU kernel). On CUDA both ops run
DeepGEMM's block-scaled GEMMs (``custom_ops/backends/deep_gemm_gemm.py``: ``echo::dg_fp8_linear``,
``echo::dg_moe_fp8``) where the library imports on an SM90 device and the shape suits, except
where ``triton_first`` / ``moe_triton_first`` say the Triton kernels (``fp8_linear_kernels.py``)
are faster; Triton everywhere else. ``set_fp8_backend("triton")`` (or
``ECHO_FP8_BACKEND=triton``) keeps Triton everywhere.
"""

from __future__ import annotations

import os

import torch

from custom_ops.fp8_linear_ref import (  # noqa: F401  (the references live there; re-exported)
    act_quant_exact,
    fp8_linear_ref,
    moe_fp8_ref,
    round_up_pow2,
)

FP8_BACKENDS = ("auto", "triton")  # auto: DeepGEMM where it runs and the shape suits
_backend = os.environ.get("ECHO_FP8_BACKEND", "auto")


def set_fp8_backend(name: str) -> None:
    """The CUDA backend of ``echo::fp8_linear`` / ``echo::moe_fp8`` for this process (set before
    a step is captured: the choice is made when the op runs, so a graph keeps the one it saw)."""
    global _backend
    if name not in FP8_BACKENDS:
        raise ValueError(f"fp8 backend must be one of {', '.join(FP8_BACKENDS)}; got {name!r}")
    _backend = name


def fp8_backend() -> str:
    return _backend


def _kernels():
    from custom_ops import fp8_linear_kernels

    return fp8_linear_kernels


_dg_failed: set[tuple] = set()  # shapes where a DeepGEMM call raised: Triton serves them


def _dg():
    """DeepGEMM's ops module if ``auto`` may use it on this process's device, else None."""
    if _backend != "auto":
        return None
    from custom_ops.backends import deep_gemm_gemm as dg

    return dg if dg.available(torch.cuda.current_device()) else None


def _try_dg(key: tuple, call):
    """``call()`` (a DeepGEMM op), or None after warning once if DeepGEMM refuses this shape (a
    build's host assert, a JIT that cannot compile: ValueError / RuntimeError): the caller then
    runs Triton. Anything else propagates: a CUDA error (the context is dead, Triton cannot
    serve), a failure while a CUDA graph is being captured (the eager warm-up calls before
    capture find a refused shape), a programming error (e.g. a name the wheel lacks)."""
    if key in _dg_failed:
        return None
    try:
        return call()
    except (ValueError, RuntimeError, NotImplementedError) as e:
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        # out of memory is no refusal of the shape: recording it would slow it down for good
        if "CUDA error" in str(e) or capturing or isinstance(e, torch.OutOfMemoryError):
            raise
        import warnings

        _dg_failed.add(key)
        warnings.warn(f"fp8: DeepGEMM refused {key} ({e!r}); Triton serves it", stacklevel=2)
        return None


@torch.library.custom_op("echo::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool
) -> torch.Tensor:
    """``x [M, K] -> [M, N]`` (x's 16-bit dtype; bf16 for fp32 x) with FP8 block-scaled weights;
    the reference by default, Triton on CUDA."""
    return fp8_linear_ref(x, w8, w_scale, ue8m0)


def triton_first(m: int, n: int, k: int) -> bool:
    """Linears where the Triton kernel beats DeepGEMM: a deep weight (K >= 4096) with at most 4
    tokens, or with at most 16 on a narrow one (N <= 2048: the MLA's down projections, the
    shared expert's), where DeepGEMM has few output tiles and no split-K. Measured on the H200
    (``bench_fp8``, docs/quantization.md, calls 2 and 3 of ``gpu_session17``): at M = 1-16 on
    7168 x 2048 and 7168 x 576 Triton took 10.8-12.0 and 7.6-8.2 µs against DeepGEMM's
    12.4-16.7 and 11.7-12.2; at M = 1-4 on 7168 x 4096 16.9-17.3 against 18.0-18.9, on
    16384 x 7168 40.4-41.8 against 40.7-42.8 (a margin inside one configuration's run-to-run
    spread there); DeepGEMM won the wider shapes from M = 8 and 2048 x 7168 at every M."""
    return k >= 4096 and (m <= 4 or (m <= 16 and n <= 2048))


@fp8_linear.register_kernel("cuda")
def _(x, w8, w_scale, ue8m0):
    dg = _dg()
    m, n, k = x.shape[0], *w8.shape
    if dg is not None and not triton_first(m, n, k) and dg.linear_suits(m, n, k, x.dtype):
        key = ("linear", m, n, k)
        y = _try_dg(key, lambda: dg.dg_fp8_linear(x, w8, w_scale, ue8m0))
        if y is not None:
            return y
    return _kernels().fp8_linear_triton(x, w8, w_scale, ue8m0)


@fp8_linear.register_fake
def _(x, w8, w_scale, ue8m0):
    dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    return x.new_empty((x.shape[0], w8.shape[0]), dtype=dtype)


# ---- echo::moe_fp8 ---------------------------------------------------------------------------


@torch.library.custom_op("echo::moe_fp8", mutates_args=())
def moe_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    ue8m0: bool,
) -> torch.Tensor:
    """Routed experts with FP8 block-scaled weights: ``x [T, D] -> fp32 [T, D]``; the reference
    by default, Triton on CUDA (grouped by expert on the device, gate and up fused)."""
    return moe_fp8_ref(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0)


def moe_triton_first(pairs: int, n_experts: int) -> bool:
    """MoE calls the Triton kernel serves before DeepGEMM: at most 8 (token, expert) pairs per
    expert. H200 (docs/quantization.md, "FP8 on the H200"), Triton against DeepGEMM's masked
    GEMM: 256 experts, T = 1-64 (at most 2 an expert), 129.6-2542.0 µs against 165.7-2609.4;
    32 and 16 experts, 2-8 an expert, Triton 4-7% faster (32 experts at T = 32: 383.1 against
    408.2 µs; 16 at T = 16: 208.7 against 220.1); 16-32 an expert DeepGEMM 11-35% faster (32
    experts at T = 64: 425.3 against 473.0; 16 at T = 32 / 64: 230.7 / 246.2 against 291.5 /
    333.3). The crossover lies between 8 and 16 an expert. Not separated by this count: one pair
    an expert on 32 experts (T = 4), where DeepGEMM was 11% faster."""
    return pairs <= 8 * n_experts


@moe_fp8.register_kernel("cuda")
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0):
    dg = _dg()
    t, e = x.shape[0], w13.shape[0]
    if (
        dg is not None
        and not moe_triton_first(topk_ids.numel(), e)
        and dg.moe_suits(t, w13.shape[2], w2.shape[2], x.dtype)
    ):
        args = (x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0)
        y = _try_dg(("moe", t, *w13.shape), lambda: dg.dg_moe_fp8(*args))
        if y is not None:
            return y
    return _kernels().moe_fp8_triton(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0)


@moe_fp8.register_fake
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0):
    return x.new_empty(x.shape, dtype=torch.float32)
