"""Selection locality measured from the real indexer: the consecutive-step top-k overlap per layer
(docs/prefetch.md, "Locality"), the figure the published measurements give for DeepSeek-V3.2
(~35-50% on deep layers, ~1-2% on layers 0-1, TensorRT-LLM on SWE-Bench 64K) and the one that,
with the pool rows each request gets, sets the GPU-pool hit rate.

``measure_overlap`` wraps every layer's ``select`` of an eager engine (a compiled step never calls
back into Python) for a few decode steps: for each request (keyed by its first host page) and
layer, |S_t ∩ S_{t-1}| / |S_{t-1}|, where S are the selected host slots, averaged over requests
and steps. Nothing is injected: the selections are the indexer's own on the model's weights.
"""

from __future__ import annotations

import torch


class OverlapProbe:
    def __init__(self, cache) -> None:
        self.layers = list(cache.layers)
        self.prev: list[dict[int, set[int]]] = [{} for _ in self.layers]
        self.sums = [0.0] * len(self.layers)
        self.counts = [0] * len(self.layers)
        self._orig = []
        for i, layer in enumerate(self.layers):
            self._orig.append(layer.select)
            layer.select = self._wrap(i, layer.select)

    def _wrap(self, i: int, select):
        def probe(q_fp8, weights, block_table, seq_lens):
            host, kth = select(q_fp8, weights, block_table, seq_lens)
            self.record(i, host, block_table, seq_lens)
            return host, kth

        return probe

    def record(self, i: int, host: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor) -> None:  # fmt: skip
        host, keys, live = host.cpu(), block_table[:, 0].tolist(), (seq_lens > 0).tolist()
        cur: dict[int, set[int]] = {}
        for b, key in enumerate(keys):
            if not live[b]:
                continue
            s = set(host[b][host[b] >= 0].tolist())
            cur[key] = s
            old = self.prev[i].get(key)
            if old:
                self.sums[i] += len(s & old) / len(old)
                self.counts[i] += 1
        self.prev[i] = cur

    def overlap(self) -> list[float]:
        return [s / c if c else 0.0 for s, c in zip(self.sums, self.counts)]

    def close(self) -> None:
        for layer, orig in zip(self.layers, self._orig):
            layer.select = orig
