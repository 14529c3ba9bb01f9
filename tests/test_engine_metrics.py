"""Engine.metrics()' decode host gap: the host's time from a decode step's sampled tokens (the
step's one sync) to the call of the next decode step, during which a GPU has nothing to run."""

from __future__ import annotations

import time

from test_engines import PROMPTS, make

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.sampling_params import SamplingParams


def test_decode_host_gap_counts_back_to_back_decode_steps_only():
    eng = make(load_model(resolve_model("tiny"))[0], compiled=False)
    schedule = eng.scheduler.schedule

    def slow_schedule():  # 20 ms of host work before every step's launch
        time.sleep(0.02)
        return schedule()

    eng.scheduler.schedule = slow_schedule
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request("r0", PROMPTS[0], params)
    kinds = ""  # per step: P (prefill) or D (decode)
    while eng.has_unfinished():
        if kinds.count("D") == 2 and "r1" not in eng.requests:  # r1's prefill between decodes
            eng.add_request("r1", PROMPTS[1], params)
        steps, decodes = eng.num_steps, eng.num_decode_steps
        eng.step()
        if eng.num_steps > steps:
            kinds += "D" if eng.num_decode_steps > decodes else "P"
    assert "DP" in kinds and "PD" in kinds[kinds.index("DP") :], kinds
    assert eng.host_gaps == sum(kinds[i : i + 2] == "DD" for i in range(len(kinds) - 1)) > 0
    assert 20.0 <= eng.metrics()["decode_host_gap_ms"] < 2000.0
    eng.reset_stats()
    assert eng.host_gaps == 0 and eng.metrics()["decode_host_gap_ms"] == 0.0
