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


def imported_names(path: Path) -> set[str]:
    """Every module and every name imported from one (`from a.b import c` gives a.b and a.b.c), TYPE_CHECKING
    imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


# Loading apart from quantizing: the models hold the math; the loader keeps the file's storage and the quantization
# pass (with the block modules and the fused path over them) chooses each layer's format.
QUANTIZATION = ("nextoken.ops.quant_linear", "nextoken.ops.quantize", "nextoken.ops.fused", "nextoken.loader.codec",
                "nextoken.loader.weights", "gguf")


def test_models_import_nothing_of_quantization() -> None:
    for path in (PACKAGE / "models").rglob("*.py"):
        bad = sorted(m for m in imported_names(path)
                     if any(m == q or m.startswith(q + ".") for q in QUANTIZATION))
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_the_loader_imports_nothing_of_quantization() -> None:
    for path in (PACKAGE / "loader").rglob("*.py"):
        bad = sorted(m for m in imported_names(path) if m.startswith(("nextoken.ops.quant", "nextoken.ops.fused")))
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"
