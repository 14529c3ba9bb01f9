"""Benchmarks and the reports made from their results (benchmarks/results/).

Run each as a module from the repository root, e.g. ``python -m benchmarks.bench_step --help``,
``python -m benchmarks.plot_results``; ``docs/benchmarks.md`` lists every results file with the
command that made it. The end-to-end benchmark is ``echo-compile bench`` (echo_compile/bench/).
The figures need matplotlib: ``pip install -e .[bench]``.
"""
