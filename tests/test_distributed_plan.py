"""The memory plan (runtime/distributed/plan.py, ``echo-compile plan``) and the 8-GPU estimate
script: the plan's byte counts are those of the real allocations at small sizes, the V3.2 AWQ
plan on 8 H200 fits, the FP8 one is refused with its reason."""

from __future__ import annotations

import json

import pytest
import torch

from custom_ops.cache.config import CacheConfig
from custom_ops.cache.kv_cache import KVCache
from echo_compile.cli import main as cli_main
from model.parallel import TPGroup
from model.presets import preset_config
from model.shard_loader import load_sharded_model
from runtime.distributed.plan import cache_bytes, memory_plan, plan_engine, v32_config, weight_bytes

# the 8 x H200 deployment's sizes given (docs/multi_gpu.md, $SIZES): left out, plan chooses them
# as serve does, from --host-mem-gib
SIZES = ["--gpu-tokens", "200000", "--host-tokens", "2097152", "--max-model-len", "163840"]


def nbytes(module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


@pytest.mark.parametrize(
    "offload, prefetch", [(True, "off"), (True, "request"), (True, "global"), (False, "off")]
)
def test_cache_bytes_are_the_allocations(offload, prefetch):
    cfg = CacheConfig(num_layers=2, host_tokens=64 * 8, gpu_tokens=96, topk=32, fmt="fp8",
                      offload=offload, max_batch=2, prefill_tokens=128, prefetch=prefetch,
                      prefetch_cap=48)  # fmt: skip
    cache = KVCache(cfg, "cpu")
    got = cache_bytes(cfg)
    staging = [layer.staging for layer in cache.layers if layer.staging is not None]
    assert len(staging) == (cfg.num_layers if prefetch != "off" else 0)
    assert got["prefetch staging"] == sum(nbytes(s) for s in staging)  # exact
    host = sum(layer.host_kv.numel() for layer in cache.layers)
    device = nbytes(cache) - host
    device_kv = host  # GPU-only: the "host" rows are the device-resident KV
    if not offload:
        host, device = 0, device + host
    assert got["host kv pool"] == host
    # every device buffer, the pools' maps and counters too, exactly (they were a 4 KB-a-layer
    # estimate); by item: the pools' rows, the indexer cache, the prefill buffer
    assert device == sum(v for k, v in got.items() if k != "host kv pool")
    pools = [layer.pool for layer in cache.layers if layer.pool is not None]
    rows = sum(p.gpu_kv.nbytes for p in pools) if offload else device_kv
    assert got["gpu kv pools"] == rows
    assert got["indexer cache"] == sum(layer.index_k.nbytes for layer in cache.layers)
    assert got["prefill buffer"] == sum(layer.prefill_kv.nbytes for layer in cache.layers)


def test_weight_bytes_are_the_loaded_shard():
    shard, _ = load_sharded_model("tiny", TPGroup(1, 2, "", gather=True))
    real = sum(t.numel() * t.element_size() for t in [*shard.parameters(), *shard.buffers()])
    assert weight_bytes(preset_config("tiny"), tp=2, rank=1) == real


def test_fp8_weight_bytes_are_the_loaded_fp8_shard(tmp_path):
    from model.checkpoint import make_checkpoint
    from model.config import ModelConfig
    from model.presets import tiny_config_dict

    cfg = ModelConfig.from_dict(dict(tiny_config_dict(), moe_intermediate_size=256))
    path = make_checkpoint(tmp_path / "fp8", cfg, fp8=True)
    shard, extras = load_sharded_model(path, TPGroup(1, 2, "", gather=True), fp8_weights="fp8")
    real = sum(t.numel() * t.element_size() for t in [*shard.parameters(), *shard.buffers()])
    assert weight_bytes(extras.config, tp=2, rank=1, fp8_weights="fp8") == real
    dequantised = weight_bytes(extras.config, tp=2, rank=1, fp8_weights="bf16")
    assert real < dequantised  # FP8 kept: fewer bytes
    assert weight_bytes(extras.config, tp=2, rank=1) == real  # the default keeps FP8


def test_awq_weight_bytes_are_the_repacked_gpu_shard(tmp_path):
    """On a GPU the loader repacks AWQ for the fast kernels (packed zero points and scales of 4
    bytes a group and column, a tinygemm copy of the small linears): the plan counts that layout
    (it counted AutoAWQ's, 1.57 GiB a rank short for V3.2 on 8 GPUs); the CPU keeps AutoAWQ's."""
    from model.awq_convert import repack_awq_model
    from model.checkpoint import make_checkpoint
    from model.config import ModelConfig
    from model.loader import load_model
    from model.presets import tiny_config_dict

    def nbytes_of(m):
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

    whole, extras = load_model("tiny-awq", keep_mtp=False)
    assert weight_bytes(extras.config, 1, cuda=False) == nbytes_of(whole)
    repack_awq_model(whole, cuda=True)  # finish_loaded_model's repack, with CUDA's choices
    assert weight_bytes(extras.config, 1) == nbytes_of(whole)
    cfg = ModelConfig.from_dict(dict(tiny_config_dict(), moe_intermediate_size=256))
    path = make_checkpoint(tmp_path / "awq", cfg, awq=True)
    for ep in (False, True):
        shard, extras = load_sharded_model(path, TPGroup(1, 2, "", gather=True), ep=ep)
        repack_awq_model(shard, cuda=True)
        assert weight_bytes(extras.config, 2, rank=1, ep=ep) == nbytes_of(shard)
    # V3.2 AWQ on 8 GPUs: 55.10 GiB as AutoAWQ, 56.67 GiB as served (either split)
    v32 = v32_config("awq")
    assert round(weight_bytes(v32, 8, cuda=False) / 2**30, 2) == 55.10
    assert round(weight_bytes(v32, 8) / 2**30, 2) == round(weight_bytes(v32, 8, ep=True) / 2**30, 2)
    assert round(weight_bytes(v32, 8) / 2**30, 2) == 56.67


def test_v32_plans_on_8_h200():
    eng = plan_engine(8, 8, gpu_tokens=200_000, host_tokens=1 << 21, max_batch=64)
    awq = memory_plan(v32_config("awq"), eng, gpu_mem_gib=139.8, host_mem_gib=2000)
    assert not awq.problems() and 40 < awq.gpu_gib["weights"] < 70, awq.table()
    # the FP8 release with the defaults: kept FP8, as vLLM serves it, it fits on 8 x H200
    kept = memory_plan(v32_config("fp8"), eng, gpu_mem_gib=139.8)
    assert not kept.problems() and kept.quant == "fp8 (kept fp8)", kept.table()
    assert memory_plan(v32_config("fp8"), eng, 139.8, fp8_weights="fp8") == kept
    # dequantised (the explicit opt-in) it does not
    fp8 = memory_plan(v32_config("fp8"), eng, gpu_mem_gib=139.8, fp8_weights="bf16")
    with pytest.raises(ValueError, match="dequantised to bf16 at load by --fp8-weights bf16"):
        fp8.check()
    # the routed experts are split 8 ways: one rank holds far less than the whole model
    assert fp8.gpu_gib["weights"] < 1300 / 8 * 1.5
    assert kept.gpu_gib["weights"] < 0.6 * fp8.gpu_gib["weights"]
    # without the prefill buffer (163840 fp8 rows a layer) its 6 GiB go elsewhere
    lean = plan_engine(8, 8, 200_000, 1 << 21, 64, prefill_buffer=False)
    lean_awq = memory_plan(v32_config("awq"), lean, gpu_mem_gib=139.8)
    assert lean_awq.gpu_gib["prefill buffer"] == 0 and 5.5 < awq.gpu_gib["prefill buffer"] < 6.5
    small_host = memory_plan(v32_config("awq"), eng, gpu_mem_gib=139.8, host_mem_gib=100)
    with pytest.raises(ValueError, match="host KV pools need"):
        small_host.check()


def test_plan_command(capsys):
    assert cli_main(["plan", "--quant", "awq", *SIZES]) == 0
    out = capsys.readouterr().out
    assert "fits" in out
    # the sizes the numbers are of, as serve's flags: plan's defaults are not serve's
    sizes = "--max-batch 64 --max-model-len 163840 --kv-format fp8 --gpu-tokens 200000"
    assert f"  for {sizes} --host-tokens 2097152\n" in out, out
    assert cli_main(["plan", "--no-offload", "--host-tokens", "65536", "--max-batch", "4",
                     "--max-model-len", "65536"]) == 0  # fmt: skip
    assert "for --max-batch 4 " in (out := capsys.readouterr().out), out
    assert "--no-offload --host-tokens 65536\n" in out and "--gpu-tokens" not in out, out
    assert cli_main(["plan", "--quant", "awq", "--no-prefill-buffer", *SIZES]) == 0
    out = capsys.readouterr().out
    assert "prefill buffer        0.00 GiB" in out and "prefetch staging      0.00 GiB" in out
    # the staging buffers of prefetch, as serve's flags size them
    flags = ["--prefetch", "request", "--prefetch-cap", "256"]
    eng = plan_engine(8, 8, 200_000, 1 << 21, 64, prefetch="request", prefetch_cap=256)
    staged = memory_plan(v32_config("awq"), eng, 139.8).gpu_gib["prefetch staging"]
    assert staged > 1.0  # 61 layers x (16384 fp8 rows + the maps of 2^21 host rows)
    assert cli_main(["plan", "--quant", "awq", *flags, *SIZES]) == 0
    assert f"prefetch staging {staged:9.2f} GiB" in capsys.readouterr().out
    flags = ["--prefetch", "request", "--no-offload"]
    assert cli_main(["plan", "--quant", "awq", *flags, *SIZES]) == 2
    assert "needs offloading" in capsys.readouterr().err
    assert cli_main(["plan", "--quant", "fp8", *SIZES]) == 0  # the FP8 release kept FP8 by default
    out = capsys.readouterr().out
    assert "fp8 (kept fp8) weights" in out and "  fits" in out
    assert cli_main(["plan", "--quant", "fp8", "--fp8-weights", "bf16", *SIZES]) == 2
    assert "the plan does not fit" in capsys.readouterr().err
    # --dp 0 / --tp 0 are refused as --gpus 0 is, not replaced by --gpus
    for flag in ("--dp", "--tp"):
        assert cli_main(["plan", flag, "0"]) == 2
        assert "must be a positive integer, got 0" in capsys.readouterr().err
    assert cli_main(["plan", "--model", "tiny", "--quant", "fp8", "--gpus", "1"]) == 2
    assert "--model plans the checkpoint's own" in capsys.readouterr().err
    # the host pools of one node's ranks against one host's memory (16 GPUs: 2 nodes of 8)
    assert cli_main(["plan", "--gpus", "16", "--host-mem-gib", "1000", *SIZES]) == 0
    assert "625.2 GiB per node (8 ranks; 2 nodes)" in capsys.readouterr().out
    # too big for one H200, the table printed first
    assert cli_main(["plan", "--gpus", "1", *SIZES]) == 2
    assert "GiB per node (1 rank; 1 node)" in capsys.readouterr().out
    one_host = ["--gpus-per-node", "16", "--host-mem-gib", "1000"]
    assert cli_main(["plan", "--gpus", "16", *one_host, *SIZES]) == 2
    assert "need 1250.5 GiB a node (16 ranks x 78.2)" in capsys.readouterr().err
    for flags, message in (  # NaN compared false everywhere: "total nan GiB ... fits"
        (["--gpu-mem-gib", "nan"], "--gpu-mem-gib must be a finite number > 0"),
        (["--reserve-gib", "nan"], "--reserve-gib must be a finite number >= 0, got nan"),
        (["--host-mem-gib", "-1"], "--host-mem-gib must be a finite number > 0, got -1.0"),
    ):
        assert cli_main(["plan", *flags, *SIZES]) == 2
        assert message in capsys.readouterr().err
    # a split the loader refuses is refused here too: 18432 / 32 = 4.5 FP8 blocks of 128
    assert cli_main(["plan", "--quant", "fp8", "--fp8-weights", "fp8", "--gpus", "32"]) == 2
    err = capsys.readouterr().err
    assert "intermediate_size=18432 cannot be split in whole blocks of 128 over 32" in err


def test_plan_names_the_rank_counts_that_split_the_model(capsys):
    """A feed-forward rank count the model cannot split is refused with the counts that split
    every feed-forward dimension (V3.2 AWQ: 2048 expert features in blocks of 128 -> 16 blocks),
    not only the one that failed (fp8's dense 18432 = 144 blocks would allow 3 or 24)."""
    from model.parallel import ffn_rank_counts

    for argv in (["--gpus", "3"], ["--gpus", "3", "--ep"], ["--quant", "fp8", "--gpus", "24"]):
        assert cli_main(["plan", *argv]) == 2
        err = capsys.readouterr().err
        assert "cannot be split" in err and "the counts that work: 1, 2, 4, 8, 16\n" in err, err
    assert ffn_rank_counts(v32_config("bf16")) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024,
                                                   2048]  # fmt: skip
    # by expert: 256 experts, but the shared expert's 2048 features are still split
    assert ffn_rank_counts(v32_config("bf16"), ep=True) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert ffn_rank_counts(preset_config("tiny")) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_estimate_script(tmp_path):
    from benchmarks.estimate_multi_gpu import main

    out = tmp_path / "est.json"
    assert main(["--out", str(out), "--contexts", "32768"]) == 0
    res = json.loads(out.read_text())
    assert res["kind"].startswith("ESTIMATE")
    one, eight = res["rows"]["1"], res["rows"]["8"]
    for a, b in zip(one, eight):  # 8 ranks each serve B requests: more tokens per second
        assert b["offload"]["tokens_per_s"] > a["offload"]["tokens_per_s"]
        assert b["offload"]["comm_ms"] > 0 == a["offload"]["comm_ms"]
    eb = res["effective_batch"][0]
    assert eb["offload"] > eb["gpu_only"] > 0


def test_check_fits_refuses_only_what_cannot_fit():
    """Weights + KV cache over the GPU's memory, or the host pool over the host's RAM: refused
    with what needs how much; enough of both: nothing (no reserve counted)."""
    from model.checkpoint_meta import read_checkpoint_meta
    from runtime.distributed.plan import check_fits
    from runtime.engine_config import EngineConfig

    _, config, _ = read_checkpoint_meta("tiny")
    eng = EngineConfig(device="cuda", host_tokens=1 << 16)
    plan = memory_plan(config, eng, 100.0, None, 0.0)
    need = sum(plan.gpu_gib.values())
    check_fits(config, eng, need * 1.01, plan.host_gib_per_rank * 1.01)  # fits
    # the staging buffers of prefetch are counted: what fits without them need not with them
    staged = EngineConfig(device="cuda", host_tokens=1 << 16, prefetch="request", prefetch_cap=4096)
    with pytest.raises(ValueError, match=r"does not fit cuda: .* a GPU needs"):
        check_fits(config, staged, need * 1.01, plan.host_gib_per_rank * 1.01)
    with pytest.raises(ValueError, match=r"does not fit cuda: .* a GPU needs .*GiB weights"):
        check_fits(config, eng, need * 0.99, 100.0)
    # the refusal names the flag that sizes the KV cache on the GPU, and says the memory is free
    with pytest.raises(ValueError, match=r"GiB GPU KV pools: --gpu-tokens 1024 rows a layer\) "
                       r"but has .* GiB free"):  # fmt: skip
        check_fits(config, eng, need * 0.99, 100.0)
    gpu_only = EngineConfig(device="cuda", host_tokens=1 << 16, offload=False)
    with pytest.raises(ValueError, match=r"KV cache: --host-tokens 65536 rows a layer, no offl"):
        check_fits(config, gpu_only, need * 0.99, 100.0)
    with pytest.raises(ValueError, match=r"the host KV pools need .*, --host-tokens 65536 rows"):
        check_fits(config, eng, 100.0, plan.host_gib_per_rank * 0.99)
    # four ranks of a dp=4 deployment on this host, one pool each: four pools must fit its memory
    dp4 = EngineConfig(device="cuda", host_tokens=1 << 16, dp=4)
    check_fits(config, dp4, 100.0, plan.host_gib_per_rank * 4.01, local_ranks=4)
    with pytest.raises(ValueError, match=r"\(4 ranks x "):
        check_fits(config, dp4, 100.0, plan.host_gib_per_rank * 3.99, local_ranks=4)
    check_fits(config, dp4, 100.0, plan.host_gib_per_rank * 2.01, local_ranks=2)  # 2 per host
    # tp alone: every rank holds the batch's KV in a host pool of its own
    tp2 = memory_plan(config, EngineConfig(tp=2, host_tokens=1 << 16), 100.0, None, 0.0)
    assert tp2.host_total_gib == pytest.approx(2 * tp2.host_gib_per_rank)
    # V3.2's FP8 checkpoint on 8 x H200: dequantised it cannot fit, kept FP8 it can
    v32, eng8 = v32_config("fp8"), plan_engine(8, 8, 200_000, 1 << 21, 64)
    with pytest.raises(ValueError, match=r"179.7 GiB weights.*by --fp8-weights bf16: leave it"):
        check_fits(v32, eng8, 139.8, 1000.0, fp8_weights="bf16")
    check_fits(v32, eng8, 139.8, 1000.0)  # the default keeps it FP8
    check_fits(v32, eng8, 139.8, 1000.0, fp8_weights="fp8")


def test_device_memory_is_the_gpu_s_free_memory(monkeypatch):
    """The check runs against what is free on the GPU now (other processes, other engines of
    this one hold the rest), not its size; asked of the rank's own device."""
    from custom_ops.cache import host_pool
    from runtime.distributed import plan

    asked = []

    def mem_get_info(device=None):
        asked.append(torch.device(device))
        return 3 * 2**30, 80 * 2**30  # (free, total)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(host_pool, "_host_memory_limit", lambda: 2**31)
    assert plan.device_memory_gib("cuda:1") == (3.0, 2.0)
    assert asked == [torch.device("cuda:1")]


def test_llm_on_cuda_checks_the_plan_before_loading(monkeypatch):
    """LLM(device="cuda") runs the check before any weight loads: a GPU too small is one
    ValueError and the loader is never called; a check that cannot run steps aside."""
    import echo_compile.startup
    import model.loader
    from echo_compile.llm import LLM
    from runtime.distributed import plan

    def no_load(*a, **k):
        raise AssertionError("loaded")

    monkeypatch.setattr(model.loader, "load_model", no_load)
    monkeypatch.setattr(echo_compile.startup, "check_device", lambda *a, **k: None)  # a GPU, faked
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: (1e-4, 1000.0))
    with pytest.raises(ValueError, match=r"does not fit cuda: bf16 on dp=1 tp=1: a GPU needs"):
        LLM("tiny", device="cuda", compile=False, progress=False)

    def broken(device):
        raise RuntimeError("no driver")

    monkeypatch.setattr(plan, "device_memory_gib", broken)
    with pytest.raises(AssertionError, match="loaded"):  # the check stepped aside
        LLM("tiny", device="cuda", compile=False, progress=False)

    def planner_bug(*a, **k):  # a ValueError that is not a refusal: the load still runs
        raise ValueError("planner bug")

    monkeypatch.setattr(plan, "device_memory_gib", lambda device: (1e-4, 1000.0))
    monkeypatch.setattr(plan, "memory_plan", planner_bug)
    with pytest.raises(AssertionError, match="loaded"):
        LLM("tiny", device="cuda", compile=False, progress=False)


def test_llm_under_torchrun_checks_its_own_gpu_and_the_host_s_ranks(monkeypatch):
    """A rank of a dp/tp job checks the GPU of its LOCAL_RANK and its host's memory against
    the pools of LOCAL_WORLD_SIZE ranks (before any process group or weight)."""
    import echo_compile.startup
    from echo_compile.llm import LLM
    from runtime.distributed import plan

    seen = []

    def memory(device):
        seen.append(device)
        return 100.0, 1e-4  # a host too small for two pools

    monkeypatch.setattr(plan, "device_memory_gib", memory)
    monkeypatch.setattr(echo_compile.startup, "check_device", lambda *a, **k: None)  # a GPU, faked
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(plan.DoesNotFit, match=r"the host KV pools need .* \(2 ranks x "):
        LLM("tiny", device="cuda", dp=2, tp=2, compile=False, progress=False)
    assert seen and set(seen) == {"cuda:1"}  # (the sizing of the pools reads it too)


def test_llm_under_torchrun_names_a_local_world_size_that_is_not_an_integer(monkeypatch):
    """A LOCAL_WORLD_SIZE torchrun could not have set stops the start-up with the variable and
    its value (it was int()'s bare "invalid literal"), as a bad RANK / LOCAL_RANK does."""
    import echo_compile.startup
    from echo_compile.llm import LLM
    from runtime.distributed import plan
    from runtime.engine_config import EngineConfig

    monkeypatch.setattr(plan, "device_memory_gib", lambda device: (100.0, 100.0))
    monkeypatch.setattr(echo_compile.startup, "check_device", lambda *a, **k: None)  # a GPU, faked
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"^environment variable LOCAL_WORLD_SIZE='two' is not"):
        LLM("tiny", device="cuda", dp=2, compile=False, progress=False)
    for bad in ("0", "-2"):  # the sizing divides by it: ZeroDivisionError, a negative share
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=rf"LOCAL_WORLD_SIZE={bad} must be at least 1"):
            plan.rank_memory_device(EngineConfig(device="cuda", dp=2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1.0")
    with pytest.raises(ValueError, match=r"LOCAL_RANK='1.0' is not an integer"):
        plan.rank_memory_device(EngineConfig(device="cuda", dp=2))


@pytest.mark.parametrize("bad", ["two", "0"])
def test_the_sizing_and_the_memory_check_alone_name_a_bad_local_world_size(monkeypatch, bad):
    """``size_engine`` and ``check_fits`` called without the rank's memory device (LLM passes the
    one it found) find it themselves, and a LOCAL_WORLD_SIZE that is not a number of ranks is
    the same named error as LLM's (inside their step-aside, it was a warning and the defaults,
    or no check)."""
    from echo_compile.memory_checks import check_fits
    from runtime import kv_sizing
    from runtime.distributed import plan
    from runtime.engine_config import EngineConfig

    monkeypatch.setattr(plan, "device_memory_gib", lambda device: (100.0, 100.0))
    monkeypatch.setattr(plan, "gpu_total_bytes", lambda device: 100 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
    config = EngineConfig(device="cuda", dp=2)
    named = r"LOCAL_WORLD_SIZE='two' is not an integer" if bad == "two" else "must be at least 1"
    with pytest.raises(ValueError, match=named):
        kv_sizing.size_engine("tiny", config, set())
    with pytest.raises(ValueError, match=named):
        check_fits("tiny", config, "auto")


def test_rank_memory_device_is_the_gpu_the_join_takes_without_local_rank(monkeypatch):
    """A launch that sets RANK but no LOCAL_RANK (one process per GPU by hand): the join takes
    ``cuda:<RANK>`` (``process.init_distributed``), so the memory checked is that GPU's, not
    cuda:0's for every rank."""
    from runtime.distributed import plan
    from runtime.engine_config import EngineConfig

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert plan.rank_memory_device(EngineConfig(device="cuda", dp=2)) == ("cuda:1", 2)
    monkeypatch.setenv("LOCAL_RANK", "0")  # (set, it wins, as in the join)
    assert plan.rank_memory_device(EngineConfig(device="cuda", dp=2)) == ("cuda:0", 2)


def test_llm_on_cpu_refuses_a_host_pool_past_memory_before_loading(monkeypatch):
    """The CPU engine's KV pool lives in host memory: a pool the machine cannot hold is refused
    with its bytes and the flag before any weight is read (it was refused after the load)."""
    import model.loader
    from custom_ops.cache import host_pool
    from echo_compile.llm import LLM

    def no_load(*a, **k):
        raise AssertionError("loaded")

    monkeypatch.setattr(model.loader, "load_model", no_load)
    monkeypatch.setattr(host_pool, "_host_memory_limit", lambda: 2**30)
    # 4 layers x 2^20 rows x 1152 B = 4.5 GiB
    with pytest.raises(
        ValueError,
        match=r"host KV pool: 4 layers x 1048576 tokens x 1152 B = "
        r"4831838208 bytes .* has only 1073741824 bytes .*--host-tokens",
    ):
        LLM("tiny", device="cpu", host_tokens=1 << 20, compile=False, progress=False)
    with pytest.raises(AssertionError, match="loaded"):  # a pool that fits: the load runs
        LLM("tiny", device="cpu", host_tokens=1 << 14, compile=False, progress=False)


def test_estimate_counts_fp8_as_served(tmp_path, capsys):
    """An FP8 checkpoint is estimated as LLM serves it by default, kept FP8 (one byte a weight and
    an fp32 scale per 128x128 block, in the feed-forward reads and in the memory plan), and
    dequantised only when ``--fp8-weights bf16`` asks for it."""
    from benchmarks.estimate_multi_gpu import expert_bytes, main

    assert expert_bytes("fp8") == 1 + 4 / 128**2 and expert_bytes("fp8", "bf16") == 2.0
    res = {}
    for how in ("auto", "bf16"):
        out = tmp_path / f"{how}.json"
        argv = ["--quant", "fp8", "--fp8-weights", how, "--contexts", "32768", "--out", str(out)]
        assert main(argv) == 0
        res[how] = json.loads(out.read_text())
    for kept, deq in zip(res["auto"]["rows"]["8"], res["bf16"]["rows"]["8"]):
        assert kept["offload"]["ffn_ms"] == pytest.approx(
            deq["offload"]["ffn_ms"] * (1 + 4 / 128**2) / 2
        )
    kept, deq = res["auto"]["effective_batch"][0], res["bf16"]["effective_batch"][0]
    # the plan's weights: 92.69 GiB kept FP8, 179.68 dequantised (docs/multi_gpu.md)
    assert kept["gpu_free_for_kv_gib"] - deq["gpu_free_for_kv_gib"] == pytest.approx(
        179.68 - 92.69, abs=0.01
    )
    assert kept["gpu_only"] > 0 == deq["gpu_only"]
    assert main(["--quant", "awq", "--fp8-weights", "fp8"]) == 2
    assert "needs an FP8 checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("dp", [1, 2])
def test_llm_counts_the_weights_once(monkeypatch, dp):
    """LLM on a (pretended) GPU counts its rank's weight bytes once (a meta-device build of the
    whole model: seconds for V3.2), and the KV sizing and the memory check both take that count
    (they counted one each)."""
    import echo_compile.startup
    import model.loader
    from echo_compile.llm import LLM
    from runtime import kv_sizing
    from runtime.distributed import dist_engine, plan

    class Loaded(Exception):
        pass

    def no_load(*a, **k):
        raise Loaded

    counted, taken = [], []
    real_count, real_sizes, real_plan = plan.weight_bytes, kv_sizing.auto_sizes, plan.memory_plan

    def count(*a, **k):
        counted.append(real_count(*a, **k))
        return counted[-1]

    def sizes(mc, config, given, memory, weight_bytes, *a, **k):
        taken.append(weight_bytes)
        return real_sizes(mc, config, given, memory, weight_bytes, *a, **k)

    def memory_plan(*a, **k):
        p = real_plan(*a, **k)
        taken.append(round(p.gpu_gib["weights"] * plan.GIB))
        return p

    monkeypatch.setattr(model.loader, "load_model", no_load)
    monkeypatch.setattr(dist_engine, "build_distributed_engine", no_load)
    monkeypatch.setattr(echo_compile.startup, "check_device", lambda *a, **k: None)  # a GPU, faked
    monkeypatch.setattr(plan, "device_memory_gib", lambda device: (139.8, 1000.0))
    monkeypatch.setattr(plan, "gpu_total_bytes", lambda device: int(139.8 * plan.GIB))
    monkeypatch.setattr(plan, "weight_bytes", count)
    monkeypatch.setattr(kv_sizing, "auto_sizes", sizes)
    monkeypatch.setattr(plan, "memory_plan", memory_plan)
    with pytest.raises(Loaded):
        LLM("tiny", device="cuda", dp=dp, compile=False, progress=False)
    assert len(counted) == 1, counted
    assert taken == counted * 2  # the sizing's, the check's


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-batch", "4", "--host-tokens", "8192", "--gpu-tokens", "512",
         "--max-model-len", "2048", "--kv-format", "fp8"],
        ["--max-batch", "2", "--host-tokens", "4096", "--gpu-tokens", "256",
         "--max-model-len", "4096", "--prefetch", "request", "--prefetch-cap", "128",
         "--kv-format", "bf16"],  # (plan's default is fp8, serve's bf16: given here)
        ["--max-batch", "4", "--host-tokens", "4096", "--max-model-len", "1024", "--no-offload",
         "--no-prefill-buffer", "--kv-format", "bf16"],
    ],
    ids=["fp8", "prefetch", "gpu_only"],
)  # fmt: skip
def test_plan_counts_what_serve_allocates_for_the_same_flags(monkeypatch, capsys, flags):
    """``echo-compile plan --model DIR`` with serve's sizing flags plans the KV cache that
    ``serve`` (``LLM`` with ``engine_options``) allocates for them, byte for byte."""
    from echo_compile.cli_args import parser
    from echo_compile.engine_args import engine_options
    from echo_compile.llm import LLM
    from runtime.distributed import plan as plan_module

    planned = {}
    real_plan = plan_module.memory_plan

    def spy(config, engine, *a, **k):
        planned.update(cache_bytes(engine.cache_config(config)))
        return real_plan(config, engine, *a, **k)

    monkeypatch.setattr(plan_module, "memory_plan", spy)
    assert cli_main(["plan", "--model", "tiny", "--gpus", "1", *flags]) == 0, capsys.readouterr()
    options = engine_options(parser().parse_args(["serve", "--device", "cpu", *flags]))
    llm = LLM("tiny", compile=False, progress=False, **options)
    cache = llm.engine.cache
    assert cache_bytes(cache.config) == planned
    host = sum(layer.host_kv.numel() for layer in cache.layers)  # (uint8 rows)
    if not cache.config.offload:  # GPU-only: the "host" rows are the device's KV cache
        host = 0
    assert planned["host kv pool"] == host
    assert sum(v for k, v in planned.items() if k != "host kv pool") == nbytes(cache) - host


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-model-len", "200000"], "more than the model's max_position_embeddings 163840"),
        (["--host-tokens", "65536", "--max-model-len", "163840"],
         "--max-model-len 163840 is more than the host KV pool"),
        (["--host-tokens", "65536", "--max-model-len", "65536", "--gpu-tokens", "200000"],
         "--gpu-tokens 200000 is more than --host-tokens 65536"),
    ],
)  # fmt: skip
def test_plan_refuses_the_sizes_serve_refuses(capsys, flags, message):
    """A context past the model's positions or the host pool, a GPU pool past the host pool:
    serve refuses them at start-up, so plan does (it planned them, the context lowered)."""
    assert cli_main(["plan", *flags]) == 2
    assert message in capsys.readouterr().err


def test_plan_caps_the_sizes_left_out_at_the_host_pool_as_serve_does(capsys):
    """plan's --max-model-len and --gpu-tokens left out are capped at --host-tokens, as serve
    caps a context and a GPU pool left out: ``plan --host-tokens 65536`` was refused for a
    --max-model-len 163840 it was not given, which serve with the same flags is not."""
    host = ["--host-mem-gib", "1536"]
    assert cli_main(["plan", "--host-tokens", "64K", *host]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "--max-model-len 65536 " in out and "--gpu-tokens 65536 --host-tokens 65536\n" in out
    assert "max_model_len 65536 (the given host_tokens)" in out and "given: --host-tokens" in out
    flags = ["--no-offload", "--host-tokens", "65536", "--max-batch", "4", *host]
    assert cli_main(["plan", *flags]) == 0
    assert "--max-model-len 65536 " in capsys.readouterr().out


def test_a_refusal_names_the_rows_that_fit_and_they_do():
    """The GPU's and the host's refusals name the --gpu-tokens / --host-tokens that fit (as vLLM
    names the fix), and a rank given that many fits."""
    import re
    from dataclasses import replace

    from model.checkpoint_meta import read_checkpoint_meta
    from runtime.distributed.plan import check_fits
    from runtime.engine_config import EngineConfig

    _, config, _ = read_checkpoint_meta("tiny")
    for eng in (EngineConfig(device="cuda", host_tokens=1 << 20, gpu_tokens=1 << 19),
                EngineConfig(device="cuda", host_tokens=1 << 19, offload=False)):  # fmt: skip
        plan = memory_plan(config, eng, 100.0, None, 0.0)
        gpu = sum(plan.gpu_gib.values()) * 0.6  # the KV rows dominate: a smaller pool fits
        host = plan.host_gib_per_rank * 0.6 if eng.offload else 100.0
        with pytest.raises(ValueError) as e:
            check_fits(config, eng, gpu, host)
        named = dict((f, int(n)) for f, n in re.findall(r"(--\w+-tokens) (\d+) fits", str(e.value)))
        assert set(named) == ({"--gpu-tokens", "--host-tokens"} if eng.offload
                              else {"--host-tokens"}), str(e.value)  # fmt: skip
        if eng.offload:  # each alone fits its own memory
            check_fits(config, replace(eng, gpu_tokens=named["--gpu-tokens"]), gpu, 100.0)
            check_fits(config, replace(eng, host_tokens=named["--host-tokens"]), 100.0, host)
        else:
            check_fits(config, replace(eng, host_tokens=named["--host-tokens"]), gpu, host)
        assert all(n > 0.5 * (1 << 18) for n in named.values())  # not needlessly small


def test_plan_shows_the_sizes_serve_chooses_for_the_deployment(capsys):
    """Left out, plan's sizes are serve's choice for the deployment planned (docs/multi_gpu.md's
    and docs/server.md's numbers: AWQ V3.2 on 8 x H200 with 1.5 TiB hosts, serve's --max-batch
    8 and bf16 rows), and the plan says where each came from; given, a size stands as given."""
    deploy = ["plan", "--quant", "awq", "--max-batch", "8", "--host-mem-gib", "1536"]
    assert cli_main([*deploy, "--kv-format", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "  for --max-batch 8 --max-model-len 163840 --kv-format bf16 --gpu-tokens 609339 " \
        "--host-tokens 1310720\n" in out, out  # fmt: skip
    assert "  (chosen as serve chooses them: max_model_len 163840 (the model's" in out
    assert "at most 0.8 x 1536 GiB host / 8 ranks)" in out
    assert cli_main([*deploy, "--gpu-tokens", "100000"]) == 0  # (fp8 rows, plan's default)
    out = capsys.readouterr().out
    assert "--gpu-tokens 100000 --host-tokens 1310720\n" in out and "given: --gpu-tokens)" in out
    assert cli_main(["plan", "--quant", "awq", *SIZES]) == 0
    assert "  (sizes as given)\n" in capsys.readouterr().out
    assert cli_main(["plan", "--quant", "awq"]) == 2  # the host pool is sized from the host
    err = capsys.readouterr().err
    assert "--host-tokens left out" in err and "give --host-mem-gib" in err


def test_plan_needs_the_hosts_memory_only_for_a_host_pool_it_sizes(capsys):
    """A given --host-tokens, or no offloading (the pool on the GPU), leaves the host's memory
    out of the sizing: plan sizes the rest without --host-mem-gib (it refused, naming the host's
    memory), and the GPU-only sizing line does not name a host it did not use."""
    assert cli_main(["plan", "--quant", "awq", "--host-tokens", "2097152"]) == 0
    out = capsys.readouterr().out
    assert "--host-tokens 2097152\n" in out and "given: --host-tokens)" in out, out
    assert cli_main(["plan", "--quant", "awq", "--no-offload", "--max-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "on the GPU, at most what its memory holds" in out and "GiB host" not in out, out


def test_plan_refuses_a_bad_fraction_even_with_every_size_given(capsys):
    """A fraction out of range is refused where it sizes nothing, as serve refuses it (plan
    printed the plan and said it fits)."""
    assert cli_main(["plan", "--quant", "awq", *SIZES, "--host-memory-fraction", "2"]) == 2
    assert "--host-memory-fraction" in capsys.readouterr().err
