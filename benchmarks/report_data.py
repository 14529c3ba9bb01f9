"""What the reports read from the results files, without matplotlib (the tables need none)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# echo_compile.bench.breakdown.CATEGORIES, in its order (a test checks they agree); any other key
# of a file is drawn after them
BREAKDOWN_CATEGORIES = ("attention", "indexer", "cache management", "moe", "dense mlp", "other")


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        print(f"skip: {path} not found")
    except (OSError, json.JSONDecodeError) as e:
        print(f"skip: {path}: {type(e).__name__}: {e}")
    return None


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def row_rate(r: dict) -> float:
    """A result row's request rate (req/s); inf: all requests at once."""
    return float(r["rate"])


def breakdown_label(key: str) -> str:
    """A breakdown entry's key ("200000": offloading's; "gpu-only 200000") as "system, pool N"."""
    system, _, n = key.rpartition(" ")
    return f"{system or 'offload'}, pool {int(n):,}"
