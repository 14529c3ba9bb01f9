"""The systems under test of ``echo-compile bench``: ``System`` (one engine, its runs and its
breakdown profile) and the sizes the run loop gives it (``batch_cap``, ``breakdown_tokens``).
What the experiment is and what each system is: experiment.py (the command's --help)."""

from __future__ import annotations

import gc
import random
import time
from dataclasses import replace

import torch

from custom_ops.backends.select import DEFAULT_BACKEND
from custom_ops.cache.config import PREFETCH_MARGIN, max_decode_rows
from custom_ops.kv_format import PAGE, pages_for, whole_pages
from echo_compile.bench.experiment import SYSTEMS
from echo_compile.bench.model_builder import weight_bytes
from echo_compile.bench.result import SystemResult, percentiles, plan_labels
from echo_compile.bench.workload import RandomPromptKV, RepeatPrevious, Workload
from model.quantize import weights_format
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams


def batch_cap(system: str, gpu_tokens: int, topk: int, min_len: int, max_batch: int) -> int:
    """The largest decode batch a system runs with a pool of ``gpu_tokens`` rows per layer:
    offloading needs B x topk <= N_G; GPU-only holds whole requests, so at most this many of the
    shortest (``min_len`` tokens, page-rounded) fit."""
    if system == "gpu-only":
        return max(1, min(max_batch, gpu_tokens // (pages_for(min_len) * PAGE)))
    return max(1, max_decode_rows(max_batch, topk, gpu_tokens))


class System:
    """One system under test, built once (compiled systems: compiled and their graphs captured)
    and then run over one or more workloads, one after another."""

    def __init__(
        self,
        model: torch.nn.Module,
        system: str,
        gpu_tokens: int,
        host_tokens: int,
        kv_format: str,
        max_len: int,
        batch: int,
        buckets: tuple[int, ...],
        device: str,
        repeat: float,
        seed: int = 0,
        compile: bool = True,  # False: every system eager (a quick dry run of the harness)
        kernel_backend: str = DEFAULT_BACKEND,  # the decode indexer's kernels (docs/backends.md)
        prefetch: str = "off",  # lossless decode prefetch of the offloading systems
        parallel=None,  # (DistContext, dp, tp, ep): one rank of a multi-process run
        compile_prefill: bool = False,  # --mode full: prefill chunks compiled as the engine's
        prefetch_margin: float = PREFETCH_MARGIN,  # the prefetch threshold's margin
        prefetch_limits: dict | None = None,  # prefetch_cap / prefetch_ratio (EngineConfig's)
        async_scheduling: bool = False,  # EngineConfig.async_scheduling
        decode_during_prefill: bool = True,  # EngineConfig.decode_during_prefill
        dynamic_decode: bool = False,  # EngineConfig.dynamic_decode
    ):
        self.locality = RepeatPrevious(repeat, seed)  # first: a bad repeat fails before any build
        from echo_compile.compiled import StepCompiler

        if system not in SYSTEMS:
            raise ValueError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}")
        self.system, self.gpu_tokens, self.model = system, gpu_tokens, model
        self.weights, self.weight_bytes = weights_format(model), weight_bytes(model)["total"]
        offload = system != "gpu-only"
        cfg = EngineConfig(
            max_batch=batch,
            # GPU-only keeps the KV in a device pool of N_G rows: the "host" pool is that pool
            host_tokens=host_tokens if offload else whole_pages(gpu_tokens),
            gpu_tokens=gpu_tokens,
            kv_format=kv_format,
            offload=offload,
            max_model_len=max_len,
            decode_buckets=tuple(sorted({b for b in buckets if 0 < b < batch} | {batch})),
            device=device,
            # decode-only runs never prefill: compiling it would only cost warm-up time; the full
            # mode compiles it (the serving path: sparse prefill, one graph per chunk bucket)
            compile_prefill=compile_prefill,
            kernel_backend=kernel_backend,
            prefetch=prefetch if offload else "off",
            prefetch_margin=prefetch_margin,
            async_scheduling=async_scheduling,
            decode_during_prefill=decode_during_prefill,
            dynamic_decode=dynamic_decode,
            # neither system caches prefixes: a System runs workload after workload (the same
            # seed, the same prompts), and a later run's cached prompts would skip the prefill
            # the comparison measures (benchmarks/bench_prefix_cache.py measures the cache)
            enable_prefix_caching=False,
            **(prefetch_limits or {}),
        )
        if parallel is not None:
            ctx, dp, tp, ep = parallel
            cfg = replace(cfg, dp=dp, tp=tp, ep=ep, collective_timeout_s=ctx.timeout_s)
        torch._dynamo.reset()  # a fresh compile per engine: no earlier engine's graphs or guards
        self.compiled = compile and system != "offload-eager"
        compiler = StepCompiler(device) if self.compiled else None
        self.engine = Engine(model, model.config, None, cfg, model_name="bench", compiler=compiler)
        # the front the run drives: this rank's engine, or (multi-process) the DP front end over
        # it; stats are read from this rank's engine
        self.front = self.engine
        if parallel is not None:
            from runtime.distributed.dist_engine import DistributedEngine

            self.front = DistributedEngine(self.engine, parallel[0], parallel[1])
        if self.locality.repeat > 0:  # a processor keeps the loop synchronous: only when used
            self.engine.logits_processors.append(self.locality)
        self.warmup_s = self.engine.runner.warmup(progress=True) if compiler else 0.0
        self.seed = seed
        self.engine.keep_finished = True

    @property
    def inject_s(self) -> float:
        """Seconds the engine spent writing received prompt KV since the last reset_stats."""
        return self.engine.prompt_kv_load_s

    def _prompts(self, wl: Workload) -> list[list[int]]:
        """The requests' prompt token ids (random: only their lengths matter), made before any
        timing starts."""
        rng = random.Random(wl.seed)
        vocab = self.model.config.vocab_size
        return [[rng.randrange(2, vocab) for _ in range(n)] for n in wl.lengths()]

    def _add(self, wl: Workload, i: int, prompt: list[int], engine: Engine | None = None) -> None:
        engine = engine or self.engine
        params = SamplingParams(
            max_tokens=wl.output_len, temperature=wl.temperature, ignore_eos=True, seed=wl.seed
        )
        rid = f"r{i}"
        kv = None
        if not wl.prefill:
            n, layers = len(prompt) - 1, engine.model_config.num_hidden_layers
            kv = RandomPromptKV(rid, n, layers, engine.config.kv_format, engine.device, self.seed)
        front = self.front if engine is self.engine else engine
        front.add_request(rid, prompt, params, prompt_kv=kv)

    def run(self, wl: Workload) -> SystemResult:
        """Serve ``wl`` (requests arrive at their Poisson times) until every request is done."""
        engine = self.engine
        engine.reset_stats()
        self.locality.reseed(wl.seed)
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
        add_s, emitted = 0.0, 0
        front = self.front
        while pending or front.has_unfinished():
            now = clock()
            while pending and pending[0][0] <= now:
                _, i = pending.pop(0)
                ta = time.perf_counter()
                self._add(wl, i, prompts[i])
                add_s += time.perf_counter() - ta
            if not front.has_unfinished():  # idle until the next arrival
                time.sleep(max(0.0, min(pending[0][0] - now, 0.01)))
                continue
            ts, injected = time.perf_counter(), self.inject_s
            outs = front.step()
            emitted += sum(len(o.new_token_ids) for o in outs)
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
        prefetch = engine.config.prefetch if engine.config.offload else "off"
        reqs = engine.finished_requests
        itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
        # multi-process: every rank's tokens (the front end gathers every rank's outputs); the
        # batch, step times, hit rates and latencies below are this rank's
        gen = sum(len(r.output_ids) for r in reqs) if front is engine else emitted
        batch = engine.decode_rows / max(engine.num_decode_steps, 1)
        step_ms = percentiles(step_times, 1e3)
        return SystemResult(
            system=self.system,
            gpu_pool_tokens=self.gpu_tokens,
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
            step_ms_median=step_ms.get("p50", 0.0),  # step_ms's p50
            step_ms=step_ms | ({"max": max(step_times) * 1e3} if step_times else {}),
            ttft_s=percentiles(ttft),
            itl_ms=percentiles(itl, 1e3),
            hit_rate=list(m["hit_rate"]),
            recalled_rows_per_step=float(m["recalled_rows_per_step"]),
            decode_host_gap_ms=float(m["decode_host_gap_ms"]),
            async_scheduling=engine.config.async_scheduling,
            decode_ahead_fraction=float(m["decode_ahead_fraction"]),
            discarded_rows=int(m["discarded_rows"]),
            decode_gpu_idle_ms=float(m["decode_gpu_idle_ms"]),
            decode_gpu_idle_gaps=int(m["decode_gpu_idle_gaps"]),
            warmup_s=self.warmup_s,
            pool_rows_per_request=self.gpu_tokens / batch if batch else 0.0,
            prefetch=prefetch,
            prefetch_cap=engine.config.prefetch_cap if prefetch != "off" else 0,
            prefetch_ratio=engine.config.prefetch_ratio if prefetch != "off" else 0.0,
            prefetched_per_step=list(m["prefetched_per_step"]),
            prefetch_precision=list(m["prefetch_precision"]),
            prefetch_coverage=list(m["prefetch_coverage"]),
            indexer_plans=plan_labels(engine.cache.layers[0].plans),
            weights=self.weights,
            weight_bytes=self.weight_bytes,
        )

    def breakdown(
        self, wl: Workload, warm_steps: int = 4, steps: int = 8, graphs: bool = False
    ) -> dict:
        """Profile ``steps`` decode steps at the workload's full batch (all requests admitted,
        ``warm_steps`` run first); per-step time by category (see echo_compile.bench.breakdown).
        The steps run eagerly (the profiler cannot attribute kernels inside a CUDA graph): a
        compiled system is profiled through an eager engine of the same configuration and model,
        built for it and dropped after (its own compiled engine is left as it was).
        ``graphs=True`` profiles a compiled system's own steps instead (the CUDA graph replays
        it serves with: the kernels by name, their total and the cache ops' share by kernel
        name; the rest is "other")."""
        if self.front is not self.engine:
            raise ValueError("the breakdown profiles one process: not with dp/tp/ep > 1")
        if not self.compiled or graphs:
            return self._breakdown(self.engine, wl, warm_steps, steps, regions=not self.compiled)
        eager = Engine(self.model, self.model.config, None, self.engine.config, model_name="bench")
        if self.locality.repeat > 0:
            eager.logits_processors.append(self.locality)
        try:
            return self._breakdown(eager, wl, warm_steps, steps)
        finally:
            del eager
            gc.collect()

    def _breakdown(
        self, engine: Engine, wl: Workload, warm_steps: int, steps: int, regions: bool = True
    ) -> dict:
        from echo_compile.bench.breakdown import profile_steps

        engine.reset_stats()
        prompts = self._prompts(wl)
        n = min(wl.requests, engine.config.max_batch)
        longer = replace(wl, output_len=breakdown_tokens(steps, warm_steps))
        for i in range(n):
            self._add(longer, i, prompts[i], engine)
        warm_until = engine.num_decode_steps + warm_steps  # a compiled engine has run before
        while engine.num_decode_steps < warm_until:
            engine.step()
        engine.cache.reset_stats()  # the hit rate of the profiled steps alone
        rows, decodes = engine.decode_rows, engine.num_decode_steps
        out = profile_steps(
            self.model, engine.step, steps, cuda=engine.device.type == "cuda", regions=regions
        )
        out["graphs"] = not regions
        # the batch the profiled steps decoded (n was recorded: a request the pools could not
        # admit beside the others made it smaller than that, silently)
        b = (engine.decode_rows - rows) / max(engine.num_decode_steps - decodes, 1)
        out["batch"] = int(b) if b == int(b) else round(b, 2)  # (an int as the JSONs record it)
        out["hit_rate"] = list(engine.metrics()["hit_rate"])
        # the consecutive-step top-k overlap of a few more steps, from the indexer's selections
        # (not of a compiled step: the probe wraps the cache layers' select, a recompile)
        out["topk_overlap"] = None if not regions else self._overlap(engine, wl)
        while engine.has_unfinished():
            engine.step()
        return out

    @staticmethod
    def _overlap(engine: Engine, wl: Workload) -> list[float]:
        from echo_compile.bench.locality import OverlapProbe

        probe = OverlapProbe(engine.cache)
        try:
            for _ in range(min(4, wl.output_len)):
                if engine.has_unfinished():
                    engine.step()
        finally:
            probe.close()
        return probe.overlap()

    def close(self) -> None:
        """Free the pools (pinned host memory, device memory) before the next system is built."""
        self.engine = self.front = None  # type: ignore[assignment]
        torch._dynamo.reset()  # the compiled step and its CUDA graphs hold the cache's buffers
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def breakdown_tokens(steps: int, warm_steps: int = 4) -> int:
    """Tokens each request of ``System.breakdown`` generates: the warm-up and profiled steps, then
    the overlap probe's (+ 6). The engine's host pool and context limit must hold them too."""
    return warm_steps + steps + 6
