"""``echo-compile plan``'s flags: a dp/tp deployment of V3.2 to plan the per-GPU memory of, with
serve's sizing flags (its defaults: the 8 x H200 deployment, not serve's; the sizes left out are
chosen as serve chooses them, from the GPU's and the host's memory)."""

from __future__ import annotations

import argparse

from echo_compile.engine_args import KV_FORMATS, add_prefetch_args, token_count
from echo_compile.process_args import add_process_args
from runtime.kv_sizing import GPU_MEMORY_UTILIZATION, HOST_MEMORY_FRACTION, RESERVE_GIB

# NOTE: no torch here either: the flags are in every --help (cli_args.py says why).

AUTO = "default: chosen as serve chooses it, from --gpu's memory and --host-mem-gib"


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """plan's flags: the deployment (weights, ranks), its sizes as serve's flags, the GPU and host
    memory it is planned against."""
    p.add_argument(
        "--quant",
        choices=("awq", "fp8", "bf16"),
        default=None,
        help="V3.2's weights (default: awq); with --model the checkpoint's own",
    )
    p.add_argument("--model", default=None, help="a checkpoint directory (default: V3.2's config)")
    p.add_argument(
        "--gpus", type=int, default=8, help="dp = tp = GPUs unless --dp/--tp (default: %(default)s)"
    )
    p.add_argument(
        "--dp", type=int, default=None, help="data-parallel attention ranks (default: --gpus)"
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel (with --ep: expert-parallel) feed-forward ranks (default: --gpus)",
    )
    p.add_argument("--ep", action="store_true", help="routed experts split by expert, not tp")
    # NOTE: the defaults plan the 8 x H200 deployment (docs/multi_gpu.md), not serve's; the
    # sizes left out are serve's choice for it (runtime/kv_sizing.py, the one rule)
    p.add_argument(
        "--gpu-tokens",
        type=token_count,
        default=None,
        help=f"GPU pool rows per layer, at most --host-tokens ({AUTO}, after the weights, the "
        "other KV buffers and --reserve-gib)",
    )
    p.add_argument(
        "--host-tokens",
        type=token_count,
        default=None,
        help=f"host pool rows per layer ({AUTO}: --max-batch requests of --max-model-len, at "
        "most what --host-memory-fraction of it holds)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=64,
        help="requests decoded at once, as serve's flag (default: %(default)s; serve's: 8)",
    )
    p.add_argument(
        "--max-model-len",
        type=token_count,
        default=None,
        help="longest prompt + output, as serve's flag (default: the model's "
        "max_position_embeddings, V3.2's 163840, at most what the host pool holds, as serve's)",
    )
    p.add_argument(
        "--kv-format",
        choices=KV_FORMATS,
        default="fp8",
        help="KV cache rows, as serve's flag (default: %(default)s; serve's: bf16)",
    )
    p.add_argument(
        "--fp8-weights",
        choices=("auto", "bf16", "fp8"),
        default="auto",
        help="an FP8 config's weights: kept FP8 (auto, the default; fp8) or dequantised at "
        "load (bf16), as serve's flag",
    )
    p.add_argument(
        "--no-offload", action="store_true", help="the whole KV cache on the GPU, as serve's flag"
    )
    p.add_argument(
        "--no-prefill-buffer",
        action="store_true",
        help="no prompt buffer of --max-model-len rows a layer on the GPU, as serve's flag",
    )
    add_prefetch_args(p)  # the staging buffers they size are planned
    p.add_argument(
        "--gpu",
        choices=("h200", "h20", "h100"),
        default="h200",
        help="the GPU whose memory is planned (default: %(default)s)",
    )
    p.add_argument(
        "--gpu-mem-gib", type=float, default=None, help="GPU memory in GiB (default: --gpu's)"
    )
    p.add_argument(
        "--host-mem-gib",
        type=float,
        default=None,
        help="host memory per node in GiB, the memory serve would read: sizes --host-tokens "
        "and checks the host pools (default: none, the host pools unchecked; needed where a "
        "size is left out)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs (ranks) of one host: their host pools share --host-mem-gib (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--reserve-gib",
        type=float,
        default=RESERVE_GIB,
        help="GiB a GPU keeps for activations, graphs, NCCL, as serve's sizing keeps "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--host-memory-fraction",
        type=float,
        default=None,
        help="as serve's: the share of --host-mem-gib the host KV pools of a host's ranks may "
        f"take, when --host-tokens is left out (default: {HOST_MEMORY_FRACTION:g})",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="as serve's (vLLM's): the share of the GPU's memory that sizes --gpu-tokens when it "
        f"is left out (default: {GPU_MEMORY_UTILIZATION:g})",
    )
    add_process_args(p)
