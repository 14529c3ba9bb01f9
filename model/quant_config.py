"""QuantConfig: a checkpoint's ``quantization_config`` block, parsed and checked.

The official FP8 checkpoints' block format (e4m3, 128x128 weight blocks, ``scale_fmt`` ue8m0,
dynamic activation scales) and AutoAWQ "gemm" checkpoints (4 bits, groups of 128, zero points);
anything else raises ``ValueError`` naming the field. ``ModelConfig.from_dict`` (model/config.py)
reads the block through ``QuantConfig.from_dict``; docs/quantization.md describes the formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.config_fields import expect


@dataclass(frozen=True)
class QuantConfig:
    """``quantization_config``: ``fp8`` (official, 128x128 blocks) or ``awq`` (AutoAWQ gemm)."""

    method: str  # "fp8" | "awq"
    weight_block_size: tuple[int, int] = (128, 128)  # fp8
    scale_fmt: str | None = None  # fp8: "ue8m0" => power-of-two activation scales
    bits: int = 4  # awq
    group_size: int = 128  # awq
    zero_point: bool = True  # awq
    version: str = "gemm"  # awq
    modules_to_not_convert: tuple[str, ...] = ()  # awq, matched as substrings

    @staticmethod
    def from_dict(d: dict[str, Any]) -> QuantConfig:
        method = d.get("quant_method")
        if method == "fp8":
            if d.get("fmt", "e4m3") != "e4m3":
                raise ValueError(
                    f"quantization_config.fmt: only 'e4m3' is supported, got {d['fmt']!r}"
                )
            block = d.get("weight_block_size", (128, 128))
            expect(isinstance(block, (list, tuple)), "quantization_config.weight_block_size",
                    "a list [128, 128]", block)  # fmt: skip
            block = tuple(block)
            if block != (128, 128):
                raise ValueError(
                    "quantization_config.weight_block_size: only [128, 128] is supported, "
                    f"got {list(block)}"
                )
            # NOTE: an unknown scale_fmt would silently serve non-power-of-two activation scales;
            # static activation scales (input_scale tensors) are not implemented
            scale_fmt = d.get("scale_fmt")
            if scale_fmt not in (None, "ue8m0"):
                raise ValueError(
                    "quantization_config.scale_fmt: expected 'ue8m0' or absent, "
                    f"got {scale_fmt!r}"
                )
            scheme = d.get("activation_scheme", "dynamic")
            if scheme not in (None, "dynamic"):
                raise ValueError(
                    "quantization_config.activation_scheme: only 'dynamic' is supported, "
                    f"got {scheme!r}"
                )
            return QuantConfig(method="fp8", weight_block_size=block, scale_fmt=scale_fmt)
        if method == "awq":
            bits = d.get("bits", d.get("w_bit"))
            group = d.get("group_size", d.get("q_group_size"))
            version = str(d.get("version", "gemm")).lower()
            zero = d.get("zero_point", True)
            if bits != 4:
                raise ValueError(
                    f"quantization_config.bits: only 4-bit AWQ is supported, got {bits!r}"
                )
            if group != 128:
                raise ValueError(
                    f"quantization_config.group_size: only 128 is supported, got {group!r}"
                )
            if version != "gemm":
                raise ValueError(
                    "quantization_config.version: only the 'gemm' AWQ layout is supported, "
                    f"got {version!r}"
                )
            if zero is not True:
                raise ValueError(
                    "quantization_config.zero_point: only zero_point=true AWQ is supported, "
                    f"got {zero!r}"
                )
            skip = d.get("modules_to_not_convert") or ()
            ok = isinstance(skip, (list, tuple)) and all(isinstance(m, str) for m in skip)
            expect(ok, "quantization_config.modules_to_not_convert", "a list of strings", skip)
            return QuantConfig(
                method="awq",
                bits=4,
                group_size=128,
                zero_point=True,
                version="gemm",
                modules_to_not_convert=tuple(skip),
            )
        raise ValueError(
            f"quantization_config.quant_method: expected 'fp8' or 'awq', got {method!r}"
        )

    def to_dict(self) -> dict[str, Any]:
        if self.method == "fp8":
            d: dict[str, Any] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": list(self.weight_block_size),
            }
            if self.scale_fmt is not None:
                d["scale_fmt"] = self.scale_fmt
            return d
        return {
            "quant_method": "awq",
            "bits": self.bits,
            "group_size": self.group_size,
            "version": self.version,
            "zero_point": self.zero_point,
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }

    def awq_skips(self, module_name: str) -> bool:
        """True when an AWQ checkpoint keeps ``module_name`` in 16-bit (substring match)."""
        return any(s in module_name for s in self.modules_to_not_convert)
