"""The status store: unicron's typed layer over etcd v3 (see DESIGN.md).

* :class:`StatusStore` - JSON values, compare-and-set, reconnect.
* :class:`KeptLease` - leases with a keep-alive thread.
* :class:`PrefixWatch` - prefix watches that survive etcd restarts.
* :class:`LeaderElection` - election with a fencing token.
* :class:`EmbeddedEtcd` - a private etcd on loopback.
* :class:`Keys` - the key layout.
"""

from unicron_elastic.store.client import CasResult, KeyValue, StatusStore
from unicron_elastic.store.election import LeaderElection
from unicron_elastic.store.embedded import EmbeddedEtcd, find_etcd_binary, free_port
from unicron_elastic.store.keys import Keys
from unicron_elastic.store.lease import KeptLease
from unicron_elastic.store.watch import PrefixWatch, WatchEvent

__all__ = [
    "CasResult",
    "EmbeddedEtcd",
    "Keys",
    "KeptLease",
    "KeyValue",
    "LeaderElection",
    "PrefixWatch",
    "StatusStore",
    "WatchEvent",
    "find_etcd_binary",
    "free_port",
]
