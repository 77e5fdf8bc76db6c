"""The worker <-> agent channel with real worker processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from conftest import wait_for
from unicron_elastic.agent.channel import AgentChannel, parse
from unicron_elastic.worker import WorkerChannel


@pytest.fixture()
def channel():
    directory = tempfile.mkdtemp(prefix="unicron-test-")
    messages: list[dict] = []
    event = threading.Event()

    def on_message(msg, received):
        messages.append(msg)
        event.set()

    ch = AgentChannel(directory, on_message)
    ch.messages, ch.event = messages, event  # type: ignore[attr-defined]
    yield ch
    ch.close()
    shutil.rmtree(directory, ignore_errors=True)


def _worker(agent_path: str, body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, UNICRON_AGENT_SOCKET=agent_path, RANK="3")
    code = "from unicron_elastic.worker import get_worker\nw = get_worker()\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_messages_and_uncaught_exception_reach_the_agent(channel) -> None:
    result = _worker(channel.path, """
        w.hello(resumable=True)
        for step in range(3):
            w.heartbeat(step, 0.01)
        with w.checkpointing():
            pass
        raise ValueError("boom at step 3")
    """)
    assert result.returncode == 1 and "ValueError: boom" in result.stderr
    wait_for(lambda: len(channel.messages) == 8)
    kinds = [m["t"] for m in channel.messages]
    assert kinds == ["hello", "beat", "beat", "beat", "state", "state", "exc", "state"]
    assert channel.messages[-1] == {"t": "state", "paused": True, "exiting": True, "rank": 3}  # goodbye at exit
    hello, exc = channel.messages[0], channel.messages[-2]
    assert hello["rank"] == 3 and hello["resumable"] is True and hello["reply"].endswith(".sock")
    assert exc["type"] == "ValueError" and exc["fatal"] is True and "boom" in exc["tb"]


def test_malformed_messages_are_logged_and_skipped(channel, capsys) -> None:
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for raw in (b"not json", b"[]", b'{"t": "beat"}', b'{"t": "what", "rank": 0}', b'{"t": "beat", "rank": 1}'):
        sender.sendto(raw, channel.path)
    sender.sendto(b'{"t": "beat", "rank": 1, "step": 0, "dur": 0.1}', channel.path)
    wait_for(lambda: len(channel.messages) == 1)
    assert channel.malformed == 5
    assert "malformed_worker_message" in capsys.readouterr().out


def test_worker_never_blocks_without_an_agent(tmp_path) -> None:
    w = WorkerChannel(agent_path=str(tmp_path / "gone.sock"), rank=0)
    started = time.perf_counter()
    for step in range(1000):
        w.heartbeat(step, 0.1)
    w.set_paused(True)  # (a message that waits for room in a full queue does not wait for an agent that is gone)
    assert time.perf_counter() - started < 1.0
    assert w.dropped == 1001
    assert WorkerChannel(agent_path="").active is False


def _full_agent(tmp_path) -> tuple[socket.socket, WorkerChannel]:
    """An agent socket nobody reads, and a worker that sent heartbeats until its queue was full (one dropped)."""
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(tmp_path / "agent.sock"))
    w = WorkerChannel(agent_path=str(tmp_path / "agent.sock"), rank=0, deliver_within=0.3)
    sent = 0
    while w.dropped == 0:  # (Linux queues net.unix.max_dgram_qlen datagrams: 10 by default)
        w.heartbeat(sent, 0.1)
        sent += 1
        assert sent < 100_000
    return agent, w


def test_a_full_agent_queue_drops_heartbeats_at_once_and_a_pause_only_after_waiting(tmp_path) -> None:
    agent, w = _full_agent(tmp_path)
    started = time.monotonic()
    for step in range(100):
        w.heartbeat(step, 0.1)
        w.waiting(True)  # (repeated while a rank waits on its group)
    assert w.dropped == 201 and time.monotonic() - started < 0.5  # neither waits
    started = time.monotonic()
    w.set_paused(True)  # nobody reads: it waits deliver_within (0.3 s), then it is dropped
    assert w.dropped == 202 and time.monotonic() - started >= 0.3
    started = time.monotonic()
    w.waiting(False)  # the end of a wait changes the agent's view too
    assert w.dropped == 203 and time.monotonic() - started >= 0.3
    agent.close()


def test_a_pause_sent_while_the_agent_is_behind_reaches_it(tmp_path) -> None:
    agent, w = _full_agent(tmp_path)
    w.deliver_within = 30.0
    received: list[dict] = []

    def drain() -> None:  # the agent catches up after 0.2 s
        time.sleep(0.2)
        agent.settimeout(5.0)
        while not received or received[-1]["t"] != "state":
            received.append(json.loads(agent.recv(65536)))

    reader = threading.Thread(target=drain)
    reader.start()
    started = time.monotonic()
    w.set_paused(True)
    waited = time.monotonic() - started
    reader.join(10)
    assert received[-1] == {"t": "state", "paused": True, "rank": 0} and w.dropped == 1  # delivered, not dropped
    assert 0.15 <= waited < 10
    agent.close()


def test_run_step_retries_when_the_agent_says_reattempt(channel) -> None:
    def reply(msg, received):
        channel.messages.append(msg)
        if msg["t"] == "hello":
            channel.reply_to = msg["reply"]
        if msg["t"] == "exc":
            channel.send(channel.reply_to, {"t": "verdict", "action": "reattempt"})

    channel._on_message = reply
    result = _worker(channel.path, """
        w.hello(resumable=True)
        calls = []
        def step():
            calls.append(1)
            if len(calls) == 1:
                raise ConnectionResetError("Connection reset by peer")
            return "ok"
        print(w.run_step(step, step=5), len(calls))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "2"]
    exc = next(m for m in channel.messages if m["t"] == "exc")
    assert exc["fatal"] is False and exc["step"] == 5 and exc["type"] == "ConnectionResetError"


def _send_all(path: str, datagrams: list[bytes]) -> None:
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        for raw in datagrams:
            sender.sendto(raw, path)  # blocking: waits while the agent's queue is full, loses nothing
    finally:
        sender.close()


def _beat(rank: int = 1, step: int = 0, dur: float = 0.1) -> bytes:
    return json.dumps({"t": "beat", "rank": rank, "step": step, "dur": dur}).encode()


def test_deeply_nested_datagrams_cost_only_themselves(channel) -> None:
    nested = [b"[" * 50_000, b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
              b'{"t": "beat", "rank": 1, "step": 0, "dur": 0.1, "x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"]
    _send_all(channel.path, [*nested, _beat(step=7)])
    wait_for(lambda: len(channel.messages) == 1, why="the channel thread died on a nested datagram")
    assert channel.messages[0]["step"] == 7
    assert channel.malformed == 3


BAD_MESSAGES = [
    b'{"t": "beat", "rank": 0, "step": 1, "dur": NaN}',
    b'{"t": "beat", "rank": 0, "step": 1, "dur": Infinity}',
    b'{"t": "beat", "rank": 0, "step": 1, "dur": -Infinity}',
    b'{"t": "beat", "rank": 0, "step": 1, "dur": 1e400}',
    b'{"t": "beat", "rank": 0, "step": 1, "dur": -0.5}',
    b'{"t": "beat", "rank": 0, "step": 1, "dur": "0.1"}',
    b'{"t": "beat", "rank": 0, "step": 1, "dur": null}',
    b'{"t": "beat", "rank": 0, "step": 1, "dur": true}',
    b'{"t": "beat", "rank": 0, "step": 1.5, "dur": 0.1}',
    b'{"t": "beat", "rank": 0, "step": "1", "dur": 0.1}',
    b'{"t": "beat", "rank": true, "step": 1, "dur": 0.1}',
    b'{"t": "beat", "rank": -1, "step": 1, "dur": 0.1}',
    b'{"t": "beat", "rank": 1e3, "step": 1, "dur": 0.1}',
    b'{"t": "beat", "rank": 99999999999999999999999, "step": 1, "dur": 0.1}',
    b'{"t": "progress", "rank": 0, "step": 1, "mb": "2"}',
    b'{"t": "hello", "rank": 0, "pid": "12", "resumable": true, "reply": "/tmp/x.sock"}',
    b'{"t": "hello", "rank": 0, "pid": 12, "resumable": "yes", "reply": "/tmp/x.sock"}',
    b'{"t": "hello", "rank": 0, "pid": 12, "resumable": true, "reply": 5}',
    b'{"t": "hello", "rank": 0, "pid": 12, "resumable": true, "reply": "' + b"x" * 5000 + b'"}',
    b'{"t": "state", "rank": 0, "paused": "no"}',
    b'{"t": "state", "rank": 0, "collective": 1}',
    b'{"t": "exc", "rank": 0, "type": ["RuntimeError"], "msg": "m", "step": 1, "fatal": false}',
    b'{"t": "exc", "rank": 0, "type": "E", "msg": {"a": 1}, "step": 1, "fatal": false}',
    b'{"t": "exc", "rank": 0, "type": "E", "msg": "m", "step": 1, "fatal": "false"}',
    b'{"t": "exc", "rank": 0, "type": "E", "msg": "m", "step": 1, "fatal": false, "tb": 3}',
    b'{"t": "exc", "rank": 0, "type": "E", "msg": "' + b"m" * 20_000 + b'", "step": 1, "fatal": false}',
    b'{"t": ["beat"], "rank": 0}',
    b'{"t": "rejoin", "rank": 0}',
    b'{"t": "rejoin", "rank": 0, "reason": 5}',
    b'{"t": "rejoin", "rank": 0, "reason": null}',
    b'{"t": "rejoin", "rank": 0, "reason": ["left out"]}',
    b'{"t": "rejoin", "rank": 0, "reason": "' + b"r" * 1001 + b'"}',
    b'{"t": "rejoin", "rank": 0, "reason": "r", "pid": "12"}',
    b'\xff\xfe\x00garbage',
    b'',
]


@pytest.mark.parametrize("raw", BAD_MESSAGES, ids=range(len(BAD_MESSAGES)))
def test_fields_of_the_wrong_type_or_range_are_rejected(raw: bytes) -> None:
    with pytest.raises(ValueError):
        parse(raw)


def test_valid_messages_still_parse() -> None:
    assert parse(_beat(rank=3, step=2, dur=0.0))["dur"] == 0.0
    assert parse(b'{"t": "beat", "rank": 0, "step": 1, "dur": 1}')["dur"] == 1
    assert parse(b'{"t": "state", "rank": 0, "paused": true, "exiting": true}')["paused"] is True
    assert parse(b'{"t": "exc", "rank": 0, "type": "E", "msg": "m", "tb": "x", "step": -1, "fatal": true}')["fatal"]
    assert parse(b'{"t": "rejoin", "rank": 2, "reason": "Excluded: left out"}')["reason"] == "Excluded: left out"
    assert parse(b'{"t": "rejoin", "rank": 2, "pid": 7, "reason": "' + b"r" * 1000 + b'"}')["pid"] == 7


def test_an_exception_that_asks_to_rejoin_sends_the_request_before_its_report(channel) -> None:
    result = _worker(channel.path, """
        class LeftOut(Exception):
            rejoin = True

        w.hello(resumable=True)
        def step():
            raise LeftOut("replica 1 lost a peer " + "x" * 3000)
        w.run_step(step, step=4)  # not reported as a step failure: no verdict to wait for
    """)
    assert result.returncode == 1 and "LeftOut: replica 1" in result.stderr
    wait_for(lambda: len(channel.messages) == 4)
    assert [m["t"] for m in channel.messages] == ["hello", "rejoin", "exc", "state"]
    rejoin, exc = channel.messages[1], channel.messages[2]
    assert rejoin["rank"] == 3 and rejoin["reason"].startswith("LeftOut: replica 1 lost a peer")
    assert len(rejoin["reason"]) == 1000 and type(rejoin["pid"]) is int
    assert exc["type"] == "LeftOut" and exc["fatal"] is True


def test_request_rejoin_and_an_ordinary_exception(channel) -> None:
    result = _worker(channel.path, """
        w.request_rejoin(42)
        class NotRejoin(Exception):
            rejoin = "yes"  # only True asks
        raise NotRejoin("plain failure")
    """)
    assert result.returncode == 1
    wait_for(lambda: len(channel.messages) == 3)
    assert [m["t"] for m in channel.messages] == ["rejoin", "exc", "state"]
    assert channel.messages[0]["reason"] == "42"
    assert channel.malformed == 0


def test_a_flood_of_malformed_datagrams_is_counted_but_not_logged_one_by_one(channel, capsys) -> None:
    _send_all(channel.path, [b'{"t": "beat", "rank": 1, "step": 0, "dur": NaN}'] * 2000 + [_beat(step=9)])
    wait_for(lambda: len(channel.messages) == 1, deadline_s=30)
    assert channel.malformed == 2000
    logged = capsys.readouterr().out.count("malformed_worker_message")
    assert 1 <= logged <= 20, logged


def test_an_exception_while_handling_one_message_costs_that_message_only(channel) -> None:
    seen: list[int] = []

    def explode(msg, received):
        seen.append(msg["step"])
        if msg["step"] == 0:
            raise RecursionError("maximum recursion depth exceeded")
        channel.event.set()

    channel._on_message = explode
    _send_all(channel.path, [_beat(step=0), _beat(step=1)])
    wait_for(lambda: seen == [0, 1])
    assert channel._thread.is_alive()


def test_a_hello_must_name_a_reply_socket_in_the_agents_directory(channel) -> None:
    hello = {"t": "hello", "rank": 1, "pid": 1, "resumable": True}
    inside = os.path.join(os.path.dirname(channel.path), "w1.sock")
    _send_all(channel.path, [json.dumps({**hello, "reply": "/tmp/elsewhere.sock"}).encode(),
                             json.dumps({**hello, "reply": inside}).encode()])
    wait_for(lambda: len(channel.messages) == 1)
    assert channel.messages[0]["reply"].endswith("/w1.sock") and channel.malformed == 1


def test_progress_is_sent_at_most_once_per_interval_and_a_heartbeat_carries_busy_time(channel) -> None:
    result = _worker(channel.path, """
        import time
        w.progress_interval = 0.05
        began = time.monotonic()
        while time.monotonic() - began < 0.5:  # a mark every millisecond for 0.5 s
            w.progress(7, 1)
            time.sleep(0.001)
        w.heartbeat(7, 0.5, busy=0.75)  # (busy is capped at the duration)
    """)
    assert result.returncode == 0, result.stderr
    wait_for(lambda: any(m["t"] == "beat" for m in channel.messages))
    progress = [m for m in channel.messages if m["t"] == "progress"]
    assert 5 <= len(progress) <= 11  # ~500 marks, one message per 50 ms
    assert progress[0] == {"t": "progress", "step": 7, "mb": 1, "rank": 3}
    assert [m for m in channel.messages if m["t"] == "beat"] == [{"t": "beat", "step": 7, "dur": 0.5, "busy": 0.5,
                                                                  "rank": 3}]
