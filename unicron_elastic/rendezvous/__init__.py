"""The ``unicron`` rendezvous backend for torchrun (``--rdzv-backend=unicron``).

torch's :class:`DynamicRendezvousHandler` over an etcd v3 backend; registered
through the ``torchrun.handlers`` entry point, so plain ``torchrun`` finds it.
"""

from unicron_elastic.rendezvous.backend import UnicronRendezvousBackend, decode_state, encode_state
from unicron_elastic.rendezvous.gate import JoinGate, JoinRequest, OpenGate
from unicron_elastic.rendezvous.handler import UnicronRendezvousHandler, create_handler, handler_factory
from unicron_elastic.rendezvous.options import KNOWN_KEYS, BackendOptions, parse_options

__all__ = [
    "KNOWN_KEYS",
    "BackendOptions",
    "JoinGate",
    "JoinRequest",
    "OpenGate",
    "UnicronRendezvousBackend",
    "UnicronRendezvousHandler",
    "create_handler",
    "decode_state",
    "encode_state",
    "handler_factory",
    "parse_options",
]
