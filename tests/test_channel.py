"""The worker <-> agent channel with real worker processes."""

from __future__ import annotations

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

from unicron_elastic.agent.channel import AgentChannel
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


def _wait(predicate, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


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
    assert _wait(lambda: len(channel.messages) == 8)
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
    assert _wait(lambda: len(channel.messages) == 1)
    assert channel.malformed == 5
    assert "malformed_worker_message" in capsys.readouterr().out


def test_worker_never_blocks_without_an_agent(tmp_path) -> None:
    w = WorkerChannel(agent_path=str(tmp_path / "gone.sock"), rank=0)
    started = time.perf_counter()
    for step in range(1000):
        w.heartbeat(step, 0.1)
    assert time.perf_counter() - started < 1.0
    assert w.dropped == 1000
    assert WorkerChannel(agent_path="").active is False


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
