"""Issue 12: ``unicron_megatron`` trains TP x PP x DP through Lightning, and survives real SIGKILLs.

Each run trains ``examples/lightning_gpt.py``'s ``MegatronGPT`` (megatron-core's
tensor-parallel layers, split into pipeline stages) under ``unicron-run
--standalone`` on CPU/gloo: TP=2 x DP=2, PP=2 x DP=2 and TP=2 x PP=2 x DP=2
(8 processes). A rank of replica 1 is SIGKILLed at one point of step 2; its
replica is lost (the other ranks of it leave and rejoin), replica 0 computes
replica 1's micro-batches, and the whole replica comes back with the state of
the matching shard of replica 0. With float64 gradient sums every shard ends
bit-identical to the failure-free run.

The e2e tier runs the TP2xPP2 equality with no parallelism, a
kill in a micro-batch on TP2xDP2, scale-in and the per-shard snapshot (the default tier's
megatron-core case is tests/test_megatron_gpt.py's); ``-m matrix`` runs
every kill point on every configuration, the DataLoader's workers feeding every
rank of a replica (the default DataLoader case is in test_lightning_strategy.py),
scale-out and the per-shard disk checkpoint (figures: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from functools import cache
from pathlib import Path

import pytest
import torch

from conftest import BIN, EXAMPLES, resumed_from_newest_snapshot
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.testing import Fault, fail_at, faults_env

GPT = os.path.join(EXAMPLES, "lightning_gpt.py")
STEPS, HOLD, B, BUCKET = 6, 4, 6, 1500  # global batch 24 in micro-batches of 4; ~7000 parameters per shard
CONFIGS = {"tp2-dp2": (2, 1), "pp2-dp2": (1, 2), "tp2-pp2-dp2": (2, 2)}
TIMEOUT = 420
SURVIVED_WITHIN_S = 30  # kill -> replica 0's step done: half the collective timeout, on a loaded machine too


def launch(out: Path, tp: int, pp: int, faults: list[Fault], *args: str, replicas: int = 2,
           timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """One run of ``lightning_gpt.py`` with ``replicas`` x TP x PP ranks under ``unicron-run --standalone``."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", **faults_env(faults, str(out / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={replicas * tp * pp}",
           "--monitor-interval=0.05", "--hang-factor=10", GPT, "--tensor-parallel", str(tp),
           "--pipeline-parallel", str(pp), "--megatron", "--steps", str(STEPS), "--bucket-numel", str(BUCKET),
           "--out", str(out), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def summary(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def shard(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return {name: v["tensor"] for name, v in torch.load(out / f"shards{rank}.pt").items()}


def buckets(out: Path, rank: int) -> int:
    """The gradient buckets of rank ``rank``'s shard."""
    return math.ceil(sum(t.numel() for t in shard(out, rank).values()) / BUCKET)


@pytest.fixture(scope="session")
def reference(failure_free):
    """The failure-free run of a configuration (made on first use, once per session)."""
    def get(tp: int, pp: int) -> Path:
        def reference_run(out: Path) -> Path:
            proc = launch(out, tp, pp, [])
            assert proc.returncode == 0, proc.stderr[-3000:]
            return out
        return failure_free(f"test_megatron_strategy.reference-tp{tp}-pp{pp}", reference_run)
    return get


def assert_every_shard_equals(out: Path, ref: Path, ranks: int) -> None:
    for r in range(ranks):
        assert summary(out, r)["global_step"] == STEPS, f"rank {r}"
        ours, theirs = shard(out, r), shard(ref, r)
        assert ours.keys() == theirs.keys()
        for name in ours:  # float64 sums: bit-identical
            assert torch.equal(ours[name], theirs[name]), f"rank {r} {name}"


def the_fault_fired(out: Path, victim: int) -> dict:
    fired = [json.loads(line) for line in (out / "faults.log").read_text().splitlines()]
    assert len(fired) == 1 and fired[0]["rank"] == victim, "the fault did not fire"
    return fired[0]


def check_recovery(out: Path, proc: subprocess.CompletedProcess, ref: Path, layout: ModelParallel,
                   victim: int) -> list[dict]:
    """The fault fired, every shard equals the failure-free run, the lost replica rejoined from replica 0.

    Returns:
        Replica 0's reports of the step the failure was noticed in, by rank.
    """
    fired = the_fault_fired(out, victim)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = 2 * layout.size
    assert_every_shard_equals(out, ref, ranks)
    for r in layout.ranks(1):  # the lost replica: the killed rank (restarted) and its peers (left, restarted)
        s = summary(out, r)
        assert s["state_from"] == "replica" and s["joined_at"] is not None and s["joined_at"] > fired["step"], r
    noticed = {}
    for r in layout.ranks(0):
        reports = [rep for rep in summary(out, r)["reports"] if rep["dead"]]
        assert len(reports) == 1 and reports[0]["dead"] == [1], (r, reports)  # replica 1, lost once
        assert sorted(reports[0]["micro_batches"]) == list(range(B)), r  # its micro-batches computed here
        noticed[r] = reports[0]
    return noticed


# -- the kills -------------------------------------------------------------------------------------------
def kill_in_a_micro_batch(layout: ModelParallel) -> tuple[int, Fault]:
    victim = layout.rank(1, layout.size - 1)  # the last shard of replica 1
    return victim, fail_at(rank=victim, step=2, micro_batch=3)


def kill_in_a_stage_reduction(layout: ModelParallel) -> tuple[int, Fault]:
    victim = layout.rank(1, (layout.pipeline - 1) * layout.tensor)  # tensor rank 0 of the last stage
    return victim, fail_at(rank=victim, step=2, bucket=2)


def kill_at(point: str):
    def kill(layout: ModelParallel) -> tuple[int, Fault]:
        victim = layout.rank(1, 0)
        return victim, fail_at(rank=victim, step=2, at=point)
    return kill


KILLS = {"micro-batch": kill_in_a_micro_batch, "stage-reduction": kill_in_a_stage_reduction,
         "before-step": kill_at("before_optimizer_step"), "after-step": kill_at("after_optimizer_step")}
# the e2e tier: a TP kill (it shares the TP=2 x DP=2 reference with the snapshot test); scenario 2 with PP
# in the e2e tier: tests/test_megatron_tp_dp.py; TP x PP x DP (8 processes, ~95 s) and the rest: -m matrix
DEFAULT = {("tp2-dp2", "micro-batch")}
CASES = [pytest.param(config, kill, id=f"{config}-{kill}",
                      marks=[] if (config, kill) in DEFAULT else [pytest.mark.matrix])
         for config in CONFIGS for kill in KILLS]


@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("config, kill", CASES)
def test_a_killed_rank_loses_its_replica_which_rejoins_with_its_shards_state(tmp_path: Path, reference,
                                                                           config: str, kill: str) -> None:
    tp, pp = CONFIGS[config]
    layout = ModelParallel(tp, pp)
    victim, fault = KILLS[kill](layout)
    proc = launch(tmp_path, tp, pp, [fault], "--hold-for-joiner", str(HOLD), "--record-times")
    noticed = check_recovery(tmp_path, proc, reference(tp, pp), layout, victim)
    failed_step = 3 if kill in ("before-step", "after-step") else 2  # after the step: noticed in the next one
    assert {rep["step"] for rep in noticed.values()} == {failed_step}
    killed_at = the_fault_fired(tmp_path, victim)["time"]
    for r in layout.ranks(0):  # not held until a collective's timeout (60 s) by a live rank that gave up the step
        done = {t["step"]: t["t"] for t in map(json.loads, (tmp_path / f"times{r}.jsonl").read_text().splitlines())}
        assert done[failed_step] - killed_at < SURVIVED_WITHIN_S, (r, done[failed_step] - killed_at)
    if kill != "stage-reduction":
        assert all(rep["kept_buckets"] == 0 for rep in noticed.values())  # scenario 1: nothing reduced yet
        return
    # scenario 2 per stage: the victim's shard kept what completed of the 2 buckets it started before it died
    # (right before bucket 2); every shard of a stage before it reduced all of its buckets with replica 1's
    # part, kept them, and ran forward only
    victim_stage = layout.stage(victim)
    for r, rep in noticed.items():
        if layout.shard(r) == layout.shard(victim):
            assert rep["kept_buckets"] <= 2, (r, rep)
        elif layout.stage(r) < victim_stage:
            assert rep["kept_buckets"] == buckets(tmp_path, r), (r, rep)
            assert summary(tmp_path, r)["forward_only"] == [failed_step], r
        if layout.stage(r) >= victim_stage:
            assert summary(tmp_path, r)["forward_only"] == [], r


# -- no parallelism, the same model ---------------------------------------------------------------------
def assemble(out: Path, layout: ModelParallel, layers: int = 2) -> dict[str, torch.Tensor]:
    """The whole model from the shards of replica 0: TP partitions concatenated, stages' blocks renumbered."""
    per_stage = layers // layout.pipeline
    parts: dict[str, dict[int, dict]] = {}
    for rank in layout.ranks(0):
        stage, tensor_rank = layout.stage(rank), layout.tensor_rank(rank)
        for name, value in torch.load(out / f"shards{rank}.pt").items():
            if name.startswith("blocks."):
                _, index, rest = name.split(".", 2)
                name = f"blocks.{stage * per_stage + int(index)}.{rest}"
            parts.setdefault(name, {})[tensor_rank] = value
    whole = {}
    for name, by_rank in parts.items():
        dim = by_rank[0]["partition_dim"]
        tensors = [by_rank[t]["tensor"] for t in sorted(by_rank)]
        whole[name] = torch.cat(tensors, dim=dim) if dim >= 0 else tensors[0]
        if dim < 0:  # replicated over the tensor-parallel ranks: identical there
            assert all(torch.equal(t, tensors[0]) for t in tensors), name
    return whole


@pytest.mark.matrix  # (tests/test_megatron_gpt.py's layouts train megatron-core's GPTModel at TP x PP)
@pytest.mark.timeout(2 * TIMEOUT)
def test_tp2_pp2_equals_the_same_model_trained_without_parallelism(tmp_path: Path) -> None:
    parallel, alone = tmp_path / "tp2-pp2", tmp_path / "alone"
    for out, (tp, pp) in ((parallel, (2, 2)), (alone, (1, 1))):
        proc = launch(out, tp, pp, [], "--dropout", "0", "--steps", "4", replicas=1)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = assemble(parallel, ModelParallel(2, 2)), assemble(alone, ModelParallel(1, 1))
    assert ours.keys() == theirs.keys() and len(ours) == 30
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name])  # float32 tolerance: TP sums in another order


# -- reconfiguration in whole replicas ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def reference_tp2_3(failure_free) -> Path:
    def reference_run(out: Path) -> Path:
        proc = launch(out, 2, 1, [], replicas=3)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out
    return failure_free("test_megatron_strategy.reference-tp2-dp3", reference_run)


@pytest.mark.matrix  # (the e2e tier scales in at DP: tests/test_lightning_strategy.py, test_elastic_dp.py)
@pytest.mark.timeout(2 * TIMEOUT)
def test_dp_scale_in_3_to_2_with_tp2_keeps_the_trajectory(tmp_path: Path, reference_tp2_3: Path) -> None:
    proc = launch(tmp_path, 2, 1, [], "--member-schedule", json.dumps({3: [0, 1]}), replicas=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [summary(tmp_path, r)["retired_at"] for r in range(6)] == [None] * 4 + [3, 3]  # replica 2, whole
    for r in range(4):
        assert summary(tmp_path, r)["global_step"] == STEPS
        assert all(torch.equal(a, b) for a, b in zip(shard(tmp_path, r).values(), shard(reference_tp2_3, r).values()))
    last = summary(tmp_path, 0)["reports"][-1]
    assert last["micro_batches"] == [0, 2, 4]  # B = 6 over 2 replicas: the global batch is unchanged


@pytest.mark.e2e
@pytest.mark.matrix
@pytest.mark.timeout(2 * TIMEOUT)
def test_dp_scale_out_2_to_3_with_tp2_new_replica_gets_its_shards_from_a_replica(tmp_path: Path,
                                                                                 reference_tp2_3: Path) -> None:
    proc = launch(tmp_path, 2, 1, [], "--members", "0,1", "--member-schedule", json.dumps({3: [0, 1, 2]}), replicas=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_every_shard_equals(tmp_path, reference_tp2_3, 6)
    for r in (4, 5):
        joined = summary(tmp_path, r)
        assert (joined["joined_at"], joined["state_from"]) == (3, "replica")
    assert summary(tmp_path, 0)["reports"][0]["micro_batches"] == [0, 2, 4]  # 2 replicas before the scale-out


# -- the DataLoader and the per-shard snapshot ---------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.matrix  # the default DataLoader case: tests/test_lightning_strategy.py
@pytest.mark.timeout(3 * TIMEOUT)
def test_dataloader_workers_feed_every_rank_of_a_replica_and_a_kill_keeps_the_trajectory(tmp_path: Path,
                                                                                         reference) -> None:
    layout = ModelParallel(2, 1)
    victim, fault = kill_in_a_micro_batch(layout)
    proc = launch(tmp_path, 2, 1, [fault], "--hold-for-joiner", str(HOLD), "--num-workers", "2", "--record-loads")
    check_recovery(tmp_path, proc, reference(2, 1), layout, victim)
    for r in layout.ranks(0):
        done = summary(tmp_path, r)
        loads = [line.split() for line in (tmp_path / f"loads{r}.txt").read_text().splitlines()]
        by_workers = {int(pid) for pid, worker, _ in loads if int(worker) >= 0}
        assert len(by_workers) == 2 and done["pid"] not in by_workers  # the DataLoader's two worker processes
        assert done["fed"] >= STEPS and done["on_demand"] >= 1  # own micro-batches fed; the lost replica's here


@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT)
def test_every_replica_lost_resumes_every_shard_from_the_memory_snapshot(tmp_path: Path, reference) -> None:
    layout = ModelParallel(2, 1)
    both = [fail_at(rank=layout.rank(replica, 0), step=3, micro_batch=replica) for replica in (0, 1)]
    proc = launch(tmp_path, 2, 1, both, "--snapshot-every", "1")  # one rank of each replica: no replica is left
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 2
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(4):
        s = summary(tmp_path, r)
        # the newest step every shard's snapshot landed for (one due while a writer is busy is skipped)
        assert s["state_from"] == "memory", (r, s["state_from"])
        assert resumed_from_newest_snapshot(proc.stdout + proc.stderr, s["joined_at"]), (r, s["joined_at"])
    assert_every_shard_equals(tmp_path, reference(2, 1), 2 * layout.size)


@pytest.mark.e2e
@pytest.mark.matrix
@pytest.mark.timeout(3 * TIMEOUT)
def test_every_replica_lost_without_snapshots_resumes_every_shard_from_disk(tmp_path: Path, reference) -> None:
    layout = ModelParallel(1, 2)
    ckpt = tmp_path / "ckpt"
    both = [fail_at(rank=layout.rank(replica, 0), step=4, micro_batch=replica) for replica in (0, 1)]
    proc = launch(tmp_path, 1, 2, both, "--snapshot-every", "0", "--checkpoint-dir", str(ckpt))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(4):
        s = summary(tmp_path, r)
        assert s["state_from"] == "disk" and s["joined_at"] in (3, 4), (r, s["state_from"], s["joined_at"])
    assert_every_shard_equals(tmp_path, reference(1, 2), 2 * layout.size)
    assert {p.name.split(".")[1] for p in ckpt.glob("step-*")} == set(layout.labels())  # one file per shard
