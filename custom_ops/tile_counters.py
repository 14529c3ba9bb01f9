"""The tile counters of the split-K kernels that sum their partials in their last program (the
W4A16 pair linear and MoE, the Triton kernels of ``echo::fp8_linear`` and ``echo::moe_fp8``): one
int32 buffer per device, zeros before and after every launch, since each tile's last program
resets its counter."""

from __future__ import annotations

import torch

_COUNTERS: dict = {}
COUNTERS = 1 << 16  # tiles per launch the counter buffer holds (decode needs a few hundred)


def reserve_counters(device: torch.device) -> torch.Tensor:
    """Make the device's tile counters of the fused split-K reductions now: zeros, and zeros
    again after every launch (its last programs reset them), so one buffer serves every call on
    the device's stream (two streams must not run these kernels at once). The loaders call this
    for every CUDA model (``model.loader.finish_loaded_model``): made during a
    ``torch.compile(mode="reduce-overhead")`` warm-up it would live in the CUDA-graph memory
    pool, which later graphs may reuse."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def counters(device: torch.device, n: int) -> torch.Tensor:
    """The counters of ``n`` tiles (made here for a direct call of the op; never regrown: a
    graph captured earlier holds the buffer's address)."""
    if n > COUNTERS:
        raise ValueError(
            f"split-K kernels: {n} counter tiles (split-K or k-sum) in one launch, "
            f"at most {COUNTERS}"
        )
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if device not in _COUNTERS and capturing:
        raise RuntimeError("split-K kernels: reserve_counters(device) before CUDA-graph capture")
    return reserve_counters(device)
