"""Prefix caching on a shared-document workload: TTFT and time with the cache off and on.

    python -m benchmarks.bench_prefix_cache --out $OUT/prefix_cache_h200.json

``--docs`` documents of ``--doc-len`` random tokens; ``--requests`` prompts, prompt i = document
i mod docs + ``--question-len`` tokens of its own; ``--output-len`` greedy tokens each; every
request arrives at once. The bench model (``--layers``, ``--experts``; random weights) in one
engine per setting, one process, the same model: ``enable_prefix_caching`` off, then on (CUDA:
compiled, CUDA graphs, warm-up timed apart). Per setting: wall time of the workload, TTFT median
and p90 (arrival to first token), the prompt tokens computed (the rest came from the cache), the
prefix cache's hit rate, and whether every request's tokens equal the run without the cache.
All at once, the two runs' decode batches differ (the cached run's prefills end sooner), and a
batch's composition can move the last bits of its logits, so ``same_tokens`` may be False
without an error. So each engine then also runs the first ``--sequential`` prompts one at a time
(every batch holds one request; with the cache on, their documents come from the cache), and
``same_tokens_sequential`` compares those: that one must be True.
``--dry-run``: the tiny preset at toy sizes on CPU (eager).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from echo_compile.bench.model_builder import build_model
from echo_compile.bench.result import environment
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams


def workload(a) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    vocab = a.vocab

    def toks(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=gen).tolist()

    docs = [toks(a.doc_len) for _ in range(a.docs)]
    return [docs[i % a.docs] + toks(a.question_len) for i in range(a.requests)]


def run(model, a, prompts: list[list[int]], cache: bool) -> dict:
    compiler = None
    if a.device.startswith("cuda"):
        from echo_compile.compiled import StepCompiler

        compiler = StepCompiler(a.device)
    cfg = EngineConfig(
        max_batch=a.max_batch, host_tokens=a.host_tokens, gpu_tokens=a.gpu_tokens,
        kv_format=a.kv_format, max_model_len=a.doc_len + a.question_len + a.output_len + 64,
        prefill_chunk=a.chunk, device=a.device, enable_prefix_caching=cache,
    )  # fmt: skip
    eng = Engine(model, model.config, None, cfg, compiler=compiler)
    warm = eng.runner.warmup(progress=True) if compiler is not None else 0.0  # eager: none
    out: dict = {"enable_prefix_caching": cache, "warmup_s": warm}
    eng.keep_finished = True
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    out["wall_s"] = time.perf_counter() - t0
    done = eng.finished_requests
    ttft = sorted(r.first_token_time - r.arrival_time for r in done)
    out["ttft_p50_s"] = statistics.median(ttft)
    out["ttft_p90_s"] = ttft[int(0.9 * (len(ttft) - 1))]
    out["prompt_tokens"] = sum(len(r.prompt_ids) for r in done)
    out["prompt_tokens_computed"] = sum(len(r.prompt_ids) - r.cached_tokens for r in done)
    out["prefix_cache_hit_rate"] = eng.metrics()["prefix_cache_hit_rate"]
    out["tokens"] = tokens
    seq: dict[str, list[int]] = {}  # the first prompts again, one request at a time
    for i, p in enumerate(prompts[: a.sequential]):
        eng.add_request(f"s{i}", p, params)
        while eng.has_unfinished():
            for o in eng.step():
                seq.setdefault(o.request_id, []).extend(o.new_token_ids)
    out["tokens_sequential"] = seq
    out["prompt_tokens_computed_sequential"] = sum(
        len(r.prompt_ids) - r.cached_tokens
        for r in eng.finished_requests
        if r.request_id.startswith("s")
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/prefix_cache_h200.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-len", type=int, default=32768)
    ap.add_argument("--question-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--gpu-tokens", type=int, default=200000)
    ap.add_argument("--kv-format", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--sequential", type=int, default=8,
                    help="prompts run again one at a time, their tokens compared off vs on")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dry-run", action="store_true", help="tiny preset, toy sizes, CPU")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.device, a.docs, a.doc_len, a.question_len, a.output_len = "cpu", 2, 140, 10, 2
        a.requests, a.max_batch, a.gpu_tokens, a.chunk, a.kv_format = 4, 4, 4 * 32, 64, "bf16"
        a.sequential = 3
    elif not a.device.startswith("cuda"):
        print("bench_prefix_cache: the bench model needs a GPU (or --dry-run)")
        return 1
    model = build_model("tiny" if a.dry_run else "bench", a.layers, a.experts, a.device)
    a.vocab = model.config.vocab_size
    prompts = workload(a)
    pages = sum(-(-(len(p) + a.output_len) // 64) for p in prompts) + a.docs
    a.host_tokens = 64 * pages  # every request's pages at once, and the documents' cached copies
    res: dict = {
        "environment": environment(),
        "command": "python -m benchmarks.bench_prefix_cache "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "workload": {
            k: getattr(a, k)
            for k in (
                "docs",
                "doc_len",
                "question_len",
                "output_len",
                "requests",
                "max_batch",
                "chunk",
            )
        },  # fmt: skip
        "runs": [],
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for cache in (False, True):
        r = run(model, a, prompts, cache)
        res["runs"].append(r)
        print({k: v for k, v in r.items() if not k.startswith("tokens")}, flush=True)
        out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    off, on = res["runs"]
    res["same_tokens"] = off["tokens"] == on["tokens"]
    res["same_tokens_sequential"] = off["tokens_sequential"] == on["tokens_sequential"]
    for r in res["runs"]:
        del r["tokens"], r["tokens_sequential"]
    res["speedup_wall"] = off["wall_s"] / on["wall_s"]
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"same tokens: {res['same_tokens']} (one at a time: {res['same_tokens_sequential']});"
          f" wall {res['speedup_wall']:.2f}x; wrote {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
