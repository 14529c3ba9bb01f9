"""``echo-compile demo``: long-context requests decoded with a GPU pool far smaller than their KV
cache, checked bit for bit against a run that keeps the whole KV cache on the device."""

from __future__ import annotations

import argparse
import random
import time

import torch

from custom_ops.kv_format import PAGE, pages_for
from echo_compile.llm import LLM
from runtime.sampling_params import SamplingParams


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float, dict]:
    eng = llm.engine
    steps0, rows0 = eng.num_decode_steps, eng.decode_rows
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    steps = eng.num_decode_steps - steps0
    m = eng.metrics()
    m["effective_batch"] = (eng.decode_rows - rows0) / max(steps, 1)
    return results, dt, m


def _check_args(a: argparse.Namespace) -> None:
    if a.requests < 1:
        raise ValueError(f"--requests must be at least 1, got {a.requests}")
    if not 1 <= a.min_len <= a.max_len:
        raise ValueError(
            f"--min-len and --max-len must satisfy 1 <= min <= max, got {a.min_len}, {a.max_len}"
        )


def run_demo(a: argparse.Namespace) -> int:
    _check_args(a)  # NOTE: bad flags fail here, before two models load
    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=0.0, logprobs=True, ignore_eos=True
    )
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(0)
    lens = [rng.randint(a.min_len, a.max_len) for _ in range(a.requests)]
    common = dict(
        max_batch=a.requests,
        kv_format=a.kv_format,
        device=device,
        progress=False,
        compile=a.compile,
        # (the longest request drawn: within the host pool below, which a given context
        # past it is refused by; --max-len + --max-tokens was, for a few requests)
        max_model_len=max(lens) + a.max_tokens,
    )
    # host pages: each request reserves ceil((prompt + max_tokens) / 64) pages
    host = sum(pages_for(n + a.max_tokens) for n in lens) * PAGE
    gpu_only = LLM(a.model, offload=False, host_tokens=host, **common)
    cfg = gpu_only.engine.model_config
    topk, vocab = cfg.index_topk, cfg.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in lens]
    # The smallest GPU pool the scheduler accepts: one selection per decode row and layer.
    gpu_tokens = a.requests * topk
    off = LLM(a.model, offload=True, host_tokens=host, gpu_tokens=gpu_tokens, **common)
    kv_rows = sum(lens) + a.requests * a.max_tokens

    print(
        f"echo-compile demo on {device}: {a.requests} requests of {min(lens)}-{max(lens)} tokens, "
        f"{a.max_tokens} new tokens each, top-k {topk}, KV format {a.kv_format}"
    )
    print(
        f"KV rows per layer: {kv_rows}; GPU pool per layer: {gpu_tokens} rows "
        f"({gpu_tokens / kv_rows:.0%} of the KV cache)"
    )
    res_off, dt_off, m_off = _run(off, prompts, params)
    res_gpu, dt_gpu, m_gpu = _run(gpu_only, prompts, params)
    gen = sum(r.stats.completion_tokens for r in res_off)
    print(
        f"offloaded : {gen / dt_off:8.1f} tok/s, effective batch {m_off['effective_batch']:.1f}, "
        f"{m_off['recalled_rows_per_step']:.1f} recalled rows per step per layer"
    )
    print(f"GPU-only  : {gen / dt_gpu:8.1f} tok/s, effective batch {m_gpu['effective_batch']:.1f}")
    print("hit rate per layer: " + ", ".join(f"{h:.3f}" for h in m_off["hit_rate"]))
    same = all(
        x.token_ids == y.token_ids and x.logprobs == y.logprobs for x, y in zip(res_off, res_gpu)
    )
    print(
        "lossless check (tokens and logprobs bit for bit vs GPU-only): "
        f"{'PASS' if same else 'FAIL'}"
    )
    print(f"first request's tokens (random weights, so not text): {res_off[0].token_ids[:16]}")
    return 0 if same else 1
