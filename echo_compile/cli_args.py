"""The ``echo-compile`` command line's flags: the parser, and the engine, server and sampling
options the flags give (cli.py runs the commands)."""

from __future__ import annotations

import argparse

from echo_compile.vllm_flags import add_vllm_args
from runtime.kv_sizing import GPU_MEMORY_UTILIZATION, HOST_MEMORY_FRACTION, RESERVE_GIB, SIZED
from runtime.sampling_params import GENERATION_CONFIG_MODES  # (imports no torch)

# NOTE: nothing here imports torch at module level: `echo-compile --help` (and a subcommand's
# --help) must answer without the seconds torch takes to import.
# Every option's help says what it does and, unless it is a switch, its default, as
# "(default: %(default)s)" where argparse holds it, in words where it is chosen later (the bench's
# parser too; tests/test_cli_help.py walks them all).

DESCRIPTION = "The echo-compile command: demo, generate, serve, make-checkpoint, plan, bench."
API_KEY_ENV = "ECHO_COMPILE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's: read after ours, so a key set for vLLM still applies
LOG_LEVEL_ENV = "ECHO_COMPILE_LOGGING_LEVEL"
VLLM_LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # vLLM's, read after ours, as the API key's
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


# the help of the flags several commands share
MODEL_HELP = "checkpoint directory, or tiny / tiny-fp8 / tiny-awq (default: %(default)s)"
DEVICE_HELP = "cpu or cuda (default: cuda when available)"
KV_FORMATS = ("bf16", "fp8")
KV_FORMAT_HELP = (
    "KV cache rows: bf16, or fp8 (FlashMLA's 656-byte row, vLLM's fp8_ds_mla; default: %(default)s)"
)


def _threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: $ECHO_COMPILE_THREADS, else $OMP_NUM_THREADS, else "
        "1 on up to 2 usable cores and half the cores above; see echo_compile/threads.py)",
    )


def _log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=None,
        help=f"level of echo-compile's own log lines on stderr (default: ${LOG_LEVEL_ENV}, else "
        f"${VLLM_LOG_LEVEL_ENV}, else info); other libraries' stay at warning",
    )


def _process_args(p: argparse.ArgumentParser) -> None:
    """The process's settings, which every command but bench (its own parser) takes."""
    _threads_arg(p)
    _log_level_arg(p)


def log_level(a: argparse.Namespace) -> str:
    """The ``--log-level`` flag, else the environment's level, else ``"info"`` (checked: a bad
    value in the environment is a ValueError naming the variable)."""
    import os

    if getattr(a, "log_level", None) is not None:
        return a.log_level
    for env in (LOG_LEVEL_ENV, VLLM_LOG_LEVEL_ENV):
        value = os.environ.get(env)
        if value:
            if value.lower() not in LOG_LEVELS:
                raise ValueError(f"${env} must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
            return value.lower()
    return "info"


# the sizes LLM chooses when they are left out, and the fractions it chooses them by
SIZED_OPTIONS = (*SIZED, "host_memory_fraction", "gpu_memory_utilization")
# the prefetch flags that size the staging buffers (serve, generate and plan)
PREFETCH_OPTIONS = ("prefetch", "prefetch_cap", "prefetch_ratio")


def _prefetch_args(p: argparse.ArgumentParser) -> None:
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


def _generation_config_arg(p: argparse.ArgumentParser, fields: str) -> None:
    p.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIG_MODES,
        default="auto",
        help=f"auto: a request's unset {fields} and its EOS ids come from the checkpoint's "
        "generation_config.json, as vLLM does; none: the file is not read "
        "(SamplingParams' defaults); default: %(default)s",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
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
        type=int,
        default=None,
        help="host KV pool rows per layer (default on CUDA: --max-batch requests of "
        "--max-model-len, at most what --host-memory-fraction holds; on the CPU 16384)",
    )
    p.add_argument(
        "--gpu-tokens",
        type=int,
        default=None,
        help="GPU pool rows per layer (default on CUDA: what --gpu-memory-utilization leaves "
        f"after the weights, the other KV buffers and a reserve of {RESERVE_GIB:g} GiB; on the CPU "
        "1024)",
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
        type=int,
        default=None,
        help="longest prompt + output a request may have (default on CUDA: the model's "
        "max_position_embeddings, lowered to what the host pool holds; on the CPU 4096; capped "
        "by --host-tokens; the prefill keeps this many rows a layer on the device unless "
        "--no-prefill-buffer)",
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
    _prefetch_args(p)
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
    _process_args(p)


def engine_options(a: argparse.Namespace) -> dict:
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="echo-compile", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser(
        "demo", help="offloaded long-context decode on the tiny model, lossless check"
    )
    d.add_argument("--model", default="tiny", help=MODEL_HELP)
    d.add_argument(
        "--requests",
        type=int,
        default=4,
        help="requests of random prompts, decoded as one batch (default: %(default)s)",
    )
    d.add_argument(
        "--min-len", type=int, default=200, help="shortest prompt in tokens (default: %(default)s)"
    )
    d.add_argument(
        "--max-len", type=int, default=400, help="longest prompt in tokens (default: %(default)s)"
    )
    d.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="tokens each request generates (default: %(default)s)",
    )
    d.add_argument("--kv-format", choices=KV_FORMATS, default="bf16", help=KV_FORMAT_HELP)
    d.add_argument("--device", default=None, help=DEVICE_HELP)
    d.add_argument("--compile", action="store_true", help="compile the steps (CUDA graphs on CUDA)")
    _process_args(d)

    g = sub.add_parser("generate", help="generate text for prompts given as arguments")
    _engine_args(g)
    g.add_argument(
        "prompts", nargs="+", help="the prompts, one argument each (quote one that has spaces)"
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="tokens generated per prompt at most (default: %(default)s)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, 0 is greedy (default: %(default)s)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample from the most likely tokens whose probabilities add up to this (default: the "
        "checkpoint's generation_config.json, see --generation-config, else 1.0: all tokens)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed: the same seed repeats the same tokens (default: a fresh random "
        "one per prompt)",
    )
    # (--temperature and --max-tokens always set theirs: greedy, 32 tokens by default)
    _generation_config_arg(g, "top_p / top_k / min_p / repetition_penalty")
    add_vllm_args(g, serve=False)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(s)
    s.add_argument(
        "model",  # (SUPPRESS: left out, --model's value stands; given, the later of the two)
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help="the checkpoint, as vLLM's `vllm serve MODEL` spells it (the same as --model)",
    )
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 for every interface (default: %(default)s)",
    )
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    s.add_argument(
        "--api-key",
        default=None,
        help=f"require Authorization: Bearer <key> on /v1/* (default: ${API_KEY_ENV}, else "
        f"${VLLM_API_KEY_ENV}, which keep the key out of `ps`)",
    )
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients may use for the model (default: --model)",
    )
    s.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM before they are aborted "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--max-body-mb",
        type=float,
        default=16.0,
        help="largest request body in MiB; larger ones get 413 (default: %(default)s)",
    )
    s.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        help="generation requests in flight at once; more get 429 (default: no limit)",
    )
    s.add_argument(
        "--cors-origin",
        action="append",
        default=None,
        help="allow browser requests from this origin (repeatable; '*' for any; default: "
        "none, no CORS headers)",
    )
    s.add_argument(
        "--uvicorn-log-level",
        type=str.lower,
        choices=UVICORN_LOG_LEVELS,
        default="info",
        help="level of uvicorn's log lines (its access lines are at info), as vLLM's flag "
        "(default: %(default)s)",
    )
    _generation_config_arg(s, "temperature / top_p / top_k / min_p / repetition_penalty")
    add_vllm_args(s, serve=True)

    m = sub.add_parser("make-checkpoint", help="write a random DeepSeek-V3.2 HF checkpoint")
    m.add_argument(
        "--preset",
        choices=("tiny", "bench"),
        default="tiny",
        help="tiny: the small CPU model of the tests; bench: V3.2's attention, indexer and vocab "
        "sizes with --layers layers and --experts experts (default: %(default)s)",
    )
    m.add_argument("--out", required=True, help="the new or empty directory to write (required)")
    q = m.add_mutually_exclusive_group()
    q.add_argument("--fp8", action="store_true", help="official FP8 format (weight_scale_inv)")
    q.add_argument("--awq", action="store_true", help="AutoAWQ 4-bit gemm format")
    m.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random weights: the same seed writes the same files (default: "
        "%(default)s)",
    )
    m.add_argument(
        "--layers", type=int, default=None, help="bench preset: number of layers (default: 4)"
    )
    m.add_argument(
        "--experts",
        type=int,
        default=None,
        help="bench preset: routed experts, a multiple of 8, at least 16 (default: 16)",
    )
    _process_args(m)

    pl = sub.add_parser("plan", help="per-GPU memory plan of a dp/tp deployment of V3.2")
    pl.add_argument(
        "--quant",
        choices=("awq", "fp8", "bf16"),
        default=None,
        help="V3.2's weights (default: awq); with --model the checkpoint's own",
    )
    pl.add_argument("--model", default=None, help="a checkpoint directory (default: V3.2's config)")
    pl.add_argument(
        "--gpus", type=int, default=8, help="dp = tp = GPUs unless --dp/--tp (default: %(default)s)"
    )
    pl.add_argument(
        "--dp", type=int, default=None, help="data-parallel attention ranks (default: --gpus)"
    )
    pl.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel (with --ep: expert-parallel) feed-forward ranks (default: --gpus)",
    )
    pl.add_argument("--ep", action="store_true", help="routed experts split by expert, not tp")
    # NOTE: the defaults plan the 8 x H200 deployment (docs/multi_gpu.md, $SIZES), not serve's
    pl.add_argument(
        "--gpu-tokens",
        type=int,
        default=200000,
        help="GPU pool rows per layer (default: %(default)s)",
    )
    pl.add_argument(
        "--host-tokens",
        type=int,
        default=1 << 21,
        help="host pool rows per layer (default: %(default)s)",
    )
    pl.add_argument(
        "--max-batch",
        type=int,
        default=64,
        help="requests decoded at once, as serve's flag (default: %(default)s; serve's: 8)",
    )
    pl.add_argument(
        "--max-model-len",
        type=int,
        default=163840,
        help="longest prompt + output, as serve's flag (default: %(default)s)",
    )
    pl.add_argument(
        "--kv-format",
        choices=KV_FORMATS,
        default="fp8",
        help="KV cache rows, as serve's flag (default: %(default)s; serve's: bf16)",
    )
    pl.add_argument(
        "--fp8-weights",
        choices=("auto", "bf16", "fp8"),
        default="auto",
        help="an FP8 config's weights: kept FP8 (auto, the default; fp8) or dequantised at "
        "load (bf16), as serve's flag",
    )
    pl.add_argument(
        "--no-offload", action="store_true", help="the whole KV cache on the GPU, as serve's flag"
    )
    pl.add_argument(
        "--no-prefill-buffer",
        action="store_true",
        help="no prompt buffer of --max-model-len rows a layer on the GPU, as serve's flag",
    )
    _prefetch_args(pl)  # the staging buffers they size are planned
    pl.add_argument(
        "--gpu",
        choices=("h200", "h20", "h100"),
        default="h200",
        help="the GPU whose memory is planned (default: %(default)s)",
    )
    pl.add_argument(
        "--gpu-mem-gib", type=float, default=None, help="GPU memory in GiB (default: --gpu's)"
    )
    pl.add_argument(
        "--host-mem-gib",
        type=float,
        default=None,
        help="host memory per node in GiB (default: none, the host pools unchecked)",
    )
    pl.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs (ranks) of one host: their host pools share --host-mem-gib (default: "
        "%(default)s)",
    )
    pl.add_argument(
        "--reserve-gib",
        type=float,
        default=8.0,
        help="GiB a GPU keeps for activations, graphs, NCCL (default: %(default)s)",
    )
    _process_args(pl)

    sub.add_parser("bench", help="end-to-end offloading vs GPU-only benchmark (see bench --help)")
    return ap


def _env_api_key() -> str | None:
    """The API key from the environment: ours, else vLLM's; None when neither is set (or empty)."""
    import os

    return os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or None


def serve_options(a: argparse.Namespace) -> dict:
    """``runtime.server.serve`` keyword arguments from the serve flags (checked before the model
    loads); the API key falls back to ``$ECHO_COMPILE_API_KEY``, then vLLM's ``$VLLM_API_KEY``
    (an operator moving from vLLM with only that set got a server without authentication)."""
    import math

    if not (a.shutdown_grace >= 0 and math.isfinite(a.shutdown_grace)):
        raise ValueError(f"--shutdown-grace must be a finite number >= 0, got {a.shutdown_grace}")
    if not (a.max_body_mb > 0 and math.isfinite(a.max_body_mb)):
        raise ValueError(f"--max-body-mb must be a finite number > 0, got {a.max_body_mb}")
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    if a.max_concurrent is not None and a.max_concurrent < 1:
        raise ValueError(f"--max-concurrent must be >= 1, got {a.max_concurrent}")
    return dict(
        host=a.host,
        port=a.port,
        api_key=a.api_key if a.api_key is not None else _env_api_key(),
        grace_s=a.shutdown_grace,
        asked_max_len=a.max_model_len,
        max_body_bytes=int(a.max_body_mb * 2**20),
        max_concurrent=a.max_concurrent,
        cors_origins=a.cors_origin,
        uvicorn_log_level=a.uvicorn_log_level,
    )


def sampling_params(a: argparse.Namespace, defaults=None):
    """``generate``'s parameters: the flags' values over ``defaults`` (the engine's
    ``sampling_defaults``, the checkpoint's generation config; None: ``SamplingParams()``)."""
    import dataclasses

    from runtime.sampling_params import SamplingParams

    flags = {"max_tokens": a.max_tokens, "temperature": a.temperature, "seed": a.seed}
    if a.top_p is not None:
        flags["top_p"] = a.top_p
    return dataclasses.replace(defaults or SamplingParams(), **flags)
