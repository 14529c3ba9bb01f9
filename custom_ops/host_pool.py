"""Host KV pool allocation: one ``[N_H, row]`` uint8 tensor per layer.

On CPU an ordinary tensor (the mechanism is the same, only the memory differs). On CUDA with
offloading, pinned host memory that GPU kernels read and write directly (UVA), exposed as a
CUDA-typed tensor. On CUDA without offloading, device memory (the GPU-only policy).
"""

from __future__ import annotations

import torch


def allocate_host_rows(
    num_layers: int, n_tokens: int, row_bytes: int, device: torch.device, pinned: bool
) -> list[torch.Tensor]:
    if device.type != "cuda":
        return [torch.zeros(n_tokens, row_bytes, dtype=torch.uint8) for _ in range(num_layers)]
    if not pinned:
        return [
            torch.zeros(n_tokens, row_bytes, dtype=torch.uint8, device=device) for _ in range(num_layers)
        ]
    raise NotImplementedError("pinned UVA host pool: being written (custom_ops/host_pool.py)")
