"""The sampling controls (runtime.sampling_controls) and top-N logprobs on one GPU, per decode step.

    python -m benchmarks.bench_sampling_controls --out $OUT/bench_sampling_controls.json

First a correctness check per batch size: the controls on CUDA against the same controls on the
CPU (same logits, same requests: allclose, the same -inf set, the same sampled tokens), printed
PASS / FAIL and recorded, never stopping the timings. Then, at the DeepSeek-V3.2 vocabulary
(129280) and B = 1 / 16 / 64 with 1000 generated tokens per request, the median wall time of a
decode step's sampling (host included: the controls run eagerly between graph replays):
``sample`` alone, controls + ``sample`` in steady state (one new token per request per step),
the first step of new requests (slot setup from prompt and history), and log_softmax + top-20.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

V = 129280
BATCHES = (1, 16, 64)
HISTORY = 1000


@dataclass
class Req:  # the fields SamplingControls reads
    request_id: str
    prompt_ids: list[int]
    params: object
    output_ids: list[int] = field(default_factory=list)


def make_requests(b: int, vocab: int, history: int, seed: int) -> list[Req]:
    from runtime.sampling_params import SamplingParams

    rng = random.Random(seed)
    reqs = []
    for i in range(b):
        params = SamplingParams(
            max_tokens=4096,
            temperature=0.8,
            seed=i,
            top_p=0.95,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.1,
            logit_bias={rng.randrange(vocab): 2.0 for _ in range(8)},
            min_p=0.05,
            min_tokens=history + 10,
        )
        prompt = [rng.randrange(vocab) for _ in range(200)]
        out = [rng.randrange(vocab) for _ in range(history)]
        reqs.append(Req(f"r{i}", prompt, params, out))
    return reqs


def wall_us(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> dict:
    """Median wall time (us) of ``fn`` over ``reps`` calls, each synchronised (host + device)."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return {"median_us": statistics.median(times), "min_us": min(times), "reps": reps}


def check(b: int, vocab: int) -> dict:
    """CUDA controls == CPU controls over a few steps (allclose, same -inf set, same tokens)."""
    import torch

    from runtime.sampler import prepare_batch, sample
    from runtime.sampling_controls import SamplingControls

    reqs_cpu = make_requests(b, vocab, 50, seed=b)
    reqs_gpu = make_requests(b, vocab, 50, seed=b)
    cpu, gpu = SamplingControls({1}), SamplingControls({1})
    gen = torch.Generator().manual_seed(b)
    for _ in range(4):
        logits = torch.randn(b, vocab, generator=gen) * 4
        a = cpu(reqs_cpu, logits.clone())
        g = gpu(reqs_gpu, logits.cuda())
        if not (
            torch.allclose(a, g.cpu(), atol=1e-4, rtol=0)
            and torch.equal(a.isinf(), g.isinf().cpu())
        ):
            return {"pass": False, "why": "controlled logits differ"}
        ps = [r.params for r in reqs_cpu]
        seeds, steps = [p.seed for p in ps], [len(r.output_ids) for r in reqs_cpu]
        sb = prepare_batch(ps, seeds, steps)
        sg = prepare_batch(ps, seeds, steps, "cuda")
        ta, _ = sample(a, sb.temperature, sb.top_k, sb.top_p, sb.seeds, sb.steps)
        tg, _ = sample(g, sg.temperature, sg.top_k, sg.top_p, sg.seeds, sg.steps)
        if not torch.equal(ta, tg.cpu()):
            return {"pass": False, "why": "sampled tokens differ"}
        for rc, rg, t in zip(reqs_cpu, reqs_gpu, ta.tolist(), strict=True):
            rc.output_ids.append(t)
            rg.output_ids.append(t)
    return {"pass": True}


def bench(b: int, vocab: int, reps: int) -> dict:
    import torch

    from runtime.sampler import prepare_batch, sample
    from runtime.sampling_controls import SamplingControls

    sync = torch.cuda.synchronize
    reqs = make_requests(b, vocab, HISTORY, seed=b)
    logits = torch.randn(b, vocab, device="cuda") * 4
    ps = [r.params for r in reqs]
    sb = prepare_batch(ps, [p.seed for p in ps], [HISTORY] * b, "cuda")

    def plain() -> object:
        return sample(logits, sb.temperature, sb.top_k, sb.top_p, sb.seeds, sb.steps)

    controls = SamplingControls({1})

    def steady() -> object:
        for r in reqs:  # one new token per request, as a decode step adds
            r.output_ids.append(7)
        x = controls(reqs, logits)
        return sample(x, sb.temperature, sb.top_k, sb.top_p, sb.seeds, sb.steps)

    def first_step() -> object:
        return SamplingControls({1})(reqs, logits)  # fresh state: prompt + history to the device

    def top20() -> object:
        top = torch.log_softmax(logits, dim=-1).topk(20, dim=-1)
        return top.indices.tolist(), top.values.tolist()

    out = {"B": b, "vocab": vocab, "history": HISTORY}
    out["sample_only"] = wall_us(plain, reps, sync)
    out["controls_plus_sample"] = wall_us(steady, reps, sync)
    out["controls_first_step"] = wall_us(first_step, max(reps // 4, 5), sync)
    out["top20_logprobs"] = wall_us(top20, reps, sync)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_sampling_controls.json"))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=V)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_sampling_controls: needs a CUDA device")
        return 2
    from echo_compile.bench.result import environment

    res: dict = {**environment(), "checks": {}, "timings": []}

    def write() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2))

    for b in BATCHES:
        try:
            r = check(b, a.vocab)
        except Exception as e:  # a crash is a FAIL, not the end of the run
            r = {"pass": False, "why": f"{type(e).__name__}: {e}"}
        res["checks"][f"B{b}"] = r
        print(f"check controls CUDA == CPU, B={b}: {'PASS' if r['pass'] else 'FAIL ' + r['why']}")
        write()
    for b in BATCHES:
        r = bench(b, a.vocab, a.reps)
        res["timings"].append(r)
        print(
            f"B={b}: sample {r['sample_only']['median_us']:.0f} us, controls+sample "
            f"{r['controls_plus_sample']['median_us']:.0f} us, first step "
            f"{r['controls_first_step']['median_us']:.0f} us, top-20 "
            f"{r['top20_logprobs']['median_us']:.0f} us"
        )
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
