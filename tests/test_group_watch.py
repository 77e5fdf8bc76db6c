"""The engine's watch over its waits (in-process): report a wait, refresh it, give the group up once a member is gone.

And the gloo transport's interrupt: a collective blocked on a peer that never
answers (a frozen one: no reset) fails at once, here and at the peer.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.transport import GlooTransport
from unicron_elastic.strategy.watch import GroupWatch, WatchTimes

FAST = WatchTimes(report_after=0.05, refresh=0.05, check_after=0.1, poll=0.05)


def _until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


class _Members:
    """The watch's ``gone()``: counts each look (the watch thread's own evidence that it ran) and says whether a
    member is gone."""

    def __init__(self) -> None:
        self.looks = 0
        self.gone: str | None = None

    def __call__(self) -> str | None:
        self.looks += 1
        return self.gone

    def looked(self, more: int) -> None:
        """Wait until the watch thread looked ``more`` more times."""
        target = self.looks + more
        _until(lambda: self.looks >= target)


def test_a_wait_shorter_than_report_after_is_not_reported_though_the_thread_watched_it() -> None:
    reports: list[bool] = []
    members = _Members()
    watch = GroupWatch(reports.append, members, lambda reason: None,
                       WatchTimes(report_after=30, refresh=30, check_after=0.05, poll=0.05))
    try:
        with watch.waiting("reduce"):
            members.looked(3)  # the thread saw this wait, past check_after, three times
            assert reports == []
        assert reports == [] and watch.interrupted == 0
    finally:
        watch.close()


def test_a_long_wait_is_reported_repeated_then_closed() -> None:
    reports: list[bool] = []
    watch = GroupWatch(reports.append, lambda: None, lambda reason: None, FAST)
    try:
        with watch.waiting("reduce"):
            pass  # completes at once: nothing said
        with watch.waiting("reduce"):
            _until(lambda: len(reports) >= 3)  # said, and said again while it lasts
        assert reports[:-1] == [True] * (len(reports) - 1) and reports[-1] is False
        assert watch.interrupted == 0
    finally:
        watch.close()


def test_a_member_gone_during_a_wait_interrupts_it_once_and_the_next_wait_is_watched_again() -> None:
    members = _Members()
    interrupts: list[str] = []
    reports: list[bool] = []
    watch = GroupWatch(reports.append, members, interrupts.append, FAST)
    try:
        with watch.waiting("reduce"):
            members.looked(3)
            assert interrupts == []  # every member alive: the wait goes on
            members.gone = "member 2 gone"
            _until(lambda: interrupts)
            said = len(reports)
            _until(lambda: len(reports) >= said + 3)  # the thread goes on watching this wait...
        assert interrupts == ["member 2 gone"] and watch.interrupted == 1  # ...and interrupted it once
        members.gone = None
        with watch.waiting("commit"):
            members.looked(3)  # the next wait is watched: its members are looked at
            assert watch.interrupted == 1
            members.gone = "member 1 gone"
            _until(lambda: len(interrupts) == 2)
        assert interrupts == ["member 2 gone", "member 1 gone"]
    finally:
        watch.close()


def test_a_check_that_fails_leaves_the_wait_to_its_timeout() -> None:
    calls: list[int] = []

    def gone() -> str | None:
        calls.append(1)
        raise RuntimeError("etcd unreachable")

    interrupts: list[str] = []
    watch = GroupWatch(lambda waiting: None, gone, interrupts.append, FAST)
    try:
        with watch.waiting("reduce"):
            _until(lambda: len(calls) >= 3)  # the check ran, and failed, three times
        assert interrupts == [] and watch.interrupted == 0
    finally:
        watch.close()


@pytest.mark.parametrize("field", ["report_after", "refresh", "check_after", "poll"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), 61, "1"])
def test_watch_times_out_of_range_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        WatchTimes(**{field: value})


@pytest.mark.compat
def test_the_gloo_transport_interrupts_a_collective_blocked_on_a_silent_peer() -> None:
    """Rank 1 never reaches the all-reduce (as if frozen): rank 0's wait fails within a second of the interrupt."""
    store, transport = dist.HashStore(), GlooTransport()
    groups: dict[int, dist.ProcessGroup] = {}

    def make(rank: int) -> None:
        groups[rank] = transport.new_group(dist.PrefixStore("g", store), rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    work = groups[0].allreduce([torch.ones(4)])
    time.sleep(0.2)
    assert not work.is_completed()
    started = time.monotonic()
    transport.interrupt(groups[0])
    with pytest.raises(RuntimeError, match="Connection closed by peer|Connection reset|closed"):
        work.wait()
    assert time.monotonic() - started < 5
    for rank in (0, 1):
        transport.abort(groups.pop(rank))


class _OpensASocketWhileItForms(dist.Store):
    """Rank 0's bootstrap store: while its group forms, another thread connects a socket (an etcd reconnect)."""

    def __init__(self, store: dist.Store, address: tuple[str, int]) -> None:
        super().__init__()  # (the pybind trampoline)
        self._store, self._address = store, address
        self.other: socket.socket | None = None
        self.set_timeout(store.timeout)

    def _open(self) -> None:
        self.other = socket.create_connection(self._address, timeout=10)

    def set(self, key, value):  # noqa: D102 - c10d semantics
        if self.other is None:  # the group has begun to form: its sockets are being opened now
            opener = threading.Thread(target=self._open)
            opener.start()
            opener.join(10)
        self._store.set(key, value)

    def get(self, key):  # noqa: D102
        return self._store.get(key)

    def wait(self, keys, timeout=None):  # noqa: D102
        self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)

    def check(self, keys):  # noqa: D102
        return self._store.check(keys)


def _echo_server() -> tuple[socket.socket, tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(64):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()


@pytest.mark.compat
def test_an_interrupt_leaves_a_socket_another_thread_opened_while_the_group_formed_working() -> None:
    """Only the group's own connections are shut down: not another thread's (an etcd reconnect, a snapshot
    upload) that happened to connect while the group was being built."""
    server, address = _echo_server()
    store, transport = dist.HashStore(), GlooTransport()
    rank0 = _OpensASocketWhileItForms(dist.PrefixStore("g", store), address)
    groups: dict[int, dist.ProcessGroup] = {}

    def make(rank: int) -> None:
        view = rank0 if rank == 0 else dist.PrefixStore("g", store)
        groups[rank] = transport.new_group(view, rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert rank0.other is not None
    try:
        work = groups[0].allreduce([torch.ones(4)])  # rank 1 never joins it: blocked, as on a frozen peer
        transport.interrupt(groups[0])
        with pytest.raises(RuntimeError, match="Connection closed by peer|Connection reset|closed"):
            work.wait()  # the group's connections were shut down
        rank0.other.sendall(b"still here")
        assert rank0.other.recv(64) == b"still here"  # the other thread's socket was not
    finally:
        rank0.other.close()
        server.close()
        for rank in (0, 1):
            transport.abort(groups.pop(rank))
