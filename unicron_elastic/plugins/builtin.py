"""The default plugin: built-in behaviour, registered like any other plugin."""

from __future__ import annotations

from unicron_elastic.detection.severity import classify
from unicron_elastic.events import Classification
from unicron_elastic.plugins import hookimpl


@hookimpl(trylast=True)
def unicron_classify_exception(exc_type: str, message: str, traceback: str) -> Classification:
    """The severity table of paper Table 1 (see ``detection/severity.py``)."""
    return classify(exc_type, message)
