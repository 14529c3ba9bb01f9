"""``LLM``'s start-up: from a checkpoint and the engine options to a warmed-up engine (the
checkpoint's meta read once, the FP8 choice, the KV sizing, the checks before any weight is read,
the load, whole or as one rank of a dp/tp job, and the warm-up)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from echo_compile.compiled import StepCompiler
from echo_compile.devices import check_device
from echo_compile.memory_checks import check_fits, check_host_pool, rank_weights
from runtime.distributed.process import ended_on_error
from runtime.distributed.rank_errors import rank_errors
from runtime.engine import Engine, EngineConfig
from runtime.engine_inputs import read_engine_inputs
from runtime.kv_sizing import (
    SIZED,
    check_given_context,
    check_given_gpu_pool,
    size_engine,
    warn_capped_batch,
)
from runtime.progress import LoadProgress

if TYPE_CHECKING:
    from runtime.distributed.dist_engine import DistributedEngine

# NOTE: the LLM's logger, as before this module was split from echo_compile/llm.py: the start-up
# lines are the LLM's (docs/compile.md, the CLI's --log-level, callers' log settings name it)
_log = logging.getLogger("echo_compile.llm")


def start_engine(
    model: str,
    engine_options: dict[str, Any],
    *,
    compile: bool | None,  # noqa: A002
    progress: bool,
    fp8_weights: str,
    generation_config: str,
    host_memory_fraction: float | None,
    gpu_memory_utilization: float | None,
) -> tuple[Engine | DistributedEngine, Path, float]:
    """``LLM(model, ...)``'s engine (its arguments, ``LLM``'s docstring), the checkpoint's
    directory and the warm-up's seconds (0.0 for an eager engine). ``engine_options`` gets the
    defaults filled in (``device``, ``enable_prefix_caching``)."""
    from model.checkpoint_meta import read_checkpoint_meta
    from model.fp8_choice import fp8_choice
    from model.loader import load_model
    from runtime.distributed.plan import rank_memory_device

    if "device" not in engine_options:
        engine_options["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    # on here, as vLLM's (serve and generate build an LLM: --no-enable-prefix-caching);
    # EngineConfig's own default is off, so an engine built directly (the tests, the bench)
    # holds no page once its requests are done
    engine_options.setdefault("enable_prefix_caching", True)
    config = EngineConfig(**engine_options)
    check_device(config.device, python=True)
    # A rank of a dp/tp/ep job joins the process group first, before anything it could fail
    # alone: an error of one rank's (its own option refused by the checkpoint, a checkpoint
    # its host lacks) raised there before the join and left the others waiting in it until the
    # collective timeout. The ranks then check they were given the same options, and each step
    # below that can fail on one rank, with no collective inside, ends in an exchange of the
    # ranks' errors (rank_errors): every rank raises the first failing rank's
    ctx, joined = None, False
    if config.world_size > 1:
        import torch.distributed as dist

        from runtime.distributed.dist_engine import join

        joined = not dist.is_initialized()  # (a caller's own group is the caller's to end)
        ctx = join(config)
    with ended_on_error(joined):  # (an error after the join: the group ended)
        if ctx is not None:  # (the options as given: fp8_weights before it is resolved)
            from runtime.distributed.dist_engine import check_same_options

            check_same_options(
                ctx,
                dict(dataclasses.asdict(config), device=config.device.split(":")[0],
                     fp8_weights=fp8_weights, generation_config=generation_config,
                     compile=compile, host_memory_fraction=host_memory_fraction,
                     gpu_memory_utilization=gpu_memory_utilization),
            )  # fmt: skip
        with rank_errors(ctx, "the start-up checks"):
            # the checkpoint's config, generation config and tokenizer's presence, read once:
            # the sizing, the checks, the engine inputs and the load (every rank's) all take it
            meta = read_checkpoint_meta(model)
            path, ckpt = meta.path, meta.config
            # one choice of the FP8 checkpoint's weights, which the sizing, the memory check
            # and the load (every rank's) all take: the load its modules kept FP8, found here
            fp8 = fp8_choice(path, ckpt, fp8_weights)
            asked, fp8_weights = fp8_weights, fp8.weights
            log_fp8_choice(ckpt, asked, fp8_weights)
            # on CUDA, the sizes left out chosen from the checkpoint and the memory (one log
            # line); the rank's weights and memory device found once for the sizing and the
            # memory check (the sizing changes no split or device they depend on)
            given = set(SIZED) & set(engine_options)
            weights = rank_weights(ckpt, config, fp8_weights)
            memory_device = rank_memory_device(config)  # (torchrun: this rank's GPU)
            # a given context the model or the pool cannot serve, refused as given (not lowered)
            check_given_context(ckpt, config, given)
        # (a multi-rank job: the ranks take the least of each automatic size, so all size
        # alike; a rank that cannot size stops every rank with its error)
        config = size_engine(
            meta, config, given, fp8_weights, host_memory_fraction, gpu_memory_utilization,
            weights, ctx, memory_device,
        )  # fmt: skip
        with rank_errors(ctx, "the start-up checks"):
            check_given_context(ckpt, config, given, sized=True)  # (a sizing skipped)
            check_given_gpu_pool(config, given)
            warn_capped_batch(ckpt, config)  # (a small GPU pool: fewer requests a step)
            # the tokenizer, the generation config and the options against the model config,
            # in seconds: a mistake there is not found after minutes of reading weights
            inputs = read_engine_inputs(meta, config, generation_config)
            if config.device.startswith("cuda"):
                check_fits(meta, config, fp8_weights, weights, memory_device)
            else:
                check_host_pool(meta, config)
            compiled = compile if compile is not None else config.device.startswith("cuda")
            if config.dynamic_decode and not compiled:  # (before minutes of reading weights)
                raise ValueError(
                    f"dynamic_decode (--dynamic-decode) is how the decode step is compiled, "
                    f"but this engine runs eagerly on {config.device} (compile={compile!r}; the "
                    "default compiles on CUDA only): pass compile=True (--compile) or leave "
                    "dynamic_decode off"
                )
        if config.world_size > 1:
            # one rank of a dp/tp job (torchrun): every rank runs this same code
            # (docs/multi_gpu.md)
            from runtime.distributed.dist_engine import build_distributed_engine

            engine = build_distributed_engine(
                meta, config, model, StepCompiler if compiled else None, ctx, fp8,
                generation_config=generation_config, inputs=inputs, progress=progress,
            )  # fmt: skip
        else:
            # (keep_mtp=False: the MTP layer is never run; held, it is GiBs of host memory)
            with LoadProgress(enabled=progress) as loading:
                net, extras = load_model(
                    meta, device=config.device, keep_mtp=False, fp8_weights=fp8,
                    progress=loading,
                )  # fmt: skip
            _log.info(loading.close())
            engine = Engine.from_loaded(
                net, extras, config, model_name=model,
                compiler=StepCompiler(config.device) if compiled else None, inputs=inputs,
            )  # fmt: skip
        # warm-up captures every bucket, then forbids recompiles of the engine's steps: from
        # here on a request can never trigger a compile
        warmup_s = engine.runner.warmup(progress=progress) if compiled else 0.0
        if compiled and progress:
            # NOTE: a log line, not a print: generate()'s output is the caller's stdout
            n = engine.runner.num_graphs
            where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default")
            _log.info("captured %d step graphs in %.1f s (compile cache: %s)", n, warmup_s, where)
    return engine, path, warmup_s


def log_fp8_choice(ckpt, asked: str, chosen: str) -> None:
    """The start-up line saying how an FP8 checkpoint's weights are served (none for others)."""
    if ckpt.quantization is None or ckpt.quantization.method != "fp8":
        return
    if chosen == "fp8":
        how = "kept FP8 (--fp8-weights bf16 dequantises them at load)"
    elif asked == "bf16":
        how = "dequantised to bf16 at load (--fp8-weights bf16)"
    else:  # "auto" on a checkpoint converted to bf16 (no weight_scale_inv tensors)
        how = "bf16 as stored (its config.json declares FP8, its tensors have no scales)"
    _log.info("FP8 checkpoint: weights %s", how)
