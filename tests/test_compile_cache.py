"""The command's torch.compile cache directory (echo_compile/compile_cache.py)."""

from __future__ import annotations

import os

from echo_compile import cli
from echo_compile.compile_cache import ENV, configure_compile_cache


def test_the_cache_goes_under_the_projects_cache_unless_set(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("ECHO_COMPILE_CACHE", str(tmp_path))
    assert configure_compile_cache() == str(tmp_path / "inductor") == os.environ[ENV]
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    assert configure_compile_cache() == str(tmp_path / "mine") == os.environ[ENV]


def test_the_command_sets_it(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("ECHO_COMPILE_CACHE", str(tmp_path))
    assert cli.main(["plan", "--quant", "awq", "--host-mem-gib", "1536"]) == 0
    assert os.environ[ENV] == str(tmp_path / "inductor")
