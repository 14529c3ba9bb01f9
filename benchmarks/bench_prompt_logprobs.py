"""The extra cost of ``prompt_logprobs`` on one GPU, per prefill chunk, at DeepSeek-V3.2's sizes.

    python -m benchmarks.bench_prompt_logprobs --out $OUT/bench_prompt_logprobs.json

A request asking for prompt logprobs runs each prefill chunk eagerly with the logits of every
token (runtime.prompt_logprobs): the LM head over T rows instead of one, then the log-softmax,
ranks and top-N of ``prompt_logprobs``. First a correctness check per size: ``prompt_logprobs`` on
CUDA against the same on the CPU (same logits: logprobs within 1e-4, same ranks and top ids),
printed PASS / FAIL and recorded, never stopping the timings. Then the median wall time (synced,
host copy included) of: the head GEMM for 1 and T rows (hidden 7168, vocab 129280, bf16 with fp32
output as the model computes it), and ``prompt_logprobs`` with N = 0 and 20, for T = 512 / 2048
(the default prefill chunk), with the peak memory each allocates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

D, V = 7168, 129280
CHUNKS = (512, 2048)
TOPS = (0, 20)


def check(t: int, vocab: int, top: int = 20) -> dict:
    import torch

    from runtime.prompt_logprobs import prompt_logprobs

    g = torch.Generator().manual_seed(t)
    logits = torch.randn(t, vocab, generator=g) * 3
    nxt = torch.randint(0, vocab, (t,), generator=g).tolist()
    cpu = prompt_logprobs(logits, nxt, top)
    gpu = prompt_logprobs(logits.cuda(), nxt, top)
    err = max(abs(a[0] - b[0]) for a, b in zip(cpu, gpu, strict=True))
    ranks = all(a[1] == b[1] for a, b in zip(cpu, gpu, strict=True))
    ids = all([x for x, _ in a[2]] == [x for x, _ in b[2]] for a, b in zip(cpu, gpu, strict=True))
    ok = err <= 1e-4 and ranks and ids
    return {"pass": ok, "max_abs_err": err, "ranks_equal": ranks, "top_ids_equal": ids, "why": ""}


def median_ms(fn: Callable[[], object], reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(t: int, vocab: int, reps: int) -> dict:
    import torch

    from runtime.prompt_logprobs import prompt_logprobs

    w = torch.randn(vocab, D, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
    nxt = torch.randint(0, vocab, (t,)).tolist()
    out: dict = {"T": t, "vocab": vocab}
    out["head_1_row_ms"] = median_ms(lambda: torch.mm(h[-1:], w.t(), out_dtype=torch.float32), reps)
    out["head_T_rows_ms"] = median_ms(lambda: torch.mm(h, w.t(), out_dtype=torch.float32), reps)
    logits = torch.mm(h, w.t(), out_dtype=torch.float32)
    for top in TOPS:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out[f"prompt_logprobs_top{top}_ms"] = median_ms(
            lambda top=top: prompt_logprobs(logits, nxt, top), reps
        )
        out[f"prompt_logprobs_top{top}_peak_mib"] = (
            torch.cuda.max_memory_allocated() - base
        ) / 2**20
    out["logits_mib"] = logits.numel() * 4 / 2**20
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_prompt_logprobs.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=V)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_prompt_logprobs: needs a CUDA device")
        return 2
    from echo_compile.bench.result import environment

    res: dict = {**environment(), "checks": {}, "timings": []}

    def write() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2))

    for t in CHUNKS:
        try:
            r = check(t, a.vocab)
        except Exception as e:  # a crash is a FAIL, not the end of the run
            r = {"pass": False, "why": f"{type(e).__name__}: {e}"}
        res["checks"][f"T{t}"] = r
        print(f"check prompt_logprobs CUDA == CPU, T={t}: {'PASS' if r['pass'] else 'FAIL'} {r}")
        write()
    for t in CHUNKS:
        r = bench(t, a.vocab, a.reps)
        res["timings"].append(r)
        print(json.dumps(r))
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
