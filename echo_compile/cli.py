"""The ``echo-compile`` command: demo, generate, serve, make-checkpoint, plan, bench (the parser
is cli_args.py's; the flags and the options they give: engine_args.py, serve_args.py,
generate_args.py, plan_args.py, process_args.py)."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from echo_compile.cli_args import parser, valued_flags
from echo_compile.compile_cache import configure_compile_cache
from echo_compile.devices import check_device
from echo_compile.engine_args import PREFETCH_OPTIONS, engine_options, given
from echo_compile.generate_args import sampling_params
from echo_compile.process_args import log_level
from echo_compile.serve_args import serve_options
from echo_compile.vllm_flags import aliased_flags, apply_vllm_flags, check_quantization

# NOTE: nothing here imports torch at module level: `echo-compile --help` (and a subcommand's
# --help) must answer without the seconds torch takes to import. Commands import what they run.

# What a user can cause: a bad path or file (OSError, incl. FileNotFoundError and PermissionError),
# a bad value or a corrupt config.json (ValueError, incl. json.JSONDecodeError and
# SamplingParamsError). They print one line and exit 2; anything else is a bug and tracebacks.
USER_ERRORS = (ValueError, OSError)

# an option whose name in the engine's (or a preset's) errors is not its flag's dest
OPTION_DESTS = {"collective_timeout_s": "collective_timeout", "n_experts": "experts"}

# the packages whose loggers --log-level sets (the library configures no logging of its own)
LOGGED_PACKAGES = ("echo_compile", "runtime", "model", "custom_ops")
LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Our packages' log lines on stderr from ``level`` up (e.g. the server's drain on shutdown,
    at info), other libraries' from warning, as Python's default. The command line's job, not a
    module's: an application embedding ``LLM`` keeps its own logging configuration. A handler
    already on the root logger (a test's, an embedding's) is kept, not doubled."""
    logging.basicConfig(format=LOG_FORMAT, stream=sys.stderr)  # (a no-op if root has handlers)
    for name in LOGGED_PACKAGES:
        logging.getLogger(name).setLevel(level.upper())


def _demo(a: argparse.Namespace) -> int:
    from echo_compile.demo import run_demo

    check_device(a.device)
    return run_demo(a)


def _generate(a: argparse.Namespace) -> int:
    sampling_params(a)  # NOTE: the flags checked before the model loads, not after
    check_device(a.device)
    check_quantization(a.vllm_quantization, a.model)
    from echo_compile.llm import LLM

    llm = LLM(
        a.model, compile=a.compile, fp8_weights=a.fp8_weights,
        generation_config=a.generation_config, **engine_options(a),
    )  # fmt: skip
    import os

    first = os.environ.get("RANK", "0") == "0"  # under torchrun every rank has the results
    params = sampling_params(a, llm.engine.sampling_defaults)
    refused = None
    try:
        for r in llm.generate(a.prompts, params, progress=first):
            if first:
                print(f"--- {r.finish_reason} ({r.stats.completion_tokens} tokens)\n{r.text}")
    except ValueError as e:
        if max(a.dp, a.tp, a.ep) == 1:
            raise
        # a prompt refused (too long, ...): refused on every rank alike (DistributedEngine),
        # so every rank reaches the clean end below; raised from there it was gloo's teardown
        # at exit that aborted a rank (SIGABRT: torchrun named it the root cause, not this)
        refused = e
    if max(a.dp, a.tp, a.ep) > 1:  # torchrun: the clean end serve's ranks have
        from runtime.distributed.process import finish

        # every rank at the barrier, the group destroyed, then the engine (which holds gloo
        # groups) freed now: left to the interpreter's finalization, gloo's teardown aborted
        # a rank after its results were printed (SIGABRT, exit 1, 2 runs of 3 here)
        finish()
        del llm
        gc.collect()
    if refused is not None:
        raise refused
    return 0


def _plan(a: argparse.Namespace) -> int:
    from runtime.distributed.plan import (
        GPU_MEM_GIB,
        check_memory,
        memory_plan,
        plan_engine,
        rank_weight_bytes,
        v32_config,
    )
    from runtime.engine_config import EngineConfig
    from runtime.kv_sizing import (
        GIB,
        GPU_MEMORY_UTILIZATION,
        HOST_MEMORY_FRACTION,
        SIZED,
        Memory,
        check_fractions,
        check_given_context,
        check_given_gpu_pool,
        sized_config,
    )

    if a.model is not None:
        if a.quant is not None:
            raise ValueError("--quant is V3.2's config's; --model plans the checkpoint's own")
        from model.checkpoint import resolve_model
        from model.config import ModelConfig

        config = ModelConfig.from_json(resolve_model(a.model) / "config.json")
    else:
        config = v32_config(a.quant or "awq")
    if a.gpus < 1:  # (the planner's error would name dp / tp, which were not given)
        raise ValueError(f"--gpus must be at least 1, got {a.gpus}")
    dp = a.gpus if a.dp is None else a.dp  # (0 is refused by the planner, not replaced)
    tp = a.gpus if a.tp is None else a.tp
    ep = tp if a.ep else 1
    # the sizes as serve takes them: given, they stand (one serve refuses is refused here);
    # left out, serve's start-up rule chooses them (kv_sizing.sized_config) from this plan's
    # memory, where serve reads its own (the ranks of a plan are alike: their least is theirs)
    named = {k for k in SIZED if getattr(a, k) is not None}
    d = EngineConfig()  # (a size left out: a placeholder the sizing replaces)
    eng = plan_engine(dp, 1 if a.ep else tp, d.gpu_tokens if a.gpu_tokens is None else a.gpu_tokens,
                      d.host_tokens if a.host_tokens is None else a.host_tokens, a.max_batch,
                      a.kv_format, not a.no_offload,
                      d.max_model_len if a.max_model_len is None else a.max_model_len, ep,
                      not a.no_prefill_buffer, device="cuda",
                      **given(a, PREFETCH_OPTIONS))  # fmt: skip
    check_given_context(config, eng, named)
    mem = a.gpu_mem_gib if a.gpu_mem_gib is not None else GPU_MEM_GIB[a.gpu]
    check_memory(mem, a.host_mem_gib, a.reserve_gib, a.gpus_per_node)  # (before the sizing)
    fractions = (  # checked even where they size nothing, as serve's
        HOST_MEMORY_FRACTION if a.host_memory_fraction is None else a.host_memory_fraction,
        GPU_MEMORY_UTILIZATION if a.gpu_memory_utilization is None else a.gpu_memory_utilization,
    )
    check_fractions(*fractions)
    weights, sizing = None, "sizes as given"
    if not set(SIZED) <= named | ({"gpu_tokens"} if a.no_offload else set()):
        # (first: a split the model refuses is the deployment's error, not the memory's)
        weights = rank_weight_bytes(config, eng, a.fp8_weights)
        # the host's memory sizes only an offloading host pool left out (kv_sizing.auto_sizes)
        if a.host_mem_gib is None and "host_tokens" not in named and not a.no_offload:
            raise ValueError(
                "--host-tokens left out: chosen from the host's memory, as serve chooses it; "
                "give --host-mem-gib (one host's memory, GiB) or --host-tokens"
            )
        ranks = min(max(dp, tp), a.gpus_per_node)  # (sharing one host: LOCAL_WORLD_SIZE)
        memory = Memory(int((a.host_mem_gib or 0) * GIB), int(mem * GIB), ranks)
        eng, sizing = sized_config(
            config, eng, named, memory, weights, *fractions, int(a.reserve_gib * GIB)
        )
        sizing = "chosen as serve chooses them: " + sizing.removeprefix("KV sizing: ")
        check_given_context(config, eng, named, sized=True)
        if named:
            sizing += "; given: " + ", ".join("--" + k.replace("_", "-") for k in sorted(named))
    check_given_gpu_pool(eng, named)
    plan = memory_plan(
        config, eng, mem, a.host_mem_gib, a.reserve_gib, a.fp8_weights, a.gpus_per_node, weights
    )
    print(plan.table(sizing))
    plan.check()  # a plan that does not fit: one error line, exit 2
    return 0


def _serve(a: argparse.Namespace) -> int:
    options = serve_options(a)
    check_device(a.device)
    check_quantization(a.vllm_quantization, a.model)
    from echo_compile.llm import LLM
    from runtime.async_engine import AsyncEngine
    from runtime.server import serve
    from runtime.server_lifecycle import bind_socket

    multi_rank = max(a.dp, a.tp, a.ep) > 1
    # one process: the address is taken before the weights load (a port in use, a bad host: one
    # line in seconds); with torchrun only rank 0 serves, and it binds once the ranks are up
    sock = None if multi_rank else bind_socket(options["host"], options["port"])
    try:
        llm = LLM(
            a.model, compile=a.compile, fp8_weights=a.fp8_weights,
            generation_config=a.generation_config, **engine_options(a),
        )  # fmt: skip
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if multi_rank:  # torchrun: rank 0 serves and drives, the others follow
        rc = _serve_multi_rank(llm, a, options)
        # the engine (and the gloo groups it holds) freed now, not in the interpreter's
        # finalization, where gloo's teardown aborted the process now and then
        # ("terminate called without an active exception", exit -6, after a clean stop)
        del llm
        gc.collect()
        return rc
    serve(AsyncEngine(llm.engine), a.served_model_name or [a.model], sock=sock, **options)
    return 0


def _serve_multi_rank(llm, a: argparse.Namespace, options: dict) -> int:
    """``serve --dp/--tp/--ep``: rank 0 runs the HTTP server over a ``DriverEngine``, every other
    rank follows its calls (runtime/distributed/driver.py says why rank 0 drives)."""
    import os
    import signal

    from runtime.async_engine import AsyncEngine
    from runtime.distributed.driver import DriverEngine, follow
    from runtime.distributed.process import RankFailure, finish, shutdown
    from runtime.server import serve

    try:
        if llm.engine.ctx.rank != 0:
            # NOTE: torchrun and a terminal's Ctrl-C signal every rank; rank 0 drains its requests
            # and then tells us to stop, so we must outlive the signal.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                follow(llm.engine)
            except RankFailure as e:  # rank 0 failed (e.g. its port was taken) and said so
                shutdown()
                print(f"echo-compile: error: {e}", file=sys.stderr)
                return 1
        else:
            # a rank gone or a failed step ends the engine: stop the server as SIGTERM does (it
            # drains what is left), then exit 1 below, so the job ends instead of serving errors
            def stop_serving() -> None:
                # NOTE: only while the server's SIGTERM handler is in place (the default action
                # would kill rank 0 without its error line); after serve() returns, the failure
                # is reported below anyway
                if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
                    os.kill(os.getpid(), signal.SIGTERM)

            driver, served = DriverEngine(llm.engine, on_failure=stop_serving), False
            try:
                serve(AsyncEngine(driver), a.served_model_name or [a.model], **options)
                served = True
            finally:
                driver.close(failed=not served)
            if driver.failure is not None:
                shutdown()
                print(f"echo-compile: error: {driver.failure.splitlines()[0]}", file=sys.stderr)
                return 1
    except BaseException:
        shutdown()
        raise
    finish()  # every rank got here: the followers saw the stop, rank 0 sent it
    return 0


def _make_checkpoint(a: argparse.Namespace) -> int:
    from model.checkpoint import make_checkpoint

    kw, given = {}, []
    for flag, key in (("layers", "num_layers"), ("experts", "n_experts")):
        v = getattr(a, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag} must be at least 1, got {v}")
        if v is not None:
            kw[key] = v
            given.append(f"--{flag} {v}")
    if a.preset == "tiny" and given:  # (make_checkpoint's own error names its Python options)
        raise ValueError(
            f"{' '.join(given)}: the bench preset's sizes (--preset bench); the tiny preset's are "
            "fixed"
        )
    out = make_checkpoint(a.out, preset=a.preset, fp8=a.fp8, awq=a.awq, seed=a.seed, **kw)
    print(f"wrote {out}")
    return 0


COMMANDS = {
    "demo": _demo,
    "generate": _generate,
    "plan": _plan,
    "serve": _serve,
    "make-checkpoint": _make_checkpoint,
}


def _user_error(e: BaseException, flags: dict[str, str]) -> int:
    """One error line; a config error naming an option the command line set by a flag
    (EngineConfig's "max_batch must be ...") names the flag ("--max-batch must be ..."), and
    states the flag's own rule: an option's "or None" (left unset) is no value a flag takes."""
    msg = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the message holds
    name, _, rest = msg.partition(" ")
    if rest.startswith("must ") and (flag := flags.get(OPTION_DESTS.get(name, name))):
        msg = f"{flag} {rest.replace(' or None, got ', ', got ', 1)}"
    print(f"echo-compile: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags: dict[str, str] = {}
    try:
        # every option after `bench` belongs to the benchmark's parser (`-- bench` too)
        if argv[:1] == ["bench"] or argv[:2] == ["--", "bench"]:
            from echo_compile.bench.flags import parse

            rest = argv[argv.index("bench") + 1 :]
            ap, a = parse(rest)  # --help and usage errors exit here, before any torch
            from echo_compile.bench.cli import run

            return run(ap, a, rest)
        ap = parser()
        a = ap.parse_args(argv)  # --help and usage errors exit here, before any torch
        flags = valued_flags(ap, a.cmd)
        from echo_compile.threads import configure_threads

        configure_logging(log_level(a))
        configure_compile_cache()
        apply_vllm_flags(a, argv)  # (logs the vLLM flags taken as no-ops)
        flags.update(aliased_flags(a))  # (--max-num-seqs gave max_batch: an error names it)
        configure_threads(a.threads)
        return COMMANDS[a.cmd](a)
    except USER_ERRORS as e:
        return _user_error(e, flags)
    except KeyboardInterrupt:  # Ctrl-C while loading (a running server drains instead)
        print("echo-compile: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


if __name__ == "__main__":
    sys.exit(main())
