"""One name per concept: no identifier of the package uses a name the glossary retires.

The table "Retired names" of docs/architecture.md's glossary is read here, so the page and the check
stay one. Identifiers are names, attributes, parameters, keywords, imported names and the names of
functions and classes (prose in docstrings and comments is not checked); a line marked
``# deprecated alias, remove in 0.3`` may keep an old name for one release.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import unicron_elastic

PACKAGE = Path(unicron_elastic.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
ALIAS_MARK = "# deprecated alias, remove in 0.3"


def retired_table() -> list[tuple[frozenset[str], str]]:
    """``(names, package prefix)`` of each row of the glossary's "Retired names" table."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Glossary"):text.index("## 1.")]
    rows = re.findall(r"^\| (`[^|]+`) \| `([\w.]+)` \| [^|]+ \|$", section, flags=re.MULTILINE)
    return [(frozenset(re.findall(r"`(\w+)`", names)), prefix) for names, prefix in rows]


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


def retired_uses(module: str, source: str, table: list[tuple[frozenset[str], str]]) -> list[str]:
    """``module:line name`` of each identifier in ``source`` that the table retires for ``module``."""
    lines = source.splitlines()
    out = []
    for line, name in sorted(set(_identifiers(ast.parse(source)))):
        for names, prefix in table:
            if name in names and (module == prefix or module.startswith(prefix + ".")) \
                    and ALIAS_MARK not in lines[line - 1]:
                out.append(f"{module}:{line} {name}")
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


def test_the_check_finds_a_retired_name_and_spares_a_marked_alias() -> None:
    source = ("coordinate = 1\n"
              "def f(plan):\n    return plan\n"
              f"def coordinate_of(x):  {ALIAS_MARK}\n    return x\n"
              "kept_per_coordinate = f  " + ALIAS_MARK + "\n")
    table = retired_table()
    assert retired_uses("unicron_elastic.strategy.engine.scratch", source, table) == [
        "unicron_elastic.strategy.engine.scratch:1 coordinate",
        "unicron_elastic.strategy.engine.scratch:2 plan",
        "unicron_elastic.strategy.engine.scratch:3 plan"]
    assert retired_uses("unicron_elastic.agent.scratch", "plan = 1\n", table) == []  # (plan is retired in strategy/ only)
