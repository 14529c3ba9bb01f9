"""Decodes between prefill chunks (``decode_during_prefill``, the default): the requests past their
prefill decode a step between two chunks of a long prompt, so its prefill does not stall them;
prefill first (off) keeps them waiting until no request has prompt tokens left. A received prompt
KV is written, not computed: it takes no turn."""

from __future__ import annotations

from engine_records import random_prompts, run, tiny

from runtime.engine import EngineConfig
from runtime.request import Request
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.scheduler_config import SchedulerConfig

CHUNK = 64


def _scheduler(interleave: bool) -> Scheduler:
    cfg = SchedulerConfig(max_batch=4, max_model_len=1024, host_tokens=64 * 64, topk=32,
                          prefill_chunk=CHUNK, decode_during_prefill=interleave)  # fmt: skip
    return Scheduler(cfg)


def _kinds(s: Scheduler, steps: int) -> str:
    """Schedule ``steps`` steps, completing each batch as the engine would (a prefill chunk
    computes its tokens, a decode step adds one token); P / D per step."""
    out = ""
    for _ in range(steps):
        b = s.schedule()
        if b is None:
            break
        if b.is_decode:
            for r in b.requests:
                r.num_computed = r.num_tokens
                r.output_ids.append(7)
        else:
            b.requests[0].num_computed = b.chunk_end
        out += "D" if b.is_decode else "P"
    return out


def _add(s: Scheduler, rid: str, prompt_len: int) -> Request:
    r = Request(rid, [5] * prompt_len, SamplingParams(max_tokens=50))
    s.add(r)
    return r


def test_a_long_prompt_alternates_with_the_decodes_of_the_others() -> None:
    s = _scheduler(True)
    a = _add(s, "a", 2 * CHUNK + 1)  # two chunks, then decoding
    assert _kinds(s, 4) == "PPDD"  # alone: nothing to take turns with
    _add(s, "b", 4 * CHUNK + 1)  # four chunks, while a decodes
    assert _kinds(s, 9) == "PDPDPDPDD"
    # a token of a's after every chunk of b; b's first token in the step after its last chunk
    assert len(a.output_ids) == 2 + 5 and len(s.running[1].output_ids) == 2


def test_prefill_first_keeps_the_others_waiting() -> None:
    s = _scheduler(False)
    a = _add(s, "a", 2 * CHUNK + 1)
    assert _kinds(s, 4) == "PPDD"
    _add(s, "b", 4 * CHUNK + 1)
    assert _kinds(s, 6) == "PPPPDD"
    assert len(a.output_ids) == 2 + 2


def test_a_decode_batch_holds_only_the_requests_past_their_prefill() -> None:
    s = _scheduler(True)
    _add(s, "a", 2)  # one token of prefill: one chunk
    assert _kinds(s, 1) == "P"
    _add(s, "b", 3 * CHUNK)
    assert _kinds(s, 2) == "DP"  # a's turn, then b's first chunk
    batch = s.schedule()
    assert batch is not None and batch.is_decode
    assert [r.request_id for r in batch.requests] == ["a"]


def test_received_prompt_kv_takes_no_turn() -> None:
    """Every waiting load is written before the next decode step, as if it were instant."""
    s = _scheduler(True)
    _add(s, "a", 2 * CHUNK + 1)
    _kinds(s, 3)  # a decodes
    loads = [_add(s, f"k{i}", 3 * CHUNK) for i in range(2)]
    for r in loads:
        r.prompt_kv = object()  # (what the engine writes; the scheduler only looks at it)
    kinds = ""
    for _ in range(3):
        b = s.schedule()
        assert b is not None
        if not b.is_decode:
            assert b.requests[0].prompt_kv is not None
            b.requests[0].num_computed = b.requests[0].prefill_end  # written in one go
            b.requests[0].prompt_kv = None
        kinds += "D" if b.is_decode else "L"
    assert kinds == "LLD" and len(b.requests) == 3


def test_engine_decodes_between_the_chunks_of_a_long_prompt() -> None:
    """Through the real engine: a decoding request gets a token between every two chunks of a
    long prompt that arrives; both finish, every pool is left empty."""
    model, _ = tiny()
    cfg = EngineConfig(max_batch=2, host_tokens=64 * 16, gpu_tokens=2 * model.config.index_topk,
                       max_model_len=512, prefill_chunk=64)  # fmt: skip
    prompts = random_prompts([70, 64 * 5 + 1], model.config.vocab_size, seed=9)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 3)]
    eng, rec, out = run(cfg, prompts, params)
    assert [len(out["r0"]), len(out["r1"])] == [12, 3]
    kinds = "".join("D" if d else "P" for d, _, _ in rec.logits)
    # r0's two chunks, then its decodes alternate with r1's five chunks
    assert kinds.startswith("PP" + "DP" * 5), kinds
    eng.check_pools()
    assert eng.cache.stats()["gpu_pool_usage"] == 0.0
