"""vLLM's ``stop_reason`` for a choice that ended on a token id (tiny checkpoint, CPU), offline
``generate()`` and served (openai client): one rule, ``RequestOutput.stop_reason``.

vLLM tells the tokenizer's EOS from the checkpoint's other EOS ids. Its scheduler's
``check_stop`` (vllm/v1/core/sched/utils.py) checks the tokenizer's EOS first, with no
stop_reason, unless ``ignore_eos``; then ``stop_token_ids``, with the id as stop_reason. And
``SamplingParams.update_from_generation_config`` (vllm/sampling_params.py) folds
generation_config.json's other EOS ids into the request's ``stop_token_ids`` (unless
``ignore_eos``). So: the tokenizer's EOS is None even when ``stop_token_ids`` names it, and
another EOS id is its id. Each case forces its token with ``logit_bias``: it is the first one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_utils import running_server

from echo_compile.llm import LLM
from model.checkpoint import resolve_model
from runtime.async_engine import AsyncEngine
from runtime.sampling_params import SamplingParams
from runtime.server import build_app

pytestmark = pytest.mark.aten_gemm  # CPU GEMMs without oneDNN (conftest.py)

MODEL = "tiny"
HI = [{"role": "user", "content": "Hi"}]
EOS = 1  # the tiny checkpoint's tokenizer EOS (and config.json's)
OTHER = 366  # "ld", a plain token: made an EOS id by the checkpoint's generation_config.json
ENGINE_OPTIONS: dict[str, Any] = dict(
    device="cpu", compile=False, max_batch=8, host_tokens=64 * 64, gpu_tokens=8 * 32,
    max_model_len=256, progress=False,
)  # fmt: skip
# (name, sampling fields, the token forced first, finish_reason, stop_reason); max_tokens 2
CASES = [
    ("eos", {}, EOS, "stop", None),
    ("eos-in-stop-ids", {"stop_token_ids": [EOS]}, EOS, "stop", None),
    ("eos-in-stop-ids-ignore-eos", {"stop_token_ids": [EOS], "ignore_eos": True}, EOS, "stop", EOS),
    ("other-eos", {}, OTHER, "stop", OTHER),
    ("other-eos-in-stop-ids", {"stop_token_ids": [OTHER]}, OTHER, "stop", OTHER),
    ("other-eos-ignore-eos", {"ignore_eos": True}, OTHER, "length", None),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with generation_config.json's eos_token_id [EOS, OTHER]."""
    path = tmp_path_factory.mktemp("ck") / "tiny-more-eos"
    shutil.copytree(resolve_model(MODEL), path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS, OTHER]
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    out = LLM(str(checkpoint), **ENGINE_OPTIONS)
    assert out.tokenizer.eos_token_id == EOS and out.engine.eos_token_ids == {EOS, OTHER}
    assert out.tokenizer.decode([OTHER]) == "ld"
    return out


@pytest.fixture(scope="module")
def url(checkpoint: Path) -> Iterator[str]:
    aengine = AsyncEngine(LLM(str(checkpoint), **ENGINE_OPTIONS).engine)
    try:
        with running_server(build_app(aengine, MODEL)) as base:
            yield base
    finally:
        aengine.shutdown()


def test_generate_stop_reason_of_eos_ids(llm: LLM) -> None:
    """The tokenizer's EOS in stop_token_ids was its id, the other EOS id None."""
    params = [
        SamplingParams(max_tokens=2, temperature=0.0, logit_bias={tok: 100.0}, **fields)
        for _, fields, tok, _, _ in CASES
    ]
    got = llm.generate(["The cache holds"] * len(CASES), params)
    assert [(c[0], r.token_ids[0], r.finish_reason, r.stop_reason) for c, r in zip(CASES, got)] == [
        (name, tok, finish, why) for name, _, tok, finish, why in CASES
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_served_stop_reason_of_eos_ids(url: str, chat: bool, stream: bool) -> None:
    """The served choices' stop_reason, as ``generate()``'s."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    got = []
    for name, fields, tok, _, _ in CASES:
        common: dict[str, Any] = dict(
            model=MODEL, max_tokens=2, temperature=0, logit_bias={str(tok): 100},
            extra_body=fields, stream=stream,
        )  # fmt: skip
        if chat:
            r = client.chat.completions.create(messages=HI, **common)
        else:
            r = client.completions.create(prompt="The cache holds", **common)
        last = list(r)[-1] if stream else r
        c = last.choices[0]
        got.append((name, c.finish_reason, c.model_extra["stop_reason"]))
    assert got == [(name, finish, why) for name, _, _, finish, why in CASES]
