"""``unicron status`` against hostile values, many events, bad limits and a secured etcd (issue #9, items 9, 10)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import unicron
from unicron_elastic.api import EtcdConfig
from unicron_elastic.cli import render_status
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.store import EmbeddedEtcd, StatusStore


def enable_auth(etcd: EmbeddedEtcd, user: str = "unicron", password: str = "s3cret") -> None:
    """Create root and ``user`` (with the root role) and turn etcd authentication on."""
    ctl = [str(Path(etcd.binary).with_name("etcdctl")), f"--endpoints={etcd.endpoint}"]
    for args in (["user", "add", "root:rootpw"], ["user", "add", f"{user}:{password}"],
                 ["user", "grant-role", user, "root"], ["auth", "enable"]):
        subprocess.run(ctl + args, check=True, capture_output=True, timeout=20)


def put_events(store: StatusStore, first: int, count: int, batch: int = 100) -> None:
    """Write events ``first .. first+count-1`` (sequence numbers) in transactions of ``batch`` puts."""
    for start in range(first, first + count, batch):
        seqs = range(start, min(start + batch, first + count))
        store.call(lambda c, seqs=seqs: c.transaction(compare=[], failure=[], success=[
            c.transactions.put(store.keys.event(s), ErrorEvent(
                Severity.SEV3, "nan_loss", "loss", f"node{s % 7}", rank=s % 8, message=f"event {s}",
                occurred_at=1.7e9 + s, detected_at=1.7e9 + s).to_json())
            for s in seqs]), "test events")


# -- hostile values -----------------------------------------------------------------
WRONG_NODES = {"list": "[]", "number": "3", "string": '"x"', "int-state": '{"state": 5}',
               "null": "null", "deep": "[" * 100_000 + "]" * 100_000, "escape": '{"state": "\\u001b[2Jgone"}'}
WRONG_EVENTS = [
    "[]", "3", '"x"', "null", "[" * 100_000 + "]" * 100_000,
    '{"severity": "SEV2", "kind": "k", "detector": "d", "node": "n", "detected_at": "yesterday"}',
    '{"severity": "SEV2", "kind": "k", "detector": "d", "node": "n", "message": 5}',
    '{"severity": "SEV2", "kind": "k", "detector": "d", "node": "n", "detected_at": 1e300}',
    '{"severity": "SEV2", "kind": "k", "detector": "d", "node": "n", "detected_at": NaN}',
    '{"severity": "SEV2", "kind": ["k"], "detector": "d", "node": {"n": 1}, "rank": "zero"}',
    '{"severity": 2, "kind": "k", "detector": "d", "node": "n"}',
    '{"severity": "SEV2", "kind": "k", "detector": "d", "node": "n", "extra": 1}',
]


def test_status_shows_malformed_lines_for_wrong_types_instead_of_a_traceback(store: StatusStore) -> None:
    store.put_json(store.keys.node("good"), {"state": "running"})
    for name, raw in WRONG_NODES.items():
        store.put(store.keys.node(name), raw)
    for i, raw in enumerate(WRONG_EVENTS, start=1):
        store.put(store.keys.event(i), raw)
    store.put(store.keys.event(100), ErrorEvent(Severity.SEV2, "task_hang", "hang", "n1", rank=3).to_json())
    text = render_status(store, limit=len(WRONG_EVENTS) + 1)
    lines = text.splitlines()
    assert any(line.split() == ["good", "running"] for line in lines), text
    for name in WRONG_NODES:
        if name != "escape":
            assert f"(malformed node record at {store.keys.node(name)})" in text, name
    assert "\x1b" not in text  # no terminal control sequences from the store reach the terminal
    assert "SEV2 task_hang" in text and "rank=3" in text
    assert text.count("(malformed value at") == len(WRONG_EVENTS), text


# -- many events, retention -----------------------------------------------------------
def test_status_shows_the_newest_events_of_20000(store: StatusStore) -> None:
    put_events(store, 0, 20_000)
    try:
        text = render_status(store, limit=3)
    finally:
        store.delete_prefix(store.keys.events())
    assert "last 3 events:" in text
    shown = [line for line in text.splitlines() if "nan_loss" in line]
    assert [line.rsplit(" ", 1)[-1] for line in shown] == ["19997", "19998", "19999"]  # oldest of them first


def test_append_event_keeps_only_the_newest(store: StatusStore) -> None:
    for i in range(12):
        store.append_event(json.dumps({"i": i}), keep=5)
    kept = store.get_prefix(store.keys.events())
    assert [json.loads(kv.value)["i"] for kv in kept] == [7, 8, 9, 10, 11]


def test_append_event_trims_a_large_backlog_in_one_go(store: StatusStore) -> None:
    put_events(store, 0, 20_000)
    try:
        store.append_event(ErrorEvent(Severity.SEV1, "ecc", "nvml", "n9").to_json())
        assert store.count_prefix(store.keys.events()) == store.event_retention == 1000
        newest = store.get_prefix(store.keys.events(), limit=1, descending=True)
        assert ErrorEvent.from_json(newest[0].value).kind == "ecc"
    finally:
        store.delete_prefix(store.keys.events())


def test_agent_publish_keeps_only_the_newest_events(etcd_config: EtcdConfig) -> None:
    from types import SimpleNamespace

    from unicron_elastic.agent.publisher import EventPublisher
    from unicron_elastic.plugins.manager import plugin_manager

    store = StatusStore(etcd_config, event_retention=3)
    rendezvous = SimpleNamespace(task="", status_store=store, max_nodes=1, round_joined=None,
                                 join_running_rounds=lambda local_world_size: None, get_run_id=lambda: "t")
    publisher = EventPublisher("n1", plugin_manager(load_entry_points=False), rendezvous)
    for i in range(5):
        publisher.publish(ErrorEvent(Severity.SEV3, "nan_loss", "loss", "n1", message=f"e{i}"))
    kept = [ErrorEvent.from_json(kv.value).message for kv in store.get_prefix(store.keys.events())]
    assert kept == ["e2", "e3", "e4"]
    store.close()


def test_event_retention_from_environment(etcd_config: EtcdConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    from unicron_elastic.api import ConfigError

    monkeypatch.setenv("UNICRON_EVENT_RETENTION", "7")
    assert StatusStore(etcd_config).event_retention == 7
    for bad in ("0", "-1", "x", "nan", "1e3"):
        monkeypatch.setenv("UNICRON_EVENT_RETENTION", bad)
        with pytest.raises(ConfigError, match="UNICRON_EVENT_RETENTION"):
            StatusStore(etcd_config)


# -- command line ---------------------------------------------------------------------
@pytest.mark.parametrize("limit", ["0", "-5", "x"])
def test_status_rejects_limits_below_one(etcd: EmbeddedEtcd, limit: str) -> None:
    res = unicron("status", "--endpoint", etcd.endpoint, "--limit", limit)
    assert res.returncode == 2, res
    last = res.stderr.strip().splitlines()[-1]  # argparse's usage, then one error line
    assert "--limit" in last and "must be a whole number >= 1" in last and "Traceback" not in res.stderr, res.stderr


def test_status_with_user_and_password_from_file_or_environment(private_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    enable_auth(private_etcd)
    secret = tmp_path / "etcd-password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    base = ("status", "--endpoint", private_etcd.endpoint, "--timeout", "2", "--user", "unicron")
    from_file = unicron(*base, "--password-file", str(secret))
    assert from_file.returncode == 0 and "nodes:" in from_file.stdout, from_file
    from_env = unicron(*base, env={"UNICRON_ETCD_PASSWORD": "s3cret"})
    assert from_env.returncode == 0 and "nodes:" in from_env.stdout, from_env
    wrong = unicron(*base, env={"UNICRON_ETCD_PASSWORD": "wrong"})
    assert wrong.returncode == 2 and "invalid user ID or password" in wrong.stderr, wrong
    assert wrong.stderr.count("\n") == 1 and "wrong" not in wrong.stderr, wrong.stderr  # the password is not echoed
    missing = unicron(*base)
    assert missing.returncode == 2 and "UNICRON_ETCD_PASSWORD" in missing.stderr and "--password-file" in missing.stderr
    no_file = unicron(*base, "--password-file", str(tmp_path / "nope"))
    assert no_file.returncode == 2 and "nope" in no_file.stderr and no_file.stderr.count("\n") == 1, no_file.stderr
    anonymous = unicron("status", "--endpoint", private_etcd.endpoint, "--timeout", "2")
    assert anonymous.returncode == 2 and "user name is empty" in anonymous.stderr, anonymous
