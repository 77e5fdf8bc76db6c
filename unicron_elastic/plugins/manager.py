"""The plugin manager: default plugin, entry-point plugins, isolated hook calls."""

from __future__ import annotations

from typing import Any

import pluggy
import structlog

from unicron_elastic.events import Classification
from unicron_elastic.plugins import builtin, hookspecs
from unicron_elastic.plugins.hookspecs import PROJECT

log = structlog.get_logger(__name__)


def plugin_manager(load_entry_points: bool = True, extra: tuple[object, ...] = (),
                   builtins: tuple[object, ...] = ()) -> pluggy.PluginManager:
    """A manager with all hooks, the default plugin, ``builtins``, entry-point plugins and ``extra``.

    ``builtins`` are the caller's own built-in plugins (the agent's detectors): registered right
    after the default plugin and before entry points, so an installed plugin still overrides them.
    A plugin whose import fails is logged and skipped.
    """
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name="unicron-builtin")
    for plugin in builtins:
        pm.register(plugin)
    if load_entry_points:
        try:
            pm.load_setuptools_entrypoints(PROJECT)
        except Exception:  # noqa: BLE001 - one broken plugin must not stop the agent
            log.exception("plugin_load_failed")
    for plugin in extra:
        pm.register(plugin)
    return pm


def call_isolated(pm: pluggy.PluginManager, hook_name: str, firstresult: bool = False, **kwargs: Any) -> Any:
    """Call a hook, one implementation at a time; a raising plugin is logged and skipped.

    Implementations run in pluggy's order (``tryfirst`` first, LIFO otherwise,
    ``trylast`` last).

    Returns:
        For ``firstresult`` the first non-None result (or None), else the list
        of non-None results.
    """
    results = []
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        try:
            result = impl.function(**{name: kwargs[name] for name in impl.argnames})
        except Exception as exc:  # noqa: BLE001 - isolation is the point
            log.error("plugin_hook_failed", plugin=impl.plugin_name, hook=hook_name, error=repr(exc))
            continue
        if result is not None:
            if firstresult:
                return result
            results.append(result)
    return None if firstresult else results


def classify_exception(pm: pluggy.PluginManager, exc_type: str, message: str, traceback: str = "") -> Classification:
    """Classify through the plugins; the built-in table always answers last."""
    result = call_isolated(pm, "unicron_classify_exception", firstresult=True,
                           exc_type=exc_type, message=message, traceback=traceback)
    if not isinstance(result, Classification):
        return builtin.unicron_classify_exception(exc_type, message, traceback)
    return result
