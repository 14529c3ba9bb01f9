import os

import pytest
import torch

from echo_compile.threads import configure_threads

# Triton kernels run on CPU tensors through the interpreter when there is no GPU. The variable is
# read when a kernel is defined, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()

configure_threads()  # the engine's CPU thread policy (a 2-core machine: 1 thread, ~2.5x faster)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: pytest -m cuda)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
