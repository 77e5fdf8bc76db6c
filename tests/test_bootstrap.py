"""A group's bootstrap stops waiting for a member whose liveness key is gone (``strategy/engine/bootstrap.py``).

Before, a node lost while a group formed (before its ranks published their
gloo addresses) stalled every survivor for the store's timeout. Here each
case builds real gloo groups in one process (threads as ranks, a HashStore
or a real TCPStore as the meeting store) and deletes a rank's liveness key
the way the agent does when its worker exits or its node's lease expires.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine.bootstrap import MemberGoneError, WatchfulStore, gone_ranks, watch_members
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, EngineOptions
from unicron_elastic.strategy.engine.transport import is_peer_failure

TIMEOUT = timedelta(seconds=30)  # the store's and the group's: far longer than any case may take


def _meeting(ranks: range, store: dist.Store | None = None) -> dist.Store:
    """A meeting store where ``ranks`` are alive (liveness keys kept, as under ``unicron-run``)."""
    store = store or dist.HashStore()
    store.set_timeout(TIMEOUT)
    store.set(K.LIVENESS, "1")
    for rank in ranks:
        store.set(K.live(rank), "0")
    return store


def _lose(store: dist.Store, rank: int, after: float) -> threading.Thread:
    """Delete ``rank``'s liveness key after ``after`` seconds (its node's lease expired)."""
    thread = threading.Thread(target=lambda: (time.sleep(after), store.delete_key(K.live(rank))), daemon=True)
    thread.start()
    return thread


def test_without_liveness_keys_the_store_is_used_as_it_is() -> None:
    store = dist.HashStore()
    assert watch_members(store, [0, 1]) is store


def test_a_member_gone_before_it_published_ends_the_wait_at_once_not_at_the_timeout() -> None:
    store = _meeting(range(2))
    watched = watch_members(store, [0, 1], every=0.1)  # (held: gloo calls the Python store, it must outlive the call)
    lost = _lose(store, 1, after=0.3)
    started = time.monotonic()
    with pytest.raises(MemberGoneError) as caught:
        dist.ProcessGroupGloo(dist.PrefixStore("g", watched), 0, 2, TIMEOUT)
    waited = time.monotonic() - started
    lost.join()
    assert 0.3 <= waited < 3, waited  # gone at 0.3 s, seen within a look or two; the timeout is 30 s
    assert caught.value.ranks == (1,)
    assert is_peer_failure(caught.value)  # the engine and the model's collectives regroup on it


def test_a_slow_member_that_is_alive_is_waited_for() -> None:
    store = _meeting(range(2))
    watched = [watch_members(store, [0, 1], every=0.05) for _ in range(2)]  # (kept alive: gloo calls them)
    groups: dict[int, dist.ProcessGroup] = {}

    def build(rank: int, delay: float) -> None:
        time.sleep(delay)
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("g", watched[rank]), rank, 2, TIMEOUT)

    threads = [threading.Thread(target=build, args=(0, 0.0)), threading.Thread(target=build, args=(1, 0.6))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(groups) == [0, 1]  # rank 0 waited through ~12 looks at rank 1's key
    tensors = [torch.full((3,), float(rank + 1)) for rank in range(2)]
    works = [groups[rank].allreduce([tensors[rank]]) for rank in range(2)]
    for work in works:
        work.wait()
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in tensors)


def test_the_timeout_still_bounds_the_wait_and_a_key_that_appears_ends_it() -> None:
    store = _meeting(range(2))
    watched = WatchfulStore(store, lambda: gone_ranks(store, [0, 1]), every=0.05)
    started = time.monotonic()
    with pytest.raises(LookupError, match="timeout"):
        watched.wait(["never"], timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - started < 3
    threading.Timer(0.2, lambda: store.set("later", "x")).start()
    assert watched.get("later") == b"x"


def test_over_a_tcp_store_it_polls_without_the_stores_own_wait(capfd: pytest.CaptureFixture[str]) -> None:
    """Under plain torchrun the meeting store is a TCPStore (its ``wait`` logs two warnings per timed-out wait)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    client = _meeting(range(2), dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT))
    lost = _lose(server, 1, after=0.4)
    with pytest.raises(MemberGoneError):
        watch_members(client, [0, 1], every=0.1).wait(["never"])
    lost.join()
    assert "waitForInput" not in capfd.readouterr().err


def test_the_engine_started_without_a_lost_member_fails_fast_so_the_agent_restarts_it_as_a_joiner() -> None:
    """The first group is built in the engine's constructor: a member lost meanwhile makes it raise (the worker
    exits, the agent restarts it, it joins knowing the member is gone) soon after the loss, not at the timeout."""
    store = _meeting(range(2))
    model = torch.nn.Linear(2, 1)
    _lose(store, 1, after=0.3)
    started = time.monotonic()
    with pytest.raises(MemberGoneError):
        ElasticDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), batch_plan=None, batch=lambda idx: idx,
                            loss_fn=lambda m, b: m(b).sum(), store=store, rank=0, world_size=2,
                            options=EngineOptions(timeout=TIMEOUT))
    assert time.monotonic() - started < 5
