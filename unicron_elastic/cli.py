"""The ``unicron`` command: cluster tools (``unicron etcd`` ...)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from unicron_elastic.api import UnicronError
from unicron_elastic.logging import configure_logging


def _cmd_etcd(args: argparse.Namespace) -> int:
    from unicron_elastic.store.embedded import EmbeddedEtcd

    with EmbeddedEtcd(cluster=args.cluster) as etcd:
        print(f"etcd ready: --rdzv-endpoint={etcd.endpoint}", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        while not stop.wait(0.5):
            if etcd.proc is not None and etcd.proc.poll() is not None:
                print("etcd exited", file=sys.stderr)
                return 1
    return 0


def render_status(store, limit: int = 10) -> str:
    """What a person wants to see about a cluster: nodes and the latest events."""
    import time

    from unicron_elastic.api import MalformedValueError
    from unicron_elastic.events import ErrorEvent

    lines = [f"cluster {store.config.cluster} at {store.config.endpoint}", "", "nodes:"]
    nodes = store.get_json_prefix(store.keys.nodes())
    for key, info in sorted(nodes.items()):
        lines.append(f"  {key.rsplit('/', 1)[-1]:<32} {info.get('state', '?')}")
    if not nodes:
        lines.append("  (none)")
    lines += ["", f"last {limit} events:"]
    events = []
    for kv in store.get_prefix(store.keys.events())[-limit:]:
        try:
            events.append(ErrorEvent.from_json(kv.value))
        except MalformedValueError:
            lines.append(f"  (malformed value at {kv.key})")
    for e in events:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.detected_at))
        lines.append(f"  {when}Z {e.severity.name} {e.kind:<20} node={e.node} rank={e.rank} {e.message[:60]}")
    if not events:
        lines.append("  (none)")
    return "\n".join(lines)


def _cmd_status(args: argparse.Namespace) -> int:
    from unicron_elastic.api import EtcdConfig
    from unicron_elastic.rendezvous.options import parse_endpoint
    from unicron_elastic.store import StatusStore

    host, port = parse_endpoint(args.endpoint)
    with StatusStore(EtcdConfig(host=host, port=port, cluster=args.cluster, reconnect_timeout=args.timeout)) as store:
        print(render_status(store, args.limit))
    return 0


def _cost_model(args: argparse.Namespace, failure_rate: float):
    from unicron_elastic.planner import CostModel, ThroughputModel, gpu_type

    calibration = ThroughputModel.load_calibration(args.calibration) if args.calibration else {}
    return CostModel(ThroughputModel(gpu_type(args.gpu), calibration), failure_rate, args.d_transition)


def _run_multitask(args: argparse.Namespace) -> str:
    from unicron_elastic.sim import CASES, case_tasks, compare
    from unicron_elastic.sim.report import multitask_table

    if args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus} must be >= 1")
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
    etcd = sub.add_parser("etcd", help="run a private etcd on a free loopback port until Ctrl-C")
    etcd.add_argument("--cluster", default="default")
    etcd.set_defaults(func=_cmd_etcd)
    status = sub.add_parser("status", help="nodes and recent error events of a cluster, from etcd")
    status.add_argument("--endpoint", required=True, help="etcd HOST:PORT (the --rdzv-endpoint)")
    status.add_argument("--cluster", default="default")
    status.add_argument("--limit", type=int, default=10)
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for etcd")
    status.set_defaults(func=_cmd_status)
    sim = sub.add_parser(
        "simulate",
        help="regenerate the paper's evaluation: multi-task table and trace-a/trace-b",
        description="Trace-driven cluster simulation. EXPERIMENT is multitask, trace-a, trace-b, all, "
        "or the path of a trace file (CSV time_s,kind,node,repair_s or JSON).",
    )
    sim.add_argument("experiment", help="multitask | trace-a | trace-b | all | PATH")
    sim.add_argument("--seed", type=int, default=0, help="seed of the generated traces")
    sim.add_argument("--case", type=int, default=5, help="workload case of Table tasks for traces (1-5)")
    sim.add_argument("--gpus", type=int, default=128, help="cluster size for multitask")
    sim.add_argument("--gpu", default="A800-80GB", help="GPU type")
    sim.add_argument("--calibration", default=None, help="CSV/JSON of measured T (model,gpus,flops)")
    sim.add_argument("--d-transition", type=float, default=60.0, help="D_transition of the cost model (s)")
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


if __name__ == "__main__":
    sys.exit(main())
