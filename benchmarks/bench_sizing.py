"""What the automatic sizes (runtime/kv_sizing.py) cost a compiled engine against given small
ones, on a GPU: ``LLM(model)`` as ``serve`` / ``generate`` build it, once with the sizes left out
(the model's context, the pools from the memory) and once with ``--sizes`` given, each in turn.

    python -m benchmarks.bench_sizing [--model tiny] [--sizes 4096,16384,1024] [--out F.json]

Per engine: the build (load, pools, pinning) and the warm-up (every graph captured), seconds; then
greedy decode of --prompts prompts of --prompt-len tokens, --max-tokens each, the median of --reps
generate() calls (the first call is not counted), as output tokens per second.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import time


def run(model: str, sizes: dict, a: argparse.Namespace) -> dict:
    import torch

    from echo_compile.llm import LLM
    from runtime.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, device="cuda", progress=False, **sizes)
    build = time.perf_counter() - t0 - llm.warmup_s
    c = llm.engine.config
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(2, 500, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)
    ]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(a.reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    out = {
        "sizes_given": sizes,
        "max_model_len": c.max_model_len,
        "host_tokens": c.host_tokens,
        "gpu_tokens": c.gpu_tokens,
        "build_s": round(build, 2),
        "warmup_s": round(llm.warmup_s, 2),
        "generate_s": [round(x, 4) for x in times[1:]],
        "tokens_per_s": round(a.prompts * a.max_tokens / statistics.median(times[1:]), 1),
    }
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument(
        "--sizes", default="4096,16384,1024", help="max_model_len,host_tokens,gpu_tokens"
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch
    import triton

    keys = ("max_model_len", "host_tokens", "gpu_tokens")
    given = dict(zip(keys, (int(x) for x in a.sizes.split(","))))
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": vars(a),
        "runs": [],
    }
    for sizes in ({}, given):
        res["runs"].append(run(a.model, sizes, a))
        print(json.dumps(res["runs"][-1]), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
