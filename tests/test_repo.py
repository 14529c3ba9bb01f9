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


def test_the_readme_compile_example_defines_what_it_compiles():
    """The README's ``echo_compile.compile(model, ...)`` example binds every name its compile
    call reads (it compiled a ``model`` nothing defined); the step tensors stay placeholders."""
    import ast
    import builtins

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)\n```", readme, re.S)
    tree = ast.parse(next(b for b in blocks if "echo_compile.compile(" in b))
    bound = set(dir(builtins))
    for stmt in tree.body:
        calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call)]
        if any(ast.unparse(c.func) == "echo_compile.compile" for c in calls):
            used = {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)}
            assert used <= bound, f"the README's compile example reads {used - bound} unbound"
            return
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                bound.add(n.id)
            elif isinstance(n, ast.alias):
                bound.add((n.asname or n.name).split(".")[0])
    raise AssertionError("no echo_compile.compile call in the README's python blocks")
