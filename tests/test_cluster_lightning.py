"""Two Lightning tasks on three node daemons, driven by the coordinator's plan (issue #11 acceptance).

The plan in etcd and the world sizes the workers trained with are both asserted; parameters equal a
failure-free run of the same global batch (``grad_dtype=float64``: ``torch.equal``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import BIN
from unicron_elastic.coordinator.service import read_plan
from unicron_elastic.node.local_cluster import LocalCluster
from unicron_elastic.store import EmbeddedEtcd, StatusStore
from unicron_elastic.testing import kill_node

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "lightning_gpt.py")
STEPS = 8
HOLD = 6  # task a waits for the returning node's ranks before this step


def gpt(out: Path, *extra: str) -> list[str]:
    return [sys.executable, GPT, "--steps", str(STEPS), "--out", str(out), "--step-time", "0.2", *extra]


def spec(name: str, command: list[str], weight: float, table: dict, hi: int) -> str:
    return json.dumps(dict(name=name, command=command, weight=weight, min_workers=2, max_workers=hi, global_batch=24,
                           model={"calibration": table}))


def wait_for(what, deadline_s: float = 240.0, why: str = ""):
    deadline = time.monotonic() + deadline_s
    while not (value := what()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {deadline_s} s: {why}")
        time.sleep(0.1)
    return value


def last_step(out: Path) -> int:
    steps = [json.loads(line)["step"] for p in out.glob("times*.jsonl") for line in p.read_text().splitlines() if line]
    return max(steps, default=-1)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.timeout(900)
def test_two_lightning_tasks_survive_a_lost_node_and_take_it_back(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    base = tmp_path / "baseline"
    run = subprocess.run([os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", GPT,
                          "--steps", str(STEPS), "--out", str(base)], capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    baseline = torch.load(base / "params0.pt")

    out_a, out_b = tmp_path / "a", tmp_path / "b"
    with LocalCluster(nodes=3, slots=2, cluster="gpt", etcd=etcd, log_dir=tmp_path / "logs",
                      launcher_args=["--monitor-interval=0.05"],
                      coordinator_args=["--failure-rate=1e-4"]) as cluster, \
            StatusStore(replace(etcd.config, cluster="gpt")) as store:
        wait_for(lambda: len(store.get_prefix(store.keys.nodes())) == 3, why="3 nodes registered")
        store.put(store.keys.task_spec("a"), spec("a", gpt(out_a, "--record-times", "--hold-for-joiner", str(HOLD)),
                                                  1.0, {"2": 2.0, "4": 3.6, "6": 5.0}, 6))
        a_done = tmp_path / "a-done"  # b waits for it before step 4: it ends after a, whatever the timing
        store.put(store.keys.task_spec("b"), spec("b", gpt(out_b, "--hold-until", str(a_done), "--hold-step", "4",
                                                          "--checkpoint-dir", str(tmp_path / "ckpt-b")),
                                                  2.0, {"2": 1.0, "4": 1.5}, 4))
        plan = wait_for(lambda: (p := read_plan(store)) and len(p.nodes) == 3 and len(p.tasks) == 2 and p,
                        why="the first plan")
        assert {n: len(t.nodes) for n, t in plan.tasks.items()} == {"a": 2, "b": 1}  # the planner's optimum
        wait_for(lambda: last_step(out_a) >= 2, why="task a at step 2")
        victim = plan.tasks["a"].nodes[-1]
        kill_node(cluster.daemons[victim].pid)  # SEV1: daemon, launcher and workers
        lost = wait_for(lambda: (p := read_plan(store)) and victim not in p.nodes and p, why="re-plan")
        assert {n: len(t.nodes) for n, t in lost.tasks.items()} == {"a": 1, "b": 1}
        cluster.start_node(victim)
        back = wait_for(lambda: (p := read_plan(store)) and victim in p.tasks["a"].nodes and p, why="node back")
        assert {n: len(t.nodes) for n, t in back.tasks.items()} == {"a": 2, "b": 1}
        # a finishes: its nodes go to b (b grows to its max, 2 nodes: torch's restart-all, state from disk)
        grown = wait_for(lambda: (p := read_plan(store)) and "a" in p.finished and p, 600, why="a finished")
        assert {n: len(t.nodes) for n, t in grown.tasks.items()} == {"b": 2}
        wait_for(lambda: all(a_done.with_name(f"a-done.waiting{r}").exists() for r in (2, 3)), 600,
                 why="b's ranks 2 and 3 (only in the grown round) waiting before step 4")
        a_done.touch()
        wait_for(lambda: "b" in read_plan(store).finished, 600, why="b finished")

    summaries = {int(p.stem[4:]): json.loads(p.read_text()) for p in out_a.glob("rank*.json")}
    assert sorted(summaries) == [0, 1, 2, 3], sorted(summaries)
    survivors = [r for r, s in summaries.items() if s["joined_at"] is None]
    rejoined = [r for r, s in summaries.items() if s["joined_at"] is not None]
    assert len(survivors) == 2 and len(rejoined) == 2  # the healthy workers were never restarted
    for r in survivors:
        reports = summaries[r]["reports"]
        failed = [x for x in reports if x["recoveries"]]
        assert failed and sorted(failed[0]["dead"]) == sorted(rejoined)  # trained on 2 workers after the loss
        assert summaries[r]["global_step"] == STEPS
    for r in rejoined:
        assert summaries[r]["state_from"] == "replica" and 2 < summaries[r]["joined_at"] < STEPS  # admitted at HOLD or the step after
    for r in range(4):
        assert same(torch.load(out_a / f"params{r}.pt"), baseline), f"task a rank {r} diverged"
    b = {int(p.stem[4:]): json.loads(p.read_text()) for p in out_b.glob("rank*.json")}
    assert sorted(b) == [0, 1, 2, 3] and all(s["global_step"] == STEPS for s in b.values())  # trained on 4 workers
    assert {s["state_from"] for s in b.values()} <= {"disk", "memory", "replica"}  # resumed, not from step 0
    for r in range(4):
        assert same(torch.load(out_b / f"params{r}.pt"), baseline), f"task b rank {r} diverged"
