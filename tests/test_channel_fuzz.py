"""Fuzz the worker channel of a live agent, then check it still detects and heals.

A real ``unicron-run --standalone --nproc-per-node=2`` runs two resumable workers
(``tests/workers/channel_fuzz_worker.py``). The test sends thousands of seeded
random and adversarial datagrams to the agent's socket (deeply nested, huge,
NaN/Infinity durations, wrong types, unknown types, thousands of foreign ranks,
binary garbage). Afterwards the agent must still answer a worker's SEV3
exception through the channel (``reattempt``), detect a real SIGKILL and
restart that worker alone, never take a healthy worker for hung, and the run
must end with exit 0.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import BIN, json_log_entries
from unicron_elastic.testing import kill_node

pytestmark = pytest.mark.e2e
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "channel_fuzz_worker.py")
DATAGRAMS = 4000
REAL_RANKS = (0, 1)


# -- the datagrams ----------------------------------------------------------------


def _junk(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value of any type (what a wrong-typed field gets)."""
    choices: list[Callable[[], object]] = [
        lambda: None, lambda: rng.choice([True, False]), lambda: rng.randint(-(2**70), 2**70),
        lambda: rng.uniform(-1e308, 1e308),
        lambda: "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(0, 40))),
        lambda: "x" * rng.choice([5_000, 20_000]),
    ]
    if depth < 3:
        choices += [lambda: [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))],
                    lambda: {str(rng.random()): _junk(rng, depth + 1) for _ in range(rng.randint(0, 3))}]
    return rng.choice(choices)()


def _valid(rng: random.Random, kind: str, rank: int, directory: str) -> dict:
    fields: dict[str, dict] = {
        "hello": {"pid": rng.randint(1, 4_000_000), "resumable": rng.random() < 0.5,
                  "reply": os.path.join(directory, f"w{rank}-{rng.randint(1, 99999)}.sock")},
        "beat": {"step": rng.randint(0, 10**6), "dur": rng.uniform(0, 10)},
        "state": {rng.choice(["paused", "collective", "exiting"]): rng.random() < 0.5},
        "progress": {"step": rng.randint(0, 10**6), "mb": rng.randint(0, 64)},
        "exc": {"type": rng.choice(["RuntimeError", "ValueError", "KeyError"]), "step": rng.randint(-1, 999),
                "msg": rng.choice(["CUDA error: uncorrectable ECC error encountered", "Connection reset by peer",
                                   "boom", "CUDA error: out of memory"]), "fatal": rng.random() < 0.5, "tb": "tb"},
    }
    return {"t": kind, "rank": rank, **fields[kind]}


#: Values of the wrong type or range for each kind of field (chosen by the test, not by the parser).
WRONG: dict[str, list[object]] = {
    "int": [None, True, 1.5, 1e3, "3", [], {}, [1], -5, 2**64, float("nan")],
    "bool": [None, 0, 1, "true", "", [], {}, [True], 0.5],
    "str": [None, 1, True, [], {"a": 1}, ["x"], 2.5],
    "dur": [None, True, "0.1", [], {}, -1, -1e-9, float("nan"), float("inf"), float("-inf")],
}
FIELD_KIND = {"rank": "int", "pid": "int", "step": "int", "mb": "int", "dur": "dur", "resumable": "bool",
              "fatal": "bool", "paused": "bool", "collective": "bool", "exiting": "bool", "reply": "str",
              "type": "str", "msg": "str", "tb": "str"}


def _nested(rng: random.Random, directory: str) -> bytes:
    depth = rng.choice([200, 1_000, 3_000, 20_000])
    shape = rng.randrange(3)
    if shape == 0:
        return b"[" * depth + b"]" * depth
    if shape == 1:
        return b'{"a":' * depth + b"1" + b"}" * depth
    inner = b"[" * depth + b"]" * depth
    return b'{"t": "beat", "rank": 7, "step": 1, "dur": 0.1, "x": ' + inner + b"}"


def _huge(rng: random.Random, directory: str) -> bytes:
    size = rng.choice([40_000, 65_000, 66_000, 150_000])
    shape = rng.randrange(3)
    if shape == 0:
        return json.dumps({"t": "exc", "rank": rng.randint(2, 99), "type": "RuntimeError", "msg": "m" * size,
                           "step": 1, "fatal": False}).encode()
    if shape == 1:
        return b'{"t": "beat", "rank": 0, "step": 1, "dur": NaN, "pad": "%s"}' % (b"p" * size)
    return b'"' + b"s" * size + b'"'


def _non_finite(rng: random.Random, directory: str) -> bytes:
    dur = rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "-1", "-0.001", '"0.1"', "null", "[]"])
    rank, step = rng.choice(REAL_RANKS), rng.randint(0, 99)
    return b'{"t": "beat", "rank": %d, "step": %d, "dur": %s}' % (rank, step, dur.encode())


def _wrong_type(rng: random.Random, directory: str) -> bytes:
    msg = _valid(rng, rng.choice(["hello", "beat", "state", "progress", "exc"]), rng.choice(REAL_RANKS), directory)
    field = rng.choice([f for f in msg if f != "t"])
    msg[field] = rng.choice(WRONG[FIELD_KIND[field]])
    return json.dumps(msg).encode()


def _unknown_type(rng: random.Random, directory: str) -> bytes:
    return json.dumps({"t": _junk(rng), "rank": rng.choice(REAL_RANKS), "step": 1, "dur": 0.1}).encode()


def _foreign_rank(rng: random.Random, directory: str) -> bytes:
    rank = rng.randint(2, 30_000)
    kind = rng.choice(["hello", "beat", "beat", "state", "progress", "exc"])
    return json.dumps(_valid(rng, kind, rank, directory)).encode()


def _garbage(rng: random.Random, directory: str) -> bytes:
    return rng.randbytes(rng.choice([0, 1, 10, 1_000, 60_000]))


def _random_json(rng: random.Random, directory: str) -> bytes:
    return json.dumps(_junk(rng)).encode()


GENERATORS = [_nested, _huge, _non_finite, _wrong_type, _wrong_type, _unknown_type, _foreign_rank, _foreign_rank,
              _garbage, _random_json]


def datagrams(seed: int, count: int, directory: str) -> list[bytes]:
    """``count`` adversarial datagrams; every generator appears early (the first ones cycle through all)."""
    rng = random.Random(seed)
    return [GENERATORS[i % len(GENERATORS)](rng, directory) if i < 3 * len(GENERATORS)
            else rng.choice(GENERATORS)(rng, directory) for i in range(count)]


# -- the live run --------------------------------------------------------------------


class Job:
    def __init__(self, tmp: Path) -> None:
        self.out = tmp / "out"
        self.out.mkdir()
        self.log_path = tmp / "launcher.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"])
        cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", "--monitor-interval=0.05",
               "--log-format=json", "--hang-factor=20", WORKER, "--out", str(self.out), "--step-time", "0.1"]
        with self.log_path.open("w") as log_file:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file, env=env)

    def notes(self, rank: int, event: str) -> list[dict]:
        path = self.out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [n for n in map(json.loads, lines) if n["event"] == event]

    def step(self, rank: int) -> int:
        try:
            return int((self.out / f"rank{rank}.step").read_text())
        except (FileNotFoundError, ValueError):
            return -1

    def logs(self) -> list[dict]:
        return json_log_entries(self.log_path)

    def of(self, event: str) -> list[dict]:
        return [e for e in self.logs() if e.get("event") == event]

    def wait(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited ({self.proc.returncode}) waiting for {what}:\n"
                                     + self.log_path.read_text()[-3000:])
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n" + self.log_path.read_text()[-3000:])
            time.sleep(0.05)


def _fuzz(path: str, payloads: list[bytes], timeout: float) -> int:
    """Send every payload (blocking while the agent's queue is full); returns how many went out."""
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.settimeout(5.0)  # a queue that stays full for 5 s: the agent stopped reading
    deadline, sent = time.monotonic() + timeout, 0
    try:
        for raw in payloads:
            assert time.monotonic() < deadline, f"fuzzing took more than {timeout}s"
            try:
                sender.sendto(raw, path)
                sent += 1
            except TimeoutError:
                raise AssertionError(f"the agent stopped reading its channel after {sent} datagrams") from None
            except OSError:
                pass  # EMSGSIZE: larger than a datagram may be; that is the sender's problem
    finally:
        sender.close()
    return sent


@pytest.mark.timeout(400)
def test_a_fuzzed_agent_still_detects_a_real_kill(tmp_path: Path) -> None:
    job = Job(tmp_path)
    try:
        job.wait("both workers past warm-up", lambda: all(job.step(r) >= 8 for r in REAL_RANKS), 120)
        [first0], [first1] = job.notes(0, "start"), job.notes(1, "start")
        socket_path = first0["socket"]
        payloads = datagrams(seed=9, count=DATAGRAMS, directory=os.path.dirname(socket_path))
        sent = _fuzz(socket_path, payloads, timeout=180)
        assert sent >= DATAGRAMS * 0.9

        # heartbeats keep flowing: a dead channel or a poisoned mean would take them for hung (2 s)
        after_fuzz = {r: job.step(r) for r in REAL_RANKS}
        job.wait("30 more steps on both ranks", lambda: all(job.step(r) >= after_fuzz[r] + 30 for r in REAL_RANKS), 120)

        # the channel still works both ways: a SEV3 report is answered with "reattempt"
        (job.out / "raise-0").touch()
        job.wait("rank 0 reattempted in place", lambda: job.notes(0, "reattempted"), 60)

        # a real kill is still detected and healed (rank 1 alone)
        os.kill(first1["pid"], signal.SIGKILL)
        job.wait("rank 1 restarted", lambda: len(job.notes(1, "start")) == 2, 60)
        restarted_at = job.step(1)
        job.wait("rank 1 training again", lambda: job.step(1) >= restarted_at + 5, 60)

        (job.out / "stop").touch()
        job.wait("the run to end", lambda: job.proc.poll() is not None, 60)
    finally:
        if job.proc.poll() is None:
            kill_node(job.proc.pid)
            job.proc.wait(timeout=30)
    tail = job.log_path.read_text()[-3000:]
    assert job.proc.returncode == 0, tail
    events = [(e["severity"], e["kind"], e["rank"]) for e in job.of("error_event") if e["kind"] != "link_flapping"]
    assert events == [("SEV3", "connection_reset", 0), ("SEV2", "exited_abnormally", 1)], tail
    assert [(a["action"], a["rank"]) for a in job.of("agent_action")] == [("reattempt", 0), ("restart_worker", 1)]
    assert [r["rank"] for r in job.of("worker_restarted")] == [1]
    assert len(job.notes(0, "start")) == 1  # the healthy worker was never killed
    assert job.notes(0, "done") and job.notes(1, "done")
    # a flood does not flood the log
    assert 1 <= len(job.of("malformed_worker_message")) <= 40
    assert len(job.of("worker_message_from_unknown_rank")) <= 12
