"""An AWQ model's whole-model passes around a load (docs/model_notes.md): which modules become
AWQ modules, and what happens to them after the weights are in.

- build the model on the meta device, then ``convert_to_awq(model, config.quantization)`` swaps
  every quantised ``nn.Linear`` for ``AWQLinear`` and every stacked ``Experts`` for ``AWQExperts``
  (model/awq.py); their parameters carry the checkpoint's names (``qweight``, ``qzeros``,
  ``scales``; experts ``w13_*``/``w2_*`` with gate then up along the packed output axis, the last
  one);
- after loading, ``densify_awq(model)`` turns ``kv_b_proj`` back into a bf16 ``nn.Linear``: the MLA
  absorbed decode reads its weight as W_UK / W_UV;
- on CUDA, ``repack_awq_model(model)`` then prepares every AWQ module for the fast kernels
  (``AWQLinear.repack``, ``AWQExperts.repack``); ``repacked_growth`` counts the bytes that adds,
  for the memory plan.
"""

from __future__ import annotations

import torch
from torch import nn

from custom_ops import awq_pairs as P
from custom_ops import awq_repack as R
from model.awq import AWQExperts, AWQLinear
from model.quant_config import QuantConfig

DENSE_AFTER_LOAD = ("kv_b_proj",)  # AWQ in the checkpoint, dense bf16 in the model (W_UK / W_UV)


def _is_stacked_experts(m: nn.Module) -> bool:
    w13, w2 = getattr(m, "w13_weight", None), getattr(m, "w2_weight", None)
    return isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3


def convert_to_awq(
    model: nn.Module, quant_config: QuantConfig, scales_dtype: torch.dtype = torch.float16
) -> list[str]:
    """Swap, in place, every ``nn.Linear`` (except ``lm_head``, which AWQ checkpoints keep 16-bit)
    and every stacked experts module (``w13_weight``/``w2_weight``) whose qualified name is not
    skipped by ``quant_config.awq_skips`` for ``AWQLinear`` / ``AWQExperts`` on the same device
    (meta is fine). Returns the converted names. ``scales_dtype``: the checkpoint's scales dtype."""
    if quant_config.method != "awq":
        raise ValueError(
            f"convert_to_awq: quant_config.method is {quant_config.method!r}, not 'awq'"
        )
    done: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            # NOTE: "name." so that "mlp.gate." matches the router module "...mlp.gate" itself.
            if child_name == "lm_head" or quant_config.awq_skips(name + "."):
                continue
            if isinstance(child, nn.Linear):
                if child.bias is not None:
                    raise ValueError(
                        f"convert_to_awq: {name} has a bias; AWQ linears here have none"
                    )
                try:
                    new: nn.Module = AWQLinear(
                        child.in_features, child.out_features, scales_dtype, child.weight.device
                    )
                except ValueError as e:  # a 16-bit module config.json did not list as such
                    raise ValueError(
                        f"convert_to_awq: {name}: {e}; if the checkpoint keeps it 16-bit, "
                        "config.json's quantization_config.modules_to_not_convert must name it "
                        f"(it names {list(quant_config.modules_to_not_convert)})"
                    ) from e
            elif _is_stacked_experts(child):
                e, two_i, d = child.w13_weight.shape
                try:
                    new = AWQExperts(e, d, two_i // 2, scales_dtype, child.w13_weight.device)
                except ValueError as err:
                    raise ValueError(f"convert_to_awq: {name}: {err}") from err
            else:
                continue
            setattr(parent, child_name, new)
            done.append(name)
    return done


def densify_awq(
    model: nn.Module,
    patterns: tuple[str, ...] = DENSE_AFTER_LOAD,
    dtype: torch.dtype = torch.bfloat16,
) -> list[str]:
    """After loading: replace each ``AWQLinear`` whose name contains one of ``patterns`` with a
    bias-free ``nn.Linear`` holding the dequantised weight in ``dtype``. Returns the names."""
    done: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, AWQLinear) or not any(p in name for p in patterns):
                continue
            dense = nn.Linear(
                child.in_features,
                child.out_features,
                bias=False,
                dtype=dtype,
                device=child.qweight.device,
            )
            dense.weight = nn.Parameter(child.dequantized_weight(dtype), requires_grad=False)
            setattr(parent, child_name, dense)
            done.append(name)
    return done


def _tinygemm_max_m(m: AWQLinear, cuda: bool | None) -> int:
    """``repack_awq_model``'s default ``tinygemm_max_m`` for ``m`` (``cuda`` None: by the
    weight's device): ``custom_ops.awq_repack.tinygemm_max_m`` of its size on CUDA, -1 elsewhere."""
    if cuda is None:
        cuda = m.qweight.device.type == "cuda"
    return R.tinygemm_max_m(m.in_features, m.out_features) if cuda else -1


def repack_awq_model(
    model: nn.Module,
    tinygemm_max_m: int | None = None,
    large_m: str | None = None,
    cuda: bool | None = None,
) -> list[str]:
    """After loading (and ``densify_awq``): ``AWQLinear.repack`` every AWQ linear of ``model``
    and ``AWQExperts.repack`` every block of routed experts. ``tinygemm_max_m``: linear calls of
    at most this many tokens use tinygemm (default ``custom_ops.awq_repack.tinygemm_max_m`` of
    the linear's size on CUDA, none elsewhere; -1 = never; ``cuda``: which of the two defaults,
    None: by the weights' device); ``large_m``: the kernel of the other calls (default
    ``R.LARGE_M_PATH``, the measured winner). Returns the names."""
    large = R.LARGE_M_PATH if large_m is None else large_m
    R.check_large_m_path(large)
    done: list[str] = []
    for name, m in list(model.named_modules()):
        try:
            if isinstance(m, AWQExperts) and not m.repacked:
                m.repack()
                done.append(name)
            if isinstance(m, AWQLinear) and not m.repacked:
                max_m = tinygemm_max_m if tinygemm_max_m is not None else _tinygemm_max_m(m, cuda)
                m.repack(max_m, large)
                done.append(name)
        except ValueError as err:  # e.g. pack_zs refusing a scale: say which module
            raise ValueError(f"repack_awq_model: {name}: {err}") from err
    for dev in {p.device for p in model.parameters() if p.device.type == "cuda"}:
        P.reserve_counters(dev)  # before any torch.compile warm-up could make them in its pool
    return done


def _nbytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


def repacked_growth(model: nn.Module) -> int:
    """Bytes ``repack_awq_model`` would add to the parameters of ``model`` on a GPU (the pair
    layout's packed zero points and scales are larger than AutoAWQ's, and the small linears keep
    a tinygemm copy too): the memory plan's weights on a GPU (runtime/distributed/plan.py).
    Nothing is allocated and ``model`` is left as it is: each distinct AWQ module shape is
    repacked once as a meta stand-in (a block of experts as one expert, times their count)."""
    growth: dict[tuple, int] = {}
    total = 0
    for m in model.modules():
        if isinstance(m, AWQExperts) and not m.repacked:
            key: tuple = ("experts", m.dim, m.inter_dim, m.w13_scales.dtype)
            if key not in growth:
                one = AWQExperts(1, m.dim, m.inter_dim, m.w13_scales.dtype, "meta")
                before = _nbytes(one)
                one.repack()
                growth[key] = _nbytes(one) - before
            total += growth[key] * m.n_experts
        elif isinstance(m, AWQLinear) and not m.repacked:
            max_m = _tinygemm_max_m(m, cuda=True)
            key = ("linear", m.in_features, m.out_features, m.scales.dtype, max_m)
            if key not in growth:
                one = AWQLinear(m.in_features, m.out_features, m.scales.dtype, "meta")
                before = _nbytes(one)
                one.repack(max_m, R.LARGE_M_PATH)
                growth[key] = _nbytes(one) - before
            total += growth[key]
    return total
