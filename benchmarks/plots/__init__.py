"""The figures of docs/benchmarks.md, one module per results file (drawn by
benchmarks.plot_results); matplotlib is imported here only (``pip install -e .[bench]``)."""
