"""``echo-compile bench``: the paper's experiment on one GPU, offloading vs GPU-only side by side.

Decode-only with injected KV (the paper's prefill/decode-disaggregated setup): each admitted
request's prompt KV (all but its last token) is written by ``LayerKV.store`` — the write path
prefill uses — from random latents, then generation is measured; generation throughput leaves the
injection time out. ``--mode full`` prefills every prompt instead (eager chunks, the explicit form
over the whole context: for small runs), and its throughput includes the prefill. Systems, same
model and the same GPU pool tokens per layer:
- ``offload``: echo-compile with the KV in pinned host memory, a GPU pool of N_G rows per layer,
  compiled (CUDA graphs);
- ``gpu-only``: the KV on the device in a pool of N_G rows (the SGLang policy: the batch is bounded
  by how many whole requests fit), compiled;
- ``offload-eager``: offloading without CUDA graphs.

Selection locality. Random weights do not give real attention's temporal locality (the paper
measures GPU-pool hit rates of 0.97-0.99). The knob is ``--repeat``: the probability that a
request's next decode input is its previous input token rather than the sampled one (sampling
still runs). At 1.0 every layer-0 indexer query differs from the last only by RoPE, so its
selections overlap heavily; deeper layers see the drift of the attention outputs and overlap less;
at 0 the model's own (greedy or sampled) tokens make every query new. The measured per-layer hit
rate is reported next to every throughput figure; do not read a throughput without it.

Runs: every system at every ``--gpu-pools`` size with all requests at once (Fig. 13), and at
``--rate-pool`` a Poisson rate sweep (Fig. 12); ``offload-eager`` at ``--eager-pools``, where the
eager steps of offload-eager and gpu-only are also profiled for the time breakdown
(echo_compile.breakdown). Results are written after every run.
"""

from __future__ import annotations

import gc
import platform
import random
import time
import zlib
from dataclasses import dataclass, field, replace

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
    prefill: bool = False  # full mode: the engine prefills each prompt instead of injecting KV

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


class BenchEngine(Engine):
    """The engine plus the benchmark's locality knob: with probability ``repeat`` a request's next
    input token is its previous input token instead of the sampled one (its logprob is then the
    sampled token's; the benchmark reads neither). Sampling still runs every step."""

    def __init__(self, *args, repeat: float = 0.0, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        if not 0.0 <= repeat <= 1.0:
            raise ValueError(f"repeat must be a probability in [0, 1], got {repeat!r}")
        self.repeat = repeat
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the knob's random stream (each benchmark run starts from the same state)."""
        self._repeat_rng = random.Random(seed)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        tokens, logprobs = super()._sample(reqs, logits)
        if self.repeat > 0:
            for i, r in enumerate(reqs):
                if self._repeat_rng.random() < self.repeat:
                    tokens[i] = r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]
        return tokens, logprobs


@dataclass
class SystemResult:
    system: str
    gpu_pool_tokens: int
    mode: str
    rate: float
    requests: int
    throughput_tok_s: float
    effective_batch: float
    max_batch: int
    decode_steps: int
    generated_tokens: int
    wall_s: float
    inject_s: float
    serve_s: float  # wall - inject: the time the throughput divides by
    steps_s: float  # of which in engine steps (decode, and prefill in full mode)
    add_s: float  # and in taking requests in (engine.add_request: checks, queueing)
    step_ms_median: float
    step_ms: dict[str, float] = field(default_factory=dict)  # percentiles, mean and max
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


def batch_cap(system: str, gpu_pool: int, topk: int, min_len: int, max_batch: int) -> int:
    """The largest decode batch a system runs with a pool of ``gpu_pool`` rows per layer:
    offloading needs B x topk <= N_G; GPU-only holds whole requests, so at most this many of the
    shortest (``min_len`` tokens, page-rounded) fit."""
    if system == "gpu-only":
        return max(1, min(max_batch, gpu_pool // (-(-min_len // 64) * 64)))
    return max(1, min(max_batch, gpu_pool // topk))


class System:
    """One system under test, built once (compiled systems: compiled and their graphs captured)
    and then run over one or more workloads, one after another."""

    def __init__(
        self,
        model: torch.nn.Module,
        system: str,
        gpu_pool: int,
        host_tokens: int,
        kv_format: str,
        max_len: int,
        batch: int,
        buckets: tuple[int, ...],
        device: str,
        repeat: float,
        seed: int = 0,
    ):
        from echo_compile.compiled import StepCompiler

        if system not in SYSTEMS:
            raise ValueError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}")
        self.system, self.gpu_pool, self.model = system, gpu_pool, model
        offload = system != "gpu-only"
        cfg = EngineConfig(
            max_batch=batch,
            # GPU-only keeps the KV in a device pool of N_G rows: the "host" pool is that pool
            host_tokens=host_tokens if offload else gpu_pool // 64 * 64,
            gpu_tokens=gpu_pool,
            kv_format=kv_format,
            offload=offload,
            max_model_len=max_len,
            decode_buckets=tuple(sorted({b for b in buckets if 0 < b < batch} | {batch})),
            device=device,
            # decode only: a compiled prefill has static shapes over max_model_len (see
            # EngineConfig.prefill_compiled); the full mode's prefill chunks run eagerly
            compile_prefill=False,
        )
        torch._dynamo.reset()  # a fresh compile per engine: no earlier engine's graphs or guards
        compiler = StepCompiler(device) if system != "offload-eager" else None
        self.engine = BenchEngine(
            model,
            model.config,
            None,
            cfg,
            model_name="bench",
            repeat=repeat,
            seed=seed,
            compiler=compiler,
        )
        self.warmup_s = self.engine.runner.warmup(progress=True) if compiler else 0.0
        self.inject = make_injector(seed)
        self.inject_s = 0.0
        self.engine.kv_injector = self._inject
        self.engine.keep_finished = True

    def _inject(self, eng: Engine, req: Request) -> None:
        t = time.perf_counter()
        self.inject(eng, req)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        self.inject_s += time.perf_counter() - t

    def _prompts(self, wl: Workload) -> list[list[int]]:
        """The requests' prompt token ids (random: only their lengths matter), made before any
        timing starts."""
        rng = random.Random(wl.seed)
        vocab = self.model.config.vocab_size
        return [[rng.randrange(2, vocab) for _ in range(n)] for n in wl.lengths()]

    def _add(self, wl: Workload, i: int, prompt: list[int]) -> None:
        params = SamplingParams(
            max_tokens=wl.output_len, temperature=wl.temperature, ignore_eos=True, seed=wl.seed
        )
        self.engine.add_request(f"r{i}", prompt, params, inject_kv=not wl.prefill)

    def run(self, wl: Workload) -> SystemResult:
        """Serve ``wl`` (requests arrive at their Poisson times) until every request is done."""
        engine = self.engine
        engine.reset_stats()
        engine.reseed(wl.seed)
        self.inject_s = 0.0
        prompts = self._prompts(wl)
        arrivals = wl.arrivals()
        pending = sorted(zip(arrivals, range(wl.requests)))
        t0 = time.perf_counter()

        def clock() -> float:
            # The serving clock. Injecting KV stands in for receiving it from a prefill instance:
            # its time is left out, and arrivals do not advance while it runs.
            return time.perf_counter() - t0 - self.inject_s

        step_times: list[float] = []
        ttft: list[float] = []
        add_s = 0.0
        while pending or engine.has_unfinished():
            now = clock()
            while pending and pending[0][0] <= now:
                _, i = pending.pop(0)
                ta = time.perf_counter()
                self._add(wl, i, prompts[i])
                add_s += time.perf_counter() - ta
            if not engine.has_unfinished():  # idle until the next arrival
                time.sleep(max(0.0, min(pending[0][0] - now, 0.01)))
                continue
            ts, injected = time.perf_counter(), self.inject_s
            outs = engine.step()
            # the step's own time: less the KV injection done inside it (at admission)
            step_times.append(time.perf_counter() - ts - (self.inject_s - injected))
            done = clock()
            for o in outs:
                if o.completion_tokens == 1:  # its first token: from its arrival time
                    ttft.append(done - arrivals[int(o.request_id[1:])])
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        m = engine.metrics()
        reqs = engine.finished_requests
        itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
        gen = sum(len(r.output_ids) for r in reqs)
        return SystemResult(
            system=self.system,
            gpu_pool_tokens=self.gpu_pool,
            mode="full" if wl.prefill else "decode-only",
            rate=wl.rate,
            requests=wl.requests,
            throughput_tok_s=gen / max(wall - self.inject_s, 1e-9),
            effective_batch=engine.decode_rows / max(engine.num_decode_steps, 1),
            max_batch=engine.config.max_batch,
            decode_steps=engine.num_decode_steps,
            generated_tokens=gen,
            wall_s=wall,
            inject_s=self.inject_s,
            serve_s=wall - self.inject_s,
            steps_s=sum(step_times),  # net of injection, like every step time
            add_s=add_s,
            step_ms_median=float(torch.tensor(step_times).median()) * 1e3 if step_times else 0.0,
            step_ms=_pct(step_times, 1e3) | ({"max": max(step_times) * 1e3} if step_times else {}),
            ttft_s=_pct(ttft),
            itl_ms=_pct(itl, 1e3),
            hit_rate=list(m["hit_rate"]),
            recalled_rows_per_step=float(m["recalled_rows_per_step"]),
            warmup_s=self.warmup_s,
        )

    def breakdown(self, wl: Workload, warm_steps: int = 4, steps: int = 8) -> dict:
        """Profile ``steps`` decode steps at the workload's full batch (all requests admitted,
        ``warm_steps`` run first); per-step time by category (see echo_compile.breakdown).
        The steps run eagerly: a compiled system's eager step function stands in meanwhile."""
        from echo_compile.breakdown import profile_steps

        engine = self.engine
        runner = engine.runner
        compiled_fn, runner.decode_fn = runner.decode_fn, runner.decode_step
        try:
            return self._breakdown(wl, warm_steps, steps, profile_steps)
        finally:
            runner.decode_fn = compiled_fn

    def _breakdown(self, wl: Workload, warm_steps: int, steps: int, profile_steps) -> dict:
        engine = self.engine
        engine.reset_stats()
        prompts = self._prompts(wl)
        n = min(wl.requests, engine.config.max_batch)
        for i in range(n):
            self._add(replace(wl, output_len=warm_steps + steps + 1), i, prompts[i])
        while engine.num_decode_steps < warm_steps:
            engine.step()
        engine.cache.reset_stats()  # the hit rate of the profiled steps alone
        out = profile_steps(self.model, engine.step, steps, cuda=engine.device.type == "cuda")
        out["batch"] = n
        out["hit_rate"] = list(engine.metrics()["hit_rate"])
        while engine.has_unfinished():
            engine.step()
        return out

    def close(self) -> None:
        """Free the pools (pinned host memory, device memory) before the next system is built."""
        self.engine = None  # type: ignore[assignment]
        torch._dynamo.reset()  # the compiled step and its CUDA graphs hold the cache's buffers
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


SYSTEMS = ("offload", "gpu-only", "offload-eager")


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
