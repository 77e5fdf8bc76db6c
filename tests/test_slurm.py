"""SLURM: the job as its environment says, the etcd members' layout, the drain watch, the warning signal,
the preemption checkpoint, Lightning's environment; one short run on a real loopback SLURM (docs/slurm.md; in the
e2e tier, like every test on a real SLURM).

The long cases (a lost node, a drain, preemption and requeue, the coordinator's pool) are in test_slurm_e2e.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

from conftest import BIN, EXAMPLES, json_log_entries, wait_for
from unicron_elastic.agent.signals import PREEMPT_SIGNAL, signal_for_workers
from unicron_elastic.api import ConfigError, EtcdConfig
from unicron_elastic.launcher import apply_slurm, get_parser
from unicron_elastic.slurm.api import (
    MAX_MEMBERS,
    PORT_RANGE,
    NotUnderSlurm,
    SlurmCommandError,
    SlurmJob,
    default_port_base,
    endpoint_list,
    etcd_layout,
    is_draining,
    parse_node_line,
    state_flags,
)
from unicron_elastic.slurm.job import current_job
from unicron_elastic.slurm.preemption import PreemptionCheckpoint
from unicron_elastic.slurm.drain_watch import NodeWatch
from unicron_elastic.store import EmbeddedEtcd, StatusStore
from unicron_elastic.strategy.lightning.environment import UnicronEnvironment
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.testing import toy_data

JOB = SlurmJob(job_id="4242", node="n2", nodes=("n1", "n2", "n3"))


# -- the job ---------------------------------------------------------------------------------------

def test_run_id_is_the_job_id_and_the_restart_count_and_an_array_task_is_requeued_by_its_own_id() -> None:
    assert JOB.run_id == "4242-0" and JOB.requeue_id == "4242" and JOB.node_index == 1
    requeued = SlurmJob(job_id="4250", node="n1", nodes=("n1",), restart_count=2, array_job_id="4242",
                        array_task_id="7")
    assert requeued.requeue_id == "4242_7" and requeued.run_id == "4242_7-2"


def test_a_node_outside_the_job_list_and_a_process_outside_slurm_are_refused() -> None:
    with pytest.raises(ConfigError, match="not in the job's node list"):
        _ = SlurmJob(job_id="1", node="n9", nodes=("n1",)).node_index
    with pytest.raises(NotUnderSlurm, match="SLURM_JOB_ID, SLURMD_NODENAME"):
        current_job({})
    with pytest.raises(NotUnderSlurm, match="SLURM_RESTART_COUNT"):
        current_job({"SLURM_JOB_ID": "1", "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n1",
                     "SLURM_RESTART_COUNT": "x"})


# -- the etcd members ------------------------------------------------------------------------------

def test_every_member_gets_ports_of_its_own_so_nodes_sharing_a_host_do_not_collide() -> None:
    nodes = ("n1", "n2", "n3", "n4")
    layout = etcd_layout(nodes, dict.fromkeys(nodes, "127.0.0.1"), 3, 20000)
    assert [m.name for m in layout] == ["n1", "n2", "n3"]  # the job's first three nodes
    ports = [p for m in layout for p in (m.client_port, m.peer_port)]
    assert len(set(ports)) == 6 and all(20000 <= p < 20000 + 2 * MAX_MEMBERS for p in ports)
    assert endpoint_list(layout) == "127.0.0.1:20000,127.0.0.1:20001,127.0.0.1:20002"
    assert etcd_layout(("a",), {"a": "::1"}, 1, 30000)[0].endpoint == "[::1]:30000"


@pytest.mark.parametrize(("members", "nodes", "base", "match"), [
    (2, 3, 20000, "odd number"), (7, 9, 20000, "odd number"), (3, 2, 20000, "only 2 node"),
    (3, 3, 80, "--port-base 80"), (3, 3, 65530, "--port-base 65530")])
def test_a_bad_member_count_or_port_base_is_refused(members: int, nodes: int, base: int, match: str) -> None:
    names = tuple(f"n{i}" for i in range(nodes))
    with pytest.raises(ConfigError, match=match):
        etcd_layout(names, dict.fromkeys(names, "h"), members, base)


def test_a_member_without_an_address_is_refused() -> None:
    with pytest.raises(ConfigError, match="'n2' of the job has no address"):
        etcd_layout(("n1", "n2", "n3"), {"n1": "a", "n3": "c"}, 3, 20000)


def _resolved_on(node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Name resolution as ``node``'s own resolver does it: Debian's /etc/hosts gives each node's own name 127.0.1.1."""
    import socket

    import unicron_elastic.slurm.job as job_module

    def getaddrinfo(host: str, *args: object, **kwargs: object) -> list[tuple]:
        address = "127.0.1.1" if host == node else f"10.0.0.{host[1:]}"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0))]

    monkeypatch.setattr(job_module, "node_records", lambda names: {n: {"NodeName": n, "NodeAddr": n} for n in names})
    monkeypatch.setattr(job_module.socket, "getaddrinfo", getaddrinfo)


def test_the_layout_is_decided_once_so_members_whose_resolvers_disagree_get_one_cluster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each node resolves its own name to 127.0.1.1: members that each decided the layout would name a member by
    an address only its own node reaches. Decided once on a host that resolves the members' nodes to their
    addresses (here n4, the batch host, not a member) and handed to every member, every member is given the same
    ``--initial-cluster``; decided on a member's node, the loopback address is refused, naming the node."""
    from unicron_elastic.slurm.api import layout_from_json, layout_to_json
    from unicron_elastic.slurm.etcd import MemberEtcd, layout_of

    nodes = ("n1", "n2", "n3", "n4")
    _resolved_on("n4", monkeypatch)
    text = layout_to_json(layout_of(SlurmJob(job_id="9", node="n4", nodes=nodes), 3, 20000))
    clusters = set()
    for name in nodes[:3]:  # each member, on its own node, from the one layout (its own resolver plays no part)
        _resolved_on(name, monkeypatch)
        layout = layout_from_json(text)
        member = MemberEtcd(next(m for m in layout if m.name == name), layout, token="9")
        clusters.add(member.initial_cluster)
    assert clusters == {"n1=http://10.0.0.1:20005,n2=http://10.0.0.2:20006,n3=http://10.0.0.3:20007"}
    _resolved_on("n2", monkeypatch)
    with pytest.raises(ConfigError, match=r"node 'n2' resolves to the loopback address 127\.0\.1\.1 while node "
                                          r"'n1' is at 10\.0\.0\.1"):
        layout_of(SlurmJob(job_id="9", node="n2", nodes=nodes), 3, 20000)


def test_a_member_without_the_layout_decided_for_the_job_refuses_to_start(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from unicron_elastic.cli import main

    monkeypatch.delenv("UNICRON_ETCD_LAYOUT", raising=False)
    for verb in ("etcd", "endpoint"):
        with pytest.raises(SystemExit) as exit_:
            main(["slurm", verb])
        assert exit_.value.code == 2
        assert "no etcd layout: decide it once in the batch script, before the step: export " \
               "UNICRON_ETCD_LAYOUT=$(unicron slurm layout)" in capsys.readouterr().err
    monkeypatch.setenv("UNICRON_ETCD_LAYOUT", '[{"name": "n1"}]')
    with pytest.raises(SystemExit):
        main(["slurm", "etcd"])
    assert "UNICRON_ETCD_LAYOUT is not a layout `unicron slurm layout` printed" in capsys.readouterr().err


def test_the_default_port_base_differs_between_jobs_and_stays_below_the_ephemeral_ports() -> None:
    bases = {default_port_base(str(job)) for job in range(1, 200)}
    assert len(bases) == 199 and min(bases) >= PORT_RANGE[0] and max(bases) + 2 * MAX_MEMBERS <= 32768
    assert default_port_base("77_3") == default_port_base("77")
    with pytest.raises(ConfigError, match="give --port-base"):
        default_port_base("abc")


#: A member as `unicron slurm etcd` runs it on node n1 of job 7 (a one-member layout on loopback).
_MEMBER = """
import sys
from unicron_elastic.logging import configure_logging
from unicron_elastic.slurm.api import SlurmJob, etcd_layout
from unicron_elastic.slurm.etcd import serve
configure_logging("json")
layout = etcd_layout(("n1",), {"n1": "127.0.0.1"}, 1, int(sys.argv[1]))
sys.exit(serve(SlurmJob(job_id="7", node="n1", nodes=("n1",)), layout, grace=60))
"""


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


@pytest.mark.e2e  # (5 s of real processes)
@pytest.mark.timeout(90)
def test_a_member_signalled_with_its_step_comes_back_with_its_keys_and_one_that_dies_alone_is_a_failure(
        tmp_path: Path) -> None:
    """SLURM's SIGTERM (preemption, scancel) reaches every process of the etcd step, the etcd binary included,
    which exits on it: the member starts it again on its data dir, the store keeps its keys and serves the
    launchers' stop for ``--grace``; SIGUSR2 then stops it with 0. An etcd process that exits while its member
    got no SIGTERM is a failure of the member (exit 1)."""
    import socket

    def free_base() -> int:
        for base in range(21000 + os.getpid() % 500 * 10, 32000, 10):
            with contextlib.ExitStack() as stack:
                try:
                    for port in (base, base + MAX_MEMBERS):
                        s = stack.enter_context(socket.socket())
                        s.bind(("127.0.0.1", port))
                    return base
                except OSError:
                    continue
        raise AssertionError("no free ports")

    def start(base: int) -> tuple[subprocess.Popen, EtcdConfig]:
        log = open(tmp_path / f"member-{base}.log", "w")  # noqa: SIM115 - closed with the process
        member = subprocess.Popen([sys.executable, "-c", _MEMBER, str(base)], stdout=log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        config = EtcdConfig(host="127.0.0.1", port=base, request_timeout=1.0)
        wait_for(lambda: "ready: --rdzv-endpoint" in (tmp_path / f"member-{base}.log").read_text(), 60,
                 why="the member ready")
        return member, config

    from unicron_elastic.store import StatusStore

    base = free_base()
    member, config = start(base)
    try:
        with StatusStore(config) as store:
            store.put("/probe", "before the SIGTERM")
        tree = [member.pid, *_children(member.pid)]
        assert len(tree) >= 2  # (the member, its etcd process, the guard)
        for pid in tree:  # as SLURM signals a step: every process of it
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: "slurm_etcd_member_restarted" in (tmp_path / f"member-{base}.log").read_text(), 30,
                 why="the member started again")
        with StatusStore(config) as store:
            assert store.get("/probe").value == b"before the SIGTERM"
        assert member.poll() is None  # it serves the grace
        member.send_signal(signal.SIGUSR2)
        assert member.wait(timeout=30) == 0
    finally:
        member.kill()
    base = free_base()
    member, _ = start(base)
    try:
        etcd_pid = next(p for p in _children(member.pid) if b"etcd" in Path(f"/proc/{p}/cmdline").read_bytes()
                        and b"--initial-cluster" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(etcd_pid, signal.SIGKILL)
        assert member.wait(timeout=30) == 1
        assert "slurm_etcd_member_exited" in (tmp_path / f"member-{base}.log").read_text()
    finally:
        member.kill()


# -- the node's state ------------------------------------------------------------------------------

def test_scontrol_lines_and_states_are_read_as_slurm_writes_them() -> None:
    line = ("NodeName=n2 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=localhost "
            "State=ALLOCATED+DRAIN ThreadsPerCore=1 Reason=maintenance [root@2026-11-27T08:00:00]")
    fields = parse_node_line(line)
    assert fields["NodeName"] == "n2" and fields["NodeAddr"] == "127.0.0.1" and fields["State"] == "ALLOCATED+DRAIN"
    assert is_draining(state_flags(fields["State"]))
    assert is_draining(state_flags("MIXED+DRAIN+COMPLETING")) and is_draining(state_flags("drained"))
    assert not is_draining(state_flags("ALLOCATED")) and not is_draining(state_flags("DOWN*+NOT_RESPONDING"))


def test_the_watch_calls_on_drain_once_and_a_failed_look_is_no_drain() -> None:
    answers = iter([SlurmCommandError("slurmctld busy"), frozenset({"ALLOCATED"}), frozenset({"ALLOCATED", "DRAIN"})])
    calls = []

    def flags(node: str) -> frozenset[str]:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    watch = NodeWatch("n2", lambda: calls.append(1), interval=0.01, flags=flags).start()
    assert watch.drained.wait(10)
    time.sleep(0.05)
    assert calls == [1]


# -- unicron-run --slurm ---------------------------------------------------------------------------

def _args(*argv: str) -> argparse.Namespace:
    return get_parser().parse_args([*argv, "train.py"])


def test_slurm_flags_default_the_run_id_node_name_and_offset_the_metrics_port() -> None:
    args = _args("--slurm", "--rdzv-endpoint=e:1", "--metrics-port=9000")
    apply_slurm(args, JOB)
    assert (args.rdzv_id, args.node_name, args.metrics_port) == ("4242-0", "n2", 9001)
    args = _args("--slurm", "--rdzv-endpoint=e:1", "--rdzv-id=joined", "--node-name=mine")
    apply_slurm(args, JOB)
    assert (args.rdzv_id, args.node_name) == ("joined", "mine")  # given flags win (a job joining another's run)


@pytest.mark.parametrize(("cpus_per_task", "nproc", "given", "expected"), [
    ("8", "2", None, "4"), ("8", "3", None, "2"), ("2", "4", None, "1"), (None, "1", None, "affinity"),
    ("8", "2", "3", "3")])
def test_each_worker_gets_its_share_of_the_tasks_cpus_as_omp_threads_unless_the_user_chose(
        monkeypatch: pytest.MonkeyPatch, cpus_per_task: str | None, nproc: str, given: str | None,
        expected: str) -> None:
    """torchrun sets 1 thread for several workers and leaves a lone worker on every core: under --slurm each worker
    gets SLURM_CPUS_PER_TASK (else the launcher's CPU affinity) / --nproc-per-node; a given OMP_NUM_THREADS wins."""
    for name, value in (("SLURM_CPUS_PER_TASK", cpus_per_task), ("OMP_NUM_THREADS", given)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    apply_slurm(_args("--slurm", "--rdzv-endpoint=e:1", f"--nproc-per-node={nproc}"), JOB)
    assert os.environ["OMP_NUM_THREADS"] == (str(len(os.sched_getaffinity(0))) if expected == "affinity" else expected)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "0")
    with pytest.raises(ConfigError, match="SLURM_CPUS_PER_TASK='0' is not a positive number"):
        apply_slurm(_args("--slurm", "--rdzv-endpoint=e:1"), JOB)


def test_a_pool_node_without_slots_runs_a_worker_per_gpu_slurm_gave_its_own_task(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from unicron_elastic.cluster_cli import _slots_of_this_node

    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert _slots_of_this_node(JOB) == 4
    with pytest.raises(ConfigError, match="--slots is required"):
        _slots_of_this_node(None)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    with pytest.raises(ConfigError, match="SLURM gave this node no GPU"):
        _slots_of_this_node(JOB)


@pytest.mark.parametrize(("argv", "match"), [
    (("--standalone",), "every node would start an etcd"), ((), "needs --rdzv-endpoint"),
    (("--rdzv-endpoint=e:1", "--slurm-poll=-1"), "--slurm-poll")])
def test_slurm_flags_that_cannot_work_are_refused(argv: tuple[str, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        apply_slurm(_args("--slurm", *argv), JOB)


def test_unicron_run_slurm_outside_a_slurm_job_is_one_error_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    done = subprocess.run([os.path.join(BIN, "unicron-run"), "--slurm", "--rdzv-endpoint=127.0.0.1:1", "x.py"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "unicron-run: error: not a task of a SLURM job step (SLURM_JOB_ID, SLURMD_NODENAME unset): run it in a "
        "SLURM job (under srun or sbatch)"]


def test_unicron_slurm_layout_outside_a_slurm_job_is_one_error_line(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from unicron_elastic.cli import main

    for name in ("SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["slurm", "layout"])
    assert exit_.value.code == 2 and "not a task of a SLURM job step" in capsys.readouterr().err


# -- SLURM's warning signal ------------------------------------------------------------------------

_PREEMPTED = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from torch.distributed.elastic.multiprocessing import SignalException
    from unicron_elastic.agent.signals import install_preemption_signal, install_stop_signals
    install_stop_signals()
    install_preemption_signal()
    child = subprocess.Popen([sys.executable, "-c",
        "import sys; print([l for l in open('/proc/self/status') if l.startswith('SigBlk')][0].split()[1]); "
        "sys.stdout.flush(); import time; time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    print("child_mask", child.stdout.readline().strip(), flush=True)
    os.kill(child.pid, signal.SIGUSR1)  # what SLURM does to every process of the step
    time.sleep(0.2)
    print("child_alive", child.poll() is None, flush=True)
    try:  # (the receiving thread may take it before os.kill returns: os.kill then raises it)
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(100):
            time.sleep(0.05)
        print("not stopped", flush=True)
    except SignalException as exc:
        print("stopped_by", exc.sigval.name, flush=True)
    child.kill()
""")


def test_the_warning_signal_stops_the_launcher_and_never_reaches_its_children() -> None:
    done = subprocess.run([sys.executable, "-c", _PREEMPTED], capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert int(lines["child_mask"], 16) & (1 << (PREEMPT_SIGNAL - 1)), done.stdout + done.stderr  # blocked in it
    assert lines["child_alive"] == "True" and lines["stopped_by"] == "SIGUSR1", done.stdout + done.stderr
    assert signal_for_workers(signal.SIGUSR1) == signal.SIGTERM and signal_for_workers(signal.SIGINT) == signal.SIGINT


# -- the preemption checkpoint and Lightning's environment -----------------------------------------

class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _reference(steps: int) -> list[torch.Tensor]:
    model = _Regression()
    optimizer = model.configure_optimizers()
    xs, ys = toy_data()
    plan = GlobalBatchPlan(len(xs), 4, 4, seed=0)
    for step in range(steps):
        optimizer.zero_grad()
        idx = plan.indices(step, 0)
        torch.nn.functional.mse_loss(model.net(xs[idx]), ys[idx]).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


class _StopAt(pl.Callback):
    """SIGTERM to this process during step ``step`` (what unicron-run's stop sends); records the steps run."""

    def __init__(self, step: int | None) -> None:
        self.step, self.steps = step, []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        self.steps.append(trainer.global_step)
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _trainer(tmp: Path, steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(strategy="unicron_megatron", accelerator="cpu", max_steps=steps, enable_progress_bar=False,
                      enable_model_summary=False, logger=False, enable_checkpointing=False, callbacks=callbacks)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(*toy_data()), batch_size=4)


@pytest.mark.timeout(120)
def test_a_stop_writes_the_step_it_ends_at_and_the_next_run_resumes_from_the_next_step(tmp_path: Path) -> None:
    first = PreemptionCheckpoint(tmp_path / "preempted.ckpt")
    assert first.resume_path is None
    with pytest.raises(SIGTERMException):
        _trainer(tmp_path, 8, [_StopAt(2), first]).fit(_Regression(), _loader())
    assert first.saved_step == 3 and first.resume_path == str(tmp_path / "preempted.ckpt")  # step 2 done, then stop
    assert not (tmp_path / "preempted.ckpt.tmp").exists()
    again, steps, model = PreemptionCheckpoint(tmp_path / "preempted.ckpt"), _StopAt(None), _Regression()
    _trainer(tmp_path, 8, [again, steps]).fit(model, _loader(), ckpt_path=again.resume_path)
    assert steps.steps == [3, 4, 5, 6, 7] and again.saved_step is None  # its first step is the next one
    for ours, ref in zip(model.parameters(), _reference(8)):
        torch.testing.assert_close(ours.detach(), ref)


@pytest.mark.timeout(120)
def test_a_preemption_checkpoint_is_resumed_only_by_the_job_or_array_task_that_wrote_it(tmp_path: Path) -> None:
    """Two tasks of array 500 given one path: task 0 writes it; task 1 (and a job with no SLURM id) refuse it,
    naming the writer; task 0 requeued (a new run) resumes it. A file there that records no job is refused."""
    from unicron_elastic.slurm.api import ForeignCheckpoint

    path = tmp_path / "preempted.ckpt"
    with pytest.raises(SIGTERMException):
        _trainer(tmp_path, 8, [_StopAt(2), PreemptionCheckpoint(path, job="500_0")]).fit(_Regression(), _loader())
    for other in ("500_1", "501"):
        foreign = PreemptionCheckpoint(path, job=other)
        with pytest.raises(ForeignCheckpoint, match=f"written by SLURM job 500_0 .*not by this job {other}"):
            _trainer(tmp_path, 8, [foreign]).fit(_Regression(), _loader(), ckpt_path=foreign.resume_path)
    own, steps = PreemptionCheckpoint(path, job="500_0"), _StopAt(None)
    _trainer(tmp_path, 8, [own, steps]).fit(_Regression(), _loader(), ckpt_path=own.resume_path)
    assert steps.steps == [3, 4, 5, 6, 7]
    trainer = _trainer(tmp_path, 2, [])
    trainer.fit(_Regression(), _loader())
    trainer.save_checkpoint(tmp_path / "plain.ckpt")  # written without the callback: no job recorded
    plain = PreemptionCheckpoint(tmp_path / "plain.ckpt", job="500_0")
    with pytest.raises(ForeignCheckpoint, match="records no job"):
        _trainer(tmp_path, 8, [plain]).fit(_Regression(), _loader(), ckpt_path=plain.resume_path)


@pytest.mark.parametrize("record, only_if_preempted, requeued, reason", [
    ({"JobState": "RUNNING", "PreemptTime": "2026-11-28T16:19:52"}, True, True, "preempted"),
    ({"JobState": "RUNNING", "PreemptTime": "None"}, False, True, "stopped"),  # the warning signal
    ({"JobState": "RUNNING", "PreemptTime": "None"}, True, False, "not preempted"),  # a node stopped otherwise
    ({"JobState": "COMPLETING", "PreemptTime": "None"}, False, False, "SLURM is ending the job (COMPLETING"),
    ({"JobState": "CANCELLED", "PreemptTime": "None"}, False, False, "cancelled"),
    ({"JobState": "TIMEOUT", "PreemptTime": "None"}, False, False, "SLURM is ending the job (TIMEOUT"),
])
def test_only_a_job_slurm_still_runs_is_requeued(record: dict, only_if_preempted: bool, requeued: bool,
                                                 reason: str) -> None:
    """After ``scancel`` SLURM shows the job ``COMPLETING`` (not ``CANCELLED``) while its batch shell still
    runs: a stop fast enough to reach the requeue then must not requeue it (seen on the loopback SLURM)."""
    from unicron_elastic.slurm.job import requeue_decision

    decided, why = requeue_decision(record, only_if_preempted)
    assert decided is requeued and reason in why


def test_the_job_of_a_process_is_its_array_task_or_its_job() -> None:
    from unicron_elastic.slurm.api import job_of_environment

    assert job_of_environment({"SLURM_JOB_ID": "512", "SLURM_ARRAY_JOB_ID": "500", "SLURM_ARRAY_TASK_ID": "3"}) \
        == "500_3"
    assert job_of_environment({"SLURM_JOB_ID": "512"}) == "512" and job_of_environment({}) is None


@pytest.mark.timeout(120)
def test_a_stop_after_the_last_step_writes_nothing(tmp_path: Path) -> None:
    callback = PreemptionCheckpoint(tmp_path / "preempted.ckpt")
    with contextlib.suppress(SIGTERMException):  # (Lightning raises it at the epoch's end too)
        _trainer(tmp_path, 3, [_StopAt(2), callback]).fit(_Regression(), _loader())  # training is over with that step
    assert callback.saved_step is None and callback.resume_path is None


_SRUN_ENV = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "n1", "SLURM_JOB_NODELIST": "n1",
             "SLURMD_NODENAME": "n1", "SLURM_STEP_ID": "0"}
_AGENT_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": "77-0"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["unicron_megatron", "instance"])
def test_lightning_under_srun_and_unicron_run_gets_the_strategys_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, strategy: str) -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from unicron_elastic.strategy import UnicronMegatronStrategy

    for name, value in {**_SRUN_ENV, **_AGENT_ENV}.items():
        monkeypatch.setenv(name, value)
    assert SLURMEnvironment.detect()  # what Lightning would pick without the strategy's own
    before = signal.getsignal(signal.SIGUSR1)
    seen = {}

    class Look(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
            seen["environment"] = trainer.strategy.cluster_environment
            seen["usr1"] = signal.getsignal(signal.SIGUSR1)

    chosen = "unicron_megatron" if strategy == "unicron_megatron" else UnicronMegatronStrategy()
    trainer = pl.Trainer(strategy=chosen, accelerator="cpu", max_steps=1, enable_progress_bar=False, logger=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[Look()])
    trainer.fit(_Regression(), _loader())
    assert type(seen["environment"]) is UnicronEnvironment  # not SLURMEnvironment
    assert type(trainer._accelerator_connector.cluster_environment) is UnicronEnvironment
    assert seen["usr1"] == before  # no SLURM requeue handler of Lightning's on SIGUSR1


# -- on a real SLURM ------------------------------------------------------------------------------

@pytest.mark.e2e  # (the default tier needs no SLURM: the README's two commands pass where none is installed)
@pytest.mark.timeout(240)
def test_unicron_run_under_srun_names_the_run_after_the_job_and_the_nodes_as_slurm_does(
        slurm, etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    out, gate = tmp_path / "out", tmp_path / "go"
    config = EtcdConfig(host="127.0.0.1", port=etcd.client_port, cluster="slurm-short")
    env = slurm.env(dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"]))
    srun = subprocess.Popen(
        ["srun", "-N2", "--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0", f"--output={tmp_path}/node-%t.log",
         os.path.join(BIN, "unicron-run"), "--slurm", "--nnodes=2", "--nproc-per-node=1", "--monitor-interval=0.05",
         "--log-format=json", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-conf=cluster={config.cluster}",
         os.path.join(EXAMPLES, "lightning_gpt.py"), "--steps", "3", "--out", str(out),
         "--hold-until", str(gate), "--hold-step", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(list(tmp_path.glob("go.waiting*"))) == 2, 180,  # both ranks train, held at step 1
                 why=lambda: "".join(p.read_text()[-1500:] for p in tmp_path.glob("node-*.log")))
        with StatusStore(config) as store:
            nodes = sorted(kv.key.rsplit("/", 1)[-1] for kv in store.get_prefix(store.keys.nodes()))
            steps = [e for p in tmp_path.glob("node-*.log") for e in json_log_entries(p) if e["event"] == "slurm_step"]
            run_id = f"{steps[0]['job']}-0"
            assert store.get(store.keys.rdzv(run_id)) is not None  # the run is named after the job
        gate.touch()
        assert srun.wait(timeout=120) == 0, srun.stdout.read().decode()[-3000:]
    finally:
        if srun.poll() is None:
            srun.kill()
    assert nodes == ["n1", "n2"]  # our node records carry SLURM's node names
    assert sorted(e["node_name"] for e in steps) == ["n1", "n2"] and {e["run_id"] for e in steps} == {run_id}
    for rank in (0, 1):
        summary = json.loads((out / f"rank{rank}.json").read_text())
        assert summary["environment"] == "UnicronEnvironment" and summary["global_step"] == 3
