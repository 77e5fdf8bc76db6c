"""A running round's torch heartbeats, replaced by the nodes' leases (``unicron-run`` only).

torch's dynamic rendezvous keeps every node's heartbeat in the run's one state key: each node rewrites the
whole state (compare-and-set) every ``keep_alive_interval`` and reads it about once a second (torch's agent asks
``num_nodes_waiting`` at each monitor interval, served from a state at most a second old). The state grows with
the run's nodes, so a running round of N nodes costs etcd O(N) bytes per node per second, O(N^2) in all, and its N
writers contend on one key (measured: ``benchmarks/scale.py``). Under ``unicron-run`` the nodes of a running round
are known alive another way: each agent's place key in the round's meeting space, on its node's lease. So while
its round runs, a node is *quiet*:

* it sends no torch heartbeat and does not read torch's state: ``num_nodes_waiting`` counts the announcements
  under ``rdzv-waiting/<run>/`` instead, one count-only read every ``keep_alive_interval``;
* a node that enters torch's rendezvous while a round is complete (to grow the run by a restart of every node,
  or because its own workers are restarted all together) first *stamps* torch's heartbeat of every participant
  whose place is held by that participant's agent (:func:`stamp_live`: one compare-and-set), then *announces*
  itself (:class:`~unicron_elastic.rendezvous.fold.Joining` with ``waiting``: a key on a lease of its own, gone
  with it). torch's own check (a participant
  without a heartbeat for ``keep_alive_interval x keep_alive_max_attempt`` is dead and removed) then removes only
  the nodes that are gone;
* the same look (:func:`look`, one request) reads the revision of torch's state; only when it changed is the
  state read and decoded, so a corrupt state stops the node as torch's own sync would;
* a quiet node that sees an announcement sends torch's heartbeats again and answers ``num_nodes_waiting`` from
  torch's state (the stamps keep it alive until its own heartbeats take over), until no announcement is left.

The stamp reads torch's state as torch's own state owner does (it is torch's pickle: see docs/rendezvous.md,
"Security": whoever can write etcd can already run code in every agent through it).
"""

from __future__ import annotations

import pickle
import random
import time
from datetime import datetime, timezone
from typing import NamedTuple

import structlog
from torch.distributed.elastic.rendezvous import RendezvousStateError

from unicron_elastic.store.client import StatusStore
from unicron_elastic.store.keys import MeetingKeys

log = structlog.get_logger(__name__)

#: Compare-and-set attempts of one stamp (conflicts come from nodes joining or heartbeating meanwhile).
STAMP_ATTEMPTS = 50


def live_places(store: StatusStore, run_id: str, round_: int) -> dict[int, int]:
    """The places of round ``round_`` whose agent is alive, with the PID in each one's owner (-1 if unknown).

    Raises:
        StoreError: etcd refused or could not be reached.
    """
    from unicron_elastic.rendezvous.api import PlaceOwner

    prefix = f"{store.keys.meeting(run_id)}{int(round_)}/{MeetingKeys.PLACES}"
    out = {}
    for kv in store.get_prefix(prefix):
        suffix = kv.key[len(prefix):]
        if suffix.isdigit():
            owner = PlaceOwner.decode(kv.value)
            out[int(suffix)] = owner.pid if owner is not None else -1
    return out


def stamp_live(backend, store: StatusStore, run_id: str) -> int | None:
    """Refresh torch's heartbeat of every participant of a complete round whose place its own agent holds.

    Args:
        backend: The run's :class:`~unicron_elastic.rendezvous.backend.UnicronRendezvousBackend`.
        store: The status store.
        run_id: The run.

    Returns:
        How many participants were stamped; None when torch's state holds no complete round (nothing runs
        quiet: nobody to tell).

    Raises:
        StoreError: etcd refused or could not be reached.
        RuntimeError: The stamp lost :data:`STAMP_ATTEMPTS` compare-and-sets in a row.
    """
    for attempt in range(STAMP_ATTEMPTS):
        current = backend.get_state()
        if current is None:
            return None
        raw, token = current
        state = pickle.loads(raw)  # noqa: S301 - torch's own state format (see the module doc)
        if not state.complete or state.closed:
            return None
        alive = live_places(store, run_id, state.round)
        now = datetime.now(timezone.utc)
        stamped = [node for node, place in state.participants.items() if alive.get(place) == node.pid]
        if not stamped:
            return 0
        for node in stamped:
            state.last_heartbeats[node] = now
        result = backend.set_state(pickle.dumps(state), token)
        if result is None or result[2]:
            log.info("rendezvous_heartbeats_stamped", run_id=run_id, round=state.round, participants=len(stamped),
                     of=len(state.participants))
            return len(stamped)
        time.sleep(random.uniform(0, min(1.0, 0.01 * 2 ** attempt)))
    raise RuntimeError(f"the heartbeats of run {run_id!r} could not be stamped: {STAMP_ATTEMPTS} conflicts in a row")


class Look(NamedTuple):
    """What a quiet node's look found.

    Attributes:
        checked: The revision of torch's state now checked (None: there is no state).
        waiting: How many nodes announced they enter the run's rendezvous.
        round: torch's round in the state, when the state was read (written since the last look).
    """

    checked: int | None
    waiting: int
    round: int | None = None


def look(backend, store: StatusStore, run_id: str, checked: int | None) -> Look:
    """A quiet node's look, one request: the announcements, and torch's state checked if it was written.

    A quiet node does not sync torch's state, so this is where a state that cannot be read is found, as
    torch's own sync would find it: the state is read and decoded only when its revision is not ``checked``.

    Args:
        backend: The run's :class:`~unicron_elastic.rendezvous.backend.UnicronRendezvousBackend`.
        store: The status store.
        run_id: The run.
        checked: The state's revision at the last look (None: never looked).

    Returns:
        The revision now checked, how many nodes announced they enter the run's rendezvous, and torch's
        round when the state was read.

    Raises:
        RendezvousStateError: The state in etcd is corrupt.
        StoreError: etcd refused or could not be reached (the look).
        RendezvousConnectionError: etcd stayed unreachable (the read of a state written since).
    """
    revision, waiting = store.revision_and_count(backend.key, store.keys.rdzv_waiting(run_id))
    if revision is None or revision == checked:
        return Look(revision, waiting)
    current = backend.get_state()  # (decodes the document: RendezvousStateError when it is not one)
    if current is None:
        return Look(None, waiting)
    try:
        state = pickle.loads(current[0])  # noqa: S301 - torch's own state format (see the module doc)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes make pickle raise
        raise RendezvousStateError("The rendezvous state is corrupt. See inner exception for details.") from exc
    round_ = getattr(state, "round", None)
    return Look(current[1], waiting, round_ if isinstance(round_, int) else None)


def announced(store: StatusStore, run_id: str) -> int:
    """How many nodes announced they are entering the run's rendezvous (one count-only read).

    Raises:
        StoreError: etcd refused or could not be reached.
    """
    return store.count_prefix(store.keys.rdzv_waiting(run_id))

