"""The one-way dependencies of ARCHITECTURE.md: the math and text layers never reach up into the engine, the server
or the tracer; the cache depends on nothing of ours but config."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nextoken"
FORBIDDEN = {
    "models": ("nextoken.engine", "nextoken.server", "nextoken.trace", "nextoken.llm", "nextoken.cli"),
    "ops": ("nextoken.engine", "nextoken.server", "nextoken.trace", "nextoken.llm", "nextoken.cli"),
    "tokenizer": ("nextoken.engine", "nextoken.server", "nextoken.trace", "nextoken.models", "nextoken.llm"),
    "loader": ("nextoken.engine", "nextoken.server", "nextoken.trace", "nextoken.llm", "nextoken.cli"),
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(layer: str) -> None:
    for path in (PACKAGE / layer).rglob("*.py"):
        bad = [m for m in imports_of(path) if m.startswith(FORBIDDEN[layer])]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_cache_imports_only_config() -> None:
    for path in (PACKAGE / "cache").rglob("*.py"):
        ours = [m for m in imports_of(path) if m.startswith("nextoken")]
        assert all(m == "nextoken.config" for m in ours), f"{path.name} imports {ours}"
