"""The snapshot writer process (``strategy/snapshots/writer.py``): one copy in the training process, the rest there.

A real writer process and a real TCPStore (the agent's): the document it sends
is the one :func:`~unicron_elastic.strategy.snapshots.safe_state.dumps` writes, the buffer
grows with the state, a writer not ready (lost and restarted, or started late)
never makes a step wait (a thread sends the snapshot meanwhile), and the writer ends with the
training process (a SIGKILL included), leaving no memory behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import structlog
import torch
import torch.distributed as dist

import unicron_elastic.strategy.snapshots.writer as writer_module
from conftest import events_named, wait_for
from test_safe_state import same
from unicron_elastic.strategy.snapshots.safe_state import dumps, encode, layout
from unicron_elastic.strategy.snapshots.writer import HostBuffer, copy_document
from unicron_elastic.strategy.snapshots.wire import SNAPSHOT_KEY, read_snapshot
from unicron_elastic.strategy.snapshots.tiers import MemorySnapshot


def _stores() -> tuple[dist.TCPStore, dist.TCPStore]:
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return agent, dist.TCPStore("127.0.0.1", agent.port, is_master=False, timeout=timedelta(seconds=30))


def _state(step: int, n: int = 1000) -> dict:
    return {"model": {"w": torch.arange(float(n)) + step, "h": torch.ones(3, 5, dtype=torch.bfloat16).t(),
                      "empty": torch.zeros(0, 4), "flag": torch.tensor([True, False])},
            "rng": np.arange(7, dtype=np.uint32), "step": step, "loops": {"epoch": 0, "nan": float("nan")}}


def test_the_document_laid_out_in_the_buffer_is_the_one_dumps_writes() -> None:
    state = _state(2)
    encoded = encode(state)
    plan = layout(encoded)
    buffer = HostBuffer(plan.size)
    try:
        copy_document(encoded, buffer, plan)
        assert bytes(buffer.bytes[: plan.size].numpy()) == dumps(state)
    finally:
        buffer.close()


@pytest.fixture()
def captured(capture_log) -> structlog.testing.LogCapture:
    return capture_log(writer_module)


@pytest.mark.timeout(120)
def test_the_writer_process_sends_each_snapshot_and_a_lost_writer_is_restarted(captured) -> None:
    agent, worker = _stores()
    snapshot = MemorySnapshot(worker, every=1, out_of_process=True)
    try:
        snapshot.start()
        for step, n in ((1, 10), (2, 3_000_000), (3, 3_000_000)):  # the buffer grows once, then is kept
            assert snapshot.save(_state(step, n))
            snapshot.wait()
            assert same(read_snapshot("agent", agent, SNAPSHOT_KEY), _state(step, n))
        writer = snapshot._writer._process
        assert writer.pid != os.getpid() and writer.poll() is None
        writer.kill()  # lost: the next save starts another one without waiting for it (a thread sends that one)
        writer.wait()
        assert snapshot.save(_state(4))
        assert events_named(captured, "snapshot_writer_lost")
        snapshot.wait()
        assert same(read_snapshot("agent", agent, SNAPSHOT_KEY), _state(4))
        wait_for(snapshot._writer.ready, deadline_s=60, why="the restarted writer never became ready")
        assert snapshot.save(_state(5))
        snapshot.wait()
        assert same(read_snapshot("agent", agent, SNAPSHOT_KEY), _state(5))
        assert snapshot._writer._process.pid != writer.pid
    finally:
        snapshot.close()
    assert writer.poll() is not None


def _gone(pid: int) -> bool:
    """Exited (a zombie not reaped yet counts: it holds no memory)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


TRAINER = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    from unicron_elastic.strategy.snapshots.tiers import MemorySnapshot
    worker = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
    snapshot = MemorySnapshot(worker, every=1, out_of_process=True)
    snapshot.start()
    snapshot.save({"w": torch.ones(1 << 20), "step": 1})
    snapshot.wait()
    print("writer", snapshot._writer._process.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.timeout(120)
def test_the_writer_ends_with_a_killed_training_process_and_frees_the_buffer(tmp_path: Path) -> None:
    agent, _ = _stores()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(agent.port)], stdout=subprocess.PIPE, text=True)
    try:
        writer = next(int(line.split()[1]) for line in trainer.stdout if line.startswith("writer "))
        assert "memfd:unicron-snapshot" in Path(f"/proc/{writer}/maps").read_text()  # it maps the shared buffer
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        wait_for(lambda: _gone(writer), deadline_s=60, why="the writer outlived its killed training process")
    finally:
        trainer.kill()
        trainer.wait()


@pytest.mark.timeout(120)
def test_a_snapshot_due_while_the_previous_is_still_sent_is_skipped_not_waited_for(captured) -> None:
    agent, worker = _stores()
    snapshot = MemorySnapshot(worker, every=1, out_of_process=True)
    try:
        snapshot.start()
        assert snapshot.save(_state(1, 12_000_000))  # 48 MB: still being sent when the next one is due
        assert not snapshot.save(_state(2))
        assert [e["step"] for e in events_named(captured, "snapshot_skipped")] == [2]
        snapshot.wait()
        assert same(read_snapshot("agent", agent, SNAPSHOT_KEY), _state(1, 12_000_000))
        assert snapshot.save(_state(3))  # taken again once the writer is free
        snapshot.wait()
        assert same(read_snapshot("agent", agent, SNAPSHOT_KEY), _state(3))
    finally:
        snapshot.close()


@pytest.mark.timeout(120)
def test_a_rank_that_becomes_a_saver_later_never_waits_for_its_writer_to_start(captured, capture_log) -> None:
    """The new primary replica after a regroup: its first snapshot due starts the writer (1-3 s of imports on a
    loaded machine) without waiting, and a thread sends that snapshot at once; the writer takes the later ones."""
    import unicron_elastic.strategy.snapshots.tiers as tiers_module

    in_thread = capture_log(tiers_module)
    agent, worker = _stores()
    snapshot = MemorySnapshot(worker, every=1, out_of_process=True)
    try:
        began = time.monotonic()
        assert snapshot.save(_state(1))
        assert time.monotonic() - began < 0.5  # (the writer's imports alone take about a second)
        assert [e["step"] for e in events_named(in_thread, "snapshot_in_thread")] == [1]
        snapshot.wait()
        assert same(read_snapshot("agent", agent, SNAPSHOT_KEY), _state(1))  # landed without the writer
        wait_for(snapshot._writer.ready, deadline_s=60, why="the writer never became ready")
        assert snapshot.save(_state(2))
        snapshot.wait()
        assert same(read_snapshot("agent", agent, SNAPSHOT_KEY), _state(2))
        assert [e["step"] for e in events_named(in_thread, "snapshot_in_thread")] == [1]  # the writer sent step 2
    finally:
        snapshot.close()
