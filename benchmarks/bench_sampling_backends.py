"""FlashInfer's sampling kernels next to the engine's sampler (``runtime.sampler.sample``).

    python -m benchmarks.bench_sampling_backends --out $OUT/sampling_backends_h200.json

Issue 16 takes FlashInfer's sampling only where it is faster *and* keeps the sampler's contract:
a seeded request reproduces exactly whatever else is in the batch and wherever its row is, with
no host sync. So the run first checks that contract on both, recorded (never stopping the
timings): B rows of the same logits, every row with the same seed and step (FlashInfer: the same
per-row seed and offset tensors) must all sample the same token. ``rows_equal_row0`` is the
fraction that did; 1.0 is the contract.

Then, at the DeepSeek-V3.2 vocabulary (129280) and B = 1 / 16 / 64, the median of CUDA-graph
replays of: ours compiled as the decode step compiles it (``torch.compile``, fullgraph) with the
filters (top-k 50, top-p 0.95: the sort) and without (temperature only); FlashInfer's
``top_k_top_p_sampling_from_logits`` and ``sampling_from_logits``; and its filter kernels alone
(softmax, ``top_k_renorm_probs``, ``top_p_renorm_probs``: no random numbers), which a sampler
keeping our noise could use in place of the sort.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from benchmarks.cuda_timer import graph_time
from runtime.sampler import sample

V = 129280
BATCHES = (1, 16, 64)
TOP_K, TOP_P, TEMP = 50, 0.95, 0.8


def row_tensors(b: int, dev: str, seed: int = 1234, step: int = 7) -> dict:
    return {
        "temperature": torch.full((b,), TEMP, device=dev),
        "top_k": torch.full((b,), TOP_K, dtype=torch.int64, device=dev),
        "top_p": torch.full((b,), TOP_P, device=dev),
        "seeds": torch.full((b,), seed, dtype=torch.int64, device=dev),
        "steps": torch.full((b,), step, dtype=torch.int64, device=dev),
    }


def ours(logits: torch.Tensor, r: dict, filters: bool = True) -> torch.Tensor:
    t = r["temperature"]
    return sample(logits, t, r["top_k"], r["top_p"], r["seeds"], r["steps"], filters=filters)[0]


def fi_sample(logits: torch.Tensor, r: dict) -> torch.Tensor:
    import flashinfer

    # per-row seed and offset tensors: the library's graph-safe, per-request seeding
    return flashinfer.sampling.top_k_top_p_sampling_from_logits(
        logits / r["temperature"][:, None],
        r["top_k"].int(),
        r["top_p"],
        seed=r["seeds"],
        offset=r["steps"],
    )


def rows_equal_row0(fn, b: int, dev: str) -> float:
    """The same logits in every row, the same seed and step: the fraction of rows whose token
    equals row 0's (the contract: 1.0)."""
    gen = torch.Generator(device="cpu").manual_seed(b)
    logits = (torch.randn(1, V, generator=gen) * 3).expand(b, V).contiguous().to(dev)
    tok = fn(logits, row_tensors(b, dev))
    return float((tok == tok[0]).float().mean())


def timed_calls(b: int, dev: str, compiled, compiled_plain, have_fi: bool) -> dict:
    logits = torch.randn(b, V, device=dev) * 3
    r = row_tensors(b, dev)
    fns = {
        "ours_compiled_filters": lambda: compiled(logits, r),
        "ours_compiled_no_filters": lambda: compiled_plain(logits, r),
    }
    if have_fi:
        import flashinfer.sampling as fs

        probs = torch.softmax(logits, dim=-1)
        k32 = r["top_k"].int()
        fns["flashinfer_top_k_top_p_sampling"] = lambda: fi_sample(logits, r)
        fns["flashinfer_sampling_from_logits"] = lambda: fs.sampling_from_logits(
            logits, seed=r["seeds"], offset=r["steps"]
        )
        fns["flashinfer_filters_only"] = lambda: fs.top_p_renorm_probs(
            fs.top_k_renorm_probs(probs, k32), r["top_p"]
        )
    return fns


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/sampling_backends_h200.json")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sampling_backends: needs a CUDA device")
        return 1
    dev = "cuda"
    try:
        import flashinfer  # noqa: F401

        have_fi = True
    except ImportError:
        have_fi = False
    import triton

    res: dict = {
        "environment": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "flashinfer": __import__("flashinfer").__version__ if have_fi else None,
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        },
        "command": "python -m benchmarks.bench_sampling_backends " + " ".join(argv or []),
        "vocab": V,
        "params": {"temperature": TEMP, "top_k": TOP_K, "top_p": TOP_P},
        "contract": {},
        "us": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(res, indent=2) + "\n")

    compiled = torch.compile(ours, fullgraph=True, dynamic=False)
    compiled_plain = torch.compile(
        lambda x, r: ours(x, r, filters=False), fullgraph=True, dynamic=False
    )
    batches = [int(b) for b in args.batches.split(",") if b]
    for b in batches:
        c = res["contract"][str(b)] = {"ours": rows_equal_row0(ours, b, dev)}
        if have_fi:
            try:
                c["flashinfer"] = rows_equal_row0(fi_sample, b, dev)
            except Exception as e:  # recorded, the timings go on
                c["flashinfer_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"B={b} rows equal to row 0 (contract 1.0): {c}", flush=True)
        save()
    for b in batches:
        row = res["us"][str(b)] = {}
        for name, fn in timed_calls(b, dev, compiled, compiled_plain, have_fi).items():
            t0 = time.monotonic()
            try:
                row[name] = graph_time([fn] * 4, args.replays).median_us
            except Exception as e:
                row[name] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"B={b} {name}: {row[name]} us ({time.monotonic() - t0:.1f} s)", flush=True)
            save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
