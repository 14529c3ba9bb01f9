"""Per-rank functions for the gloo tests (tests/test_distributed*.py) that run the tiny model:
module-level so that ``runtime.distributed.process.spawn`` can start them in fresh processes.
Each writes what it saw to ``out`` (rank 0, or every rank where the test compares ranks). The
driver protocol's workers over a fake engine are tests/driver_workers.py's."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from runtime.sampling_params import SamplingParams

MAX_TOKENS = 6


def end() -> None:
    """A worker's clean end, after it dropped its engine (``del llm``): every rank at the
    barrier, the group destroyed (``finish``), then the engine's reference cycles, which hold
    gloo groups, collected now and not in the interpreter's finalization, where gloo's teardown
    aborted a process now and then after a clean stop (SIGABRT; echo_compile/cli.py's serve
    frees its engine the same way)."""
    import gc

    from runtime.distributed.process import finish

    finish()
    gc.collect()


def capture(store: dict):
    """A logits processor that records each decode step's logits row of every request."""

    def proc(reqs, logits):
        for r, row in zip(reqs, logits):
            store.setdefault(r.request_id, []).append(row.clone())
        return logits

    return proc


def generate_and_record(llm, prompts) -> dict:
    """Greedy generation of ``prompts`` with the decode logits of every request recorded."""
    store: dict = {}
    eng = getattr(llm.engine, "engine", llm.engine)  # the rank's local Engine
    eng.logits_processors.append(capture(store))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    placed: dict = {}  # request id -> DP rank, as placed (the front end forgets finished ids)
    front = llm.engine
    if hasattr(front, "owner"):
        add = front.add_request

        def add_and_record(request_id, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            add(request_id, *args, **kwargs)
            placed[request_id] = front.owner[request_id]

        front.add_request = add_and_record
    res = llm.generate(prompts, params)
    if hasattr(front, "owner"):
        del front.add_request  # (the class's again: later requests are not recorded)
        assert not front.owner, "finished requests must leave the front end's owner map"
    return {
        "tokens": [r.token_ids for r in res],
        "ids": [r.request_id for r in res],
        "logits": store,
        "owner": placed,
    }


def gen_worker(rank: int, out: str, cases: list, prompts: list, timeout_s: float) -> None:
    """Run every (name, engine options, prompt indices) case under one process group; save
    per-rank records."""
    from echo_compile.llm import LLM

    torch.set_num_threads(1)
    recs = {}
    for name, opts, which in cases:
        llm = LLM(
            "tiny", compile=False, progress=False, device="cpu", collective_timeout_s=timeout_s,
            **opts,
        )  # fmt: skip
        recs[name] = generate_and_record(llm, [prompts[i] for i in which])
        # without params: the sampling defaults, capped at the context (LLM._defaults); not
        # recorded (the capture processor removed)
        getattr(llm.engine, "engine", llm.engine).logits_processors.clear()
        recs[name]["no_params"] = len(llm.generate([prompts[which[0]]])[0].token_ids)
        recs[name]["unfinished_after"] = llm.engine.has_unfinished()  # a collective
        try:  # refused on every rank alike (a collective call), nothing left behind
            plp = SamplingParams(max_tokens=1, prompt_logprobs=1)
            llm.engine.add_request(f"{name}-plp", prompts[0], plp)
            recs[name]["prompt_logprobs"] = "accepted"
            while llm.engine.has_unfinished():
                llm.engine.step()
        except ValueError as e:
            recs[name]["prompt_logprobs"] = str(e)
    torch.save(recs, Path(out) / f"rank{rank}.pt")
    del llm
    end()


def die_worker(
    rank: int, out: str, opts: dict, prompts: list, timeout_s: float, inside: bool = False
) -> None:
    """Rank 1 exits abruptly after two steps (``inside``: in its third decode step's forward,
    between the model's collectives); rank 0 records the error it gets and when."""
    from echo_compile.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(
        "tiny", compile=False, progress=False, device="cpu", collective_timeout_s=timeout_s, **opts
    )
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"r{i}", p, params)
    runner, calls = llm.engine.runner, [0]
    decode = runner.decode_fn

    def dying_decode(*args):  # noqa: ANN002, ANN202
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            os._exit(3)
        return decode(*args)

    if inside:
        runner.decode_fn = dying_decode
    steps, t0 = 0, time.perf_counter()
    try:
        while True:
            if rank == 1 and steps == 2 and not inside:
                os._exit(3)  # a crash: no cleanup, no goodbye to the process group
            llm.engine.step()
            steps += 1
            t0 = time.perf_counter()
    except Exception as e:  # noqa: BLE001  (the test checks which, and its message)
        msg = f"{type(e).__name__}: {e}"
    (Path(out) / "rank0.txt").write_text(f"{time.perf_counter() - t0:.2f}\n{msg}")


def lint_worker(rank: int, out: str, opts: dict, timeout_s: float) -> None:
    """Trace one rank's dp/tp decode step (collectives included) with the CUDA-graph lint
    backend, fullgraph, on padding rows; save the report and the graph breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from echo_compile.graph_lint import LintReport, lint_backend
    from echo_compile.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(
        "tiny", compile=False, progress=False, device="cpu", collective_timeout_s=timeout_s, **opts
    )
    runner = llm.engine.runner
    report = LintReport()
    lint = lint_backend(report)
    ops: set[str] = set()

    def backend(gm, example_inputs):  # record the collectives Dynamo captured, then lint
        ops.update(str(n.target) for n in gm.graph.nodes if "c10d" in str(n.target))
        return lint(gm, example_inputs)

    counters.clear()
    step = torch.compile(runner.decode_step, backend=backend, fullgraph=True)
    with torch.no_grad():
        logits = step(*runner.padding_inputs(True, 2))
    torch.save(
        {"report": report, "breaks": dict(counters["graph_break"]), "shape": logits.shape,
         "collectives": sorted(ops)},
        Path(out) / f"rank{rank}.pt",
    )  # fmt: skip
    del llm, runner, step, backend
    end()


def nccl_worker(rank: int, out: str, cases: list, prompts: list, timeout_s: float) -> None:
    """The CUDA version of gen_worker: compiled (CUDA graphs, NCCL collectives inside), the
    graph gates recorded (cudagraph skips, partitions, graph breaks), recompiles forbidden."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from echo_compile.llm import LLM

    recs = {}
    counters.clear()
    for name, opts, which in cases:
        llm = LLM(
            "tiny", compile=True, progress=False, device="cuda", collective_timeout_s=timeout_s,
            **opts,
        )  # fmt: skip
        with torch.compiler.set_stance("fail_on_recompile"):
            recs[name] = generate_and_record(llm, [prompts[i] for i in which])
        recs[name]["logits"] = {k: [t.cpu() for t in v] for k, v in recs[name]["logits"].items()}
        recs[name]["graphs"] = llm.engine.runner.num_graphs
    recs["gates"] = {
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraph_partitions": counters["inductor"].get("cudagraph_partitions", 0),
        "graph_breaks": dict(counters["graph_break"]),
    }
    torch.save(recs, Path(out) / f"rank{rank}.pt")
    del llm
    end()


def prompt_kv_worker(
    rank: int, out: str, opts: dict, prompts: list, kvs: list, timeout_s: float
) -> None:
    """Requests whose prompt KV was computed elsewhere (``add_request(..., prompt_kv=)``, every
    rank passing the same rows), greedy; rank 0 saves every request's tokens and each rank its
    own step counts (a prefill step would mean the rows were recomputed, not written)."""
    from echo_compile.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(
        "tiny", compile=False, progress=False, device="cpu", collective_timeout_s=timeout_s, **opts
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, (p, kv) in enumerate(zip(prompts, kvs)):
        llm.engine.add_request(f"r{i}", p, params, prompt_kv=kv)
    tokens: dict = {}
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    local = llm.engine.engine
    steps = (local.num_steps, local.num_decode_steps)
    torch.save({"tokens": tokens, "steps": steps}, Path(out) / f"kv_rank{rank}.pt")
    del llm, local
    end()


def prefix_worker(rank: int, out: str, opts: dict, waves: list, timeout_s: float) -> None:
    """Prefix caching on data-parallel ranks: each wave of prompts added together and run to
    its end (greedy); rank 0 saves every request's tokens and owning rank, each rank its prefix
    cache's hits."""
    from echo_compile.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(
        "tiny", compile=False, progress=False, device="cpu", collective_timeout_s=timeout_s, **opts
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, owner, i = {}, {}, 0
    for wave in waves:
        for p in wave:
            rid, i = f"p{i}", i + 1
            llm.engine.add_request(rid, p, params)
            owner[rid] = llm.engine.owner[rid]
        while llm.engine.has_unfinished():
            for o in llm.engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    prefix = llm.engine.engine.scheduler.prefix
    hits = prefix.hits if prefix is not None else 0
    torch.save({"tokens": tokens, "owner": owner, "hits": hits}, Path(out) / f"px_rank{rank}.pt")
    del llm, prefix
    end()


def cli_generate_worker(rank: int, out: str, extra: tuple = (), own: tuple = ((), ())) -> None:
    """``echo-compile generate --dp 2 --tp 2`` as torchrun runs it on each rank; records its exit
    code and whether the process group is still up when it returns (left to the interpreter's
    finalization, gloo's teardown aborted a rank now and then). ``extra``: flags, then prompts
    that go before "hello there"; ``own[rank]``: flags this rank alone is given."""
    import torch.distributed as dist

    from echo_compile.cli import main

    argv = ["generate", "--dp", "2", "--tp", "2", "--device", "cpu", "--no-compile",
            "--collective-timeout", "60", *own[rank], *extra, "hello there",
            "--max-tokens", "2"]  # fmt: skip
    rc = main(argv)
    (Path(out) / f"rank{rank}.txt").write_text(f"{rc} {dist.is_initialized()}")


def sizing_error_worker(rank: int, out: str, cli: bool) -> None:
    """Rank 1 alone fails its own KV sizing (``kv_sizing._own_sizes`` raises, as a read of its
    memory could), each rank records what it raised. ``cli``: ``echo-compile generate --dp 2
    --tp 2`` with an OSError, its exit code recorded; else ``size_engine`` itself, as a rank of
    a dp=2 job, with an OSError, then a RuntimeError: each error's type and message."""
    from runtime import kv_sizing

    own_sizes = kv_sizing._own_sizes

    def fail(error: Exception):
        def sizes(path, config, *a):
            if rank == 1:
                raise error
            return own_sizes(path, config, *a)

        kv_sizing._own_sizes = sizes

    if cli:
        fail(OSError("cannot read /proc/meminfo"))
        cli_generate_worker(rank, out)
        return
    from model.checkpoint import resolve_model
    from runtime.distributed.process import init_distributed
    from runtime.engine_config import EngineConfig

    ctx = init_distributed("cpu", timeout_s=60.0)
    path, config = resolve_model("tiny"), EngineConfig(device="cpu", dp=2)
    rec = {}
    for error in (OSError("cannot read /proc/meminfo"), RuntimeError("CUDA driver error")):
        fail(error)
        try:
            kv_sizing.size_engine(path, config, set(), ctx=ctx)
            rec[type(error).__name__] = "sized"
        except Exception as e:  # noqa: BLE001
            rec[type(error).__name__] = (type(e).__name__, str(e))
    # the group is still up after each error: a sizing of every rank still agrees
    kv_sizing._own_sizes = own_sizes
    after = kv_sizing.size_engine(path, config, set(), ctx=ctx)
    rec["after"] = tuple(getattr(after, k) for k in kv_sizing.SIZED)
    torch.save(rec, Path(out) / f"rank{rank}.pt")
    end()


def metrics_worker(rank: int, out: str, opts: dict, prompts: list, timeout_s: float) -> None:
    """``serve --dp 2``'s engines without HTTP: rank 0 drives (``DriverEngine``) requests to
    their end, then reads the driver's metrics and the server's scrape of them; rank 1 follows.
    Each rank then saves its own engine's ``metrics()`` (no step after the driver's read)."""
    from echo_compile.llm import LLM
    from runtime.distributed.driver import DriverEngine, follow

    torch.set_num_threads(1)
    llm = LLM(
        "tiny", compile=False, progress=False, device="cpu", collective_timeout_s=timeout_s, **opts
    )
    rec: dict = {}
    if rank == 0:
        from runtime.server_metrics import ServerMetrics

        driver = DriverEngine(llm.engine)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            driver.add_request(f"m{i}", p, params)
        rec["owner"] = dict(llm.engine.owner)
        while driver.has_unfinished():
            driver.step()
        rec["driver"] = driver.metrics()
        met = ServerMetrics("tiny", 512)
        met.update(rec["driver"], 0)
        import prometheus_client as prom

        rec["scrape"] = prom.generate_latest(met.registry).decode()
        driver.close()
    else:
        follow(llm.engine)
    rec["own"] = llm.engine.engine.metrics()
    torch.save(rec, Path(out) / f"metrics_rank{rank}.pt")
    del llm
    end()


def kv_sizing_worker(rank: int, out: str, memory: list, lowered: list) -> None:
    """Size the tiny model as a CUDA rank of a dp=2 job, from faked memory (``memory[rank]``:
    host GiB, GPU total GiB): this rank's own sizes (alone), the agreed ones and their log lines,
    and what a given context that does not fit one rank's host raises on each. Then an ``LLM``
    of dp=2 on the CPU whose ranks' own sizes are ``lowered[rank]`` (max_model_len, host_tokens,
    gpu_tokens): the sizes its ranks were built with, or the error that stopped them."""
    import dataclasses
    import logging

    from model.checkpoint import resolve_model
    from runtime import kv_sizing
    from runtime.distributed import plan
    from runtime.distributed.process import init_distributed
    from runtime.engine_config import EngineConfig

    host_gib, gpu_gib = memory[rank]
    plan.device_memory_gib = lambda device: (gpu_gib, host_gib)
    plan.gpu_total_bytes = lambda device: int(gpu_gib * kv_sizing.GIB)
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append(r.getMessage())
    kv_sizing.logger.addHandler(handler)
    kv_sizing.logger.setLevel(logging.INFO)
    ctx = init_distributed("cpu", timeout_s=60.0)
    path, config = resolve_model("tiny"), EngineConfig(device="cuda", dp=2)
    sized = ("max_model_len", "host_tokens", "gpu_tokens")
    rec: dict = {"own": [getattr(kv_sizing.size_engine(path, config, set()), k) for k in sized]}
    del lines[:]
    agreed = kv_sizing.size_engine(path, config, set(), ctx=ctx)
    rec["agreed"], rec["lines"] = [getattr(agreed, k) for k in sized], list(lines)
    given = dataclasses.replace(config, max_model_len=163840)
    try:
        kv_sizing.size_engine(path, given, {"max_model_len"}, ctx=ctx)
        rec["given"] = "sized"
    except ValueError as e:
        rec["given"] = str(e)
    # the LLM: its ranks' own sizes made to differ (on the CPU the rule keeps the defaults)
    own = dict(zip(sized, lowered[rank]))
    kv_sizing._own_sizes = lambda path, config, *a: (dataclasses.replace(config, **own), "")
    from echo_compile.llm import LLM

    try:
        llm = LLM("tiny", compile=False, progress=False, device="cpu", dp=2, max_batch=2,
                  collective_timeout_s=60.0)  # fmt: skip
        rec["llm"] = [getattr(llm.engine.engine.config, k) for k in sized]
        rec["llm"].append(llm.engine.max_model_len)
        del llm
    except ValueError as e:
        rec["llm"] = str(e)
    torch.save(rec, Path(out) / f"rank{rank}.pt")
    end()


def run_bounded(fn, *args, deadline_s: float = 30.0) -> None:
    """``spawn(fn, 2, *args)``, every rank given ``deadline_s`` in all to end: a rank still
    running then is killed and the test fails as a hang (it does not block the suite)."""
    from runtime.distributed.process import spawn

    ctx = spawn(fn, 2, *args, join=False)
    end_at = time.monotonic() + deadline_s
    for p in ctx.processes:
        p.join(max(0.1, end_at - time.monotonic()))
    hung = [r for r, p in enumerate(ctx.processes) if p.exitcode is None]
    for r in hung:
        ctx.processes[r].kill()
        ctx.processes[r].join()
    assert not hung, f"ranks {hung} were still running after {deadline_s:g} s (a hang)"


def step_raise_worker(
    rank: int, out: str, opts: dict, prompts: list, where: str, drive: bool = False
) -> None:
    """Rank 1's step raises a ``RuntimeError`` (``where``: "schedule", in its third scheduling,
    before the step agreement; "model", in its third decode forward, between the model's
    collectives); every rank records the error it ends with. ``drive``: as ``serve`` runs, rank
    0 drives (``DriverEngine``, whose ``failure`` it records too) and rank 1 follows."""
    from echo_compile.llm import LLM
    from runtime.distributed.driver import DriverEngine, follow

    torch.set_num_threads(1)
    llm = LLM(
        "tiny", compile=False, progress=False, device="cpu", collective_timeout_s=20.0, **opts
    )
    eng, calls = llm.engine.engine, [0]
    target = "_schedule" if where == "schedule" else "decode_fn"
    owner = eng if where == "schedule" else eng.runner
    real = getattr(owner, target)

    def failing(*args):  # noqa: ANN002, ANN202
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise RuntimeError("injected step failure: bad tensor on rank 1")
        return real(*args)

    setattr(owner, target, failing)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    lines = []
    try:
        if drive and rank == 0:
            driver = DriverEngine(llm.engine)
            try:
                for i, p in enumerate(prompts):
                    driver.add_request(f"r{i}", p, params)
                while True:
                    driver.step()
            finally:
                lines.append(str(driver.failure))
                driver.close(failed=True)
        elif drive:
            follow(llm.engine)
        else:
            for i, p in enumerate(prompts):
                llm.engine.add_request(f"r{i}", p, params)
            while True:
                llm.engine.step()
    except Exception as e:  # noqa: BLE001  (the test checks which, and its message)
        lines.insert(0, f"{type(e).__name__}: {e}")
    (Path(out) / f"rank{rank}.txt").write_text("\n".join(x.replace("\n", " ") for x in lines))


def add_raise_worker(rank: int, out: str, opts: dict, prompts: list) -> None:
    """Rank 1's placement of the first prompt raises (an error of one rank before the add's
    first gather); every rank records what that add raised, then runs the other prompts to their
    end and records the ids that finished."""
    from echo_compile.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(
        "tiny", compile=False, progress=False, device="cpu", collective_timeout_s=20.0, **opts
    )
    sched = llm.engine.engine.scheduler
    placement = sched.placement

    def failing(prompt_ids, takes):  # noqa: ANN001, ANN202
        if rank == 1 and list(prompt_ids) == list(prompts[0]):
            raise RuntimeError("injected placement failure on rank 1")
        return placement(prompt_ids, takes)

    sched.placement = failing
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    lines = []
    try:
        llm.engine.add_request("bad", prompts[0], params)
        lines.append("accepted")
    except Exception as e:  # noqa: BLE001  (the test checks which, and its message)
        lines.append(f"{type(e).__name__}: {e}")
    for i, p in enumerate(prompts[1:]):
        llm.engine.add_request(f"r{i}", p, params)
    done = []
    while llm.engine.has_unfinished():
        done += [o.request_id for o in llm.engine.step() if o.finished]
    lines.append(" ".join(sorted(done)))
    (Path(out) / f"rank{rank}.txt").write_text("\n".join(lines))
    del llm
    end()
