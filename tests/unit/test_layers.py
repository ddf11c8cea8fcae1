"""The dependency rule: pure layers (errors, wire, model, cluster) import no clock, randomness,
I/O, trio or cffi, so the model stays a deterministic function of its events."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "cpgbroker"
PURE = [
    SRC / "errors.py",
    *sorted((SRC / "wire").glob("*.py")),
    *sorted((SRC / "model").glob("*.py")),
    *sorted((SRC / "cluster").glob("*.py")),
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
    "cpgbroker.cpg",
    "cpgbroker.dev.cluster",
    "cpgbroker.corosync._cpg",
)


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(SRC)))
def test_pure_module_imports(path: Path) -> None:
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            if name.split(".")[0] in FORBIDDEN or name.startswith(FORBIDDEN_PROJECT):
                bad.append(name)
    assert not bad, f"{path.name} imports {bad}"


def test_the_rule_sees_every_pure_package() -> None:
    assert any(p.parent.name == "model" for p in PURE)
    assert any(p.parent.name == "wire" for p in PURE)
