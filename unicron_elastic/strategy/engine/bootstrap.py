"""A view of the meeting store for a group's bootstrap that stops waiting for members that are gone.

gloo (and NCCL) build a group by publishing each rank's address in a c10d
store and waiting there for the others'. A member lost before it published
(its node went away while the group formed) is waited for until the store's
timeout - a minute by default - and every survivor stalls that long. Where
the workers' supervisors keep liveness keys (``unicron-run``: the agent puts
``live/<rank>`` on its node's lease and deletes it when the worker exits),
:func:`watch_members` gives the group a store whose blocking reads look at
the members' liveness keys while they wait and raise
:class:`MemberGoneError` as soon as one is gone: the survivors give up
within :data:`WATCH_EVERY_S` of the loss being known instead of at the timeout.

Without liveness keys (plain ``torchrun``) the store is used as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist
from typing_extensions import override

from unicron_elastic.store.keys import MeetingKeys as K

#: How often a blocked read looks at the members' liveness keys (seconds).
WATCH_EVERY_S = 0.5
#: A blocked read polls its keys after this many seconds, doubling up to :data:`POLL_MAX_S`.
POLL_MIN_S = 0.001
POLL_MAX_S = 0.01


class MemberGoneError(dist.DistNetworkError):
    """A member of a group being formed is gone (its liveness key vanished): the group cannot form.

    A :class:`torch.distributed.DistNetworkError`, like the failure of a
    peer during a collective: the engine and the model's collectives treat
    it as the loss of a peer (they regroup).

    Attributes:
        ranks: The launch ranks that are gone.
    """

    def __init__(self, ranks: Sequence[int], keys: Sequence[str]) -> None:
        self.ranks = tuple(ranks)
        super().__init__(f"ranks {list(self.ranks)} are gone (their liveness keys vanished) while waiting "
                         f"for {list(keys)} in the meeting store: the group cannot form")


class ForwardingStore(dist.Store):
    """A c10d store that sends every operation to ``store`` as it is: the base of the wrappers that change a few.

    Keep the object referenced while groups made from it live: torch calls its
    Python methods, and once collected they fail ("Not implemented").

    Args:
        store: The store every operation goes to.
    """

    def __init__(self, store: dist.Store) -> None:
        super().__init__()  # required by the pybind trampoline
        self._store = store
        self.set_timeout(store.timeout)

    @override
    def set(self, key: str, value: str | bytes) -> None:  # noqa: D102 - c10d semantics
        self._store.set(key, value)

    @override
    def get(self, key: str) -> bytes:  # noqa: D102 - c10d semantics
        return self._store.get(key)

    @override
    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:  # noqa: D102
        if override_timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, override_timeout)

    @override
    def check(self, keys: list[str]) -> bool:  # noqa: D102 - c10d semantics
        return self._store.check(keys)

    @override
    def add(self, key: str, num: int) -> int:  # noqa: D102 - c10d semantics
        return self._store.add(key, num)

    @override
    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:  # noqa: D102
        return self._store.compare_set(key, expected_value, desired_value)

    @override
    def delete_key(self, key: str) -> bool:  # noqa: D102 - c10d semantics
        return self._store.delete_key(key)

    @override
    def num_keys(self) -> int:  # noqa: D102 - c10d semantics
        return self._store.num_keys()


class WatchfulStore(ForwardingStore):
    """A c10d store whose blocking reads (``get``, ``wait``) give up when a watched rank is gone.

    Other operations go to ``store`` as they are. The overall timeout of a
    read is ``store``'s (or the one the caller passes), as before. Keep the
    object referenced while groups made from it live: torch calls its Python
    methods, and once collected they fail ("Not implemented").

    Args:
        store: The meeting store.
        gone: Returns the watched ranks that are gone (an empty list while all are alive).
        every: Seconds between looks at ``gone`` while a read is blocked.
    """

    def __init__(self, store: dist.Store, gone: Callable[[], list[int]], every: float = WATCH_EVERY_S) -> None:
        super().__init__(store)
        self._gone, self._every = gone, every

    @override
    def get(self, key: str) -> bytes:
        """The value of ``key`` once it exists.

        Raises:
            MemberGoneError: A watched rank is gone while waiting.
            LookupError: The key did not appear within the timeout.
        """
        self.wait([key])
        return self._store.get(key)

    @override
    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        """Wait until every key exists, looking at the watched ranks every ``every`` seconds.

        The keys are polled (every :data:`POLL_MAX_S` at most) rather than
        waited for in the store's own ``wait``: a TCPStore logs two warnings
        for every ``wait`` that times out.

        Raises:
            MemberGoneError: A watched rank is gone while waiting.
            LookupError: Not all keys appeared within the timeout.
        """
        timeout = override_timeout or self.timeout
        now = time.monotonic()
        deadline, look = now + timeout.total_seconds(), now + self._every
        delay = POLL_MIN_S
        while not self._store.check(keys):
            now = time.monotonic()
            if now >= deadline:
                raise LookupError(f"timeout after {timeout} waiting for keys {keys} in the meeting store")
            if now >= look:
                gone = self._gone()
                if gone:
                    raise MemberGoneError(gone, keys)
                look = now + self._every
            time.sleep(min(delay, max(deadline - now, 0.0)))
            delay = min(delay * 2, POLL_MAX_S)



def gone_ranks(store: dist.Store, ranks: Sequence[int]) -> list[int]:
    """Those of ``ranks`` whose liveness key is absent from the meeting ``store`` (they exited or their node is lost)."""
    return [rank for rank in ranks if not store.check([K.live(rank)])]


def watch_members(store: dist.Store, ranks: Sequence[int], every: float = WATCH_EVERY_S) -> dist.Store:
    """The store a group of the launch ``ranks`` bootstraps in: watchful where liveness keys are kept.

    A rank counts as gone when its key is absent. A member restarted since
    it was admitted has a key again (its new incarnation's) and is still
    waited for until the timeout.

    Args:
        store: The meeting store.
        ranks: The launch ranks of the group's members.
        every: Seconds between looks at their liveness keys while a read is blocked.
    """
    if not store.check([K.LIVENESS]):
        return store
    watched = list(ranks)
    return WatchfulStore(store, lambda: gone_ranks(store, watched), every)
