"""One start-up of ``LLM`` (the offline API and the server's) reads its checkpoint's meta
(``model.checkpoint_meta.read_checkpoint_meta``: config.json, generation_config.json, the
tokenizer's presence) once, finds the device whose memory it plans with
(``plan.rank_memory_device``) once and, for an FP8 checkpoint, the modules kept FP8
(``model.fp8_choice.fp8_choice``) and its shard listing (``model.shards.shard_files``) once: each
is passed down to the sizing, the checks, the engine inputs and the load, which read nothing of it
again."""

from __future__ import annotations

import sys

import pytest
import torch

import model.checkpoint_meta
import model.fp8_choice
import model.loader
import model.shards
from runtime.distributed import plan


class Loaded(Exception):
    """The load was reached (the test stops there)."""


def _count(monkeypatch, module, name: str) -> list[int]:
    """Count the calls of ``module.name``, wherever it is imported from: every loaded module
    holding the same function (an import at a module's top) gets the counting one too."""
    real, calls = getattr(module, name), [0]

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    for m in list(sys.modules.values()):
        if getattr(m, name, None) is real:
            monkeypatch.setattr(m, name, counted)
    return calls


def test_a_cpu_start_up_reads_the_checkpoint_meta_once(monkeypatch):
    """The whole start-up on the CPU: the FP8 choice, the host pool's check, the engine inputs
    and the load."""
    from echo_compile.llm import LLM

    reads = _count(monkeypatch, model.checkpoint_meta, "read_checkpoint_meta")
    llm = LLM("tiny", device="cpu", compile=False, progress=False, max_batch=2)
    assert llm.engine.model_config.vocab_size > 0
    assert reads[0] == 1


@pytest.mark.parametrize("dp", [1, 2])
def test_a_cuda_start_up_reads_the_meta_and_the_memory_device_once(monkeypatch, dp):
    """On a (pretended) GPU, up to the load: the sizing and the memory check both take the
    checkpoint's model config and this rank's memory device from ``LLM``; the load (one
    process's, or a dp rank's build) takes the meta already read."""
    import echo_compile.llm
    import echo_compile.startup
    from runtime.distributed import dist_engine

    monkeypatch.setattr(echo_compile.startup, "check_device", lambda *a, **k: None)
    monkeypatch.setattr(plan, "device_memory_gib", lambda d: (139.8, 1000.0))
    monkeypatch.setattr(plan, "gpu_total_bytes", lambda d: int(139.8 * 2**30))
    if dp > 1:  # no process group: the ranks' agreement is this rank's own sizes
        monkeypatch.setattr(dist_engine, "join", lambda config: None)
    reads = _count(monkeypatch, model.checkpoint_meta, "read_checkpoint_meta")
    devices = _count(monkeypatch, plan, "rank_memory_device")
    sources = []

    def stop(source, *a, **k):
        sources.append(source)
        raise Loaded

    monkeypatch.setattr(model.loader, "load_model", stop)
    monkeypatch.setattr(dist_engine, "build_distributed_engine", stop)
    with pytest.raises(Loaded):
        echo_compile.llm.LLM("tiny", device="cuda", dp=dp, compile=False, progress=False)
    assert (reads[0], devices[0]) == (1, 1)
    # (the load reads no meta again)
    assert isinstance(sources[0], model.checkpoint_meta.CheckpointMeta)


def test_an_fp8_start_up_finds_the_modules_kept_fp8_once(monkeypatch):
    """An FP8 checkpoint's start-up walks its shard listing for the modules kept FP8
    (``fp8_scaled_modules``) once: the choice the sizing and the checks read and the modules the
    load converts come from the same walk (it was made again inside the load). The load takes
    the listing that walk read (``FP8Choice.shards``): the shard index is read once (the load
    read it again, ``checked_shards``), whole or sharded."""
    from echo_compile.llm import LLM
    from model.checkpoint import resolve_model
    from model.fp8_weights import FP8Linear

    scans = _count(monkeypatch, model.fp8_choice, "fp8_scaled_modules")
    listings = _count(monkeypatch, model.shards, "shard_files")
    llm = LLM(str(resolve_model("tiny-fp8")), device="cpu", compile=False, progress=False,
              max_batch=2)  # fmt: skip
    assert any(isinstance(m, FP8Linear) for m in llm.engine.runner.model.modules())  # kept FP8
    assert (scans[0], listings[0]) == (1, 1)
    # a tp rank's load (build_distributed_engine's) takes the choice made too
    from model.parallel import TPGroup
    from model.shard_loader import load_sharded_model

    meta = model.checkpoint_meta.read_checkpoint_meta("tiny-fp8")
    choice = model.fp8_choice.fp8_choice(meta.path, meta.config, "auto")
    shard, _ = load_sharded_model(meta, TPGroup(0, 1, "", gather=False), fp8_weights=choice)
    assert any(isinstance(m, FP8Linear) for m in shard.modules())
    assert (scans[0], listings[0]) == (2, 2)


def test_a_bf16_load_reads_the_shard_listing_once(monkeypatch):
    """A load whose FP8 choice read no listing (a bf16 checkpoint) reads it in the load, once;
    ``load_weights`` called alone reads it itself."""
    from model.model import DeepseekV32ForCausalLM

    listings = _count(monkeypatch, model.shards, "shard_files")
    model.loader.load_model("tiny")
    assert listings[0] == 1
    meta = model.checkpoint_meta.read_checkpoint_meta("tiny")
    with torch.device("meta"):
        net = DeepseekV32ForCausalLM(meta.config)
    model.loader.load_weights(net, meta.path, meta.config)
    assert listings[0] == 2


@pytest.mark.parametrize("name", ["tiny", "tiny-fp8"])
def test_a_rank_build_reads_the_shard_listing_once(monkeypatch, name: str):
    """A dp/tp rank's build (``build_distributed_engine``) reads the shard listing once, before
    the options check (the checkpoint's fingerprint hashes it), and its FP8 choice (made after
    the check: an FP8 checkpoint's walks that listing) and its load take it: the index is not
    read again; the meta it is given is not read again either."""
    import torch.distributed as dist

    from runtime.distributed.dist_engine import build_distributed_engine
    from runtime.distributed.process import DistContext
    from runtime.engine_config import EngineConfig

    def gather(out, obj, group=None):  # (rank 1 given rank 0's options)
        out[:] = [obj, obj]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    meta = model.checkpoint_meta.read_checkpoint_meta(name)
    reads = _count(monkeypatch, model.checkpoint_meta, "read_checkpoint_meta")
    listings = _count(monkeypatch, model.shards, "shard_files")
    ctx = DistContext(0, 2, 0, "cpu", "gloo", "0", None, 10.0)
    tp = 2 if name == "tiny" else 1  # (tiny-fp8's experts are one FP8 block wide: no tp)
    engine = build_distributed_engine(meta, EngineConfig(dp=2, tp=tp, device="cpu"), ctx=ctx)
    assert engine.dp == 2
    assert (reads[0], listings[0]) == (0, 1)
