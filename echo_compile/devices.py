"""The device check the command lines (echo-compile's and its bench's) and the Python API share."""

from __future__ import annotations


def check_device(device: str | None, python: bool = False) -> None:
    """A CUDA device asked for where there is none: one clear error instead of torch's assert
    (``python``: name the option as the Python API spells it, else as the command line)."""
    if device is None or not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "no CUDA device is visible" if torch.version.cuda else "torch is built without CUDA"
        asked, cpu = (
            (f"device={device!r}", "device='cpu'")
            if python
            else (f"--device {device}", "--device cpu")
        )
        raise ValueError(f"{asked}: CUDA is not available ({why}); use {cpu}")
