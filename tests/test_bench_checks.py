"""The correctness logic of four H200 benchmarks, on CPU: the sampling contract check of
benchmarks/bench_sampling_backends.py, the selections of benchmarks/bench_prefill_overlap.py and
the dry runs of benchmarks/bench_prefill_gather.py and benchmarks/bench_prefix_cache.py; and
where benchmarks/bench_dynamic_decode.py writes."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_dynamic_decode as dynamic
from benchmarks import bench_prefill as prefill
from benchmarks import bench_prefill_gather as gather
from benchmarks import bench_prefill_overlap as overlap
from benchmarks import bench_prefix_cache as prefix
from benchmarks import bench_sampling_backends as sampling


def test_sampling_contract_check_passes_ours_and_catches_row_dependence():
    assert sampling.placements(sampling.ours, [1, 4, 9], "cpu") == {
        "same_as_first": 1.0,
        "placements": 7,
    }

    def by_row(logits, r):  # what FlashInfer does: the row index enters the random stream
        r = dict(r)
        r["seeds"] = r["seeds"] + torch.arange(len(r["seeds"]))
        return sampling.ours(logits, r)

    assert sampling.placements(by_row, [1, 4, 9], "cpu")["same_as_first"] < 1.0


def test_overlap_selections_are_what_their_names_say():
    gen = torch.Generator().manual_seed(0)
    T, K, L = 8, 16, 256
    sel = {k: overlap.selections(k, T, K, L, gen) for k in ("shared", "sliding", "independent")}
    for s in sel.values():  # ascending distinct positions in range, as the kernel takes them
        assert s.shape == (T, K) and s.dtype == torch.int32
        assert (s.diff(dim=1) > 0).all() and int(s.min()) >= 0 and int(s.max()) < L
    assert (sel["shared"] == sel["shared"][0]).all()
    assert torch.equal(sel["sliding"][1:, :-1], sel["sliding"][:-1, 1:])  # shifted by one row
    assert not (sel["independent"] == sel["independent"][0]).all()


def test_prefill_gather_dry_run_checks_the_op_and_records_every_part(tmp_path):
    out = tmp_path / "g.json"
    assert gather.main(["--dry-run", "--copy-progs", "4", "--out", str(out)]) == 0
    (size,) = json.loads(out.read_text())["sizes"]
    assert size["check"] is True and size["blocks"] >= 3
    assert 0 < size["rows_late"] < size["rows_selected"] <= size["ctx"]
    assert set(size["ms"]) == {"indexer", "buffer_read", "dense_host", "gather_after",
                               "copy_all", "copy_late", "gather_fused[4]"}  # fmt: skip


def test_prefix_cache_dry_run_serves_the_same_tokens_with_fewer_computed(tmp_path):
    out = tmp_path / "p.json"
    assert prefix.main(["--dry-run", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    off, on = res["runs"]
    assert res["same_tokens"] is True
    assert off["prompt_tokens_computed"] == off["prompt_tokens"] == on["prompt_tokens"]
    assert on["prompt_tokens_computed"] < on["prompt_tokens"] and on["prefix_cache_hit_rate"] > 0
    # the prompts again one at a time: equal tokens, their documents from the cache when on
    assert res["same_tokens_sequential"] is True
    assert on["prompt_tokens_computed_sequential"] < off["prompt_tokens_computed_sequential"]


def test_prefill_bench_dry_run_checks_pass_and_times_the_path_without_the_buffer(tmp_path):
    """bench_prefill at toy sizes on the interpreter: every kernel check PASS (a check that
    cannot run at the small sizes failed here once), the path without the prefill buffer timed,
    its logits equal to the buffered path's, and no section failed."""
    out = tmp_path / "p.json"
    # (no time budget: on a loaded 2-core machine the checks took past the default 150 s, and
    # every timing was skipped)
    assert prefill.main(["--dry-run", "--budget-s", "1e9", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["status"] == "done" and "errors" not in res, res.get("errors")
    bad = {k: v for k, v in res["correctness"].items()
           if isinstance(v, str) and v != "PASS" and not v.startswith("skipped")}  # fmt: skip
    assert not bad, bad
    assert all(res["no_buffer_logits_equal"].values())
    assert any(t["path"] == "sparse_no_buffer" and t["ttft_s"] > 0 for t in res["ttft"])


def test_dynamic_decode_speed_keeps_the_cpu_study_file(monkeypatch):
    """``--speed`` without ``--out`` writes a file of its own, not the CPU study's
    (results/dynamic_decode_cpu.json, which its default overwrote); given ``--out``, that."""
    import subprocess

    written = []
    done = subprocess.CompletedProcess([], 0, stdout='{"mode": "m"}\n', stderr="")
    monkeypatch.setattr(dynamic.subprocess, "run", lambda *a, **k: done)
    monkeypatch.setattr(dynamic, "_write", lambda out, res: written.append(str(out)))
    dynamic.main(["--speed"])
    assert len(set(written)) == 1  # (after each mode)
    assert written[0].endswith(".json") and "dynamic_decode_cpu" not in written[0]
    written.clear()
    dynamic.main(["--speed", "--out", "x.json"])
    assert set(written) == {"x.json"}


@pytest.mark.parametrize("backend", ["inductor_no_graphs", "aot_eager"])
def test_dynamic_decode_speed_refuses_another_backend(monkeypatch, capsys, backend):
    """``--speed`` times the engine's own compile: given ``--backend`` (``inductor_no_graphs``
    to time the step without CUDA graphs) it ran Inductor with CUDA graphs and said nothing; now
    it is an error naming the flag, before any engine runs."""
    monkeypatch.setattr(dynamic.subprocess, "run", lambda *a, **k: pytest.fail("ran a mode"))
    with pytest.raises(SystemExit):
        dynamic.main(["--speed", "--backend", backend])
    assert f"--backend {backend}: --speed times the engine's own compile" in capsys.readouterr().err


def test_dynamic_decode_compare_names_the_first_step_whose_tokens_differ():
    """Logits that differ by rounding until one request's argmax flips: that request's later rows
    (decoded from other tokens) are left out of the same-input diff, while the other request of
    its batch and a later request (started from the same prompt in both runs) are counted; the
    diff was taken only up to the first flip, over every row."""
    t = torch.tensor
    a = {"logits": [t([[1.0, 2.0]]), t([[2.0, 1.9]]), t([[0.0, 1.0], [1.0, 2.0]]),
                    t([[5.0, 1.0], [2.0, 1.0]])],
         "requests": [["r1"], ["r1"], ["r1", "r2"], ["r2", "r3"]]}  # fmt: skip
    b = {"logits": [t([[1.0, 2.25]]), t([[2.0, 2.1]]), t([[0.0, 9.0], [1.0, 2.5]]),
                    t([[5.0, 1.5], [2.0, 1.0]])],
         "requests": a["requests"]}  # fmt: skip
    r = dynamic._compare(a, b)
    assert r["equal_steps"] == 0
    assert (r["first_divergent_step"], r["diverged_requests"]) == (1, 1)
    assert r["max_abs_diff_same_inputs"] == 0.5  # r2's, not r1's 8.0 after its flip
    assert r["max_abs_diff_by_step"] == [0.25, 0.2, 8.0, 0.5]
    same = dynamic._compare(a, a)
    assert (same["first_divergent_step"], same["diverged_requests"]) == (None, 0)


def test_dynamic_decode_compare_refuses_runs_that_scheduled_differently():
    """Rows are compared as the same requests' logits, so the two runs must have scheduled alike:
    another request order at a step, or another step count, is named, not compared."""
    t = torch.tensor
    a = {"logits": [t([[1.0, 2.0]]), t([[0.0, 1.0], [1.0, 2.0]])],
         "requests": [["r1"], ["r1", "r2"]]}  # fmt: skip
    swapped = {"logits": a["logits"], "requests": [["r1"], ["r2", "r1"]]}
    with pytest.raises(ValueError, match=r"decode step 1 ran requests \['r1', 'r2'\]"):
        dynamic._compare(a, swapped)
    longer = {"logits": a["logits"] + [t([[1.0, 2.0]])], "requests": a["requests"] + [["r2"]]}
    with pytest.raises(ValueError, match="2 decode steps in one and 3 in the other"):
        dynamic._compare(a, longer)


def test_dynamic_decode_pairs_keep_their_results_when_one_pair_cannot_be_compared():
    """One mode that scheduled differently costs only its pairs: the others are still compared
    (the JSON is written with the error in place of that pair's figures)."""
    t = torch.tensor
    a = {"logits": [t([[1.0, 2.0]]), t([[0.0, 1.0], [1.0, 2.0]])],
         "requests": [["r1"], ["r1", "r2"]]}  # fmt: skip
    swapped = {"logits": a["logits"], "requests": [["r1"], ["r2", "r1"]]}
    out = dynamic.compare_pairs({"dynamic": a, "static": a, "eager": swapped})
    assert out["dynamic_vs_static"]["equal_steps"] == 2
    assert "scheduled differently" in out["dynamic_vs_eager"]["error"]
    assert "scheduled differently" in out["static_vs_eager"]["error"]
    assert list(dynamic.compare_pairs({"dynamic": a, "eager": a})) == ["dynamic_vs_eager"]
