"""echo_compile.compile(model, ...): the compiled model object a user drives directly."""

from __future__ import annotations

import pytest
import torch

import echo_compile
from custom_ops.cache.kv_cache import KVCache
from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.model_runner import ModelRunner


def test_compiled_model_prefill_then_decode_matches_eager():
    model, _ = load_model(resolve_model("tiny"))
    kw = dict(
        host_tokens=1024,
        gpu_tokens=2 * model.config.index_topk,
        max_batch=2,
        max_model_len=256,
        decode_buckets=(2,),
        prefill_chunk=64,
    )
    cm = echo_compile.compile(model, **kw)
    assert isinstance(cm.cache, KVCache) and cm.model is model
    assert cm.runner.prefill_static_width  # the policy compiles prefill at this max_model_len
    P = cm.runner.pages_per_seq
    with pytest.raises(ValueError, match="exceeds the 2 rows"):  # before anything compiles
        z = torch.zeros(3, dtype=torch.int64)
        cm.decode(z, z, z, torch.zeros(3, P, dtype=torch.int32), z.int())
    # an eager twin with its own cache, driven through the same runner code
    eager = ModelRunner(
        model, KVCache(cm.cache.config), torch.device("cpu"), 256, (2,), (16, 32, 64)
    )
    bt = torch.zeros(2, P, dtype=torch.int32)
    bt[0, :2] = torch.tensor([0, 1])
    bt[1, :2] = torch.tensor([2, 3])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=g) for n in (50, 60)]
    for b, ids in enumerate(prompts):  # prefill all but the last prompt token
        n = ids.shape[0] - 1
        pos = torch.arange(n)
        slots = bt[b, pos // 64].long() * 64 + pos % 64
        args = (ids[:n], pos, slots, bt[b : b + 1], torch.tensor([n], dtype=torch.int32))
        out = cm.prefill(*args)
        pad = 64 - n
        ref = eager.prefill_step(
            torch.cat([ids[:n], ids.new_zeros(pad)]),
            torch.cat([pos, pos[-1:].expand(pad)]),
            torch.cat([slots, slots.new_full((pad,), -1)]),
            bt[b : b + 1],
            torch.tensor([n], dtype=torch.int32),
            torch.tensor([n - 1]),
        )
        assert out.shape == (1, model.config.vocab_size)
        torch.testing.assert_close(out, ref, rtol=0, atol=5e-2 * float(ref.abs().max()))
    # decode the last prompt token of both requests, then one more step
    ids = torch.stack([p[-1] for p in prompts])
    for _ in range(2):
        pos = torch.tensor([p.shape[0] - 1 for p in prompts])
        slots = bt[torch.arange(2), pos // 64].long() * 64 + pos % 64
        lens = (pos + 1).to(torch.int32)
        out = cm.decode(ids, pos, slots, bt, lens)
        ref = eager.decode_step(ids, pos, slots, bt, lens, torch.arange(2))
        assert out.shape == (2, model.config.vocab_size)
        err = (out - ref).abs().amax() / ref.abs().amax()
        assert float(err) <= 2e-2
        ids = out.argmax(-1)
        prompts = [torch.cat([p, i[None]]) for p, i in zip(prompts, ids)]


def test_after_warmup_decode_runs_in_any_grad_mode_and_checks_its_inputs():
    """The README's flow: warm up, then ``decode`` as a user calls it (grad mode on, or under
    inference_mode with tensors made there): the frozen steps run, no recompile refused. A
    tensor of the wrong dtype, shape or device is an error naming it. (aot_eager: the Dynamo
    guards are what this tests, test_engines.py says why.)"""
    from echo_compile.compiled import CompiledModel, StepCompiler
    from runtime.engine_config import EngineConfig
    from runtime.model_runner import build_runner

    model, _ = load_model(resolve_model("tiny"))
    cfg = EngineConfig(max_batch=2, host_tokens=1024, gpu_tokens=2 * model.config.index_topk,
                       max_model_len=256, decode_buckets=(2,), prefill_chunk=64, device="cpu",
                       compile_prefill=False)  # fmt: skip
    cm = CompiledModel(build_runner(model, cfg, StepCompiler("cpu", backend="aot_eager")))
    cm.warmup(progress=False)
    P = cm.runner.pages_per_seq

    def inputs():
        bt = torch.zeros(2, P, dtype=torch.int32)
        bt[1, 0] = 1
        pos = torch.tensor([0, 0])
        return (torch.tensor([5, 9]), pos, bt[:, 0].long() * 64, bt, (pos + 1).int())

    assert torch.is_grad_enabled()
    first = cm.decode(*inputs())
    with torch.inference_mode():
        again = cm.decode(*inputs())  # the same rows written again: the same logits
    assert torch.equal(first, again) and not first.requires_grad
    good = inputs()
    for i, bad, match in (
        (0, good[0].int(), "input_ids must be torch.int64"),
        (3, good[3].long(), "block_table must be torch.int32"),
        (3, good[3][:, :-1], rf"block_table must be \[2, {P}\]"),
        (1, good[1][:1], "1-D of n rows"),
        (4, good[4][:1], r"seq_lens must be \[2\]"),
        (0, good[0].tolist(), "input_ids must be a tensor"),
    ):
        args = list(good)
        args[i] = bad
        with pytest.raises(ValueError, match=match):
            cm.decode(*args)
    z = torch.zeros(65, dtype=torch.int64)  # one token over the chunk: the option is named
    with pytest.raises(ValueError, match=r"at most prefill_chunk \(64\) tokens per call, got 65"):
        cm.prefill(z, z, z, good[3][:1], good[4][:1])


def test_strided_batch_1_views_run_the_warm_steps():
    """A batch-1 view of a wider tensor (``tokens[:, -1]``, one row of a strided block table)
    keeps its stride on its size-1 dim, and ``contiguous()`` keeps it too: the steps were
    compiled on row-major tensors, so without a copy it was a recompile, refused after warm-up.
    It runs the warm steps and gives the logits of fresh tensors. (aot_eager, as above.)"""
    from echo_compile.compiled import CompiledModel, StepCompiler
    from runtime.engine_config import EngineConfig
    from runtime.model_runner import build_runner

    model, _ = load_model(resolve_model("tiny"))
    topk = model.config.index_topk
    cfg = EngineConfig(max_batch=1, host_tokens=1024, gpu_tokens=topk, max_model_len=256,
                       decode_buckets=(1,), prefill_chunk=16, device="cpu")  # fmt: skip
    cm = CompiledModel(build_runner(model, cfg, StepCompiler("cpu", backend="aot_eager")))
    assert cm.runner.prefill_static_width
    cm.warmup(calls=1, progress=False)
    P = cm.runner.pages_per_seq
    fresh_bt = torch.zeros(1, P, dtype=torch.int32)
    fresh_bt[0, 0] = 3
    tables = torch.zeros(4, P, dtype=torch.int32)
    tables[2] = fresh_bt[0]
    bt = tables[::2][1:2]  # the same [1, P] rows, strides (2P, 1)
    assert bt.stride() == (2 * P, 1) and bt.contiguous().stride() == (2 * P, 1)
    n = 5
    ids, pos, lens = torch.tensor([7, 11, 13, 17, 19, 23]), torch.arange(n), torch.tensor([n])
    lens = lens.int()
    got = cm.prefill(ids[:n], pos, 3 * 64 + pos, bt, lens)
    want = cm.prefill(ids[:n].clone(), pos, 3 * 64 + pos, fresh_bt, lens)  # the same rows again
    assert torch.equal(got, want)
    tokens = torch.tensor([[5, 6, 7, 9]])
    last = tokens[:, -1]  # [1], stride (4,)
    assert last.stride() == (4,) and last.contiguous().stride() == (4,)
    pos = torch.tensor([n])
    got = cm.decode(last, pos, 3 * 64 + pos, bt, lens + 1)
    want = cm.decode(torch.tensor([9]), pos, 3 * 64 + pos, fresh_bt, lens + 1)
    assert torch.equal(got, want)


def test_compile_takes_engine_config_s_cache_options_with_its_defaults():
    """compile()'s options are EngineConfig's (its docstring says so): the prefetch and
    prefill-buffer options reach the cache, and every shared option has EngineConfig's default.
    (Nothing compiles: the steps compile on their first call.)"""
    import dataclasses
    import inspect

    from runtime.engine_config import EngineConfig

    model, _ = load_model(resolve_model("tiny"))
    opts = dict(prefetch="request", prefetch_cap=16, prefetch_ratio=0.25, prefetch_margin=1.0,
                prefill_buffer=False)  # fmt: skip
    cm = echo_compile.compile(model, host_tokens=1024, gpu_tokens=2 * model.config.index_topk,
                              max_batch=2, max_model_len=256, prefill_chunk=64, **opts)  # fmt: skip
    cfg = cm.cache.config
    got = (cfg.prefetch, cfg.prefetch_cap, cfg.prefetch_ratio, cfg.prefetch_margin)
    assert got == ("request", 16, 0.25, 1.0)
    assert cfg.prefill_tokens == 0 and cm.cache.layers[0].staging.cap == 16
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    params = inspect.signature(echo_compile.compile).parameters
    shared = [n for n, p in params.items() if n in defaults and n != "device"]
    assert set(opts) <= set(shared)
    for name in shared:
        if params[name].default is not inspect.Parameter.empty:
            assert params[name].default == defaults[name], name


def test_compile_refuses_a_model_cast_from_bf16():
    """A model cast with .float() (or .half()) is refused when compiled, naming its dtype: the
    KV rows and cache ops are bf16, and its first step failed deep in Dynamo's trace."""
    model, _ = load_model(resolve_model("tiny"))
    kw = dict(host_tokens=1024, gpu_tokens=2 * model.config.index_topk, max_batch=2)
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(ValueError, match=f"the model's weights are {dtype}"):
            echo_compile.compile(model.to(dtype), **kw)


def test_compile_names_bad_decode_buckets():
    """decode_buckets=2 (not a list) was "TypeError: 'int' object is not iterable"."""
    model, _ = load_model(resolve_model("tiny"))
    kw = dict(host_tokens=1024, gpu_tokens=2 * model.config.index_topk, max_batch=2)
    for bad in (2, "2", (0, 2)):
        with pytest.raises(ValueError, match="decode_buckets must be a list of positive integers"):
            echo_compile.compile(model, decode_buckets=bad, **kw)
    # buckets given without max_batch (compile's default, 8): the error names what they must
    # end at (it said "end at max_batch", not its value)
    with pytest.raises(ValueError, match=r"end at max_batch \(8\), got \(1, 2, 4\)"):
        echo_compile.compile(model, host_tokens=1024, gpu_tokens=4096, decode_buckets=(1, 2, 4))
    for good in ([1, 2], range(1, 3)):
        cm = echo_compile.compile(model, decode_buckets=good, **kw)
        assert cm.runner.decode_buckets == (1, 2)


def test_compile_refuses_a_module_that_is_not_a_deepseek_model():
    """Another module (a Hugging Face model, a bare nn.Linear) is a TypeError naming its type,
    not an AttributeError from inside the runner."""
    want = r"DeepseekV32ForCausalLM .*torch\.nn\.modules\.linear\.Linear"
    with pytest.raises(TypeError, match=want):
        echo_compile.compile(torch.nn.Linear(4, 4), host_tokens=1024, gpu_tokens=4096)


def _tiny_aot_eager():
    """A CompiledModel of the tiny model (decode bucket 1, eager prefill), its steps compiled with
    aot_eager (the Dynamo guards are what the tests below test, test_engines.py says why)."""
    from echo_compile.compiled import CompiledModel, StepCompiler
    from runtime.engine_config import EngineConfig
    from runtime.model_runner import build_runner

    model, _ = load_model(resolve_model("tiny"))
    cfg = EngineConfig(max_batch=1, host_tokens=1024, gpu_tokens=model.config.index_topk,
                       max_model_len=256, device="cpu", compile_prefill=False)  # fmt: skip
    return CompiledModel(build_runner(model, cfg, StepCompiler("cpu", backend="aot_eager")))


def test_after_warmup_decode_runs_whatever_the_caller_s_torch_globals():
    """Dynamo guards each graph on process-global torch state: a caller's ``torch.autocast``,
    ``set_num_threads`` (``LLM()`` sets it: an LLM built in the process of a warm CompiledModel),
    ``set_default_dtype``, ``set_float32_matmul_precision`` or a reduced-precision reduction flag
    made every later call a recompile, refused after warm-up. The steps run in the state of their
    construction, autocast off, with the same logits, and the caller's state is theirs again
    after each call."""
    cm = _tiny_aot_eager()
    cm.warmup(calls=1, progress=False)
    bt = torch.zeros(1, cm.runner.pages_per_seq, dtype=torch.int32)

    def call():
        p = torch.tensor([3])
        return cm.decode(torch.tensor([5]), p, p.clone(), bt, (p + 1).int())

    ref = call()
    threads = torch.get_num_threads()
    mm = torch.backends.cuda.matmul
    bf16 = mm.allow_bf16_reduced_precision_reduction
    fp16 = mm.allow_fp16_reduced_precision_reduction
    changes = (
        ("autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16).__enter__(),
         lambda c: c.__exit__(None, None, None), lambda: torch.is_autocast_enabled("cpu")),
        ("threads", lambda: torch.set_num_threads(threads + 1),
         lambda _: torch.set_num_threads(threads), torch.get_num_threads),
        ("dtype", lambda: torch.set_default_dtype(torch.bfloat16),
         lambda _: torch.set_default_dtype(torch.float32), torch.get_default_dtype),
        ("precision", lambda: torch.set_float32_matmul_precision("high"),
         lambda _: torch.set_float32_matmul_precision("highest"),
         torch.get_float32_matmul_precision),
        ("bf16 reduce", lambda: setattr(mm, "allow_bf16_reduced_precision_reduction", not bf16),
         lambda _: setattr(mm, "allow_bf16_reduced_precision_reduction", bf16),
         lambda: mm.allow_bf16_reduced_precision_reduction),
        ("fp16 reduce", lambda: setattr(mm, "allow_fp16_reduced_precision_reduction", not fp16),
         lambda _: setattr(mm, "allow_fp16_reduced_precision_reduction", fp16),
         lambda: mm.allow_fp16_reduced_precision_reduction),
    )  # fmt: skip
    for name, change, undo, read in changes:
        ctx = change()
        try:
            before = read()
            assert torch.equal(call(), ref), name
            assert read() == before, name  # the caller's setting, restored
        finally:
            undo(ctx)


def test_warmup_refuses_fewer_than_one_call():
    """warmup(calls=0) compiled nothing and froze the steps: every later call was a refused
    "recompile" (Dynamo's "Detected recompile when torch.compile stance is
    'fail_on_recompile'"). It is a ValueError naming the argument."""
    cm = _tiny_aot_eager()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="warmup calls must be a positive integer"):
            cm.warmup(calls=bad, progress=False)
    assert not any(fn.frozen for _, _, fn in cm.runner.compiled)


def _tiny_eager(max_batch: int = 2):
    """A CompiledModel of the tiny model whose steps run eagerly (no compiler: the cache and
    input logic is what the tests below test, not a compile)."""
    from echo_compile.compiled import CompiledModel
    from runtime.engine_config import EngineConfig
    from runtime.model_runner import build_runner

    model, _ = load_model(resolve_model("tiny"))
    cfg = EngineConfig(max_batch=max_batch, host_tokens=1024,
                       gpu_tokens=max_batch * model.config.index_topk, max_model_len=256,
                       prefill_chunk=64, device="cpu")  # fmt: skip
    return CompiledModel(build_runner(model, cfg))


def _greedy(cm, ids: torch.Tensor, pages: list[int], steps: int = 3) -> list[torch.Tensor]:
    """Prefill ``ids`` into host ``pages``, then ``steps`` greedy decode steps: every logits."""
    return list(_greedy_steps(cm, ids, pages, steps))


def test_release_lets_a_sequence_reuse_another_s_pages():
    """The GPU pools map host slot -> GPU row, and writing new rows into a slot does not update
    that map: a second sequence in the first one's pages attended the first one's rows in its
    decode steps (different logits, silently). ``release(pages)`` forgets them: the second
    sequence's logits equal those of a fresh object. Bad page ids are refused, naming them, and
    leave the object usable."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(2, 500, (n,), generator=g) for n in (50, 40))
    cm = _tiny_eager()
    _greedy(cm, a, [0, 1])
    n_pages = 1024 // 64
    for bad, shown in (([0, n_pages], str(n_pages)), ([-1], "-1"), ([1.0], "1.0")):
        want = rf"pages must be host page ids in \[0, 16\).*got {shown}"
        with pytest.raises(ValueError, match=want):
            cm.release(bad)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        cm.release(torch.tensor([[0.0]]))
    cm.release(torch.tensor([0, 1]))
    reused = _greedy(cm, b, [0, 1])
    fresh = _greedy(_tiny_eager(), b, [0, 1])
    for got, want in zip(reused, fresh, strict=True):
        assert torch.equal(got, want)


def test_cpu_inputs_with_bad_values_are_refused_naming_them_and_nothing_is_lost():
    """On the CPU the values are read too (no device sync there): a token id out of the vocab,
    a position past max_model_len (it ran, on rows outside the block table), a slot or page
    outside the host pool, a position at or past its row's seq_lens. Each is a ValueError
    naming the tensor and the value, raised before the step runs: a sequence already prefilled
    decodes afterwards with the logits it would have had."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 500, (30,), generator=g)
    want = _greedy(_tiny_eager(), ids, [2], steps=1)
    cm = _tiny_eager()
    P = cm.runner.pages_per_seq
    bt = torch.zeros(1, P, dtype=torch.int32)
    bt[0, 0] = 2
    n = ids.shape[0]
    pos = torch.arange(n)
    out = cm.prefill(ids, pos, 128 + pos, bt, torch.tensor([n], dtype=torch.int32))
    assert torch.equal(out, want[0])
    p = torch.tensor([n])
    good = (out.argmax(-1), p, 128 + p, bt, (p + 1).int())
    for i, bad, match in (
        (0, torch.tensor([512]), r"input_ids must be in \[0, 512\) \(vocab_size\), got 512 at "
                                 r"input_ids\[0\]"),
        (0, torch.tensor([-3]), r"input_ids must be .*, got -3"),
        (1, torch.tensor([256]), r"positions must be in \[0, 256\) \(max_model_len\), got 256"),
        (4, torch.tensor([257], dtype=torch.int32), r"seq_lens must be in \[0, 256\].*got 257"),
        (1, torch.tensor([n + 1]), r"positions must be below their row's seq_lens, got 31"),
        (2, torch.tensor([1024]), r"out_slots must be -1 or host slots in \[0, 1024\).*got 1024"),
        (3, torch.full((1, P), 16, dtype=torch.int32),
         r"block_table must be host pages in \[0, 16\).*got 16 at block_table\[\(0, 0\)\]"),
    ):  # fmt: skip
        args = list(good)
        args[i] = bad
        with pytest.raises(ValueError, match=match):
            cm.decode(*args)
    bad_ids = ids.clone()
    bad_ids[7] = 600
    with pytest.raises(ValueError, match=r"input_ids must be .*, got 600 at input_ids\[7\]"):
        cm.prefill(bad_ids, pos, 128 + pos, bt, torch.tensor([n], dtype=torch.int32))
    assert torch.equal(cm.decode(*good), want[1])


def test_matches_generate_and_two_compiled_objects_do_not_interfere():
    """The object gives generate()'s greedy tokens for the same prompts (both eager), and two
    compiled objects in one process, their calls interleaved, each give the eager object's
    logits bit for bit (aot_eager, as above: each owns its compiled steps and cache)."""
    from echo_compile import LLM
    from runtime.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(2, 500, (n,), generator=g) for n in (50, 60))
    eager = _tiny_eager()
    want = [_greedy(eager, a, [0, 1]), _greedy(eager, b, [2, 3])]
    llm = LLM("tiny", compile=False, max_batch=2, host_tokens=1024, gpu_tokens=64,
              max_model_len=256, prefill_chunk=64, enable_prefix_caching=False,
              generation_config="none")  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    res = llm.generate([a.tolist(), b.tolist()], params)
    for r, logits in zip(res, want, strict=True):
        assert r.token_ids == [int(x.argmax(-1)) for x in logits]
    c1, c2 = _tiny_aot_eager(), _tiny_aot_eager()
    for cm in (c1, c2):
        cm.warmup(calls=1, progress=False)
    one, two = _greedy_steps(c1, a, [0, 1]), _greedy_steps(c2, b, [2, 3])
    for w1, w2 in zip(*want, strict=True):
        assert torch.equal(next(one), w1) and torch.equal(next(two), w2)


def _greedy_steps(cm, ids: torch.Tensor, pages: list[int], steps: int = 3):
    """``_greedy``'s logits one call at a time (a generator), for interleaving objects."""
    bt = torch.zeros(1, cm.runner.pages_per_seq, dtype=torch.int32)
    bt[0, : len(pages)] = torch.tensor(pages)
    n = ids.shape[0]
    pos = torch.arange(n)
    out = cm.prefill(ids, pos, bt[0, pos // 64].long() * 64 + pos % 64, bt,
                     torch.tensor([n], dtype=torch.int32))  # fmt: skip
    yield out
    for s in range(steps):
        p = torch.tensor([n + s])
        out = cm.decode(out.argmax(-1), p, bt[0, p // 64].long() * 64 + p % 64, bt, (p + 1).int())
        yield out
