"""Engine.metrics()' decode host gap: the host's time from a decode step's sampled tokens (the
step's one sync) to the next decode step's launch, during which a GPU has nothing to run."""

from __future__ import annotations

import random
import time

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams


def test_decode_host_gap_counts_back_to_back_decode_steps_only():
    model = load_model(resolve_model("tiny"))[0]
    cfg = EngineConfig(
        max_batch=2,
        host_tokens=1024,
        gpu_tokens=2 * model.config.index_topk,
        max_model_len=128,
        decode_buckets=(2,),
        prefill_chunk=16,
    )
    eng = Engine(model, model.config, None, cfg)
    schedule = eng.scheduler.schedule

    def slow_schedule():  # 20 ms of host work before every step's launch
        time.sleep(0.02)
        return schedule()

    eng.scheduler.schedule = slow_schedule
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((20, 37)):  # the second prompt's prefill lands between decode steps
        eng.add_request(f"r{i}", [random.Random(i).randrange(2, 512) for _ in range(n)], params)
    kinds = []
    while eng.has_unfinished():
        steps, decodes = eng.num_steps, eng.num_decode_steps
        eng.step()
        if eng.num_steps > steps:
            kinds.append(eng.num_decode_steps > decodes)
    back_to_back = sum(a and b for a, b in zip(kinds, kinds[1:]))
    assert not all(kinds) and back_to_back > 0
    assert eng.host_gaps == back_to_back
    assert 20.0 <= eng.metrics()["decode_host_gap_ms"] < 2000.0
    eng.reset_stats()
    assert eng.host_gaps == 0 and eng.metrics()["decode_host_gap_ms"] == 0.0
