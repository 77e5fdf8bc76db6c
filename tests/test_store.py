"""The status store against a real etcd: values, CAS, leases, watches, reconnect."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import etcd3
import pytest

from conftest import wait_for
from unicron_elastic.api import (
    ConfigError,
    EtcdConfig,
    EtcdStartError,
    MalformedValueError,
    NotLeaderError,
    StoreError,
    StoreUnavailableError,
)
from unicron_elastic.store import (
    EmbeddedEtcd,
    KeptLease,
    Keys,
    LeaderElection,
    PrefixWatch,
    StatusStore,
    free_port,
)
from unicron_elastic.store.embedded import GOMAXPROCS_ENV, etcd_environment


def test_put_get_delete_and_json(store: StatusStore) -> None:
    key = store.keys.plan()
    assert store.get(key) is None
    rev = store.put_json(key, {"generation": 1})
    kv = store.get(key)
    assert kv is not None and kv.mod_revision == rev
    assert store.get_json(key) == {"generation": 1}
    assert store.delete(key) is True
    assert store.get_json(key) is None


def test_malformed_json_is_a_typed_error_and_skipped_in_prefix_reads(store: StatusStore) -> None:
    store.put(store.keys.node("good"), '{"ok": true}')
    store.put(store.keys.node("bad"), b"\x00not json")
    with pytest.raises(MalformedValueError, match="not JSON"):
        store.get_json(store.keys.node("bad"))
    assert store.get_json_prefix(store.keys.nodes()) == {store.keys.node("good"): {"ok": True}}


def test_cas_create_only_and_conflicts(store: StatusStore) -> None:
    key = store.keys.task_status("t1")
    first = store.cas(key, "a", None)
    assert first.succeeded and first.current is not None and first.current.value == b"a"
    again = store.cas(key, "b", None)
    assert not again.succeeded and again.current.value == b"a"
    token = first.current.mod_revision
    ok = store.cas(key, "c", token)
    assert ok.succeeded and ok.current.value == b"c" and ok.current.mod_revision > token
    stale = store.cas(key, "d", token)
    assert not stale.succeeded and stale.current.value == b"c"


def test_concurrent_cas_increments_lose_nothing(store: StatusStore) -> None:
    key = store.keys.task_status("counter")
    store.put(key, "0")

    def bump(n: int) -> None:
        for _ in range(n):
            while True:
                kv = store.get(key)
                if store.cas(key, str(int(kv.value) + 1), kv.mod_revision).succeeded:
                    break

    threads = [threading.Thread(target=bump, args=(25,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get(key).value == b"100"


def test_lease_expiry_is_seen_by_a_watcher(store: StatusStore) -> None:
    events = []
    watch = PrefixWatch(store, store.keys.nodes(), events.append)
    lease = KeptLease(store, ttl=1)
    store.put_json(store.keys.node("n1"), {"host": "a"}, lease=lease.id)
    time.sleep(2.5)  # refreshed: the key must outlive its TTL
    assert store.get(store.keys.node("n1")) is not None
    lease.close(revoke=False)  # stop refreshing: simulate a dead agent
    stopped = time.monotonic()
    assert wait_for(lambda: any(e.kind == "delete" for e in events), deadline_s=5)
    elapsed = time.monotonic() - stopped
    assert elapsed < 3.0, elapsed  # 1 s TTL, <= 1/3 TTL of refresh slack, watch delay
    assert [e.kind for e in events] == ["put", "delete"]
    watch.cancel()


def test_a_watch_of_deletes_only_gets_each_delete_with_the_value_it_deleted(store: StatusStore) -> None:
    events = []
    watch = PrefixWatch(store, store.keys.nodes(), events.append, deletes_only=True)
    try:
        for i in range(5):  # puts (many writers) cost the watch nothing
            store.put(store.keys.node(f"d{i}"), f"v{i}")
        store.put(store.keys.node("d1"), "v1 again")
        store.delete(store.keys.node("d1"))
        assert wait_for(lambda: events, deadline_s=5)
        store.put(store.keys.node("d9"), "late")
        store.delete(store.keys.node("d9"))
        assert wait_for(lambda: len(events) == 2, deadline_s=5)
        assert [(e.kind, e.key, e.previous) for e in events] == [
            ("delete", store.keys.node("d1"), b"v1 again"), ("delete", store.keys.node("d9"), b"late")]
    finally:
        watch.cancel()


def test_lease_revoke_deletes_keys_at_once(store: StatusStore) -> None:
    lease = KeptLease(store, ttl=5)
    store.put(store.keys.node("n2"), "x", lease=lease.id)
    lease.close(revoke=True)
    assert store.get(store.keys.node("n2")) is None


def test_a_lapsed_lease_is_renewed_and_the_holder_puts_its_keys_back(store: StatusStore) -> None:
    key = store.keys.node("renewed")
    renewed: list[int] = []
    lost = threading.Event()

    def put_back(lease_id: int) -> None:
        store.put(key, "back", lease=lease_id)
        renewed.append(lease_id)

    lease = KeptLease(store, ttl=2, on_lost=lost.set, on_renewed=put_back)
    first = lease.id
    store.put(key, "first", lease=first)
    store.call(lambda c: c.revoke_lease(first), "revoke")  # what etcd does to a lease not refreshed for a TTL
    assert store.get(key) is None
    assert wait_for(lambda: renewed, deadline_s=10)
    assert renewed == [lease.id] and lease.id != first and lease.renewals == 1
    assert store.get(key).value == b"back"
    time.sleep(2.5)  # the new lease is refreshed like the first
    assert store.get(key).value == b"back" and not lost.is_set()
    lease.close(revoke=True)
    assert store.get(key) is None


def test_a_lapsed_lease_without_renewal_or_with_a_failed_one_is_lost(store: StatusStore) -> None:
    for renew in (None, _failing_renewal):
        lost = threading.Event()
        lease = KeptLease(store, ttl=2, on_lost=lost.set, on_renewed=renew)
        store.call(lambda c, lid=lease.id: c.revoke_lease(lid), "revoke")
        assert lost.wait(10), renew
        assert lease.lost.is_set() and lease.renewals == 0
        lease.close(revoke=True)


def _failing_renewal(lease_id: int) -> None:
    raise StoreError(f"cannot put keys on {lease_id}")


@pytest.mark.e2e
def test_a_private_etcd_whose_port_was_taken_meanwhile_starts_on_fresh_ports() -> None:
    """free_port() only says a port *was* free; another process can bind it before etcd does (seen under
    load: ``unicron-run --standalone`` failed with "bind: address already in use")."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedEtcd()
        server.client_port = taken.getsockname()[1]  # the race, made certain
        try:
            server.start()
            assert server.client_port != taken.getsockname()[1]
            with StatusStore(server.config) as store:
                store.put("/k", "v")
                assert store.get("/k").value == b"v"
        finally:
            server.stop()
        restarted = EmbeddedEtcd().start()  # a restart keeps its ports: no second chance on another one
        try:
            restarted.kill()
            restarted.client_port = taken.getsockname()[1]
            with pytest.raises(EtcdStartError, match="address already in use"):
                restarted.start()
        finally:
            restarted.stop()


def test_lease_ttl_must_be_positive(store: StatusStore) -> None:
    with pytest.raises(ConfigError, match="ttl"):
        KeptLease(store, ttl=0)


def test_election_and_fencing_token(store: StatusStore) -> None:
    a = LeaderElection(store, "a", ttl=2)
    b = LeaderElection(store, "b", ttl=2)
    token = a.campaign(timeout=5)
    assert a.is_leader() and b.try_acquire() is None
    a.fenced_put(store.keys.plan(), "from-a")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("token", b.campaign(timeout=10)))
    t.start()
    a.resign()
    t.join(timeout=10)
    assert result["token"] > token and b.is_leader()
    with pytest.raises(NotLeaderError):
        a.token = token  # a deposed leader that still believes it leads
        a.fenced_put(store.keys.plan(), "stale")
    assert store.get(store.keys.plan()).value == b"from-a"
    b.fenced_put(store.keys.plan(), "from-b")
    assert store.get(store.keys.plan()).value == b"from-b"
    b.resign()


def test_the_embedded_server_runs_go_on_one_core_unless_the_environment_sets_gomaxprocs(
        private_etcd: EmbeddedEtcd) -> None:
    assert private_etcd.proc is not None
    raw = Path(f"/proc/{private_etcd.proc.pid}/environ").read_bytes().decode().split("\0")
    environ = dict(entry.split("=", 1) for entry in raw if "=" in entry)
    assert environ[GOMAXPROCS_ENV] == os.environ.get(GOMAXPROCS_ENV, "1")
    assert environ.get("PATH") == os.environ.get("PATH")  # (the rest of the environment is passed on)
    assert etcd_environment({"PATH": "/bin"}) == {"PATH": "/bin", GOMAXPROCS_ENV: "1"}
    assert etcd_environment({GOMAXPROCS_ENV: "4"}) == {GOMAXPROCS_ENV: "4"}  # the user's choice stands


def test_store_reconnects_after_etcd_restart(private_etcd: EmbeddedEtcd) -> None:
    store = StatusStore(private_etcd.config)
    store.put("/k", "before")
    private_etcd.kill()
    restarter = threading.Timer(1.0, private_etcd.start)
    restarter.start()
    started = time.monotonic()
    assert store.get("/k").value == b"before"  # blocks through the outage
    assert time.monotonic() - started >= 0.9
    store.put("/k", "after")
    assert store.get("/k").value == b"after"
    restarter.join()
    store.close()


def test_watch_resumes_after_etcd_restart_without_losing_events(private_etcd: EmbeddedEtcd) -> None:
    store = StatusStore(private_etcd.config)
    seen = []
    watch = PrefixWatch(store, "/w/", lambda e: seen.append((e.key, e.value)))
    store.put("/w/1", "a")
    assert wait_for(lambda: len(seen) == 1)
    private_etcd.kill()
    private_etcd.start()
    store.put("/w/2", "b")
    store.put("/w/3", "c")
    wait_for(lambda: len(seen) == 3, deadline_s=15, why=lambda: f"3 events, saw {seen}")
    assert seen == [("/w/1", b"a"), ("/w/2", b"b"), ("/w/3", b"c")]
    assert watch.reconnects >= 1
    watch.cancel()
    store.close()


def test_unreachable_endpoint_gives_clear_error_within_timeout() -> None:
    config = EtcdConfig(host="127.0.0.1", port=free_port(), reconnect_timeout=1.5, request_timeout=0.5)
    store = StatusStore(config)
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"127\.0\.0\.1:\d+ unreachable for 1\.5s"):
        store.get("/x")
    elapsed = time.monotonic() - started
    assert 1.4 <= elapsed <= 3.0, elapsed


def test_raw_python3_etcd3_client_refuses_to_reconnect(private_etcd: EmbeddedEtcd) -> None:
    """Why the store builds a fresh client after a failure (see _etcd3_compat)."""
    raw = etcd3.client("127.0.0.1", private_etcd.client_port, timeout=1)
    raw.put("/raw", "1")
    private_etcd.kill()
    with pytest.raises(etcd3.exceptions.ConnectionFailedError):
        raw.get("/raw")
    private_etcd.start()
    assert StatusStore(private_etcd.config).get("/raw").value == b"1"  # etcd is back
    with pytest.raises(ValueError, match="failed node"):
        raw.get("/raw")  # ... but the old client will not use it for 300 s
    raw.close()


def test_python3_etcd3_watch_module_lacks_six() -> None:
    """Why _etcd3_compat patches etcd3.watch: without it a dead stream kills the thread."""
    code = "import etcd3.watch, inspect; print(hasattr(etcd3.watch, 'six'), 'six.itervalues' in inspect.getsource(etcd3.watch))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_keys_reject_slashes_and_empty_parts() -> None:
    with pytest.raises(ConfigError):
        Keys("a/b")
    with pytest.raises(ConfigError):
        Keys("c").node("")
    assert Keys("c").event(7) < Keys("c").event(10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"port": 0}, "port"),
        ({"cluster": "a/b"}, "cluster"),
        ({"request_timeout": 0}, "request_timeout"),
        ({"cert_key": "k"}, "cert_key and cert_cert"),
        ({"user": "u"}, "user and password"),
    ],
)
def test_etcd_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EtcdConfig(**kwargs)


def test_missing_etcd_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from unicron_elastic.api import EtcdBinaryNotFoundError

    monkeypatch.setenv("UNICRON_ETCD_BINARY", str(tmp_path / "nope"))
    with pytest.raises(EtcdBinaryNotFoundError, match="not an executable"):
        EmbeddedEtcd()


def test_user_password_authentication(private_etcd: EmbeddedEtcd) -> None:
    from pathlib import Path

    etcdctl = str(Path(private_etcd.binary).with_name("etcdctl"))
    ctl = [etcdctl, f"--endpoints={private_etcd.endpoint}"]
    for args in (["user", "add", "root:rootpw"], ["user", "add", "unicron:s3cret"], ["user", "grant-role", "unicron", "root"], ["auth", "enable"]):
        subprocess.run(ctl + args, check=True, capture_output=True, timeout=20)
    good = StatusStore(EtcdConfig(port=private_etcd.client_port, user="unicron", password="s3cret", reconnect_timeout=2))
    good.put("/auth", "ok")
    assert good.get("/auth").value == b"ok"
    good.close()
    bad = StatusStore(EtcdConfig(port=private_etcd.client_port, user="unicron", password="wrong", reconnect_timeout=2))
    with pytest.raises(StoreError, match="authentication failed, invalid user ID or password"):
        bad.get("/auth")
    anonymous = StatusStore(EtcdConfig(port=private_etcd.client_port, reconnect_timeout=2))
    with pytest.raises(StoreError, match="user name is empty"):
        anonymous.get("/auth")


def test_config_repr_hides_the_password() -> None:
    assert "s3cret" not in repr(EtcdConfig(user="u", password="s3cret"))
