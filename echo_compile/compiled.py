"""The compiled model object: one fullgraph step per batch bucket, cache management included.

``echo_compile.compile(model, ...)`` returns a ``CompiledModel``. It owns:
- the model (weights, static),
- the ``KVCache`` (host KV pool, paged indexer cache, per-layer GPU pools: static buffers that the
  captured graphs mutate in place),
- one compiled decode step per decode bucket (``dynamic_decode``: one for every bucket, its
  batch dim symbolic) and (unless ``compile_prefill=False``) one compiled prefill step per chunk
  bucket, for any context limit (an uncompiled prefill runs eagerly).

Call signature (all device tensors; see docs/CONTRACTS.md for the slot/page conventions)::

    logits = cm.decode(input_ids [B], positions [B], out_slots [B], block_table [B, P],
                       seq_lens [B])
    logits = cm.prefill(input_ids [T], positions [T], out_slots [T], block_table [1, P],
                        seq_lens [1])

``input_ids``, ``positions``, ``out_slots`` are int64, ``block_table`` and ``seq_lens`` int32;
``block_table`` has ``runner.pages_per_seq`` columns (a prefill's may have fewer when prefill is
not compiled). A wrong dtype, shape or device is a ``ValueError`` naming the tensor. On the CPU
the values are checked too (reading them costs no device sync there): token ids in ``[0,
vocab_size)``, positions in ``[0, max_model_len)``, each below its row's ``seq_lens``, which are
at most ``max_model_len``, out slots ``-1`` or host slots, block-table entries host pages; a bad
one is a ``ValueError`` naming the tensor and the value, raised before anything runs. On CUDA
the values (pages, slots, positions, ids) are the caller's to get right: checking them would
sync with the device. Any strides do (a view is copied to
the row-major layout the steps were compiled on). The steps run without autograd, whatever the
caller's grad or inference mode, with autocast off and in the torch globals of ``compile()``'s
time (CPU threads, default dtype, fp32 matmul precision, reduced-precision reductions), whatever
the caller's at the call: a graph is guarded on them, and a change after warm-up would be a
refused recompile.
``decode`` returns fp32 logits [B, V] (B padded internally to the next bucket and cut back);
``prefill`` takes at most ``prefill_chunk`` tokens per call (a longer prompt: one call per chunk,
in order) and returns the logits of the chunk's last token [1, V]. Outputs are cloned, so they
survive the next CUDA-graph replay. The engine (runtime.engine.Engine) drives the same object.

The GPU pools cache host rows by host slot: before a sequence's pages are handed to another
sequence, ``cm.release(pages)`` forgets them (the engine's scheduler does this at a request's
finish); without it the next owner's decode steps would attend the old rows cached under those
slots.

NOTE: a prefill keeps its context in one device prefill buffer per layer, indexed by position: run
one request's chunks in order, one request at a time (as the engine's scheduler does); chunks of
two requests interleaved would read each other's rows.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from custom_ops.backends.select import DEFAULT_BACKEND
from custom_ops.cache.config import PREFETCH_MARGIN
from custom_ops.kv_format import PAGE
from echo_compile import settings
from echo_compile.devices import check_device
from model.model import DeepseekV32ForCausalLM
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


def _row_major_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` has."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it is an inference tensor or its strides are not the row-major
    ones of its shape.

    NOTE: Dynamo guards every stride, size-1 dims' too, and the steps were compiled on row-major
    tensors: a batch-1 view ``tokens[:, -1]`` of a [1, 4] tensor has stride (4,), which is a
    recompile (refused after warm-up). ``contiguous()`` and ``clone()`` keep that stride: a
    size-1 view counts as contiguous. A fresh tensor has the standard strides."""
    if t.is_inference() or t.stride() != _row_major_strides(t.shape):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return t


def _set_bf16_reduce(v: bool) -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = v


def _set_fp16_reduce(v: bool) -> None:
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = v


# The process-global torch settings Dynamo guards every compiled graph on (GLOBAL_STATE) that a
# user (or ``LLM()``, which sets the thread count) may change, as (get, set): CPU threads, default
# dtype, fp32 matmul precision (TF32), bf16 / fp16 reduced-precision GEMM reductions.
_GLOBALS = (
    (torch.get_num_threads, torch.set_num_threads),
    (torch.get_default_dtype, torch.set_default_dtype),
    (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    (lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, _set_bf16_reduce),
    (lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction, _set_fp16_reduce),
)


def _torch_globals() -> tuple:
    """The values of ``_GLOBALS`` now."""
    return tuple(get() for get, _ in _GLOBALS)


@contextlib.contextmanager
def _pinned_globals(state: tuple, device: torch.device) -> Iterator[None]:
    """``state`` (``_torch_globals()``) and autocast off for the ``with`` body, the caller's again
    after it.

    NOTE: Dynamo guards a graph on them (GLOBAL_STATE): a caller's ``torch.autocast``,
    ``set_num_threads`` (``LLM()`` sets it: one built after a ``CompiledModel`` warmed up),
    ``set_default_dtype``, ``set_float32_matmul_precision`` or a reduced-precision reduction
    flag made every later call a recompile, refused after warm-up. The steps are bf16 by design:
    autocast has nothing to do there."""
    now = _torch_globals()
    changed = [(set_, v, was) for (_, set_), v, was in zip(_GLOBALS, state, now) if v != was]
    try:
        for set_, v, _ in changed:
            set_(v)
        with contextlib.ExitStack() as stack:
            for kind in ("cpu", "cuda") if device.type == "cuda" else ("cpu",):
                if torch.is_autocast_enabled(kind):  # (entered only then: ~5 us a context)
                    stack.enter_context(torch.autocast(kind, enabled=False))
            yield
    finally:
        for set_, _, was in changed:
            set_(was)


class CompiledStep:
    """A fullgraph torch.compile'd step (runtime.model_runner.CompiledStep); ``code``: the code
    object Dynamo keeps this step's compiled entries on (its own, see ``_own_code``). Every call
    (compiles and warm-up included) runs in the torch globals of its construction (``globals``,
    ``_GLOBALS``: thread count, default dtype, fp32 matmul precision, reduced-precision
    reductions) with autocast off, whatever the caller's (``_pinned_globals``)."""

    def __init__(
        self,
        compiled: Callable[..., torch.Tensor],
        device: torch.device,
        code,
        dynamic_batch: bool = False,
    ):
        self.compiled = compiled
        self.device = device
        self.code = code
        self.dynamic_batch = dynamic_batch
        self.frozen = False  # set by ModelRunner.warmup
        self.globals = _torch_globals()

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            # decode and prefill graphs alternate: start a new cudagraph-tree generation each call
            torch.compiler.cudagraph_mark_step_begin()
        # reproducible compiles and runs (settings.py says why), scoped to our own calls as the
        # stance below is, so that other torch users in the process are not affected
        with settings.deterministic_algorithms(), _pinned_globals(self.globals, self.device):
            if self.dynamic_batch and not self.frozen:
                _mark_batch_dynamic(args)
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
    fullgraph) that cannot afford Inductor's minute per graph on a small CPU. ``cuda_graphs =
    False``: Inductor's kernels without the CUDA graphs around them (a diagnostic: which of the
    two changes a GPU step's bits, ``bench_dynamic_decode --backend inductor_no_graphs``)."""

    def __init__(
        self, device: str | torch.device, strict: bool = False, backend: str = "inductor",
        cuda_graphs: bool = True,
    ):  # fmt: skip
        self.device = torch.device(device)
        self.strict = strict
        self.backend = backend
        self.cuda_graphs = cuda_graphs

    def __call__(
        self, step: StepModule, num_graphs: int, dynamic_batch: bool = False
    ) -> CompiledStep:
        settings.apply(num_graphs, strict=self.strict)
        opts = {}
        if self.backend == "inductor" and self.cuda_graphs:
            opts["mode"] = settings.compile_mode(self.device)
        method = _own_code(step)
        fn = torch.compile(method, fullgraph=True, dynamic=False, backend=self.backend, **opts)
        return CompiledStep(fn, self.device, method.__func__.__code__, dynamic_batch)


def _mark_batch_dynamic(args: tuple[torch.Tensor, ...]) -> None:
    """Dim 0 of every input marked dynamic (EngineConfig.dynamic_decode: in a decode step all six
    inputs are batch-sized; ``dynamic=False`` otherwise, so nothing else turns symbolic).

    NOTE: only until the step is frozen: the marks matter to a compile, and none follows warm-up
    (the graph's guards read the sizes, not the marks), and six ``mark_dynamic`` calls are
    host time a decode step would pay for nothing. Dynamo specializes a
    size-1 dim whatever the mark, so a call at B = 1 compiles a static graph of its own and the
    first call above 1 (the warm-up's largest bucket: ``ModelRunner.warmup`` runs them largest
    first) one graph guarded ``2 <= B`` that serves every bucket above 1; reduce-overhead then
    records a CUDA graph per batch size as it first sees it, in warm-up (docs/compile.md, "One
    compile for every decode bucket?")."""
    for t in args:
        torch._dynamo.mark_dynamic(t, 0)


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

    def release(self, pages: Sequence[int] | torch.Tensor) -> None:
        """Forget the host ``pages`` (a sequence's block-table entries, ids in ``[0, host_tokens //
        64)``) in every layer's GPU pool: call it when a sequence is done, before its pages hold
        another's rows. Its rows stay in the host pool; only the GPU copies are dropped.

        NOTE: the pools map host slot -> GPU row; a prefill or decode writing new rows into a
        slot does not update that map, so a page reused without ``release`` served the next
        sequence the old sequence's rows (silently different logits)."""
        if isinstance(pages, torch.Tensor):
            if pages.dim() > 1 or pages.dtype.is_floating_point or pages.dtype == torch.bool:
                raise ValueError(
                    f"pages must be a 1-D integer tensor or a list of ints, got a {pages.dtype} "
                    f"tensor of shape {list(pages.shape)}"
                )
            ids = pages.reshape(-1).tolist()
        else:
            ids = list(pages)
        n_pages = self.cache.config.host_tokens // PAGE
        bad = [p for p in ids if isinstance(p, bool) or not isinstance(p, int)]
        bad += [p for p in ids if p not in bad and not 0 <= p < n_pages]
        if bad:
            raise ValueError(
                f"pages must be host page ids in [0, {n_pages}) (host_tokens "
                f"{self.cache.config.host_tokens} // {PAGE}), got {bad[0]!r}"
            )
        if not ids:
            return
        dev = self.runner.device
        first = torch.tensor(ids, dtype=torch.int64).to(dev)[:, None] * PAGE
        with torch.inference_mode(False), torch.no_grad():
            self.cache.release((first + torch.arange(PAGE, device=dev)).flatten())

    def decode(self, input_ids, positions, out_slots, block_table, seq_lens) -> torch.Tensor:
        n = self._check(True, input_ids, positions, out_slots, block_table, seq_lens)
        cfg = self.cache.config
        if n > cfg.max_decode_rows:
            # the guaranteed recall needs every row's selection on the GPU at once
            raise ValueError(
                f"decode batch {n} exceeds the {cfg.max_decode_rows} rows a step may have "
                f"(max_batch {cfg.max_batch}; offloading: batch x top-k {cfg.topk} <= the GPU "
                f"pool of {cfg.gpu_tokens} rows)"
            )
        return self._run(True, input_ids, positions, out_slots, block_table, seq_lens)[:n]

    def prefill(self, input_ids, positions, out_slots, block_table, seq_lens) -> torch.Tensor:
        n = self._check(False, input_ids, positions, out_slots, block_table, seq_lens)
        chunk = self.runner.prefill_buckets[-1]
        if n > chunk:
            raise ValueError(
                f"prefill takes at most prefill_chunk ({chunk}) tokens per call, got {n}: run the "
                "prompt in chunks, in order, or compile with a larger prefill_chunk"
            )
        return self._run(False, input_ids, positions, out_slots, block_table, seq_lens)

    def _run(self, is_decode: bool, *inputs: torch.Tensor) -> torch.Tensor:
        # NOTE: in the grad mode the steps were compiled and frozen in (ModelRunner.warmup's
        # no_grad; a caller's grad mode or inference mode would be a recompile, refused after
        # warm-up), on inputs that are not inference tensors
        with torch.inference_mode(False), torch.no_grad():
            inputs = tuple(_row_major(t) for t in inputs)
            args = self.runner.pad_inputs(is_decode, *inputs)
            fn = self.runner.decode_fn if is_decode else self.runner.prefill_fn
            return fn(*args)

    def _check(self, is_decode: bool, *inputs: torch.Tensor) -> int:
        """The rows (decode) or tokens (prefill) of the call, after checking what the compiled
        steps' static shapes need, so a wrong one is an error naming it (after warm-up it
        would be a refused recompile, before it a silent one). The values (pages, positions)
        are the caller's: checking them would sync with the device."""
        names = ("input_ids", "positions", "out_slots", "block_table", "seq_lens")
        dtypes = (torch.int64, torch.int64, torch.int64, torch.int32, torch.int32)
        dev = self.runner.device
        for name, t, dtype in zip(names, inputs, dtypes, strict=True):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
            if t.device.type != dev.type or (dev.index is not None and t.device != dev):
                raise ValueError(f"{name} is on {t.device}, the model on {dev}")
        ids, pos, slots, bt, lens = inputs
        n = ids.shape[0] if ids.dim() == 1 else -1
        if n < (0 if is_decode else 1) or pos.shape != (n,) or slots.shape != (n,):
            what = "rows" if is_decode else "tokens (at least 1)"
            shapes = [tuple(t.shape) for t in (ids, pos, slots)]
            msg = f"input_ids, positions and out_slots must be 1-D of n {what}, got {shapes}"
            raise ValueError(msg)
        P = self.runner.pages_per_seq
        rows = n if is_decode else 1
        wide = is_decode or self.runner.prefill_static_width
        if bt.dim() != 2 or bt.shape[0] != rows or (bt.shape[1] != P if wide else bt.shape[1] > P):
            want = f"[{rows}, {P}]" if wide else f"[1, <= {P}]"
            msg = f"block_table must be {want} (pages_per_seq {P}), got {list(bt.shape)}"
            raise ValueError(msg)
        if lens.shape != (rows,):
            raise ValueError(f"seq_lens must be [{rows}], got {list(lens.shape)}")
        if dev.type == "cpu" and n > 0:
            self._check_values(is_decode, *inputs)
        return n

    def _check_values(self, is_decode: bool, *inputs: torch.Tensor) -> None:
        """The values of host (CPU) inputs, whose reads cost no device sync: out of range they
        were an IndexError naming no argument, or no error at all (a position past
        ``max_model_len``: logits of rows outside the block table), and a step that failed
        midway could leave the GPU pools' maps half updated."""
        ids, pos, slots, bt, lens = inputs
        cfg, limit = self.cache.config, self.runner.max_model_len
        vocab = self.model.config.vocab_size
        n_pages = cfg.host_tokens // PAGE
        if is_decode:  # rows of seq_len 0 are padding (the runner's own): nothing to check
            real = lens > 0
            row_lens = lens
        else:
            real = torch.ones_like(pos, dtype=torch.bool)
            row_lens = lens.expand(pos.shape[0])
        checks = (
            ("input_ids", ids, (ids < 0) | (ids >= vocab), f"in [0, {vocab}) (vocab_size)"),
            ("positions", pos, (pos < 0) | (pos >= limit), f"in [0, {limit}) (max_model_len)"),
            ("seq_lens", lens, (lens < 0) | (lens > limit), f"in [0, {limit}] (max_model_len)"),
            ("positions", pos, real & (pos >= row_lens), "below their row's seq_lens"),
            ("out_slots", slots, (slots < -1) | (slots >= cfg.host_tokens),
             f"-1 or host slots in [0, {cfg.host_tokens}) (host_tokens)"),
            ("block_table", bt, (bt < 0) | (bt >= n_pages),
             f"host pages in [0, {n_pages}) (host_tokens // {PAGE})"),
        )  # fmt: skip
        for name, t, bad, rule in checks:
            if bool(bad.any()):
                first = bad.nonzero()[0].tolist()
                at = first[0] if len(first) == 1 else tuple(first)
                raise ValueError(f"{name} must be {rule}, got {t[at].item()} at {name}[{at}]")


def _buckets(b):
    """A sequence of buckets as a tuple; anything else as given, for EngineConfig to name (2
    was a TypeError, 'int' object is not iterable)."""
    return tuple(b) if isinstance(b, Sequence) and not isinstance(b, (str, bytes)) else b


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
    prefetch: str = "off",
    prefetch_cap: int = 64,
    prefetch_ratio: float = 1 / 512,
    prefetch_margin: float = PREFETCH_MARGIN,
    prefill_buffer: bool = True,
    dynamic_decode: bool = False,
    device: str | torch.device | None = None,
    strict: bool = False,
    warmup_now: bool = False,
) -> CompiledModel:
    """Compile ``model`` (a ``model.DeepseekV32ForCausalLM``) for offloaded decode; see the module
    docstring for the call signature and the state the returned object owns.

    These options are ``runtime.EngineConfig``'s of the same names and defaults, checked there:
    ``host_tokens``, ``gpu_tokens``, ``kv_format``, ``offload``, ``max_batch``,
    ``max_model_len``, ``decode_buckets``, ``prefill_chunk``, ``compile_prefill`` (its prefill
    policy), ``kernel_backend``, ``prefetch``, ``prefetch_cap``, ``prefetch_ratio``,
    ``prefetch_margin``, ``prefill_buffer`` and ``dynamic_decode``. The others are this
    function's: ``device`` (by default the model's), ``strict`` (a skipped CUDA graph is an
    error) and ``warmup_now`` (warm up before returning). EngineConfig's serving options
    (dp/tp/ep, the scheduler's, prefix caching) are the engine's (``LLM``): a ``CompiledModel``
    has no scheduler. ``model`` is prepared for serving in place (``build_runner``: MLA's
    ``q_a_proj``, ``kv_a_proj_with_mqa`` and the indexer's ``wk`` become one ``qkv_a_proj``,
    docs/model_notes.md)."""
    if not isinstance(model, DeepseekV32ForCausalLM):
        raise TypeError(
            f"echo_compile.compile takes a model.DeepseekV32ForCausalLM (load_model gives one), "
            f"got {type(model).__module__}.{type(model).__qualname__}"
        )
    device = torch.device(device) if device is not None else next(model.parameters()).device
    config = EngineConfig(
        max_batch=max_batch,
        host_tokens=host_tokens,
        gpu_tokens=gpu_tokens,
        kv_format=kv_format,
        offload=offload,
        max_model_len=max_model_len,
        prefill_chunk=prefill_chunk,
        decode_buckets=_buckets(decode_buckets),
        device=str(device),
        compile_prefill=compile_prefill,
        kernel_backend=kernel_backend,
        prefetch=prefetch,
        prefetch_cap=prefetch_cap,
        prefetch_ratio=prefetch_ratio,
        prefetch_margin=prefetch_margin,
        prefill_buffer=prefill_buffer,
        dynamic_decode=dynamic_decode,
    )
    check_device(config.device, python=True)
    cm = CompiledModel(build_runner(model, config, StepCompiler(device, strict)))
    if warmup_now:
        cm.warmup()
    return cm
