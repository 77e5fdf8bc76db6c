"""pluggy plugins: hook specifications, the default plugin and the plugin manager.

Third-party plugins are found through the entry-point group ``unicron_elastic``.
"""

import pluggy

from unicron_elastic.plugins.hookspecs import PROJECT

hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["PROJECT", "hookimpl"]
