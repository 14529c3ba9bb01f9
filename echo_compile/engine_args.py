"""The flags of the commands that run an engine (generate and serve; plan shares the prefetch
and format ones) and the engine options they give, ``LLM``'s keyword arguments."""

from __future__ import annotations

import argparse
from decimal import Decimal

from echo_compile.process_args import add_process_args
from runtime.kv_sizing import GPU_MEMORY_UTILIZATION, HOST_MEMORY_FRACTION, RESERVE_GIB, SIZED
from runtime.sampling_params import GENERATION_CONFIG_MODES  # (imports no torch)

# NOTE: no torch here either: the flags are in every --help (cli_args.py says why).

# the help of the flags several commands share
MODEL_HELP = "checkpoint directory, or tiny / tiny-fp8 / tiny-awq (default: %(default)s)"
DEVICE_HELP = "cpu or cuda (default: cuda when available)"
KV_FORMATS = ("bf16", "fp8")
KV_FORMAT_HELP = (
    "KV cache rows: bf16, or fp8 (FlashMLA's 656-byte row, vLLM's fp8_ds_mla; default: %(default)s)"
)

# the sizes LLM chooses when they are left out, and the fractions it chooses them by
SIZED_OPTIONS = (*SIZED, "host_memory_fraction", "gpu_memory_utilization")
# the prefetch flags that size the staging buffers (serve, generate and plan)
PREFETCH_OPTIONS = ("prefetch", "prefetch_cap", "prefetch_ratio")


def token_count(value: str) -> int:
    """A token count as vLLM's ``--max-model-len`` takes it: an integer, or one with a suffix,
    k / m / g for powers of 1000 and K / M / G for powers of 1024 (``100k`` = 100000, ``128K`` =
    131072, ``25.6k`` = 25600); a count that is not whole is refused, naming the value."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    v = value.strip()
    scale = units.get(v[-1:], 1)
    try:
        # (a Decimal: a float's 4.1 x 10**6 is 4099999.9999999995, "not whole")
        n = Decimal(v[:-1]) * scale if scale > 1 else Decimal(int(v))
    except (ValueError, ArithmeticError):
        raise argparse.ArgumentTypeError(
            f"invalid token count: {value!r} (an integer, or with k / m / g for 1000s, K / M / G "
            "for 1024s: 100k, 128K)"
        ) from None
    why = "not whole" if not n.is_finite() or n != n.to_integral_value() else None  # (nan, inf)
    if why is None and abs(n) >= 2**63:  # (1e999999999k: int() of it would take minutes)
        why = "too large"
    if why is not None:
        raise argparse.ArgumentTypeError(
            f"invalid token count: {value!r} is {n.normalize():g}, {why}"
        )
    return int(n)


def add_prefetch_args(p: argparse.ArgumentParser) -> None:
    """The prefetch flags (``PREFETCH_OPTIONS``), which serve, generate and plan take."""
    p.add_argument(
        "--prefetch",
        choices=("off", "request", "global"),
        default=None,
        help="lossless decode prefetch fused into the indexer, with offloading (docs/prefetch.md): "
        "request (at most --prefetch-cap rows per request and layer) or global (--prefetch-ratio "
        "rows per context token of the batch, at most max_batch x --prefetch-cap); default: off",
    )
    p.add_argument("--prefetch-cap", type=int, default=None,
                   help="staged rows per request and layer (default: "
                   "EngineConfig.prefetch_cap)")  # fmt: skip
    p.add_argument("--prefetch-ratio", type=float, default=None,
                   help="global: staged rows per context token of the batch (default: "
                   "EngineConfig.prefetch_ratio)")  # fmt: skip


def given(a: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """The options of ``names`` the command line set (EngineConfig holds the defaults and checks
    the values)."""
    return {k: getattr(a, k) for k in names if getattr(a, k) is not None}


def add_generation_config_arg(p: argparse.ArgumentParser, fields: str) -> None:
    """``--generation-config`` (generate and serve); ``fields``: the sampling fields it fills."""
    p.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIG_MODES,
        default="auto",
        help=f"auto: a request's unset {fields} and its EOS ids come from the checkpoint's "
        "generation_config.json, as vLLM does; none: the file is not read "
        "(SamplingParams' defaults); default: %(default)s",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, which generate and serve take, and the process's."""
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="requests decoded at once at most (the largest captured decode batch; default: "
        "%(default)s)",
    )
    p.add_argument(
        "--host-tokens",
        type=token_count,
        default=None,
        help="host KV pool rows (tokens) per layer, a multiple of 64 (default on CUDA: "
        "--max-batch requests of --max-model-len, at most what --host-memory-fraction holds; on "
        "the CPU 16384)",
    )
    p.add_argument(
        "--gpu-tokens",
        type=token_count,
        default=None,
        help="GPU pool rows (tokens) per layer, at most --host-tokens (default on CUDA: what "
        "--gpu-memory-utilization leaves after the weights, the other KV buffers and a reserve "
        f"of {RESERVE_GIB:g} GiB; on the CPU 1024)",
    )
    p.add_argument(
        "--host-memory-fraction",
        type=float,
        default=None,
        help="the share of the host memory this process may use (physical or the container's "
        "limit) that the host KV pools of this host's ranks may take, when --host-tokens is "
        f"left out (default: {HOST_MEMORY_FRACTION:g}; CUDA)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="as vLLM's: the share of the GPU's total memory this engine may use (weights, KV "
        f"cache, reserve), which sizes --gpu-tokens when it is left out (default: "
        f"{GPU_MEMORY_UTILIZATION:g}; CUDA)",
    )
    p.add_argument("--kv-format", choices=KV_FORMATS, default="bf16", help=KV_FORMAT_HELP)
    p.add_argument(
        "--fp8-weights",
        choices=("auto", "bf16", "fp8"),
        default="auto",
        help="an FP8 checkpoint's weights: kept FP8 (auto, the default, as vLLM serves them; fp8 "
        "also refuses a checkpoint that is not FP8) or dequantised to bf16 at load (bf16)",
    )
    p.add_argument(
        "--no-offload", action="store_true", help="keep the whole KV cache on the device"
    )
    p.add_argument(
        "--kernel-backend",
        default=None,
        help="the decode indexer's kernels: auto (default), triton, deep_gemm or flashinfer "
        "(docs/backends.md; without the libraries every choice runs triton)",
    )
    p.add_argument(
        "--max-model-len",
        type=token_count,
        default=None,
        help="longest prompt + output a request may have, in tokens (100k, 128K as vLLM takes "
        "them; default on CUDA: the "
        "model's max_position_embeddings, lowered to what the host pool holds; on the CPU 4096; "
        "a given one past max_position_embeddings or --host-tokens is refused; the prefill "
        "keeps this many rows a layer on the device unless --no-prefill-buffer)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens a prefill step computes at most (a multiple of 16; default: "
        "EngineConfig.prefill_chunk)",
    )
    p.add_argument(
        "--decode-buckets",
        default=None,
        help="the decode batch sizes captured as CUDA graphs, comma-separated, increasing, the "
        "last = --max-batch (default: EngineConfig's, runtime/engine_config.py)",
    )
    p.add_argument(
        "--dynamic-decode",
        action="store_true",
        help="compile the decode step once for every bucket, its batch dim symbolic (two "
        "compiles instead of one per bucket; docs/compile.md)",
    )
    p.add_argument(
        "--prefill-first",
        action="store_true",
        help="decoding requests wait for every pending prefill chunk (default: they decode a step "
        "between two chunks of a long prompt)",
    )
    p.add_argument(
        "--no-prefill-buffer",
        action="store_true",
        help="prefill copies only the rows its queries select from the host pool instead of "
        "keeping the prompt on the device (saves max_model_len rows a layer)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep sequences' full KV pages in the host pool for later prompts that start with "
        "the same tokens (default: on, as vLLM's; --no-enable-prefix-caching turns it off)",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="launch the next decode step before reading the last one's tokens (one process)",
    )
    add_prefetch_args(p)
    p.add_argument("--prefetch-margin", type=float, default=None,
                   help="the threshold's margin over the EMA of the k-th score, in EMAs of its "
                   "distance from it (0 = ECHO's threshold; default: "
                   "EngineConfig.prefetch_margin)")  # fmt: skip
    p.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=None,
        help="capture CUDA graphs (default on CUDA)",
    )
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run the steps eagerly, no CUDA graphs (default on the CPU)",
    )
    p.add_argument(
        "--dp", type=int, default=1, help="data-parallel attention ranks (torchrun; default: 1)"
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel feed-forward ranks (default: 1)"
    )
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel ranks, instead of --tp (default: 1)"
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=300.0,
        help="seconds a rank waits for the others before it stops (dp/tp/ep > 1; default: "
        "%(default)s)",
    )
    add_process_args(p)


def engine_options(a: argparse.Namespace) -> dict:
    """``LLM``'s engine options from the engine flags (the ones left out: ``LLM`` sizes them or
    ``EngineConfig`` holds their defaults)."""
    opts = dict(
        max_batch=a.max_batch,
        kv_format=a.kv_format,
        offload=not a.no_offload,
        dp=a.dp,
        tp=a.tp,
        ep=a.ep,
        collective_timeout_s=a.collective_timeout,
        async_scheduling=a.async_scheduling,
        decode_during_prefill=not a.prefill_first,
        prefill_buffer=not a.no_prefill_buffer,
        dynamic_decode=a.dynamic_decode,
    )
    if a.device:
        opts["device"] = a.device
    if a.kernel_backend is not None:  # checked by EngineConfig (one home for the names)
        opts["kernel_backend"] = a.kernel_backend
    if a.decode_buckets is not None:
        try:
            opts["decode_buckets"] = tuple(int(b) for b in a.decode_buckets.split(","))
        except ValueError:
            raise ValueError(
                f"--decode-buckets must be comma-separated integers, got {a.decode_buckets!r}"
            ) from None
    # left out: EngineConfig's default (prefix caching: LLM turns it on unless given)
    opts.update(given(a, ("prefill_chunk", "enable_prefix_caching", "prefetch_margin")))
    opts.update(given(a, PREFETCH_OPTIONS))
    # left out: sized from the checkpoint and the memory (runtime/kv_sizing.py, via LLM)
    opts.update(given(a, SIZED_OPTIONS))
    return opts
