"""The docs stay true to the code: every module path and nextoken class ARCHITECTURE.md names exists, it stays under
150 lines, every `nextoken <command>` the README shows is a real subcommand with real options, and every relative
link in README.md, ARCHITECTURE.md and docs/ points to a file that exists.

Each check is a function that returns what it found wrong, so the last tests can hold the checks themselves to
catching a wrong name."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from nextoken.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
MAX_ARCHITECTURE_LINES = 150
# Backticked paths in these folders must exist in the tree.
TREE_PREFIXES = ("nextoken/", "tests/", "benchmarks/", "scripts/", "docs/")

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
# A nextoken class, optionally with one attribute: `LLMEngine`, `Scheduler.schedule`, `ForwardBatch.build()`.
CLASS_NAME = re.compile(r"^([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)(?:\.([A-Za-z_]\w*))?(?:\(\))?$")
COMMAND_SEPARATORS = {"|", "||", "&&", ";", "&"}


def code_spans(text: str) -> list[str]:
    """Inline code outside fenced blocks."""
    return CODE_SPAN.findall(FENCE.sub("", text))


def fenced_lines(text: str) -> list[str]:
    return [line for block in FENCE.findall(text) for line in block.splitlines()[1:-1]]


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Backticked tree paths (`nextoken/engine/scheduler.py`) and dotted modules (`nextoken.engine.scheduler`) that
    do not exist under `root`."""
    missing = []
    for span in code_spans(text):
        if span.startswith(TREE_PREFIXES):
            if not (root / span).exists():
                missing.append(span)
        elif re.fullmatch(r"nextoken(\.\w+)+", span):
            path = root / span.replace(".", "/")
            if not (path.with_suffix(".py").exists() or (path / "__init__.py").exists()):
                missing.append(span)
    return missing


@cache
def defined_names(package: Path = ROOT / "nextoken") -> dict[str, set[str]]:
    """Every class defined in the package -> its methods, class-level names and the `self.x` it assigns."""
    classes: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = classes.setdefault(node.name, set())
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    for target in targets:
                        if isinstance(target, ast.Name):
                            names.add(target.id)
                        elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                              and target.value.id == "self"):
                            names.add(target.attr)
    return classes


def unknown_classes(text: str, classes: dict[str, set[str]]) -> list[str]:
    """Backticked class names (and `Class.attribute`) that nextoken does not define."""
    unknown = []
    for span in code_spans(text):
        match = CLASS_NAME.match(span)
        if match is None:
            continue
        cls, attr = match.groups()
        if cls not in classes or (attr is not None and attr not in classes[cls]):
            unknown.append(span)
    return unknown


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the CLI parser has no subcommands")


def commands_in(line: str) -> list[list[str]]:
    """The argument lists of every `nextoken ...` command on a shell line (`.venv/bin/nextoken` too)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    found, start = [], True
    for i, word in enumerate(words):
        if start and (word == "nextoken" or word.endswith("/nextoken")):
            rest = words[i + 1:]
            end = next((k for k, w in enumerate(rest) if w in COMMAND_SEPARATORS), len(rest))
            found.append(rest[:end])
        start = word in COMMAND_SEPARATORS
    return found


def bad_commands(text: str, parser: argparse.ArgumentParser) -> list[str]:
    """`nextoken <command> --option` in code (fenced or inline) whose command or option the CLI does not have."""
    commands = subcommands(parser)
    bad = []
    for line in fenced_lines(text) + code_spans(text):
        for args in commands_in(line):
            if not args:
                continue
            sub = commands.get(args[0])
            if sub is None:
                bad.append(f"nextoken {args[0]}")
                continue
            for arg in args[1:]:
                option = arg.split("=", 1)[0]
                if option.startswith("-") and option != "-" and option not in sub._option_string_actions:
                    bad.append(f"nextoken {args[0]} {option}")
    return bad


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(path.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    return broken


def test_architecture_names_only_modules_that_exist() -> None:
    text = ARCHITECTURE.read_text()
    named = [s for s in code_spans(text) if s.startswith("nextoken/")]
    assert len(named) > 40, "ARCHITECTURE.md should name nextoken's modules as `nextoken/package/module.py`"
    assert missing_paths(text) == []


def test_architecture_names_only_classes_that_exist() -> None:
    assert unknown_classes(ARCHITECTURE.read_text(), defined_names()) == []


def test_architecture_is_short() -> None:
    num_lines = len(ARCHITECTURE.read_text().splitlines())
    assert num_lines < MAX_ARCHITECTURE_LINES, f"ARCHITECTURE.md has {num_lines} lines"


def test_readme_shows_only_real_commands_and_options() -> None:
    text = README.read_text()
    shown = {args[0] for line in fenced_lines(text) for args in commands_in(line) if args}
    assert {"run", "chat", "serve", "trace"} <= shown, f"the README's tour shows {sorted(shown)}"
    assert bad_commands(text, build_parser()) == []


def test_readme_names_only_paths_that_exist() -> None:
    assert missing_paths(README.read_text()) == []


@pytest.mark.parametrize("path", [README, ARCHITECTURE, *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(path: Path) -> None:
    assert broken_links(path) == []


# The checks must be able to fail.

def test_a_wrong_module_path_is_caught() -> None:
    text = "`nextoken/engine/scheduler.py` and `nextoken/engine/planner.py`, `nextoken.engine.runner`, `nextoken.x`"
    assert missing_paths(text) == ["nextoken/engine/planner.py", "nextoken.x"]


def test_a_wrong_class_or_method_is_caught() -> None:
    text = "`LLMEngine.step`, `Scheduler.update`, `BenchConfig`, `ForwardBatch.build()`, `Request.num_computed_tokens`"
    assert unknown_classes(text, defined_names()) == ["Scheduler.update", "BenchConfig"]


def test_a_wrong_command_or_option_is_caught() -> None:
    text = ("```bash\nnextoken run --max-tokens 8 \"hi\"  # --fake in a comment is fine\n"
            "echo hi | .venv/bin/nextoken bench --model x\nnextoken trace --html=t.html --colour x\n```\n"
            "`from nextoken import LLM` and `nextoken serve --port 0`\n")
    assert bad_commands(text, build_parser()) == ["nextoken bench", "nextoken trace --colour"]


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("")
    page = tmp_path / "page.md"
    page.write_text("[a](there.md) [b](missing.md#part) [c](https://example.com/x.md) [d](#section)")
    assert broken_links(page) == ["missing.md#part"]
