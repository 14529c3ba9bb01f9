"""`echo-compile bench --dp 2 --ep 2` under torchrun on CPU (gloo), at the tiny size: every rank
builds the same random model and cuts its shard (``model.shard_loader.shard_model``, checked
against the checkpoint loader), the decode-only requests' injected prompt KV goes to their DP
rank, and rank 0's JSON counts every rank's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.loader import load_model
from model.parallel import TPGroup
from model.shard_loader import load_sharded_model, shard_model
from runtime.distributed.process import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("ep", [False, True])
def test_shard_model_cuts_what_the_loader_reads(ep):
    full, _ = load_model("tiny", keep_mtp=False)
    for r in range(2):
        g = TPGroup(r, 2, "", gather=True)
        cut, (read, _) = shard_model(full, g, ep).state_dict(), load_sharded_model("tiny", g, ep=ep)
        want = read.state_dict()
        assert cut.keys() == want.keys()
        assert all(torch.equal(cut[k], want[k]) for k in want)


def test_two_rank_bench_counts_every_rank_s_tokens(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "echo_compile.cli", "bench", "--preset", "tiny",
        "--device", "cpu", "--no-compile", "--dp", "2", "--ep", "2", "--requests", "4",
        "--min-ctx", "64", "--max-ctx", "128", "--output-len", "4", "--gpu-pools", "1024",
        "--systems", "offload", "--collective-timeout", "60", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    d = json.loads(out.read_text())
    assert d["parallel"] == {"dp": 2, "tp": 1, "ep": 2}
    (r,) = d["results"]  # the rate sweep and the breakdown are single-process only
    assert d["breakdown"] == {}
    assert r["generated_tokens"] == 4 * 4  # every rank's requests, counted on rank 0
    assert r["effective_batch"] == 2.0  # rank 0 decoded its two of the four requests
    assert r["throughput_tok_s"] > 0 and len(r["hit_rate"]) == d["model"]["num_hidden_layers"]
    assert "no rate sweep and no breakdown" in p.stdout
