"""Host KV pool allocation: one ``[N_H, row]`` uint8 tensor per layer.

- CPU: an ordinary tensor (CI runs the engine this way; the mechanism is the same).
- CUDA with offloading: pinned host memory that GPU kernels read and write directly (UVA). We
  allocate it with ``cudaHostAlloc(Mapped | Portable)`` through cuda.bindings rather than
  ``torch.empty(pin_memory=True)``, whose caching host allocator rounds every block up to a power
  of two (a 45 GiB pool would pin 64 GiB). The tensor handed out is CUDA-typed, built from the
  mapped device pointer through ``__cuda_array_interface__``: under torch.compile a CPU tensor in
  the graph would stop CUDA-graph capture. Each layer gets its own allocation (one base tensor per
  layer: views of one shared base make Inductor clone the whole base, docs/graph_notes.md).
- CUDA without offloading: device memory (the GPU-only policy).

The pool is sized once at start; a request for more memory than the machine has fails here with
the byte count, instead of an opaque allocator error (or the OOM killer) later.
"""

from __future__ import annotations

import ctypes
import os

import torch


def _host_memory_limit() -> int:
    """Physical memory, lowered to the cgroup limit when a container sets one."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def _check_size(num_layers: int, n_tokens: int, row_bytes: int, available: int, where: str) -> int:
    if num_layers <= 0 or n_tokens <= 0 or row_bytes <= 0:
        raise ValueError(
            f"host KV pool: num_layers, n_tokens and row_bytes must be positive, got "
            f"{num_layers}, {n_tokens}, {row_bytes}"
        )
    total = num_layers * n_tokens * row_bytes
    if total > available:
        raise ValueError(
            f"host KV pool: {num_layers} layers x {n_tokens} tokens x {row_bytes} B = {total} "
            f"bytes ({total / 2**30:.2f} GiB) asked for, but {where} has only {available} bytes "
            f"({available / 2**30:.2f} GiB); lower host_tokens (--host-tokens)"
        )
    return total


class PinnedRows:
    """One layer's pinned, device-mapped host rows. ``cuda()`` is the CUDA-typed view kernels use;
    ``cpu()`` a CPU view of the same bytes. Both keep this object (and so the memory) alive."""

    def __init__(self, n_tokens: int, row_bytes: int, device: torch.device, zero: bool = True):
        from cuda.bindings import runtime as cudart  # lazily: only CUDA machines need it

        self._cudart = cudart
        self.shape = (n_tokens, row_bytes)
        self.nbytes = n_tokens * row_bytes
        self.device = device
        flags = cudart.cudaHostAllocMapped | cudart.cudaHostAllocPortable
        with torch.cuda.device(device):
            err, ptr = cudart.cudaHostAlloc(self.nbytes, flags)
            if err != cudart.cudaError_t.cudaSuccess:
                raise ValueError(
                    f"host KV pool: cudaHostAlloc of {self.nbytes} bytes "
                    f"({self.nbytes / 2**30:.2f} GiB) failed: {err}; lower host_tokens "
                    "(--host-tokens)"
                )
            self.ptr = int(ptr)
            err, dptr = cudart.cudaHostGetDevicePointer(self.ptr, 0)
            if err != cudart.cudaError_t.cudaSuccess:
                cudart.cudaFreeHost(self.ptr)
                raise RuntimeError(f"cudaHostGetDevicePointer failed: {err}")
        self.dptr = int(dptr)
        if zero:
            ctypes.memset(self.ptr, 0, self.nbytes)
        # Read by torch.as_tensor(self, device="cuda"); torch keeps a reference to self.
        self.__cuda_array_interface__ = {
            "shape": self.shape,
            "typestr": "|u1",
            "data": (self.dptr, False),
            "strides": None,
            "version": 3,
        }

    def cuda(self) -> torch.Tensor:
        return torch.as_tensor(self, device=self.device)

    def cpu(self) -> torch.Tensor:
        buf = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        t = torch.frombuffer(buf, dtype=torch.uint8).view(self.shape)
        t._echo_pinned_owner = self  # keep the allocation alive as long as the view
        return t

    def __del__(self) -> None:
        ptr = getattr(self, "ptr", 0)
        if ptr:
            self._cudart.cudaFreeHost(ptr)
            self.ptr = 0


def allocate_host_rows(
    num_layers: int,
    n_tokens: int,
    row_bytes: int,
    device: torch.device,
    pinned: bool,
    zero: bool = True,
) -> list[torch.Tensor]:
    """``num_layers`` separate uint8 ``[n_tokens, row_bytes]`` tensors (see the module docstring).
    ``zero=False`` skips clearing pinned memory (a startup cost of a few seconds per 10 GB)."""
    device = torch.device(device)
    check_host_rows(num_layers, n_tokens, row_bytes, device, pinned)
    if device.type != "cuda":
        return [torch.zeros(n_tokens, row_bytes, dtype=torch.uint8) for _ in range(num_layers)]
    if not pinned:
        return [
            torch.zeros(n_tokens, row_bytes, dtype=torch.uint8, device=device)
            for _ in range(num_layers)
        ]
    return [PinnedRows(n_tokens, row_bytes, device, zero).cuda() for _ in range(num_layers)]


def check_host_rows(
    num_layers: int, n_tokens: int, row_bytes: int, device: torch.device, pinned: bool
) -> None:
    """``allocate_host_rows``'s refusal, which ``LLM`` also runs before it reads a weight: a
    ValueError with the byte count when the rows cannot fit the memory they would live in (the
    host's, or the GPU's free memory for the GPU-only pool)."""
    device = torch.device(device)
    if device.type == "cuda" and not pinned:
        free, _ = torch.cuda.mem_get_info(device)
        _check_size(num_layers, n_tokens, row_bytes, free, f"{device} (free memory)")
    else:
        _check_size(num_layers, n_tokens, row_bytes, _host_memory_limit(), "this machine")
