"""Recording wrappers around a real (eager) Engine, shared by the tests that compare two runs:
what each decode step's indexer selected, per request, layer and position, and the logits of every
forward. Wrapping instance attributes keeps the engine's code untouched (eager only: a compiled
step would not call the wrappers)."""

from __future__ import annotations

import random

import torch

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.request import PAGE, Request
from runtime.sampling_params import SamplingParams
from runtime.tokenizer import Tokenizer

_TINY: dict[str, tuple] = {}


def tiny(device: str = "cpu"):
    """(model, tokenizer) of the tiny checkpoint on ``device``, loaded once per test process."""
    if device not in _TINY:
        path = resolve_model("tiny")
        model, _ = load_model(path, device=device)
        _TINY[device] = (model, Tokenizer.from_dir(path))
    return _TINY[device]


def positions_of(req: Request, host_slots: torch.Tensor) -> torch.Tensor:
    """Token positions of ``req`` held by ``host_slots`` (-1 stays -1). Host slots depend on which
    pages a request got at admission, which differs between runs whose batches differ; the
    positions do not."""
    page_index = {p: i for i, p in enumerate(req.pages)}
    out = []
    for s in host_slots.tolist():
        if s < 0:
            out.append(-1)
        else:
            out.append(page_index[s // PAGE] * PAGE + s % PAGE)  # KeyError: not this request's
    return torch.tensor(out, dtype=torch.int64)


class Recorder:
    """Wraps ``engine.runner.forward`` and every cache layer's ``select``/``fetch``.

    ``selected[(request_id, position, layer)]``: the token positions (ascending, -1 padded) the
    indexer selected for the query at ``position``. ``batch_sizes``: rows of every decode step.
    ``logits``: (is_decode, request ids, logits) of every forward. Each ``fetch`` is checked on the
    spot: the slots handed to attention hold exactly the selected host rows, -1 where -1."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.selected: dict[tuple[str, int, int], torch.Tensor] = {}
        self.batch_sizes: list[int] = []
        self.logits: list[tuple[bool, list[str], torch.Tensor]] = []
        self.fetch_checks = 0
        self._batch: list[Request] = []
        self._ahead = 0  # 1: a decode step one token ahead of the host (asynchronous scheduling)
        forward = engine.runner.forward

        def wrapped_forward(batch, *ahead):  # (next_ids, next_rows): a step run ahead
            self._batch = list(batch.requests) if batch.is_decode else []
            self._ahead = int(bool(ahead))
            if batch.is_decode:
                self.batch_sizes.append(len(batch.requests))
            out = forward(batch, *ahead)
            ids = [r.request_id for r in batch.requests]
            self.logits.append((batch.is_decode, ids, out.detach().cpu().clone()))
            return out

        engine.runner.forward = wrapped_forward
        for layer in engine.cache.layers:
            self._wrap_layer(layer)

    def _wrap_layer(self, layer) -> None:
        select, fetch = layer.select, layer.fetch
        lid = layer.layer_id

        def wrapped_select(q_fp8, weights, block_table, seq_lens):
            host, kth = select(q_fp8, weights, block_table, seq_lens)
            for i, req in enumerate(self._batch):
                # the query of a decode row is its newest token
                pos = req.num_tokens - 1 + self._ahead
                assert int(seq_lens[i]) == pos + 1
                key = (req.request_id, pos, lid)
                assert key not in self.selected, f"{key} selected twice"
                self.selected[key] = positions_of(req, host[i])
            # padded rows (seq_len 0) select nothing
            assert (host[len(self._batch) :] == -1).all()
            return host, kth

        def wrapped_fetch(host_slots):
            pool, slots = fetch(host_slots)
            valid = host_slots >= 0
            assert torch.equal(slots >= 0, valid), "a selected row has no GPU slot (or vice versa)"
            rows_attended = pool[slots[valid].long()].cpu()
            host = layer.host_kv  # pinned host memory (or its device view) when offloading
            rows_selected = host[host_slots[valid].long().to(host.device)].cpu()
            assert torch.equal(rows_attended, rows_selected), f"layer {lid}: wrong rows on GPU"
            self.fetch_checks += 1
            return pool, slots

        layer.select = wrapped_select
        layer.fetch = wrapped_fetch


def random_prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lens]


def run(
    cfg: EngineConfig, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[Engine, Recorder, dict[str, list[int]]]:
    """Run ``prompts`` to completion on a fresh engine over the shared tiny model; returns the
    engine, its recorder and the generated token ids per request id."""
    model, tok = tiny(cfg.device)
    eng = Engine(model, model.config, tok, cfg)
    rec = Recorder(eng)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return eng, rec, out
