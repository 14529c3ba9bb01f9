"""The per-GPU memory plan of a dp/tp deployment, computed from the model config (no weights
read, no memory allocated): what one rank holds on its GPU and in host memory, and a clear
refusal when it does not fit.

- weights: the rank's model as ``model.shard_loader`` builds it, on the meta device (the exact
  parameter and buffer bytes it would allocate: attention, embeddings and head whole, the
  feed-forward blocks 1/tp; AWQ 4-bit with kv_b_proj dequantised; an FP8 checkpoint kept FP8,
  one byte a weight, unless ``fp8_weights="bf16"`` dequantises it at load, as the loader does:
  ``model.fp8_weights.resolve_fp8_weights``);
- the KV cache of ``custom_ops.cache`` for the rank's ``CacheConfig``: GPU pools (offload) or
  the whole KV (GPU-only), the prefill buffer, the indexer cache (one 132-byte key per host
  row per layer, on the GPU), the prefetch staging buffers, the pools' maps and recall buffers;
  the host pool in host memory;
- a reserve for everything not computed (activations, CUDA graphs' pools, NCCL buffers, the
  allocator's slack): a stated guess, ``reserve_gib``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from custom_ops.cache.config import CacheConfig
from custom_ops.cache.gpu_pool import pool_buffers
from custom_ops.cache.staging import staging_bytes
from custom_ops.kv_format import INDEX_PAGE_BYTES, PAGE
from model.config import ModelConfig
from model.fp8_weights import resolve_fp8_weights
from runtime.engine_config import EngineConfig

GIB = 2**30
# H200: 141 GB = 131.3 GiB usable by the driver's count (torch reports ~139.8 GiB total)
GPU_MEM_GIB = {"h200": 139.8, "h20": 95.0, "h100": 79.6}


def v32_config(quant: str) -> ModelConfig:
    """DeepSeek-V3.2's config.json dimensions (61 layers, the first 3 dense, 256 experts), with
    ``quant`` "bf16" | "fp8" (official 128x128 blocks) | "awq" (4-bit gemm)."""
    from model.checkpoint import with_quantization
    from model.presets import bench_config_dict

    if quant not in ("bf16", "fp8", "awq"):
        raise ValueError(f"quant must be bf16, fp8 or awq, got {quant!r}")
    d = dict(bench_config_dict(num_layers=61, n_experts=256), first_k_dense_replace=3)
    return with_quantization(ModelConfig.from_dict(d), quant == "fp8", quant == "awq")


def fp8_checkpoint_modules(config: ModelConfig) -> set[str]:
    """The modules an FP8 checkpoint of ``config`` gives a ``weight_scale_inv`` (the layout
    model/checkpoint.py writes, the official one's), without a checkpoint."""
    from model.checkpoint import stored_tensor_specs

    suffix = ".weight_scale_inv"
    return {n.removesuffix(suffix) for n in stored_tensor_specs(config) if n.endswith(suffix)}


def weight_bytes(
    config: ModelConfig,
    tp: int,
    rank: int = 0,
    ep: bool = False,
    fp8_weights: str = "auto",
    cuda: bool = True,
) -> int:
    """Bytes of one rank's parameters and buffers (built on the meta device) when the
    feed-forward is split over ``tp`` ranks (``ep``: routed experts by expert; ``fp8_weights``:
    an FP8 checkpoint's weights kept FP8 or dequantised, as ``load_sharded_model`` does), in the
    layouts the loader leaves on a GPU (``cuda``; AWQ repacked for the fast kernels, larger than
    the checkpoint's) or on the CPU."""
    from model.parallel import TPGroup
    from model.shard_loader import build_sharded_model

    kept = resolve_fp8_weights(fp8_weights, config, "this config") == "fp8"
    fp8 = fp8_checkpoint_modules(config) if kept else None
    model = build_sharded_model(config, TPGroup(rank, tp, "", gather=True), ep=ep, fp8_modules=fp8)
    if config.quantization is not None and config.quantization.method == "awq":
        from model.awq_convert import densify_awq, repacked_growth

        densify_awq(model)  # as load_sharded_model does (kv_b_proj bf16)
        # and on a GPU model.loader.finish_loaded_model repacks it (the CPU keeps AutoAWQ's)
        repacked = repacked_growth(model) if cuda else 0
    else:
        repacked = 0
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) + repacked


def rank_weight_bytes(config: ModelConfig, engine: EngineConfig, fp8_weights: str = "auto") -> int:
    """``weight_bytes`` of one rank of ``engine`` (its feed-forward split, by expert or not): what
    the memory plan and the KV sizing (runtime/kv_sizing.py) count as its weights. NOTE: a
    meta-device build of the whole model, seconds for V3.2: ``LLM`` counts it once for both."""
    return weight_bytes(config, engine.ffn_ranks, ep=engine.ep > 1, fp8_weights=fp8_weights)


def cache_bytes(cfg: CacheConfig) -> dict[str, int]:
    """Device and host bytes of a ``KVCache`` of ``cfg`` (mirrors custom_ops/cache/kv_cache.py
    allocation by allocation, a pool's and a staging's buffers from the functions ``GpuPool`` and
    ``Staging`` allocate them from; except the decode indexer's library buffers: about 1 MB, once
    for all layers, where a plan uses DeepGEMM or FlashInfer, which depends on what is installed;
    the plan's reserve covers them)."""
    layers, n_h = cfg.num_layers, cfg.host_tokens
    kv = n_h * cfg.row_bytes * layers
    prefetch = cfg.offload and cfg.prefetch != "off"  # as KVCache builds a layer's Staging
    # a GPU pool's rows, and the rest of it: its maps, recall buffers and counters
    pool = {k: math.prod(shape) * dtype.itemsize for k, (shape, dtype, _) in
            pool_buffers(cfg).items()} if cfg.offload else {}  # fmt: skip
    rows = pool.pop("gpu_kv", 0)
    return {
        "gpu kv pools": rows * layers if cfg.offload else kv,
        "indexer cache": n_h // PAGE * INDEX_PAGE_BYTES * layers,
        "prefill buffer": (cfg.prefill_tokens + 1) * cfg.row_bytes * layers
        if cfg.prefill_tokens
        else 0,
        "prefetch staging": staging_bytes(cfg) * layers if prefetch else 0,
        # prefill_copied (two int64 counters a layer) and the pools' other buffers
        "metadata": (16 + sum(pool.values())) * layers,
        "host kv pool": kv if cfg.offload else 0,
    }


@dataclass(frozen=True)
class MemoryPlan:
    quant: str
    dp: int
    tp: int  # ranks the feed-forward is split over (by tp or, see quant, by ep)
    gpu_gib: dict[str, float]  # per GPU, by item
    host_gib_per_rank: float
    gpu_mem_gib: float
    host_mem_gib: float | None  # per node (its ranks' host pools), None: not checked
    reserve_gib: float
    gpus_per_node: int = 8  # ranks sharing one host's memory
    host_tokens: int = 0  # host pool rows a layer (named in the host's problem)
    gpu_tokens: int = 0  # GPU pool rows a layer (named in the GPU's problem, with offloading)
    offload: bool = True  # False: the GPU holds the whole KV, host_tokens rows a layer
    gpu_free: bool = False  # gpu_mem_gib is the GPU's free memory now (check_fits), not its size
    max_batch: int = 0  # the sizes planned, named in the table (0: not given)
    max_model_len: int = 0
    kv_format: str = ""

    @property
    def gpu_total_gib(self) -> float:
        return sum(self.gpu_gib.values()) + self.reserve_gib

    @property
    def ranks(self) -> int:
        """Processes of the deployment, each with its own host pool (tp alone too: every rank
        holds the same batch's KV)."""
        return max(self.dp, self.tp)

    @property
    def ranks_per_node(self) -> int:
        return min(self.ranks, self.gpus_per_node)

    @property
    def host_total_gib(self) -> float:
        """The host pools of one node's ranks."""
        return self.host_gib_per_rank * self.ranks_per_node

    def problems(self) -> list[str]:
        out = []
        if self.gpu_total_gib > self.gpu_mem_gib:
            w = self.gpu_gib["weights"]
            dequant = "(dequantised)" in self.quant
            why = (" (FP8 weights dequantised to bf16 at load by --fp8-weights bf16: leave it "
                   "out to keep them FP8)") if dequant else ""  # fmt: skip
            kv, what = self.gpu_gib["gpu kv pools"], "GPU KV pools" if self.offload else "KV cache"
            # the flag that sizes the KV cache on the GPU: the pools', or the whole cache's
            flag = (f"--gpu-tokens {self.gpu_tokens} rows a layer" if self.offload else
                    f"--host-tokens {self.host_tokens} rows a layer, no offloading")  # fmt: skip
            has = f"{self.gpu_mem_gib:g} GiB"
            has = f"{self.gpu_mem_gib:.1f} GiB free" if self.gpu_free else has
            # the rows that fit: the excess taken off the KV rows alone (the pools' maps and
            # the indexer cache shrink with them too, so the count is on the safe side)
            rows = self.gpu_tokens if self.offload else self.host_tokens
            over = self.gpu_total_gib - self.gpu_mem_gib
            fit = (int(rows * (1 - over / kv)) // PAGE * PAGE) if kv > over else 0
            name = "--gpu-tokens" if self.offload else "--host-tokens"
            fix = f"; {name} {fit} fits" if fit > 0 and not dequant else ""
            out.append(
                f"{self.quant} on dp={self.dp} tp={self.tp}: a GPU needs "
                f"{self.gpu_total_gib:.1f} GiB ({w:.1f} GiB weights, {kv:.1f} GiB {what}: "
                f"{flag}) but has {has}{why}{fix}"
            )
        if self.host_mem_gib is not None and self.host_total_gib > self.host_mem_gib:
            n = self.ranks_per_node
            ranks = f" a node ({n} ranks x {self.host_gib_per_rank:.1f})" if n > 1 else ""
            fit = int(self.host_tokens * self.host_mem_gib / self.host_total_gib) // PAGE * PAGE
            out.append(
                f"the host KV pools need {self.host_total_gib:.1f} GiB{ranks}, --host-tokens "
                f"{self.host_tokens} rows a layer, but the host has {self.host_mem_gib:.1f} GiB"
                + (f"; --host-tokens {fit} fits" if fit > 0 else "")
            )
        return out

    def check(self) -> None:
        """Raise ``ValueError`` naming what does not fit."""
        p = self.problems()
        if p:
            raise ValueError("the plan does not fit: " + "; ".join(p))

    def table(self, sizing: str = "") -> str:
        """The plan, one item a line; ``sizing``: where the sizes came from (given, or chosen as
        serve chooses them: ``kv_sizing.sized_config``'s line), after the sizes."""
        lines = [f"per-GPU memory plan: {self.quant} weights, dp={self.dp} tp={self.tp}"]
        if self.max_batch:  # the sizes planned, as serve's flags (plan's defaults are not serve's)
            pools = f"--gpu-tokens {self.gpu_tokens}" if self.offload else "--no-offload"
            lines.append(
                f"  for --max-batch {self.max_batch} --max-model-len {self.max_model_len} "
                f"--kv-format {self.kv_format} {pools} --host-tokens {self.host_tokens}"
            )
        if sizing:
            lines.append(f"  ({sizing})")
        for k, v in self.gpu_gib.items():
            lines.append(f"  {k:<16} {v:9.2f} GiB")
        lines.append(f"  {'reserve (guess)':<16} {self.reserve_gib:9.2f} GiB")
        lines.append(f"  {'total':<16} {self.gpu_total_gib:9.2f} GiB of {self.gpu_mem_gib:g} GiB")
        host = f"  host KV pool     {self.host_gib_per_rank:9.2f} GiB per rank"
        nodes = -(-self.ranks // self.gpus_per_node)
        per_node = f"{counted(self.ranks_per_node, 'rank')}; {counted(nodes, 'node')}"
        lines.append(host + f", {self.host_total_gib:.1f} GiB per node ({per_node})")
        lines.append("  fits" if not self.problems() else "  DOES NOT FIT: " + "; ".join(
            self.problems()))  # fmt: skip
        return "\n".join(lines)


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one: "1 rank", "2 ranks"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def check_memory(
    gpu_mem_gib: float, host_mem_gib: float | None, reserve_gib: float, gpus_per_node: int
) -> None:
    """``memory_plan``'s memory, refused by name where it is not a finite amount (NaN compares
    false everywhere: a NaN GPU was "total nan GiB ... fits")."""
    # (one message each: the command line names the option's flag, "--reserve-gib must be ...")
    if not 0 < gpu_mem_gib < math.inf:
        raise ValueError(f"gpu_mem_gib must be a finite number > 0, got {gpu_mem_gib}")
    if not 0 <= reserve_gib < math.inf:
        raise ValueError(f"reserve_gib must be a finite number >= 0, got {reserve_gib}")
    if host_mem_gib is not None and not 0 < host_mem_gib < math.inf:
        raise ValueError(f"host_mem_gib must be a finite number > 0, got {host_mem_gib}")
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, got {gpus_per_node}")


def memory_plan(
    config: ModelConfig,
    engine: EngineConfig,
    gpu_mem_gib: float,
    host_mem_gib: float | None = None,
    reserve_gib: float = 8.0,
    fp8_weights: str = "auto",
    gpus_per_node: int = 8,
    weights: int | None = None,
) -> MemoryPlan:
    """The plan of one rank of ``engine`` (dp, tp, pools) serving ``config`` (``fp8_weights``:
    as ``LLM``'s, for an FP8 checkpoint; ``gpus_per_node``: the ranks whose host pools share one
    host's ``host_mem_gib``; ``weights``: the rank's ``rank_weight_bytes`` if already counted)."""
    check_memory(gpu_mem_gib, host_mem_gib, reserve_gib, gpus_per_node)
    q = config.quantization.method if config.quantization is not None else "bf16"
    fp8_weights = resolve_fp8_weights(fp8_weights, config, f"this config ({q})")
    if q == "fp8":
        q += " (kept fp8)" if fp8_weights == "fp8" else " (dequantised)"
    q += " (experts by expert)" if engine.ep > 1 else ""
    cache = cache_bytes(engine.cache_config(config))
    host = cache.pop("host kv pool")
    w = rank_weight_bytes(config, engine, fp8_weights) if weights is None else weights
    gpu = {"weights": w, **cache}
    return MemoryPlan(
        q,
        engine.dp,
        engine.ffn_ranks,
        {k: v / GIB for k, v in gpu.items()},
        host / GIB,
        gpu_mem_gib,
        host_mem_gib,
        reserve_gib,
        gpus_per_node,
        engine.host_tokens,
        engine.gpu_tokens,
        engine.offload,
        max_batch=engine.max_batch,
        max_model_len=engine.max_model_len,
        kv_format=engine.kv_format,
    )


class DoesNotFit(ValueError):
    """``check_fits``'s refusal (a ValueError, so the command line prints it as one line)."""


def check_fits(
    config: ModelConfig,
    engine: EngineConfig,
    gpu_mem_gib: float,
    host_mem_gib: float,
    fp8_weights: str = "auto",
    local_ranks: int = 1,
    weights: int | None = None,
) -> None:
    """Refuse, before anything is loaded, what cannot fit: one rank's weights and KV cache alone
    over ``gpu_mem_gib``, or the host KV pools of the ``local_ranks`` ranks sharing this host
    (one pool each, whatever the split) over ``host_mem_gib``. No reserve is counted
    (activations and CUDA graphs come on top), so it refuses only what would certainly fail:
    an out-of-memory error minutes into loading becomes one line at once. ``gpu_mem_gib``: the
    GPU's free memory (``device_memory_gib``), as the refusal says; ``weights``: as
    ``memory_plan``'s."""
    plan = memory_plan(
        config, engine, gpu_mem_gib, host_mem_gib, 0.0, fp8_weights, local_ranks, weights
    )
    plan = replace(plan, gpu_free=True)
    problems = plan.problems()
    if problems:
        raise DoesNotFit(f"does not fit {engine.device}: " + "; ".join(problems))


def rank_memory_device(config: EngineConfig) -> tuple[str, int]:
    """The device whose memory this rank plans with, and the ranks sharing its host's memory:
    ``config.device`` alone; under torchrun (``world_size`` > 1) a bare ``cuda`` / ``cuda:0`` is
    this rank's GPU, ``cuda:<LOCAL_RANK>`` (unset: ``RANK``, the GPU the join takes,
    ``process.init_distributed``), and ``LOCAL_WORLD_SIZE`` ranks share the host. A
    variable that is not an integer is a ``ValueError`` naming it and its value, as the process
    group's join makes, and so is a ``LOCAL_WORLD_SIZE`` below 1 (torchrun sets them: such a
    value is a broken launch, not a memory the sizing could step aside from)."""
    from runtime.distributed.process import env_int

    device, local_ranks = config.device, 1
    if config.world_size > 1:
        if device in ("cuda", "cuda:0"):
            device = f"cuda:{env_int('LOCAL_RANK', env_int('RANK', 0))}"
        local_ranks = env_int("LOCAL_WORLD_SIZE", 1)
        if local_ranks < 1:  # (the sizing divides the host's memory by it)
            raise ValueError(
                f"environment variable LOCAL_WORLD_SIZE={local_ranks} must be at least 1 (the "
                "ranks on this host, as torchrun sets it)"
            )
    return device, local_ranks


def device_memory_gib(device: str) -> tuple[float, float]:
    """The GPU's free memory now and the memory the host lets this process use (physical, or
    the container's limit), GiB. Free, not total: other processes, and other engines of this
    one, hold part of the GPU (the GPU-only pool's own check, ``check_host_rows``, reads free
    memory too)."""
    import torch

    from custom_ops.cache.host_pool import _host_memory_limit

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return free / GIB, _host_memory_limit() / GIB


def gpu_total_bytes(device: str) -> int:
    """The GPU's total memory, bytes (what vLLM's --gpu-memory-utilization is a fraction of)."""
    import torch

    return torch.cuda.mem_get_info(torch.device(device))[1]


def plan_engine(
    dp: int,
    tp: int,
    gpu_tokens: int,
    host_tokens: int,
    max_batch: int,
    kv_format: str = "fp8",
    offload: bool = True,
    max_model_len: int = 163840,
    ep: int = 1,
    prefill_buffer: bool = True,
    **options,
) -> EngineConfig:
    """An engine config for planning (long contexts: the whole V3.2 context by default);
    ``options``: other ``EngineConfig`` options, e.g. the prefetch ones that size the staging
    buffers (``prefetch``, ``prefetch_cap``, ``prefetch_ratio``)."""
    base = EngineConfig(
        max_batch=max_batch,
        host_tokens=host_tokens,
        gpu_tokens=gpu_tokens,
        kv_format=kv_format,
        offload=offload,
        max_model_len=max_model_len,
        prefill_buffer=prefill_buffer,
        **options,
    )
    return replace(base, dp=dp, tp=tp, ep=ep)
