"""The flags of ``echo-compile bench`` (checks.py checks their values, cli.py runs them)."""

from __future__ import annotations

import argparse

from echo_compile.bench import experiment
from echo_compile.bench.experiment import SYSTEMS

# NOTE: no torch here: `echo-compile bench --help` and a usage error answer without the seconds
# torch takes to import (echo_compile/cli_args.py says why), so the defaults that live in modules
# importing torch are spelled here (tests/test_cli_help.py holds them to those constants):
BACKENDS = ("auto", "triton", "deep_gemm", "flashinfer")  # custom_ops.backends.select.BACKENDS
DEFAULT_BACKEND = "auto"  # custom_ops.backends.select.DEFAULT_BACKEND
PREFETCH_MARGIN = 2.0  # custom_ops.cache.config.PREFETCH_MARGIN
BENCH_LOCALITY = 0.86  # model.locality.BENCH_LOCALITY

# --preset tiny's sizes where no flag sets them: a dry run of the harness in about a minute on
# two CPU cores (the bench preset's 64 requests of 80K-100K tokens took ~20 GB of host memory)
TINY_DEFAULTS = {"requests": 4, "min_ctx": 200, "max_ctx": 300, "output_len": 4, "max_batch": 4}


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the options of ``argv`` (None: the process's arguments); ``--preset tiny``
    swaps in ``TINY_DEFAULTS``, the flags given still win. ``--help`` and usage errors exit
    here, before any torch; ``--device`` is left None when not given (cli.run picks it)."""
    ap = parser()
    if ap.parse_known_args(argv)[0].preset == "tiny":
        ap.set_defaults(**TINY_DEFAULTS)
    return ap, ap.parse_args(argv)


def parser() -> argparse.ArgumentParser:
    """The bench's flags (``--preset tiny``'s own defaults: ``parse``)."""
    ap = argparse.ArgumentParser(
        prog="echo-compile bench",
        description=experiment.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--preset",
        choices=("bench", "tiny"),
        default="bench",
        help="tiny: a CPU dry run of the harness (its own defaults: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in TINY_DEFAULTS.items())
        + "; default: %(default)s)",
    )
    ap.add_argument(
        "--layers", type=int, default=4, help="the model's layers (default: %(default)s)"
    )
    ap.add_argument(
        "--experts",
        type=int,
        default=16,
        help="routed experts, a multiple of 8, at least 16 (default: %(default)s)",
    )
    ap.add_argument(
        "--workload",
        choices=("long", "sharegpt"),
        default="long",
        help="long: InfiniteBench-like lengths (--min-ctx/--max-ctx); sharegpt: short prompts "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--mode",
        choices=("decode-only", "full"),
        default="decode-only",
        help="decode-only: inject each prompt's KV (PD-disaggregated); full: prefill it too "
        "(the compiled sparse prefill of a served engine; --eager-prefill: eager chunks; "
        "default: %(default)s)",
    )
    ap.add_argument(
        "--eager-prefill",
        action="store_true",
        help="--mode full: run the prefill chunks eagerly instead of compiled",
    )
    ap.add_argument(
        "--requests", type=int, default=64, help="requests per run (default: %(default)s)"
    )
    ap.add_argument(
        "--min-ctx",
        type=int,
        default=80_000,
        help="long: shortest context in tokens (default: %(default)s)",
    )
    ap.add_argument(
        "--max-ctx",
        type=int,
        default=100_000,
        help="long: longest context in tokens (default: %(default)s)",
    )
    ap.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="tokens per request (InfiniteBench: 256; 128 keeps the default run under 10 min; "
        "default: %(default)s)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, 0 is greedy (default: %(default)s)",
    )
    ap.add_argument(
        "--locality",
        type=float,
        default=BENCH_LOCALITY,
        help="the locality model's knob λ in [0, 1) planted in the random weights (0: none; "
        "docs/prefetch.md, 'Locality model'; benchmarks/calibrate_locality.py calibrates it; "
        "default: %(default)s)",
    )
    ap.add_argument(
        "--repeat",
        type=float,
        default=0.0,
        help="probability that a decode input repeats the previous one (a second locality "
        "knob; e2e_h200.json was taken with --locality 0 --repeat 1; default: %(default)s)",
    )
    ap.add_argument(
        "--gpu-pools",
        default="325000,200000,110000",
        help="GPU pool rows per layer (N_G), comma-separated to run each (default: %(default)s)",
    )
    ap.add_argument(
        "--host-tokens",
        type=int,
        default=0,
        help="host pool rows per layer (default: 0, enough for every request)",
    )
    ap.add_argument(
        "--kv-format",
        choices=("bf16", "fp8"),
        default="fp8",
        help="KV cache rows: bf16, or fp8 (FlashMLA's 656-byte row; default: %(default)s)",
    )
    ap.add_argument(
        "--max-batch",
        type=int,
        default=64,
        help="requests decoded at once at most (default: %(default)s)",
    )
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="the systems to run, comma-separated (the description above says what each is; "
        "default: %(default)s)",
    )
    ap.add_argument(
        "--kernel-backend",
        choices=BACKENDS,
        default=DEFAULT_BACKEND,
        help="the decode indexer's kernels, for every system (docs/backends.md; default: "
        "%(default)s)",
    )
    ap.add_argument(
        "--prefetch",
        default="off",
        help="lossless decode prefetch of the offloading systems, comma-separated to run each: "
        "off, request, global (docs/prefetch.md; default: %(default)s)",
    )
    ap.add_argument(
        "--prefill-first",
        action="store_true",
        help="--mode full: decoding requests wait for every pending prefill chunk "
        "(EngineConfig.decode_during_prefill=False; by default decodes run between chunks)",
    )
    ap.add_argument(
        "--dynamic-decode",
        action="store_true",
        help="compile the decode step once for every bucket, its batch dim symbolic "
        "(EngineConfig.dynamic_decode)",
    )
    ap.add_argument(
        "--async-scheduling",
        default="off",
        help="launch each decode step before reading the last one's tokens (EngineConfig."
        "async_scheduling), comma-separated to run each: off, on (default: %(default)s)",
    )
    ap.add_argument(
        "--prefetch-margin",
        type=float,
        default=PREFETCH_MARGIN,
        help="the prefetch threshold's margin over the EMA of the k-th score, in EMAs of the "
        f"k-th score's distance from it (default: {PREFETCH_MARGIN:g}; 0 = ECHO's threshold)",
    )
    ap.add_argument(
        "--prefetch-cap",
        type=int,
        default=None,
        help="staged rows per request and layer: the request mode's cap and, times the batch, "
        "the staging buffer (default: EngineConfig.prefetch_cap)",
    )
    ap.add_argument(
        "--prefetch-ratio",
        type=float,
        default=None,
        help="the global mode's budget, staged rows per context token of the batch (default: "
        "EngineConfig.prefetch_ratio)",
    )
    ap.add_argument(
        "--weights",
        default="bf16",
        help="the model's weights, comma-separated to run each: bf16 (as drawn), awq, fp8 (those "
        "weights quantised in memory and served as the loader serves an AutoAWQ / official FP8 "
        "checkpoint of them; fp8 kept FP8, as --fp8-weights' default serves an FP8 checkpoint; "
        "docs/quantization.md, 'End to end'; default: %(default)s)",
    )
    ap.add_argument(
        "--eager-pools",
        default=None,
        help="pools at which offload-eager runs (default: 200000 if among --gpu-pools, else the "
        "first of them)",
    )
    ap.add_argument(
        "--rates",
        default="2,4,8,16",
        help="Poisson request rates (req/s) of the rate sweep (Fig. 12); empty: no sweep "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--rate-pool",
        type=int,
        default=None,
        help="the sweep's GPU pool (default: 200000 if among --gpu-pools, else the first of them)",
    )
    ap.add_argument(
        "--rate-requests",
        type=int,
        default=16,
        help="requests per sweep point (default: %(default)s)",
    )
    ap.add_argument(
        "--breakdown-steps",
        type=int,
        default=8,
        help="profiled eager steps of offload-eager and gpu-only (at --eager-pools); 0: none "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--breakdown-graphs",
        action="store_true",
        help="profile the compiled systems' own steps (CUDA graph replays, offload included, "
        "each --prefetch mode) instead of eager ones: the kernels by name, the total and the "
        "cache ops' share (their kernels by name), no other categories",
    )
    ap.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run every system eagerly (a quick dry run of the harness; the numbers then say "
        "nothing about CUDA graphs)",
    )
    ap.add_argument(
        "--device",
        default=None,
        help="cpu or cuda (default: cuda when available, else cpu)",
    )
    ap.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel attention ranks (torchrun; default: %(default)s)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel feed-forward ranks (default: %(default)s)",
    )
    ap.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks, instead of --tp (default: %(default)s)",
    )
    ap.add_argument(
        "--collective-timeout",
        type=float,
        default=300.0,
        help="seconds a rank waits for the others before it stops (dp/tp/ep > 1; default: "
        "%(default)s)",
    )
    ap.add_argument(
        "--out",
        help="the JSON results (default: e2e_PRESET_DEVICE.json in the current directory; the "
        "committed results under benchmarks/results/ are written only when named)",
    )
    return ap
