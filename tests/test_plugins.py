"""pluggy hooks: documentation, default plugin, isolation of crashing plugins."""

from __future__ import annotations

import inspect
from pathlib import Path

from conftest import REPO
from unicron_elastic.events import Classification, ErrorEvent, Severity
from unicron_elastic.plugins import hookimpl, hookspecs
from unicron_elastic.plugins.manager import call_isolated, classify_exception, plugin_manager


def _hook_names() -> list[str]:
    return [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("unicron_")]


def test_every_hook_is_documented() -> None:
    docs = Path(REPO, "docs", "hooks.md").read_text()
    missing = [name for name in _hook_names() if f"### `{name}(" not in docs]
    assert _hook_names() and not missing, missing


def test_every_hook_is_named_unicron_and_has_a_docstring() -> None:
    for name in _hook_names():
        assert inspect.getdoc(getattr(hookspecs, name)), name


def test_builtin_table_answers_by_default() -> None:
    pm = plugin_manager(load_entry_points=False)
    assert classify_exception(pm, "RuntimeError", "Connection reset by peer") == Classification(Severity.SEV3, "connection_reset")


class VendorPlugin:
    @hookimpl
    def unicron_classify_exception(self, exc_type, message, traceback):
        if "FlakyStorage" in exc_type:
            return Classification(Severity.SEV3, "storage")
        return None


class CrashingPlugin:
    @hookimpl(tryfirst=True)
    def unicron_classify_exception(self, exc_type, message, traceback):
        raise RuntimeError("plugin bug")

    @hookimpl
    def unicron_event(self, event):
        raise RuntimeError("plugin bug")


def test_plugin_extends_the_table() -> None:
    pm = plugin_manager(load_entry_points=False, extra=(VendorPlugin(),))
    assert classify_exception(pm, "FlakyStorageError", "") == Classification(Severity.SEV3, "storage")
    assert classify_exception(pm, "ValueError", "x").kind == "software"  # falls through to the table


def test_crashing_plugin_is_isolated_and_logged(capsys) -> None:
    seen = []

    class Recorder:
        @hookimpl
        def unicron_event(self, event):
            seen.append(event.kind)

    pm = plugin_manager(load_entry_points=False, extra=(CrashingPlugin(), VendorPlugin(), Recorder()))
    assert classify_exception(pm, "FlakyStorageError", "").kind == "storage"
    event = ErrorEvent(Severity.SEV2, "task_hang", "hang", "n1")
    call_isolated(pm, "unicron_event", event=event)
    assert seen == ["task_hang"]
    assert "plugin_hook_failed" in capsys.readouterr().out
