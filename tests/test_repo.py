"""Repository promises: CI runs exactly the README's test command; committed GPU results come
from the GPU. (The dependency direction is checked in test_package.py.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(b for b in blocks if "pytest" in b).strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in [line.strip() for line in ci]


def test_committed_results_come_from_the_gpu():
    """benchmarks/results/*_h200.json are H200 measurements: a CPU dry run (or a test) that wrote
    to the default output path would show up here."""
    import json

    files = sorted((ROOT / "benchmarks" / "results").glob("*_h200*.json"))
    assert files
    for f in files:
        d = json.loads(f.read_text())
        assert "H200" in str(d.get("environment", d).get("device")), f.name
