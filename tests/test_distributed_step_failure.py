"""A step that raises on one rank of a two-process gloo job (docs/multi_gpu.md, "Process
model"): every rank stops with that rank's error, named ``rank 1: <type>: <message>`` on the
others (``runtime/distributed/failure_note.py``), offline and under the serve driver, whose
``failure`` (the server's error line and log) names it too. Before, the other ranks' error said
only that "another rank failed". Each job runs under a deadline (``run_bounded``): a rank still
running is killed and the test fails as a hang."""

from __future__ import annotations

import pytest
from distributed_workers import run_bounded, step_raise_worker
from engine_records import random_prompts

OPTS = dict(max_batch=4, host_tokens=64 * 16, max_model_len=256, prefill_chunk=64, dp=2, tp=2)
RAISED = "RuntimeError: injected step failure: bad tensor on rank 1"


def _errors(tmp_path) -> list[list[str]]:
    return [(tmp_path / f"rank{r}.txt").read_text().split("\n") for r in range(2)]


@pytest.mark.parametrize("where", ["schedule", "model"])
def test_a_step_raising_on_one_rank_names_it_on_every_rank(tmp_path, where):
    """``schedule``: rank 1 raises before the step agreement, where rank 0 waits; ``model``: in
    its decode forward, while rank 0 is inside the model's collectives."""
    prompts = random_prompts([30, 30], 512, seed=5)
    run_bounded(step_raise_worker, str(tmp_path), OPTS, prompts, where)
    (zero,), (one,) = _errors(tmp_path)
    assert one == RAISED  # the failing rank: its own error, as it is
    assert zero.startswith(f"RankFailure: rank 1: {RAISED} (raised in its step; rank 0/2 stops:")
    assert "another rank failed" not in zero, zero


def test_a_followers_step_raising_is_named_in_the_drivers_failure(tmp_path):
    """Under ``serve``: rank 1's step raises while rank 0 drives; rank 0's step error and the
    driver's ``failure`` (what serve prints and the failed requests carry) name rank 1's error."""
    prompts = random_prompts([30, 30], 512, seed=5)
    run_bounded(step_raise_worker, str(tmp_path), OPTS, prompts, "model", True)
    (zero, failure), (one,) = _errors(tmp_path)
    assert one == RAISED
    assert zero.startswith(f"RankFailure: rank 1: {RAISED} (raised in its step;"), zero
    assert failure == f"the multi-rank engine stopped: {zero}"


def test_an_add_failing_on_one_rank_is_refused_on_every_rank_naming_it(tmp_path):
    """Rank 1's placement of a request raises (before the add's first gather): every rank
    refuses the request with rank 1's error, and the ranks go on together (it raised on rank 1
    alone, which met rank 0's load exchange with its next request's broadcast)."""
    from distributed_workers import add_raise_worker

    prompts = random_prompts([30, 30, 30], 512, seed=5)
    run_bounded(add_raise_worker, str(tmp_path), OPTS, prompts)
    want = "ValueError: rank 1: RuntimeError: injected placement failure on rank 1"
    assert _errors(tmp_path) == [[want, "r0 r1"]] * 2


def test_a_new_job_does_not_name_an_earlier_jobs_failure(monkeypatch):
    """A store can outlive a job (torchrun's agent store lasts the whole attempt; a store the
    process still holds is re-joined on the same port), and a new job read the earlier job's
    note: a later collective failure named a step error of another job. Rank 0 clears the note
    as it creates the group. (In one process, the job's store given the earlier note: a
    two-job run in spawned ranks re-joining one port was timing-dependent.)"""
    import torch.distributed as dist

    from runtime.distributed import process
    from runtime.distributed.failure_note import leave_note, read_note
    from runtime.distributed.process import DistContext

    store = dist.HashStore()
    zero, one = (DistContext(r, 2, r, "cpu", "gloo", "0", None, 10.0, store) for r in (0, 1))
    leave_note(one, RuntimeError("the first job's step failure"), "its step")
    assert read_note(zero, 0.1) is not None  # the earlier job's note, still in the store
    monkeypatch.setattr(process, "job_store", lambda: store)
    # (set, not deleted: the join's own setdefaults would outlive the test otherwise)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(process.free_port())}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    process.init_distributed("cpu", timeout_s=20.0)  # a new job (of one rank: rank 0)
    try:
        assert read_note(zero, 0.1) is None
    finally:
        process.shutdown()
