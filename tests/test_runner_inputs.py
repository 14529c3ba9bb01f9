"""The step inputs ModelRunner builds (decode_inputs / prefill_inputs), against a construction
written here from the Request's state alone: token ids, positions, output host slots, block
table, seq_lens and logits indices, padding included. An off-by-one in any of them (a decode
seq_len that excludes the newest token, say) changes what the indexer may select."""

from __future__ import annotations

import pytest
import torch

from runtime.model_runner import ModelRunner
from runtime.request import Request, Status
from runtime.sampling_params import SamplingParams

PAGE = 64  # tokens per host page (written out: this file must not reuse the runtime's math)
MAX_LEN = 400
P = -(-MAX_LEN // PAGE)


def _runner() -> ModelRunner:
    # the input builders touch neither the model nor the cache
    return ModelRunner(None, None, torch.device("cpu"), MAX_LEN, (1, 2, 4), (16, 32, 64, 128))


def _request(rid: str, n_prompt: int, n_out: int, pages: list[int], seed: int) -> Request:
    g = torch.Generator().manual_seed(seed)
    r = Request(rid, torch.randint(2, 500, (n_prompt,), generator=g).tolist(),
                SamplingParams(max_tokens=n_out + 10))  # fmt: skip
    r.output_ids = torch.randint(2, 500, (n_out,), generator=g).tolist()
    r.pages, r.status = list(pages), Status.RUNNING
    r.num_computed = n_prompt + n_out - 1
    return r


def _slot(pages: list[int], pos: int) -> int:
    return pages[pos // PAGE] * PAGE + pos % PAGE


def _expected_decode(reqs: list[Request], bucket: int) -> tuple[torch.Tensor, ...]:
    ids = [0] * bucket
    pos = [0] * bucket
    slots = [-1] * bucket
    lens = [0] * bucket
    bt = torch.zeros(bucket, P, dtype=torch.int32)
    for i, r in enumerate(reqs):
        tokens = r.prompt_ids + r.output_ids
        ids[i] = tokens[-1]  # the newest token: its KV is written this step
        pos[i] = len(tokens) - 1
        slots[i] = _slot(r.pages, len(tokens) - 1)
        lens[i] = len(tokens)  # it attends to itself too
        bt[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
    return (
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(pos, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int64),
        bt,
        torch.tensor(lens, dtype=torch.int32),
        torch.arange(bucket, dtype=torch.int64),
    )


NAMES = ("input_ids", "positions", "out_slots", "block_table", "seq_lens", "logits_indices")


def _assert_inputs(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(want) == len(NAMES)
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


def test_decode_inputs_match_an_independent_construction():
    runner = _runner()
    a = _request("a", 70, 3, [5, 2], 1)  # newest token at 72: the second page
    b = _request("b", 64, 0, [7, 0, 3], 2)  # newest token at 63: the last row of page 7
    c = _request("c", 1, 0, [4], 3)  # one token: seq_len 1
    d = _request("d", 129, 5, [1, 6, 8], 4)
    _assert_inputs(runner.decode_inputs([a, b, c], 4), _expected_decode([a, b, c], 4))
    # the per-bucket block table is cached by row owner: reordered, shrunk and grown batches,
    # and requests that generated a token meanwhile, must still see exactly their own rows
    a.output_ids.append(9)
    _assert_inputs(runner.decode_inputs([c, a], 4), _expected_decode([c, a], 4))
    _assert_inputs(runner.decode_inputs([d, c, b, a], 4), _expected_decode([d, c, b, a], 4))
    _assert_inputs(runner.decode_inputs([b], 1), _expected_decode([b], 1))
    _assert_inputs(runner.decode_inputs([b, d], 2), _expected_decode([b, d], 2))


@pytest.mark.parametrize("static_width", [False, True])
@pytest.mark.parametrize(
    ("start", "end", "bucket"), [(0, 16, 16), (0, 50, 64), (64, 127, 64), (128, 200, 128)]
)
def test_prefill_inputs_match_an_independent_construction(start, end, bucket, static_width):
    runner = _runner()
    runner.prefill_static_width = static_width
    r = _request("p", 200, 0, [3, 9, 1, 4], 5)
    n = end - start
    pad = bucket - n
    want = (
        torch.tensor(r.prompt_ids[start:end] + [0] * pad, dtype=torch.int64),
        # padding repeats the last position; its out_slot -1 writes nothing
        torch.tensor(list(range(start, end)) + [end - 1] * pad, dtype=torch.int64),
        torch.tensor([_slot(r.pages, p) for p in range(start, end)] + [-1] * pad),
        None,
        torch.tensor([end], dtype=torch.int32),  # the chunk sees every token up to its end
        torch.tensor([n - 1], dtype=torch.int64),  # logits of the chunk's last real token
    )
    width = P if static_width else -(-end // PAGE)
    bt = torch.zeros(1, P, dtype=torch.int32)
    bt[0, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
    want = want[:3] + (bt[:, :width].contiguous(),) + want[4:]
    _assert_inputs(runner.prefill_inputs(r, start, end, bucket), want)


def test_request_slots_match_slot_of():
    """Request.slots (vectorised) is slot_of for every token of the range, over random pages and
    ranges; a range outside the request's pages is an error naming it."""
    g = torch.Generator().manual_seed(4)
    for seed in range(20):
        pages = torch.randperm(500, generator=g)[: 1 + seed].tolist()
        r = _request(f"r{seed}", 5, 1, pages, seed)
        n = len(pages) * 64
        start = int(torch.randint(0, n + 1, (1,), generator=g))
        end = int(torch.randint(start, n + 1, (1,), generator=g))
        got = r.slots(start, end)
        assert got.dtype == torch.int64
        assert got.tolist() == [r.slot_of(p) for p in range(start, end)]
    assert r.slots(n, n).tolist() == [] and r.slots(64, 64).tolist() == []
    with pytest.raises(ValueError, match=r"r19: tokens \[0, 1281\) outside its 1280 slots"):
        r.slots(0, n + 1)
