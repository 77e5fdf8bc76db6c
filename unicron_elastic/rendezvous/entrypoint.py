"""The ``torchrun.handlers`` entry point, kept free of imports.

torch loads out-of-tree handlers while ``torch.distributed.elastic.rendezvous``
is being imported, which can happen in the middle of importing our own
rendezvous modules (e.g. ``unicron_elastic.rendezvous.backend`` imports torch's
rendezvous package). Importing the handler here would then be circular and the
``unicron`` backend would silently fail to register, so the factory defers
every import to the moment a handler is actually created.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def handler_factory() -> Callable[[Any], Any]:
    """Entry point of group ``torchrun.handlers``: torchrun calls it with no arguments."""

    def create(params: Any) -> Any:
        from unicron_elastic.rendezvous.handler import create_handler

        return create_handler(params)

    return create
