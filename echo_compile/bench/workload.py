"""What a run of ``echo-compile bench`` serves: its requests (``Workload``: how many, their
context and output lengths, their arrivals), each one's prompt KV as a prefill instance would send
it (``RandomPromptKV``), and the ``--repeat`` locality knob on their next inputs
(``RepeatPrevious``). The systems that serve them: harness.py."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch

from custom_ops.fp8 import act_quant, fp8_round_trip
from custom_ops.kv_format import ROW_BYTES, pack_index_k, pack_kv_rows
from runtime.sampler import force_tokens


@dataclass
class Workload:
    requests: int = 64
    min_ctx: int = 80_000
    max_ctx: int = 100_000
    output_len: int = 256
    rate: float = float("inf")  # requests/s (Poisson); inf = all at once
    temperature: float = 0.0
    seed: int = 0
    prefill: bool = False  # full mode: the engine prefills each prompt instead of injecting KV

    def lengths(self) -> list[int]:
        rng = random.Random(self.seed)
        return [rng.randint(self.min_ctx, self.max_ctx) for _ in range(self.requests)]

    def arrivals(self) -> list[float]:
        if self.rate == float("inf"):
            return [0.0] * self.requests
        rng = random.Random(self.seed + 1)
        t, out = 0.0, []
        for _ in range(self.requests):
            t += rng.expovariate(self.rate)
            out.append(t)
        return out


def sharegpt_like(requests: int, seed: int = 0) -> Workload:
    """Short-context workload: inputs ~ U(64, 1024), 256 outputs (ShareGPT's median input is a few
    hundred tokens); documented, not sampled from the data set."""
    return Workload(requests=requests, min_ctx=64, max_ctx=1024, output_len=256, seed=seed)


class RandomPromptKV:
    """A request's prompt KV as a prefill instance would send it (a ``runtime.prompt_kv`` source):
    random FP8-round-tripped latents and random indexer keys, made chunk by chunk as the engine
    writes them, so a 100K-token prompt is never held whole.

    NOTE: one generator serves every chunk, so the rows depend on the order in which chunks are
    asked for; the engine asks chunk by chunk, every layer of a chunk in turn, always."""

    def __init__(
        self, request_id: str, num_tokens: int, num_layers: int, fmt: str, device, seed: int = 0
    ):
        self.num_tokens, self.num_layers, self.fmt = num_tokens, num_layers, fmt
        self.row_bytes = ROW_BYTES[fmt]
        self.device = torch.device(device)
        # crc32, not hash(): Python salts str hashes per process, and the KV must be reproducible
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed + zlib.crc32(request_id.encode()))

    def chunk(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, gen, dev = end - start, self.gen, self.device
        c = torch.randn(n, 512, generator=gen, device=dev)
        pe = torch.randn(n, 64, generator=gen, device=dev)
        k = torch.randn(n, 128, generator=gen, device=dev)
        kq, ks = act_quant(k)
        rows = pack_kv_rows(fp8_round_trip(c.bfloat16()), pe.bfloat16(), self.fmt)
        return rows, pack_index_k(kq, ks.squeeze(-1))


class RepeatPrevious:
    """The benchmark's locality knob, a logits processor (``Engine.logits_processors``): with
    probability ``repeat`` a request's next input token is its previous input token instead of
    the one the model would pick (that row's logits become a point mass on it, so sampling still
    runs every step; the benchmark reads no logprob)."""

    def __init__(self, repeat: float, seed: int = 0):
        if not 0.0 <= repeat <= 1.0:
            raise ValueError(f"repeat must be a probability in [0, 1], got {repeat!r}")
        self.repeat = repeat
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the knob's random stream (each benchmark run starts from the same state)."""
        self.rng = random.Random(seed)

    def __call__(self, reqs, logits: torch.Tensor) -> torch.Tensor:
        if self.repeat <= 0:
            return logits
        rows = [i for i in range(len(reqs)) if self.rng.random() < self.repeat]
        prev = [reqs[i].output_ids[-1] if reqs[i].output_ids else reqs[i].prompt_ids[-1]
                for i in rows]  # fmt: skip
        return force_tokens(logits, rows, prev)
