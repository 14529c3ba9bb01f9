"""The ranks of a dp/tp/ep job agree on the KV sizes each chose from its own memory
(runtime/distributed/size_agreement.py, runtime/kv_sizing.py): two gloo processes on the CPU,
each made to see other memory, as the single-rank sizing tests pretend to be on CUDA."""

from __future__ import annotations

import pytest
import torch
from distributed_workers import kv_sizing_worker

from runtime.distributed.process import spawn

# rank 0: a large host, a small GPU (it limits gpu_tokens); rank 1: a small host (it limits the
# context and the host pool), a large GPU. Host GiB, GPU total GiB
MEMORY = [(1024.0, 10.0), (0.5, 80.0)]
# the LLM's ranks' own (max_model_len, host_tokens, gpu_tokens)
LOWERED = [(512, 2048, 256), (1024, 1024, 512)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sizes")
    spawn(kv_sizing_worker, 2, str(out), MEMORY, LOWERED)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_every_rank_takes_the_least_of_each_automatic_size(ranks):
    own = [r["own"] for r in ranks]
    least = [min(a, b) for a, b in zip(*own)]
    # each rank alone would run another configuration, each limiting some size
    assert own[0] != least and own[1] != least, own
    assert [r["agreed"] for r in ranks] == [least, least]


def test_a_rank_whose_own_size_was_more_says_which_rank_limited_it(ranks):
    # (rank 1 also warns that its host lowered the model's context)
    (line0,), (line1,) = ([x for x in r["lines"] if x.startswith("KV sizing")] for r in ranks)
    l_max, l_host, l_gpu = ranks[0]["agreed"]
    (o_max, o_host, _), (_, _, o_gpu) = ranks[0]["own"], ranks[1]["own"]
    assert line0.startswith("KV sizing: max_model_len 163840")
    assert (
        f"; the least over the 2 ranks: max_model_len {l_max} (rank 1's; this rank's {o_max}), "
        f"host_tokens {l_host} (rank 1's; this rank's {o_host})" in line0
    ), line0
    assert f"; the least over the 2 ranks: gpu_tokens {l_gpu} (rank 0's; this rank's {o_gpu})" in (
        line1
    ), line1
    assert "max_model_len" not in line1.split("; the least")[1]


def test_a_given_context_one_rank_cannot_hold_stops_every_rank_with_its_error(ranks):
    assert ranks[1]["given"].startswith("--max-model-len 163840: one request needs")
    assert ranks[0]["given"] == "rank 1: " + ranks[1]["given"]


def test_an_llm_of_ranks_that_size_apart_is_built_with_the_agreed_sizes(ranks):
    """Without the agreement the ranks were refused at start-up as given other options (sizes
    that no one gave); with it both run the least sizes, and the context limit they admit by."""
    assert ranks[0]["llm"] == ranks[1]["llm"] == [512, 1024, 256, 512]
