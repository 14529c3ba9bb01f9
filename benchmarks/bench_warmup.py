"""Warm-up time of the README's ``echo_compile.compile`` example: the tiny model compiled with
``max_batch=4, prefill_chunk=256``, then ``cm.warmup()`` (every bucket compiled and, on CUDA,
captured), timed.

    python -m benchmarks.bench_warmup [--device cpu] [--out benchmarks/results/warmup_cpu.json]
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python -m benchmarks.bench_warmup   (a first run's time)

Inductor caches compiled graphs on disk: a second run of the same example compiles faster than a
first; the JSON says whether the caches were off.

Writes the buckets, the total seconds and their mean per bucket, and the environment (device,
versions, threads, date).

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python -m benchmarks.bench_warmup --layers 1 2 4 8 \
        [--out benchmarks/results/warmup_layers_cpu.json]

``--layers``: how warm-up grows with the layer count. The tiny architecture (random weights) with
each number of layers (layer 0 dense, the rest MoE: first_k_dense_replace 1), ONE decode graph
(bucket B=1, prefill not compiled), each count in a fresh process (no kernel compiled for one
count is reused by another); the seconds of ``cm.warmup()`` and a linear fit of them against the
layer count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

import echo_compile
from echo_compile.bench.result import environment
from model.config import ModelConfig
from model.loader import load_model
from model.model import DeepseekV32ForCausalLM
from model.presets import tiny_config_dict

COLD = "TORCHINDUCTOR_FORCE_DISABLE_CACHES"  # inductor's: every graph compiled afresh


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default: cuda when available)")  # fmt: skip
    ap.add_argument("--out", default=None,
                    help="the JSON (default: benchmarks/results/warmup_DEVICE.json)")  # fmt: skip
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="layer counts: one decode graph each, in its own process")  # fmt: skip
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # (the child)
    a = ap.parse_args(argv)
    if a.one is not None:
        print(json.dumps(one_decode_graph(a.one, a.device)))
        return 0
    if a.layers:
        return layer_sweep(a)
    out = Path(a.out or f"benchmarks/results/warmup_{a.device.split(':')[0]}.json")
    model, _ = load_model("tiny", device=a.device)
    # the README's example, as written there
    cm = echo_compile.compile(
        model, host_tokens=4096, gpu_tokens=1024, max_batch=4, prefill_chunk=256
    )  # fmt: skip
    graphs = [(kind, b) for kind, buckets, _ in cm.runner.compiled for b in buckets]
    total = cm.warmup(progress=False)  # (ModelRunner.warmup: 3 calls a bucket, then frozen)
    print(f"{len(graphs)} graphs, {total:.1f} s in all, {total / len(graphs):.1f} s each")
    env = _env()
    command = "python -m benchmarks.bench_warmup --device " + a.device
    res = {
        "what": "README's compile example: cm.warmup() seconds (3 calls a bucket)",
        "command": _cold_prefix() + command,
        "env": env,
        "graphs": [f"{kind} {b}" for kind, b in graphs],
        "total_s": round(total, 1),
        "per_graph_s": round(total / len(graphs), 1),
    }
    _write(out, res)
    return 0


def _env() -> dict:
    return environment() | {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "inductor_caches": "off" if os.environ.get(COLD) == "1" else "on",
        "machine": platform.machine(),
    }


def _cold_prefix() -> str:
    return f"{COLD}=1 " if os.environ.get(COLD) == "1" else ""


def _write(out: Path, res: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


def one_decode_graph(layers: int, device: str) -> dict:
    """The tiny architecture with ``layers`` layers, random weights: ``cm.warmup()`` seconds of
    its one decode graph (B=1), and Dynamo's graph and graph-break counts."""
    from torch._dynamo.utils import counters

    cfg = ModelConfig.from_dict(tiny_config_dict() | {"num_hidden_layers": layers})
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(cfg)
    model.to_empty(device=device).random_init_()
    cm = echo_compile.compile(
        model, host_tokens=4096, gpu_tokens=1024, max_batch=1, decode_buckets=(1,),
        compile_prefill=False,
    )  # fmt: skip
    counters.clear()
    total = cm.warmup(progress=False)
    dense = cfg.first_k_dense_replace
    return {
        "layers": layers,
        "dense_layers": min(dense, layers),
        "moe_layers": max(layers - dense, 0),
        "warmup_s": round(total, 1),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def layer_sweep(a: argparse.Namespace) -> int:
    rows = []
    for n in a.layers:
        cmd = [sys.executable, "-m", "benchmarks.bench_warmup", "--one", str(n), "--device",
               a.device]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    res = {
        "what": "one decode graph (B=1) of the tiny architecture by layer count: cm.warmup() s",
        "command": _cold_prefix()
        + "python -m benchmarks.bench_warmup --layers "
        + " ".join(map(str, a.layers)),
        "env": _env(),
        "rows": rows,
    }
    if len(rows) > 1:
        base, per = _fit([r["layers"] for r in rows], [r["warmup_s"] for r in rows])
        res["fit"] = {"intercept_s": round(base, 1), "per_layer_s": round(per, 2)}
        # an extrapolation of the tiny architecture's compile time, not a measurement
        res["extrapolated_61_layers_s"] = round(base + 61 * per, 1)
        print(f"fit: {base:.1f} s + {per:.2f} s a layer; 61 layers: {base + 61 * per:.0f} s")
    _write(Path(a.out or f"benchmarks/results/warmup_layers_{a.device}.json"), res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
