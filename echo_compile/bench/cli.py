"""The command line of ``echo-compile bench`` (the harness and what it measures: harness.py; its
flags: flags.py; the checks of their sizes and ranks: checks.py).

    python -m echo_compile.cli bench [options]     (= echo-compile bench; --help lists them)

Runs every system at every GPU pool size, the rate sweep at one pool, and the breakdown profiles,
and writes one JSON (after every run, so a cut-short session keeps what it measured)."""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from custom_ops.cache.config import check_prefetch
from custom_ops.kv_format import PAGE, pages_for, whole_pages
from echo_compile import settings
from echo_compile.bench.checks import check_sizes, index_topk, number_list, parallel_config
from echo_compile.bench.experiment import SYSTEMS
from echo_compile.bench.flags import parse
from echo_compile.bench.harness import System, batch_cap, breakdown_tokens
from echo_compile.bench.model_builder import build_model, weight_bytes
from echo_compile.bench.result import environment, json_safe
from echo_compile.bench.workload import Workload, sharegpt_like
from echo_compile.compile_cache import configure_compile_cache
from model.quantize import WEIGHTS
from runtime.engine_config import EngineConfig


def breakdown_key(system: str, weights: str, prefetch: str, pool: int) -> str:
    """A breakdown entry's key (``report_data.breakdown_label`` reads it): the system, the weights
    format unless bf16, the prefetch mode unless off, then the pool ("offload fp8 prefetch-global
    200000"); offload-eager's bf16 entry without prefetch is the pool alone ("200000", the form of
    the committed results). Distinct for each of these, so no entry overwrites another."""
    parts = [system] + [weights] * (weights != "bf16")
    parts += [f"prefetch-{prefetch}"] * (prefetch != "off")
    return " ".join(parts + [str(pool)]) if parts != ["offload-eager"] else str(pool)


def main(argv: list[str] | None = None) -> int:
    """``echo-compile bench ARGV`` (None: the process's arguments)."""
    return run(*parse(argv), argv)


def run(ap: argparse.ArgumentParser, a: argparse.Namespace, argv: list[str] | None) -> int:
    """The bench of ``a``, the options ``flags.parse`` read from ``argv`` (the echo-compile
    command parses before it imports this module: its --help needs no torch)."""
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    configure_compile_cache()
    if a.out is None:
        a.out = f"e2e_{a.preset}_{a.device.split(':')[0]}.json"
    if a.preset != "tiny" and not a.device.startswith("cuda"):
        # NOTE: the bench preset is the full-size attention on a GPU's memory budget; on a CPU it
        # would spend minutes building the model before anything fails
        ap.error(
            f"--preset {a.preset} needs a CUDA device (--device is {a.device!r}); "
            "use --preset tiny for a CPU dry run of the harness"
        )
    check_sizes(a, ap)
    systems = a.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"--systems: unknown system {s!r} (choose from {', '.join(SYSTEMS)})")
    prefetches = a.prefetch.split(",")
    for p in prefetches:
        if p not in ("off", "request", "global"):
            ap.error(f"--prefetch: unknown mode {p!r} (choose from off, request, global)")
    asyncs = a.async_scheduling.split(",")
    if not asyncs or any(x not in ("off", "on") for x in asyncs) or len(set(asyncs)) < len(asyncs):
        ap.error(f"--async-scheduling: {a.async_scheduling!r} is not off, on or off,on")
    keys = ("prefetch_cap", "prefetch_ratio")
    limits = {k: getattr(a, k) for k in keys if getattr(a, k) is not None}
    try:  # the engine's own rules for the prefetch options, before any model is built
        d = {f.name: f.default for f in fields(EngineConfig)} | limits
        check_prefetch("off", d["prefetch_cap"], d["prefetch_ratio"], True, a.prefetch_margin)
    except ValueError as e:
        ap.error(f"prefetch options: {e}")
    formats = a.weights.split(",")
    for w in formats:
        if w not in WEIGHTS:
            ap.error(f"--weights: unknown format {w!r} (choose from {', '.join(WEIGHTS)})")
    if len(set(formats)) < len(formats):
        ap.error(f"--weights: a format named twice in {a.weights!r}")
    if not 0.0 <= a.repeat <= 1.0:
        ap.error(f"--repeat must be in [0, 1], got {a.repeat}")
    if a.repeat > 0 and "on" in asyncs:
        print(
            "echo-compile bench: --repeat is a logits processor, which keeps the loop "
            "synchronous: --async-scheduling on runs as off (decode_ahead_fraction 0)",
            flush=True,
        )
    if not 0.0 <= a.locality < 1.0:
        ap.error(f"--locality must be in [0, 1), got {a.locality}")
    pools, rates = (
        number_list(ap, "--gpu-pools", a.gpu_pools, int),
        number_list(ap, "--rates", a.rates, float),
    )
    par = parallel_config(a, ap)
    if par is not None and (rates or a.breakdown_steps):
        # NOTE: the sweep's arrivals follow each rank's own clock (the ranks would add requests
        # at different steps), and the profiler reads one process: both stay single-process
        print("echo-compile bench: dp/tp/ep > 1: no rate sweep and no breakdown", flush=True)
        rates, a.breakdown_steps = [], 0
    if par is not None and par.ffn_ranks > 1 and formats != ["bf16"]:
        # NOTE: tp/ep cut every rank's shard from the whole 16-bit model (shard_model)
        ap.error(f"--weights {a.weights}: tp/ep > 1 needs --weights bf16")
    if any(not r > 0 for r in rates):  # (inf: all at once; nan is refused too)
        ap.error(f"--rates must be positive, got {a.rates!r}")
    if not pools:
        ap.error("--gpu-pools: give at least one pool size")
    # NOTE: a pool is otherwise checked only when its systems are built: --gpu-pools 200000,0
    # failed after every run at 200000 (minutes on a GPU), not before the model was built
    topk = index_topk(a)
    for p in pools:
        if p < 1 or (any(s != "gpu-only" for s in systems) and p < topk):
            ap.error(
                f"--gpu-pools: a pool of {p} rows cannot hold one request's selection (top-k "
                f"{topk}); each must be at least {topk}"
            )
    if a.rate_pool is None:
        a.rate_pool = 200_000 if 200_000 in pools else pools[0]  # as --eager-pools
    if rates and a.rate_pool not in pools:
        ap.error(f"--rate-pool {a.rate_pool} must be one of --gpu-pools {a.gpu_pools}")

    if a.requests < 1 or (rates and a.rate_requests < 1):
        ap.error("--requests and --rate-requests must be at least 1")
    default_pool = 200_000 if 200_000 in pools else pools[0]
    eager_pools = (
        number_list(ap, "--eager-pools", a.eager_pools, int)
        if a.eager_pools is not None
        else [default_pool]
    )
    if "offload-eager" in systems and not set(eager_pools) <= set(pools):
        ap.error(f"--eager-pools {a.eager_pools} must be among --gpu-pools {a.gpu_pools}")
    if "offload-eager" in systems and not eager_pools:
        # NOTE: offload-eager runs only at these pools: with none it ran nowhere and exited 0
        ap.error("--eager-pools: give at least one pool size (offload-eager runs only there)")
    if a.workload == "sharegpt":
        wl = sharegpt_like(a.requests)
        wl.temperature = a.temperature
    else:
        wl = Workload(a.requests, a.min_ctx, a.max_ctx, a.output_len, temperature=a.temperature)
    wl.prefill = a.mode == "full"
    sweep = [replace(wl, requests=a.rate_requests, rate=r) for r in rates]

    longest = pages_for(wl.max_ctx + wl.output_len) * PAGE
    if "gpu-only" in systems and whole_pages(min(pools)) < longest:
        ap.error(
            f"gpu-only: a GPU pool of {min(pools)} rows cannot hold the longest request "
            f"({wl.max_ctx} + {wl.output_len} tokens, {longest} rows in whole pages)"
        )
    # every request of the largest workload at once, in whole pages
    most = max([wl] + sweep, key=lambda w: w.requests)
    # NOTE: the breakdown's requests (the workload's first ones) generate breakdown_tokens each:
    # sized for output_len alone, a longer breakdown profiled a smaller batch than it recorded
    # (the host pool held fewer of them) or failed after the runs (past the context limit)
    gen = max(wl.output_len, breakdown_tokens(a.breakdown_steps) if a.breakdown_steps > 0 else 0)
    host = a.host_tokens or PAGE * sum(pages_for(n + gen) for n in most.lengths())
    # now that the host pool's size is known: the cap's bound by it (the offloading systems'
    # runs only: gpu-only runs prefetch off, below)
    for p in prefetches if any(s != "gpu-only" for s in systems) else []:
        try:
            check_prefetch(p, d["prefetch_cap"], d["prefetch_ratio"], True, a.prefetch_margin, host)
        except ValueError as e:
            ap.error(f"prefetch options: {e}")
    t_start = time.perf_counter()
    parallel, first = None, True
    if par is not None:
        from runtime.distributed.process import init_distributed

        dev = None if a.device in ("cuda", "cuda:0") else a.device
        ctx = init_distributed(dev, a.collective_timeout)
        if ctx.world_size != par.world_size:
            ap.error(
                f"--dp {a.dp} --tp {a.tp} --ep {a.ep} need {par.world_size} processes, this job "
                f"has {ctx.world_size}: launch with torchrun --nproc-per-node {par.world_size}"
            )
        a.device, parallel, first = ctx.device, (ctx, a.dp, a.tp, a.ep), ctx.rank == 0
    max_len = wl.max_ctx + gen + 64
    out = {
        "environment": environment(),
        "command": "echo-compile bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {},
        "workload": asdict(wl),
        "locality": a.locality,
        "repeat": a.repeat,
        "host_tokens": host,
        "kv_format": a.kv_format,
        "prefetch": prefetches,
        "prefetch_margin": a.prefetch_margin,
        "async_scheduling": asyncs,
        "decode_during_prefill": not a.prefill_first,
        "dynamic_decode": a.dynamic_decode,
        "weights": formats,
        "weight_bytes": {},
        "compiled": a.compile,
        "compile_prefill": wl.prefill and a.compile and not a.eager_prefill,
        "kernel_backend": a.kernel_backend,
        "fill_uninitialized": settings.FILL_UNINITIALIZED,
        "parallel": {"dp": a.dp, "tp": a.tp, "ep": a.ep},
        "results": [],
        "breakdown": {},
    }
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every run, so a cut-short session still leaves its results
        out["elapsed_s"] = time.perf_counter() - t_start
        c = torch._dynamo.utils.counters  # the process's so far (every run before this save)
        out["graph_gates"] = {
            "cudagraph_skips": c["inductor"].get("cudagraph_skips", 0),
            "cudagraph_partitions": c["inductor"].get("cudagraph_partitions", 0),
            "graph_breaks": sum(c["graph_break"].values()),
        }
        if first:  # multi-process: rank 0 writes (its throughput counts every rank's tokens)
            path.write_text(json.dumps(json_safe(out), indent=1, allow_nan=False))

    jobs = [
        (s, p, x == "on")
        for s in systems
        for p in (prefetches if s != "gpu-only" else ["off"])
        for x in asyncs
    ]
    for weights in formats:  # one model at a time: each format's weights fill the device alone
        model = sut = None  # the previous format's model freed before the next is built
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        model = build_model(a.preset, a.layers, a.experts, a.device, a.locality, weights)
        if par is not None and par.ffn_ranks > 1:  # every rank built the same weights: its shard
            from model.shard_loader import shard_model
            from runtime.distributed.dist_engine import tp_group

            model = shard_model(model, tp_group(ctx, replace(par, device=a.device)), ep=a.ep > 1)
        cfg = model.config
        # the 16-bit model's config (each format's quantization_config: its runs' "weights")
        out["model"] = out["model"] or replace(cfg, quantization=None).to_dict()
        out["weight_bytes"][weights] = weight_bytes(model)
        save()
        for pool, (system, prefetch, asynchronous) in itertools.product(pools, jobs):
            eager = system == "offload-eager"
            if eager and pool not in eager_pools:
                continue
            runs = [wl] + (sweep if pool == a.rate_pool and not eager else [])
            cap = batch_cap(system, pool, cfg.index_topk, wl.min_ctx + wl.output_len, a.max_batch)
            cap = min(cap, max(r.requests for r in runs))
            buckets = {r.requests % cap for r in runs if r.rate == float("inf")} - {0}
            if len(runs) > 1 and system == "offload":  # arrivals spread out: smaller batches too
                buckets |= {b for b in (16, 32) if b < 2 * a.rate_requests}
            sut = System(
                model, system, pool, host, a.kv_format, max_len, cap, tuple(buckets), a.device,
                a.repeat, wl.seed, a.compile, a.kernel_backend, prefetch, parallel,
                compile_prefill=wl.prefill and not a.eager_prefill,
                prefetch_margin=a.prefetch_margin, prefetch_limits=limits,
                async_scheduling=asynchronous,
                decode_during_prefill=not a.prefill_first, dynamic_decode=a.dynamic_decode,
            )  # fmt: skip
            for run in runs:
                r = sut.run(run)
                out["results"].append(asdict(r))
                save()
                print_rank0 = print if first else (lambda *_, **__: None)
                # no gaps: not measured (a CPU run), which "0.00 ms" read as measured
                idle = f"{r.decode_gpu_idle_ms:.2f} ms" if r.decode_gpu_idle_gaps else "-"
                print_rank0(
                    f"{system:14s} {weights} weights, prefetch {prefetch:7s} async "
                    f"{'on ' if asynchronous else 'off'} pool {pool:7d} rate "
                    f"{run.rate:5g}: {r.throughput_tok_s:9.1f} tok/s (median step "
                    f"{r.step_ms_median:.2f} ms, host gap {r.decode_host_gap_ms:.2f} ms, GPU "
                    f"idle {idle}), "
                    f"batch {r.effective_batch:5.1f}, hit rate "
                    f"{' '.join(f'{h:.2f}' for h in r.hit_rate) or '-'} "
                    f"at {r.pool_rows_per_request:.0f} pool rows/request "
                    f"(warm-up {r.warmup_s:.0f} s, {time.perf_counter() - t_start:.0f} s in)",
                    flush=True,
                )
            if (
                (system != "offload" or a.breakdown_graphs)
                # the eager systems at the first prefetch mode; the graphs at each
                and (prefetch == prefetches[0] or system == "offload")
                and asynchronous == (asyncs[0] == "on")
                and pool in eager_pools
                and a.breakdown_steps > 0
            ):
                bd = sut.breakdown(wl, steps=a.breakdown_steps, graphs=a.breakdown_graphs)
                key = breakdown_key(system, weights, prefetch, pool)
                out["breakdown"][key] = bd
                save()
                parts = ", ".join(f"{k} {v:.2f}" for k, v in bd["ms_per_step"].items())
                how = "graph replays" if bd["graphs"] else "eager"
                print(f"breakdown {key} (ms/step, {how}, {bd['time']} time): {parts}")
            sut.close()
    save()
    if first:
        print(f"wrote {a.out} ({out['elapsed_s']:.0f} s)")
    if parallel is not None:
        from runtime.distributed.process import finish

        finish()
    return 0
