"""Kernel-library backends of the decode indexer (DeepGEMM scores, FlashInfer top-k), each call an
``echo::`` custom op with a fake so the compiled decode step captures it in its CUDA graph; the
libraries are optional (``pip install -e '.[kernels]'``) and imported on first CUDA use.
``select`` decides which backend serves which half; docs/backends.md describes the whole.
"""

from custom_ops.backends import (  # noqa: F401  (registers)
    deep_gemm_gemm,
    deep_gemm_ops,
    flashinfer_ops,
    split_ops,
)
