"""The package's layout: declared layers, no import circles, docs/architecture.md maps every module, the strategy registers.

The benchmarks (``benchmarks/*.py``, which import each other by file name) have no import circles either.

Static (``ast``): lazy imports and ``TYPE_CHECKING`` imports count, since a
circle through them is still two modules that need each other.

The AST cannot see imports by name, which the layering therefore does not check:
``_lightning_hook.STRATEGY_MODULE`` (the late registration of the Lightning strategy, on purpose),
the lazy ``_EXPORTS`` tables of packages' ``__init__`` modules and ``rendezvous/__init__.py``'s table.
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
BENCHMARKS = PACKAGE.parent / "benchmarks"


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


#: The package's layers, bottom first (docs/architecture.md, "Layers"). A module's unit is the longest
#: name below that is the module or a package above it, else its top-level module or folder
#: (``(root)``: the package's ``__init__``). A unit may import units of lower layers only; inside one
#: unit anything goes (the circle test still holds). A new top-level module or folder is placed here.
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"api", "processes", "_lightning_hook", "_lazy"}),
    ("vocabulary", {"env", "events", "planner", "(root)"}),
    ("infrastructure", {"store", "detection", "coordinator.api", "worker", "logging", "faults", "agent.warm.api"}),
    ("contracts", {"agent.api", "rendezvous.api", "meeting", "cli_options", "slurm.api"}),
    ("services", {"rendezvous", "plugins", "strategy.snapshots", "slurm"}),
    ("engines", {"agent", "coordinator", "strategy.engine"}),
    ("runners", {"node", "coordinator.service", "sim", "launcher", "strategy.lightning"}),
    ("front", {"strategy", "testing"}),
    ("commands", {"cluster_cli"}),
    ("entry", {"cli"}),
]
LAYER = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}


def unit(module: str) -> str:
    """The layering unit of ``module`` (a dotted name of the package)."""
    name = module.removeprefix("unicron_elastic").removeprefix(".")
    if not name:
        return "(root)"
    parts = name.split(".")
    for length in range(len(parts), 0, -1):
        if ".".join(parts[:length]) in LAYER:
            return ".".join(parts[:length])
    return parts[0]


def back_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str, str, str]]:
    """``(importer, imported, its unit, their unit)`` for each import of a unit of the same layer or above."""
    found = []
    for importer in sorted(graph):
        for imported in sorted(graph[importer]):
            mine, theirs = unit(importer), unit(imported)
            if mine != theirs and LAYER.get(theirs, len(LAYERS)) >= LAYER.get(mine, -1):
                found.append((importer, imported, mine, theirs))
    return found


def _describe(arrows: list[tuple[str, str, str, str]]) -> str:
    names = {index: name for index, (name, _) in enumerate(LAYERS)}
    return "imports against the declared layers (tests/test_module_map.py LAYERS):\n" + "\n".join(
        f"  {importer} -> {imported}: {mine} ({names.get(LAYER.get(mine))}) may not import {theirs} "
        f"({names.get(LAYER.get(theirs))})" for importer, imported, mine, theirs in arrows)


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


def benchmark_graph() -> dict[str, set[str]]:
    """``module -> benchmarks/ modules it imports``, lazy imports included (a script's folder is on its path)."""
    files = {path.stem: path for path in BENCHMARKS.glob("*.py")}
    graph = {}
    for module, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.partition(".")[0])
        graph[module] = (imported & set(files)) - {module}
    return graph


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    assert cycles(import_graph()) == []


def test_no_benchmark_imports_itself_through_others() -> None:
    graph = benchmark_graph()
    assert {"_scale_emu", "_scale_report"} <= graph["scale"]  # (the graph sees lazy imports too)
    assert cycles(graph) == []


def test_every_unit_has_a_layer() -> None:
    assert sorted({unit(module) for module in import_graph()} - set(LAYER)) == []


def test_no_unit_imports_its_own_layer_or_above() -> None:
    arrows = back_arrows(import_graph())
    assert arrows == [], _describe(arrows)


def test_the_layering_finds_a_back_arrow() -> None:
    graph = {"unicron_elastic.rendezvous.rounds": {"unicron_elastic.agent.meeting_point", "unicron_elastic.rendezvous.api"},
             "unicron_elastic.rendezvous.api": set(), "unicron_elastic.agent.meeting_point": set()}
    assert back_arrows(graph) == [("unicron_elastic.rendezvous.rounds", "unicron_elastic.agent.meeting_point",
                                   "rendezvous", "agent")]


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


#: The most methods a class of the package has (Lightning's ``DDPStrategy`` has 29, ``FSDPStrategy`` 33, torch's
#: ``SimpleElasticAgent`` 22), the longest ``__init__`` and the longest module, in lines.
MOST_METHODS, LONGEST_INIT, LONGEST_MODULE = 35, 50, 700


def sizes() -> tuple[list[str], list[str], list[str]]:
    """Classes over :data:`MOST_METHODS` methods, ``__init__`` over :data:`LONGEST_INIT` lines, modules over
    :data:`LONGEST_MODULE` lines (``path:name count`` each)."""
    classes, inits, modules = [], [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source, where = path.read_text(), path.relative_to(PACKAGE.parent)
        if source.count("\n") > LONGEST_MODULE:
            modules.append(f"{where} {source.count(chr(10))}")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if len(methods) > MOST_METHODS:
                classes.append(f"{where}:{node.name} {len(methods)}")
            inits += [f"{where}:{node.name} {m.end_lineno - m.lineno + 1}" for m in methods
                      if m.name == "__init__" and m.end_lineno - m.lineno + 1 > LONGEST_INIT]
    return classes, inits, modules


def test_every_class_module_and_init_stays_small_enough_to_hold() -> None:
    assert sizes() == ([], [], [])


def _overrides_unmarked(cls: type) -> list[str]:
    """``Class.method`` for each method ``cls`` defines over one of a base from outside the package, without
    ``@override``."""
    foreign = [base for base in cls.__mro__[1:] if base is not object and not base.__module__.startswith("unicron")]
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_") and name.endswith("_") or not any(name in vars(base) for base in foreign):
            continue
        function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if callable(function) and not getattr(function, "__override__", False):
            found.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return found


def test_every_method_overriding_lightning_or_torch_says_so() -> None:
    import importlib
    import inspect

    modules = sorted(module for module in import_graph() if not module.endswith("__main__"))
    unmarked = []
    for name in modules:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name:
                unmarked += _overrides_unmarked(cls)
    assert unmarked == []
