"""Package promises: importing a package registers its ops; no import cycle inside a package;
every ``echo::`` op passes ``torch.library.opcheck``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch
from test_decode_kernels import _att_inputs, _gen, make_indexer_inputs

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("custom_ops", "model", "runtime", "echo_compile")
ECHO_OPS = (
    "allocate", "free", "recall", "release", "release_layers", "offload", "indexer_topk",
    "sparse_mla_decode",
    "w4a16_linear", "moe_w4a16", "moe_bf16",
    "w4a16_linear_p", "moe_w4a16_p", "fp8_linear",
    "moe_fp8",
    "indexer_topk_prefetch", "recall_staged",
    "prefill_indexer_topk", "sparse_mla_prefill", "prefill_indexer_topk_gather",
)  # fmt: skip


def test_import_custom_ops_registers_every_op():
    """A fresh interpreter: ``import custom_ops`` alone makes every op callable (CPU kernel, a
    CUDA kernel of its own, fake), and leaves the Triton kernel modules unimported until a CUDA
    call needs them."""
    code = (
        "import sys, torch, custom_ops\n"
        f"for name in {ECHO_OPS!r}:\n"
        "    op = getattr(torch.ops.echo, name).default\n"
        "    for key in ('CPU', 'Meta'):  # CPU: the default (reference) kernel\n"
        "        assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), key)\n"
        "    # a CUDA kernel of its own (the default kernel would cover CUDA too, computed)\n"
        "    assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), 'CUDA'), name\n"
        "print(sorted(m for m in sys.modules if m.startswith('custom_ops.') and 'kernels' in m))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, at any depth (imports inside functions count: a lazy
    import is still a dependency), resolved to module names of this repository."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    names = {_module_name(p): p for p in files}
    graph = {}
    for name, path in names.items():
        deps = {d for d in _imports(path, name) if d in names and d != name}
        # a module importing its own package's __init__ (``from custom_ops import x``) is how
        # Python reaches a sibling, not a dependency on the package's contents
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def test_no_import_cycle_inside_a_package():
    graph = _graph()
    cycles, state = [], {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = "open"
        for d in sorted(graph[n]):
            if d.split(".")[0] != n.split(".")[0]:
                continue  # across packages the direction test below applies
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, [*stack, d])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


def test_dependency_direction():
    """custom_ops <- model <- runtime <- echo_compile, checked on every module at any depth."""
    rank = {p: i for i, p in enumerate(PACKAGES)}
    bad = [
        f"{n} imports {d}"
        for n, deps in _graph().items()
        for d in deps
        if rank[d.split(".")[0]] > rank[n.split(".")[0]]
    ]
    assert not bad, bad


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The checker itself: two modules importing each other (lazily) form a cycle it reports."""
    pkg = tmp_path / "custom_ops"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from custom_ops import b\n")
    (pkg / "b.py").write_text("from custom_ops.a import f\n")
    for other in PACKAGES[1:]:
        (tmp_path / other).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = _graph()
    assert graph["custom_ops.a"] == {"custom_ops.b"} and graph["custom_ops.b"] == {"custom_ops.a"}


def test_opcheck_indexer_topk():
    inp = make_indexer_inputs(3, 4, 8, [200, 17, 0], _gen(1))
    torch.library.opcheck(torch.ops.echo.indexer_topk.default, (*inp.values(), 64))


def test_opcheck_sparse_mla_decode():
    for fmt in ("bf16", "fp8"):
        q, pool, slots = _att_inputs(2, 4, 37, 100, fmt, 3, "cpu")
        scale = 192**-0.5
        op = torch.ops.echo.sparse_mla_decode.default
        torch.library.opcheck(op, (q, pool, slots, scale, fmt))


def test_every_package_is_packaged():
    """pyproject's package list names every directory of Python files of the four packages (a
    missing one installs from a checkout but not from a wheel), each with an __init__.py."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])  # fmt: skip
    dirs = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert dirs == listed
    assert all((ROOT / d.replace(".", "/") / "__init__.py").exists() for d in dirs)
