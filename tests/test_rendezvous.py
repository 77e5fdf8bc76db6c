"""The unicron rendezvous backend: torch's backend contract case by case, options, registration."""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta
from importlib.metadata import entry_points

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from unicron_elastic.api import ConfigError, EtcdConfig
from unicron_elastic.rendezvous import (
    KNOWN_KEYS,
    UnicronRendezvousBackend,
    UnicronRendezvousHandler,
    create_handler,
    parse_options,
)
from unicron_elastic.store import StatusStore
from unicron_elastic.store.c10d import EtcdC10dStore
from unicron_elastic.store.keys import MeetingKeys

from conftest import wait_for

pytestmark = pytest.mark.compat  # the backend contract and the handler's use of torch's rendezvous internals

@pytest.fixture()
def backend(store: StatusStore) -> UnicronRendezvousBackend:
    return UnicronRendezvousBackend(store, "run1")


def test_backend_name_is_unicron(backend: UnicronRendezvousBackend) -> None:
    assert backend.name == "unicron"


def test_get_state_is_none_when_absent(backend: UnicronRendezvousBackend) -> None:
    assert backend.get_state() is None


def test_set_state_without_token_creates(backend: UnicronRendezvousBackend) -> None:
    state, token, has_set = backend.set_state(b"s1")
    assert (state, has_set) == (b"s1", True)
    assert backend.get_state() == (b"s1", token)


def test_set_state_without_token_when_present_returns_current(backend: UnicronRendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"s1")
    assert backend.set_state(b"s2") == (b"s1", token, False)


def test_set_state_with_current_token_sets_and_returns_new_token(backend: UnicronRendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"s1")
    state, new_token, has_set = backend.set_state(b"s2", token)
    assert (state, has_set) == (b"s2", True) and new_token != token
    assert backend.get_state() == (b"s2", new_token)


def test_set_state_with_old_token_returns_current(backend: UnicronRendezvousBackend) -> None:
    _, old, _ = backend.set_state(b"s1")
    _, current, _ = backend.set_state(b"s2", old)
    assert backend.set_state(b"s3", old) == (b"s2", current, False)


@pytest.mark.parametrize("token", ["not-a-number", -5, 0, object()])
def test_set_state_with_invalid_token_returns_current(backend: UnicronRendezvousBackend, token) -> None:
    _, current, _ = backend.set_state(b"s1")
    assert backend.set_state(b"s2", token) == (b"s1", current, False)


def test_set_state_with_token_when_absent_returns_none(backend: UnicronRendezvousBackend) -> None:
    assert backend.set_state(b"s1", 12345) is None
    assert backend.get_state() is None


def test_token_of_a_deleted_and_recreated_state_is_stale(backend: UnicronRendezvousBackend, store) -> None:
    _, token, _ = backend.set_state(b"s1")
    store.delete(backend.key)
    _, new_token, _ = backend.set_state(b"s2")
    assert backend.set_state(b"s3", token) == (b"s2", new_token, False)


@pytest.mark.parametrize("raw", [b"garbage", b'{"format": "other", "state": ""}', b'{"format": "torch-dynamic-rendezvous/v1", "state": "!!"}'])
def test_corrupt_state_raises_state_error(backend: UnicronRendezvousBackend, store, raw: bytes) -> None:
    store.put(backend.key, raw)
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()


def test_a_quiet_look_decodes_the_state_only_when_it_was_written_and_finds_it_corrupt(
        backend: UnicronRendezvousBackend, store) -> None:
    from unicron_elastic.rendezvous import quiet
    from unicron_elastic.rendezvous.backend import encode_state

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    assert quiet.look(backend, store, "run1", None) == (None, 0, None)  # no state yet, nobody announced
    state = _RendezvousState()
    state.round = 3
    _, token, _ = backend.set_state(pickle.dumps(state))
    store.put(store.keys.rdzv_waiting("run1", "n1"), b"1")
    assert quiet.look(backend, store, "run1", None) == (token, 1, 3)  # read: torch's round with it
    checked = token
    reads = []
    real_get = backend.get_state
    backend.get_state = lambda: reads.append(1) or real_get()  # type: ignore[method-assign]
    assert quiet.look(backend, store, "run1", checked) == (checked, 1, None) and reads == []  # unchanged: not read
    store.put(backend.key, b"not a rendezvous state")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        quiet.look(backend, store, "run1", checked)
    store.put(backend.key, encode_state(b"not a pickle"))  # a document, but not torch's state
    with pytest.raises(RendezvousStateError, match="corrupt"):
        quiet.look(backend, store, "run1", checked)


def test_state_is_stored_as_json_not_pickle(backend: UnicronRendezvousBackend, store) -> None:
    backend.set_state(pickle.dumps({"round": 3}))
    assert store.get_json(backend.key)["format"] == "torch-dynamic-rendezvous/v1"


def test_unreachable_etcd_is_a_rendezvous_connection_error() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from unicron_elastic.store import free_port

    store = StatusStore(EtcdConfig(port=free_port(), reconnect_timeout=0.5, request_timeout=0.5))
    with pytest.raises(RendezvousConnectionError, match="unreachable"):
        UnicronRendezvousBackend(store, "r").get_state()


# -- options -------------------------------------------------------------------


def test_options_defaults_and_torchrun_timeout() -> None:
    opts = parse_options("127.0.0.1:1234", "job", {"timeout": 900})
    assert (opts.etcd.host, opts.etcd.port, opts.etcd.cluster) == ("127.0.0.1", 1234, "default")
    assert opts.task == "job" and opts.join_timeout == timedelta(seconds=900)
    assert parse_options("h", "job", {}).etcd.port == 2379


def test_options_all_known_keys_parse() -> None:
    conf = {
        "cluster": "c", "task": "t", "request_timeout": "2.5", "reconnect_timeout": "4",
        "store_timeout": "9", "join_timeout": "10", "last_call_timeout": "1", "close_timeout": "3",
        "heartbeat_timeout": "2", "keep_alive_interval": "1", "keep_alive_max_attempt": "2",
        "user": "u", "password": "p", "timeout": "900", "rank": "0",
    }
    opts = parse_options("[::1]:2380", "job", conf)
    assert (opts.etcd.host, opts.etcd.port, opts.etcd.user) == ("::1", 2380, "u")
    assert opts.join_timeout == timedelta(seconds=10) and opts.keep_alive_interval == 1
    assert opts.etcd.request_timeout == 2.5 and opts.store_timeout == timedelta(seconds=9)


@pytest.mark.parametrize(
    ("endpoint", "conf", "match"),
    [
        ("h:1", {"bogus": "1"}, "unknown --rdzv-conf key.*bogus"),
        ("h:1", {"join_timeout": "soon"}, "join_timeout='soon' is not an integer"),
        ("h:1", {"request_timeout": "-1"}, "request_timeout='-1' must be > 0"),
        ("h:1", {"cluster": "a/b"}, "cluster"),
        ("h:1", {"cert_key": "k.pem"}, "cert_key and cert_cert"),
        ("h:port", {}, "port 'port' is not a number"),
        ("", {}, "--rdzv-endpoint"),
    ],
)
def test_options_bad_input_names_key_and_value(endpoint: str, conf: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_options(endpoint, "job", conf)
    assert isinstance(info.value, ConfigError)


def test_every_known_key_is_documented_in_the_readme() -> None:
    from conftest import REPO

    readme = open(f"{REPO}/docs/rendezvous.md").read()
    missing = [k for k in KNOWN_KEYS if f"`{k}`" not in readme]
    assert not missing, missing


# -- handler and registration ----------------------------------------------------


def _params(etcd_config: EtcdConfig, run_id: str = "job", **conf) -> RendezvousParameters:
    return RendezvousParameters(
        backend="unicron",
        endpoint=f"{etcd_config.host}:{etcd_config.port}",
        run_id=run_id,
        min_nodes=1,
        max_nodes=2,
        cluster=etcd_config.cluster,
        **conf,
    )


def test_entry_point_is_registered_for_torchrun() -> None:
    names = {ep.name: ep.value for ep in entry_points(group="torchrun.handlers")}
    assert names["unicron"] == "unicron_elastic.rendezvous.entrypoint:handler_factory"


@pytest.mark.parametrize("first", ["unicron_elastic.rendezvous.backend", "unicron_elastic.rendezvous.options",
                                   "unicron_elastic.rendezvous", "torch.distributed.run"])
def test_backend_registers_whatever_is_imported_first(first: str) -> None:
    """torch loads entry points while its rendezvous package is imported; no cycle may break it."""
    import subprocess
    import sys

    code = (f"import {first}\n"
            "from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry as r\n"
            "print('unicron' in r._registry)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["True"], result.stderr[-2000:]
    assert "Exception while registering" not in result.stderr


def test_torch_registry_builds_our_handler(etcd_config: EtcdConfig) -> None:
    rdzv_registry._register_out_of_tree_handlers()
    handler = rdzv_registry.get_rendezvous_handler(_params(etcd_config))
    assert isinstance(handler, UnicronRendezvousHandler)
    assert handler.get_backend() == "unicron" and handler.get_run_id() == "job"


def test_bad_rdzv_conf_surfaces_as_value_error_from_registry(etcd_config: EtcdConfig) -> None:
    rdzv_registry._register_out_of_tree_handlers()
    with pytest.raises(ValueError, match="bogus"):
        rdzv_registry.get_rendezvous_handler(_params(etcd_config, bogus="1"))


def test_single_node_rendezvous_completes_through_etcd(etcd_config: EtcdConfig, store: StatusStore) -> None:
    handler = create_handler(_params(etcd_config, last_call_timeout="1", join_timeout="20"))
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert store.get(store.keys.rdzv("job")) is not None
    info.store.set("k", b"v")
    assert info.store.get("k") == b"v"
    handler.shutdown()


def test_torch_still_caches_the_agent_store_that_we_drop() -> None:
    """Pins torch 2.13 internals behind UnicronRendezvousHandler._forget_agent_store."""
    import inspect

    source = inspect.getsource(DynamicRendezvousHandler.next_rendezvous)
    assert "self._bootstrap_store_info is None" in source
    assert "self._shared_tcp_store_server" in source


# -- c10d store ---------------------------------------------------------------


def test_c10d_store_semantics(store: StatusStore) -> None:
    s = EtcdC10dStore(store, store.keys.c10d("job"), timeout=timedelta(seconds=2))
    s.set("a", "1")
    assert s.get("a") == b"1"
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    assert s.check(["a", "n"]) and not s.check(["a", "missing"])
    assert s.compare_set("a", "1", "2") == b"2"
    assert s.compare_set("a", "1", "3") == b"2"
    assert s.compare_set("new", "", "x") == b"x"
    assert s.num_keys() == 3
    assert s.delete_key("a") and not s.check(["a"])
    with pytest.raises(LookupError, match="missing"):
        s.wait(["missing"], timedelta(milliseconds=200))


def test_c10d_store_works_through_torch_apis(store: StatusStore) -> None:
    """multi_get/multi_set go through the pybind trampoline to our get/set."""
    import torch.distributed as dist

    s = EtcdC10dStore(store, store.keys.c10d("job2"), timeout=timedelta(seconds=2))
    prefixed = dist.PrefixStore("round0", s)
    prefixed.multi_set(["x", "y"], [b"1", b"2"])
    assert prefixed.multi_get(["x", "y"]) == [b"1", b"2"]
    assert s.get("round0/x") == b"1"


# -- the seam with the agent (rendezvous/api.py): what the handler offers, what it hands back --------------


def test_the_unicron_handler_is_the_agents_seam_and_torchs_handlers_are_not() -> None:
    """In-process: ``UnicronRendezvous`` is what the agent asks for; torch's c10d and static handlers are not it."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from unicron_elastic.agent import seam
    from unicron_elastic.rendezvous.api import RoundJoined, RoundStart, UnicronRendezvous

    def built(cls: type[DynamicRendezvousHandler]) -> DynamicRendezvousHandler:
        store = dist.HashStore()
        return cls.from_backend("seam", store, C10dRendezvousBackend(store, "seam"), 1, 3, local_addr="127.0.0.1")

    unicron = built(UnicronRendezvousHandler)
    assert isinstance(unicron, UnicronRendezvous) and seam.unicron_rendezvous(unicron) is unicron
    assert (unicron.max_nodes, unicron.round_joined, unicron.rejoin) == (3, None, False)
    with pytest.raises(RuntimeError, match="no round"):  # the agent asks only once a rendezvous completed
        seam.round_joined(unicron)
    with pytest.raises(ValueError, match="local_world_size"):
        unicron.join_running_rounds(0)
    unicron.join_running_rounds(4)
    assert (unicron.rejoin, unicron.local_world_size) == (True, 4)
    for other in (built(DynamicRendezvousHandler), StaticTCPRendezvous("127.0.0.1", 29500, 0, 1, "seam", 60)):
        assert not isinstance(other, UnicronRendezvous)  # (--rdzv-backend=c10d or static)
        assert seam.unicron_rendezvous(other) is None and seam.round_joined(other) is None
    joined = RoundJoined(2, running=True, past_round=RoundStart(1, 2, 2, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        joined.round = 3  # type: ignore[misc]
    assert RoundJoined(0) == RoundJoined(0, running=False, past_round=None)


# -- a node arriving at a running round: a lost place, or a new one (growth in place) --------------


def _running(etcd_config: EtcdConfig, run_id: str, nproc: int = 2):
    """A one-node round of ``run_id`` formed through torch's rendezvous, its agent's meeting point open."""
    from unicron_elastic.agent.meeting_point import MeetingPoint, RoundStart
    from unicron_elastic.rendezvous.api import max_world

    handler = create_handler(_params(etcd_config, run_id, last_call_timeout="1", join_timeout="20"))
    handler.join_running_rounds(nproc)  # (what unicron-run's agent does)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size, handler.round_joined.running) == (0, 1, False)  # no round ran: torch's rendezvous
    start = RoundStart(1, nproc, nproc, max_world(1, nproc, handler.max_nodes, nproc))
    point = MeetingPoint(handler.status_store, run_id, handler.current_round(), 5, 0, 1, host="127.0.0.1",
                         start=start)
    assert point.start is not None and point.start.max_world == 2 * nproc
    return handler, point


def _arriving(etcd_config: EtcdConfig, run_id: str, join_timeout: str = "20", nproc: int = 2
              ) -> UnicronRendezvousHandler:
    handler = create_handler(_params(etcd_config, run_id, last_call_timeout="1", join_timeout=join_timeout))
    handler.join_running_rounds(nproc)
    return handler


def test_a_node_arriving_at_a_growable_round_adds_a_place_up_to_the_max(etcd_config: EtcdConfig,
                                                                        store: StatusStore) -> None:
    from unicron_elastic.rendezvous.api import max_world, ranks_past_round

    first, point = _running(etcd_config, "grow")
    try:
        point.mark_growable()  # a worker's hello(growable=True)
        wider = _arriving(etcd_config, "grow", join_timeout="1", nproc=3)  # its ranks would not be the place's
        with pytest.raises(RendezvousTimeoutError):
            wider.next_rendezvous()
        second = _arriving(etcd_config, "grow")
        info = second.next_rendezvous()
        joined = second.round_joined
        assert (info.rank, info.world_size) == (1, 2) and joined.running and joined.past_round is not None
        assert (joined.round, joined.past_round.nodes, joined.past_round.world) == (first.current_round(), 1, 2)
        assert list(ranks_past_round(1, 2, info.rank, 2)) == [2, 3] and max_world(1, 2, second.max_nodes, 2) == 4
        places = store.get(f"{store.keys.meeting('grow')}{first.current_round()}/{MeetingKeys.AGENTS_WORLD}")
        assert places is not None and int(places.value) == 2
        third = _arriving(etcd_config, "grow", join_timeout="1")  # --nnodes=1:2: the round is full
        with pytest.raises(RendezvousTimeoutError, match="every place taken"):
            third.next_rendezvous()
    finally:
        point.close()


def test_a_round_whose_workers_never_said_growable_is_not_grown(etcd_config: EtcdConfig, monkeypatch) -> None:
    import unicron_elastic.rendezvous.handler as handler_module
    import unicron_elastic.rendezvous.rounds as rounds_module
    from unicron_elastic.rendezvous.gate import JoinGate

    class Planned(JoinGate):  # what PlanGate does when the plan gives the task one more node
        restarts_to_grow = True

        def admit(self, request) -> None:
            return None

        def grow(self, request, nodes: int) -> bool:
            return True

    _, point = _running(etcd_config, "plain")
    try:
        monkeypatch.setattr(rounds_module, "GROWABLE_WAIT_S", 0.0)  # the round's workers had their time
        waiting = _arriving(etcd_config, "plain", join_timeout="1")
        with pytest.raises(RendezvousTimeoutError):  # without a coordinator: wait for a lost place, restart nobody
            waiting.next_rendezvous()
        planned = _arriving(etcd_config, "plain")
        planned.gate = Planned()
        monkeypatch.setattr(handler_module, "SETTLE_S", 0.3)
        began = time.monotonic()
        assert planned._rejoin_running_round() is None  # under a plan: torch's restart-all at the new size
        assert time.monotonic() - began >= 0.3  # once the wish held for SETTLE_S (not a lapsed lease's blip)
        assert planned.round_joined is None
    finally:
        point.close()


# -- a lease that lapses on an overloaded host and is renewed is not a lost node --------------------


def _lose_place(etcd_config: EtcdConfig, run_id: str, handler: UnicronRendezvousHandler):
    """Place 1 of ``handler``'s round: its node started workers and was lost (seen, agent gone, not done)."""
    from unicron_elastic.agent.meeting_point import MeetingPoint

    lost = MeetingPoint(handler.status_store, run_id, handler.current_round(), 5, 1, 2, host="127.0.0.1")
    lost.close()  # the lease goes with its keys; no exit barrier: the place is free
    return f"{handler.status_store.keys.meeting(run_id)}{handler.current_round()}/"


def test_an_arriving_node_waits_out_a_lapsed_lease_instead_of_restarting_the_round(
        etcd_config: EtcdConfig, store: StatusStore) -> None:
    first, point = _running(etcd_config, "lapse")
    try:
        prefix = _lose_place(etcd_config, "lapse", first)
        store.delete(prefix + MeetingKeys.agent(0))  # the survivor's lease lapsed: no live agent for a while
        arriving = _arriving(etcd_config, "lapse")
        result: list = []
        thread = threading.Thread(target=lambda: result.append(arriving._rejoin_running_round()), daemon=True)
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive()  # neither a restart-all (None) nor the place of a node that may be alive
        point._rekey(point.lease.id)  # the renewal puts the survivor's keys back
        thread.join(timeout=10)
        assert not thread.is_alive() and result[0] is not None
        assert (result[0].rank, result[0].world_size) == (1, 2) and arriving.round_joined.running  # the lost node's place
    finally:
        point.close()


def test_a_round_without_a_live_agent_for_the_settle_time_is_given_up(etcd_config: EtcdConfig,
                                                                      monkeypatch) -> None:
    import unicron_elastic.rendezvous.handler as handler_module

    first, point = _running(etcd_config, "gone")
    _lose_place(etcd_config, "gone", first)
    point.close()  # every node of the round lost
    monkeypatch.setattr(handler_module, "SETTLE_S", 0.3)
    began = time.monotonic()
    assert _arriving(etcd_config, "gone")._rejoin_running_round() is None  # torch's next round
    assert time.monotonic() - began >= 0.3


def test_a_place_deleted_is_told_as_lost_unless_its_owner_marked_it_left_or_it_is_ours(store: StatusStore) -> None:
    from unicron_elastic.agent.meeting_point import PlacesWatch
    from unicron_elastic.rendezvous.api import PlaceOwner

    prefix = store.keys.meeting("places") + "0/"
    lost: list[str] = []
    owners = {p: PlaceOwner(f"node{p}", "h", 100 + p, 0, p) for p in range(4)}
    for p, owner in owners.items():
        store.put(prefix + MeetingKeys.agent(p), owner.encode())
    watch = PlacesWatch(store, prefix, own=0, on_peer_lost=lambda node, revision: lost.append(node))
    try:
        store.put(prefix + MeetingKeys.agent(2), PlaceOwner("node2", "h", 102, 0, 2, left=True).encode())
        store.put(prefix + MeetingKeys.agent(4), PlaceOwner("node4", "h", 104, 0, 4).encode())  # taken after the watch
        for p in (0, 2, 1, 4):  # ours, left on purpose, lost, lost
            store.delete(prefix + MeetingKeys.agent(p))
        assert wait_for(lambda: len(lost) >= 2, deadline_s=5)
        time.sleep(0.2)  # (nothing more comes)
        assert lost == ["node1", "node4"]
    finally:
        watch.cancel()


def test_a_node_whose_place_was_taken_while_its_lease_lapsed_gives_it_up(etcd_config: EtcdConfig,
                                                                         store: StatusStore) -> None:
    from unicron_elastic.api import PlaceTakenError
    from unicron_elastic.agent.meeting_point import MeetingPoint

    first, point = _running(etcd_config, "fence")
    lost: list[bool] = []
    lapsing = MeetingPoint(store, "fence", first.current_round(), 5, 1, 2, host="127.0.0.1",
                           on_place_lost=lambda: lost.append(True))
    try:
        prefix = f"{store.keys.meeting('fence')}{first.current_round()}/"
        assert store.get(prefix + MeetingKeys.agent(1)).value == lapsing.owner.encode()
        store.delete(prefix + MeetingKeys.agent(1))  # its lease lapsed
        arriving = _arriving(etcd_config, "fence")
        assert arriving._rejoin_running_round().rank == 1  # a live agent (place 0): place 1 looks lost, taken
        with pytest.raises(PlaceTakenError):
            lapsing._rekey(lapsing.lease.id)  # the renewal does not take it back ...
        assert lost == [True]  # ... the node gives itself up (its agent: SEV1)
        assert store.get(prefix + MeetingKeys.agent(1)).value != lapsing.owner.encode()
        point._rekey(point.lease.id)  # a renewal whose place nobody took puts it back
        assert store.get(prefix + MeetingKeys.agent(0)).value == point.owner.encode()
    finally:
        lapsing.close()
        point.close()


def test_a_node_arriving_after_the_run_finished_is_told_so_and_one_after_a_failure_is_refused(
        etcd_config: EtcdConfig) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from unicron_elastic.rendezvous.handler import SETTLE_S, RunFinished

    for run_id, succeeded in (("done", True), ("failed", False)):
        first, point = _running(etcd_config, run_id)
        _lose_place(etcd_config, run_id, first)  # a place whose node left before the end (not done)
        if succeeded:
            assert point.exit_barrier(1, 0.0) == []  # this node's workers succeeded: training is over
        point.close()
        first.shutdown()  # torch closes the rendezvous when its launcher ends
        arriving = _arriving(etcd_config, run_id)
        began = time.monotonic()
        with pytest.raises(RunFinished if succeeded else RendezvousClosedError) as caught:
            arriving.next_rendezvous()
        assert isinstance(caught.value, RunFinished) == succeeded
        assert (time.monotonic() - began < SETTLE_S) == succeeded  # a finished round is no lapsed one
        plain = create_handler(_params(etcd_config, run_id, last_call_timeout="1", join_timeout="20"))
        with pytest.raises(RendezvousClosedError) as caught:  # plain torchrun: torch's error, as before
            plain.next_rendezvous()
        assert not isinstance(caught.value, RunFinished)


# -- a running round is quiet: no torch heartbeats, no reads of torch's state (rendezvous/quiet.py) ------------


class _GrowsByRestart:
    """What PlanGate says when the plan gives the task one more node and its workers cannot admit joiners."""

    restarts_to_grow = True

    def admit(self, request) -> None:
        return None

    def grow(self, request, nodes: int) -> bool:
        return True


def test_a_quiet_node_whose_round_torch_moved_past_enters_the_next_round(
        etcd_config: EtcdConfig, store: StatusStore) -> None:
    """A node that joined a running round is no participant of torch's: when the others go on to the next
    round and its look comes too late to see them waiting, torch's round past its own still tells it to
    enter the next round (it was left quiet in a round that had ended)."""
    from unicron_elastic.rendezvous.backend import decode_state

    conf = dict(last_call_timeout="1", join_timeout="30", keep_alive_interval="1", keep_alive_max_attempt="2")
    first = create_handler(_params(etcd_config, "moved-on", **conf))
    first.join_running_rounds(2)
    first.next_rendezvous()
    assert first.num_nodes_waiting() == 0  # quiet in its round
    kv = store.get(store.keys.rdzv("moved-on"))
    state = pickle.loads(decode_state(kv.value))
    state.round += 1  # the others went on without it (as torch does once its round's participants left)
    state.complete, state.participants, state.last_heartbeats = False, {}, {}
    first.backend.set_state(pickle.dumps(state), kv.mod_revision)
    deadline = time.monotonic() + 10
    while first.num_nodes_waiting() == 0:  # seen at its next look (every keep_alive_interval)
        assert time.monotonic() < deadline, "the node was left in a round that had ended"
        time.sleep(0.1)
    assert first.round_joined is not None and first.round_joined.round == state.round - 1


def test_a_running_round_is_quiet_and_a_node_entering_the_rendezvous_keeps_it_alive(
        etcd_config: EtcdConfig, store: StatusStore, monkeypatch) -> None:
    """Seen at 64 nodes: torch's heartbeats and state reads cost every node of a running round the whole
    state a second (benchmarks/scale.py). Quiet, the round writes nothing; a node entering the rendezvous
    stamps the live places first, so the long-silent participant is not dropped as dead, and announces
    itself, so the participant sees it waiting and the round re-forms with both."""
    import unicron_elastic.rendezvous.handler as handler_module
    import unicron_elastic.rendezvous.rounds as rounds_module
    from unicron_elastic.agent.meeting_point import MeetingPoint, RoundStart
    from unicron_elastic.rendezvous.backend import decode_state

    monkeypatch.setattr(rounds_module, "GROWABLE_WAIT_S", 0.0)  # the round's workers never said growable
    monkeypatch.setattr(handler_module, "SETTLE_S", 0.1)
    conf = dict(last_call_timeout="1", join_timeout="30", keep_alive_interval="1", keep_alive_max_attempt="2")
    first = create_handler(_params(etcd_config, "quiet", **conf))
    first.join_running_rounds(2)
    first.next_rendezvous()
    point = MeetingPoint(first.status_store, "quiet", first.current_round(), 5, 0, 1, host="127.0.0.1",
                         start=RoundStart(1, 2, 2, 4))
    key = store.keys.rdzv("quiet")
    try:
        written = store.get(key).mod_revision
        quiet_until = time.monotonic() + 2.5  # more than keep_alive_interval x keep_alive_max_attempt
        while time.monotonic() < quiet_until:
            assert first.num_nodes_waiting() == 0  # (torch's agent asks at every monitor interval)
            time.sleep(0.1)
        assert store.get(key).mod_revision == written  # torch would have written a heartbeat every second

        second = create_handler(_params(etcd_config, "quiet", **conf))
        second.join_running_rounds(2)
        second.gate = _GrowsByRestart()
        joined: list = []
        thread = threading.Thread(target=lambda: joined.append(second.next_rendezvous()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while first.num_nodes_waiting() == 0:  # the announcement is seen within keep_alive_interval
            assert time.monotonic() < deadline, "the node waiting for the next round was not seen"
            time.sleep(0.1)
        state = pickle.loads(decode_state(store.get(key).value))
        assert first._this_node in state.participants  # stamped from its live place: not dropped as dead
        info = first.next_rendezvous()  # torch's agent restarts every worker: the round re-forms with both
        thread.join(30)
        assert joined and (info.world_size, joined[0].world_size) == (2, 2)
        assert store.count_prefix(store.keys.rdzv_waiting("quiet")) == 0  # the announcements are withdrawn
    finally:
        point.close()
