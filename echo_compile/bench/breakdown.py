"""Where a decode step's time goes: attention, indexer, cache management, MoE, dense MLP, other.

Decode steps of an *eager* engine run under ``torch.profiler``; every kernel's device time (CPU
time on a CPU run) is charged to the innermost named region that launched it:
- the ``echo::`` custom ops by name: ``sparse_mla_decode`` is attention, ``indexer_topk`` the
  indexer's selection, ``allocate``/``free``/``recall``/``release``/``offload`` cache management,
  ``moe_bf16``/``moe_w4a16``/``moe_w4a16_p``/``moe_fp8`` MoE;
- module regions entered by forward hooks: each layer's ``indexer`` (its projections), ``MoE`` and
  dense ``MLP`` blocks;
- everything else (projections, norms, RoPE, lm_head, sampling) is ``other``.
Eager, because inside a CUDA graph the profiler cannot tell which op launched a kernel. The custom
ops run the same kernels compiled or not; Inductor fuses the small element-wise work in ``other``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

CATEGORIES = ("attention", "indexer", "cache management", "moe", "dense mlp", "other")

_OPS = {
    "echo::sparse_mla_decode": "attention",
    "echo::indexer_topk": "indexer",
    "echo::indexer_topk_prefetch": "indexer",
    "echo::index_scores": "indexer",  # the kernel backends' parts of the selection
    "echo::topk_from_scores": "indexer",
    "echo::dg_paged_mqa_logits": "indexer",
    "echo::dg_paged_mqa_schedule": "indexer",
    "echo::fi_topk": "indexer",
    "echo::allocate": "cache management",
    "echo::free": "cache management",
    "echo::recall": "cache management",
    "echo::recall_staged": "cache management",
    "echo::release": "cache management",
    "echo::release_layers": "cache management",
    "echo::offload": "cache management",
    "echo::moe_bf16": "moe",
    "echo::moe_w4a16": "moe",
    "echo::moe_w4a16_p": "moe",
    "echo::moe_fp8": "moe",
    "echo::dg_moe_fp8": "moe",
}
_REGION = "echo_breakdown:"


def cache_kernel_names() -> frozenset[str]:
    """The cache ops' Triton kernels by name (the staged recall runs the recall's): inside a CUDA
    graph no op claims a kernel, so a graph replay's cache management is found by these names
    (unique among the project's kernels, a test checks)."""
    from custom_ops import cache_fused_kernels as F
    from custom_ops import cache_list_kernels as L
    from custom_ops import cache_pool_kernels as P
    from custom_ops import cache_release_kernels as R

    kernels = (F._free_kernel, F._recall_kernel, L._lookup_kernel, L._copy_out_kernel,
               R._release_kernel, R._release_layers_kernel, R._offload_kernel, P._evict_hist_kernel,
               P._allocate_kernel, P._evict_place_kernel)  # fmt: skip
    return frozenset(k.fn.__name__ for k in kernels)


def _hook_regions(model: nn.Module) -> list:
    """Forward hooks that open a profiler region around each indexer, MoE and dense MLP."""
    from model.model import Indexer
    from model.moe import MLP, MoE

    handles = []
    for mod in model.modules():
        if isinstance(mod, Indexer):
            name = "indexer"
        elif isinstance(mod, MoE):
            name = "moe"
        elif isinstance(mod, MLP) and not _inside_moe(model, mod):
            name = "dense mlp"
        else:
            continue
        stack: list = []

        def pre(_m, _a, name=name, stack=stack):
            rf = torch.profiler.record_function(_REGION + name)
            rf.__enter__()
            stack.append(rf)

        def post(_m, _a, _o, stack=stack):
            stack.pop().__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


def _inside_moe(model: nn.Module, mlp: nn.Module) -> bool:
    from model.moe import MoE

    return any(mlp is m for moe in model.modules() if isinstance(moe, MoE) for m in moe.modules())


def _category(event) -> str:
    e = event
    while e is not None:
        if e.name in _OPS:
            return _OPS[e.name]
        if e.name.startswith(_REGION):
            return e.name[len(_REGION) :]
        e = e.cpu_parent
    return "other"


def _tally(events, cuda: bool, names: frozenset[str] = frozenset()) -> tuple[dict, ...]:
    """Device (CUDA) or CPU microseconds by category, by kernel name (all of it, minus what ops
    claimed: ``by_name``; all of it: ``kernels``) and the CUDA API calls, from profiler events.
    A kernel charged to "other" whose name is in ``names`` (a graph replay's, which no op
    claims) is cache management; one an op claimed keeps the op's category.

    On CUDA the kernels appear twice: charged to the CPU op that launched them and as events of
    their own; categories come from the first, the total from the second. Kernels no op claimed
    are counted as "other" (cache management if named) and listed by name."""
    us = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, float] = {}
    kernels: dict[str, float] = {}
    api: dict[str, list[float]] = {}  # CUDA runtime / driver calls: [count, host us]
    for ev in events:
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("cu"):
            a = api.setdefault(ev.name, [0, 0.0])
            a[0] += 1
            a[1] += ev.cpu_time_total
        if ev.device_type == torch.autograd.DeviceType.CPU:
            t = ev.self_device_time_total if cuda else ev.self_cpu_time_total
            category = _category(ev)
            if t > 0:
                us[category] += t
            for k in ev.kernels if cuda else ():
                by_name[k.name] = by_name.get(k.name, 0.0) - k.duration
                if category == "other" and k.name in names:  # e.g. the graph launch's
                    us["other"] -= k.duration
                    us["cache management"] += k.duration
        elif cuda and not (ev.is_user_annotation or ev.name.startswith(_REGION)):
            # (a region also shows up on the device as an annotation spanning its kernels)
            by_name[ev.name] = by_name.get(ev.name, 0.0) + ev.time_range.elapsed_us()
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.time_range.elapsed_us()
    for n, v in by_name.items():
        if v > 0:
            us["cache management" if n in names else "other"] += v
    return us, by_name, kernels, api


def profile_steps(
    model: nn.Module, step: Callable[[], object], steps: int, cuda: bool, regions: bool = True
) -> dict:
    """Run ``step()`` ``steps`` times under the profiler; per-step milliseconds by category
    (device time on CUDA, CPU time otherwise) and their total; on CUDA also the kernels that
    took the most device time, by name, whatever launched them. ``regions=False`` hooks no
    module (a compiled step: a hook added after compilation would recompile it); on CUDA no op
    claims a graph replay's kernels: the cache ops' are charged to "cache management" by name
    (``cache_kernel_names``), every other one is "other", listed by name."""
    handles = _hook_regions(model) if regions else []
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    names = cache_kernel_names() if cuda and not regions else frozenset()
    us, by_name, kernels, api = _tally(prof.events(), cuda, names)
    unclaimed = sum(v for v in by_name.values() if v > 0)
    top = sorted(((v, n) for n, v in by_name.items() if v > 0), reverse=True)[:8]
    heavy = sorted(((v, n) for n, v in kernels.items()), reverse=True)[:24]
    ms = {k: v / 1e3 / steps for k, v in us.items()}

    def per_step(pairs) -> dict[str, float]:  # names cut to 120 characters; equal cuts add up
        out: dict[str, float] = {}
        for v, n in pairs:
            out[n[:120]] = out.get(n[:120], 0.0) + v / 1e3 / steps
        return out

    return {
        "ms_per_step": ms,
        "total_ms": sum(ms.values()),
        "unclaimed_ms": unclaimed / 1e3 / steps,
        "unclaimed_top": per_step(top),
        "top_kernels": per_step(heavy),  # device time (CUDA only)
        "time": "device" if cuda else "cpu",
        # the host's side: the steps' wall time (profiler on) and the CUDA API calls per step by
        # host time (kernel launches outside a graph, graph launches, synchronisations, copies)
        "wall_ms": wall * 1e3 / steps,
        "cuda_api": {
            n: {"calls": c / steps, "host_ms": t / 1e3 / steps}
            for n, (c, t) in sorted(api.items(), key=lambda kv: -kv[1][1])[:10]
        },
    }
