"""A start-up error on one rank of a two-process gloo job (docs/multi_gpu.md, "Process model"):
every rank exits with that error, named with the failing rank, within seconds; none waits in a
collective or the join. Each job runs under a deadline: a rank still running is killed and the
test fails ("hung"), it does not block the suite (``run_bounded``)."""

from __future__ import annotations

import shutil

import torch
from distributed_workers import cli_generate_worker, run_bounded, sizing_error_worker


def _tiny_copy(tmp_path):
    from model.checkpoint import resolve_model

    path = tmp_path / "ckpt"
    shutil.copytree(resolve_model("tiny"), path)
    return path


def _codes(tmp_path) -> list[str]:
    return [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]


def test_a_shard_unreadable_on_one_rank_stops_every_rank_naming_it(tmp_path, capfd):
    """Rank 1's copy of the checkpoint has a truncated shard (a bad copy on one host): its
    fingerprint (config, shard listing) is rank 0's, so the ranks build, and the load fails on
    rank 1 alone. Every rank returns 2 with rank 1's error (rank 0 ran on to its first request
    and failed there with a RankFailure naming no cause, a traceback and no exit code)."""
    other = _tiny_copy(tmp_path)
    shard = other / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    run_bounded(cli_generate_worker, str(tmp_path), (), ((), ("--model", str(other))))
    assert _codes(tmp_path) == ["2 False"] * 2
    err = capfd.readouterr().err
    assert err.count("not a readable safetensors file") == 2, err
    assert err.count("echo-compile: error: rank 1: ") == 1, err  # rank 0's line names rank 1


def test_an_option_only_one_rank_is_given_stops_every_rank_naming_it(tmp_path, capfd):
    """Rank 1 alone given ``--fp8-weights fp8`` for the (bf16) tiny checkpoint: its option was
    resolved, and refused, before the join, on rank 1 alone, and rank 0 waited in the join until
    the collective timeout (60 s here). Now every rank names the option that differs, and
    returns 2."""
    run_bounded(cli_generate_worker, str(tmp_path), (), ((), ("--fp8-weights", "fp8")))
    assert _codes(tmp_path) == ["2 False"] * 2
    err = capfd.readouterr().err
    assert err.count("fp8_weights: rank 0 has 'auto', rank 1 has 'fp8'") == 2, err


def test_a_checkpoint_missing_on_one_rank_stops_every_rank_naming_it(tmp_path, capfd):
    """Rank 1's ``--model`` directory does not exist (not mounted on its host): it was read
    before the join, on rank 1 alone, and rank 0 waited in the join until the collective
    timeout. Now every rank returns 2 with rank 1's error."""
    missing = tmp_path / "not-mounted"
    run_bounded(cli_generate_worker, str(tmp_path), (), ((), ("--model", str(missing))))
    assert _codes(tmp_path) == ["2 False"] * 2
    err = capfd.readouterr().err
    assert err.count(str(missing)) == 2, err
    assert err.count("echo-compile: error: rank 1: ") == 1, err


def test_a_sizing_that_fails_on_one_rank_stops_every_rank_naming_its_error(tmp_path):
    """Rank 1's own KV sizing raises (an OSError, a RuntimeError: not only a ValueError): only a
    ValueError was passed into the ranks' size agreement, so rank 1 raised alone and rank 0 got
    a RankFailure naming no cause at the agreement. Now rank 1 raises its own error and rank 0
    that error, named with rank 1 (``rank_errors``' rule: an OSError a ValueError, anything
    else a RankFailure), and the group is still up for the next collective."""
    run_bounded(sizing_error_worker, str(tmp_path), False)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r1["OSError"] == ("OSError", "cannot read /proc/meminfo")
    assert r0["OSError"] == ("ValueError", "rank 1: OSError: cannot read /proc/meminfo")
    assert r1["RuntimeError"] == ("RuntimeError", "CUDA driver error")
    assert r0["RuntimeError"] == (
        "RankFailure",
        "rank 1/2: the KV sizing failed: RuntimeError: CUDA driver error",
    )
    assert r0["after"] == r1["after"] == (4096, 16384, 1024)  # (the CPU's sizes)


def test_a_sizing_oserror_on_one_rank_is_every_ranks_exit_2_naming_it(tmp_path, capfd):
    """``echo-compile generate --dp 2 --tp 2`` whose rank 1 cannot read its memory (an OSError
    from its sizing): every rank returns 2 (the CLI's code for a user's error), rank 0's line
    naming rank 1 and the error's type."""
    run_bounded(sizing_error_worker, str(tmp_path), True)
    assert _codes(tmp_path) == ["2 False"] * 2
    err = capfd.readouterr().err
    assert err.count("cannot read /proc/meminfo") == 2, err
    assert err.count("echo-compile: error: rank 1: OSError: cannot read /proc/meminfo") == 1, err
