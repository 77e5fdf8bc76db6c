"""N nodes joining one run at once: every write of a forming round folds in the nodes that announced themselves.

torch's dynamic rendezvous keeps a run's whole state in one key, and each node adds itself to the round's
participants by a compare-and-set of that key. N nodes arriving together make N writers of one key: one wins
each time, the N - 1 others lose, read the state again and retry, so a round of N nodes costs O(N^2)
transactions, each carrying the whole O(N) state. On this machine 128 emulated nodes made 19,000 transactions
in two minutes and 256 made 44,000 in four without ever completing the round (``benchmarks/scale.py``; the
waiting participants' heartbeats, which torch writes the same way, could no longer get through and they were
dropped as dead).

So a node first *announces* that it joins (:class:`Joining`: a key of its own under ``rdzv-joining/<run>/``, on
a lease of its own, written without contention), then enters torch's rendezvous as before. Whoever writes a
forming round's state (a node adding itself, a heartbeat) adds every announced node that is not in it yet, as
torch's own ``_add_to_participants`` would (:func:`fold_joiners`): its heartbeat now, the last-call deadline once
the round has ``min_nodes``, complete with torch's ranks once it has ``max_nodes``. A node that finds itself
folded in writes nothing; it waits for the round like any participant. N nodes joining at once then cost a few
successful writes and at most about N lost ones, instead of about N^2 / 2.

Nothing else changes: a folded node that is lost before the round completes has no heartbeat after the fold's
and torch drops it as it drops any silent participant; an announcement is gone with its node's lease.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable
from datetime import datetime, timezone

import structlog
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _NodeDesc,
    _RendezvousState,
)

from unicron_elastic.store.client import StatusStore
from unicron_elastic.store.lease import KeptLease

log = structlog.get_logger(__name__)


def encode_node(node: _NodeDesc) -> bytes:
    """A node's identity in torch's rendezvous as the JSON of its announcement."""
    return json.dumps({"addr": node.addr, "pid": node.pid, "local_id": node.local_id}).encode()


def decode_node(raw: bytes) -> _NodeDesc | None:
    """The node of an announcement (None: not an announcement this version wrote)."""
    try:
        doc = json.loads(raw)
        return _NodeDesc(str(doc["addr"]), int(doc["pid"]), int(doc["local_id"]))
    except (ValueError, KeyError, TypeError):
        return None


def fold_joiners(state: _RendezvousState, joiners: Iterable[_NodeDesc], settings: RendezvousSettings,
                 now: datetime) -> list[_NodeDesc]:
    """Add the announced ``joiners`` to a forming round as torch's ``_add_to_participants`` adds a node.

    Only a round that is neither complete nor closed takes joiners; a node already a participant, or on the
    redundancy list (torch moves it itself), is left alone; no more than ``settings.max_nodes`` participants.

    Args:
        state: torch's state about to be written (changed in place).
        joiners: The announced nodes.
        settings: The run's rendezvous settings (``min_nodes``, ``max_nodes``, the last-call timeout).
        now: The heartbeat time of the added nodes.

    Returns:
        The nodes added, in order.
    """
    added: list[_NodeDesc] = []
    if state.complete or state.closed:
        return added
    for node in sorted(set(joiners)):
        if len(state.participants) >= settings.max_nodes:
            break
        if node in state.participants or node in state.redundancy_list:
            continue
        state.wait_list.discard(node)
        state.participants[node] = 0
        state.last_heartbeats[node] = now
        added.append(node)
        if len(state.participants) == settings.min_nodes:
            state.deadline = now + settings.timeout.last_call
        if len(state.participants) == settings.max_nodes:
            state.complete = True
            state.deadline = None
            for rank, participant in enumerate(sorted(state.participants)):
                state.participants[participant] = rank
    return added


class Folder:
    """The backend's hook: before a write of the state, fold in the announced nodes (one range read).

    Args:
        store: The status store.
        run_id: The run.
        settings: The handler's rendezvous settings.
        me: The handler's own node, never folded in by its own writes (it adds or removes itself as torch says:
            torch's exit from a round must not be undone by the fold).
    """

    def __init__(self, store: StatusStore, run_id: str, settings: RendezvousSettings, me: _NodeDesc) -> None:
        self._store, self._run_id, self._settings, self._me = store, run_id, settings, me

    def __call__(self, raw: bytes) -> bytes:
        """torch's pickled state with the announced nodes folded in (``raw`` itself when none was).

        Raises:
            StoreError: etcd refused or could not be reached.
        """
        state = pickle.loads(raw)  # noqa: S301 - torch's own state format (docs/rendezvous.md, "Security")
        if state.complete or state.closed:
            return raw
        joiners = [node for kv in self._store.get_prefix(self._store.keys.rdzv_joining(self._run_id))
                   if (node := decode_node(kv.value)) is not None and node != self._me]
        added = fold_joiners(state, joiners, self._settings, datetime.now(timezone.utc))
        if not added:
            return raw
        return pickle.dumps(state)


class Joining:
    """This node joins the run's next round: its announcements, on a lease of its own, until :meth:`close`.

    Args:
        store: The status store.
        run_id: The run.
        node: This node's identity in torch's rendezvous.
        ttl: The lease's TTL (seconds).
        waiting: Also announce it under ``rdzv-waiting/<run>/``: a round runs whose quiet nodes must heartbeat
            again meanwhile (:mod:`~unicron_elastic.rendezvous.quiet`).

    Raises:
        StoreError: etcd refused or could not be reached.
    """

    def __init__(self, store: StatusStore, run_id: str, node: _NodeDesc, ttl: int, waiting: bool = False) -> None:
        self.lease = KeptLease(store, ttl)
        try:
            store.put(store.keys.rdzv_joining(run_id, str(node)), encode_node(node), lease=self.lease.id)
            if waiting:
                store.put(store.keys.rdzv_waiting(run_id, str(node)), b"1", lease=self.lease.id)
        except BaseException:
            self.lease.close(revoke=True)
            raise

    def close(self) -> None:
        """Withdraw the announcements (revokes their lease)."""
        self.lease.close(revoke=True)
