"""The tables of docs/e2e_report.md and docs/compile.md, from the committed result files.

    python -m benchmarks.e2e_summary [--e2e benchmarks/results/e2e_h200.json]
                                      [--step benchmarks/results/step_b{1,16,64}_h200.json]
                                      [--weights e2e_weights_bf16_h200.json ...]

Prints markdown. Every number is a field of the JSON or a ratio of fields:
- "measured" throughput is the bench's own: generated tokens / (wall - KV injection);
- "steady" throughput is effective batch / median decode step: the decode rate with the batch
  full, without the ramp-up, the last partial wave and the host work between requests.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from benchmarks.report_data import (
    BREAKDOWN_CATEGORIES,
    RESULTS,
    STEP_FILES,
    breakdown_label,
    load_steps,
    row_rate,
)


def steady(r: dict) -> float:
    return r["effective_batch"] / r["step_ms_median"] * 1e3 if r["step_ms_median"] else 0.0


def _hits(r: dict) -> str:
    h = r.get("hit_rate") or []
    return " / ".join(f"{x:.2f}" for x in h) if h else "-"


def _serving(r: dict) -> str:
    """The time the throughput divides by, and how much of it the engine's steps and taking
    requests in (add_request) took; the rest is the loop around them."""
    if "add_s" not in r:
        return "-"
    return f"{r['serve_s']:.2f}: {r['steps_s']:.2f} + {r['add_s']:.2f}"


def _system(r: dict) -> str:
    """The run's system, with its weights when they are not bf16 (``--weights``)."""
    w = r.get("weights", "bf16")
    return r["system"] if w == "bf16" else f"{r['system']} ({w})"


def weights_table(ds: list[dict]) -> list[str]:
    """The all-at-once runs of one or more bench JSONs (``--weights``: e.g. one file per
    format), each next to the bf16 run of the same system, pool and prefetch: x bf16."""
    rows = [r for d in ds for r in d["results"] if row_rate(r) == math.inf]

    def key(r: dict) -> tuple:
        return (r["system"], r["gpu_pool_tokens"], r.get("prefetch", "off"))

    bf16 = {key(r): r for r in rows if r.get("weights", "bf16") == "bf16"}
    out = [
        "| weights | system | pool | weight GB | measured tok/s | x bf16 | steady tok/s | x bf16 "
        "| step p50 | eff. batch | hit rate per layer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = bf16.get(key(r))
        x = f"{r['throughput_tok_s'] / b['throughput_tok_s']:.2f}x" if b else "-"
        xs = f"{steady(r) / steady(b):.2f}x" if b and steady(b) else "-"
        out.append(
            f"| {r.get('weights', 'bf16')} | {r['system']} | {r['gpu_pool_tokens']:,} | "
            f"{r.get('weight_bytes', 0) / 1e9:.2f} | {r['throughput_tok_s']:.0f} | {x} | "
            f"{steady(r):.0f} | {xs} | {r['step_ms_median']:.2f} ms | "
            f"{r['effective_batch']:.1f} | {_hits(r)} |"
        )
    return out


def e2e_tables(d: dict) -> list[str]:
    rows = d["results"]
    env, wl = d["environment"], d["workload"]
    out = [
        f"`{d.get('command', 'echo-compile bench')}` — {env['device']}, torch {env['torch']}, "
        f"triton {env['triton']}, {env['date']}; {d['model']['num_hidden_layers']} layers, "
        f"{wl['requests']} requests of {wl['min_ctx']:,}-{wl['max_ctx']:,} tokens, "
        f"{wl['output_len']} outputs, {d['kv_format']} KV, repeat {d.get('repeat', '?')}, "
        f"{' / '.join(d.get('weights', ['bf16']))} weights"
        + (f", {d['elapsed_s']:.0f} s in all" if "elapsed_s" in d else ""),
        "",
        "| pool | system | measured tok/s | steady tok/s | eff. batch (max) | step p50 | "
        "ITL p50 / p99 | TTFT p50 | serving s: steps + intake | hit rate per layer | "
        "recalled rows/step/layer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    once = [r for r in rows if row_rate(r) == math.inf]
    for r in once:
        out.append(
            f"| {r['gpu_pool_tokens']:,} | {_system(r)} | {r['throughput_tok_s']:.0f} | "
            f"{steady(r):.0f} | {r['effective_batch']:.1f} ({r.get('max_batch', '?')}) | "
            f"{r['step_ms_median']:.2f} ms | {r['itl_ms'].get('p50', 0):.1f} / "
            f"{r['itl_ms'].get('p99', 0):.1f} ms | {r['ttft_s'].get('p50', 0):.2f} s | "
            f"{_serving(r)} | {_hits(r)} | {r['recalled_rows_per_step']:,.0f} |"
        )
    out += ["", "| pool | offload / GPU-only, measured | steady | offload compiled / eager |"]
    out.append("|---|---|---|---|")
    for pool, w in dict.fromkeys((r["gpu_pool_tokens"], r.get("weights", "bf16")) for r in once):
        by = {r["system"]: r for r in once
              if r["gpu_pool_tokens"] == pool and r.get("weights", "bf16") == w}  # fmt: skip
        off, gpu, eager = by.get("offload"), by.get("gpu-only"), by.get("offload-eager")
        ratio = f"{off['throughput_tok_s'] / gpu['throughput_tok_s']:.2f}x" if off and gpu else "-"
        st = f"{steady(off) / steady(gpu):.2f}x" if off and gpu else "-"
        gr = f"{off['throughput_tok_s'] / eager['throughput_tok_s']:.2f}x" if off and eager else "-"
        label = f"{pool:,}" if w == "bf16" else f"{pool:,} ({w})"
        out.append(f"| {label} | {ratio} | {st} | {gr} |")
    sweep = [r for r in rows if row_rate(r) != math.inf]
    if sweep:
        out += [
            "",
            "| rate (req/s) | system | measured tok/s | eff. batch | ITL p50 | TTFT p50 | "
            "hit rate per layer |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sorted(sweep, key=lambda r: (r["system"], row_rate(r))):
            out.append(
                f"| {row_rate(r):g} | {_system(r)} | {r['throughput_tok_s']:.0f} | "
                f"{r['effective_batch']:.1f} | {r['itl_ms'].get('p50', 0):.1f} ms | "
                f"{r['ttft_s'].get('p50', 0):.2f} s | {_hits(r)} |"
            )
    if d.get("breakdown"):
        out += ["", breakdown_row_header(), "|---|---|---|---|---|---|---|---|---|"]
    for pool, e in (d.get("breakdown") or {}).items():
        out.append(breakdown_row(f"{breakdown_label(pool)}, batch {e.get('batch')}", e))
    return out


def breakdown_row_header() -> str:
    return "| eager step | " + " | ".join(BREAKDOWN_CATEGORIES) + " | total | cache share |"


def breakdown_row(label: str, e: dict) -> str:
    ms = e["ms_per_step"]
    cells = " | ".join(f"{ms.get(c, 0.0):.2f}" for c in BREAKDOWN_CATEGORIES)
    share = ms.get("cache management", 0.0) / e["total_ms"]
    return f"| {label} | {cells} | {e['total_ms']:.2f} ms | {share:.0%} |"


def step_tables(d: dict) -> list[str]:
    env = d["environment"]
    dates = ", ".join(d.get("dates", [env["date"]]))
    out = [
        f"`benchmarks/bench_step.py` — {env['device']}, torch {env['torch']}, {dates}; "
        f"{d['model']['num_hidden_layers']} layers, context {d['ctx']:,}, {d['steps']} steps, "
        f"{d['kv_format']} KV, repeat {d.get('repeat', '?')}",
        "",
        "| B | offload compiled | offload eager | graphs speed-up | GPU-only compiled | "
        "1 - GPU-only / offload | hit rate per layer |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        st = r["step_ms"]
        out.append(
            f"| {r['batch']} | {st['offload']:.2f} ms | {st['offload_eager']:.2f} ms | "
            f"{r['graphs_speedup']:.2f}x | {st['gpu_only']:.2f} ms | "
            f"{r['cache_management_share']:.0%} | {_hits(r)} |"
        )
    out += ["", breakdown_row_header(), "|---|---|---|---|---|---|---|---|---|"]
    for key, name in (("breakdown", "offload"), ("breakdown_gpu_only", "GPU-only")):
        for r in d["rows"]:
            if r.get(key):
                out.append(breakdown_row(f"{name}, B={r['batch']}", r[key]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--e2e", type=Path, default=RESULTS / "e2e_h200.json")
    ap.add_argument(
        "--step",
        type=Path,
        nargs="+",
        default=[RESULTS / f for f in STEP_FILES],
        help="bench_step JSONs of one model and context, e.g. one per batch size (their rows "
        "make one table)",
    )
    ap.add_argument(
        "--weights",
        type=Path,
        nargs="+",
        default=[],
        help="bench JSONs whose runs to compare by weights format (bash benchmarks/gpu_session.sh "
        "e2e quant writes e2e_weights_{bf16,awq,fp8}_h200.json)",
    )
    a = ap.parse_args(argv)
    if a.weights:
        missing = [str(p) for p in a.weights if not p.exists()]
        if missing:
            ap.error(f"--weights: no such file {missing[0]}")
        print("## weights: " + ", ".join(p.name for p in a.weights) + "\n")
        print("\n".join(weights_table([json.loads(p.read_text()) for p in a.weights])) + "\n")
    if a.e2e.exists():
        print(f"## {a.e2e.name}\n")
        print("\n".join(e2e_tables(json.loads(a.e2e.read_text()))) + "\n")
    else:
        print(f"({a.e2e} not found)\n")
    steps = load_steps(a.step)
    if steps is not None:
        print("## " + ", ".join(p.name for p in a.step) + "\n")
        print("\n".join(step_tables(steps)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
