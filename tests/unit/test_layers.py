"""The dependency rule (docs/architecture.md): layers, pure packages, no import cycles.

Three lines of defence:

* import-linter's contracts in ``pyproject.toml`` (``[tool.importlinter]``): the layers, the
  pure packages' forbidden imports (no clock, randomness, I/O, trio or cffi), who may import the
  runtime and the audit, and no cycles between sibling modules or packages. Run here as
  ``lint-imports`` (scripts/test.sh runs it too), and proven to catch planted violations in a
  copy of the source.
* grimp's graph (import-linter's) searched for cycles between single modules, which also sees a
  cycle through a package's ``__init__`` (``acyclic_siblings`` compares siblings only).
* an AST walk over the pure modules for what grimp cannot see at all: imports of the compiled
  corosync modules (``_cpg``, ``_quorum`` have no Python source).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "cpgbroker"
PURE = [
    SRC / "errors.py",
    *sorted((SRC / "wire").glob("*.py")),
    *sorted((SRC / "model").rglob("*.py")),
    *sorted((SRC / "cluster").glob("*.py")),
    SRC / "corosync" / "events.py",
]
FORBIDDEN = {
    "time",
    "random",
    "uuid",
    "os",
    "socket",
    "threading",
    "asyncio",
    "logging",
    "trio",
    "cffi",
    "secrets",
    "subprocess",
    "select",
}
FORBIDDEN_PROJECT = (
    "cpgbroker.runtime",
    "cpgbroker.dev",
    "cpgbroker.cli",
    "cpgbroker.deploy",
    "cpgbroker.audit",
    "cpgbroker.corosync._cpg",
    "cpgbroker.corosync._quorum",
    "cpgbroker.corosync._cmap",
    "cpgbroker.corosync.cmap",
    "cpgbroker.corosync.cpg",
    "cpgbroker.corosync.votequorum",
    "cpgbroker.corosync.errors",
)
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` run in ``root`` (its ``pyproject.toml`` holds the contracts) over the
    package in ``root/src``."""
    env = dict(os.environ, PYTHONPATH=str(root / "src"), COLUMNS="200", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_import_contracts_are_kept() -> None:
    res = lint_imports(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_planted_violations_are_reported(tmp_path: Path) -> None:
    copy = tmp_path / "src" / "cpgbroker"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.o"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")

    def plant(rel: str, line: str) -> None:
        path = copy / rel
        path.write_text((path.read_text() if path.exists() else "") + line + "\n")

    plant("model/events.py", "import trio")
    plant("errors.py", "import time")
    plant("wire/framer.py", "from cpgbroker.runtime.amqp import server")
    plant("wire/_planted_a.py", "from cpgbroker.wire import _planted_b")
    plant("wire/_planted_b.py", "from cpgbroker.wire import _planted_a")
    res = lint_imports(tmp_path)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    for expected in (
        # pure packages: trio and the clock
        "cpgbroker.model.events -> trio",
        "cpgbroker.errors -> time",
        "cpgbroker.wire is not allowed to import cpgbroker.runtime",  # layers
        "Illegal imports of protected package cpgbroker.runtime",
        "cpgbroker.wire.framer -> cpgbroker.runtime",
        "No cycles are allowed in cpgbroker.wire.",
    ):
        assert expected in out, f"{expected!r} not reported:\n{out}"
    assert "._planted_a -> ._planted_b" in out or "._planted_b -> ._planted_a" in out, out
    broken = [line for line in out.splitlines() if line.endswith(" BROKEN")]
    for contract in ("Layers:", "Pure packages:", "Only the command line", "No import cycles"):
        assert any(line.startswith(contract) for line in broken), (contract, broken)


def import_cycles(package: str, path: Path) -> list[list[str]]:
    """Every set of modules of ``package`` (found on ``path``) that import each other in a
    circle (strongly connected components of grimp's graph, Tarjan's algorithm)."""
    sys.path.insert(0, str(path))
    try:
        graph = grimp.build_graph(package, cache_dir=None)
    finally:
        sys.path.remove(str(path))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle_between_modules() -> None:
    assert import_cycles("cpgbroker", ROOT / "src") == []


def test_a_cycle_through_a_package_init_is_seen(tmp_path: Path) -> None:
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from cyc.a import A\n")
    (pkg / "a.py").write_text("import cyc\nA = 1\n")
    assert import_cycles("cyc", tmp_path) == [["cyc", "cyc.a"]]


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(SRC)))
def test_pure_module_imports(path: Path) -> None:
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in FORBIDDEN or name.startswith(FORBIDDEN_PROJECT):
                bad.append(name)
    assert not bad, f"{path.name} imports {bad}"


def test_the_rule_sees_every_pure_package() -> None:
    assert any(p.parent.name == "model" for p in PURE)
    # ... and the model's rooms (model/routing/, model/messages/, ...).
    assert any(p.parent.parent.name == "model" for p in PURE)
    assert any(p.parent.name == "wire" for p in PURE)
    assert any(p.parent.name == "cluster" for p in PURE)
