"""Compiling Triton kernels for an H200 (sm_90) on a machine without a GPU, in a fresh interpreter:
the test session sets TRITON_INTERPRET=1, which swaps the kernels for interpreted functions at
import, and the interpreter does not lower what the compiler lowers.

    from sm90_utils import assert_compiles, run_script

A script prints ``OK <name>`` per kernel compiled and ``FAIL <name>: ...`` per failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_script(script: str) -> str:
    """Run ``script`` in a fresh interpreter (no TRITON_INTERPRET, the repo importable); its
    output (stdout, then stderr), after asserting it exited 0."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
        timeout=600,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    return out


def assert_compiles(script: str, kernels: int) -> str:
    """``script`` compiled ``kernels`` kernels, none failed; returns its output."""
    out = run_script(script)
    assert "FAIL" not in out, out[-3000:]
    assert out.count("OK ") == kernels, out[-3000:]
    return out
