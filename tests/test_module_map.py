"""The package's layout: no import circles, docs/architecture.md maps every module, the strategy registers.

Static (``ast``): lazy imports and ``TYPE_CHECKING`` imports count, since a
circle through them is still two modules that need each other.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import unicron_elastic

PACKAGE = Path(unicron_elastic.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(module: str, node: ast.Import | ast.ImportFrom, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules ``node`` imports (a name inside a module counts as that module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):  # (a package's own __init__ aside)
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of the package it imports``, lazy and ``TYPE_CHECKING`` imports included."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        graph[module] = set().union(*(_imported(module, node, path.name == "__init__.py", set(files))
                                      for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's import circles: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_module_map_names_every_module_once_with_one_job() -> None:
    text = ARCHITECTURE.read_text()
    section = text[text.index("## 5. Modules"):]
    listed = re.findall(r"^- `(unicron_elastic/[\w/]+\.py)`( \([^)]*\))?: \S", section, flags=re.MULTILINE)
    files = sorted(str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py"))
    assert sorted(path for path, _ in listed) == files
    assert [path for path, mark in listed if mark] == []  # no "(several jobs)"


@pytest.mark.parametrize("first", ["unicron_elastic.strategy.lightning.environment",  # (the order that once failed)
                                   *(pytest.param(order, marks=pytest.mark.e2e) for order in (
                                       "unicron_elastic.strategy.lightning",
                                       "unicron_elastic.strategy.lightning.megatron_strategy", "lightning.pytorch, unicron_elastic",
                                       "unicron_elastic, lightning.pytorch"))])
def test_the_strategy_registers_whichever_module_is_imported_first(first: str) -> None:
    code = (f"import {first}\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "assert 'unicron_megatron' in StrategyRegistry, 'not registered'\n")
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
