"""``echo-compile bench``: the paper's experiment on one GPU, offloading vs GPU-only side by side.

Decode-only with injected KV (the paper's prefill/decode-disaggregated setup): each request is
added with ``Engine.add_request(..., prompt_kv=RandomPromptKV(...))``, the engine's public intake
of a prompt's KV computed elsewhere, so at admission its prompt KV (all but its last token) is
written from random latents through the write path prefill uses, then generation is measured;
generation throughput leaves the injection time (``Engine.prompt_kv_load_s``) out. ``--mode full``
prefills every prompt instead (the compiled sparse prefill the engine serves with, one graph per
chunk bucket; ``--eager-prefill``: the same chunks eagerly), and its throughput includes it.
Systems, same model and the same GPU pool tokens per layer:
- ``offload``: echo-compile with the KV in pinned host memory, a GPU pool of N_G rows per layer,
  compiled (CUDA graphs);
- ``gpu-only``: the KV on the device in a pool of N_G rows (the SGLang policy: the batch is bounded
  by how many whole requests fit), compiled;
- ``offload-eager``: offloading without CUDA graphs.

Selection locality. Random weights do not give real attention's temporal locality (the paper
measures GPU-pool hit rates of 0.97-0.99). The knob is ``--locality`` λ, the locality model planted
in the random weights (model/locality.py: a persistent per-token importance in the index scores of
layers >= 2, calibrated by benchmarks/calibrate_locality.py against the published consecutive-step
top-k overlap). ``--repeat`` is the earlier knob, off by default and kept only to reproduce the
results taken with it (``--locality 0 --repeat 1``): the probability that a request's next decode
input is its previous input token (``RepeatPrevious``, a logits processor on
``Engine.logits_processors``); it makes layer 0's queries repeat, which real models' 1-2% overlap
at layers 0-1 contradicts. The measured per-layer hit rate is reported next to every throughput
figure; do not read a throughput without it.

Weights: ``--weights awq`` / ``fp8`` serve the same random weights as the loader serves an AutoAWQ
/ official FP8 checkpoint of them (model/quantize.py; docs/quantization.md, "End to end"); each
run records its format and the weights' bytes on the device, next to its hit rates.

Runs: every system at every ``--gpu-pools`` size with all requests at once (Fig. 13), and at
``--rate-pool`` a Poisson rate sweep (Fig. 12); ``offload-eager`` at ``--eager-pools``, where the
eager steps of offload-eager and gpu-only are also profiled for the time breakdown
(echo_compile.bench.breakdown). Results are written after every run.
"""

# NOTE: no torch here: this module is the bench's --help (flags.py), which answers without the
# seconds torch takes to import (echo_compile/cli_args.py says why)

SYSTEMS = ("offload", "gpu-only", "offload-eager")
