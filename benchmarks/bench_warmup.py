"""Warm-up time of the README's ``echo_compile.compile`` example: the tiny model compiled with
``max_batch=4, prefill_chunk=256``, then ``cm.warmup()`` (every bucket compiled and, on CUDA,
captured), timed.

    python -m benchmarks.bench_warmup [--device cpu] [--out benchmarks/results/warmup_cpu.json]
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python -m benchmarks.bench_warmup   (a first run's time)

Inductor caches compiled graphs on disk: a second run of the same example compiles faster than a
first; the JSON says whether the caches were off.

Writes the buckets, the total seconds and their mean per bucket, and the environment (device,
versions, threads, date).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch

import echo_compile
from echo_compile.bench.harness import environment
from model.loader import load_model

COLD = "TORCHINDUCTOR_FORCE_DISABLE_CACHES"  # inductor's: every graph compiled afresh


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default: cuda when available)")  # fmt: skip
    ap.add_argument("--out", default=None,
                    help="the JSON (default: benchmarks/results/warmup_DEVICE.json)")  # fmt: skip
    a = ap.parse_args(argv)
    out = Path(a.out or f"benchmarks/results/warmup_{a.device.split(':')[0]}.json")
    model, _ = load_model("tiny", device=a.device)
    # the README's example, as written there
    cm = echo_compile.compile(
        model, host_tokens=4096, gpu_tokens=1024, max_batch=4, prefill_chunk=256
    )  # fmt: skip
    graphs = [(kind, b) for kind, buckets, _ in cm.runner.compiled for b in buckets]
    total = cm.warmup(progress=False)  # (ModelRunner.warmup: 3 calls a bucket, then frozen)
    print(f"{len(graphs)} graphs, {total:.1f} s in all, {total / len(graphs):.1f} s each")
    env = environment() | {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "inductor_caches": "off" if os.environ.get(COLD) == "1" else "on",
        "machine": platform.machine(),
    }
    command = "python -m benchmarks.bench_warmup --device " + a.device
    res = {
        "what": "README's compile example: cm.warmup() seconds (3 calls a bucket)",
        "command": (f"{COLD}=1 " if os.environ.get(COLD) == "1" else "") + command,
        "env": env,
        "graphs": [f"{kind} {b}" for kind, b in graphs],
        "total_s": round(total, 1),
        "per_graph_s": round(total / len(graphs), 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
