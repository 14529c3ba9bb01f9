"""Regional compilation (echo_compile/regional.py, opt-in): every layer's feed-forward runs
through one nested compile region, reused per kind, and the compiled step's logits equal the
unrolled step's bit for bit (CPU: Inductor's C++ backend, no CUDA graphs)."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.utils import ReinplaceCounters, counters

from echo_compile.compiled import StepCompiler
from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.tokenizer import Tokenizer
from tests.test_compile import drive


def _engine(compiler: StepCompiler | None) -> Engine:
    """A small engine over a model of its own (regional compilation marks its model)."""
    path = resolve_model("tiny")
    model, _ = load_model(path)
    opts = dict(
        max_batch=4,
        host_tokens=4096,
        gpu_tokens=4 * model.config.index_topk,
        max_model_len=512,
        decode_buckets=(4,),
        prefill_chunk=64,
        device="cpu",
        compile_prefill=False,
    )
    return Engine(
        model, model.config, Tokenizer.from_dir(path), EngineConfig(**opts), compiler=compiler
    )


def test_regional_step_reuses_one_moe_region_with_each_layer_s_weights():
    """Dynamo's graph of the regional decode step: one graph, no break, every MoE layer a call of
    the same subgraph, each with its own layer's weights (an instance-level region once called
    layer 0's subgraph with layer 0's weights in every layer)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    eng = _engine(StepCompiler("cpu", backend=backend, regional=True))
    assert len(drive(eng, steps=3)) > 0
    assert dict(counters["graph_break"]) == {}
    assert len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    config = eng.runner.model.config
    moe_layers = range(config.first_k_dense_replace, config.num_hidden_layers)
    assert len(moe_layers) == 3
    moe = [n for n in calls if any("_mlp_modules_gate_" in str(a) for a in n.args)]
    assert len(moe) == len(moe_layers)
    assert len({n.args[0].target for n in moe}) == 1  # one subgraph, reused
    for i, n in zip(moe_layers, moe):
        names = [str(a) for a in n.args[2:] if "_mlp_modules_" in str(a)]
        assert names and all(f"_layers_modules_{i}_" in a for a in names), (i, names)


def test_regional_compiled_decode_equals_the_unrolled_step():
    """Regional and unrolled compiled decode give torch.equal logits at every step of a greedy
    generation; Inductor still reinplaces every cache op."""
    import torch._inductor.config as ic

    torch._dynamo.reset()
    counters.clear()
    ReinplaceCounters.clear()
    old = ic.fx_graph_cache
    ic.fx_graph_cache = False  # ReinplaceCounters are only filled on a cache miss
    try:
        unrolled = drive(_engine(StepCompiler("cpu")))
        regional = drive(_engine(StepCompiler("cpu", regional=True)))
    finally:
        ic.fx_graph_cache = old
    assert dict(counters["graph_break"]) == {}
    assert ReinplaceCounters.get_total_missed() == 0
    assert len(unrolled) == len(regional) >= 12
    for u, r in zip(unrolled, regional):
        assert torch.equal(u, r)
