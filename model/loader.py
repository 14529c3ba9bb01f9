"""Load a Hugging Face DeepSeek-V3.2 checkpoint directory into ``DeepseekV32ForCausalLM``.

The model is built on the meta device, materialised on the target device, and every checkpoint
tensor is placed by an explicit name mapping (docs/CONTRACTS.md), shard by shard:
- ``X`` -> parameter ``X`` (cast to the parameter's dtype: norms may be bf16, fp16 or fp32);
- FP8 ``X.weight`` (e4m3) + ``X.weight_scale_inv`` -> ``X.weight`` dequantised (128x128 blocks);
- AWQ ``X.qweight/qzeros/scales`` -> the AWQ module's parameters of the same names;
- ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.S`` -> slice E (gate then up along the output
  axis) of ``mlp.experts.w13_S`` / ``mlp.experts.w2_S``;
- layers ``>= num_hidden_layers`` (MTP) -> kept aside, unconverted, in ``LoadExtras.mtp``.
Every problem raises ``ValueError`` naming the tensor and the file: missing, unexpected, wrong
shape, wrong kind of dtype, a shard the index names that is not there, FP8 scales that are not
powers of two where config.json declares ``scale_fmt: ue8m0``.
A caller that shows the load's progress passes ``progress(n, total)``: called after each tensor
is read, ``n`` its bytes, ``total`` those the whole load reads, both from the shards' headers
before any tensor is read (a tensor's span in its file, whatever its dtype: ``tensor_bytes``), so
the ``n`` sum to ``total`` (the bar is the caller's: ``runtime.progress``).
Shards are read one after another: reading ahead in threads was measured slower
(benchmarks/bench_load.py; docs/model_notes.md, "Loading the shards").
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from model.checkpoint import resolve_model
from model.config import ModelConfig
from model.fp8_weights import is_ue8m0, resolve_fp8_weights, weight_dequant_fp8
from model.shards import checked_shards, open_shard, read_json, shard_files

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_EXPERT = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale_inv|qweight|qzeros|scales)"
)
FP16_MAX = torch.finfo(torch.float16).max  # 65504
FP16_MIN_NORMAL = torch.finfo(torch.float16).tiny  # 2^-14
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class LoadExtras:
    """What ``load_model`` returns besides the model."""

    config: ModelConfig
    path: Path  # its tokenizer and generation config: runtime.engine_inputs
    # MTP layers (``model.layers.{num_hidden_layers + k}.*``) exactly as stored, on the CPU.
    mtp: dict[str, torch.Tensor] = field(default_factory=dict)


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
    if dtype in _FLOAT or dtype == torch.float64:
        return "float"
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    return str(dtype).removeprefix("torch.")


class _Loader:
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


def load_weights(
    model: nn.Module,
    path: str | Path,
    config: ModelConfig,
    device: str | torch.device = "cpu",
    keep_mtp: bool = True,
    local: Callable[[str], str | None] | None = None,
    read: Callable[[Any, str, str], torch.Tensor] | None = None,
    read_bytes: Callable[[str, int], int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    shards: tuple[str, dict[str, list[str]]] | None = None,
) -> dict[str, torch.Tensor]:
    """Materialise ``model`` (built on the meta device) on ``device`` and fill it from the
    checkpoint at ``path``; returns the MTP tensors kept aside (none read if not ``keep_mtp``).
    Raises ``ValueError`` on any missing / unexpected / misshapen tensor, the names checked
    before any tensor is read. One rank's shard (``model.shard_loader``): ``local(name)`` is the
    model's name of checkpoint tensor ``name``, None for one not read here, and ``read(f, name,
    file)`` reads its part from the open shard ``f`` (default: all of it), ``read_bytes(name,
    n)`` the bytes of that part of the ``n``-byte tensor (default: ``n``). ``progress(n, total)``
    (module docstring): after each tensor read, ``n`` its bytes as read (``read_bytes`` of its
    bytes in the file, ``tensor_bytes``), ``total`` the sum of every ``n`` of this load.
    ``shards``: the checkpoint's ``shard_files`` listing where the caller already read it
    (``FP8Choice.shards``), else read here."""
    path = Path(path)
    local = local or (lambda name: name)
    index, files, fp8, nbytes = checked_shards(path, shards)
    model.to_empty(device=device)  # (before the loader, which holds the parameters)
    loader = _Loader(model, config, path)
    here = {f: [n for n in map(local, names) if n is not None] for f, names in files.items()}
    loader.check_names(here, {n for n in map(local, fp8) if n is not None}, index)
    # (checkpoint name, the model's name) of every tensor read, shard by shard
    todo = {
        file: [(n, ours) for n in names
               if (keep_mtp or not loader.is_mtp(n)) and (ours := local(n)) is not None]
        for file, names in files.items()
    }  # fmt: skip
    size = read_bytes or (lambda name, n: n)
    total = sum(size(n, nbytes[n]) for todo_f in todo.values() for n, _ in todo_f)
    for file, names in todo.items():
        with open_shard(path, file) as f:
            for name, ours in names:
                t = f.get_tensor(name) if read is None else read(f, name, file)
                loader.add(ours, t, file)  # (the copy is the read: get_tensor maps the file)
                if progress is not None:
                    progress(size(name, nbytes[name]), total)
    loader.finish(index)
    _init_non_persistent_buffers(model)
    return loader.mtp


def _init_non_persistent_buffers(model: nn.Module) -> None:
    """``to_empty`` leaves buffers uninitialised: the model recomputes those not in the checkpoint
    (rope frequencies, Hadamard matrices) in its ``init_buffers()``."""
    persistent = set(model.state_dict(keep_vars=True))
    computed = [name for name, _ in model.named_buffers() if name not in persistent]
    init = getattr(model, "init_buffers", None)
    if callable(init):
        init()
    elif computed:
        raise TypeError(
            f"{type(model).__name__} has non-persistent buffers ({computed[0]}, ...) but no "
            "init_buffers() method to recompute them after to_empty()"
        )


def _cast_half_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Give the model's 16-bit float parameters ``dtype`` (fp32 ones, e.g. the router bias,
    stay fp32)."""
    if dtype not in _FLOAT:
        raise ValueError(f"load_model: dtype must be bfloat16, float16 or float32, got {dtype}")
    for m in model.modules():
        for k, p in list(m.named_parameters(recurse=False)):
            if p.dtype in (torch.bfloat16, torch.float16) and p.dtype != dtype:
                setattr(m, k, nn.Parameter(p.to(dtype), requires_grad=False))


def load_model(
    path_or_name: str | Path | CheckpointMeta,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    keep_mtp: bool = True,
    fp8_weights: str | FP8Choice = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[nn.Module, LoadExtras]:
    """Load a checkpoint directory (or a built-in name: ``tiny``, ``tiny-fp8``, ``tiny-awq``; or
    its ``CheckpointMeta``, already read) as ``DeepseekV32ForCausalLM`` on ``device``; ``dtype``
    is the dtype of its 16-bit weights.
    ``keep_mtp=False`` skips reading the MTP layer (a whole MoE block plus embed/head copies).
    ``fp8_weights`` (FP8 checkpoints, ``model.fp8_weights.resolve_fp8_weights``): ``"auto"``
    (default) and ``"fp8"`` keep the linears FP8 (``model.fp8_weights.FP8Linear``), ``"bf16"``
    dequantises every FP8 weight at load (the reference); or the ``FP8Choice`` already made
    for this checkpoint (``fp8_choice``). ``progress``: ``load_weights``'."""
    from model.model import DeepseekV32ForCausalLM

    path, config, _ = checkpoint_meta(path_or_name)
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
    _cast_half_params(model, dtype)
    awq = config.quantization is not None and config.quantization.method == "awq"
    choice = fp8_choice(path, config, fp8_weights)
    scaled = choice.modules
    if scaled is not None:
        from model.fp8_weights import convert_to_fp8

        convert_to_fp8(model, scaled, config.quantization.scale_fmt == "ue8m0")
    if awq:
        from model.awq import convert_to_awq

        convert_to_awq(model, config.quantization)  # NOTE: after the cast: scales stay fp16
    mtp = load_weights(model, path, config, device, keep_mtp, progress=progress,
                       shards=choice.shards)
    finish_loaded_model(model, config, device, dtype)
    return model, LoadExtras(config, path, mtp)


def fp8_scaled_modules(
    path: Path, fp8_weights: str, files: dict[str, list[str]]
) -> set[str] | None:
    """The modules to keep FP8 (those the checkpoint gives a ``weight_scale_inv``; ``files``:
    its ``shard_files`` listing), for ``fp8_weights`` that ``resolve_fp8_weights`` did not
    resolve to ``"bf16"``. A checkpoint whose config.json says FP8 but that has no scales (its
    weights converted to bf16, e.g. by DeepSeek's fp8_cast_bf16.py, with config.json left as it
    was) is served as the bf16 it holds under ``"auto"`` (None), and is a ValueError under an
    explicit ``"fp8"``."""
    scaled = {n.removesuffix(".weight_scale_inv") for names in files.values()
              for n in names if n.endswith(".weight_scale_inv")}  # fmt: skip
    if not scaled and fp8_weights == "auto":
        return None
    if not scaled:
        raise ValueError(
            f"fp8_weights={fp8_weights!r}: {path} has no weight_scale_inv tensors, though its "
            "config.json declares an fp8 quantization_config (already converted to bf16? load "
            "them with fp8_weights='bf16' or 'auto', --fp8-weights bf16)"
        )
    return scaled


class FP8Choice(NamedTuple):
    """``fp8_weights`` resolved against one checkpoint (``fp8_choice``). Found once and passed
    down (``LLM``: ``weights`` to the sizing and the memory checks, the whole choice to the load,
    whole or sharded), as ``CheckpointMeta`` is: the load walks no shard listing for it again,
    and reads no shard index again (it takes ``shards``)."""

    weights: str  # what the load serves: "fp8" (kept FP8) or "bf16"
    modules: set[str] | None  # those kept FP8 (``fp8_scaled_modules``'); None: "bf16"
    # the shard listing (``shard_files``') the walk read, for the load; None: none read (the
    # options resolved to "bf16" without it), the load reads it
    shards: tuple[str, dict[str, list[str]]] | None = None


def fp8_choice(path: Path, config: ModelConfig, fp8_weights: str | FP8Choice) -> FP8Choice:
    """What ``load_model`` serves for ``fp8_weights`` (``fp8_scaled_modules``' rule: "auto"
    keeps what the checkpoint holds), for the readers that must agree with the load before it
    (the memory plan, the sizing) and for the load itself; a choice already made is returned
    as given."""
    if isinstance(fp8_weights, FP8Choice):
        return fp8_weights
    if resolve_fp8_weights(fp8_weights, config, str(path)) == "bf16":  # (its ValueErrors)
        return FP8Choice("bf16", None)
    shards = shard_files(path)
    scaled = fp8_scaled_modules(path, fp8_weights, shards[1])
    return FP8Choice("bf16" if scaled is None else "fp8", scaled, shards)


class CheckpointMeta(NamedTuple):
    """What a start-up reads of a checkpoint directory before any weight
    (``read_checkpoint_meta``). Read once and passed down (``LLM``: to the FP8 choice, the KV
    sizing, the memory checks, the engine inputs and the load), not cached: engines of other
    checkpoints may live in the same process."""

    path: Path
    config: ModelConfig
    # {} when absent; the ValueError naming it when it is not valid JSON (raised only where it
    # is used: generation_config "none" skips it)
    generation_config: Any


def read_checkpoint_meta(path_or_name: str | Path) -> CheckpointMeta:
    """A checkpoint directory's path, model config and generation config, with its tokenizer
    checked present: what every loader (whole or sharded) reads first."""
    path = resolve_model(path_or_name)
    raw = read_json(_require(path, "config.json"), "model config")
    if not isinstance(raw, dict):  # NOTE: from_dict would fail on it with an AttributeError
        raise ValueError(f"{path}/config.json: expected a JSON object, not {type(raw).__name__}")
    config = ModelConfig.from_dict(raw)
    _require(path, "tokenizer.json")
    gen = path / "generation_config.json"
    try:
        generation_config = read_json(gen, "generation config") if gen.is_file() else {}
    except ValueError as e:  # NOTE: raised only where it is used: generation_config "none" skips it
        generation_config = e
    return CheckpointMeta(path, config, generation_config)


def checkpoint_meta(source: str | Path | CheckpointMeta) -> CheckpointMeta:
    """``source``'s meta: as given where it was already read, else ``read_checkpoint_meta``'s."""
    return source if isinstance(source, CheckpointMeta) else read_checkpoint_meta(source)


def finish_loaded_model(
    model: nn.Module, config: ModelConfig, device: str | torch.device, dtype: torch.dtype
) -> None:
    """After the weights are in (whole or sharded loader): AWQ's kv_b_proj densified and, on
    CUDA, the fast int4 layouts and the split-K kernels' tile counters; frozen, eval mode."""
    if config.quantization is not None and config.quantization.method == "awq":
        from model.awq import densify_awq, repack_awq_model

        densify_awq(model, dtype=dtype)  # kv_b_proj -> bf16 weight (MLA reads W_UK / W_UV)
        if torch.device(device).type == "cuda":  # the fast layouts (CPU keeps the AutoAWQ one)
            repack_awq_model(model)
    if torch.device(device).type == "cuda":  # outside any CUDA-graph pool (tile_counters)
        from custom_ops.tile_counters import reserve_counters

        reserve_counters(device)
    model.requires_grad_(False)
    model.eval()


def _require(path: Path, name: str) -> Path:
    if not (path / name).is_file():
        raise ValueError(f"{path}: no {name} (not a Hugging Face checkpoint directory?)")
    return path / name
