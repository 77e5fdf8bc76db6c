"""The cluster commands: ``unicron task``, ``unicron node``, ``unicron cluster up`` and ``unicron-coordinator``.

Bad input is one ``error: ...`` line and exit code 2 (``unicron``'s ``main``
turns :class:`~unicron_elastic.api.ConfigError` into that); nothing in etcd
is changed by a refused command.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading

import structlog

from unicron_elastic.api import ConfigError
from unicron_elastic.cli_options import add_etcd_options, bounded, etcd_config, positive_int

log = structlog.get_logger(__name__)

#: Default ``--timeout`` of the coordinator and the node daemon: they ride out etcd outages this long.
DAEMON_TIMEOUT_S = 30.0


def _store(args: argparse.Namespace):
    from unicron_elastic.store import StatusStore

    return StatusStore(etcd_config(args))


# -- unicron task -----------------------------------------------------------------------------------
def _cmd_task_submit(args: argparse.Namespace) -> int:
    from unicron_elastic.coordinator.api import SpecError, TaskSpec

    spec = TaskSpec.from_file(args.spec)
    warning = spec.weight_warning()
    if warning is not None:
        log.warning("task_weight_outside_recommended", detail=warning)
    with _store(args) as store:
        result = store.cas(store.keys.task_spec(spec.name), json.dumps(spec.to_dict(), sort_keys=True), None)
        if not result.succeeded:
            raise SpecError(f"field 'name': a task named {spec.name!r} exists already in cluster "
                            f"{store.config.cluster!r} (names are never reused)")
    print(f"submitted task {spec.name}")
    return 0


def _cmd_task_list(args: argparse.Namespace) -> int:
    from unicron_elastic.coordinator.status import read_tasks, render_tasks

    with _store(args) as store:
        tasks = read_tasks(store)
    print(json.dumps(tasks, sort_keys=True) if args.json else render_tasks(tasks))
    return 0


def _cmd_task_cancel(args: argparse.Namespace) -> int:
    with _store(args) as store:
        keys = store.keys
        if store.get(keys.task_spec(args.name)) is None:
            raise ConfigError(f"no task named {args.name!r} in cluster {store.config.cluster!r}")
        status = store.get_json(keys.task_status(args.name)) or {}
        if status.get("state") in ("finished", "failed"):
            raise ConfigError(f"task {args.name!r} has {status['state']} already")
        store.put(keys.task_cancel(args.name), "cancel")
    print(f"cancelling task {args.name}")
    return 0


# -- unicron node -----------------------------------------------------------------------------------
def _stop_on_signals(stop, on_sigterm=None) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        action = on_sigterm if sig == signal.SIGTERM and on_sigterm is not None else stop
        signal.signal(sig, lambda *_, act=action: act())


def _slots_of_this_node(job: object | None) -> int:
    """``--slots`` not given: with ``--slurm``, this node's GPUs as SLURM gave them to this task.

    Raises:
        ConfigError: Not under ``--slurm``, or SLURM gave this task no GPU (``SLURM_GPUS_ON_NODE``).
    """
    gpus = os.environ.get("SLURM_GPUS_ON_NODE", "")
    if job is None:
        raise ConfigError("--slots is required (without --slurm there is no SLURM to ask for the node's GPUs)")
    if not gpus.isdigit() or int(gpus) < 1:
        raise ConfigError(f"--slots not given and SLURM gave this node no GPU (SLURM_GPUS_ON_NODE={gpus!r}): "
                          "allocate them (sbatch --gpus-per-node=N or --gres=gpu:N) or give --slots")
    return int(gpus)


def _cmd_node(args: argparse.Namespace) -> int:
    from unicron_elastic.node.daemon import NodeDaemon

    job = None
    if args.slurm:  # one task per node of a pool allocation: SLURM's node name, and SLURM's drain drains it
        from unicron_elastic.slurm.job import current_job

        job = current_job()
    name = args.name or (job.node if job is not None else socket.gethostname())
    slots = args.slots if args.slots is not None else _slots_of_this_node(job)
    with _store(args) as store:
        store.keys.node(name)  # refuses a name with '/'
        daemon = NodeDaemon(store, name, slots, ttl=args.ttl, launcher_args=args.launcher_arg,
                            leave_timeout=args.leave_timeout)
        _stop_on_signals(daemon.stop, on_sigterm=daemon.drain)  # SIGTERM drains; Ctrl-C, SIGHUP stop now
        if job is not None and args.slurm_poll > 0:
            from unicron_elastic.slurm.drain_watch import NodeWatch

            NodeWatch(job.node, daemon.drain, args.slurm_poll).start()
        return daemon.run()


# -- unicron-coordinator ----------------------------------------------------------------------------
def _policy_config(args: argparse.Namespace):
    from unicron_elastic.coordinator.vocabulary import PolicyConfig
    from unicron_elastic.planner import CostModel, ThroughputModel, gpu_type

    gpu_type(args.gpu)  # refuses an unknown type now
    CostModel(ThroughputModel(gpu_type(args.gpu)), args.failure_rate, args.d_transition)  # checks the ranges
    return PolicyConfig(args.gpu, args.failure_rate, args.d_transition, args.escalate_after, args.window)


def coordinator_parser() -> argparse.ArgumentParser:
    """``unicron-coordinator``'s flags."""

    parser = argparse.ArgumentParser(
        prog="unicron-coordinator",
        description="The cluster's workload manager: leader-elected on etcd (run any number; one leads), "
        "turns node losses and joins, task submissions and completions into plans for all tasks.")
    add_etcd_options(parser, timeout=DAEMON_TIMEOUT_S)
    parser.add_argument("--ttl", type=positive_int, default=5,
                        help="lease TTL of the leader key, seconds: a dead leader is replaced within about this")
    parser.add_argument("--gpu", default="A800-80GB", help="GPU type of the analytic throughput model")
    parser.add_argument("--failure-rate", type=float, default=1.0 / (128 * 7 * 86400 / 4),
                        help="lambda of the cost model, failures per GPU per second")
    parser.add_argument("--d-transition", type=float, default=60.0, help="D_transition of the cost model, seconds")
    parser.add_argument("--escalate-after", type=positive_int, default=3,
                        help="SEV2/SEV3 events on one node within --window that isolate it")
    parser.add_argument("--window", type=bounded(86400 * 365), default=600.0, help="the escalation window, seconds")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    return parser


def coordinator_main(argv: list[str] | None = None) -> int:
    """Console entry point of ``unicron-coordinator``; runs until SIGTERM/SIGINT (then resigns)."""
    from unicron_elastic.api import UnicronError
    from unicron_elastic.logging import configure_logging

    parser = coordinator_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format)
    try:
        from unicron_elastic.coordinator.metrics import CoordinatorMetrics
        from unicron_elastic.coordinator.service import Coordinator

        config = _policy_config(args)
        metrics = CoordinatorMetrics.serve(args.metrics_port) if args.metrics_port is not None else None
        with _store(args) as store:
            coordinator = Coordinator(store, config, ttl=args.ttl, metrics=metrics)
            _stop_on_signals(coordinator.stop)
            coordinator.run()
        return 0
    except (ValueError, UnicronError, OSError) as exc:
        parser.exit(2, f"unicron-coordinator: error: {exc}\n")


# -- unicron cluster up -----------------------------------------------------------------------------
def _cmd_cluster_up(args: argparse.Namespace) -> int:
    from unicron_elastic.node.local_cluster import LocalCluster

    stop = threading.Event()
    _stop_on_signals(stop.set)
    with LocalCluster(args.nodes, args.slots, cluster=args.cluster, launcher_args=args.launcher_arg,
                      etcd_members=args.etcd_members) as cluster:
        print(f"cluster {args.cluster} up: etcd at {cluster.endpoint}, coordinator, {args.nodes} nodes x "
              f"{args.slots} slots\n  unicron status --endpoint {cluster.endpoint} --cluster {args.cluster}\n"
              f"  unicron task submit SPEC.json --endpoint {cluster.endpoint} --cluster {args.cluster}\n"
              "Ctrl-C stops everything.", flush=True)
        reported: set[str] = set()
        while not stop.wait(0.5):
            dead = cluster.dead()
            if dead:
                print(f"stopping: {dead} exited", file=sys.stderr)
                return 1
            for name in set(cluster.dead_nodes()) - reported:
                reported.add(name)
                print(f"node daemon {name} exited (a lost node); the cluster carries on", file=sys.stderr, flush=True)
    return 0


def add_cluster_commands(sub) -> None:
    """Add ``task``, ``node`` and ``cluster`` to ``unicron``'s sub-commands."""

    task = sub.add_parser("task", help="submit, list and cancel the tasks of a coordinated cluster")
    verbs = task.add_subparsers(dest="verb", required=True)
    submit = verbs.add_parser("submit", help="submit a task spec (JSON or YAML)")
    submit.add_argument("spec", help="SPEC.json or SPEC.yaml: name, command, weight, min_workers, max_workers, "
                        "global_batch, model")
    add_etcd_options(submit)
    submit.set_defaults(func=_cmd_task_submit)
    listing = verbs.add_parser("list", help="the tasks and their state")
    add_etcd_options(listing)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_cmd_task_list)
    cancel = verbs.add_parser("cancel", help="stop a task's workers and give its nodes to the others")
    cancel.add_argument("name")
    add_etcd_options(cancel)
    cancel.set_defaults(func=_cmd_task_cancel)

    node = sub.add_parser("node", help="the node daemon: registers the node and runs the workers the plan gives it "
                          "(SIGTERM drains the node first; Ctrl-C, SIGHUP or a second SIGTERM stop at once)")
    add_etcd_options(node, timeout=DAEMON_TIMEOUT_S)
    node.add_argument("--slots", type=positive_int, default=None,
                      help="workers this node runs (its GPUs; with --slurm the default is the GPUs SLURM gave this "
                           "node's task, SLURM_GPUS_ON_NODE)")
    node.add_argument("--name", default=None,
                      help="node name (default: the host name; with --slurm, SLURMD_NODENAME)")
    node.add_argument("--ttl", type=positive_int, default=2, help="lease TTL of the node, seconds")
    node.add_argument("--launcher-arg", action="append", default=[],
                      help="extra unicron-run flag for every task (repeatable), e.g. --launcher-arg=--node-ttl=1")
    node.add_argument("--leave-timeout", type=bounded(86400), default=60.0,
                      help="seconds a launcher asked to leave its task at a step boundary (the plan moved the node) "
                           "gets before it is stopped, and a drain waits for the plan without the node; default 60")
    node.add_argument("--slurm", action="store_true",
                      help="run as this node's task of a SLURM step (srun --ntasks-per-node=1 --no-kill "
                           "--kill-on-bad-exit=0): named SLURMD_NODENAME, drained when SLURM drains the node")
    node.add_argument("--slurm-poll", type=bounded(86400, allow_zero=True), default=10.0,
                      help="with --slurm: seconds between two looks at the node's state in SLURM "
                           "(0: never; default 10)")
    node.set_defaults(func=_cmd_node)

    cluster = sub.add_parser("cluster", help="a whole cluster on this machine, for demos and tests")
    verbs = cluster.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="start etcd, a coordinator and N node daemons on loopback until Ctrl-C")
    up.add_argument("--nodes", type=positive_int, default=3)
    up.add_argument("--slots", type=positive_int, default=2)
    up.add_argument("--cluster", default="local")
    up.add_argument("--etcd-members", type=bounded(9, integer=True), default=1,
                    help="members of the cluster's etcd (default 1; 3 or 5 to survive losing 1 or 2)")
    up.add_argument("--launcher-arg", action="append", default=[], help="extra unicron-run flag for every task")
    up.set_defaults(func=_cmd_cluster_up)


if __name__ == "__main__":
    sys.exit(coordinator_main())
