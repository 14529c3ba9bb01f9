"""Host time of streaming detokenisation per generated token: the engine's
``IncrementalDetokenizer`` (two ``decode`` calls of a small window a token) against ``tokenizers``'
own ``DecodeStream`` (a candidate, not used), on the tiny checkpoint's byte-level BPE tokenizer
over its training text, fed one token at a time. Checks first that both stream the same text.

    python -m benchmarks.bench_detokenize --out benchmarks/results/detokenize_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import tokenizers
from tokenizers.decoders import DecodeStream

from model.checkpoint import BOS, EOS, train_tokenizer
from model.tokenizer_data import TRAINING_TEXT
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer


def stream(way: str, raw, tok: Tokenizer, ids: list[int]) -> tuple[float, str]:
    """(seconds, text) of feeding ``ids`` one at a time."""
    t0 = time.perf_counter()
    if way == "incremental":
        d = IncrementalDetokenizer(tok)
        text = "".join(d.add(i) for i in ids) + d.flush()
    else:
        s = DecodeStream(skip_special_tokens=True)
        text = "".join(s.step(raw, i) or "" for i in ids)
    return time.perf_counter() - t0, text


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="results JSON path")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=4096, help="the tiny tokenizer's vocabulary")
    a = ap.parse_args(argv)
    raw = train_tokenizer(a.vocab)
    tok = Tokenizer(raw, BOS, EOS)
    ids = raw.encode(TRAINING_TEXT).ids[1:]  # (without the BOS)
    res: dict = {"tokens": len(ids)}
    texts = {}
    for way in ("incremental", "decode_stream"):
        times = []
        for _ in range(a.reps):
            dt, texts[way] = stream(way, raw, tok, ids)
            times.append(dt / len(ids) * 1e6)
        res[way] = {"us_per_token": statistics.median(times)}
    res["same_text"] = texts["incremental"] == texts["decode_stream"]
    print(json.dumps(res))
    out = {
        "device": cpu_name(),
        "tokenizers": tokenizers.__version__,
        "date": datetime.date.today().isoformat(),
        **res,
    }
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
