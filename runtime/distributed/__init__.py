"""Multi-process serving over torch.distributed (docs/multi_gpu.md): the process group and its
launch (``process``), request placement over data-parallel ranks (``balance``), the per-step
agreement that keeps every rank's collectives in line (``step_sync``) and the engine that runs
one rank (``dist_engine``)."""
