"""Engine.add_request(..., prompt_kv=...): a prompt whose KV was computed by another engine's
prefill decodes exactly as if it had been prefilled here (the decode side of prefill/decode
disaggregation), and bad KV is rejected with an error naming the problem."""

from __future__ import annotations

import random

import pytest
import torch

from custom_ops.kv_format import INDEX_ROW_BYTES, ROW_BYTES
from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.prompt_kv import PromptKV
from runtime.sampling_params import SamplingParams

# 300 tokens: several pages, more than index_topk (32) so selection is sparse; 20: fewer than
# index_topk, so the selections carry -1 padding; 1: nothing to transfer at all
LENGTHS = (300, 20, 1)


@pytest.fixture(scope="module")
def model():
    return load_model(resolve_model("tiny"))[0]


def _engine(
    model, fmt: str = "bf16", offload: bool = True, max_batch: int = 3, device: str = "cpu"
) -> Engine:
    cfg = EngineConfig(
        max_batch=max_batch,
        host_tokens=64 * 24,
        gpu_tokens=max_batch * model.config.index_topk,
        kv_format=fmt,
        offload=offload,
        max_model_len=512,
        device=device,
        # prefill first: the local engine then decodes in the batches of the one that received
        # the KV (which prefills nothing), so their logprobs compare bit for bit
        decode_during_prefill=False,
    )
    return Engine(model, model.config, None, cfg)


def _prompts(model) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(2, model.config.vocab_size) for _ in range(n)] for n in LENGTHS]


PARAMS = (
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True),
    SamplingParams(max_tokens=6, temperature=0.8, seed=11, ignore_eos=True, logprobs=True),
    SamplingParams(max_tokens=6, temperature=1.0, top_k=5, seed=5, ignore_eos=True, logprobs=True),
)


def _run(engine: Engine) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks, lps = out.setdefault(o.request_id, ([], []))
            toks += o.new_token_ids
            lps += o.new_logprobs or []
    return out


def _prefill_elsewhere(model, fmt: str, prompts, device: str = "cpu") -> list[PromptKV]:
    """A prefill engine: prefill each prompt, then hand its KV over (max_tokens=1: it would
    decode one token; it is aborted once its prompt KV is taken)."""
    sender = _engine(model, fmt, offload=True, max_batch=1, device=device)
    kvs = []
    for i, p in enumerate(prompts):
        sender.add_request(f"p{i}", p, SamplingParams(max_tokens=1))
        while sender.requests[f"p{i}"].in_prefill:
            assert sender.step() == []  # prefill chunks sample nothing
        kvs.append(sender.prompt_kv(f"p{i}"))
        sender.abort_request(f"p{i}")
    return kvs


def check_received_kv_decodes_like_a_local_prefill(model, fmt, offload, device="cpu") -> None:
    prompts = _prompts(model)
    local = _engine(model, fmt, offload, device=device)
    for i, (p, sp) in enumerate(zip(prompts, PARAMS)):
        local.add_request(f"r{i}", p, sp)
    expected = _run(local)
    assert local.num_steps > local.num_decode_steps  # the local engine did prefill

    kvs = _prefill_elsewhere(model, fmt, prompts, device)
    assert [kv.num_tokens for kv in kvs] == [n - 1 for n in LENGTHS]
    decode = _engine(model, fmt, offload, device=device)
    for i, (p, sp, kv) in enumerate(zip(prompts, PARAMS, kvs)):
        decode.add_request(f"r{i}", p, sp, prompt_kv=kv)
    got = _run(decode)
    assert decode.num_steps == decode.num_decode_steps  # no prefill step ran
    assert got.keys() == expected.keys()
    for rid in expected:
        assert got[rid][0] == expected[rid][0], rid
        assert torch.equal(torch.tensor(got[rid][1]), torch.tensor(expected[rid][1])), rid


@pytest.mark.parametrize(("fmt", "offload"), [("bf16", True), ("fp8", False)])
def test_received_prompt_kv_decodes_like_a_local_prefill(model, fmt, offload) -> None:
    check_received_kv_decodes_like_a_local_prefill(model, fmt, offload)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_received_prompt_kv_decodes_like_a_local_prefill_cuda(fmt) -> None:
    """On the GPU: the host pool is pinned memory the kernels read directly (eager engines)."""
    model = load_model(resolve_model("tiny"), device="cuda")[0]
    check_received_kv_decodes_like_a_local_prefill(model, fmt, True, "cuda")


def test_the_received_rows_land_in_the_request_slots(model) -> None:
    """What prompt_kv() hands out after a receive is what was received (a round trip)."""
    prompt = _prompts(model)[0]
    (kv,) = _prefill_elsewhere(model, "fp8", [prompt])
    eng = _engine(model, "fp8")
    eng.add_request("r", prompt, SamplingParams(max_tokens=2), prompt_kv=kv)
    eng.step()  # admission writes the rows, then the first decode step runs
    back = eng.prompt_kv("r")
    for layer in range(kv.num_layers):
        assert torch.equal(back.kv_rows[layer], kv.kv_rows[layer])
        assert torch.equal(back.index_rows[layer], kv.index_rows[layer])


def _kv(layers: int, tokens: int, row: int = ROW_BYTES["bf16"]) -> PromptKV:
    return PromptKV(
        [torch.zeros(tokens, row, dtype=torch.uint8) for _ in range(layers)],
        [torch.zeros(tokens, INDEX_ROW_BYTES, dtype=torch.uint8) for _ in range(layers)],
    )


def test_bad_prompt_kv_is_rejected_with_its_problem(model) -> None:
    eng = _engine(model)
    layers, p = model.config.num_hidden_layers, [5] * 10
    params = SamplingParams(max_tokens=2)
    cases = [
        (_kv(layers - 1, 9), "has 3 layers, the model has 4"),
        (_kv(layers, 10), "needs the KV of all but its last token: 9"),
        (_kv(layers, 9, ROW_BYTES["fp8"]), "rows are 656 bytes, the cache's 'bf16' rows are 1152"),
        (object(), "prompt_kv must be a runtime.prompt_kv.PromptKV"),
    ]
    for kv, message in cases:
        with pytest.raises(ValueError, match=message):
            eng.add_request("bad", p, params, prompt_kv=kv)
        assert "bad" not in eng.requests
    cut = SamplingParams(max_tokens=2, truncate_prompt_tokens=6)
    with pytest.raises(ValueError, match="cut the prompt from 10 to 6 tokens, but prompt_kv"):
        eng.add_request("bad", p, cut, prompt_kv=_kv(layers, 9))
    assert "bad" not in eng.requests
    good = torch.zeros(9, ROW_BYTES["bf16"], dtype=torch.uint8)
    index = torch.zeros(9, INDEX_ROW_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"index_rows\[1\] must be uint8 \[9, 132\]"):
        PromptKV([good, good], [index, index[:, :128]])
    with pytest.raises(ValueError, match=r"kv_rows\[0\] must be a 2-D uint8 tensor"):
        PromptKV([good.float()], [index])
    with pytest.raises(ValueError, match="one entry per layer"):
        PromptKV([good, good], [index])


class _BadSource:
    """A generator that yields a chunk of the wrong width."""

    num_layers, num_tokens, row_bytes = 4, 9, ROW_BYTES["bf16"]

    def chunk(self, layer: int, start: int, end: int):
        return (
            torch.zeros(end - start, 100, dtype=torch.uint8),
            torch.zeros(end - start, INDEX_ROW_BYTES, dtype=torch.uint8),
        )


def test_a_bad_chunk_fails_its_request_only(model) -> None:
    eng = _engine(model)
    eng.add_request("bad", [5] * 10, SamplingParams(max_tokens=2), prompt_kv=_BadSource())
    with pytest.raises(ValueError, match=r"layer 0 \[0, 9\): kv rows must be uint8 \[9, 1152\]"):
        eng.step()
    assert "bad" not in eng.requests and not eng.has_unfinished()
    assert eng.scheduler.pages.num_free == eng.scheduler.pages.num_pages  # its pages came back


def test_prompt_kv_of_a_request_not_prefilled_is_refused(model) -> None:
    eng = _engine(model)
    with pytest.raises(ValueError, match="unknown request 'nope'"):
        eng.prompt_kv("nope")
    eng.add_request("r", [5] * 200, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="'r' is not prefilled yet"):  # queued, not admitted
        eng.prompt_kv("r")
    eng.abort_request("r")
    eng.add_request("one", [5], SamplingParams(max_tokens=2))  # one token: nothing to hand over
    assert eng.prompt_kv("one").num_tokens == 0


class _FailingSource(_BadSource):
    """A source whose chunk() raises something other than ValueError (a connector's I/O error)."""

    def chunk(self, layer: int, start: int, end: int):
        raise OSError("connection reset while reading the prompt KV")


def test_a_source_that_raises_fails_its_request_only(model) -> None:
    """Left queued, the request would have every later step retry its load and raise again: the
    engine served nothing else until it was aborted."""
    eng = _engine(model)
    eng.add_request("bad", [5] * 10, SamplingParams(max_tokens=2), prompt_kv=_FailingSource())
    eng.add_request("ok", [5] * 10, SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(OSError, match="connection reset"):
        eng.step()
    assert "bad" not in eng.requests
    assert len(_run(eng)["ok"][0]) == 2  # the next steps serve the other request
    assert eng.scheduler.pages.num_free == eng.scheduler.pages.num_pages  # its pages came back
