"""Shared fixtures: a real etcd per session (and per test where it is restarted)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from unicron_elastic.api import EtcdConfig
from unicron_elastic.store import EmbeddedEtcd, StatusStore
from unicron_elastic.testing import json_log_entries  # noqa: F401 - the tests import it from here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
BIN = os.path.dirname(sys.executable)
T = TypeVar("T")


def wait_for_launcher(condition: Callable[[], object], seconds: float, what: str, log: Path | None = None,
                      proc: subprocess.Popen | None = None) -> None:
    """Poll ``condition`` until it holds; fail with the log's tail past ``seconds`` or if ``proc`` exits first.

    A launcher that exits just as the condition comes true has not exited
    *before* it: the condition is checked again before that failure.
    """
    deadline = time.monotonic() + seconds
    while not condition():
        tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
        assert proc is None or proc.poll() is None or condition(), \
            f"launcher exited ({proc.returncode}) before {what}:\n{tail}"
        assert time.monotonic() < deadline, f"no {what} after {seconds}s:\n{tail}"
        time.sleep(0.05)


def wait_for(what: Callable[[], object], deadline_s: float = 240.0, interval: float = 0.05,
             why: str | Callable[[], str] = "") -> object:
    """Poll ``what`` until it returns something true and return that; fail past ``deadline_s``.

    The deadline only bounds a failing test: a passing one returns as soon as
    the condition holds, so it is generous for a loaded machine. ``why`` (or
    what it returns, read at the failure) goes into the failure's message.

    Raises:
        AssertionError: ``what`` was still false after ``deadline_s`` seconds.
    """
    deadline = time.monotonic() + deadline_s
    while not (value := what()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {deadline_s} s: {why() if callable(why) else why}")
        time.sleep(interval)
    return value


def unicron(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the ``unicron`` CLI (without an inherited ``UNICRON_ETCD_PASSWORD``); its output captured as text."""
    full = {k: v for k, v in os.environ.items() if k != "UNICRON_ETCD_PASSWORD"}
    full.update(env or {})
    return subprocess.run([os.path.join(BIN, "unicron"), *args], capture_output=True, text=True, timeout=timeout,
                          env=full)


def leader_of(store: StatusStore) -> str | None:
    """The coordinator candidate that holds the leader key, if any."""
    kv = store.get(store.keys.leader())
    return kv.value.decode() if kv else None


def events_named(cap: object, name: str) -> list[dict]:
    """The entries named ``name`` of a ``structlog.testing.LogCapture``."""
    return [e for e in cap.entries if e["event"] == name]


@pytest.fixture()
def capture_log(monkeypatch: pytest.MonkeyPatch) -> Callable[[object], object]:
    """``capture_log(module, ...)`` replaces each ``module.log`` for the test and returns their one ``LogCapture``.

    Independent of any global structlog setup: every level is captured.
    """
    import structlog

    def capture(*modules: object) -> structlog.testing.LogCapture:
        cap = structlog.testing.LogCapture()
        logger = structlog.wrap_logger(structlog.testing.CapturingLogger(), processors=[cap],
                                       wrapper_class=structlog.make_filtering_bound_logger(0))
        for module in modules:
            monkeypatch.setattr(module, "log", logger)
        return cap

    return capture


@pytest.fixture(scope="session")
def failure_free(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], T]], T]:
    """``failure_free(name, run)``: the failure-free reference run ``name``, trained once per session.

    ``run(out)`` trains into the fresh folder ``out`` and returns what the
    tests compare with (final parameters, or the folder). Every later request
    for ``name``, from any module, gets the same value without training again.
    ``name`` must identify everything the run depends on.
    """
    runs: dict[str, object] = {}

    def get(name: str, run: Callable[[Path], T]) -> T:
        if name not in runs:
            runs[name] = run(tmp_path_factory.mktemp(re.sub(r"[^A-Za-z0-9_.-]", "_", name)))
        return runs[name]  # type: ignore[return-value]

    return get


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    """One private etcd for the whole session (tests isolate by cluster name)."""
    server = EmbeddedEtcd().start()
    yield server
    server.stop()


@pytest.fixture()
def private_etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd of the test's own, for tests that stop or restart it."""
    server = EmbeddedEtcd().start()
    yield server
    server.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test on a real SLURM is in the e2e tier: the default tier must pass where SLURM is not installed.

    Raises:
        pytest.UsageError: A test asks for the ``slurm`` fixture without the ``e2e`` mark.
    """
    unmarked = [item.nodeid for item in items if "slurm" in getattr(item, "fixturenames", ())
                and item.get_closest_marker("e2e") is None]
    if unmarked:
        raise pytest.UsageError(f"tests on a real SLURM must be marked e2e: {unmarked}")


@pytest.fixture(scope="session")
def _slurm_session() -> Iterator[object]:
    """A real SLURM cluster of three nodes on loopback (munged, slurmctld, three slurmd), once per session.

    Started only by a test that asks for it (in the e2e tier); a machine without Debian's ``slurmd slurmctld
    munge`` fails the test with the reason (``bash .ci/system-packages`` installs them, as ``.ci/run`` does): no
    test skips for want of SLURM.
    """
    from unicron_elastic.slurm.loopback import LoopbackSlurm

    cluster = LoopbackSlurm(3).start()
    yield cluster
    cluster.stop()


@pytest.fixture()
def slurm(_slurm_session) -> Iterator[object]:
    """The session's loopback SLURM cluster, every node up and no job left when the test starts and ends."""
    _slurm_session.heal()
    yield _slurm_session
    _slurm_session.heal()


def _cluster_name(request: pytest.FixtureRequest) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:80]


@pytest.fixture()
def etcd_config(etcd: EmbeddedEtcd, request: pytest.FixtureRequest) -> EtcdConfig:
    """Config for the session etcd with a cluster name unique to the test."""
    return EtcdConfig(host="127.0.0.1", port=etcd.client_port, cluster=_cluster_name(request), reconnect_timeout=10)


@pytest.fixture()
def store(etcd_config: EtcdConfig) -> Iterator[StatusStore]:
    """A status store on the session etcd, closed after the test."""
    s = StatusStore(etcd_config)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """No test leaves this process's environment or torch's thread count changed for the tests after it.

    An in-process Lightning ``Trainer`` sets ``OMP_NUM_THREADS`` (and torch's
    thread count) for a one-process run; a later test's subprocess would
    inherit it and train a reference run with another thread count than the
    run it is compared with.
    """
    import torch

    environ, threads = dict(os.environ), torch.get_num_threads()
    yield
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update({name: value for name, value in environ.items() if os.environ.get(name) != value})
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _cli_keeps_the_test_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process ``unicron`` CLI calls must not reconfigure this process's logging.

    ``configure_logging`` routes structlog through stdlib logging and caches the
    module loggers on first use, so one in-process ``main([...])`` would change
    where every later test's logs go.
    """
    import unicron_elastic.cli

    monkeypatch.setattr(unicron_elastic.cli, "configure_logging", lambda *args, **kwargs: None)


def snapshots_saved(output: str) -> dict[str | None, set[int]]:
    """``{shard: steps}`` of the in-memory snapshots a run's output says landed (``snapshot_saved`` lines)."""
    saved: dict[str | None, set[int]] = {}
    for line in output.splitlines():
        if "snapshot_saved" in line:
            shard = re.search(r"shard=(\S+)", line)
            step = re.search(r"step=(\d+)", line)
            name = None if shard is None or shard.group(1) == "None" else shard.group(1)
            saved.setdefault(name, set()).add(int(step.group(1)))
    return saved


def resumed_from_newest_snapshot(output: str, step: int | None) -> bool:
    """Whether ``step`` is a step every shard's snapshot landed for, and none newer landed before the first rejoin.

    The log lines of different processes reach the launcher's output in no guaranteed order, so a
    snapshot's ``snapshot_saved`` line may follow the ``rank_rejoined`` of a rank that resumed from it.
    """
    saved = snapshots_saved(output)
    landed = set.intersection(*saved.values()) if saved else set()
    return step in landed and step >= (newest_snapshot(output) or 0)


def newest_snapshot(output: str) -> int | None:
    """The newest step every shard's snapshot landed for before the first rank rejoined (what it resumed from)."""
    saved = snapshots_saved(output.split("rank_rejoined", 1)[0])
    common = set.intersection(*saved.values()) if saved else set()
    return max(common) if common else None




_QUIET_EVENTS = {"detector_disabled", "snapshot_server_started", "node_registered", "command"}


def _timeline(root: Path, limit: int = 60) -> str:
    """The JSON log events of a failed multi-process test (its ``tmp_path``'s ``*.log`` files), oldest first."""
    rows = []
    for path in root.rglob("*.log"):
        for entry in json_log_entries(path):
            if entry.get("event") not in _QUIET_EVENTS:
                rows.append(entry)
    rows.sort(key=lambda e: str(e.get("timestamp", "")))
    lines = []
    for e in rows[-limit:]:
        rest = {k: v for k, v in e.items() if k not in ("timestamp", "event", "level", "logger", "argv")}
        lines.append(f"{str(e.get('timestamp', ''))[11:23]} {e.get('event')} {json.dumps(rest)[:160]}")
    return "\n".join(lines)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that left JSON logs under its ``tmp_path`` shows their newest events (CI shows them)."""
    report = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and call.when == "call" and isinstance(tmp, Path) and tmp.exists():
        try:
            text = _timeline(tmp)
        except OSError:
            text = ""
        if text:
            report.sections.append(("timeline (newest JSON log events)", text))
    return report
