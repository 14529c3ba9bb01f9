"""``echo-compile bench``: the paper's experiment on one GPU, offloading vs GPU-only side by side.

Decode-only with injected KV (the paper's prefill/decode-disaggregated setup): each admitted
request's prompt KV (all but its last token) is written by ``LayerKV.store`` — the write path
prefill uses — from random latents, then generation is measured. Systems, same model and the same
GPU pool tokens per layer:
- ``offload``: echo-compile with the KV in pinned host memory, a GPU pool of N_G rows per layer,
  compiled (CUDA graphs);
- ``gpu-only``: the KV on the device in a pool of N_G rows (the SGLang policy: the batch is bounded
  by how many whole requests fit), compiled;
- ``offload-eager``: offloading without CUDA graphs.

Selection locality. Random weights do not give real attention's temporal locality, so locality is
set by the sampling temperature: at 0 (greedy) a random model mostly repeats its input token, the
indexer query barely changes between steps and the selections overlap heavily; higher temperatures
draw fresh tokens and the overlap falls. The measured per-layer hit rate is reported next to every
throughput figure; do not read a throughput without it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from custom_ops.fp8 import act_quant, fp8_round_trip
from custom_ops.kv_format import pack_index_k, pack_kv_rows
from runtime.engine import Engine, EngineConfig
from runtime.request import Request
from runtime.sampling_params import SamplingParams


@dataclass
class Workload:
    requests: int = 64
    min_ctx: int = 80_000
    max_ctx: int = 100_000
    output_len: int = 256
    rate: float = float("inf")  # requests/s (Poisson); inf = all at once
    temperature: float = 0.0
    seed: int = 0

    def lengths(self) -> list[int]:
        rng = random.Random(self.seed)
        return [rng.randint(self.min_ctx, self.max_ctx) for _ in range(self.requests)]

    def arrivals(self) -> list[float]:
        if self.rate == float("inf"):
            return [0.0] * self.requests
        rng = random.Random(self.seed + 1)
        t, out = 0.0, []
        for _ in range(self.requests):
            t += rng.expovariate(self.rate)
            out.append(t)
        return out


def sharegpt_like(requests: int, seed: int = 0) -> Workload:
    """Short-context workload: inputs ~ U(64, 1024), 256 outputs (ShareGPT's median input is a few
    hundred tokens); documented, not sampled from the data set."""
    return Workload(requests=requests, min_ctx=64, max_ctx=1024, output_len=256, seed=seed)


def make_injector(seed: int = 0):
    """The KV writer: random FP8-round-tripped latents and random indexer keys, chunk by chunk."""

    def inject(engine: Engine, req: Request) -> None:
        # crc32, not hash(): Python salts str hashes per process, and the KV must be reproducible
        gen = torch.Generator(device=engine.device)
        gen.manual_seed(seed + zlib.crc32(req.request_id.encode()))
        n = req.prefill_end
        chunk = 16384
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            slots = torch.tensor([req.slot_of(p) for p in range(start, end)], device=engine.device)
            for layer in engine.cache.layers:
                c = torch.randn(end - start, 512, generator=gen, device=engine.device)
                pe = torch.randn(end - start, 64, generator=gen, device=engine.device)
                k = torch.randn(end - start, 128, generator=gen, device=engine.device)
                kq, ks = act_quant(k)
                rows = pack_kv_rows(fp8_round_trip(c.bfloat16()), pe.bfloat16(), layer.fmt)
                layer.store(rows, pack_index_k(kq, ks.squeeze(-1)), slots)

    return inject


@dataclass
class SystemResult:
    system: str
    gpu_pool_tokens: int
    throughput_tok_s: float
    effective_batch: float
    decode_steps: int
    generated_tokens: int
    wall_s: float
    inject_s: float
    step_ms_median: float
    ttft_s: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    hit_rate: list[float] = field(default_factory=list)
    recalled_rows_per_step: float = 0.0
    warmup_s: float = 0.0


def _pct(xs: list[float], scale: float = 1.0) -> dict[str, float]:
    if not xs:
        return {}
    t = torch.tensor(xs, dtype=torch.float64) * scale
    return {f"p{q}": float(torch.quantile(t, q / 100)) for q in (50, 90, 99)} | {
        "mean": float(t.mean())
    }


def run_system(
    model: torch.nn.Module,
    tokenizer,
    wl: Workload,
    system: str,
    gpu_pool: int,
    host_tokens: int,
    kv_format: str,
    max_batch: int,
    device: str,
) -> SystemResult:
    from echo_compile.compiled import compile_runner, warmup

    lens = wl.lengths()
    offload = system != "gpu-only"
    max_len = wl.max_ctx + wl.output_len + 64
    topk = model.config.index_topk
    # Only the batch sizes this workload produces are captured (each bucket is a compile): with
    # all requests arriving at once, offloading runs waves of `batch`; GPU-only runs as many whole
    # requests as its pool holds, padded to that bucket.
    if offload:
        batch = min(max_batch, gpu_pool // topk, wl.requests)
        rest = wl.requests % batch
        buckets = tuple(sorted({batch, rest} - {0}))
        cfg = EngineConfig(
            max_batch=batch,
            host_tokens=host_tokens,
            gpu_tokens=gpu_pool,
            kv_format=kv_format,
            offload=True,
            max_model_len=max_len,
            decode_buckets=buckets,
            device=device,
        )
    else:
        # The pool admits requests by their real lengths, so up to this many of the shortest fit.
        # (The H200 run in docs/e2e_report.md predates this: it capped GPU-only at the count of the
        # longest requests that fit, batch 1.)
        per_req = -(-(wl.min_ctx + wl.output_len) // 64) * 64
        batch = max(1, min(max_batch, gpu_pool // per_req))
        cfg = EngineConfig(
            max_batch=batch,
            host_tokens=gpu_pool // 64 * 64,
            gpu_tokens=gpu_pool,
            kv_format=kv_format,
            offload=False,
            max_model_len=max_len,
            device=device,
        )
    engine = Engine(model, model.config, tokenizer, cfg, model_name="bench")
    warm = 0.0
    if system != "offload-eager":
        compile_runner(engine.runner)
        warm = warmup(engine.runner, progress=True, prefill=False)
    inject = make_injector(wl.seed)
    inject_s = 0.0

    def injector(eng: Engine, req: Request) -> None:
        nonlocal inject_s
        t = time.perf_counter()
        inject(eng, req)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        inject_s += time.perf_counter() - t

    engine.kv_injector = injector
    engine.keep_finished = True
    params = SamplingParams(
        max_tokens=wl.output_len, temperature=wl.temperature, ignore_eos=True, seed=wl.seed
    )
    rng = random.Random(wl.seed)
    pending = sorted(zip(wl.arrivals(), range(wl.requests)))
    t0 = time.perf_counter()
    step_times, done = [], {}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            _, i = pending.pop(0)
            prompt = [rng.randrange(2, model.config.vocab_size) for _ in range(lens[i])]
            engine.add_request(f"r{i}", prompt, params, inject_kv=True)
        ts = time.perf_counter()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step_times.append(time.perf_counter() - ts)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    m = engine.metrics()
    reqs = engine.finished_requests
    ttft = [r.first_token_time - r.arrival_time for r in reqs if r.first_token_time]
    itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    gen = sum(len(r.output_ids) for r in reqs)
    return SystemResult(
        system=system,
        gpu_pool_tokens=gpu_pool,
        throughput_tok_s=gen / max(wall - inject_s, 1e-9),
        effective_batch=engine.decode_rows / max(engine.num_decode_steps, 1),
        decode_steps=engine.num_decode_steps,
        generated_tokens=gen,
        wall_s=wall,
        inject_s=inject_s,
        step_ms_median=float(torch.tensor(step_times).median()) * 1e3 if step_times else 0.0,
        ttft_s=_pct(ttft),
        itl_ms=_pct(itl, 1e3),
        hit_rate=list(m["hit_rate"]),
        recalled_rows_per_step=float(m["recalled_rows_per_step"]),
        warmup_s=warm,
    )


def build_model(preset: str, layers: int, experts: int, device: str) -> torch.nn.Module:
    """The benchmark model with deterministic random weights, built directly on ``device``:
    ``bench`` (real V3.2 attention/indexer dims, ``layers`` and ``experts`` chosen) or ``tiny``."""
    from model.model import DeepseekV32ForCausalLM
    from model.presets import preset_config

    if preset == "bench":
        cfg = preset_config("bench", num_layers=layers, n_experts=experts)
    else:
        cfg = preset_config("tiny")
    with torch.device(device):
        model = DeepseekV32ForCausalLM(cfg)
    return model.random_init_(seed=0).eval()


def environment() -> dict:
    import triton

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = "cpu"
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="echo-compile bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--preset",
        choices=("bench", "tiny"),
        default="bench",
        help="tiny: a CPU dry run of the harness",
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument(
        "--workload",
        choices=("long", "sharegpt"),
        default="long",
        help="long: InfiniteBench-like lengths (--min-ctx/--max-ctx); sharegpt: short prompts",
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-ctx", type=int, default=80_000)
    ap.add_argument("--max-ctx", type=int, default=100_000)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rate", type=float, default=float("inf"))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--gpu-pools", default="325000,200000,110000")
    ap.add_argument("--host-tokens", type=int, default=0, help="default: enough for every request")
    ap.add_argument("--kv-format", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--systems", default="offload,gpu-only,offload-eager")
    ap.add_argument(
        "--eager-pools", default="200000", help="pool sizes at which offload-eager runs"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/e2e_h200.json")
    a = ap.parse_args(argv)

    model = build_model(a.preset, a.layers, a.experts, a.device)
    cfg = model.config
    if a.workload == "sharegpt":
        wl = sharegpt_like(a.requests)
        wl.rate, wl.temperature = a.rate, a.temperature
    else:
        wl = Workload(a.requests, a.min_ctx, a.max_ctx, a.output_len, a.rate, a.temperature)
    host = a.host_tokens or -(-(sum(wl.lengths()) + a.requests * (a.output_len + 128)) // 64) * 64
    results = []
    for pool in [int(x) for x in a.gpu_pools.split(",")]:
        for system in a.systems.split(","):
            if system == "offload-eager" and str(pool) not in a.eager_pools.split(","):
                continue
            r = run_system(model, None, wl, system, pool, host, a.kv_format, a.max_batch, a.device)
            print(
                f"{system:14s} pool {pool:7d}: {r.throughput_tok_s:9.1f} tok/s, batch "
                f"{r.effective_batch:5.1f}, hit rate "
                f"{sum(r.hit_rate) / max(len(r.hit_rate), 1):.3f}",
                flush=True,
            )
            results.append(asdict(r))
    out = {
        "environment": environment(),
        "model": cfg.to_dict(),
        "workload": asdict(wl),
        "host_tokens": host,
        "kv_format": a.kv_format,
        "results": results,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0
