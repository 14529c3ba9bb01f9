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


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: pytest -m cuda)")
    for item in items:
        # a test taking the ``device`` fixture runs its kernels on the GPU there: so that the
        # GPU runs (``pytest -m cuda``) select it too, it counts as a cuda test on a GPU machine
        if HAS_CUDA and "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cuda)
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="module", autouse=True)
def _aten_gemm(request):
    """Modules marked ``aten_gemm`` run their CPU GEMMs on ATen's own kernels, not oneDNN's.
    oneDNN picks AMX, AVX-512 or AVX2 kernels by CPU and shape, whose bf16 results differ in the
    last bits between CPUs and between batch shapes; one ulp can flip an FP8 rounding or an
    argmax near-tie, so the tolerances of tests that compare against another computation (an
    independent implementation, a dense formula, another batching) held on one CPU and failed
    on an AMX one. Only in-process: tests comparing with worker processes keep oneDNN on both
    sides. The engine outside the tests keeps oneDNN."""
    if request.node.get_closest_marker("aten_gemm") is None:
        yield
        return
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    yield
    torch.backends.mkldnn.enabled = was
