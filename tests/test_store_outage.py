"""etcd outages while many threads share one StatusStore (issue #9, items 4 and 13).

Every thread loops on get/put/cas. etcd is stopped for 3 s and 15 s (shorter than the
reconnect timeout: no caller sees anything) and for longer than a 2 s reconnect timeout
(every caller gets StoreUnavailableError, the documented outcome, and nothing else).
The store logs ``etcd_reconnected`` with the outage's duration when etcd is back.
"""

from __future__ import annotations

import threading
import time

import pytest
import structlog

import unicron_elastic.store.client as client_module
from conftest import events_named
from unicron_elastic.api import EtcdConfig, StoreUnavailableError
from unicron_elastic.store import EmbeddedEtcd, StatusStore

THREADS = 8


@pytest.fixture()
def captured(capture_log) -> structlog.testing.LogCapture:
    """The store module's log records."""
    return capture_log(client_module)


class Hammer:
    """THREADS threads doing get/put/cas on one store until stopped; records what escapes."""

    def __init__(self, store: StatusStore) -> None:
        self.store = store
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.errors: list[tuple[int, float, BaseException]] = []
        self.ops = [0] * THREADS
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(THREADS)]

    def _run(self, i: int) -> None:
        key = f"/outage/{i}"
        while not self.stop.is_set():
            try:
                self.store.put(key, str(self.ops[i]))
                kv = self.store.get(key)
                self.store.cas(key, "next", kv.mod_revision if kv is not None else None)
                self.ops[i] += 1
            except BaseException as exc:  # noqa: BLE001 - the test records everything that escapes
                with self.lock:
                    self.errors.append((i, time.monotonic(), exc))
                time.sleep(0.05)

    def __enter__(self) -> Hammer:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self.threads), "a store call hangs"

    def wait_ops(self, minimum: int, timeout: float) -> None:
        """Wait until every thread has done ``minimum`` more rounds than now."""
        target = [n + minimum for n in self.ops]
        deadline = time.monotonic() + timeout
        while any(n < t for n, t in zip(self.ops, target)):
            assert time.monotonic() < deadline, f"threads made no progress: {self.ops} < {target}"
            time.sleep(0.05)


@pytest.mark.parametrize("outage_s", [3.0, pytest.param(15.0, marks=pytest.mark.e2e)])
def test_outage_shorter_than_reconnect_timeout_is_invisible(
    private_etcd: EmbeddedEtcd, captured: structlog.testing.LogCapture, outage_s: float
) -> None:
    config = EtcdConfig(port=private_etcd.client_port, reconnect_timeout=outage_s + 30, request_timeout=2)
    store = StatusStore(config)
    with Hammer(store) as hammer:
        hammer.wait_ops(3, timeout=30)
        private_etcd.kill()
        time.sleep(outage_s)  # the outage itself
        private_etcd.start()
        hammer.wait_ops(3, timeout=60)
    store.close()
    assert [(i, repr(e)) for i, _, e in hammer.errors] == []
    reconnected = events_named(captured, "etcd_reconnected")
    assert len(reconnected) == 1, captured.entries  # once per outage, not once per thread
    assert outage_s - 1 <= reconnected[0]["outage_s"] <= outage_s + 30
    assert len(events_named(captured, "etcd_unreachable_retrying")) == 1


def test_outage_longer_than_reconnect_timeout_raises_only_store_unavailable(
    private_etcd: EmbeddedEtcd, captured: structlog.testing.LogCapture
) -> None:
    config = EtcdConfig(port=private_etcd.client_port, reconnect_timeout=2, request_timeout=1)
    store = StatusStore(config)
    with Hammer(store) as hammer:
        hammer.wait_ops(3, timeout=30)
        private_etcd.kill()
        killed = time.monotonic()
        deadline = killed + 60
        while {i for i, _, _ in hammer.errors} != set(range(THREADS)):
            assert time.monotonic() < deadline, f"not every thread gave up: {hammer.errors}"
            time.sleep(0.05)
        private_etcd.start()
        hammer.wait_ops(3, timeout=60)  # and they all work again once etcd is back
    store.close()
    unexpected = [(i, repr(e)) for i, _, e in hammer.errors if not isinstance(e, StoreUnavailableError)]
    assert unexpected == []
    first_error = min(t for _, t, _ in hammer.errors)
    assert first_error - killed >= 1.0  # each caller retried for about reconnect_timeout (2 s) first
    assert all("unreachable for 2.0s" in str(e) for _, _, e in hammer.errors)
    assert events_named(captured, "etcd_reconnected")


def ride_out_outage(endpoint: str, cluster: str, tmp_path, cut, heal) -> None:
    """A real run (``unicron-run``, one rank): once it trained 10 steps, ``cut()`` etcd, wait 3 s, ``heal()``.

    Asserts the run finishes every step, logs the reconnection (or, with several members, the move to one
    that answered), and restarts nothing.
    """
    import json
    import os
    import subprocess

    from conftest import BIN, EXAMPLES

    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"])
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={endpoint}", "--rdzv-id=outage",
           "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=0.1", "--log-format=json",
           f"--rdzv-conf=cluster={cluster},last_call_timeout=1,keep_alive_interval=1",
           os.path.join(EXAMPLES, "resilient_worker.py"), "--steps", "150", "--step-time", "0.05", "--out", str(out)]
    log_path = tmp_path / "run.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            step_file = out / "rank0.step"
            deadline = time.monotonic() + 90
            while not (step_file.exists() and step_file.read_text().strip() and int(step_file.read_text()) >= 10):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)
            cut()
            time.sleep(3.0)  # the outage itself
            heal()
            assert proc.wait(timeout=100) == 0, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    names = [r.get("event") for r in records]
    # the run met the outage: it waited for etcd, or (several members) its store moved to one that answered
    seen = {"etcd_reconnected", "etcd_failover"} if "," in endpoint else {"etcd_reconnected"}
    assert seen & set(names), text[-3000:]
    assert "worker_restarted" not in names and "error_event" not in names, text[-3000:]
    assert "Traceback" not in text and "Cannot invoke RPC" not in text, text[-3000:]
    assert int((out / "rank0.step").read_text()) == 149


@pytest.mark.timeout(150)
def test_unicron_run_rides_out_a_3s_etcd_outage(private_etcd: EmbeddedEtcd, tmp_path) -> None:
    """A real run: etcd stops for 3 s mid-training; the run finishes and logs the reconnection."""
    ride_out_outage(private_etcd.endpoint, "outage", tmp_path, private_etcd.kill, private_etcd.start)
