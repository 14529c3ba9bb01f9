"""The one rule that sizes the context and the KV pools from the checkpoint and the machine's
memory when the user leaves them out (``LLM`` and the ``serve`` / ``generate`` flags), as vLLM
sizes its KV cache from memory instead of asking for rows.

On a CUDA device, for one rank (docs/server.md, "Limits"):

- ``max_model_len``: the model's ``max_position_embeddings``;
- ``host_tokens`` (offloading: the host pool): rows for ``max_batch`` requests of
  ``max_model_len`` each, at most what ``host_memory_fraction`` of the host memory this process
  may use holds (shared by the ranks of this host), and at most what the GPU holds of the
  indexer cache (a key per host row, on the GPU); without offloading it is the whole KV cache,
  on the GPU, and only the GPU bounds it. When one ``max_model_len`` request does not fit, an
  automatic ``max_model_len`` is lowered to what does; a given one is refused;
- ``gpu_tokens`` (offloading: the GPU pool): what ``gpu_memory_utilization`` of the GPU's
  memory leaves after the weights, the rest of the KV cache (indexer cache, prefill buffer,
  maps, staging) and a reserve for activations and CUDA graphs (as vLLM's flag: a fraction of
  the GPU's total memory, so every rank of a job on like GPUs picks the same sizes), at least
  ``max_batch x index_topk`` (a full decode batch's selection), at most ``host_tokens``.

Under torchrun (dp / tp / ep > 1) each rank sizes from its own memory, then every size left out
is the least over the ranks (runtime/distributed/size_agreement.py), so that all run one
configuration; a rank whose own choice was more says so in its line.

On the CPU (the tests' and the demo's engine, never a real deployment: an eager prefill there
costs time in ``max_model_len``) the sizes stay ``EngineConfig``'s small defaults.
The bytes are the memory plan's (runtime/distributed/plan.py), the one count of them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported lazily: the command line reads this module's constants for its
    # help, and `--help` must not import torch)
    from model.config import ModelConfig
    from runtime.distributed.process import DistContext
    from runtime.engine_config import EngineConfig

logger = logging.getLogger(__name__)

GIB = 2**30
HOST_MEMORY_FRACTION = 0.8  # of the host memory this process may use, for the host KV pools
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default: of the GPU's total memory, for this engine
RESERVE_GIB = 8.0  # activations, CUDA graphs' pools, NCCL buffers: the memory plan's guess
SIZED = ("max_model_len", "host_tokens", "gpu_tokens")  # the options this rule chooses


@dataclass(frozen=True)
class Memory:
    """What one rank may use: the host's memory (shared by ``local_ranks`` ranks) and its GPU's
    total memory, bytes."""

    host_bytes: int
    gpu_total_bytes: int
    local_ranks: int = 1


@dataclass(frozen=True)
class Sizes:
    max_model_len: int
    host_tokens: int
    gpu_tokens: int
    why: str  # the start-up log line: what was chosen and from what


def check_fractions(host_memory_fraction: float, gpu_memory_utilization: float) -> None:
    for name, v in (("host_memory_fraction", host_memory_fraction),
                    ("gpu_memory_utilization", gpu_memory_utilization)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ValueError(f"{name} must be a number in (0, 1], got {v!r}")


def check_given_context(
    mc: ModelConfig, config: EngineConfig, given: set[str], sized: bool = False
) -> None:
    """A ``max_model_len`` the user gave (``given`` names it), before the sizing and the load:
    refused where the model's positions or the host pool cannot serve it, naming the flags and
    the fix, as vLLM refuses a ``max_model_len`` past the model's or past its KV cache (it was
    lowered, with a warning only after the weights had loaded). The host pool bounds it where it
    is not sized after this check: a given ``host_tokens``, or the CPU's default; on CUDA a pool
    left out is sized to hold it (``auto_sizes`` refuses where memory cannot). ``sized``: called
    again after ``size_engine``, where a CUDA pool left out may have kept ``EngineConfig``'s
    default (the sizing from memory skipped, on this rank or the one the ranks' least came from),
    which then bounds it too: it was capped there without a word."""
    if "max_model_len" not in given:
        return
    from custom_ops.kv_format import PAGE, pages_for

    asked, positions = config.max_model_len, mc.max_position_embeddings
    if asked > positions:
        rs = mc.rope_scaling
        yarn = (
            f", already YaRN-scaled: {rs.factor:g} x original {rs.original_max_position_embeddings}"
            if rs is not None and positions > rs.original_max_position_embeddings
            else ""
        )
        raise ValueError(
            f"--max-model-len {asked} is more than the model's max_position_embeddings "
            f"{positions} (config.json{yarn}): positions past it were never trained; lower "
            f"--max-model-len to at most {positions}"
        )
    cuda = config.device.startswith("cuda")
    sized_later = cuda and "host_tokens" not in given and not sized
    if asked > config.host_tokens and not sized_later:
        whose, why = "--host-tokens", ""
        if "host_tokens" not in given:
            whose = "the default --host-tokens" if cuda else "the CPU's default --host-tokens"
            why = " (EngineConfig's: the sizing from memory was skipped)" if cuda else ""
        need = pages_for(asked) * PAGE
        pool = "host KV pool" if config.offload else "KV pool (GPU-only: on the device)"
        raise ValueError(
            f"--max-model-len {asked} is more than the {pool} holds: {whose} "
            f"{config.host_tokens} rows a layer{why}, and a request reserves its rows at "
            f"admission; give --host-tokens {need} (or more, a multiple of {PAGE}) or lower "
            f"--max-model-len to at most {config.host_tokens}"
        )


def check_given_gpu_pool(config: EngineConfig, given: set[str]) -> None:
    """A ``gpu_tokens`` the user gave against the pools (``config`` sized), for every entry point
    (``LLM``, so serve and generate, and ``plan``). Offloading: the GPU pool caches host pool
    rows, so rows past ``host_tokens`` are GPU memory never used; refused, naming both and the
    fix (a pool left out is sized to at most ``host_tokens``). Without offloading there is no GPU
    pool (the whole KV cache is on the GPU, ``host_tokens`` rows): warned about, naming the flag
    and the one that sizes that cache, as a fraction that sizes nothing is (``size_engine``);
    allocating nothing, it is not refused (a script may pass one set of sizes to both modes)."""
    if "gpu_tokens" in given and not config.offload:
        logger.warning(
            "--gpu-tokens %d has no effect: it sizes offloading's GPU pool, and without "
            "offloading (--no-offload) the whole KV cache is on the GPU, sized by --host-tokens "
            "(%d rows a layer)", config.gpu_tokens, config.host_tokens,
        )  # fmt: skip
    if "gpu_tokens" in given and config.offload and config.gpu_tokens > config.host_tokens:
        raise ValueError(
            f"--gpu-tokens {config.gpu_tokens} is more than --host-tokens {config.host_tokens}: "
            "the GPU pool caches rows of the host pool, so the rows past it would never be "
            f"used; lower --gpu-tokens to at most {config.host_tokens}, raise --host-tokens, or "
            "keep the whole KV cache on the GPU (--no-offload)"
        )


def warn_capped_batch(mc: ModelConfig, config: EngineConfig) -> str | None:
    """The warning (logged, and returned; None: none) where the GPU pool cannot hold a full
    decode batch's selections (``max_decode_rows``: each decoding request keeps ``index_topk``
    rows a layer in it), so a step decodes fewer than ``max_batch`` requests: allowed (a small
    pool is a choice), but said at start-up, with the flags that would decode them all, rather
    than found from the throughput."""
    from custom_ops.cache.config import max_decode_rows

    topk = mc.index_topk
    rows = max_decode_rows(config.max_batch, topk, config.gpu_tokens if config.offload else None)
    if rows >= config.max_batch or rows == 0:  # (0: a pool below index_topk, refused by name)
        return None
    msg = (
        f"--max-batch {config.max_batch}: a decode step holds at most {rows} requests, "
        f"--gpu-tokens {config.gpu_tokens} // index_topk {topk} (each decoding request keeps its "
        f"{topk} selected rows a layer in the GPU pool); --gpu-tokens "
        f"{config.max_batch * topk} decodes --max-batch at once, --max-batch {rows} captures "
        "no bucket that never runs"
    )
    logger.warning("%s", msg)
    return msg


def _gpu_cache_bytes(mc: ModelConfig, config: EngineConfig, host: int, gpu: int) -> int:
    """The KV cache's device bytes (the plan's count) with ``host`` / ``gpu`` rows a layer."""
    from runtime.distributed.plan import cache_bytes

    c = dataclasses.replace(config, host_tokens=host, gpu_tokens=gpu)
    b = cache_bytes(c.cache_config(mc))
    b.pop("host kv pool")
    return sum(b.values())


def auto_sizes(
    mc: ModelConfig,
    config: EngineConfig,
    given: set[str],
    memory: Memory,
    weight_bytes: int,
    host_memory_fraction: float = HOST_MEMORY_FRACTION,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    reserve_bytes: int = int(RESERVE_GIB * GIB),
) -> Sizes:
    """The sizes of ``SIZED`` for a CUDA rank: ``config``'s where ``given`` names them, else
    chosen from ``memory`` (module docstring). A ValueError where a given ``max_model_len`` does
    not fit; where nothing fits, the least sizes (the memory check then refuses them)."""
    from custom_ops.kv_format import PAGE, ROW_BYTES, pages_for

    check_fractions(host_memory_fraction, gpu_memory_utilization)
    layers, row = mc.num_hidden_layers, ROW_BYTES[config.kv_format]
    min_gpu = config.max_batch * mc.index_topk  # a full decode batch's selected rows
    max_len = config.max_model_len if "max_model_len" in given else mc.max_position_embeddings
    max_len = min(max_len, mc.max_position_embeddings)
    if "host_tokens" in given:  # a given pool caps the context (EngineConfig.model_len's rule)
        max_len = min(max_len, config.host_tokens)
    one = pages_for(max_len) * PAGE  # one request of max_len: the least useful pool
    # the device cost is linear in the rows of each pool: measured at two points each
    g0 = config.gpu_tokens if "gpu_tokens" in given else min_gpu
    trial = dataclasses.replace(config, max_model_len=max_len)
    base = _gpu_cache_bytes(mc, trial, one, g0)
    per_host = (_gpu_cache_bytes(mc, trial, one + 1024 * PAGE, g0) - base) / (1024 * PAGE)
    per_gpu = (_gpu_cache_bytes(mc, trial, one, g0 + 1024 * PAGE) - base) / (1024 * PAGE)
    budget = memory.gpu_total_bytes * gpu_memory_utilization - reserve_bytes - weight_bytes
    why = []
    if "host_tokens" in given:
        host = config.host_tokens
    else:
        want = config.max_batch * one  # (each request reserves whole pages)
        caps = {"GPU (indexer cache)": one + (budget - base) / per_host if per_host else want}
        host_share = memory.host_bytes * host_memory_fraction / memory.local_ranks
        if config.offload:
            caps["host"] = host_share / (layers * row)
        cap = min(caps.values())
        host = min(want, max(0, int(cap)) // PAGE * PAGE)
        if host < PAGE:  # not a page fits (the weights alone, a tiny host): the memory check
            host = one  # refuses these sizes, naming what does not fit
        elif host < one:
            short = min(caps, key=caps.get)
            if "max_model_len" in given:
                need = one * layers * row
                raise ValueError(
                    f"--max-model-len {max_len}: one request needs {one} KV rows a layer "
                    f"({layers} layers x {row} B = {need / GIB:.1f} GiB), more than the {short} "
                    f"holds: {host} rows ({host_share / GIB:.1f} GiB of host memory, "
                    f"--host-memory-fraction {host_memory_fraction:g}"
                    + (f", {memory.local_ranks} ranks" if memory.local_ranks > 1 else "")
                    + f"; GPU: --gpu-memory-utilization {gpu_memory_utilization:g}); lower "
                    "--max-model-len, or give --host-tokens to size the pool yourself"
                )
            logger.warning(
                "max_model_len %d (the model's max_position_embeddings) does not fit the %s: "
                "lowered to %d, the rows it holds (--host-memory-fraction %g, "
                "--gpu-memory-utilization %g; --max-model-len / --host-tokens to choose)",
                max_len, short, host, host_memory_fraction, gpu_memory_utilization,
            )  # fmt: skip
            max_len = host
        ranks = f" / {memory.local_ranks} ranks" if memory.local_ranks > 1 else ""
        # fewer than max_batch requests of the whole context: said, as vLLM's "maximum
        # concurrency" line (the others wait for pages; shorter requests still batch)
        held = f"; holds {host // one} of them at once" if host < want else ""
        cap_text = (  # without offloading the pool is on the GPU: the host caps nothing
            f"at most {host_memory_fraction:g} x {memory.host_bytes / GIB:.0f} GiB host{ranks}"
            if config.offload
            else "on the GPU, at most what its memory holds"
        )
        why.append(
            f"host_tokens {host} ({host * layers * row / GIB:.1f} GiB: max_batch "
            f"{config.max_batch} x {max_len}, {cap_text}{held})"
        )
    if "gpu_tokens" in given or not config.offload:
        gpu = config.gpu_tokens
    else:
        trial = dataclasses.replace(config, max_model_len=max_len)
        other = _gpu_cache_bytes(mc, trial, host, g0) - g0 * per_gpu  # all but the pool's rows
        # (at least one request's selection, which the cache needs, if past the host pool)
        gpu = max(mc.index_topk, min(host, max(min_gpu, int((budget - other) / per_gpu))))
        why.append(
            f"gpu_tokens {gpu} ({gpu * per_gpu / GIB:.1f} GiB: {gpu_memory_utilization:g} x "
            f"{memory.gpu_total_bytes / GIB:.1f} GiB GPU - {weight_bytes / GIB:.1f} GiB weights "
            f"- {other / GIB:.1f} GiB other KV buffers - {reserve_bytes / GIB:g} GiB reserve)"
        )
    if "max_model_len" not in given:
        if max_len == mc.max_position_embeddings:
            src = "the model's max_position_embeddings"
        elif "host_tokens" in given and max_len == config.host_tokens:
            src = "the given host_tokens"
        else:
            src = "what fits of the model's max_position_embeddings"
        why.insert(0, f"max_model_len {max_len} ({src})")
    return Sizes(max_len, host, gpu, "KV sizing: " + ", ".join(why) if why else "")


def size_engine(
    path,
    config: EngineConfig,
    given: set[str],
    fp8_weights: str = "auto",
    host_memory_fraction: float | None = None,
    gpu_memory_utilization: float | None = None,
    weights: int | None = None,
    ctx: DistContext | None = None,
    memory_device: tuple[str, int] | None = None,
) -> EngineConfig:
    """``config`` with ``auto_sizes``'s sizes for this rank's GPU and host (CUDA only; the CPU
    keeps ``config``), logged in one line. Memory that cannot be read (no driver, a planner
    that cannot count the config) leaves ``config`` as it is, with a warning; a torchrun
    variable that is not an integer (``LOCAL_RANK``, ``RANK``, ``LOCAL_WORLD_SIZE``), or a
    ``LOCAL_WORLD_SIZE`` below 1, raises (``plan.rank_memory_device``'s ValueError). A fraction
    given (not None) where it sizes nothing is warned about, naming the flag. ``path``: the
    checkpoint directory, or its ``model.checkpoint_meta.CheckpointMeta`` already read.
    ``weights``: the rank's ``plan.rank_weight_bytes`` if already counted (else counted here);
    ``memory_device``: ``plan.rank_memory_device``'s, if already found (else found here).
    ``ctx``: this rank's place in a multi-rank job (``dist_engine.join``), which every rank of it
    passes: each size left out is then the least over the ranks (``size_agreement.agree_min``,
    a collective every rank makes, on the CPU too), as vLLM takes its workers' least KV block
    count, and a rank whose own choice was more says so in its line, naming the rank that
    limited it; a rank whose own sizing raises (a given context that does not fit its memory, a
    read that fails) stops every rank with its error, named with that rank (``rank_errors``: a
    ``ValueError`` or ``OSError`` there is a ``ValueError`` on the others, anything else a
    ``RankFailure``), before the agreement."""
    if ctx is None or ctx.world_size == 1:
        config, why = _own_sizes(
            path, config, given, fp8_weights, host_memory_fraction, gpu_memory_utilization, weights,
            memory_device,
        )  # fmt: skip
        if why:
            logger.info("%s", why)
        return config
    from runtime.distributed.rank_errors import rank_errors
    from runtime.distributed.size_agreement import agree_min

    # NOTE: any error of this rank's own sizing (not only a ValueError: an OSError, a
    # RuntimeError) is exchanged before the agreement's collective; raised here alone, it left
    # the others a RankFailure naming no cause at the agreement
    with rank_errors(ctx, "the KV sizing"):
        own, why = _own_sizes(
            path, config, given, fp8_weights, host_memory_fraction, gpu_memory_utilization, weights,
            memory_device,
        )  # fmt: skip
    # a size the user gave is the same on every rank (check_same_options): not agreed on
    auto = [k for k in SIZED if k not in given and (config.offload or k != "gpu_tokens")]
    agreed = agree_min(ctx, {k: getattr(own, k) for k in auto})
    lowered = {k: v for k, (v, _) in agreed.items() if v < getattr(own, k)}
    if lowered:
        notes = ", ".join(
            f"{k} {v} (rank {agreed[k][1]}'s; this rank's {getattr(own, k)})"
            for k, v in lowered.items()
        )
        why = (why or "KV sizing:") + f"; the least over the {ctx.world_size} ranks: {notes}"
        own = dataclasses.replace(own, **lowered)
    if why:
        logger.info("%s", why)
    return own


def _own_sizes(
    path,
    config: EngineConfig,
    given: set[str],
    fp8_weights: str,
    host_memory_fraction: float | None,
    gpu_memory_utilization: float | None,
    weights: int | None,
    memory_device: tuple[str, int] | None,
) -> tuple[EngineConfig, str]:
    """``size_engine`` for this rank alone: the config and its line (empty: nothing sized)."""
    if not config.offload:  # no GPU pool: nothing to size in gpu_tokens
        given = given | {"gpu_tokens"}
    cuda = config.device.startswith("cuda")
    applies = {  # what each fraction sizes, when left out
        "host_memory_fraction": cuda and config.offload and "host_tokens" not in given,
        "gpu_memory_utilization": cuda and not set(SIZED) <= given,
    }
    fractions = (("host_memory_fraction", host_memory_fraction),
                 ("gpu_memory_utilization", gpu_memory_utilization))  # fmt: skip
    host_memory_fraction = (
        HOST_MEMORY_FRACTION if host_memory_fraction is None else host_memory_fraction
    )
    gpu_memory_utilization = (
        GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
    )
    # NOTE: before the warning below: a bad value is an error, not also a no-op (two lines)
    check_fractions(host_memory_fraction, gpu_memory_utilization)
    for name, v in fractions:  # (as given: None was left out)
        if v is not None and not applies[name]:
            logger.warning(
                "--%s %s has no effect: it sizes what is left out of --max-model-len / "
                "--host-tokens / --gpu-tokens on CUDA%s", name.replace("_", "-"), v,
                "" if cuda else f" (this engine runs on {config.device})",
            )  # fmt: skip
    if not cuda or set(SIZED) <= given:
        return config, ""
    from model.checkpoint_meta import checkpoint_meta
    from runtime.distributed import plan

    # (torchrun: this rank's GPU; a bad LOCAL_RANK / LOCAL_WORLD_SIZE is a broken launch, its
    # ValueError raised as LLM's, not a memory the sizing steps aside from)
    device, local_ranks = memory_device or plan.rank_memory_device(config)
    try:
        _, mc, _ = checkpoint_meta(path)
        _, host_gib = plan.device_memory_gib(device)
        memory = Memory(int(host_gib * GIB), plan.gpu_total_bytes(device), local_ranks)
        w = plan.rank_weight_bytes(mc, config, fp8_weights) if weights is None else weights
    except Exception as e:  # noqa: BLE001
        logger.warning("KV sizing from memory skipped (%s: %s): EngineConfig's defaults for %s",
                       type(e).__name__, e, ", ".join(sorted(set(SIZED) - given)))  # fmt: skip
        return config, ""
    return sized_config(mc, config, given, memory, w, host_memory_fraction, gpu_memory_utilization)


def sized_config(
    mc: ModelConfig,
    config: EngineConfig,
    given: set[str],
    memory: Memory,
    weight_bytes: int,
    host_memory_fraction: float = HOST_MEMORY_FRACTION,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    reserve_bytes: int = int(RESERVE_GIB * GIB),
) -> tuple[EngineConfig, str]:
    """``config`` with ``auto_sizes``'s sizes for a CUDA rank of ``memory`` and
    ``weight_bytes``, and its line: what a rank's start-up (``size_engine``, from the memory it
    reads) and ``echo-compile plan`` (from the memory it is given) both size with, so the plan
    shows what serve would choose."""
    if not config.offload:  # no GPU pool: nothing to size in gpu_tokens
        given = given | {"gpu_tokens"}
    s = auto_sizes(
        mc, config, given, memory, weight_bytes, host_memory_fraction, gpu_memory_utilization,
        reserve_bytes,
    )  # fmt: skip
    sized = dataclasses.replace(
        config, max_model_len=s.max_model_len, host_tokens=s.host_tokens, gpu_tokens=s.gpu_tokens
    )
    return sized, s.why
