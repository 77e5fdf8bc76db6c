"""The ``unicron`` command: cluster tools (``unicron etcd`` ...)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from unicron_elastic.api import MAX_TIMEOUT_S, UnicronError
from unicron_elastic.cli_options import add_etcd_options, bounded, etcd_config, positive_int
from unicron_elastic.logging import configure_logging


def _cmd_etcd(args: argparse.Namespace) -> int:
    """Run a private etcd until SIGINT, SIGTERM or SIGHUP; it is stopped and its data dir removed.

    The handlers are installed before etcd starts, so a signal during start-up
    stops it too; if this process is killed outright, etcd dies with it (see
    :class:`~unicron_elastic.store.embedded.EmbeddedEtcd`). With ``--members N``
    (N > 1) it runs an N-member cluster: a member that exits is reported, and
    the command ends (exit code 1) once the cluster lost its quorum.

    Raises:
        ConfigError: ``--members`` is below 1.
    """
    from unicron_elastic.store.embedded import EmbeddedEtcd, EmbeddedEtcdCluster

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    single = args.members == 1
    etcd = EmbeddedEtcd(cluster=args.cluster) if single else EmbeddedEtcdCluster(args.members, cluster=args.cluster)
    members = [etcd] if single else etcd.members
    with etcd:
        print(f"etcd ready: --rdzv-endpoint={etcd.endpoint}", flush=True)
        reported: set[str] = set()
        while not stop.wait(0.5):
            exited = [m.endpoint for m in members if m.proc is not None and m.proc.poll() is not None]
            for endpoint in sorted(set(exited) - reported):
                print(f"etcd member {endpoint} exited", file=sys.stderr)
            reported.update(exited)
            if len(exited) > (len(members) - 1) // 2:  # no quorum left
                print("etcd exited" if single else "the etcd cluster lost its quorum", file=sys.stderr)
                return 1
    return 0


_EVENT_TEXT_FIELDS = ("kind", "detector", "node", "task", "message")


def _printable(text: str, width: int | None = None) -> str:
    """``text`` without control characters (no terminal escapes from the store), cut to ``width``."""
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if width is None else clean[:width]


def _number_ok(value: object) -> bool:
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _node_line(kv) -> str:
    """One node record as a status line, or a "(malformed ...)" line for a value of the wrong shape."""
    import json

    try:
        info = json.loads(kv.value)
    except (ValueError, UnicodeDecodeError, RecursionError):
        info = None
    state = info.get("state", "?") if isinstance(info, dict) else None
    if not isinstance(state, str):
        return f"  (malformed node record at {_printable(kv.key)})"
    slots = info.get("slots")
    extra = f" slots={slots}" if isinstance(slots, int) and not isinstance(slots, bool) else ""
    return f"  {_printable(kv.key.rsplit('/', 1)[-1], 64):<32} {_printable(state, 40)}{extra}"


def _event_line(kv) -> str:
    """One stored event as a status line, or a "(malformed ...)" line for a value of the wrong shape."""
    import time

    from unicron_elastic.api import MalformedValueError
    from unicron_elastic.events import ErrorEvent

    try:
        e = ErrorEvent.from_json(kv.value)
        if not (all(isinstance(getattr(e, name), str) for name in _EVENT_TEXT_FIELDS)
                and isinstance(e.rank, int) and not isinstance(e.rank, bool)
                and _number_ok(e.occurred_at) and _number_ok(e.detected_at)):
            raise MalformedValueError(f"wrong field types at {kv.key}")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.detected_at))
    except (MalformedValueError, RecursionError, OverflowError, OSError, ValueError, TypeError):
        return f"  (malformed value at {_printable(kv.key)})"
    return (f"  {when}Z {e.severity.name} {_printable(e.kind, 40):<20} node={_printable(e.node, 64)} "
            f"rank={e.rank} {_printable(e.message, 60)}")


def render_status(store, limit: int = 10) -> str:
    """What a person wants to see about a cluster: nodes and the latest events.

    Only the newest ``limit`` events are read (etcd sorts and limits), so a
    long event history costs nothing. A value of the wrong shape is shown as
    a "(malformed ...)" line; text from the store is stripped of control characters.
    """
    lines = [f"cluster {store.config.cluster} at {store.config.endpoint}", "", "nodes:"]
    lines += [_node_line(kv) for kv in store.get_prefix(store.keys.nodes())] or ["  (none)"]
    lines += ["", f"last {limit} events:"]
    newest = store.get_prefix(store.keys.events(), limit=limit, descending=True)
    lines += [_event_line(kv) for kv in reversed(newest)] or ["  (none)"]
    return "\n".join(lines)


def _status_text(store, limit: int) -> str:
    from unicron_elastic.coordinator.status import cluster_status, render_plan

    return render_status(store, limit) + "\n\n" + render_plan(cluster_status(store, limit))


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from unicron_elastic.coordinator.status import cluster_status
    from unicron_elastic.store import StatusStore

    stopped = threading.Event()
    if args.watch is not None:  # Ctrl-C ends the watch between two reads (inside a gRPC call it could be lost)
        signal.signal(signal.SIGINT, lambda signum, frame: stopped.set())
    with StatusStore(etcd_config(args)) as store:
        while True:
            if args.json:
                print(json.dumps(cluster_status(store, args.limit), sort_keys=True), flush=True)
            else:
                if args.watch is not None and sys.stdout.isatty():
                    print("\033[2J\033[H", end="")
                print(_status_text(store, args.limit), flush=True)
            if args.watch is None:
                return 0
            if stopped.wait(args.watch):
                return 130
            if not args.json:
                print(flush=True)


def _gpus(text: str) -> int:
    """argparse type of ``--gpus``: a whole number in 1..``MAX_GPUS`` (100,000)."""
    from unicron_elastic.planner import MAX_GPUS

    return int(bounded(MAX_GPUS, integer=True)(text))


def _cost_model(args: argparse.Namespace, failure_rate: float):
    from unicron_elastic.planner import CostModel, ThroughputModel, gpu_type

    calibration = ThroughputModel.load_calibration(args.calibration) if args.calibration else {}
    return CostModel(ThroughputModel(gpu_type(args.gpu), calibration), failure_rate, args.d_transition)


def _run_multitask(args: argparse.Namespace) -> str:
    from unicron_elastic.sim import CASES, case_tasks, compare
    from unicron_elastic.sim.report import multitask_table

    cost = _cost_model(args, failure_rate=1.0 / (128 * 7 * 86400 / 4))
    rows = [compare(case, case_tasks(case), args.gpus, cost) for case in sorted(CASES)]
    return f"Multi-task WAF on {args.gpus} x {args.gpu} (weighted PFLOP/s, no failures)\n\n" + multitask_table(rows)


def _run_trace(args: argparse.Namespace, which: str) -> str:
    from tqdm import tqdm

    from unicron_elastic.sim import case_tasks, load_trace, simulate, trace_a, trace_b
    from unicron_elastic.sim.engine import policy
    from unicron_elastic.sim.report import plot, save_json, trace_table

    trace = {"trace-a": trace_a, "trace-b": trace_b}[which](args.seed) if which in ("trace-a", "trace-b") else load_trace(which)
    cost = _cost_model(args, failure_rate=trace.failure_rate())
    policies = ["unicron", *[p for p in args.policies.split(",") if p and p != "unicron"]]
    results = {}
    with tqdm(total=len(trace.events) * len(policies), desc=trace.name, unit="event", disable=None) as bar:
        for name in policies:
            results[name] = simulate(trace, case_tasks(args.case), cost, policy(name), progress=bar.update)
    text = trace_table(trace, results)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot(out / f"{trace.name}.png", trace, results)
        save_json(out / f"{trace.name}.json", trace, results)
        text += f"\n\nwrote {out / (trace.name + '.png')} and {out / (trace.name + '.json')}"
    return text


def _cmd_simulate(args: argparse.Namespace) -> int:
    experiments = ["multitask", "trace-a", "trace-b"] if args.experiment == "all" else [args.experiment]
    for experiment in experiments:
        text = _run_multitask(args) if experiment == "multitask" else _run_trace(args, experiment)
        print(text, end="\n\n", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``unicron`` argument parser with all sub-commands."""
    parser = argparse.ArgumentParser(prog="unicron", description=__doc__)
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    sub = parser.add_subparsers(dest="command", required=True)
    etcd = sub.add_parser("etcd", help="run a private etcd on free loopback ports until Ctrl-C")
    etcd.add_argument("--cluster", default="default")
    etcd.add_argument("--members", type=bounded(9, integer=True), default=1,
                      help="etcd members to run as one cluster (default 1; 3 or 5 to survive losing 1 or 2)")
    etcd.set_defaults(func=_cmd_etcd)
    status = sub.add_parser("status", help="nodes, tasks, the plan and recent error events of a cluster, from etcd")
    add_etcd_options(status)
    status.add_argument("--limit", type=positive_int, default=10, help="newest events to show (>= 1)")
    status.add_argument("--json", action="store_true", help="one JSON document (per refresh) for scripts")
    status.add_argument("--watch", type=bounded(3600), default=None, metavar="SECONDS",
                        help="refresh every SECONDS until Ctrl-C")
    status.set_defaults(func=_cmd_status)
    from unicron_elastic.cluster_cli import add_cluster_commands

    add_cluster_commands(sub)
    from unicron_elastic.slurm.cli import add_slurm_commands

    add_slurm_commands(sub)
    sim = sub.add_parser(
        "simulate",
        help="regenerate the paper's evaluation: multi-task table and trace-a/trace-b",
        description="Trace-driven cluster simulation. EXPERIMENT is multitask, trace-a, trace-b, all, "
        "or the path of a trace file (CSV time_s,kind,node,repair_s or JSON).",
    )
    sim.add_argument("experiment", help="multitask | trace-a | trace-b | all | PATH")
    sim.add_argument("--seed", type=int, default=0, help="seed of the generated traces")
    sim.add_argument("--case", type=int, default=5, help="workload case of Table tasks for traces (1-5)")
    sim.add_argument("--gpus", type=_gpus, default=128, help="cluster size for multitask (1 to 100,000)")
    sim.add_argument("--gpu", default="A800-80GB", help="GPU type")
    sim.add_argument("--calibration", default=None, help="CSV/JSON of measured T (model,gpus,flops)")
    sim.add_argument("--d-transition", type=bounded(MAX_TIMEOUT_S, allow_zero=True), default=60.0,
                     help="D_transition of the cost model (s; >= 0, at most one year)")
    sim.add_argument("--policies", default="megatron,oobleck,bamboo,varuna")
    sim.add_argument("--out", default=None, help="folder for PNG plots and JSON results")
    sim.set_defaults(func=_cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``unicron``; bad input exits 2 with one clear line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format)
    try:
        return int(args.func(args) or 0)
    except (ValueError, UnicronError) as exc:  # bad input or etcd unreachable: the message says which
        parser.exit(2, f"unicron: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
