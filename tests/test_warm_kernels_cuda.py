"""On the GPU: once a compiled engine is warmed up, serving compiles no Triton kernel, so no
request waits on a JIT. The steps themselves are CUDA graphs; what runs outside them (a finished
request's echo::release, a prompt-KV load's echo::offload, sampling) must be compiled by the
warm-up too: the first finishing request of a bench run held the whole batch's step up by ~0.4 s
on the H200 while echo::release compiled. In a fresh process, so that no earlier test has
compiled a kernel already (Triton keeps compiled kernels per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

SCRIPT = r"""
import json, random
import torch
import triton
from echo_compile import LLM, SamplingParams

llm = LLM("tiny", max_batch=2, host_tokens=4096, gpu_tokens=2 * 32, kv_format="fp8",
          offload=True, max_model_len=512, prefill_chunk=64, progress=False)
compiled = []  # every Triton JIT compile from here on
triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
rng = random.Random(3)
prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (40, 300, 129)]
params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
out = llm.generate(prompts, params)  # prefill, decode, and finishes (echo::release)
eng = llm.engine
eng.add_request("sender", prompts[1], params)
while not eng.requests["sender"].output_ids:
    eng.step()
eng.add_request("receiver", prompts[1], params, prompt_kv=eng.prompt_kv("sender"))
while eng.has_unfinished():  # the receiver's prompt-KV load (echo::offload)
    eng.step()
served = list(compiled)


@triton.jit
def _probe(x):  # a kernel compiled on purpose: shows that the hook sees compiles at all
    triton.language.store(x, 1.0)


_probe[(1,)](torch.zeros(1, device="cuda"))
print(json.dumps({"compiled": served, "probe": compiled[len(served):],
                  "tokens": [len(o.token_ids) for o in out]}))
"""


def test_serving_compiles_no_triton_kernel_after_warmup(tmp_path):
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "serve.py"  # a file: Triton reads a kernel's source from it
    script.write_text(SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tokens"] == [6, 6, 6]
    assert len(got["probe"]) == 1 and "_probe" in got["probe"][0], got["probe"]
    assert got["compiled"] == [], "JIT-compiled while serving:\n" + "\n".join(got["compiled"])
