"""FlashInfer's sampling kernels next to the engine's sampler (``runtime.sampler.sample``).

    python -m benchmarks.bench_sampling_backends --out $OUT/sampling_backends_h200.json

Issue 16 takes FlashInfer's sampling only where it is faster *and* keeps the sampler's contract:
a seeded request reproduces exactly whatever else is in the batch and wherever its row is, with
no host sync. So the run first checks that contract on both, recorded (never stopping the
timings): one seeded request (fixed logits, seed and step) is placed at the first, middle and
last row of batches of each size, among rows of random logits, seeds and steps (FlashInfer: per-row
seed and offset tensors, its graph-safe seeding); it must sample the same token at every
placement. ``same_as_first`` is the fraction of placements that did (1.0 = the contract), for our
sampler eager and compiled (as the decode step runs it) and for FlashInfer.

Then, at the DeepSeek-V3.2 vocabulary (129280) and B = 1 / 16 / 64, the median of CUDA-graph
replays of: ours compiled as the decode step compiles it (``torch.compile``, fullgraph) with the
filters (top-k 50, top-p 0.95: the sort) and without (temperature only); FlashInfer's
``top_k_top_p_sampling_from_logits`` and ``sampling_from_logits``; and its filter kernels alone
(temperature and softmax, ``top_k_renorm_probs``, ``top_p_renorm_probs``: no random numbers),
which a sampler keeping our noise could use in place of the sort.
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


SEED, STEP = 1234, 7  # the target request's


def row_tensors(b: int, dev: str, gen: torch.Generator | None = None) -> dict:
    """Every row's sampling tensors; with ``gen``, random seeds and steps for the rows."""
    seeds = torch.full((b,), SEED, dtype=torch.int64)
    steps = torch.full((b,), STEP, dtype=torch.int64)
    if gen is not None:
        seeds = torch.randint(0, 2**40, (b,), generator=gen)
        steps = torch.randint(0, 4096, (b,), generator=gen)
    return {
        "temperature": torch.full((b,), TEMP, device=dev),
        "top_k": torch.full((b,), TOP_K, dtype=torch.int64, device=dev),
        "top_p": torch.full((b,), TOP_P, device=dev),
        "seeds": seeds.to(dev),
        "steps": steps.to(dev),
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


def placements(fn, batches: list[int], dev: str) -> dict:
    """One target request (fixed logits, seed SEED, step STEP) sampled at every batch size of
    ``batches`` and at the first, middle and last row, the other rows random (logits, seeds,
    steps). The contract: the same token at every placement. Returns the fraction of placements
    whose token equals the first one's, and how many there were."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(V, generator=gen) * 3
    toks = []
    for b in batches:
        for pos in sorted({0, b // 2, b - 1}):
            logits = torch.randn(b, V, generator=gen) * 3
            logits[pos] = target
            r = row_tensors(b, dev, gen)
            r["seeds"][pos], r["steps"][pos] = SEED, STEP
            toks.append(int(fn(logits.to(dev), r)[pos]))
    return {"same_as_first": sum(t == toks[0] for t in toks) / len(toks), "placements": len(toks)}


def timed_calls(b: int, dev: str, compiled, compiled_plain, have_fi: bool) -> dict:
    logits = torch.randn(b, V, device=dev) * 3
    r = row_tensors(b, dev)
    fns = {
        "ours_compiled_filters": lambda: compiled(logits, r),
        "ours_compiled_no_filters": lambda: compiled_plain(logits, r),
    }
    if have_fi:
        import flashinfer.sampling as fs

        k32 = r["top_k"].int()
        fns["flashinfer_top_k_top_p_sampling"] = lambda: fi_sample(logits, r)
        fns["flashinfer_sampling_from_logits"] = lambda: fs.sampling_from_logits(
            logits, seed=r["seeds"], offset=r["steps"]
        )
        fns["flashinfer_filters_only"] = lambda: fs.top_p_renorm_probs(
            fs.top_k_renorm_probs(torch.softmax(logits / r["temperature"][:, None], -1), k32),
            r["top_p"],
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
    checks = {"ours_eager": ours, "ours_compiled": compiled}
    if have_fi:
        checks["flashinfer"] = fi_sample
    for name, fn in checks.items():
        try:
            res["contract"][name] = placements(fn, batches, dev)
        except Exception as e:  # recorded, the timings go on
            res["contract"][f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"contract (one seeded request at every placement; 1.0 = kept): {name} "
              f"{res['contract'].get(name)}", flush=True)  # fmt: skip
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
