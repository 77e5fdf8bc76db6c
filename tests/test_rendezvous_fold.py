"""N nodes joining one run at once: the writes of a forming round fold in the announced nodes (rendezvous/fold.py)."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousState,
)

from unicron_elastic.api import EtcdConfig
from unicron_elastic.rendezvous import create_handler
from unicron_elastic.rendezvous.fold import decode_node, encode_node, fold_joiners
from unicron_elastic.store import StatusStore

pytestmark = pytest.mark.compat  # torch's rendezvous state, as its _add_to_participants changes it

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _settings(min_nodes: int, max_nodes: int) -> RendezvousSettings:
    return RendezvousSettings("run", min_nodes, max_nodes, RendezvousTimeout(last_call=timedelta(seconds=3)),
                              keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3)


def _node(i: int) -> _NodeDesc:
    return _NodeDesc("10.0.0.1", 100 + i, 0)


def test_an_announcement_round_trips_and_a_foreign_value_is_no_node() -> None:
    assert decode_node(encode_node(_node(3))) == _node(3)
    assert decode_node(b"1") is None and decode_node(b"{}") is None


@given(st.integers(1, 12), st.integers(0, 12), st.integers(0, 6), st.integers(0, 15))
def test_a_fold_is_torch_adding_each_node_in_turn(min_nodes: int, extra: int, present: int, joiners: int) -> None:
    """Folding k nodes gives the state torch's k _add_to_participants would: heartbeats, the last call's
    deadline at min_nodes, complete with sorted ranks at max_nodes, never more than max_nodes."""
    settings = _settings(min_nodes, min_nodes + extra)
    state = _RendezvousState()
    for i in range(min(present, settings.max_nodes - 1)):
        state.participants[_node(i)] = 0
        state.last_heartbeats[_node(i)] = NOW - timedelta(seconds=1)
    before = dict(state.participants)
    state.wait_list.add(_node(50))
    announced = [_node(i) for i in range(joiners)] + [_node(50)]
    added = fold_joiners(state, announced, settings, NOW)

    assert not set(added) & set(before)
    assert len(state.participants) == min(settings.max_nodes, len(before) + len(added))
    assert len(state.participants) <= settings.max_nodes
    assert all(state.last_heartbeats[n] == NOW for n in added)
    assert not set(added) & state.wait_list
    count = len(state.participants)
    assert state.complete == (count == settings.max_nodes and bool(added))
    if state.complete:
        assert state.deadline is None
        assert sorted(state.participants.values()) == list(range(count))
        assert [state.participants[n] for n in sorted(state.participants)] == list(range(count))
    elif len(before) < min_nodes <= count:
        assert state.deadline == NOW + timedelta(seconds=3)


def test_a_complete_or_closed_round_and_a_redundant_node_are_left_alone() -> None:
    settings = _settings(1, 4)
    complete = _RendezvousState()
    complete.complete = True
    closed = _RendezvousState()
    closed.closed = True
    assert fold_joiners(complete, [_node(1)], settings, NOW) == []
    assert fold_joiners(closed, [_node(1)], settings, NOW) == []
    forming = _RendezvousState()
    forming.redundancy_list.add(_node(1))
    assert fold_joiners(forming, [_node(1), _node(2)], settings, NOW) == [_node(2)]


def _params(config: EtcdConfig, run_id: str, nodes: int) -> RendezvousParameters:
    return RendezvousParameters(backend="unicron", endpoint=f"{config.host}:{config.port}", run_id=run_id,
                                min_nodes=nodes, max_nodes=nodes, local_addr="127.0.0.1", cluster=config.cluster,
                                join_timeout="60", last_call_timeout="1")


@pytest.mark.timeout(90)
def test_nodes_joining_at_once_complete_their_round_in_a_few_writes(etcd_config: EtcdConfig,
                                                                    store: StatusStore) -> None:
    """24 handlers (one etcd client each, as 24 agents) join one run at once: each gets its own rank, and the
    state is written a few times rather than once per node (torch alone: at least 24 writes, and about
    24^2 / 2 lost compare-and-sets)."""
    nodes = 24
    handlers = [create_handler(_params(etcd_config, "herd", nodes)) for _ in range(nodes)]
    infos: dict[int, object] = {}
    errors: list[BaseException] = []
    writes: list[bool] = []

    def counted(set_state):
        def set_and_count(state, token=None):
            result = set_state(state, token)
            writes.append(bool(result and result[2]))
            return result
        return set_and_count

    for h in handlers:
        h.backend.set_state = counted(h.backend.set_state)

    def join(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(nodes)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(75)
        assert not errors, errors
        assert sorted(info.rank for info in infos.values()) == list(range(nodes))
        assert {info.world_size for info in infos.values()} == {nodes}
        assert sum(writes) <= nodes // 3, writes  # the state's writes: most nodes were folded in, not self-added
        assert len(writes) <= 3 * nodes, len(writes)  # and the lost ones: about one a node, not ~nodes^2 / 2
        assert store.count_prefix(store.keys.rdzv_joining("herd")) == 0  # the announcements are withdrawn
    finally:
        for h in handlers:
            h.shutdown()
            h.status_store.close()
