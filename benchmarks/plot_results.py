"""Figures of the committed H200 results, for docs/benchmarks.md.

    python -m benchmarks.plot_results [--results benchmarks/results] [--out docs/figures]

Reads the results JSONs (any of them may be missing: its figures are skipped with a note) and
writes PNGs with matplotlib's Agg backend (benchmarks/plots/, one module per file; install the
``bench`` extra: ``pip install -e .[bench]``):

    e2e_throughput.png     e2e_h200.json (Fig. 13): throughput per system at each measured GPU pool
                           size, all requests at once (rate inf), effective batch and mean hit
                           rate on each bar, offload / GPU-only ratio above each pool
    e2e_rate_sweep.png     e2e_h200.json (Fig. 12): throughput vs Poisson request rate per system,
                           effective batch at each point (skipped without finite-rate rows)
    e2e_hit_rate.png       e2e_h200.json: per-layer hit rate of the offload system(s), all at once
    e2e_breakdown.png      e2e_h200.json "breakdown": ms per eager decode step by category
                           (attention, indexer, cache management, moe, dense mlp, other) per pool
    step_breakdown.png     step_b{1,16,64}_h200.json: the same at B=1/16/64, with compiled /
                           GPU-only / eager step times (bench_step.py)
    decode_kernels.png     decode_kernels_h200.json: kernel times per swept config vs targets
    cache_ops.png          cache_ops_h200.json: op latencies and recall bandwidth vs targets
    awq_vs_bf16.png        awq_h200.json: W4A16 vs bf16 latency by batch size
    awq_pairs_vs_bf16.png  awq_pairs_h200.json: W4A16 linear speed over bf16 with issue 17's
                           targets (its MoE rows predate the current MoE: awq_moe_vs_bf16.png)
    awq_served_vs_bf16.png awq_served_h200.json: the AWQ linear as served (decode batches to
                           prefill chunks) over bf16, with tinygemm, the SCALED wide tile and
                           issue 17's targets
    awq_moe_vs_bf16.png    awq_parts_h200.json: the fused int4 MoE over the bf16 grouped MoE,
                           alternating rounds' medians and range, with the target
    prefetch_margin.png    prefetch_h200.json: indexer + recall with prefetch over without, per
                           threshold margin and hit rate, with the bound and the paper's ratio

Every plotted number is a field of a JSON file; targets are drawn from the files' "targets".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.report_data import RESULTS, ROOT, STEP_FILES, load, load_steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "figures")
    a = ap.parse_args(argv)
    written: list[Path] = []
    # imported here: the figures need matplotlib, --help does not
    from benchmarks.plots.awq import plot_awq
    from benchmarks.plots.awq_moe import plot_awq_moe
    from benchmarks.plots.awq_pairs import plot_awq_pairs
    from benchmarks.plots.awq_served import plot_awq_served
    from benchmarks.plots.breakdown import plot_step
    from benchmarks.plots.cache_ops import plot_cache
    from benchmarks.plots.common import plt
    from benchmarks.plots.e2e import plot_e2e
    from benchmarks.plots.kernels import plot_decode
    from benchmarks.plots.prefetch import plot_prefetch

    steps = load_steps([a.results / f for f in STEP_FILES])
    if steps is not None:
        plot_step(steps, a.out, written)
    for file, fn in (
        ("e2e_h200.json", plot_e2e),
        ("decode_kernels_h200.json", plot_decode),
        ("cache_ops_h200.json", plot_cache),
        ("awq_h200.json", plot_awq),
        ("awq_pairs_h200.json", plot_awq_pairs),
        ("awq_served_h200.json", plot_awq_served),
        ("awq_parts_h200.json", plot_awq_moe),
        ("prefetch_h200.json", plot_prefetch),
    ):
        d = load(a.results / file)
        if d is None:
            continue
        try:
            fn(d, a.out, written)
        except Exception as e:  # one malformed file must not stop the other figures
            print(f"skip: {file}: {type(e).__name__}: {e}", file=sys.stderr)
            plt.close("all")
    print(f"{len(written)} figure(s) written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
