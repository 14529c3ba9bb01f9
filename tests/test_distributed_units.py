"""Pieces of multi-process serving that need no process group (docs/multi_gpu.md): the dp/tp
options, the DP balancer, the step agreement's combination, and the TP shards: each rank loads
exactly its rows/columns of the checkpoint (bf16, FP8, AWQ), and the ranks' partial outputs add
up to the whole block's output."""

from __future__ import annotations

import re

import pytest
import torch

from model.config import ModelConfig
from model.loader import load_model
from model.parallel import TPGroup
from model.presets import tiny_config_dict
from model.shard_loader import load_sharded_model, local_expert_name, shard_axis
from runtime.distributed.balance import RankLoad, assign
from runtime.distributed.step_sync import combine
from runtime.engine_config import EngineConfig


def test_engine_config_dp_tp():
    assert EngineConfig(dp=2, tp=2).world_size == 2
    assert EngineConfig(tp=4).world_size == 4 and EngineConfig(dp=8).world_size == 8
    with pytest.raises(ValueError, match="must be equal"):
        EngineConfig(dp=2, tp=4)
    assert EngineConfig(dp=4, ep=4).ffn_ranks == 4 and EngineConfig(ep=2).world_size == 2
    with pytest.raises(ValueError, match="by tp or by ep"):
        EngineConfig(tp=2, ep=2)
    with pytest.raises(ValueError, match="dp=2 and ep=4"):
        EngineConfig(dp=2, ep=4)
    with pytest.raises(ValueError, match="collective_timeout_s must be a positive number"):
        EngineConfig(collective_timeout_s=0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="dp must be a positive integer"):
            EngineConfig(dp=bad)


def test_balancer_least_load_within_host_capacity():
    loads = [RankLoad(0, 10, 10), RankLoad(0, 10, 10)]
    assert [assign(2, 100, loads) for _ in range(4)] == [0, 1, 0, 1]  # ties -> lower rank
    # rank 0 is lightly loaded but its pool is full: the request goes where its pages are free
    loads = [RankLoad(5, 1, 10), RankLoad(500, 6, 10)]
    assert assign(3, 50, loads) == 1 and loads[1].free_pages == 3 and loads[1].load_tokens == 550
    # free nowhere now: the least-loaded rank whose pool can ever hold it (it waits there)
    loads = [RankLoad(9, 0, 4), RankLoad(1, 0, 2)]
    assert assign(3, 10, loads) == 0
    with pytest.raises(ValueError, match="more than any data-parallel rank's host pool"):
        assign(5, 10, loads)


def test_balancer_counts_only_the_tokens_a_rank_has_not_cached():
    # rank 1 is busier, but holds 900 of the request's 1000 tokens: less work there
    loads = [RankLoad(200, 30, 30), RankLoad(500, 30, 30, cached_tokens=900)]
    assert assign(16, 1000, loads) == 1 and loads[1].load_tokens == 600
    # a cached prefix does not outweigh a much larger load
    loads = [RankLoad(200, 30, 30), RankLoad(2000, 30, 30, cached_tokens=900)]
    assert assign(16, 1000, loads) == 0


def test_step_agreement_takes_the_largest_wants():
    wants = torch.tensor([[0, 4, 1], [64, 0, 1], [0, 0, 0]])
    p = combine(wants)
    assert (p.prefill_bucket, p.decode_bucket, p.any_unfinished) == (64, 4, True)
    assert not combine(torch.zeros(2, 3, dtype=torch.int64)).any_unfinished


def test_shard_axis():
    assert shard_axis("model.layers.1.mlp.experts.7.gate_proj.weight") == 0
    assert shard_axis("model.layers.1.mlp.experts.7.down_proj.weight") == 1
    assert shard_axis("model.layers.1.mlp.shared_experts.up_proj.qweight") == 1  # [in, out/8]
    assert shard_axis("model.layers.1.mlp.experts.0.down_proj.scales") == 0  # [in/128, out]
    assert shard_axis("model.layers.0.mlp.down_proj.weight_scale_inv") == 1
    assert shard_axis("model.layers.1.mlp.gate.weight") is None  # the router: whole
    assert shard_axis("model.layers.1.self_attn.o_proj.weight") is None


def _check_shards(full: torch.nn.Module, shards: list[torch.nn.Module]) -> int:
    """Every parameter: whole and equal on every rank, or split along one axis with the ranks'
    parts (gate and up halves separately for stacked w13) concatenating to the whole exactly."""
    whole = dict(full.named_parameters())
    parts = [dict(s.named_parameters()) for s in shards]
    assert all(p.keys() == whole.keys() for p in parts)
    split = 0
    for name, w in whole.items():
        ps = [p[name] for p in parts]
        if w.dtype == torch.float8_e4m3fn:  # compare FP8 weights by their bytes
            w, ps = w.view(torch.uint8), [p.view(torch.uint8) for p in ps]
        if ps[0].shape == w.shape:
            assert all(torch.equal(p, w) for p in ps), name
            continue
        (axis,) = [i for i, (a, b) in enumerate(zip(ps[0].shape, w.shape)) if a != b]
        if ".w13_" in name:  # [gate rows | up rows] on each rank
            halves = [p.chunk(2, dim=axis) for p in ps]
            got = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=axis)
        else:
            got = torch.cat(ps, dim=axis)
        assert torch.equal(got, w), name
        split += 1
    return split


def test_bf16_shards_are_the_checkpoint_split():
    full, _ = load_model("tiny", keep_mtp=False)
    shards = [load_sharded_model("tiny", TPGroup(r, 2, "", gather=True))[0] for r in range(2)]
    # per layer: dense MLP 3 (layer 0) or experts w13, w2 + shared 3 (layers 1-3)
    assert _check_shards(full, shards) == 3 + 3 * 5


@pytest.mark.parametrize("fmt", ["fp8", "awq"])
def test_quantised_shards_are_the_checkpoint_split(tmp_path, fmt):
    from model.checkpoint import make_checkpoint

    # the tiny model with 256 expert features: a shard of 128 holds whole FP8 blocks / AWQ groups
    cfg = ModelConfig.from_dict(dict(tiny_config_dict(), moe_intermediate_size=256))
    path = make_checkpoint(tmp_path / fmt, cfg, fp8=fmt == "fp8", awq=fmt == "awq")
    full, _ = load_model(path, keep_mtp=False)
    shards = [load_sharded_model(path, TPGroup(r, 2, "", gather=True))[0] for r in range(2)]
    assert _check_shards(full, shards) >= 3 + 3 * 5


@pytest.fixture(scope="module")
def tiny_fp8_256(tmp_path_factory):
    from model.checkpoint import make_checkpoint

    # the tiny model with 256 expert features: a shard of 128 holds whole FP8 blocks
    cfg = ModelConfig.from_dict(dict(tiny_config_dict(), moe_intermediate_size=256))
    return make_checkpoint(tmp_path_factory.mktemp("fp8"), cfg, fp8=True)


@pytest.mark.parametrize("ep", [False, True])
def test_fp8_shards_stay_fp8_and_split_the_single_process_fp8_model(tiny_fp8_256, ep):
    """fp8_weights='fp8' with tp (or ep) = 2: every FP8 linear and expert stack stays e4m3 on
    each rank, its weight bytes and block scales the single-process FP8 model's split on 128x128
    block boundaries (or its experts whole, for EP), and the ranks' partial outputs add up to
    the single-process FP8 block."""
    from model.fp8_weights import FP8Experts, FP8Linear

    path = tiny_fp8_256
    full, _ = load_model(path, keep_mtp=False, fp8_weights="fp8")
    shards = [load_sharded_model(path, TPGroup(r, 2, "", gather=True), ep=ep,
                                 fp8_weights="fp8")[0] for r in range(2)]  # fmt: skip
    for s in shards:
        kinds = {type(m) for m in s.model.modules()}
        assert FP8Linear in kinds and FP8Experts in kinds
        fp8 = [n for n, p in s.named_parameters() if p.dtype == torch.float8_e4m3fn]
        assert any(".mlp.down_proj." in n for n in fp8)  # a TP-split dense MLP kept FP8
        assert any(".experts.w13_weight" in n for n in fp8)
    if ep:
        for i, layer in enumerate(full.model.layers):
            if full.config.is_moe_layer(i):
                whole = layer.mlp.experts.w13_weight.view(torch.uint8)
                for r, s in enumerate(shards):
                    mine = s.model.layers[i].mlp.experts.w13_weight.view(torch.uint8)
                    assert torch.equal(mine, whole[4 * r : 4 * r + 4])
    else:
        assert _check_shards(full, shards) >= 3 + 3 * 5
    x = torch.randn(12, full.config.hidden_size, generator=torch.Generator().manual_seed(2))
    x = x.to(torch.bfloat16)
    for i, layer in enumerate(full.model.layers):
        ref = layer.mlp(x).float()
        got = sum(s.model.layers[i].mlp.partial(x) for s in shards).to(torch.bfloat16).float()
        ulp = 2.0**-7 * ref.abs().max().item()
        assert (got - ref).abs().max().item() <= ulp, f"layer {i}"


def test_fp8_weights_option_is_checked():
    with pytest.raises(ValueError, match="needs an FP8 checkpoint"):
        load_sharded_model("tiny", TPGroup(0, 2, "", gather=True), fp8_weights="fp8")
    with pytest.raises(ValueError, match="fp8_weights must be"):
        load_sharded_model("tiny", TPGroup(0, 2, "", gather=True), fp8_weights="int8")
    # tiny-fp8: 128 expert features over 2 ranks = 64 rows, half of one 128x128 FP8 block
    with pytest.raises(ValueError, match="in whole blocks of 128"):
        load_sharded_model("tiny-fp8", TPGroup(0, 2, "", gather=True), fp8_weights="fp8")


def test_shards_must_hold_whole_quantisation_blocks():
    # tiny-fp8: 128 expert features over 2 ranks = 64 rows, half of one 128x128 FP8 block
    with pytest.raises(ValueError, match="in whole blocks of 128"):
        load_sharded_model("tiny-fp8", TPGroup(0, 2, "", gather=True))
    with pytest.raises(ValueError, match="cannot be split evenly over 3 feed-forward ranks"):
        load_sharded_model("tiny", TPGroup(0, 3, "", gather=True))


def test_tp_partial_outputs_add_up_to_the_block():
    full, _ = load_model("tiny", keep_mtp=False)
    shards = [load_sharded_model("tiny", TPGroup(r, 2, "", gather=True))[0] for r in range(2)]
    x = torch.randn(12, full.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    for i, layer in enumerate(full.model.layers):
        ref = layer.mlp(x).float()  # [T, D] the whole block
        got = sum(s.model.layers[i].mlp.partial(x) for s in shards).to(torch.bfloat16).float()
        # one bf16 rounding of each rank's partial products: about one ulp of the output
        ulp = 2.0**-7 * ref.abs().max().item()
        assert (got - ref).abs().max().item() <= ulp, f"layer {i}"
        assert not torch.equal(shards[0].model.layers[i].mlp.partial(x), ref)  # a real split


def test_ep_shards_hold_their_experts_whole():
    g1 = TPGroup(1, 2, "", gather=True)
    assert local_expert_name("model.layers.2.mlp.experts.5.up_proj.weight", g1, 8) == (
        "model.layers.2.mlp.experts.1.up_proj.weight"
    )
    assert local_expert_name("model.layers.2.mlp.experts.3.up_proj.weight", g1, 8) is None
    assert local_expert_name("model.layers.2.mlp.gate.weight", g1, 8) == (
        "model.layers.2.mlp.gate.weight"
    )
    full, _ = load_model("tiny", keep_mtp=False)
    shards = [load_sharded_model("tiny", TPGroup(r, 2, "", gather=True), ep=True)[0]
              for r in range(2)]  # fmt: skip
    x = torch.randn(12, full.config.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    for i, layer in enumerate(full.model.layers):
        if not full.config.is_moe_layer(i):
            continue
        whole = layer.mlp.experts
        for r, s in enumerate(shards):
            mine = s.model.layers[i].mlp.experts
            assert mine.n_experts == 4
            assert torch.equal(mine.w13_weight, whole.w13_weight[4 * r : 4 * r + 4])
            assert torch.equal(mine.w2_weight, whole.w2_weight[4 * r : 4 * r + 4])
        ref = layer.mlp(x).float()
        got = sum(s.model.layers[i].mlp.partial(x) for s in shards).to(torch.bfloat16).float()
        ulp = 2.0**-7 * ref.abs().max().item()
        assert (got - ref).abs().max().item() <= ulp, f"layer {i}"


def test_driver_does_not_hand_out_rank0_only_methods():
    """The server shares a prefill over n choices only if its engine has add_request_group: on a
    multi-rank driver that would add the group to rank 0's engine alone (no other rank, no DP
    balance, no abort through the driver), so the driver does not offer it; reads pass through."""
    from types import SimpleNamespace

    from runtime.distributed.driver import DriverEngine

    local = SimpleNamespace(add_request_group=lambda *a: None, tokenizer="tok", max_model_len=7)
    d = DriverEngine(SimpleNamespace(ctx=SimpleNamespace(rank=0, timeout_s=60.0), engine=local))
    try:
        assert (d.tokenizer, d.max_model_len) == ("tok", 7)
        assert not hasattr(d, "add_request_group")
    finally:
        d.close()


def test_driver_refuses_what_rank_0_alone_would_get_naming_it():
    """Only the reads alike on every rank pass through the driver to rank 0's engine; any other
    Engine attribute (state that is one rank's, or a call that changes it) is an AttributeError
    naming it: each was silently rank 0's, e.g. a logits processor added to one rank, the step
    counters of one rank read as the deployment's."""
    from types import SimpleNamespace

    from runtime.distributed.driver import DriverEngine

    local = SimpleNamespace(
        tokenizer="tok", model_name="m", max_model_len=7, sampling_defaults="sd",
        eos_token_ids=frozenset({1}), config="cfg", model_config="mc",
        prompt_kv=lambda rid: None, logits_processors=[], num_steps=3, requests={},
        check_pools=lambda: None, cache=object(), keep_finished=False,
    )  # fmt: skip
    d = DriverEngine(SimpleNamespace(ctx=SimpleNamespace(rank=0, timeout_s=60.0), engine=local))
    try:
        reads = ("tokenizer", "model_name", "max_model_len", "sampling_defaults",
                 "eos_token_ids", "config", "model_config")  # fmt: skip
        assert [getattr(d, n) for n in reads] == [getattr(local, n) for n in reads]
        for name in ("prompt_kv", "logits_processors", "num_steps", "requests", "check_pools",
                     "cache", "keep_finished", "no_such_thing"):  # fmt: skip
            with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
                getattr(d, name)
    finally:
        d.close()


def test_the_model_steps_guard_blames_peers_only_for_collective_failures():
    """Around the model step (collectives and this rank's own work), only a transport failure is
    a RankFailure ("another rank failed"); this rank's own error, e.g. out of memory, passes as
    it is (it was blamed on the peers)."""
    import torch.distributed as dist

    from runtime.distributed.process import DistContext, RankFailure, guarded

    ctx = DistContext(0, 2, 0, "cpu", "gloo", "0", None, 10.0)
    for err in (
        RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"),
        dist.DistError("NCCL communicator was aborted"),
    ):
        with pytest.raises(RankFailure, match="the model step failed"):
            with guarded(ctx, "the model step", only_collectives=True):
                raise err
    for err in (torch.OutOfMemoryError("CUDA out of memory."), RuntimeError("shape mismatch")):
        with pytest.raises(type(err), match=str(err)):
            with guarded(ctx, "the model step", only_collectives=True):
                raise err
    with pytest.raises(RankFailure):  # the step agreement: every error there is a peer's
        with guarded(ctx, "the step agreement"):
            raise RuntimeError("shape mismatch")


def test_a_failing_ranks_note_names_its_error_in_the_others_rank_failure():
    """The failing rank's note (failure_note) turns the others' RankFailure from "another rank
    failed" into that rank's error; the first note stays, a rank reads none of its own, and
    with no note (a rank killed) the failure reads as before, after a bounded wait."""
    import torch.distributed as dist

    from runtime.distributed.failure_note import leave_note, read_note
    from runtime.distributed.process import DistContext, RankFailure, guarded

    store = dist.HashStore()
    zero, one = (DistContext(r, 2, r, "cpu", "gloo", "0", None, 10.0, store) for r in (0, 1))
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    with pytest.raises(RankFailure, match="another rank failed"):
        with guarded(zero, "the step agreement"):  # no note yet
            raise gone
    leave_note(one, ValueError("bad tensor\nsecond line"), "its step")
    leave_note(zero, RuntimeError("later, because of rank 1"), "its step")  # not kept
    assert read_note(one, 0.1) is None  # its own
    want = "rank 1: ValueError: bad tensor (raised in its step; rank 0/2 stops: the step agreement"
    with pytest.raises(RankFailure, match=re.escape(want)):
        with guarded(zero, "the step agreement"):
            raise gone


def test_a_ranks_own_start_up_error_is_raised_when_the_exchange_also_fails(monkeypatch):
    """A rank whose start-up step raised meets a peer gone in the exchange of errors
    (rank_errors): it stops with its own error (an OSError: the CLI's exit 2, its message), the
    exchange's RankFailure its context; it raised only "another rank failed" and lost its own.
    A rank with nothing of its own raises the RankFailure."""
    import torch.distributed as dist

    from runtime.distributed.process import DistContext, RankFailure
    from runtime.distributed.rank_errors import rank_errors

    def gone(out, obj, group=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    monkeypatch.setattr(dist, "all_gather_object", gone)
    ctx = DistContext(1, 2, 1, "cpu", "gloo", "0", None, 10.0)
    with pytest.raises(OSError, match="shard unreadable") as raised:
        with rank_errors(ctx, "the weight load"):
            raise OSError("shard unreadable")
    assert isinstance(raised.value.__context__, RankFailure)
    with pytest.raises(RankFailure, match="another rank failed"):
        with rank_errors(ctx, "the weight load"):
            pass


def test_ranks_built_with_other_engine_options_are_refused_naming_them(monkeypatch):
    """A rank given another tp (or kv_format, max_batch, ...) than rank 0 is refused on every
    rank before a weight loads, naming the option: with tp it met other collectives (gloo
    aborted it: "collective mismatch"), with kv_format it silently computed other numbers. The
    refusal's wording covers the checkpoint too: the same path may hold other files on another
    host, so "the same command on each" alone would not explain it."""
    import torch.distributed as dist

    from model.checkpoint import resolve_model
    from model.checkpoint_meta import CheckpointFingerprint
    from runtime.distributed.dist_engine import build_distributed_engine
    from runtime.distributed.process import DistContext

    ctx = DistContext(0, 2, 0, "cpu", "gloo", "0", None, 10.0)
    config = EngineConfig(dp=2, tp=2, device="cpu")
    other = {"tp": 1, "kv_format": "fp8"}  # what rank 1 was given

    def gather(out, obj, group=None):  # rank 1's options are rank 0's but for `other`
        # (the start-up steps' error exchanges, rank_errors: None, no error, on both ranks)
        out[:] = [obj, dict(obj, **other) if isinstance(obj, dict) else obj]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    with pytest.raises(ValueError, match="kv_format: rank 0 has 'bf16', rank 1 has 'fp8'; tp: "):
        build_distributed_engine(resolve_model("tiny"), config, ctx=ctx)
    # another checkpoint at rank 0's path (another host's files): the wording names that case too
    other = {"checkpoint": CheckpointFingerprint("9c41", str(resolve_model("tiny")))}
    with pytest.raises(ValueError) as err:
        build_distributed_engine(resolve_model("tiny"), config, ctx=ctx)
    assert str(err.value).startswith(
        "every rank of a dp/tp/ep job must be given the same engine options (torchrun runs the "
        "same command on each) and the same checkpoint (compared by its fingerprint: config, "
        "generation config when read, shard listing; one path may hold other files on other "
        "hosts): "
        "checkpoint: rank 0 has "
    ), err.value
    assert str(err.value).endswith(f"rank 1 has 9c41 ({resolve_model('tiny')})"), err.value
    other = {}  # the same options everywhere: built
    assert build_distributed_engine(resolve_model("tiny"), config, ctx=ctx).dp == 2


def test_a_rank_given_an_fp8_weights_the_checkpoint_refuses_is_refused_by_the_options_check(
    monkeypatch,
):
    """``build_distributed_engine`` called with an ``fp8_weights`` string checks the ranks'
    options before it resolves the string against the checkpoint: rank 1 given ``fp8`` for a
    bf16 checkpoint (rank 0 ``auto``) raised "needs an FP8 checkpoint" on rank 1 alone, before
    the check's collective, and rank 0 waited in it until the collective timeout; now every
    rank gets the check's error naming fp8_weights."""
    import torch.distributed as dist

    from model.checkpoint import resolve_model
    from runtime.distributed.dist_engine import build_distributed_engine
    from runtime.distributed.process import DistContext

    ctx = DistContext(1, 2, 1, "cpu", "gloo", "0", None, 10.0)  # this process: rank 1
    gathered = []

    def gather(out, obj, group=None):  # rank 0's options are this rank's but for fp8_weights
        gathered.append(obj)
        out[:] = [dict(obj, fp8_weights="auto") if isinstance(obj, dict) else obj, obj]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    config = EngineConfig(dp=2, tp=2, device="cpu")
    with pytest.raises(ValueError, match="fp8_weights: rank 0 has 'auto', rank 1 has 'fp8'$"):
        build_distributed_engine(resolve_model("tiny"), config, ctx=ctx, fp8_weights="fp8")
    # the checks before the options' (none failed), then the options: nothing after them
    assert [type(g) for g in gathered] == [type(None), dict]
