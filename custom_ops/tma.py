"""Tensor descriptors for the kernels' ``TMA`` loads (Hopper's tensor memory accelerator: one
bulk copy a tile, issued by one thread, in place of every thread's ``cp.async`` and its address
arithmetic). A descriptor needs its base and every row stride 16-byte aligned; rows and columns
past the tensor's shape load as zeros."""

from __future__ import annotations

import torch


def _aligned(t: torch.Tensor, strides: list[int]) -> bool:
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in strides[:-1])


def activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when a descriptor can cover it, else a contiguous copy that can (activations
    are small; weights are never copied: ``descriptor`` raises)."""
    if _aligned(x, list(x.stride())) and x.stride(-1) == 1:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def descriptor(name: str, t: torch.Tensor, block: list[int], shape: list[int] | None = None):
    """A descriptor of ``t`` (or of contiguous ``t`` viewed as ``shape``, row-major) in ``block``
    tiles; ValueError naming ``name`` unless it is 16-byte aligned."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if shape is None:
        shape, strides = list(t.shape), list(t.stride())
    elif t.is_contiguous():
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
    else:
        raise ValueError(f"{name}: a TMA view {shape} needs a contiguous tensor")
    if not _aligned(t, strides):
        raise ValueError(
            f"{name}: TMA needs a 16-byte aligned base and row strides, got {list(t.shape)} "
            f"{t.dtype} at {t.data_ptr() % 16} (mod 16) with strides {strides}"
        )
    return TensorDescriptor(t, shape, strides, block)


def supported(device: torch.device) -> bool:
    """TMA runs here: a Hopper or newer GPU (sm_90+), or the CPU's Triton interpreter. A rule
    that takes it elsewhere (an A100) falls back to the pointer loads."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9
