"""The CPU thread policy (echo_compile/threads.py)."""

import os

import pytest
import torch

from echo_compile import threads


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    n = torch.get_num_threads()
    monkeypatch.setattr(threads, "_configured", False)
    yield
    torch.set_num_threads(n)


def test_default_is_one_thread_on_small_machines_and_half_the_cores_above():
    assert [threads.default_threads(c) for c in (1, 2, 3, 4, 6, 16, 64)] == [1, 1, 1, 2, 3, 8, 32]


def test_usable_cores_come_from_the_affinity_mask(monkeypatch):
    assert 1 <= threads.usable_cores() <= len(os.sched_getaffinity(0))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(threads, "_cgroup_cpu_limit", lambda: None)
    assert threads.usable_cores() == 6
    monkeypatch.setattr(threads, "_cgroup_cpu_limit", lambda: 1.5)  # a container's --cpus 1.5
    assert threads.usable_cores() == 2


def test_precedence_flag_then_env_then_omp_then_policy(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    env = {"ECHO_COMPILE_THREADS": "3", "OMP_NUM_THREADS": "5"}
    assert threads.choose_threads(2, env) == 2
    assert threads.choose_threads(None, env) == 3
    assert threads.choose_threads(None, {"OMP_NUM_THREADS": "5"}) is None  # torch honours it
    assert threads.choose_threads(None, {"ECHO_COMPILE_THREADS": " "}) == 4
    assert threads.choose_threads(None, {}) == 4


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_bad_values_name_their_source(bad):
    with pytest.raises(ValueError, match=rf"ECHO_COMPILE_THREADS must be .*got '{bad}'"):
        threads.choose_threads(None, {"ECHO_COMPILE_THREADS": bad})


@pytest.mark.parametrize("bad", [0, -1, True])
def test_bad_requests_are_refused(bad):
    with pytest.raises(ValueError, match=rf"--threads must be a positive integer .*got {bad!r}"):
        threads.choose_threads(bad, {})


def test_more_threads_than_usable_cores_are_refused(monkeypatch):
    """A thread count above the usable cores is an error naming its source and value (100000
    crashed the process in torch.set_num_threads, SIGSEGV, no error line)."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert threads.choose_threads(4, {}) == 4
    with pytest.raises(ValueError, match=r"--threads must be at most the 4 usable CPU cores"):
        threads.choose_threads(5, {})
    with pytest.raises(ValueError, match=r"ECHO_COMPILE_THREADS must be at most the 4 .*'100000'"):
        threads.choose_threads(None, {"ECHO_COMPILE_THREADS": "100000"})


def test_configure_applies_once_and_leaves_a_later_choice_alone(monkeypatch):
    monkeypatch.setenv("ECHO_COMPILE_THREADS", "1")
    assert threads.configure_threads() == 1 == torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's own choice after the first engine
    assert threads.configure_threads() == 2
    assert threads.configure_threads(1) == 1  # an explicit request always applies


def test_llm_applies_the_policy_before_anything_loads(monkeypatch):
    from echo_compile import llm

    calls = []
    monkeypatch.setattr(llm, "configure_threads", lambda: calls.append(1))
    with pytest.raises(ValueError, match="max_batch"):
        llm.LLM("tiny", max_batch=0)
    assert calls == [1]
