"""The context and KV pool sizes chosen from the checkpoint and the memory when left out
(runtime/kv_sizing.py): the rule over faked memory, its refusal, the CPU's small defaults, and
the flags that reach it."""

from __future__ import annotations

import logging

import pytest

from echo_compile import cli_args, engine_args
from model.checkpoint import resolve_model
from model.config import ModelConfig
from runtime.engine_config import EngineConfig
from runtime.kv_sizing import GIB, Memory, auto_sizes, size_engine

ROW = 4 * 1152  # the tiny model's 4 layers of bf16 rows, bytes per token
BIG = Memory(host_bytes=1024 * GIB, gpu_total_bytes=80 * GIB)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_json(resolve_model("tiny") / "config.json")


def test_left_out_the_context_is_the_models_and_the_pools_hold_max_batch_of_it(tiny):
    s = auto_sizes(tiny, EngineConfig(device="cuda"), set(), BIG, weight_bytes=GIB)
    assert (s.max_model_len, s.host_tokens) == (163840, 8 * 163840)
    # the GPU pool: the GPU's 0.9 after weights, reserve and the other buffers, at most the host's
    assert s.gpu_tokens == 8 * 163840
    small_gpu = Memory(1024 * GIB, gpu_total_bytes=int(10 * GIB))  # 9 GiB - 8 reserve - 1 weights
    s = auto_sizes(tiny, EngineConfig(device="cuda"), set(), small_gpu, weight_bytes=0)
    assert 8 * 32 <= s.gpu_tokens < 8 * 163840  # a full decode batch's selection at least
    assert s.gpu_tokens * ROW < 1 * GIB
    assert "gpu_tokens" in s.why and "max_model_len 163840 (the model's" in s.why


def test_a_host_too_small_for_the_context_lowers_it_and_says_so(tiny, caplog):
    caplog.set_level(logging.WARNING, logger="runtime.kv_sizing")
    host = Memory(host_bytes=GIB, gpu_total_bytes=80 * GIB, local_ranks=2)  # 0.4 GiB a rank
    s = auto_sizes(tiny, EngineConfig(device="cuda"), set(), host, weight_bytes=0)
    rows = int(0.8 * GIB / 2 / ROW) // 64 * 64
    assert (s.max_model_len, s.host_tokens) == (rows, rows)
    (line,) = [r.getMessage() for r in caplog.records]
    assert (
        f"max_model_len 163840 (the model's max_position_embeddings) does not fit the host: "
        f"lowered to {rows}"
        in line
        and "--host-memory-fraction 0.8" in line
    )
    # a fraction of its own: a pool of max_batch x the context where it fits
    s = auto_sizes(tiny, EngineConfig(device="cuda", max_batch=2), set(), BIG, 0, 0.01)
    assert (s.max_model_len, s.host_tokens) == (163840, 2 * 163840)


def test_a_given_context_that_does_not_fit_is_refused_naming_the_flags(tiny):
    host = Memory(host_bytes=GIB // 2, gpu_total_bytes=80 * GIB)
    config = EngineConfig(device="cuda", max_model_len=163840)
    with pytest.raises(ValueError) as e:
        auto_sizes(tiny, config, {"max_model_len"}, host, weight_bytes=0)
    msg = str(e.value)
    for part in ("--max-model-len 163840", "163840 KV rows", "0.7 GiB", "--host-tokens",
                 "93184 rows (0.4 GiB of host memory", "--host-memory-fraction 0.8"):  # fmt: skip
        assert part in msg, (part, msg)


def test_given_sizes_stand(tiny):
    config = EngineConfig(device="cuda", max_model_len=1000, host_tokens=2048, gpu_tokens=512)
    given = {"max_model_len", "host_tokens", "gpu_tokens"}
    s = auto_sizes(tiny, config, given, Memory(GIB, GIB), weight_bytes=0)
    assert (s.max_model_len, s.host_tokens, s.gpu_tokens) == (1000, 2048, 512)
    s = auto_sizes(tiny, EngineConfig(device="cuda", max_model_len=1000), {"max_model_len"},
                   BIG, weight_bytes=0)  # fmt: skip
    assert (s.max_model_len, s.host_tokens) == (1000, 8 * 1024)  # (whole pages)


def test_the_cpu_keeps_the_small_defaults_and_cuda_reads_the_memory(monkeypatch, caplog):
    """The CPU engine (tests, demo) keeps EngineConfig's sizes; on CUDA the left-out ones come
    from the memory (faked here) in one log line; memory that cannot be read leaves them."""
    from runtime.distributed import plan

    path = resolve_model("tiny")
    cpu = EngineConfig(device="cpu")
    assert size_engine(path, cpu, set()) is cpu
    assert (cpu.max_model_len, cpu.host_tokens, cpu.gpu_tokens) == (4096, 16384, 1024)
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: (70.0, 1024.0))
    monkeypatch.setattr(plan, "gpu_total_bytes", lambda device: 80 * GIB)
    caplog.set_level(logging.INFO, logger="runtime.kv_sizing")
    c = size_engine(path, EngineConfig(device="cuda"), set())
    assert (c.max_model_len, c.host_tokens) == (163840, 8 * 163840)
    assert c.gpu_tokens > 1024 and "KV sizing: max_model_len 163840" in caplog.text
    c = size_engine(path, EngineConfig(device="cuda", gpu_tokens=256), {"gpu_tokens"})
    assert c.gpu_tokens == 256

    def no_driver(device):
        raise RuntimeError("no driver")

    monkeypatch.setattr(plan, "gpu_total_bytes", no_driver)
    c = size_engine(path, EngineConfig(device="cuda"), set())
    assert (c.max_model_len, c.host_tokens, c.gpu_tokens) == (4096, 16384, 1024)
    assert "KV sizing from memory skipped (RuntimeError: no driver)" in caplog.text
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
        size_engine(path, cpu, set(), gpu_memory_utilization=1.5)


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_sizes_left_out_on_the_command_line_are_left_to_the_rule(cmd):
    parse = cli_args.parser().parse_args
    base = [cmd, "--model", "tiny"] + (["x"] if cmd == "generate" else [])
    keys = ("max_model_len", "host_tokens", "gpu_tokens", "host_memory_fraction",
            "gpu_memory_utilization")  # fmt: skip
    assert not set(keys) & set(engine_args.engine_options(parse(base)))
    flags = ["--max-model-len", "8192", "--host-tokens", "65536", "--gpu-tokens", "4096",
             "--host-memory-fraction", "0.5", "--gpu-memory-utilization", "0.85"]  # fmt: skip
    opts = engine_args.engine_options(parse([*base, *flags]))
    assert [opts[k] for k in keys] == [8192, 65536, 4096, 0.5, 0.85]


@pytest.mark.cuda
def test_on_a_gpu_an_llm_without_sizes_reads_the_real_memory_and_serves_a_long_prompt(caplog):
    """On a real GPU (no faked memory): ``LLM("tiny")`` without sizes takes the model's context,
    pools from the memory it reads, says so in one line, and serves a prompt longer than the
    CPU's 4096-token default context."""
    import torch

    from echo_compile.llm import LLM
    from runtime.sampling_params import SamplingParams

    caplog.set_level(logging.INFO, logger="runtime.kv_sizing")
    llm = LLM("tiny", device="cuda", compile=False, max_batch=2, progress=False)
    c = llm.engine.config
    assert c.max_model_len == 163840 and c.host_tokens == 2 * 163840
    assert 2 * 32 <= c.gpu_tokens <= c.host_tokens
    assert "KV sizing: max_model_len 163840" in caplog.text
    prompt = torch.randint(2, 500, (6000,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    assert len(out.token_ids) == 4


def test_sizes_all_given_or_moot_read_no_memory_and_log_nothing(monkeypatch, caplog):
    """GPU-only with its context and pool given (the demo's GPU-only engine): gpu_tokens does not
    apply, so nothing is sized, no memory is read and no (empty) line is logged."""
    from runtime.distributed import plan

    def unread(device):
        raise AssertionError("memory read")

    monkeypatch.setattr(plan, "device_memory_gib", unread)
    monkeypatch.setattr(plan, "gpu_total_bytes", unread)
    caplog.set_level(logging.INFO, logger="runtime.kv_sizing")
    c = EngineConfig(device="cuda", offload=False, max_model_len=512, host_tokens=4096)
    assert size_engine(resolve_model("tiny"), c, {"max_model_len", "host_tokens"}) is c
    assert caplog.records == []


def test_a_given_host_pool_caps_the_automatic_context_in_the_sizes_and_the_line(tiny):
    c = EngineConfig(device="cuda", host_tokens=65536)
    s = auto_sizes(tiny, c, {"host_tokens"}, BIG, weight_bytes=GIB)
    assert s.max_model_len == 65536  # (what EngineConfig.model_len would cap it at)
    assert "max_model_len 65536 (the given host_tokens)" in s.why


def test_a_fraction_that_sizes_nothing_is_warned_about_naming_the_flag(caplog):
    caplog.set_level(logging.WARNING, logger="runtime.kv_sizing")
    path = resolve_model("tiny")
    cpu = EngineConfig(device="cpu")
    assert size_engine(path, cpu, set(), host_memory_fraction=0.5) is cpu
    assert "--host-memory-fraction 0.5 has no effect" in caplog.text
    assert "this engine runs on cpu" in caplog.text
    caplog.clear()
    every = EngineConfig(device="cuda")
    assert size_engine(path, every, {"max_model_len", "host_tokens", "gpu_tokens"},
                       gpu_memory_utilization=0.7) is every  # fmt: skip
    assert "--gpu-memory-utilization 0.7 has no effect" in caplog.text
    caplog.clear()
    assert size_engine(path, cpu, set()) is cpu  # left out: nothing to say
    assert caplog.text == ""


@pytest.fixture
def no_load(monkeypatch):
    """``LLM``'s loader replaced: a start-up that passes its checks stops with "loaded"."""
    import model.loader

    def load(*a, **k):
        raise AssertionError("loaded")

    monkeypatch.setattr(model.loader, "load_model", load)


@pytest.mark.parametrize(
    "options, parts",
    [  # past the model's positions (V3.2's 163840, YaRN already applied): not lowered to them
        (dict(max_model_len=200000, host_tokens=262144),
         ("--max-model-len 200000", "max_position_embeddings 163840", "40 x original 4096",
          "at most 163840")),
        # past a given host pool: a request could never be admitted (it was lowered to the pool)
        (dict(max_model_len=100000, host_tokens=16384),
         ("--max-model-len 100000", "--host-tokens 16384 rows", "give --host-tokens 100032",
          "lower --max-model-len to at most 16384")),
        # the CPU keeps its default pool: named as the default
        (dict(max_model_len=100000),
         ("the CPU's default --host-tokens 16384", "--host-tokens 100032")),
    ],
)
def test_a_given_context_the_model_or_pool_cannot_serve_is_refused_before_the_load(
    no_load, options, parts
):
    from echo_compile.llm import LLM

    with pytest.raises(ValueError) as e:
        LLM("tiny", device="cpu", compile=False, progress=False, **options)
    for part in parts:
        assert part in str(e.value), (part, str(e.value))
    with pytest.raises(AssertionError, match="loaded"):  # what fits starts
        LLM("tiny", device="cpu", compile=False, progress=False, max_model_len=16384)


def test_a_given_context_is_refused_on_cuda_too_where_the_sizing_lowered_it(no_load, monkeypatch):
    """On CUDA the sizing capped a given context at the positions or a given pool silently."""
    import echo_compile.startup
    from echo_compile.llm import LLM
    from runtime.distributed import plan

    monkeypatch.setattr(echo_compile.startup, "check_device", lambda *a, **k: None)
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: (80.0, 100.0))
    monkeypatch.setattr(plan, "gpu_total_bytes", lambda device: 80 * GIB)
    for options, part in ((dict(max_model_len=200000), "max_position_embeddings 163840"),
                          (dict(max_model_len=100000, host_tokens=16384), "--host-tokens 16384")):
        with pytest.raises(ValueError, match=part):
            LLM("tiny", device="cuda", compile=False, progress=False, **options)
    with pytest.raises(AssertionError, match="loaded"):  # a pool left out is sized to hold it
        LLM("tiny", device="cuda", compile=False, progress=False, max_model_len=100000)


def test_a_given_context_is_refused_where_the_sizing_from_memory_was_skipped(no_load, monkeypatch):
    """CUDA memory that cannot be read leaves EngineConfig's host pool (16384 rows): a given
    context past it was capped there without a word (the warning after the load is gone)."""
    import echo_compile.startup
    from echo_compile.llm import LLM
    from runtime.distributed import plan

    def no_driver(device):
        raise RuntimeError("no driver")

    monkeypatch.setattr(echo_compile.startup, "check_device", lambda *a, **k: None)
    monkeypatch.setattr(echo_compile.startup, "check_fits", lambda *a, **k: None)
    monkeypatch.setattr(plan, "gpu_total_bytes", no_driver)
    with pytest.raises(ValueError) as e:
        LLM("tiny", device="cuda", compile=False, progress=False, max_model_len=100000)
    for part in ("--max-model-len 100000", "the default --host-tokens 16384",
                 "sizing from memory was skipped", "give --host-tokens 100032"):  # fmt: skip
        assert part in str(e.value), (part, str(e.value))
    with pytest.raises(AssertionError, match="loaded"):  # what fits the default pool starts
        LLM("tiny", device="cuda", compile=False, progress=False, max_model_len=16384)


def test_a_given_gpu_pool_past_the_host_pool_is_refused(no_load, monkeypatch):
    """The GPU pool caches host rows: past ``host_tokens`` its rows are never used."""
    from echo_compile.llm import LLM

    with pytest.raises(ValueError) as e:
        LLM("tiny", device="cpu", compile=False, progress=False, host_tokens=1024, gpu_tokens=4096)
    for part in ("--gpu-tokens 4096", "--host-tokens 1024", "at most 1024", "--no-offload"):
        assert part in str(e.value), (part, str(e.value))
    for fine in (dict(host_tokens=1024, gpu_tokens=1024),
                 dict(host_tokens=1024, gpu_tokens=4096, offload=False)):  # fmt: skip
        with pytest.raises(AssertionError, match="loaded"):
            LLM("tiny", device="cpu", compile=False, progress=False, **fine)


@pytest.mark.parametrize("entry", ["LLM", "generate", "serve", "plan"])
def test_a_given_gpu_pool_without_offloading_is_warned_about_naming_the_flag(
    entry, no_load, monkeypatch, caplog
):
    """GPU-only has no GPU pool (the whole KV cache is on the GPU, ``host_tokens`` rows): a
    given ``gpu_tokens`` sizes nothing, said by every entry point that takes it (it was ignored
    without a word); left out, or with offloading, nothing is said."""
    from echo_compile.cli import main
    from echo_compile.llm import LLM

    def start(*flags: str) -> None:
        if entry == "LLM":
            opts = {"offload": "--no-offload" not in flags}
            if "--gpu-tokens" in flags:
                opts["gpu_tokens"] = int(flags[flags.index("--gpu-tokens") + 1])
            with pytest.raises(AssertionError, match="loaded"):
                LLM("tiny", device="cpu", compile=False, progress=False, **opts)
        elif entry == "plan":  # (sizes given: plan needs no memory)
            sizes = ["--host-tokens", "65536", "--max-model-len", "65536", "--max-batch", "4"]
            if "--no-offload" not in flags:
                sizes += [] if "--gpu-tokens" in flags else ["--gpu-tokens", "4096"]
            assert main(["plan", "--model", "tiny", *sizes, *flags]) == 0
        else:
            monkeypatch.setattr("runtime.server_lifecycle.bind_socket", lambda *a: None)
            prompt = ["x"] if entry == "generate" else []
            with pytest.raises(AssertionError, match="loaded"):
                main([entry, "--model", "tiny", "--device", "cpu", *flags, *prompt])

    caplog.set_level(logging.WARNING, logger="runtime.kv_sizing")
    start("--no-offload", "--gpu-tokens", "512")
    assert "--gpu-tokens 512 has no effect" in caplog.text, caplog.text
    assert "without offloading (--no-offload) the whole KV cache is on the GPU" in caplog.text
    assert "sized by --host-tokens" in caplog.text
    caplog.clear()
    start("--no-offload")
    start("--gpu-tokens", "512")
    assert "has no effect" not in caplog.text, caplog.text


def test_a_gpu_pool_that_caps_the_decode_batch_is_warned_about_at_start_up(no_load, caplog):
    """gpu_tokens < max_batch x index_topk: a step decodes gpu_tokens // topk requests, not
    max_batch (allowed: said once at start-up, naming the flags that decode them all)."""
    from echo_compile.llm import LLM

    caplog.set_level(logging.WARNING, logger="runtime.kv_sizing")
    with pytest.raises(AssertionError, match="loaded"):
        LLM("tiny", device="cpu", compile=False, progress=False, max_batch=8, gpu_tokens=64)
    for part in ("--max-batch 8: a decode step holds at most 2 requests", "--gpu-tokens 64",
                 "--gpu-tokens 256 decodes", "--max-batch 2"):  # fmt: skip
        assert part in caplog.text, (part, caplog.text)
    caplog.clear()
    full_batch = (dict(gpu_tokens=256), dict(gpu_tokens=64, offload=False))  # max_batch 8
    for full in full_batch:
        with pytest.raises(AssertionError, match="loaded"):
            LLM("tiny", device="cpu", compile=False, progress=False, **full)
    assert "decode step holds" not in caplog.text
    # a pool below one request's selections is refused by name, not first warned about as a
    # batch of 0 ("--max-batch 0")
    with pytest.raises(ValueError, match="gpu_tokens"):
        LLM("tiny", device="cpu", compile=False, progress=False, max_batch=8, gpu_tokens=16)
    assert "decode step holds" not in caplog.text


def test_a_given_context_past_a_gpu_only_pool_names_that_pool(no_load):
    """GPU-only (``offload=False``): the pool ``host_tokens`` sizes lives on the device, and the
    refusal says so rather than naming a host pool."""
    from echo_compile.llm import LLM

    with pytest.raises(ValueError) as e:
        LLM("tiny", device="cpu", compile=False, progress=False, offload=False,
            host_tokens=16384, max_model_len=100000)  # fmt: skip
    assert "more than the KV pool (GPU-only: on the device) holds" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="more than the host KV pool holds"):
        LLM("tiny", device="cpu", compile=False, progress=False, host_tokens=16384,
            max_model_len=100000)  # fmt: skip


def test_a_host_pool_for_fewer_than_max_batch_requests_says_how_many_it_holds(tiny):
    """max_batch 64 of 100000 tokens in 1 GiB of host: the pool holds one of them at a time,
    which the line says (it named only "max_batch 64 x 100000, at most ...")."""
    config = EngineConfig(device="cuda", max_model_len=100000, max_batch=64)
    one_gib = Memory(host_bytes=GIB, gpu_total_bytes=80 * GIB)
    s = auto_sizes(tiny, config, {"max_model_len", "max_batch"}, one_gib, weight_bytes=0)
    assert s.host_tokens // 100032 == 1
    assert "max_batch 64 x 100000, at most 0.8 x 1 GiB host; holds 1 of them at once)" in s.why
    s = auto_sizes(tiny, config, {"max_model_len", "max_batch"}, BIG, weight_bytes=0)
    assert s.host_tokens == 64 * 100032 and "holds" not in s.why


@pytest.mark.parametrize(
    "flags",
    [[], ["--gpu-tokens", "2048"], ["--max-model-len", "8192", "--kv-format", "fp8",
     "--no-prefill-buffer"], ["--no-offload", "--max-batch", "2"]],
    ids=["left_out", "gpu_given", "context_given", "gpu_only"],
)  # fmt: skip
@pytest.mark.parametrize("host_gib, gpu_gib", [(1024.0, 80.0), (0.5, 80.0), (1024.0, 9.0)])
def test_plan_chooses_the_sizes_serve_chooses_at_start_up(monkeypatch, capsys, flags, host_gib,
                                                          gpu_gib):  # fmt: skip
    """``echo-compile plan`` with the sizes left out shows what a CUDA rank's start-up
    (``size_engine`` over serve's flags) chooses for the same memory: the host's and the GPU's
    (faked here for the start-up, given to plan), the same weights and reserve."""
    import re

    from echo_compile.cli import main
    from runtime.distributed import plan
    from runtime.kv_sizing import SIZED

    monkeypatch.setattr(plan, "device_memory_gib", lambda device: (gpu_gib, host_gib))
    monkeypatch.setattr(plan, "gpu_total_bytes", lambda device: int(gpu_gib * GIB))
    both = ["--model", "tiny", "--max-batch", "4", "--kv-format", "bf16", *flags]
    options = engine_args.engine_options(cli_args.parser().parse_args(["serve", *both]))
    config = EngineConfig(**{**options, "device": "cuda"})
    started = size_engine(resolve_model("tiny"), config, set(SIZED) & set(options),
                          memory_device=("cuda:0", 1))  # fmt: skip
    rc = main(["plan", "--gpus", "1", "--host-mem-gib", str(host_gib), "--gpu-mem-gib",
               str(gpu_gib), *both])  # fmt: skip
    out = capsys.readouterr().out
    # (a GPU too small for anything: serve's least sizes, which plan, as serve's check, refuses)
    assert rc == (2 if gpu_gib < 10 and "--no-offload" in flags else 0), out
    planned = {k: int(re.search(f"--{k.replace('_', '-')} (\\d+)", out)[1])
               for k in SIZED if k != "gpu_tokens" or started.offload}  # fmt: skip
    assert planned == {k: getattr(started, k) for k in planned}, out
    assert "chosen as serve chooses them: " in out
