"""The compiled model object: one fullgraph step per batch bucket, cache management included.

``echo_compile.compile(model, ...)`` returns a ``CompiledModel``. It owns:
- the model (weights, static),
- the ``KVCache`` (host KV pool, paged indexer cache, per-layer GPU pools: static buffers that the
  captured graphs mutate in place),
- one compiled decode step per decode bucket and (unless ``compile_prefill=False``) one compiled
  prefill step per chunk bucket, for any context limit (an uncompiled prefill runs eagerly).

Call signature (all device tensors; see docs/CONTRACTS.md for the slot/page conventions)::

    logits = cm.decode(input_ids [B], positions [B], out_slots [B], block_table [B, P],
                       seq_lens [B])
    logits = cm.prefill(input_ids [T], positions [T], out_slots [T], block_table [1, P],
                        seq_lens [1])

``decode`` returns fp32 logits [B, V] (B padded internally to the next bucket and cut back);
``prefill`` returns the logits of the chunk's last token [1, V]. Outputs are cloned, so they
survive the next CUDA-graph replay. The engine (runtime.engine.Engine) drives the same object.

NOTE: a prefill keeps its context in one device prefill buffer per layer, indexed by position: run
one request's chunks in order, one request at a time (as the engine's scheduler does); chunks of
two requests interleaved would read each other's rows.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Sequence

import torch
from torch import nn

from custom_ops.backends.select import DEFAULT_BACKEND
from echo_compile import settings
from runtime.engine_config import EngineConfig
from runtime.model_runner import ModelRunner, StepModule, build_runner

_step_ids = itertools.count()


def _own_code(step: StepModule) -> Callable[..., torch.Tensor]:
    """``step.forward`` as a method whose code object is this step's alone.

    NOTE: Dynamo keeps its compiled entries on the code object and counts recompiles per code
    object, and every engine's steps run ``StepModule.forward``: a second engine in the process
    added its buckets to the first one's entries, hit ``recompile_limit`` and died in warm-up
    (FailOnRecompileLimitHit, "tensor 'seq_lens' size mismatch"). A copy of the code (renamed, so
    traces say which step) gives each compiled step a cache of its own, which dies with it;
    ``torch._dynamo.reset()`` instead would drop a live engine's graphs."""
    fwd = type(step).forward
    kind = "decode" if step.is_decode else "prefill"
    name = f"{fwd.__name__}_{kind}_{next(_step_ids)}"
    code = fwd.__code__.replace(co_name=name)
    fn = types.FunctionType(code, fwd.__globals__, name, fwd.__defaults__, fwd.__closure__)
    return types.MethodType(fn, step)


class CompiledStep:
    """A fullgraph torch.compile'd step (runtime.model_runner.CompiledStep); ``code``: the code
    object Dynamo keeps this step's compiled entries on (its own, see ``_own_code``)."""

    def __init__(self, compiled: Callable[..., torch.Tensor], device: torch.device, code):
        self.compiled = compiled
        self.device = device
        self.code = code
        self.frozen = False  # set by ModelRunner.warmup

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            # decode and prefill graphs alternate: start a new cudagraph-tree generation each call
            torch.compiler.cudagraph_mark_step_begin()
        # reproducible compiles and runs (settings.py says why), scoped to our own calls as the
        # stance below is, so that other torch users in the process are not affected
        with settings.deterministic_algorithms():
            if self.frozen:
                # after warm-up no request may trigger a compile
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self.compiled(*args).clone()
            # a copy: the next graph replay overwrites the output
            return self.compiled(*args).clone()


class StepCompiler:
    """runtime.model_runner.StepCompiler: fullgraph, static shapes, reduce-overhead (CUDA graphs)
    on CUDA, with echo_compile.settings; ``strict`` (tests) makes a cudagraph skip an error.
    ``backend`` other than Inductor: CPU tests of the compile plumbing (Dynamo's caches, guards,
    fullgraph) that cannot afford Inductor's minute per graph on a small CPU."""

    def __init__(self, device: str | torch.device, strict: bool = False, backend: str = "inductor"):
        self.device = torch.device(device)
        self.strict = strict
        self.backend = backend

    def __call__(self, step: StepModule, num_graphs: int) -> CompiledStep:
        settings.apply(num_graphs, strict=self.strict)
        opts = {}
        if self.backend == "inductor":
            opts["mode"] = settings.compile_mode(self.device)
        method = _own_code(step)
        fn = torch.compile(method, fullgraph=True, dynamic=False, backend=self.backend, **opts)
        return CompiledStep(fn, self.device, method.__func__.__code__)


class CompiledModel:
    """See the module docstring."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.cache = runner.cache

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    def warmup(self, calls: int = 3, progress: bool = True) -> float:
        return self.runner.warmup(calls, progress)

    def decode(self, input_ids, positions, out_slots, block_table, seq_lens) -> torch.Tensor:
        n = input_ids.shape[0]
        cfg = self.cache.config
        if n > cfg.max_decode_rows:
            # the guaranteed recall needs every row's selection on the GPU at once
            raise ValueError(
                f"decode batch {n} exceeds the {cfg.max_decode_rows} rows a step may have "
                f"(max_batch {cfg.max_batch}; offloading: batch x top-k {cfg.topk} <= the GPU "
                f"pool of {cfg.gpu_tokens} rows)"
            )
        args = self.runner.pad_inputs(True, input_ids, positions, out_slots, block_table, seq_lens)
        return self.runner.decode_fn(*args)[:n]

    def prefill(self, input_ids, positions, out_slots, block_table, seq_lens) -> torch.Tensor:
        args = self.runner.pad_inputs(False, input_ids, positions, out_slots, block_table, seq_lens)
        return self.runner.prefill_fn(*args)


def compile(  # noqa: A001  (the public name: echo_compile.compile)
    model: nn.Module,
    *,
    host_tokens: int,
    gpu_tokens: int,
    kv_format: str = "bf16",
    offload: bool = True,
    max_batch: int = 8,
    max_model_len: int = 4096,
    decode_buckets: Sequence[int] | None = None,
    prefill_chunk: int = 2048,
    compile_prefill: bool | None = None,
    kernel_backend: str = DEFAULT_BACKEND,
    device: str | torch.device | None = None,
    strict: bool = False,
    warmup_now: bool = False,
) -> CompiledModel:
    """Compile ``model`` (a ``model.DeepseekV32ForCausalLM``) for offloaded decode; see the module
    docstring for the call signature and the state the returned object owns. The options are
    ``runtime.EngineConfig``'s (``compile_prefill``: its prefill policy)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    config = EngineConfig(
        max_batch=max_batch,
        host_tokens=host_tokens,
        gpu_tokens=gpu_tokens,
        kv_format=kv_format,
        offload=offload,
        max_model_len=max_model_len,
        prefill_chunk=prefill_chunk,
        decode_buckets=tuple(decode_buckets) if decode_buckets is not None else None,
        device=str(device),
        compile_prefill=compile_prefill,
        kernel_backend=kernel_backend,
    )
    cm = CompiledModel(build_runner(model, config, StepCompiler(device, strict)))
    if warmup_now:
        cm.warmup()
    return cm
