"""One name per concept: no identifier uses a name the glossary retires, in the package or around it.

The table "Retired names" of docs/architecture.md's glossary is read here, so the page and the check
stay one. In the package, identifiers are names, attributes, parameters, keywords, imported names and
the names of functions and classes (prose in docstrings and comments is not checked). No line is exempt:
0.2.0 removed the aliases 0.1.0 kept for one release.

Around the package (tests/, benchmarks/, examples/), a file's own local names are its own: what is
checked is what it uses of the package, the attributes it reads, the keywords it passes and the names
it imports, against each row whose package the file imports. In the Markdown pages (docs/, the README,
benchmarks/RESULTS.md; not the CHANGELOG, which names what was removed) the identifiers in code spans
and code blocks are checked against the rows of the package a page documents (``docs/strategy.md``:
``unicron_elastic.strategy``), or of the whole package for a page of several.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import unicron_elastic

PACKAGE = Path(unicron_elastic.__file__).parent
ROOT = PACKAGE.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: The folders of Python files around the package that are checked.
AROUND = ("tests", "benchmarks", "examples")
#: The Markdown pages that are checked.
PAGES = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md")

Table = list[tuple[frozenset[str], str]]


def retired_table() -> Table:
    """``(names, package prefix)`` of each row of the glossary's "Retired names" table."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Glossary"):text.index("## 1.")]
    rows = re.findall(r"^\| (`[^|]+`) \| `([\w.]+)` \| [^|]+ \|$", section, flags=re.MULTILINE)
    return [(frozenset(re.findall(r"`(\w+)`", names)), prefix) for names, prefix in rows]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _identifiers(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, identifier)`` of every name the module defines or uses."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.end_lineno or node.lineno, node.attr))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            found.append((node.value.lineno, node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.lineno, node.name))
        elif isinstance(node, ast.alias):
            found.append((node.lineno, (node.asname or node.name).rpartition(".")[2]))
    return found


def retired_uses(module: str, source: str, table: Table) -> list[str]:
    """``module:line name`` of each identifier in ``source`` that the table retires for ``module``."""
    return [f"{module}:{line} {name}" for line, name in sorted(set(_identifiers(ast.parse(source))))
            for names, prefix in table if name in names and _within(module, prefix)]


def _package_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, identifier)`` of what a file uses of the package: attributes, keywords, imported names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.append((node.end_lineno or node.lineno, node.attr))
        elif isinstance(node, ast.keyword) and node.arg:
            found.append((node.value.lineno, node.arg))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.rpartition(".")[2]) for alias in node.names]
    return found


def _imported_modules(tree: ast.AST) -> set[str]:
    """The package's modules (and the names in them) a file imports."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return {name for name in found if _within(name, "unicron_elastic")}


def retired_uses_around(label: str, source: str, table: Table) -> list[str]:
    """``label:line name`` of each use of the package in ``source`` by a name the table retires.

    A row counts where the file imports a module of its package (any of ``unicron_elastic`` for the
    rows of the whole package).
    """
    tree = ast.parse(source)
    modules = _imported_modules(tree)
    return [f"{label}:{line} {name}" for line, name in sorted(set(_package_uses(tree)))
            for names, prefix in table if name in names and any(_within(m, prefix) for m in modules)]


def page_scope(page: Path) -> str:
    """The package a Markdown page documents: ``unicron_elastic.<stem>`` where that module exists, else the whole."""
    stem = page.stem
    if (PACKAGE / stem).is_dir() or (PACKAGE / f"{stem}.py").is_file():
        return f"unicron_elastic.{stem}"
    return "unicron_elastic"


def _code(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of the code of a Markdown page: fenced blocks' lines and inline code spans."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            found.append((number, line))
        else:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
    return found


def retired_in_page(label: str, text: str, scope: str, table: Table) -> list[str]:
    """``label:line name`` of each identifier in the page's code that the table retires for ``scope``.

    The rows of the retired table itself are skipped (they name the old names on purpose).
    """
    rows = {line for line in text.splitlines() if re.match(r"^\| `[^|]+` \| `[\w.]+` \| [^|]+ \|$", line)}
    lines = text.splitlines()
    out = []
    for number, code in _code(text):
        if lines[number - 1] in rows:
            continue
        for name in sorted(set(re.findall(r"[A-Za-z_]\w*", code))):
            out += [f"{label}:{number} {name}" for names, prefix in table if name in names and _within(scope, prefix)]
    return out


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_glossary_retires_names() -> None:
    table = retired_table()
    assert len(table) >= 7 and all(names for names, _ in table)


def test_no_identifier_of_the_package_uses_a_retired_name() -> None:
    table = retired_table()
    found = [use for path in sorted(PACKAGE.rglob("*.py"))
             for use in retired_uses(_module(path), path.read_text(), table)]
    assert found == [], "names the glossary (docs/architecture.md) retires:\n" + "\n".join(found)


def test_no_test_benchmark_or_example_uses_the_package_by_a_retired_name() -> None:
    table = retired_table()
    found = [use for folder in AROUND for path in sorted((ROOT / folder).rglob("*.py"))
             for use in retired_uses_around(str(path.relative_to(ROOT)), path.read_text(), table)]
    assert found == [], "names the glossary (docs/architecture.md) retires:\n" + "\n".join(found)


def test_no_page_names_a_retired_identifier_in_its_code() -> None:
    table = retired_table()
    found = [use for page in PAGES
             for use in retired_in_page(str(page.relative_to(ROOT)), page.read_text(), page_scope(page), table)]
    assert found == [], "names the glossary (docs/architecture.md) retires:\n" + "\n".join(found)


def test_the_check_finds_a_retired_name_even_on_a_line_once_marked_as_an_alias() -> None:
    source = ("coordinate = 1\n"
              "def f(plan):\n    return plan\n"
              "def coordinate_of(x):\n    return x\n"
              "kept_per_coordinate = f  # deprecated alias, remove in 0.3\n")
    table = retired_table()
    assert retired_uses("unicron_elastic.strategy.engine.scratch", source, table) == [
        "unicron_elastic.strategy.engine.scratch:1 coordinate",
        "unicron_elastic.strategy.engine.scratch:2 plan",
        "unicron_elastic.strategy.engine.scratch:3 plan",
        "unicron_elastic.strategy.engine.scratch:6 kept_per_coordinate"]
    assert retired_uses("unicron_elastic.agent.scratch", "plan = 1\n", table) == []  # (plan is retired in strategy/ only)


def test_the_check_around_the_package_finds_what_a_file_uses_of_it() -> None:
    source = ("from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel\n"
              "from unicron_elastic.worker import SOCKET_ENV\n"
              "plan = 1\n"
              "e = ElasticDataParallel(plan=plan)\n"
              "e.leader\n")
    table = retired_table()
    assert retired_uses_around("tests/scratch.py", source, table) == [
        "tests/scratch.py:2 SOCKET_ENV", "tests/scratch.py:4 plan", "tests/scratch.py:5 leader"]
    coordinator = "from unicron_elastic.coordinator.api import ClusterPlan\nstate.plan.leader\n"
    assert retired_uses_around("tests/scratch.py", coordinator, table) == []  # (the coordinator's plan and leader)


def test_the_check_of_a_page_reads_its_code_only() -> None:
    table = retired_table()
    text = ("The plan and the leader, in prose.\n"
            "Pass `schedule=` to the strategy.\n"
            "```python\nlayout.coordinate(rank)\n```\n")
    assert retired_in_page("docs/strategy.md", text, "unicron_elastic.strategy", table) == [
        "docs/strategy.md:2 schedule", "docs/strategy.md:4 coordinate"]
    assert retired_in_page("docs/coordinator.md", text, "unicron_elastic.coordinator", table) == [
        "docs/coordinator.md:4 coordinate"]
    assert page_scope(ROOT / "docs" / "strategy.md") == "unicron_elastic.strategy"
    assert page_scope(ROOT / "docs" / "decisions.md") == "unicron_elastic"
