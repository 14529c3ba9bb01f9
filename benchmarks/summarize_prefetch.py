"""A bench_prefetch result as Markdown tables, one per hit rate: each configuration's step (µs),
fused indexer, speed-up over no prefetch and fraction of the bound, per step and amortized over
the refill cycle, with precision and coverage; the run's parts and the fusion's cost above them.

    python -m benchmarks.summarize_prefetch \
        benchmarks/results/gpu_session40/call6_prefetch_h05_budgets_h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = ("step µs", "fused indexer µs", "x", "of bound", "amortized µs", "amortized of bound",
           "precision", "coverage")  # fmt: skip


def _num(x, digits: int) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "-"


def configurations(r: dict) -> list[str]:
    """The configuration names of one hit rate's results (``cap64_m2_rows8``, ...), in order."""
    suffix = "_fused_indexer_us"
    return [k[: -len(suffix)] for k in r if k.endswith(suffix)]


def rows(r: dict) -> list[tuple[str, list[str]]]:
    """(configuration, its cells in ``COLUMNS`` order) for one hit rate's results."""
    out = []
    for n in configurations(r):
        cells = [_num(r.get(f"{n}_us"), 1), _num(r.get(f"{n}_fused_indexer_us"), 1),
                 _num(r.get(f"{n}_speedup"), 3), _num(r.get(f"{n}_of_bound"), 3),
                 _num(r.get(f"amortized_{n}_us"), 1), _num(r.get(f"amortized_{n}_of_bound"), 3),
                 _num(r.get(f"{n}_precision"), 3), _num(r.get(f"{n}_coverage"), 3)]  # fmt: skip
        out.append((n, cells))
    return out


def summarize(res: dict) -> str:
    """The whole result as Markdown."""
    checks = "PASS" if res.get("all_pass") else "FAIL"
    lines = [f"{res.get('device')}, {res.get('date')}: checks {checks}, "
             f"{len(res.get('rounds', []))} rounds"]  # fmt: skip
    parts = res.get("results", {}).get("parts", {})
    timed = [
        f"{k[:-3]} {v:.1f}" for k, v in parts.items() if k.endswith("_us") and isinstance(v, float)
    ]
    lines.append("parts (µs): " + ", ".join(timed))
    for k, v in res.items():
        if "slowdown" in k and isinstance(v, float):
            lines.append(f"{k}: {v:+.2%}")
    for h, r in res.get("results", {}).items():
        if h == "parts":
            continue
        lines += ["", f"**{h}**: baseline {_num(r.get('baseline_us'), 1)} µs, bound "
                  f"{_num(r.get('bound_us'), 1)} µs", "",
                  "| configuration | " + " | ".join(COLUMNS) + " |",
                  "|---" * (len(COLUMNS) + 1) + "|"]  # fmt: skip
        lines += [f"| {n} | " + " | ".join(c) + " |" for n, c in rows(r)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="a benchmarks.bench_prefetch JSON")
    print(summarize(json.loads(ap.parse_args().result.read_text())))


if __name__ == "__main__":
    main()
