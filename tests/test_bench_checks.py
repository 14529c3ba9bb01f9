"""The correctness logic of two H200 benchmarks, on CPU: the sampling contract check of
benchmarks/bench_sampling_backends.py and the selections of benchmarks/bench_prefill_overlap.py."""

from __future__ import annotations

import torch

from benchmarks import bench_prefill_overlap as overlap
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
