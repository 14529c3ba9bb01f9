"""The end-to-end benchmark harness (echo-compile bench) on the tiny preset: the runs it makes, the
locality knob, the time breakdown, and its argument errors. The numbers themselves come from the
H200 (benchmarks/results/); here only that they are computed and consistent."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from echo_compile.bench import cli as bench_cli
from echo_compile.bench import harness as bench
from echo_compile.bench.breakdown import CATEGORIES
from echo_compile.bench.model_builder import build_model
from echo_compile.bench.workload import Workload

ARGS = [
    "--preset", "tiny", "--device", "cpu", "--requests", "4", "--min-ctx", "200",
    "--max-ctx", "300", "--output-len", "4", "--max-batch", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", 0, 0, "cpu")


def test_bench_writes_every_run_and_a_breakdown(tmp_path, monkeypatch) -> None:
    # without --out: e2e_PRESET_DEVICE.json in the current directory (the default was the
    # committed H200 result, which a CPU dry run overwrote)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "e2e_tiny_cpu.json"
    argv = ARGS + ["--gpu-pools", "704,384", "--eager-pools", "384", "--rate-pool", "384"]
    # eager: what is checked here is the runs and their records (compiled systems: the tests below)
    argv += ["--rates", "400", "--rate-requests", "2", "--no-compile"]
    assert bench_cli.main(argv) == 0
    d = json.loads(out.read_text())
    assert d["compiled"] is False
    runs = {(r["system"], r["gpu_pool_tokens"], float(r["rate"])) for r in d["results"]}
    assert "Infinity" not in out.read_text()  # JSON every parser reads: the rate inf is "inf"
    inf = math.inf
    assert runs == {
        ("offload", 704, inf), ("gpu-only", 704, inf),
        ("offload", 384, inf), ("offload", 384, 400.0), ("gpu-only", 384, inf),
        ("gpu-only", 384, 400.0), ("offload-eager", 384, inf),
    }  # fmt: skip
    layers = d["model"]["num_hidden_layers"]
    for r in d["results"]:
        assert r["generated_tokens"] == r["requests"] * 4
        assert r["throughput_tok_s"] > 0 and 1 <= r["effective_batch"] <= r["max_batch"]
        offload = r["system"] != "gpu-only"
        assert len(r["hit_rate"]) == (layers if offload else 0)
        assert all(0 <= h <= 1 for h in r["hit_rate"])
        assert (r["recalled_rows_per_step"] > 0) == offload
        assert 0 < r["steps_s"] and r["steps_s"] + r["add_s"] <= r["serve_s"] <= r["wall_s"]
        assert r["add_s"] > 0
        st = r["step_ms"]
        assert 0 < st["p50"] <= st["p99"] <= st["max"] and st["mean"] <= st["max"]
        assert 0 <= r["ttft_s"]["p50"] <= r["serve_s"]
    # GPU-only holds whole requests: 384 rows fit one of these, 704 two; offloading is bounded by
    # B x topk <= N_G and the max batch
    caps = {(r["system"], r["gpu_pool_tokens"]): r["max_batch"] for r in d["results"]}
    assert caps[("gpu-only", 384)] == 1 and caps[("gpu-only", 704)] == 2
    assert caps[("offload", 384)] == 4
    assert set(d["breakdown"]) == {"384", "gpu-only 384"}  # offload-eager's and GPU-only's
    bd = d["breakdown"]["384"]
    assert set(bd["ms_per_step"]) == set(CATEGORIES) and bd["batch"] == 4
    for part in ("attention", "indexer", "cache management", "moe"):
        assert bd["ms_per_step"][part] > 0, part
    assert bd["total_ms"] == pytest.approx(sum(bd["ms_per_step"].values()))
    gpu = d["breakdown"]["gpu-only 384"]
    assert gpu["batch"] == 1 and gpu["hit_rate"] == []  # no GPU pool: nothing recalled
    # offloading's cache management is the recall + offload; GPU-only only writes its rows
    assert gpu["ms_per_step"]["cache management"] < bd["ms_per_step"]["cache management"]


def test_bench_runs_asynchronous_scheduling_beside_the_synchronous_loop(tmp_path) -> None:
    out = tmp_path / "async.json"
    argv = ARGS + ["--gpu-pools", "704", "--systems", "offload", "--rates", "", "--no-compile"]
    argv += ["--breakdown-steps", "0", "--async-scheduling", "off,on", "--out", str(out)]
    assert bench_cli.main(argv) == 0
    d = json.loads(out.read_text())
    assert d["async_scheduling"] == ["off", "on"]
    runs = {r["async_scheduling"]: r for r in d["results"]}
    assert set(runs) == {False, True}
    off, on = runs[False], runs[True]
    assert off["generated_tokens"] == on["generated_tokens"] == 4 * 4
    assert off["decode_steps"] == on["decode_steps"]
    assert off["decode_ahead_fraction"] == 0.0 and off["decode_host_gap_ms"] > 0
    # 4 rows decode 4 tokens: steps 2, 3 and 4 are launched before the step before them is read
    assert on["decode_ahead_fraction"] == 0.75 and on["discarded_rows"] == 0


def test_bench_prefetch_limits_reach_the_engine(tmp_path) -> None:
    """--prefetch-cap / --prefetch-ratio set the staging limits of the prefetching runs (recorded
    per run; 0 for a run without prefetch); left out, a prefetching run has EngineConfig's."""
    from runtime.engine_config import EngineConfig

    out = tmp_path / "pf.json"
    argv = ARGS + ["--gpu-pools", "384", "--systems", "offload", "--rates", "", "--no-compile",
                   "--breakdown-steps", "0", "--prefetch", "off,global", "--prefetch-cap", "96",
                   "--prefetch-ratio", "0.25", "--out", str(out)]  # fmt: skip
    assert bench_cli.main(argv) == 0
    runs = {r["prefetch"]: r for r in json.loads(out.read_text())["results"]}
    assert set(runs) == {"off", "global"}
    on = runs["global"]
    assert (on["prefetch_cap"], on["prefetch_ratio"]) == (96, 0.25)
    assert sum(on["prefetched_per_step"]) > 0  # the budget staged rows
    assert runs["off"]["generated_tokens"] == on["generated_tokens"]
    assert (runs["off"]["prefetch_cap"], runs["off"]["prefetch_ratio"]) == (0, 0.0)  # none
    argv = ARGS + ["--gpu-pools", "384", "--systems", "offload", "--rates", "", "--no-compile",
                   "--breakdown-steps", "0", "--prefetch", "request"]  # fmt: skip
    assert bench_cli.main(argv + ["--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["results"]
    cfg = EngineConfig()
    assert (run["prefetch_cap"], run["prefetch_ratio"]) == (cfg.prefetch_cap, cfg.prefetch_ratio)


def test_breakdown_profiles_each_prefetch_mode(tmp_path) -> None:
    """With --breakdown-graphs the compiled offload system's steps are profiled at each
    --prefetch mode (only the first mode's were), keyed by the mode; offload-eager's at the
    first mode only, under keys of its own (a prefetch mode's eager entry overwrote the
    compiled one's)."""
    out = tmp_path / "bd.json"
    argv = ARGS + ["--gpu-pools", "384", "--eager-pools", "384", "--systems",
                   "offload-eager,offload", "--rates", "", "--no-compile", "--breakdown-steps", "2",
                   "--breakdown-graphs", "--prefetch", "global,off", "--out", str(out)]  # fmt: skip
    assert bench_cli.main(argv) == 0
    bd = json.loads(out.read_text())["breakdown"]
    want = {"offload-eager prefetch-global 384", "offload prefetch-global 384", "offload 384"}
    assert set(bd) == want
    assert all(e["ms_per_step"]["cache management"] > 0 for e in bd.values())
    from benchmarks.report_data import breakdown_label

    assert breakdown_label("offload prefetch-global 384") == "offload prefetch-global, pool 384"


def test_breakdown_keys_are_distinct() -> None:
    """Every (system, weights, prefetch) of one pool has a key of its own; offload-eager's bf16
    entry without prefetch is the pool alone, as the committed results have it."""
    keys = {
        bench_cli.breakdown_key(s, w, p, 384)
        for s in ("offload", "offload-eager", "gpu-only")
        for w in ("bf16", "awq", "fp8")
        for p in ("off", "request", "global")
    }
    assert len(keys) == 27 and "384" in keys and "offload fp8 prefetch-global 384" in keys


def _eager_system(model, repeat: float) -> bench.System:
    return bench.System(model, "offload-eager", 256, 4096, "fp8", 512, 2, (), "cpu", repeat, seed=0)


def test_repeat_feeds_the_previous_input_and_raises_locality(model) -> None:
    wl = Workload(requests=2, min_ctx=300, max_ctx=300, output_len=12, temperature=1.0)
    hit = {}
    for repeat in (0.0, 1.0):
        sut = _eager_system(model, repeat)
        r = sut.run(wl)
        reqs = sut.engine.finished_requests
        if repeat == 1.0:  # every decode input is the prompt's last token
            assert all(set(q.output_ids) == {q.prompt_ids[-1]} for q in reqs)
        else:
            assert any(len(set(q.output_ids)) > 1 for q in reqs)
        hit[repeat] = r.hit_rate
        sut.close()
    assert hit[1.0][0] > hit[0.0][0] + 0.1, hit


def test_runs_of_one_system_do_not_leak_into_each_other(model) -> None:
    """A System reused for a second workload reports exactly what a fresh System reports."""
    wl = Workload(requests=3, min_ctx=200, max_ctx=300, output_len=5, temperature=1.0)
    first = _eager_system(model, 0.5)
    first.run(replace(wl, seed=7, output_len=3))  # a different workload first
    again = first.run(wl)
    first.close()
    fresh = _eager_system(model, 0.5)
    alone = fresh.run(wl)
    fresh.close()
    for field in ("decode_steps", "generated_tokens", "effective_batch", "hit_rate"):
        assert getattr(again, field) == getattr(alone, field), field
    assert again.recalled_rows_per_step == alone.recalled_rows_per_step
    assert again.decode_steps == 5 * 2  # a wave of 2 (the max batch), then 1


def test_batch_cap() -> None:
    assert bench.batch_cap("offload", 200_000, 2048, 80_256, 64) == 64
    assert bench.batch_cap("offload", 110_000, 2048, 80_256, 64) == 53
    assert bench.batch_cap("gpu-only", 200_000, 2048, 80_256, 64) == 2
    assert bench.batch_cap("gpu-only", 325_000, 2048, 80_256, 64) == 4
    assert bench.batch_cap("gpu-only", 50_000, 2048, 80_256, 64) == 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--repeat", "1.5"], "--repeat"),
        (["--locality", "1"], "--locality must be in [0, 1)"),
        (["--systems", "offload,vllm"], "unknown system 'vllm'"),
        (["--gpu-pools", "256"], "cannot hold the longest request"),
        (["--rates", "2,-1"], "--rates must be positive"),
        (["--rate-pool", "999"], "--rate-pool 999 must be one of"),
        (["--eager-pools", "999"], "--eager-pools 999 must be among"),
        (["--requests", "0"], "--requests and --rate-requests must be at least 1"),
        (["--gpu-pools", "310"], "cannot hold the longest request"),  # 304 tokens: 5 pages > 4
        (["--prefetch-margin", "-1"], "prefetch_margin must be a finite number >= 0"),
        (["--prefetch-cap", "0"], "prefetch_cap must be a positive integer, got 0"),
        # bounded by the host pool, known once the workload is (before any model is built)
        (["--prefetch", "request", "--prefetch-cap", "10000000"], "cap must be at most host_tok"),
        (["--prefetch-ratio", "nan"], "prefetch_ratio must be in (0, 1] (staged rows per"),
        (["--async-scheduling", "yes"], "--async-scheduling: 'yes' is not off, on or off,on"),
        (["--async-scheduling", "on", "--dp", "2"], "async_scheduling needs dp = tp = ep = 1"),
        (["--rates", "nan"], "--rates must be positive"),  # (it spun forever)
        (["--rates", "1,x"], "--rates: '1,x' is not a comma-separated list of floats"),
        (["--gpu-pools", "704,x"], "--gpu-pools: '704,x' is not a comma-separated list of ints"),
        (["--device", "foo"], "--device 'foo':"),
        (["--min-ctx", "300", "--max-ctx", "200"], "--max-ctx 200 is below --min-ctx 300"),
        (["--min-ctx", "0"], "--min-ctx must be at least 1, got 0"),
        (["--output-len", "0"], "--output-len must be at least 1, got 0"),
        (["--max-batch", "0"], "--max-batch must be at least 1, got 0"),
        (["--tp", "0"], "tp must be a positive integer, got 0"),
        (["--workload", "sharegpt", "--output-len", "2"], "--output-len would be ignored"),
        (["--layers", "2"], "--preset tiny is fixed"),
        # every pool before any run (a bad second pool failed after every run at the first)
        (["--systems", "offload", "--gpu-pools", "704,0"], "a pool of 0 rows cannot hold"),
        (["--systems", "offload", "--gpu-pools", "704,16"], "a pool of 16 rows cannot hold"),
        (["--eager-pools", ""], "--eager-pools: give at least one pool size"),
        # (silently meant no breakdown / were ignored by a decode-only run)
        (["--breakdown-steps", "-3"], "--breakdown-steps must be at least 0, got -3"),
        (["--eager-prefill"], "--eager-prefill applies to --mode full only"),
        (["--prefill-first"], "--prefill-first applies to --mode full only"),
    ],
)
def test_bench_rejects_bad_arguments(extra, message, capsys, tmp_path) -> None:
    # (--out: a case that wrongly passed validation must not overwrite the committed results)
    argv = ARGS + ["--out", str(tmp_path / "x.json"), "--gpu-pools", "704"] + extra
    with pytest.raises(SystemExit):
        bench_cli.main(argv)
    assert message in capsys.readouterr().err


def test_bench_gpu_only_ignores_the_prefetch_cap(tmp_path) -> None:
    """gpu-only runs prefetch off, so a cap past the host pool (an error for the offloading
    systems) does not stop a gpu-only bench."""
    argv = ARGS + ["--gpu-pools", "704", "--systems", "gpu-only", "--rates", "", "--no-compile",
                   "--breakdown-steps", "0", "--prefetch", "request", "--prefetch-cap",
                   "10000000", "--out", str(tmp_path / "g.json")]  # fmt: skip
    assert bench_cli.main(argv) == 0


def test_bench_engine_rejects_bad_repeat(model) -> None:
    with pytest.raises(ValueError, match="repeat must be a probability"):
        _eager_system(model, -0.5)


def test_full_mode_prefills_instead_of_injecting(model) -> None:
    """--mode full: the engine runs prefill steps for the prompts and no KV is injected."""
    wl = Workload(requests=2, min_ctx=150, max_ctx=200, output_len=4)
    for prefill in (False, True):
        sut = _eager_system(model, 0.0)
        r = sut.run(replace(wl, prefill=prefill))
        eng = sut.engine
        assert r.mode == ("full" if prefill else "decode-only")
        assert (sut.inject_s > 0) == (not prefill)
        assert (eng.num_steps > eng.num_decode_steps) == prefill  # prefill chunks are steps
        # full: the first request decodes alone once, between its prefill and the second's
        assert r.generated_tokens == 8 and r.decode_steps == (5 if prefill else 4)
        sut.close()


def test_neither_system_caches_prefixes(model, monkeypatch) -> None:
    """A System runs the same prompts again (one seed): the second full run prefills them all
    again, offloading and GPU-only alike, whatever EngineConfig's default."""
    config = bench.EngineConfig
    monkeypatch.setattr(  # the engine's default turned on: the harness must still say off
        bench, "EngineConfig", lambda **kw: config(**{"enable_prefix_caching": True} | kw)
    )
    wl = Workload(requests=2, min_ctx=150, max_ctx=200, output_len=2, prefill=True)
    for system, pool in (("offload-eager", 256), ("gpu-only", 512)):
        sut = bench.System(model, system, pool, 4096, "fp8", 512, 2, (), "cpu", 0.0, seed=0)
        steps = []
        for _ in range(2):
            sut.run(wl)
            eng = sut.engine
            steps.append(eng.num_steps - eng.num_decode_steps)  # prefill chunks
        assert not sut.engine.config.enable_prefix_caching
        assert steps[0] == steps[1] > 0, (system, steps)
        sut.close()


@pytest.mark.parametrize("prefill_first", [False, True])
def test_full_mode_cli(tmp_path, prefill_first) -> None:
    out = tmp_path / "full.json"
    argv = ARGS + ["--mode", "full", "--gpu-pools", "384", "--rates", "", "--out", str(out)]
    argv += ["--systems", "offload-eager", "--eager-pools", "384", "--breakdown-steps", "0"]
    assert bench_cli.main(argv + (["--prefill-first"] if prefill_first else [])) == 0
    d = json.loads(out.read_text())
    assert d["workload"]["prefill"] is True
    assert [r["mode"] for r in d["results"]] == ["full"]
    assert d["compile_prefill"] is True  # the default: the serving path (offload-eager aside)
    assert d["decode_during_prefill"] is not prefill_first
    # 4 requests of 4 tokens: prefill first decodes all four together, 4 steps; with decodes
    # between the chunks the first three take turns while the others prefill
    assert d["results"][0]["decode_steps"] == (4 if prefill_first else 7)


def test_full_mode_compiles_prefill_unless_eager_prefill(model) -> None:
    """A compiled system of --mode full compiles its prefill chunks; decode-only does not."""
    for flag in (True, False):
        sut = bench.System(model, "gpu-only", 320, 320, "fp8", 320, 1, (), "cpu", 1.0,
                           compile=False, compile_prefill=flag)  # fmt: skip
        assert sut.engine.config.compile_prefill is flag
        sut.close()


def test_bench_prints_no_gpu_idle_time_it_did_not_measure(tmp_path, capsys) -> None:
    """A CPU run times no GPU idle gaps (decode_gpu_idle_gaps 0): the console says "-", not
    "0.00 ms", a measured zero."""
    out = tmp_path / "idle.json"
    argv = ARGS + ["--gpu-pools", "704", "--systems", "offload", "--rates", "", "--no-compile",
                   "--breakdown-steps", "0", "--out", str(out)]  # fmt: skip
    assert bench_cli.main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["decode_gpu_idle_gaps"] == 0
    assert "GPU idle -)" in capsys.readouterr().out


def test_breakdown_records_the_batch_it_profiled(model) -> None:
    """A host pool of 9 pages holds one of these requests with the breakdown's 9 tokens (5 pages
    each), not two: the profiled steps decode one row, and that is the batch recorded (it said
    2, the requests it added)."""
    wl = Workload(requests=2, min_ctx=300, max_ctx=300, output_len=3)
    sut = bench.System(model, "offload-eager", 256, 576, "fp8", 512, 2, (), "cpu", 0.0)
    assert bench.breakdown_tokens(2, 1) == 9
    bd = sut.breakdown(wl, warm_steps=1, steps=2)
    assert bd["batch"] == 1
    sut.close()


def test_bench_sizes_its_pools_for_a_breakdown_longer_than_the_output(tmp_path) -> None:
    """70 profiled steps (80 tokens a request) with --output-len 4: the host pool and context
    limit hold the breakdown's requests, all 4 at once (it failed after the runs, past the
    context limit of the 4-token workload)."""
    out = tmp_path / "long.json"
    argv = ARGS + ["--gpu-pools", "704", "--systems", "offload-eager", "--eager-pools", "704",
                   "--rates", "", "--breakdown-steps", "70", "--out", str(out)]  # fmt: skip
    assert bench_cli.main(argv) == 0
    d = json.loads(out.read_text())
    assert d["breakdown"]["704"]["batch"] == 4
    assert [r["generated_tokens"] for r in d["results"]] == [16]


def test_breakdown_of_a_compiled_system_runs_eagerly_and_leaves_it_as_it_was(model) -> None:
    """...unless ``graphs=True``: then its own compiled steps, no module hooked (a hook would
    recompile the frozen step, which raises)."""
    wl = Workload(requests=1, min_ctx=200, max_ctx=200, output_len=3)
    sut = bench.System(model, "gpu-only", 320, 320, "fp8", 320, 1, (), "cpu", 1.0)
    bd = sut.breakdown(wl, warm_steps=1, steps=2)
    assert bd["total_ms"] > 0 and bd["batch"] == 1
    assert sut.engine.num_steps == 0  # profiled on an eager engine of its own
    r = sut.run(wl)  # the frozen compiled step again: a recompile would raise
    assert r.generated_tokens == 3
    steps = sut.engine.num_steps
    g = sut.breakdown(wl, warm_steps=1, steps=2, graphs=True)  # its own compiled steps
    assert g["graphs"] and not bd["graphs"] and sut.engine.num_steps > steps
    assert g["total_ms"] > 0 and g["wall_ms"] > 0 and g["topk_overlap"] is None
    # no module hooked: the dense MLP's time is a region's only
    assert g["ms_per_step"]["dense mlp"] == 0 < bd["ms_per_step"]["dense mlp"]
    sut.close()


def test_reports_render_the_committed_results(tmp_path, capsys) -> None:
    """benchmarks/plot_results.py and e2e_summary.py run on the committed H200 files (what the
    docs' figures and tables are made from)."""
    from benchmarks import e2e_summary, plot_results

    assert plot_results.main(["--out", str(tmp_path)]) == 0
    figs = {p.name for p in tmp_path.glob("*.png")}
    assert {"e2e_throughput.png", "e2e_rate_sweep.png", "e2e_breakdown.png"} <= figs
    assert {"step_breakdown.png", "decode_kernels.png", "cache_ops.png", "awq_vs_bf16.png"} <= figs
    capsys.readouterr()
    assert e2e_summary.main([]) == 0
    text = capsys.readouterr().out
    assert "| 200,000 | 8.60x | 10.42x | 2.36x |" in text  # the report's ratio row, recomputed
    # the decode-step table: one row per bench_step file (one batch size each), in batch order
    at = [text.index(f"| {b} | {ms} ms |") for b, ms in ((1, "4.45"), (16, "6.60"), (64, "10.34"))]
    assert at == sorted(at)


def test_reports_and_the_profiler_agree_on_the_categories() -> None:
    from benchmarks.report_data import BREAKDOWN_CATEGORIES

    assert BREAKDOWN_CATEGORIES == CATEGORIES


ROOT = Path(__file__).resolve().parents[1]


def _code_lines(files):
    for f in files:
        for line in f.read_text().splitlines():
            yield f.relative_to(ROOT), line.strip()


def test_benchmarks_run_as_modules_without_sys_path_edits() -> None:
    bad = [(f, ln) for f, ln in _code_lines(ROOT.glob("benchmarks/**/*.py")) if "sys.path" in ln]
    assert not bad, bad


def test_the_product_never_imports_the_harness_or_matplotlib() -> None:
    """matplotlib is the bench extra's; the harness is imported only by the bench command."""
    files = [f for pkg in ("custom_ops", "model", "runtime", "echo_compile") for f in
             (ROOT / pkg).rglob("*.py") if "bench" not in f.relative_to(ROOT).parts]  # fmt: skip
    bad = []
    for f, ln in _code_lines(files):
        if re.match(r"(from|import) matplotlib", ln):
            bad.append((f, ln))
        if re.match(r"(from|import) echo_compile\.bench", ln) and f != Path("echo_compile/cli.py"):
            bad.append((f, ln))
    assert not bad, bad


@pytest.mark.parametrize("extra, want", [
    ([], (4, 200, 300, 4)),  # the tiny preset's own sizes (a minute on two cores)
    (["--requests", "6", "--max-ctx", "500"], (6, 200, 500, 4)),  # flags given win
])  # fmt: skip
def test_the_tiny_preset_defaults_to_a_dry_run_size(extra, want, monkeypatch, tmp_path) -> None:
    seen = []

    class Stop(Exception):
        pass

    def workload(requests, min_ctx, max_ctx, output_len, **kw):  # noqa: ANN001, ANN003
        seen.append((requests, min_ctx, max_ctx, output_len))
        raise Stop

    monkeypatch.setattr(bench_cli, "Workload", workload)
    with pytest.raises(Stop):
        bench_cli.main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), *extra])
    assert seen == [want]


def test_every_decode_op_has_a_category() -> None:
    """Every registered ``echo::`` op is charged to its category by name, except the linears
    (projections: "other") and the prefill-only ops (echo::recall_staged, prefetch's recall, was
    "other")."""
    import torch

    import custom_ops  # noqa: F401  (registers the ops)
    from echo_compile.bench.breakdown import _OPS

    ops = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("echo::")}
    linears = {"echo::fp8_linear", "echo::dg_fp8_linear", "echo::w4a16_linear",
               "echo::w4a16_linear_p"}  # fmt: skip
    prefill = {"echo::prefill_indexer_topk", "echo::prefill_indexer_topk_gather",
               "echo::sparse_mla_prefill", "echo::dg_prefill_logits"}  # fmt: skip
    assert ops - set(_OPS) == linears | prefill
    assert set(_OPS) <= ops  # no stale name
    assert _OPS["echo::recall_staged"] == "cache management"


def _triton_kernels() -> list[tuple[str, str]]:
    """(file, name) of every ``@triton.jit`` function of custom_ops named ``*_kernel`` (the
    launched kernels, the names a profile shows)."""
    import ast

    out = []
    for path in sorted(Path("custom_ops").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                decos = [ast.unparse(d) for d in node.decorator_list]
                if any(d.startswith(("triton.jit", "jit")) for d in decos):
                    out.append((path.name, node.name))
    return out


def test_cache_kernel_names_are_every_cache_kernel_and_no_other() -> None:
    """A graph replay's cache management is found by kernel name: every kernel of the cache
    modules is named (the staged recall launches the recall's alone), and no other kernel shares
    a name."""
    from echo_compile.bench.breakdown import cache_kernel_names

    names = cache_kernel_names()
    kernels = _triton_kernels()
    assert len(kernels) > 30  # the scan found the project's kernels
    cache_files = {"cache_fused_kernels.py", "cache_list_kernels.py", "cache_pool_kernels.py",
                   "cache_release_kernels.py"}
    assert {n for f, n in kernels if f in cache_files} == names
    for name in names:  # defined once in the project: an indexer kernel is never charged
        assert [f for f, n in kernels if n == name] in [[f] for f in cache_files], name


def test_tally_charges_a_graph_replay_s_cache_kernels_once() -> None:
    """A profile of compiled steps: the graph launch (no op) claims its kernels, so its cache
    kernels move from other to cache management; a cache op run eagerly beside it (a release)
    keeps its own charge, counted once (it was counted twice); an unclaimed cache kernel is
    cache management too."""
    from types import SimpleNamespace as NS

    import torch

    from echo_compile.bench.breakdown import _tally

    cpu, dev = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def op(name, kernels):
        ks = [NS(name=n, duration=d) for n, d in kernels]
        return NS(name=name, device_type=cpu, cpu_parent=None, kernels=ks, cpu_time_total=1.0,
                  self_device_time_total=sum(d for _, d in kernels))  # fmt: skip

    def kernel(name, us):
        return NS(name=name, device_type=dev, is_user_annotation=False,
                  time_range=NS(elapsed_us=lambda: us))  # fmt: skip

    events = [
        op("cudaGraphLaunch", [("_recall_kernel", 30.0), ("gemm", 100.0)]),
        op("echo::release", [("_release_kernel", 10.0)]),
        kernel("_recall_kernel", 30.0), kernel("gemm", 100.0), kernel("_release_kernel", 10.0),
        kernel("_offload_kernel", 5.0),  # no op claimed it
    ]  # fmt: skip
    us, by_name, kernels, _ = _tally(events, True, frozenset(
        {"_recall_kernel", "_release_kernel", "_offload_kernel"}))  # fmt: skip
    assert us["cache management"] == 45.0 and us["other"] == 100.0
    assert sum(us.values()) == sum(kernels.values()) == 145.0
    us, _, _, _ = _tally(events, True)  # no names (an eager profile): the graph is other
    assert us["cache management"] == 10.0 and us["other"] == 135.0


@pytest.mark.cuda
def test_graph_breakdown_charges_the_cache_kernels() -> None:
    """On the GPU a compiled offload system's own graph replays charge the cache ops' kernels to
    cache management, by name (no op claims a kernel inside a graph), and the rest to other."""
    from echo_compile.bench.breakdown import cache_kernel_names

    model = build_model("tiny", 0, 0, "cuda")
    wl = Workload(requests=2, min_ctx=200, max_ctx=200, output_len=3)
    sut = bench.System(model, "offload", 320, 4096, "fp8", 1024, 2, (), "cuda", 1.0)
    sut.run(wl)
    g = sut.breakdown(wl, warm_steps=1, steps=2, graphs=True)
    ms = g["ms_per_step"]
    named = sum(v for n, v in g["top_kernels"].items() if n in cache_kernel_names())
    assert ms["cache management"] >= named > 0, ms  # (top_kernels: the 24 longest)
    assert ms["other"] > 0 and math.isclose(sum(ms.values()), g["total_ms"])
    assert ms["cache management"] + ms["other"] == pytest.approx(g["total_ms"])
    sut.close()
