"""The --device check the command lines share (echo-compile's and its bench's)."""

from __future__ import annotations


def check_device(device: str | None) -> None:
    """A CUDA device asked for where there is none: one clear error instead of torch's assert."""
    if device is None or not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "no CUDA device is visible" if torch.version.cuda else "torch is built without CUDA"
        raise ValueError(f"--device {device}: CUDA is not available ({why}); use --device cpu")
