"""The ``unicron`` rendezvous backend for torchrun (``--rdzv-backend=unicron``).

torch's :class:`DynamicRendezvousHandler` over an etcd v3 backend; registered
through the ``torchrun.handlers`` entry point (``entrypoint.handler_factory``),
so plain ``torchrun`` finds it. Names are imported lazily: importing this
package must not import torch's rendezvous package (see ``entrypoint.py``).
"""

from __future__ import annotations

from unicron_elastic._lazy import lazy_exports

_EXPORTS = {
    "UnicronRendezvousBackend": "backend",
    "decode_state": "backend",
    "encode_state": "backend",
    "JoinGate": "gate",
    "JoinRequest": "gate",
    "OpenGate": "gate",
    "RunFinished": "handler",
    "UnicronRendezvousHandler": "handler",
    "create_handler": "handler",
    "handler_factory": "entrypoint",
    "KNOWN_KEYS": "options",
    "BackendOptions": "options",
    "parse_options": "options",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
