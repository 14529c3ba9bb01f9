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


# bench_step's files, one batch size each (`STEP_BATCH_LIST="1 16 64" bash
# benchmarks/gpu_session.sh time step`): the decode-step tables and figure read them together
STEP_FILES = ("step_b1_h200.json", "step_b16_h200.json", "step_b64_h200.json")


def load_steps(paths: list[Path]) -> dict | None:
    """bench_step results of one model and context (e.g. one file per batch size) as one: the
    first file's fields, every file's rows by batch, and each file's date under ``dates``. None
    when none loads; a ValueError when they measured different models or contexts."""
    loaded = [(p, d) for p in paths if (d := load(p)) is not None]
    if not loaded:
        return None
    ds = [d for _, d in loaded]
    same = ("model", "ctx", "steps", "kv_format", "repeat")
    for p, d in loaded:
        if any(d.get(k) != ds[0].get(k) for k in same):
            first = loaded[0][0]
            raise ValueError(f"{p}: another model or workload than {first} ({', '.join(same)})")
    rows = sorted((r for d in ds for r in d["rows"]), key=lambda r: r["batch"])
    return {**ds[0], "rows": rows, "dates": sorted({d["environment"]["date"] for d in ds})}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def row_rate(r: dict) -> float:
    """A result row's request rate (req/s); inf: all requests at once."""
    return float(r["rate"])


def breakdown_label(key: str) -> str:
    """A breakdown entry's key ("200000": offloading's; "gpu-only 200000") as "system, pool N"."""
    system, _, n = key.rpartition(" ")
    return f"{system or 'offload'}, pool {int(n):,}"
