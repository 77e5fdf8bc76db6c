"""The process environment has one home: ``unicron_elastic/env.py`` names every ``UNICRON_*`` variable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import unicron_elastic
from unicron_elastic import env
from unicron_elastic.api import ConfigError

PACKAGE = Path(unicron_elastic.__file__).parent
VARIABLE = re.compile(r"\bUNICRON_[A-Z_]+\b")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def variables_named_outside_env() -> list[str]:
    """``path:line name`` of each string constant (not a docstring) naming a variable outside ``env.py``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "env.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno} {name}" for name in VARIABLE.findall(node.value)]
    return found


def test_no_module_but_env_names_a_variable() -> None:
    assert variables_named_outside_env() == []


def test_the_architecture_page_lists_every_variable_as_env_does() -> None:
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(UNICRON_[A-Z_]+)` \| (.+?) \| (.+?) \| (.+?) \|$", text, flags=re.MULTILINE)
    assert rows == [(v.name, v.set_by, v.read_by, v.format) for v in env.VARIABLES]
    assert len({v.name for v in env.VARIABLES}) == len(env.VARIABLES)


def test_integers_are_refused_with_the_variables_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.MAX_WORLD.name, "many")
    with pytest.raises(ConfigError, match="UNICRON_MAX_WORLD"):
        env.max_world(4)
    monkeypatch.setenv(env.ROUND.name, "-1")
    with pytest.raises(ConfigError, match="UNICRON_ROUND"):
        env.round_()
    monkeypatch.setenv(env.EVENT_RETENTION.name, "0")
    with pytest.raises(ConfigError, match="UNICRON_EVENT_RETENTION"):
        env.event_retention(1000)


def test_unset_variables_read_as_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in env.VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)
    assert (env.max_world(4), env.round_(), env.worker_restarts(), env.event_retention(1000)) == (4, 0, 0, 1000)
    assert (env.node_daemon(), env.daemon_pid(), env.meeting_text(), env.etcd_password()) == (None, None, None, None)
    assert env.first_incarnation()


def test_what_the_agent_and_the_daemon_write_is_what_the_readers_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (env.ROUND, env.MEETING, env.ETCD_PASSWORD):
        monkeypatch.setenv(variable.name, "")  # (restored after the test)
    monkeypatch.delenv(env.ETCD_PASSWORD.name)
    env.set_round(3)
    env.set_meeting('{"prefix": "p/"}', "secret")
    assert (env.round_(), env.meeting_text(), env.etcd_password()) == (3, '{"prefix": "p/"}', "secret")
    env.clear_meeting()
    assert env.meeting_text() is None
    assert env.respawn_env("n1", 2, 1) == {"UNICRON_INCARNATION": "n1.2.1", "UNICRON_WORKER_RESTARTS": "1"}
    launched = env.launcher_environment("n1", 42, None, base={})
    assert launched == {"UNICRON_NODE_DAEMON": "n1", "UNICRON_NODE_DAEMON_PID": "42"}
    monkeypatch.setattr("os.environ", {**launched})
    assert (env.node_daemon(), env.daemon_pid()) == ("n1", 42)
