"""``LLM.generate`` over a batch (tiny checkpoint, CPU): a bad prompt is an error naming its
index, and nothing of the call stays queued."""

from __future__ import annotations

from typing import Any

import pytest

from echo_compile.llm import LLM
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.aten_gemm  # CPU GEMMs without oneDNN (conftest.py)

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        "tiny", device="cpu", compile=False, offload=True, max_batch=8, host_tokens=64 * 64,
        gpu_tokens=8 * 32, max_model_len=1024, progress=False,
    )  # fmt: skip


def assert_nothing_queued(llm: LLM) -> None:
    assert not llm.engine.requests and not llm.engine.has_unfinished() and not llm._outputs


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ([], ValueError, "prompt 2: the prompt is empty"),
        ([5] * 1100, ValueError, r"prompt 2: prompt \(1100 tokens\) \+ max_tokens \(3\) = 1103"),
        ([5, 10**7], ValueError, r"prompt 2: prompt token ids must be in \[0, 512\)"),
        (5, TypeError, "prompt 2: a prompt must be a string or a list of token ids, got int"),
        (bytearray(b"Ho"), TypeError, "prompt 2: a prompt must be a string or a list"),
    ],
    ids=["empty", "over-context", "bad-id", "int", "bytearray"],
)
def test_generate_names_the_bad_prompt_and_queues_nothing(
    llm: LLM, bad: Any, error: type[Exception], message: str
) -> None:
    """A bad prompt of a batch is an error naming its index (it named the problem only), the
    prompts before it, already queued, are taken back, and the next call returns its own
    outputs only, those of a call that followed no error."""
    good = ["Hi", [5, 6, 7]]
    want = [r.token_ids for r in llm.generate(good, PARAMS)]
    with pytest.raises(error, match=message):
        llm.generate([*good, bad, "Ho"], PARAMS)
    assert_nothing_queued(llm)
    got = llm.generate(good, PARAMS)
    assert [r.token_ids for r in got] == want
    assert [len(r.prompt_token_ids) for r in got] == [len(llm.tokenizer.encode("Hi")), 3]
    assert_nothing_queued(llm)
