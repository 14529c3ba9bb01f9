"""``echo-compile bench --weights awq|fp8``: the bench model's random bf16 weights quantised in
memory (model/quantize.py) must be exactly what the loader serves for a quantised checkpoint of
them, so the bench measures what a user would serve. Tiny preset, CPU."""

from __future__ import annotations

import json

import pytest
import torch
from test_loader import last_logits
from torch import nn

from echo_compile.bench import cli as bench_cli
from echo_compile.bench.model_builder import build_model
from model.awq import AWQExperts, AWQLinear
from model.fp8_weights import FP8Experts, FP8Linear, weight_dequant_fp8, weight_quant_fp8
from model.loader import load_model
from model.moe import Experts
from model.quantize import quantize_in_memory, weights_format

ATTN = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")  # kv_b_proj: 16-bit in both
INDEXER = ("wq_b", "wk", "weights_proj")
PROMPT = [0, 44, 73, 341, 83]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("weights, name, kw", [
    ("awq", "tiny-awq", {}), ("fp8", "tiny-fp8", {"fp8_weights": "fp8"}),
])  # fmt: skip
def test_in_memory_quantisation_is_the_loaded_checkpoint(weights, name, kw) -> None:
    """The tiny bf16 checkpoint quantised in memory == make-checkpoint --awq / --fp8 of the same
    weights loaded through the loader: the same module types, config and tensors, bit for bit,
    so the same logits."""
    model, _ = load_model("tiny")
    names = quantize_in_memory(model, weights)
    ref, _ = load_model(name, **kw)
    assert names and model.config == ref.config and weights_format(model) == weights
    types = {n: type(m) for n, m in model.named_modules()}
    assert types == {n: type(m) for n, m in ref.named_modules()}
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(_bits(got[k]), _bits(t)), k
    assert torch.equal(last_logits(model, PROMPT), last_logits(ref, PROMPT))


@pytest.fixture(scope="module")
def built() -> dict[str, nn.Module]:
    return {w: build_model("tiny", 0, 0, "cpu", 0.5, w) for w in ("bf16", "awq", "fp8")}


def test_awq_bench_model_has_the_served_modules(built) -> None:
    awq = built["awq"]
    layers = awq.model.layers
    last = len(layers) - 1
    for i, block in enumerate(layers):
        a, mlp = block.self_attn, block.mlp
        # QuantTrio's exclusions (awq_modules_to_not_convert): the dense layer 0 and the last
        # layer stay 16-bit; kv_b_proj is densified after load (the MLA absorbs it)
        quantised = 0 < i < last
        for p in ATTN:
            assert isinstance(getattr(a, p), AWQLinear) == quantised, (i, p)
        assert type(a.kv_b_proj) is nn.Linear
        if i > 0:
            assert isinstance(mlp.experts, AWQExperts if quantised else Experts), i
            assert isinstance(mlp.shared_experts.down_proj, AWQLinear) == quantised, i
        else:
            assert type(mlp.gate_proj) is nn.Linear
    assert type(awq.lm_head) is nn.Linear and awq.config.quantization.method == "awq"


def test_fp8_bench_model_has_the_served_modules(built) -> None:
    bf16, fp8 = built["bf16"], built["fp8"]
    for i, (block, ref) in enumerate(zip(fp8.model.layers, bf16.model.layers, strict=True)):
        a, mlp = block.self_attn, block.mlp
        for p in ATTN:
            assert isinstance(getattr(a, p), FP8Linear), (i, p)
        # the official checkpoint stores the indexer's wq_b / wk in FP8 too: served FP8
        assert isinstance(a.indexer.wq_b, FP8Linear) and isinstance(a.indexer.wk, FP8Linear)
        # kv_b_proj: FP8 in the checkpoint, dequantised at load (the loader's path)
        w = ref.self_attn.kv_b_proj.weight
        w8, s = weight_quant_fp8(w, scale_fmt="ue8m0")
        assert torch.equal(a.kv_b_proj.weight, weight_dequant_fp8(w8, s, dtype=w.dtype))
        assert not torch.equal(a.kv_b_proj.weight, w)
        if i > 0:
            assert isinstance(mlp.experts, FP8Experts)
            assert isinstance(mlp.shared_experts.up_proj, FP8Linear)
        else:
            assert isinstance(mlp.down_proj, FP8Linear)
    assert fp8.config.quantization.method == "fp8" and fp8.config.quantization.scale_fmt == "ue8m0"


def test_indexer_weights_and_logits_across_formats(built) -> None:
    """The locality model's head weighting (indexer.weights_proj, planted) stays the bf16 one,
    bit for bit, in both formats; AWQ leaves the whole indexer 16-bit. The quantised models'
    logits stay close to the bf16 model's (4-bit / e4m3 error of random weights)."""
    bf16 = built["bf16"]
    ref = last_logits(bf16, PROMPT)
    for w in ("awq", "fp8"):
        m = built[w]
        for block, b in zip(m.model.layers, bf16.model.layers, strict=True):
            mine, theirs = block.self_attn.indexer, b.self_attn.indexer
            assert torch.equal(mine.weights_proj.weight, theirs.weights_proj.weight), w
            if w == "awq":
                for p in INDEXER:
                    assert torch.equal(getattr(mine, p).weight, getattr(theirs, p).weight)
        got = last_logits(m, PROMPT)
        corr = torch.corrcoef(torch.stack([got, ref]))[0, 1]
        assert torch.isfinite(got).all() and not torch.equal(got, ref), w
        assert corr > 0.9, (w, float(corr))


def test_bench_dry_run_with_each_format_records_it(tmp_path, capsys) -> None:
    out = tmp_path / "e2e.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--requests", "2", "--min-ctx", "200",
        "--max-ctx", "260", "--output-len", "3", "--max-batch", "2", "--gpu-pools", "384",
        "--rates", "", "--breakdown-steps", "0", "--systems", "offload", "--no-compile",
        "--weights", "bf16,awq,fp8", "--out", str(out),
    ]  # fmt: skip
    assert bench_cli.main(argv) == 0
    d = json.loads(out.read_text())
    assert d["weights"] == ["bf16", "awq", "fp8"] and "quantization_config" not in d["model"]
    assert [r["weights"] for r in d["results"]] == ["bf16", "awq", "fp8"]
    wb = d["weight_bytes"]
    for r in d["results"]:
        assert r["weight_bytes"] == wb[r["weights"]]["total"]
        assert r["generated_tokens"] == 6 and len(r["hit_rate"]) == d["model"]["num_hidden_layers"]
    assert wb["awq"]["int32"] > 0 and wb["fp8"]["float8_e4m3fn"] > 0
    assert wb["fp8"]["total"] < wb["awq"]["total"] < wb["bf16"]["total"]
    # the report: every format's run next to bf16's, and the e2e tables name the format
    from benchmarks import e2e_summary

    capsys.readouterr()
    assert e2e_summary.main(["--weights", str(out), "--e2e", str(out), "--step", "-"]) == 0
    text = capsys.readouterr().out
    rows = [ln for ln in text.splitlines() if ln.startswith(("| awq | offload", "| fp8 | offload"))]
    assert len(rows) == 2 and all(ln.split(" | ")[5].endswith("x") for ln in rows), text
    assert "| offload (fp8) |" in text and "bf16 / awq / fp8 weights" in text


@pytest.mark.parametrize("extra, message", [
    (["--weights", "int4"], "--weights: unknown format 'int4' (choose from bf16, awq, fp8)"),
    (["--weights", "awq,awq"], "--weights: a format named twice"),
])  # fmt: skip
def test_bench_rejects_bad_weights(extra, message, capsys, tmp_path) -> None:
    argv = ["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path / "x.json")] + extra
    with pytest.raises(SystemExit):
        bench_cli.main(argv)
    assert message in capsys.readouterr().err


def test_bad_weights_raise_value_errors(built) -> None:
    with pytest.raises(ValueError, match="weights must be one of bf16, awq, fp8, got 'int4'"):
        build_model("tiny", 0, 0, "cpu", weights="int4")
    with pytest.raises(ValueError, match="already quantised"):
        quantize_in_memory(built["awq"], "fp8")


@pytest.mark.cuda
def test_in_memory_quantisation_is_the_loaded_checkpoint_on_cuda() -> None:
    """On CUDA the loader also makes the fast int4 layouts (repack_awq_model): the same there."""
    for weights, name, kw in (("awq", "tiny-awq", {}), ("fp8", "tiny-fp8", {"fp8_weights": "fp8"})):
        model, _ = load_model("tiny", device="cuda")
        quantize_in_memory(model, weights)
        ref, _ = load_model(name, device="cuda", **kw)
        got, want = model.state_dict(), ref.state_dict()
        assert got.keys() == want.keys(), weights
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(_bits(got[k]), _bits(t)), k
        assert torch.equal(last_logits(model, PROMPT), last_logits(ref, PROMPT))


@pytest.mark.cuda
def test_compiled_bench_runs_each_format_on_cuda(tmp_path) -> None:
    """The compiled (CUDA-graph) decode step of the tiny bench model in AWQ and FP8."""
    torch._dynamo.utils.counters.clear()
    out = tmp_path / "e2e.json"
    argv = [
        "--preset", "tiny", "--device", "cuda", "--requests", "2", "--min-ctx", "200",
        "--max-ctx", "260", "--output-len", "4", "--max-batch", "2", "--gpu-pools", "384",
        "--rates", "", "--breakdown-steps", "0", "--systems", "offload",
        "--weights", "awq,fp8", "--out", str(out),
    ]  # fmt: skip
    assert bench_cli.main(argv) == 0
    d = json.loads(out.read_text())
    assert [(r["weights"], r["generated_tokens"]) for r in d["results"]] == [("awq", 8), ("fp8", 8)]
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert d["graph_gates"] == {"cudagraph_skips": 0, "cudagraph_partitions": 0, "graph_breaks": 0}
