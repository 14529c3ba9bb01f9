"""On the GPU: the sampling controls with the compiled decode step (CUDA graphs): no recompile
after warm-up with every control on, offloading on/off bit-identical, and the controls' CUDA
result equal to their CPU one (same tokens)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.cuda


def _params():
    from runtime.sampling_params import SamplingParams

    return [
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3,
                       frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=5, presence_penalty=1.0, min_p=0.05,
                       logit_bias={100: 2.0}, min_tokens=12),
        SamplingParams(max_tokens=12, temperature=1.2, seed=6, top_k=50, repetition_penalty=0.9,
                       ignore_eos=True),
    ]  # fmt: skip


def test_compiled_decode_with_sampling_controls_lossless_no_recompile():
    import torch._dynamo
    from test_compile import make_engine
    from torch._dynamo.utils import counters

    from model.checkpoint import resolve_model
    from model.loader import load_model
    from runtime.tokenizer import Tokenizer

    path = resolve_model("tiny")
    model, _ = load_model(path, device="cuda")
    tiny = (model, Tokenizer.from_dir(path))
    torch._dynamo.reset()
    counters.clear()
    outs = {}
    for offload in (True, False):
        eng = make_engine(tiny, offload, compiled=True, strict=True)
        eng.runner.warmup(calls=3, progress=False)
        rng = random.Random(3)
        with torch.compiler.set_stance("fail_on_recompile"):
            for i, (n, p) in enumerate(zip((70, 90, 130), _params(), strict=True)):
                eng.add_request(f"r{i}", [rng.randrange(2, 512) for _ in range(n)], p)
            out: dict[str, list[int]] = {}
            while eng.has_unfinished():
                for o in eng.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs[offload] = out
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert outs[True] == outs[False] and all(len(v) == 12 for v in outs[True].values())


def test_controls_cuda_equal_cpu():
    from test_sampling_controls import EOS, Req, V, random_params

    from runtime.sampler import prepare_batch, sample
    from runtime.sampling_controls import SamplingControls

    rng = random.Random(1)
    reqs = [
        Req(f"r{i}", [rng.randrange(V) for _ in range(5)], random_params(rng)) for i in range(8)
    ]
    cpu, gpu = SamplingControls({EOS}), SamplingControls({EOS})
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        logits = torch.randn(len(reqs), V, generator=gen) * 3
        a = cpu(reqs, logits.clone())
        b = gpu(reqs, logits.cuda()).cpu()
        assert torch.allclose(a, b, atol=1e-5, rtol=0) and torch.equal(a.isinf(), b.isinf())
        sb = prepare_batch([r.params for r in reqs], [r.params.seed for r in reqs],
                           [len(r.output_ids) for r in reqs])  # fmt: skip
        tok, _ = sample(a, sb.temperature, sb.top_k, sb.top_p, sb.seeds, sb.steps)
        for r, t in zip(reqs, tok.tolist(), strict=True):
            r.output_ids.append(t)
