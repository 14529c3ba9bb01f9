"""Where each checkpoint tensor goes, and the checks on it (``WeightPlacer``): the explicit name
mapping of docs/CONTRACTS.md, one tensor at a time into the materialised parameters:
- ``X`` -> parameter ``X`` (cast to the parameter's dtype: norms may be bf16, fp16 or fp32);
- FP8 ``X.weight`` (e4m3) + ``X.weight_scale_inv`` -> ``X.weight`` dequantised (128x128 blocks),
  or both kept where the module is FP8 (``FP8Linear`` / FP8 experts);
- AWQ ``X.qweight/qzeros/scales`` -> the AWQ module's parameters of the same names;
- ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.S`` -> slice E (gate then up along the output
  axis) of ``mlp.experts.w13_S`` / ``mlp.experts.w2_S``;
- layers ``>= num_hidden_layers`` (MTP) -> kept aside, unconverted.
Every problem raises ``ValueError`` naming the tensor and the file: missing, unexpected, wrong
shape, wrong kind of dtype, FP8 scales that are not finite and >= 0, AWQ scales fp16 would change,
a config.json ``num_hidden_layers`` other than the checkpoint's decoder layers (the MTP layer told
apart by its ``eh_proj``);
FP8 scales that are not powers of two where config.json declares ``scale_fmt: ue8m0`` are one
warning. The shards' reading is ``model.loader.load_weights``'.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from model.config import ModelConfig
from model.fp8_weights import is_ue8m0, weight_dequant_fp8

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_EXPERT = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale_inv|qweight|qzeros|scales)"
)
FP16_MAX = torch.finfo(torch.float16).max  # 65504
FP16_MIN_NORMAL = torch.finfo(torch.float16).tiny  # 2^-14
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: parameter ``param``, optionally expert ``expert`` and
    half ``part`` (0 gate, 1 up) of a stacked ``w13`` parameter."""

    param: str
    expert: int | None = None
    part: int | None = None
    out_axis: int = 0  # the output-features axis of the expert slice (AWQ packs it last)

    @property
    def piece(self) -> tuple[str, int | None, int | None]:
        return (self.param, self.expert, self.part)


def _target(name: str) -> _Target:
    """The parameter (slice) that checkpoint tensor ``name`` loads into."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return _Target(name)
    prefix, e, proj, suffix = m.groups()
    out_axis = 0 if suffix in ("weight", "weight_scale_inv") else -1  # AWQ packs it last
    if proj == "down_proj":
        return _Target(f"{prefix}.w2_{suffix}", int(e), None, out_axis)
    return _Target(f"{prefix}.w13_{suffix}", int(e), 0 if proj == "gate_proj" else 1, out_axis)


def _marked(t: torch.Tensor, bad: torch.Tensor) -> tuple[str, str] | None:
    """For a message about the entries of ``t`` that ``bad`` marks: ("N of its M", "(e.g.
    <the first one> at <its index>)"); None when it marks none."""
    idx = bad.nonzero()
    if not len(idx):
        return None
    i = tuple(idx[0].tolist())
    return f"{len(idx)} of its {t.numel()}", f"(e.g. {t[i].item()!r} at {list(i)})"


def _kind(dtype: torch.dtype) -> str:
    if dtype in FLOAT_DTYPES or dtype == torch.float64:
        return "float"
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    return str(dtype).removeprefix("torch.")


class WeightPlacer:
    """Places the tensors of one checkpoint into the (materialised) parameters of ``model``."""

    def __init__(self, model: nn.Module, config: ModelConfig, path: Path):
        self.config = config
        self.path = path
        # persistent buffers are loaded like parameters (state_dict is exactly what a file holds)
        self.params: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self.loaded: set[tuple[str, int | None, int | None]] = set()
        self.fp8: dict[str, tuple[torch.Tensor | None, torch.Tensor | None, str]] = {}
        self.mtp: dict[str, torch.Tensor] = {}
        # weight scales that break the declared ue8m0 format: reported once, at the end. NOTE: a
        # warning, not an error: official checkpoints that declare ue8m0 are reported to store
        # some non-power-of-two weight scales (o_proj), and dequantisation is exact for any fp32
        # scale, so they load as they are.
        self.non_ue8m0: list[str] = []

    def _where(self, name: str, file: str) -> str:
        return f"tensor {name!r} in {self.path / file}"

    def is_mtp(self, name: str) -> bool:
        lm = _LAYER.match(name)
        return lm is not None and int(lm.group(1)) >= self.config.num_hidden_layers

    def add(self, name: str, t: torch.Tensor, file: str) -> None:
        if self.is_mtp(name):
            self.mtp[name] = t
            return
        module = name.rsplit(".", 1)[0]
        if t.dtype == torch.float8_e4m3fn or name.endswith(".weight_scale_inv"):
            # NOTE: an FP8 weight and its scale may sit in different shards; pair them up first.
            w, s, _ = self.fp8.get(module, (None, None, file))
            if name.endswith(".weight_scale_inv"):
                s = t
            elif name.endswith(".weight"):
                w = t
            else:
                raise ValueError(f"{self._where(name, file)}: FP8 is only supported for weights")
            if w is None or s is None:
                self.fp8[module] = (w, s, file)
                return
            del self.fp8[module]
            held = self.params.get(_target(module + ".weight").param)
            if held is not None and held.dtype == torch.float8_e4m3fn:  # FP8Linear/Experts
                self._check_scales(module, s, file)
                self._copy(module + ".weight", w, file)
                self._copy(module + ".weight_scale_inv", s, file)
                return
            name, t = module + ".weight", self._dequant(module, w, s, file)
        self._copy(name, t, file)

    def _dequant(self, module: str, w: torch.Tensor, s: torch.Tensor, file: str) -> torch.Tensor:
        self._check_scales(module, s, file)
        try:
            return weight_dequant_fp8(w, s)
        except ValueError as e:
            raise ValueError(f"{self._where(module + '.weight_scale_inv', file)}: {e}") from e

    def _check_scales(self, module: str, s: torch.Tensor, file: str) -> None:
        if s.dtype != torch.float32:
            raise ValueError(
                f"{self._where(module + '.weight_scale_inv', file)}: dtype {s.dtype}, "
                "expected float32"
            )
        where = self._where(module + ".weight_scale_inv", file)
        # a NaN scale made a NaN model silently (0 is let be: an all-zero block's amax / 448)
        if bad := _marked(s, ~(torch.isfinite(s) & (s >= 0))):
            raise ValueError(f"{where}: {bad[0]} scales are not finite and >= 0 {bad[1]}")
        q = self.config.quantization
        if q is not None and q.scale_fmt == "ue8m0":
            bad = _marked(s, ~is_ue8m0(s))
            if bad and not self.non_ue8m0:
                self.non_ue8m0.append(f"{where}: {bad[0]} scales are not powers of two {bad[1]}")
            elif bad:
                self.non_ue8m0.append(module)

    def _copy(self, name: str, t: torch.Tensor, file: str) -> None:
        tgt = _target(name)
        p = self.params.get(tgt.param)
        if p is None:
            self._unexpected(name, file)
        if tgt.piece in self.loaded:
            raise ValueError(f"{self._where(name, file)}: loaded twice")
        dest = p.data
        if tgt.expert is not None:
            if tgt.expert >= dest.shape[0]:
                raise ValueError(
                    f"unexpected {self._where(name, file)}: expert {tgt.expert} but "
                    f"{tgt.param!r} holds {dest.shape[0]} experts"
                )
            dest = dest[tgt.expert]
            if tgt.part is not None:
                half = dest.shape[tgt.out_axis] // 2
                dest = dest.narrow(tgt.out_axis, tgt.part * half, half)
        if tuple(t.shape) != tuple(dest.shape):
            raise ValueError(
                f"{self._where(name, file)}: shape {list(t.shape)}, but {tgt.param!r} "
                f"expects {list(dest.shape)}"
            )
        if _kind(t.dtype) != _kind(dest.dtype):
            raise ValueError(
                f"{self._where(name, file)}: dtype {t.dtype} cannot load into {tgt.param!r} "
                f"of dtype {dest.dtype}"
            )
        if name.endswith(".scales") and dest.dtype == torch.float16:  # AWQ's
            self._check_awq_scales(name, t, file)
        with torch.no_grad():
            dest.copy_(t)
        self.loaded.add(tgt.piece)

    def _check_awq_scales(self, name: str, t: torch.Tensor, file: str) -> None:
        """AWQ scales are held as fp16 (the kernels' format). A scale that is not finite, or,
        from a bf16 or fp32 file, one fp16 would make inf (above 65504) or hold inexactly below
        its normal range (under 2^-14, where fp16 keeps fewer bits), would load changed without a
        word: a NaN model, inf, or a scale that lost its digits. Above 2^-14 bf16 scales are
        exact in fp16, and fp32 ones round to its 11 bits (2^-11 relative at most, far below the
        4-bit weights' own error)."""
        bad = ~torch.isfinite(t)
        if t.dtype != torch.float16:
            a = t.float().abs()
            inexact = t.to(torch.float16).to(t.dtype) != t
            bad |= (a > FP16_MAX) | ((a < FP16_MIN_NORMAL) & inexact)
        if some := _marked(t, bad):
            raise ValueError(
                f"{self._where(name, file)}: {some[0]} {t.dtype} AWQ scales would change as fp16, "
                f"the AWQ kernels' scales: not finite, above {FP16_MAX:g}, or below "
                f"{FP16_MIN_NORMAL:.3g} and not an fp16 value {some[1]}"
            )

    def _unexpected(self, name: str, file: str) -> None:
        hint = ""
        module = name.rsplit(".", 1)[0]
        siblings = sorted(k for k in self.params if k.rsplit(".", 1)[0] == module)
        if siblings:
            hint = f" (the model holds {', '.join(siblings)} there)"
        raise ValueError(
            f"unexpected {self._where(name, file)}: the model has no parameter "
            f"{_target(name).param!r}{hint}"
        )

    def finish(self, index: str) -> None:
        """Raise for FP8 halves without partner and parameters never (fully) loaded; warn once
        for weight scales that break the declared ue8m0 format."""
        if self.non_ue8m0:
            warnings.warn(
                f"config.json declares scale_fmt 'ue8m0' (power-of-two scales), but "
                f"{len(self.non_ue8m0)} weight_scale_inv tensor(s) are not: first "
                f"{self.non_ue8m0[0]}; loaded as stored (dequantisation is exact for any scale)",
                stacklevel=3,
            )
        for module, (_, s, file) in self.fp8.items():
            if s is None:
                raise ValueError(
                    f"missing tensor '{module}.weight_scale_inv' (its FP8 weight is in "
                    f"{self.path / file})"
                )
            if _target(module + ".weight").piece in self.loaded:
                raise ValueError(
                    f"unexpected {self._where(module + '.weight_scale_inv', file)}: "
                    f"'{module}.weight' is not FP8"
                )
            raise ValueError(
                f"missing tensor '{module}.weight' (its weight_scale_inv is in {self.path / file})"
            )
        self._raise_missing(self.loaded, index)

    def check_names(self, files: dict[str, list[str]], fp8: set[str], index: str) -> None:
        """Before any tensor is read, from the shards' names (``fp8``: those stored as e4m3)
        alone: an FP8 weight or scale without its partner, or parameters no tensor provides,
        fail in seconds instead of after every shard was read (minutes on V3.2)."""
        self._check_layer_count(files)
        where = {n: f for f, names in files.items() for n in names if not self.is_mtp(n)}
        covered: set[tuple[str, int | None, int | None]] = set()
        for name, file in where.items():
            module = name.rsplit(".", 1)[0]
            if name.endswith(".weight_scale_inv"):
                if module + ".weight" not in where:
                    raise ValueError(
                        f"missing tensor '{module}.weight' (its weight_scale_inv is in "
                        f"{self.path / file})"
                    )
                covered.add(_target(module + ".weight").piece)
            elif _target(name).param not in self.params:
                self._unexpected(name, file)  # e.g. AWQ tensors, config.json not saying AWQ
            elif name in fp8 and module + ".weight_scale_inv" not in where:
                raise ValueError(
                    f"missing tensor '{module}.weight_scale_inv' (its FP8 weight is in "
                    f"{self.path / file})"
                )
            covered.add(_target(name).piece)
        self._raise_missing(covered, index)

    def _check_layer_count(self, files: dict[str, list[str]]) -> None:
        """config.json's ``num_hidden_layers`` against the checkpoint's layers: an MTP layer (the
        one with an ``eh_proj``) is the first layer past the decoder layers. NOTE: a count one
        short loaded silently, the last decoder layer kept aside as if it were the MTP layer (a
        checkpoint without its MTP layer: nothing else missing, a wrong model); one too many
        was an "unexpected tensor" of the MTP layer that named no config field."""
        n = self.config.num_hidden_layers
        first: dict[int, tuple[str, str]] = {}  # layer -> (its first tensor, its file)
        mtp: dict[int, tuple[str, str]] = {}  # MTP layer -> (its eh_proj tensor, its file)
        for file, names in files.items():
            for name in names:
                if (lm := _LAYER.match(name)) is None:
                    continue
                layer = int(lm.group(1))
                first.setdefault(layer, (name, file))
                if name.startswith(f"model.layers.{layer}.eh_proj."):
                    mtp.setdefault(layer, (name, file))
        field = f"config.json field 'num_hidden_layers' is {n}"
        for layer in sorted(first):
            if layer >= n and layer not in mtp:
                name, file = first[layer]
                raise ValueError(
                    f"{field}, but the checkpoint has a decoder layer {layer} (e.g. "
                    f"{self._where(name, file)}; it has no eh_proj, so it is not an MTP layer): "
                    "num_hidden_layers must count every decoder layer"
                )
            if layer < n and layer in mtp:
                name, file = mtp[layer]
                raise ValueError(
                    f"{field}, but layer {layer} of the checkpoint is an MTP layer "
                    f"({self._where(name, file)}): num_hidden_layers must count the decoder "
                    "layers only"
                )

    def _raise_missing(self, loaded: set[tuple[str, int | None, int | None]], index: str) -> None:
        missing: list[str] = []
        for name, p in self.params.items():
            m = re.fullmatch(r"(.*\.mlp\.experts)\.(w13|w2)_(\w+)", name)
            if m is None:
                if (name, None, None) not in loaded:
                    missing.append(name)
                continue
            prefix, which, suffix = m.groups()
            parts = ((0, "gate_proj"), (1, "up_proj")) if which == "w13" else ((None, "down_proj"),)
            for e in range(p.shape[0]):
                for part, proj in parts:
                    if (name, e, part) not in loaded:
                        missing.append(f"{prefix}.{e}.{proj}.{suffix}")
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(
                f"missing tensor(s) in {self.path / index}: {', '.join(missing[:8])}{more} "
                "(parameters the checkpoint never provided)"
            )
