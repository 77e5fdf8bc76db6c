"""Real torchrun / unicron-run subprocesses on loopback with a real etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, EXAMPLES
from unicron_elastic.launcher import get_parser
from unicron_elastic.store import EmbeddedEtcd, free_port
from unicron_elastic.testing import kill_node

ALLREDUCE = os.path.join(EXAMPLES, "allreduce.py")
FAST_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"


def _env(tmp: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    return env


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _node(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env())


def _torchrun(etcd: EmbeddedEtcd, run_id: str, nnodes: str, out: Path, *extra: str) -> list[str]:
    return [
        os.path.join(BIN, "torchrun"), "--rdzv-backend=unicron", f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}", f"--nnodes={nnodes}", "--nproc-per-node=2", "--monitor-interval=0.1",
        f"--rdzv-conf=cluster={run_id},{FAST_RDZV}", *extra, ALLREDUCE, "--out", str(out),
    ]


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_plain_torchrun_two_nodes_world_size_4(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = _torchrun(etcd, "two-nodes", "2", out)
    nodes = [_node(cmd, tmp_path / f"node{i}.log") for i in range(2)]
    codes = [p.wait(timeout=80) for p in nodes]
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:]
    records = _records(out)
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    assert {r["world_size"] for r in records} == {4}
    assert {r["value"] for r in records} == {10.0}


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_node_loss_leaves_the_other_node_finishing_with_world_size_2(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = _torchrun(etcd, "node-loss", "1:2", out, "--max-restarts=1")
    cmd += ["--steps", "80", "--sleep", "0.1"]
    nodes = [_node(cmd, tmp_path / f"node{i}.log") for i in range(2)]
    deadline = time.monotonic() + 60
    while len(list(out.glob("progress*"))) < 4:  # all four ranks are past init and training
        assert time.monotonic() < deadline, (tmp_path / "node0.log").read_text()[-3000:]
        assert all(p.poll() is None for p in nodes)
        time.sleep(0.05)
    # which node is the survivor? the one hosting ranks 0-1 or 2-3 - either works
    killed = kill_node(nodes[1].pid)
    assert len(killed) == 3  # launcher + 2 workers
    assert nodes[0].wait(timeout=90) == 0, (tmp_path / "node0.log").read_text()[-3000:]
    records = _records(out)
    assert [r["rank"] for r in records] == [0, 1]
    assert {r["world_size"] for r in records} == {2}
    assert {r["restart_count"] for r in records} == {1}
    assert {r["value"] for r in records} == {3.0}


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.compat
@pytest.mark.timeout(90)
def test_unicron_run_standalone_needs_no_etcd_and_leaves_none_behind(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out"
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", ALLREDUCE, "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp), timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "standalone_etcd" in result.stderr
    records = _records(out)
    assert {r["world_size"] for r in records} == {2}
    # our agent class ran the workers: it exports the incarnation (<node>.<rendezvous count>.<restarts>)
    assert {tuple(r["incarnation"].rsplit(".", 2)[1:]) for r in records} == {("1", "0")}
    # etcd's data dir and log are removed (torch keeps its own torchelastic_* log dir)
    assert [p.name for p in tmp.iterdir() if p.name.startswith("unicron-etcd")] == []
    assert _processes_mentioning(str(tmp)) == []  # no etcd still running on it


def test_unicron_run_reuses_torchrun_parser_with_unicron_default() -> None:
    args = get_parser().parse_args(["--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3", "train.py", "--lr", "1"])
    assert args.rdzv_backend == "unicron"
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("1:2", "2", 3)
    assert (args.training_script, args.training_script_args) == ("train.py", ["--lr", "1"])


@pytest.mark.timeout(60)
def test_unicron_run_bad_rdzv_conf_fails_clearly(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    cmd = [
        os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd.endpoint}", "--rdzv-conf=bogus=1",
        "--nproc-per-node=1", ALLREDUCE,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=50)
    assert result.returncode != 0
    assert "unknown --rdzv-conf key(s) bogus" in result.stderr


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_unicron_run_unreachable_etcd_fails_within_reconnect_timeout(tmp_path: Path) -> None:
    cmd = [
        os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-conf=reconnect_timeout=2,request_timeout=1", "--nproc-per-node=1", ALLREDUCE,
    ]
    started = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=50)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "unreachable for 2.0s" in result.stderr
    assert elapsed < 20, elapsed


def test_unicron_cli_runs_under_python_m() -> None:
    result = subprocess.run([sys.executable, "-m", "unicron_elastic.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "etcd" in result.stdout
