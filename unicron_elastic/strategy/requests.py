"""The join and leave requests' counter in the meeting store, read by the leader off the step's critical path.

Ranks that want to join, and agents that ask their ranks to leave, add one
to :attr:`~unicron_elastic.store.keys.MeetingKeys.JOIN_REQUESTS`; the group's
leader reads it every step for the next step's members. The read of step
*s* + 1's requests begins in a thread when step *s* begins computing, so the
last bucket, in which every other rank waits, carries no store round trip.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as StillReading
from typing import Any

import structlog

from unicron_elastic.store.keys import MeetingKeys as K

log = structlog.get_logger(__name__)

#: How long the leader's read of the join/leave requests rides out an etcd outage before it reports
#: none (training goes on; the requests are seen at a later step).
REQUESTS_PATIENCE_S = 1.0
#: How long the end of a step waits for the read begun while it computed. A read still pending then
#: (etcd failing over to another member, which takes up to a leader election) counts as no request:
#: they are seen at a later step, and the leader's step does not stall long enough to be taken for a
#: hang (``--hang-min-silence``, 0.5 s by default).
STEP_END_WAIT_S = 0.2


class RequestReader:
    """The request counter of one rank's meeting store.

    Args:
        store: The meeting store (a c10d store; etcd's ``read_int`` bounds the wait in an outage).
        rank: This launch rank (whose leave request :meth:`withdraw_leave` forgets).
    """

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        #: The read thread (started by the first :meth:`prefetch`).
        self.reader: ThreadPoolExecutor | None = None
        #: ``(step, its read)``: the read begun while ``step`` computed, not taken yet.
        self.prefetched: tuple[int, Future[int]] | None = None

    def count(self) -> int:
        """The join/leave request counter (0 if absent).

        Raises:
            StoreUnavailableError: etcd stayed unreachable for :data:`REQUESTS_PATIENCE_S`.
        """
        if hasattr(self.store, "read_int"):
            return self.store.read_int(K.JOIN_REQUESTS, REQUESTS_PATIENCE_S)
        return self.store.add(K.JOIN_REQUESTS, 0)

    def prefetch(self, step: int) -> None:
        """Begin reading the counter for ``step + 1``'s members now, in the read thread."""
        if self.reader is None:
            self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unicron-requests")
        self.prefetched = (step, self.reader.submit(self.count))

    def count_for(self, step: int, proposal: bool) -> int:
        """The counter for ``step``'s members: the read begun while ``step - 1`` computed, else read now.

        The read begun earlier is waited for at most :data:`STEP_END_WAIT_S`
        (0, no request, if it is still pending: the next read is queued behind it).

        Raises:
            StoreUnavailableError: etcd stayed unreachable for :data:`REQUESTS_PATIENCE_S`.
        """
        prefetched, self.prefetched = self.prefetched, None
        if proposal and prefetched is not None and step == prefetched[0] + 1:
            try:  # read while this rank computed: no round trip at the step's end
                return prefetched[1].result(timeout=STEP_END_WAIT_S)
            except StillReading:
                log.info("requests_read_pending", step=step, waited_s=STEP_END_WAIT_S)
                return 0
        return self.count()

    def withdraw_leave(self) -> None:
        """Forget this rank's leave request (it retired); a failure is logged, not raised (its agent withdraws too)."""
        try:
            if self.store.check([K.leave(self.rank)]) and self.store.delete_key(K.leave(self.rank)):
                self.store.add(K.JOIN_REQUESTS, -1)
        except Exception as exc:  # noqa: BLE001 - retiring must not turn into a crash
            log.warning("leave_request_not_withdrawn", rank=self.rank, error=str(exc)[:200])

    def close(self) -> None:
        """Stop the read thread (a read in flight is dropped)."""
        self.prefetched = None
        if self.reader is not None:
            self.reader.shutdown(wait=False)
            self.reader = None
