"""One compile for every decode bucket? EngineConfig.dynamic_decode against the default.

By default the engine compiles its decode step once per decode bucket, static shapes
(``echo_compile.compiled.StepCompiler``: ``dynamic=False``). This compares, on the tiny checkpoint
with decode buckets 1, 2, 4, 8 (prefill eager), each in a fresh process:

- ``static``: the engine's compiler, ``runner.warmup()`` (3 calls a bucket, then frozen);
- ``dynamic``: ``EngineConfig(dynamic_decode=True)``: the same step compiled ONCE with dim 0 (the
  batch) of its six inputs marked dynamic (``torch._dynamo.mark_dynamic`` before each call;
  ``dynamic=False`` otherwise, so nothing else turns dynamic), the same warm-up;
- ``eager``: no compile.

Each then runs greedy requests, 1, 2, 4 and 8 at a time (decode batches of every size up to 8:
the buckets, and the sizes between padded to them), with
the steps frozen (``fail_on_recompile``): the warm-up seconds, Dynamo's graphs (one Inductor
compile each, ``fullgraph``), graph breaks, every recompile's guard failure, and the decode logits
of dynamic vs static vs eager, step by step.

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python -m benchmarks.bench_dynamic_decode \
        [--steps 4] [--out benchmarks/results/dynamic_decode_cpu.json]

``--backend inductor_no_graphs``: Inductor's kernels without CUDA graphs (on a GPU, which of the
two changes the compiled step's bits against eager).

``--backend aot_eager``: Dynamo and AOT tracing only (fake implementations, guards), no Inductor:
finds the blockers in seconds. NOTE: CPU only says whether it traces, compiles and agrees; CUDA
graphs (one capture per size under cudagraph trees, zero skips) and Triton's speed with symbolic
shapes need a GPU (docs/compile.md, "One compile for every decode bucket?").

``--speed`` (a GPU): the decode step's speed instead, on the bench model (``--layers``,
``--experts``; offloading, fp8 KV, ``--ctx`` tokens a request, decode-only as ``echo-compile
bench``): one engine per mode (static, dynamic; each in a fresh process) with decode buckets 1, 2,
4, ..., 64, its warm-up seconds and Dynamo graphs, then the median decode step with 1, 16 and 64
requests in that same engine (written to ``benchmarks/results/dynamic_decode_speed.json`` unless
``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.bench_warmup import _cold_prefix, _env, _write
from echo_compile.bench.harness import System
from echo_compile.bench.model_builder import build_model
from echo_compile.bench.workload import Workload
from echo_compile.compiled import StepCompiler
from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.tokenizer import Tokenizer

BUCKETS = (1, 2, 4, 8)
OUT = "benchmarks/results/dynamic_decode_cpu.json"
SPEED_OUT = "benchmarks/results/dynamic_decode_speed.json"
MODES = ("eager", "static", "dynamic")
BACKENDS = ("inductor", "inductor_no_graphs", "aot_eager")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_mode(mode: str, backend: str, steps: int, logits_out: str) -> dict:
    """One mode in this process: warm-up, then 1, 2, 4, 8 greedy requests; the decode logits
    (``[B, V]`` per step) saved to ``logits_out``."""
    from torch._dynamo.utils import counters

    path = resolve_model("tiny")
    model, _ = load_model(path)
    device = next(model.parameters()).device
    graphs = backend != "inductor_no_graphs"
    compiler = None if mode == "eager" else StepCompiler(
        device, backend=backend if graphs else "inductor", cuda_graphs=graphs
    )  # fmt: skip
    b = max(BUCKETS)
    cfg = EngineConfig(
        max_batch=b, host_tokens=16384, gpu_tokens=b * model.config.index_topk, max_model_len=512,
        decode_buckets=BUCKETS, prefill_chunk=64, compile_prefill=False, device=str(device),
        dynamic_decode=mode == "dynamic",
    )  # fmt: skip
    engine = Engine(model, model.config, Tokenizer.from_dir(path), cfg, compiler=compiler)
    recompiles = _Lines()
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(recompiles)
    counters.clear()
    # the 1-minute load average: another process on a shared machine inflates the seconds
    res: dict = {"mode": mode, "backend": backend, "loadavg_before": os.getloadavg()[0]}
    t0 = time.perf_counter()
    try:
        res["warmup_s"] = round(engine.runner.warmup(progress=False), 1) if compiler else 0.0
    except Exception as e:  # a blocker: report it exactly
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback_tail"] = traceback.format_exc().splitlines()[-12:]
        res["failed_after_s"] = round(time.perf_counter() - t0, 1)
        return res
    res["loadavg_after_warmup"] = os.getloadavg()[0]
    res["graphs"] = counters["stats"]["unique_graphs"]
    res["graph_breaks"] = sum(counters["graph_break"].values())
    logs: list[torch.Tensor] = []
    rows: list[list[str]] = []  # each decode step's requests, in its logits' row order
    fwd = engine.runner.forward

    def rec(batch, *ahead):
        out = fwd(batch, *ahead)
        if batch.is_decode:
            logs.append(out.clone())
            rows.append([r.request_id for r in batch.requests])
        return out

    engine.runner.forward = rec
    rng = random.Random(5)
    try:
        for b in BUCKETS:
            # prefills go one a step: b more tokens, so that all b decode together for ~steps
            params = SamplingParams(max_tokens=steps + b, temperature=0.0, ignore_eos=True)
            for i in range(b):
                prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(20, 60))]
                engine.add_request(f"b{b}r{i}", prompt, params)
            while engine.has_unfinished():
                engine.step()
    except Exception as e:  # a recompile refused after warm-up, a failing op
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback_tail"] = traceback.format_exc().splitlines()[-12:]
    res["graphs_after_serving"] = counters["stats"]["unique_graphs"]
    # CUDA: reduce-overhead's graphs (a skip runs that call eagerly; a partition splits a graph)
    res["cudagraph"] = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    res["recompile_log"] = [ln for r in recompiles.lines for ln in r.splitlines()]
    res["decode_batches"] = [int(t.shape[0]) for t in logs]
    torch.save({"logits": logs, "requests": rows}, logits_out)
    return res


SPEED_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SPEED_BATCHES = (1, 16, 64)


def run_speed(mode: str, layers: int, experts: int, ctx: int, steps: int) -> dict:
    """One mode's engine on the bench model (in this process): warm-up seconds, Dynamo graphs,
    the cudagraph counters, and the median decode step with 1, 16 and 64 requests."""
    from torch._dynamo.utils import counters

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model("bench", layers, experts, device)
    per_req = -(-(ctx + steps + 64) // 64) * 64  # whole pages
    b = max(SPEED_BUCKETS)
    counters.clear()
    sut = System(
        model, "offload", max(b * model.config.index_topk, 200_000), b * per_req, "fp8", per_req,
        b, SPEED_BUCKETS, device, 1.0, dynamic_decode=mode == "dynamic",
    )  # fmt: skip
    res: dict = {"mode": mode, "warmup_s": round(sut.warmup_s, 1)}
    res["graphs"] = counters["stats"]["unique_graphs"]
    res["graph_breaks"] = sum(counters["graph_break"].values())
    res["step_ms_median"] = {}
    for n in SPEED_BATCHES:
        r = sut.run(Workload(requests=n, min_ctx=ctx, max_ctx=ctx, output_len=steps))
        res["step_ms_median"][n] = round(r.step_ms_median, 3)
        print(mode, n, r.step_ms_median, file=sys.stderr, flush=True)
    res["graphs_after_serving"] = counters["stats"]["unique_graphs"]
    res["cudagraph"] = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    sut.close()
    return res


def _compare(a: dict, b: dict) -> dict:
    """Two runs' decode steps (``run_mode``'s file: each step's logits and its requests, row by
    row; both runs schedule alike), step by step: how many equal (``torch.equal``), the max abs
    diff by batch size and by step, the first step where a request's greedy token (the logits'
    argmax) differs, and ``max_abs_diff_same_inputs``: over the rows of the requests that had
    decoded the same tokens so far (a request whose token differed decodes other tokens after
    it, so its later rows differ by more than rounding; the other requests of its batch, and
    the later requests, started from the same prompts, do not). Runs that scheduled
    differently (another request, or another row order, at some step) raise ``ValueError``: their
    rows would not be the same requests' logits."""
    _check_same_schedule(a["requests"], b["requests"])
    by: dict[int, float] = {}
    equal, first, same = 0, None, 0.0
    diverged: set[str] = set()  # the requests whose greedy tokens differed
    steps = []
    for i, (x, y, ids) in enumerate(zip(a["logits"], b["logits"], a["requests"], strict=True)):
        equal += int(torch.equal(x, y))
        d = (x - y).abs().amax(-1)  # [B]
        steps.append(round(float(d.max()), 4))
        by[x.shape[0]] = max(by.get(x.shape[0], 0.0), float(d.max()))
        flips = x.argmax(-1) != y.argmax(-1)  # [B]
        for row, rid in enumerate(ids):
            if rid in diverged:
                continue
            same = max(same, float(d[row]))
            if flips[row]:
                diverged.add(rid)
                first = i if first is None else first
    scale = max(float(t.abs().max()) for t in a["logits"])
    return {"steps": len(a["logits"]), "equal_steps": equal, "max_abs_diff_by_batch": by,
            "max_abs_logit": round(scale, 3), "first_divergent_step": first,
            "diverged_requests": len(diverged), "max_abs_diff_same_inputs": same,
            "max_abs_diff_by_step": steps}  # fmt: skip


def compare_pairs(logits: dict[str, dict]) -> dict:
    """``_compare`` of each pair of modes that both ran; a pair that cannot be compared (the runs
    scheduled differently) records its error, so the other pairs' results are still written."""
    pairs = [("dynamic", "static"), ("dynamic", "eager"), ("static", "eager")]
    out = {}
    for x, y in pairs:
        if x in logits and y in logits:
            try:
                out[f"{x}_vs_{y}"] = _compare(logits[x], logits[y])
            except ValueError as e:
                out[f"{x}_vs_{y}"] = {"error": str(e)}
    return out


def _check_same_schedule(a: list[list[str]], b: list[list[str]]) -> None:
    """Raise ``ValueError`` naming the first decode step whose requests (in row order) differ
    between two runs, or their step counts if one ran more steps."""
    for i, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            raise ValueError(
                f"the two runs scheduled differently: decode step {i} ran requests {list(x)} in "
                f"one and {list(y)} in the other, so their logits cannot be compared row by row"
            )
    if len(a) != len(b):
        raise ValueError(
            f"the two runs scheduled differently: {len(a)} decode steps in one and {len(b)} in "
            "the other, so their logits cannot be compared step by step"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="greedy tokens a request (default 4)")
    ap.add_argument("--backend", default="inductor", choices=BACKENDS,
                    help="inductor (default), inductor_no_graphs (no CUDA graphs) or aot_eager "
                    "(the logits comparison; --speed takes inductor only)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", default=None, help=f"the JSON (default {OUT}; --speed: {SPEED_OUT})")
    ap.add_argument("--speed", action="store_true", help="the step's speed on the bench model")
    ap.add_argument("--layers", type=int, default=4, help="--speed: the bench model's layers")
    ap.add_argument("--experts", type=int, default=16, help="--speed: its routed experts")
    ap.add_argument("--ctx", type=int, default=32768, help="--speed: tokens a request")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (the child: a mode)
    ap.add_argument("--logits", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.speed and a.backend != "inductor":  # (it was run with the engine's compile, silently)
        ap.error(f"--backend {a.backend}: --speed times the engine's own compile (Inductor, CUDA "
                 "graphs); --backend applies to the logits comparison only")  # fmt: skip
    # NOTE: --speed's default is its own file: it wrote the CPU study's (results/ holds it)
    a.out = a.out or (SPEED_OUT if a.speed else OUT)
    if a.one is not None:
        if a.speed:
            res = run_speed(a.one, a.layers, a.experts, a.ctx, a.steps)
        else:
            res = run_mode(a.one, a.backend, a.steps, a.logits)
        print(json.dumps(res))
        return 0
    if a.speed:
        return _speed(a)
    rows, logits = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes:  # each in a fresh process: no kernel of one reused by another
            f = f"{tmp}/{mode}.pt"
            cmd = [sys.executable, "-m", "benchmarks.bench_dynamic_decode", "--one", mode,
                   "--backend", a.backend, "--steps", str(a.steps), "--logits", f]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                rows[mode] = {"mode": mode, "error": done.stderr.strip().splitlines()[-12:]}
            else:
                rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
                if Path(f).exists():
                    logits[mode] = torch.load(f)
            print({k: v for k, v in rows[mode].items() if k != "recompile_log"}, flush=True)
    cmp = compare_pairs(logits)
    for k, v in cmp.items():
        print(k, v)
    command = f"python -m benchmarks.bench_dynamic_decode --steps {a.steps}"
    if a.backend != "inductor":
        command += f" --backend {a.backend}"
    res = {
        "what": "decode buckets 1,2,4,8 of the tiny checkpoint (prefill eager): the engine's "
        "static compile per bucket vs one compile with the batch dim marked dynamic; "
        "runner.warmup() seconds (3 calls a bucket), Dynamo graphs, logits step by step",
        "command": _cold_prefix() + command,
        "env": _env(),
        "buckets": list(BUCKETS),
        "modes": rows,
        "logits": cmp,
    }
    _write(Path(a.out), res)
    return 0


def _speed(a: argparse.Namespace) -> int:
    rows: dict = {}
    command = (
        f"python -m benchmarks.bench_dynamic_decode --speed --layers {a.layers} --experts "
        f"{a.experts} --ctx {a.ctx} --steps {a.steps}"
    )
    res = {
        "what": "the bench model's decode step (offloading, fp8 KV, decode-only), one engine per "
        f"mode with decode buckets {list(SPEED_BUCKETS)}: warm-up, Dynamo graphs, median step "
        f"at {list(SPEED_BATCHES)} requests",
        "command": _cold_prefix() + command,
        "env": _env(),
        "modes": rows,
    }
    for mode in ("static", "dynamic"):  # each in a fresh process
        cmd = [sys.executable, "-m", "benchmarks.bench_dynamic_decode", "--speed", "--one", mode,
               "--layers", str(a.layers), "--experts", str(a.experts), "--ctx", str(a.ctx),
               "--steps", str(a.steps)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            rows[mode] = {"mode": mode, "error": done.stderr.strip().splitlines()[-12:]}
        else:
            rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(rows[mode], flush=True)
        _write(Path(a.out), res)  # after each mode: a run cut short keeps the first
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
