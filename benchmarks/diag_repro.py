"""Is the compiled engine reproducible? Runs the workload of tests/test_lossless_cuda.py (8 prompts,
compiled, CUDA graphs) one or more times in this process and saves each run's per-step logits, so
runs in one process and runs in separate processes can be compared (issue 13, item 0).

    python -m benchmarks.diag_repro --fmt fp8 --modes offload,offload --out $OUT/a.pt
    python -m benchmarks.diag_repro --compare $OUT/a.pt:0 $OUT/b.pt:0
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path


def record(fmt: str, modes: list[str], variant: str) -> list[dict]:
    # the test's own workload and run(), loaded from its file (tests/ is not a package)
    path = Path(__file__).resolve().parents[1] / "tests" / "test_lossless_cuda.py"
    spec = importlib.util.spec_from_file_location("test_lossless_cuda", path)
    t = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(t)

    import echo_compile
    from echo_compile import settings

    if variant == "detalg":  # deterministic aten kernels; empty tensors filled with NaN
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
    if variant == "nographs":  # Inductor without CUDA graphs
        settings.compile_mode = lambda device: None
    elif variant == "eager":
        llm = echo_compile.LLM

        def eager(*a, **k):
            obj = llm(*a, compile=False, **k)
            obj.engine.runner.prefill_static_width = True  # the compiled prefill's inputs
            return obj

        echo_compile.LLM = eager
    from model.checkpoint import resolve_model
    from model.config import ModelConfig

    topk = ModelConfig.from_json(resolve_model("tiny") / "config.json").index_topk
    runs = []
    for m in modes:
        res, log, _ = t.run(fmt, m == "offload", t.MAX_BATCH * topk)
        runs.append(
            dict(
                mode=m,
                steps=[(d, ids) for d, ids, _ in log],
                logits=[x for _, _, x in log],
                tokens=[r.token_ids for r in res],
            )
        )
        print(f"{fmt} {m}: {len(log)} steps", flush=True)
    return runs


def compare(a: dict, b: dict) -> str:
    import torch

    if a["steps"] != b["steps"]:
        return "different schedules"
    diff = [i for i, (x, y) in enumerate(zip(a["logits"], b["logits"])) if not torch.equal(x, y)]
    if not diff:
        return f"identical over {len(a['steps'])} steps"
    i = diff[0]
    d, ids = a["steps"][i]
    err = (a["logits"][i] - b["logits"][i]).abs().max().item()
    return (
        f"{len(diff)}/{len(a['steps'])} steps differ; first: step {i} "
        f"({'decode' if d else 'prefill'} of {ids}), max |diff| {err:.3g}; "
        f"tokens equal: {a['tokens'] == b['tokens']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fmt", default="fp8", choices=("bf16", "fp8"))
    p.add_argument("--modes", default="offload,offload", help="comma list of offload|gpu")
    p.add_argument("--variant", default="graphs", choices=("graphs", "nographs", "eager", "detalg"))
    p.add_argument("--out", help="file for the recorded runs (torch.save)")
    p.add_argument("--compare", nargs="*", metavar="FILE:RUN", help="compare recorded runs")
    a = p.parse_args()
    import torch

    if a.compare:
        runs = {}
        for spec in a.compare:
            f, i = spec.rsplit(":", 1)
            runs[spec] = torch.load(f, weights_only=False)[int(i)]
        keys = list(runs)
        for j, x in enumerate(keys):
            for y in keys[j + 1 :]:
                print(f"{x} vs {y}: {compare(runs[x], runs[y])}")
        return
    torch.save(record(a.fmt, a.modes.split(","), a.variant), a.out)


if __name__ == "__main__":
    main()
