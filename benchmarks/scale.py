"""The control plane at N nodes x 8 ranks: etcd load, loss detection, joins, re-planning, failover (issue #47).

Emulated nodes (``benchmarks/_scale_emu.py``) run the project's own control-plane code against a real etcd
(one member, or the three-member cluster ``unicron etcd --members 3`` starts), many nodes in this one process:
node daemons, the agents' rendezvous, meeting points, liveness keys and node detectors, the data-parallel
leader's per-step read, and the coordinator. The training is replaced by a thread that steps. Every etcd
request is counted on the client (by role, kind and key family) and on the server (``/metrics``).

Scenarios, each a function of N:

* ``steady``: a coordinator and its standby, N daemons, runs of up to 64 nodes (``--task-nodes``) whose
  rounds form one after the other; then the etcd requests and bytes per node per second by kind over a window;
* ``loss``: one node of a run lost (its leases lapse, nothing cleaned up): the time until each surviving
  node of its run is told (p50, p99, max) and the watch events and writes the loss causes in total;
* ``join``: N agents joining one run at once (``--nnodes=N``): the time until torch's round is complete for
  every one (its rank known: the round), and until every agent is up (its ranks assigned through the c10d
  store, its meeting point and liveness keys written), with the rendezvous transactions and their conflicts
  counted;
* ``plan``: N node records and 100 tasks: a node lost or joined -> the new plan in etcd (median, p99), and the
  plan's size in etcd;
* ``failover``: the leading coordinator lost at N nodes: the time until the standby has planned an event that
  happened meanwhile, against the leader TTL.

    python benchmarks/scale.py --nodes 16,64,256 [--etcd one|three] [--only steady,loss,join,plan,failover]
    python benchmarks/scale.py --report            # tables and plots from benchmarks/scale_results.json

Results accumulate in ``benchmarks/scale_results.json``, one entry per run keyed by everything the run depends
on (:data:`KEY_FIELDS`: the design's label, the scenario, N, the number of etcd members, the node TTL, the
commit, ``-dirty`` when the tree differed from it, and the emulation's settings): a run replaces only a run of
the same key, so a run at another TTL or commit is kept beside it. Entries written before the TTL and the
settings were recorded read as "not recorded" (``None``), never as a default. ``--report`` prints the tables,
the extrapolation to 2,048 nodes (a linear model of the per-node rates measured at the largest N, not a
measurement), the verdicts, and writes the plots (``benchmarks/scale_*.png``); it and every run exit 1 when a
verdict is "NOT met".
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _scale_emu as emu  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "scale_results.json"
TASKS = 100
#: Seconds between two events of the ``plan`` scenario (failures come minutes apart; the coordinator builds the
#: one-step table for the next event after writing each plan, 0.8 s at 2,048 nodes and 100 tasks).
EVENT_GAP_S = 2.0

#: What a run's figures depend on: two runs replace each other in the results file only when all of these are
#: equal (a field an older entry did not record is None, so it never stands for a value).
KEY_FIELDS = ("label", "scenario", "n", "etcd_members", "ttl", "commit", "monitor_interval", "supervise_s",
              "step_time", "task_nodes", "seconds", "events")
#: The etcd of a run by its name on the command line.
ETCD_MEMBERS = {"one": 1, "three": 3}


def _etcd(kind: str):
    from unicron_elastic.store import EmbeddedEtcd
    from unicron_elastic.store.embedded import EmbeddedEtcdCluster

    return (EmbeddedEtcdCluster(3) if kind == "three" else EmbeddedEtcd()).start()


def _endpoints(server) -> list[str]:
    members = getattr(server, "members", None) or [server]
    return [m.endpoint for m in members]


def _config(server, cluster: str):
    return replace(server.config, cluster=cluster, reconnect_timeout=60.0)


def _cpu(server) -> tuple[float, float, float]:
    """(wall, this process' CPU seconds, etcd's CPU seconds over its members) now."""
    import os

    etcd = 0.0
    for member in getattr(server, "members", None) or [server]:
        try:
            fields = open(f"/proc/{member.proc.pid}/stat").read().rsplit(")", 1)[1].split()
            etcd += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, AttributeError, IndexError, ValueError):
            pass
    times = os.times()
    return time.monotonic(), times.user + times.system, etcd


def _cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> dict[str, float]:
    """Cores used between two :func:`_cpu` readings: by the emulation (this process) and by etcd."""
    wall = max(after[0] - before[0], 1e-9)
    return {"emulation_cores": (after[1] - before[1]) / wall, "etcd_cores": (after[2] - before[2]) / wall}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def _by_kind(snap: dict[str, Any], n: int) -> dict[str, Any]:
    """Per node per second and totals by kind, role and family from a meter snapshot."""
    seconds = snap["seconds"]
    kinds: dict[str, float] = collections.Counter()
    kbytes: dict[str, float] = collections.Counter()
    roles: dict[str, float] = collections.Counter()
    families: dict[str, float] = collections.Counter()
    for (role, kind, family), count in snap["calls"].items():
        kinds[kind] += count
        kbytes[kind] += snap["bytes"].get((role, kind, family), 0)
        roles[f"{role}:{kind}"] += count
        families[f"{kind}:{family}"] += count
    writes, write_bytes = emu.writes_of(snap)
    total_bytes = sum(snap["bytes"].values())
    return {
        "seconds": seconds,
        "per_node_per_s": {k: v / n / seconds for k, v in kinds.items()},
        "bytes_per_node_per_s": {k: v / n / seconds for k, v in kbytes.items()},
        "by_role_per_s": {k: v / seconds for k, v in roles.items()},
        "by_family_per_s": {k: v / seconds for k, v in families.items()},
        "writes_per_node_per_s": writes / n / seconds,
        "writes_per_s": writes / seconds,
        "write_bytes_per_s": write_bytes / seconds,
        "requests_per_s": sum(v for k, v in kinds.items() if k != "watch_event" and k != "keepalive_reply") / seconds,
        "bytes_per_s": total_bytes / seconds,
        "bytes_per_node_per_s_total": total_bytes / n / seconds,
        "conflicts": {f"{r}:{f}": c for (r, f), c in snap["conflicts"].items()},
    }


def _sum_by(snap: dict[str, Any], kinds: tuple[str, ...] | None = None) -> dict[str, int]:
    """Calls of a meter snapshot summed by ``kind:family`` (over roles)."""
    out: collections.Counter = collections.Counter()
    for (role, kind, family), count in snap["calls"].items():
        if kinds is None or kind in kinds:
            out[f"{kind}:{family}"] += count
    return dict(out)


# -- steady state and one loss --------------------------------------------------------------------------
def steady_and_loss(server, n: int, seconds: float, settings: emu.Settings, task_nodes: int) -> dict[str, Any]:
    """N daemons on runs of ``task_nodes`` nodes: the steady state over ``seconds``, then one node lost."""
    endpoints = _endpoints(server)
    cluster = emu.EmuCluster(_config(server, f"scale-steady-{n}"), settings, coordinators=2)
    runs = max(1, math.ceil(n / task_nodes))
    out: dict[str, Any] = {"n": n, "runs": runs, "task_nodes": min(n, task_nodes)}
    try:
        cluster.start_coordinators(ttl=5)
        started = time.monotonic()
        names = cluster.start_daemons(n)
        cluster.wait_registered(n, timeout=max(60.0, n / 10))
        placed = 0
        for r in range(runs):  # (once every node is there: each plan places a run whole; one round forms at a time)
            size = min(task_nodes, n - r * task_nodes)
            cluster.submit(f"run{r}", size)
            placed += size
            cluster.wait_count_joined(placed, timeout=max(120.0, 2.0 * size))
        out["formed_s"] = time.monotonic() - started
        time.sleep(max(3.0, settings.keep_alive_interval))  # past the start's writes, one heartbeat period in
        emu.METER.reset()
        before, cpu = emu.server_metrics(endpoints), _cpu(server)
        time.sleep(seconds)
        snap = emu.METER.snapshot()
        server_delta = _delta(emu.server_metrics(endpoints), before)
        out["steady"] = _by_kind(snap, n)
        out["steady"].update(_cores(cpu, _cpu(server)))
        out["steady"]["server_per_s"] = {k: v / snap["seconds"] for k, v in server_delta.items()}
        agents = cluster.agents()
        out["steady"]["waiting_seen"] = sum(a.waiting_seen for a in agents.values())
        out["steady"]["renewed_leases"] = sum(getattr(lease, "renewals", 0) for lease in cluster.leases())
        out["steady"]["emulation_s"] = time.monotonic() - started
        out["loss"] = _lose_one(cluster, endpoints, names, settings)
    finally:
        cluster.close()
    return out


def _lose_one(cluster: emu.EmuCluster, endpoints: list[str], names: list[str], settings: emu.Settings) -> dict:
    victim = names[len(names) // 2]
    runs = {name: agent.task for name, agent in cluster.agents().items()}
    survivors = [x for x in names if x != victim and runs.get(x) == runs.get(victim)]  # (its run's nodes)
    emu.METER.reset()
    before = emu.server_metrics(endpoints)
    killed = time.monotonic()
    cluster.kill(victim)
    deadline = killed + settings.ttl + 15.0
    while time.monotonic() < deadline:
        if len(cluster.losses.get(victim, {})) >= len(survivors):
            break
        time.sleep(0.05)
    time.sleep(2.0)  # what the loss sets off (events, the re-plan, their watchers) settles
    snap = emu.METER.snapshot()
    server_delta = _delta(emu.server_metrics(endpoints), before)
    seen = cluster.losses.get(victim, {})
    delays = [seen[s] - killed for s in survivors if s in seen]
    totals = emu.totals(snap)
    return {
        "survivors": len(survivors), "saw_it": len(delays),
        "p50_s": emu.percentile(delays, 0.5), "p99_s": emu.percentile(delays, 0.99),
        "max_s": max(delays) if delays else float("nan"),
        "watch_events": totals.get("watch_event", 0),
        "watch_events_server": server_delta.get("etcd_debugging_mvcc_events_total", 0.0),
        "writes": emu.writes_of(snap)[0],
        "by_family": _sum_by(snap, ("watch_event", "txn", "put", "deleterange")),
    }


# -- N agents joining one run at once -----------------------------------------------------------------
def join_storm(server, n: int, settings: emu.Settings) -> dict[str, Any]:
    """N agents with ``--nnodes=N`` start at once: seconds until each has its rank; transactions counted."""
    from unicron_elastic.store.client import StatusStore

    emu.install_meter()
    config = _config(server, f"scale-join-{n}")
    stores = {role: StatusStore(emu.role_config(config, role)) for role in ("agent", "worker")}
    endpoint = ",".join(f"{h}:{p}" for h, p in config.members)
    agents = [emu.EmuAgent(stores, endpoint, config.cluster, f"j{i:05d}", "storm", (n, n), settings)
              for i in range(n)]
    emu.METER.reset()
    cpu = _cpu(server)
    started = time.monotonic()
    for agent in agents:
        agent.start()
    deadline = started + max(60.0, 0.25 * n)
    result: dict[str, Any] = {"n": n}
    try:
        while time.monotonic() < deadline and not all(a.joined.is_set() or a.failed for a in agents):
            time.sleep(0.05)
        done = [a.joined_at - started for a in agents if a.joined_at is not None]
        ranked = [a.rendezvous_at - started for a in agents if a.rendezvous_at is not None]
        snap = emu.METER.snapshot()
        result.update(_cores(cpu, _cpu(server)))
        rdzv = {k: v for (r, k, fam), v in snap["calls"].items() if fam == "rdzv"}
        result.update({
            "ranked": len(ranked), "round_s": max(ranked) if len(ranked) == n else float("nan"),
            "round_p50_s": emu.percentile(ranked, 0.5),
            "joined": len(done), "failed": sum(1 for a in agents if a.failed),
            "all_s": max(done) if len(done) == n else float("nan"),
            "p50_s": emu.percentile(done, 0.5),
            "rdzv_txns": sum(v for (r, k, fam), v in snap["calls"].items() if fam == "rdzv" and k == "txn"),
            "rdzv_reads": sum(v for (r, k, fam), v in snap["calls"].items() if fam == "rdzv" and k == "range"),
            "rdzv_bytes": sum(v for (r, k, fam), v in snap["bytes"].items() if fam == "rdzv"),
            "rdzv_conflicts": sum(c for (r, fam), c in snap["conflicts"].items() if fam == "rdzv"),
            "requests": sum(v for (r, k, fam), v in snap["calls"].items() if k not in ("watch_event", "keepalive_reply")),
            "by_family": _sum_by(snap),
            "first_failure": repr(next((a.failed for a in agents if a.failed), None))[:300],
        })
    finally:
        for agent in agents:
            agent.stop()
        for store in stores.values():
            store.close()
    return result


# -- the coordinator: event -> plan, and failover ---------------------------------------------------------
def _records(store, n: int, ttl: int = 3600) -> dict[str, int]:
    from unicron_elastic.coordinator.api import NodeRecord

    leases = {}
    for i in range(n):
        name = f"n{i:05d}"
        leases[name] = store.grant_lease(ttl)
        store.put(store.keys.node(name), NodeRecord(name, 8).to_json(), lease=leases[name])
    return leases


def _tasks(store, n: int, tasks: int) -> None:
    """``tasks`` tasks whose sizes add up to about 1.5 N nodes (so the planner must choose), each on a few sizes."""
    per = max(1, (3 * n) // (2 * tasks))
    for t in range(tasks):
        sizes = sorted({max(1, per // 4), max(1, per // 2), per, 2 * per})
        table = {str(8 * k): float(k) ** 0.9 * (1.0 + (t % 7) / 10) for k in sizes}
        spec = {"name": f"t{t:03d}", "command": ["true"], "weight": 1.0 + (t % 3) / 2, "min_workers": 8 * sizes[0],
                "max_workers": 8 * sizes[-1], "global_batch": 8 * sizes[-1], "model": {"calibration": table}}
        store.put(store.keys.task_spec(f"t{t:03d}"), json.dumps(spec))


def _plan_watch(store):
    from unicron_elastic.coordinator.api import ClusterPlan
    from unicron_elastic.store.watch import PrefixWatch

    seen = threading.Condition()
    latest = {"generation": -1, "at": 0.0, "size": 0}

    def on_plan(event) -> None:
        if event.kind == "put":
            with seen:
                latest.update(generation=ClusterPlan.from_json(event.value).generation, at=time.monotonic(),
                              size=len(event.value))
                seen.notify_all()

    return PrefixWatch(store, store.keys.plan(), on_plan), seen, latest


def _wait_plan(seen, latest, want: int, timeout: float) -> float:
    with seen:
        if not seen.wait_for(lambda: latest["generation"] >= want, timeout=timeout):
            raise TimeoutError(f"no plan generation {want} within {timeout}s")
        return latest["at"]


def _coordinator(store_config, ttl: int, name: str):
    from unicron_elastic.coordinator.service import Coordinator
    from unicron_elastic.coordinator.vocabulary import PolicyConfig
    from unicron_elastic.store.client import StatusStore

    store = StatusStore(emu.role_config(store_config, "coordinator"))
    timings: list[float] = []
    c = Coordinator(store, PolicyConfig(failure_rate=1e-4), ttl=ttl, candidate=name, alert=lambda a: None,
                    on_plan=lambda plan, elapsed: timings.append(elapsed))
    thread = threading.Thread(target=c.run, name=name, daemon=True)
    thread.start()
    return c, thread, timings


def event_to_plan(server, n: int, events: int, tasks: int = TASKS) -> dict[str, Any]:
    """N node records, ``tasks`` tasks: node lost / joined alternately -> the new plan seen in etcd."""
    from unicron_elastic.coordinator.api import NodeRecord
    from unicron_elastic.coordinator.service import read_plan
    from unicron_elastic.store.client import StatusStore

    emu.install_meter()
    config = _config(server, f"scale-plan-{n}")
    admin = StatusStore(emu.role_config(config, "admin"))
    leases = _records(admin, n)
    _tasks(admin, n, tasks)
    c, thread, timings = _coordinator(config, 5, "plan-leader")
    result: dict[str, Any] = {"n": n, "tasks": tasks}
    try:
        deadline = time.monotonic() + 600
        while (plan := read_plan(admin)) is None or len(plan.nodes) < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("no first plan within 600 s")
            time.sleep(0.1)
        result["first_plan_s"] = timings[0] if timings else float("nan")
        watch, seen, latest = _plan_watch(admin)
        with seen:
            latest["generation"] = plan.generation
        latencies, inside = [], []
        for i in range(events):
            time.sleep(EVENT_GAP_S)  # events come apart (the table for the next one is built after each plan)
            with seen:
                want = latest["generation"] + 1
            node = f"n{(7 * i // 2) % n:05d}"
            before = len(timings)
            began = time.monotonic()
            if i % 2 == 0:
                admin.call(lambda cl, lease=leases[node]: cl.revoke_lease(lease), "revoke")
            else:
                leases[node] = admin.grant_lease(3600)
                admin.put(admin.keys.node(node), NodeRecord(node, 8).to_json(), lease=leases[node])
            at = _wait_plan(seen, latest, want, 120)
            latencies.append(at - began)
            inside.extend(timings[before:])
        watch.cancel()
        keys = admin.keys
        state = admin.get(keys.coordinator_state())
        commands = admin.get_prefix(f"{keys.prefix}commands/")
        result.update({
            "median_s": statistics.median(latencies), "p99_s": emu.percentile(latencies, 0.99),
            "max_s": max(latencies), "coordinator_median_s": statistics.median(inside) if inside else float("nan"),
            "plan_bytes": latest["size"] or len(admin.get(keys.plan()).value),
            "state_bytes": len(state.value) if state else 0,
            "commands_bytes": sum(len(kv.value) for kv in commands), "commands": len(commands),
            "events": events,
        })
    finally:
        c.stop()
        thread.join(30)
        admin.close()
    return result


def failover(server, n: int, ttl: int = 5, tasks: int = TASKS) -> dict[str, Any]:
    """The leader lost at N nodes (its lease lapses): seconds until the standby plans an event of meanwhile."""
    from unicron_elastic.coordinator.service import read_plan
    from unicron_elastic.store.client import StatusStore

    emu.install_meter()
    config = _config(server, f"scale-failover-{n}")
    admin = StatusStore(emu.role_config(config, "admin"))
    leases = _records(admin, n)
    _tasks(admin, n, tasks)
    leader, lthread, _ = _coordinator(config, ttl, "leader")
    deadline = time.monotonic() + 600
    while (plan := read_plan(admin)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("no first plan within 600 s")
        time.sleep(0.1)
    standby, sthread, stimings = _coordinator(config, ttl, "standby")
    time.sleep(1.0)
    watch, seen, latest = _plan_watch(admin)
    with seen:
        latest["generation"] = plan.generation
    try:
        lease = leader.election._lease
        killed = time.monotonic()
        lease._stop.set()  # the leader's process is gone: its lease lapses, nothing is revoked
        lease.lost.set()
        leader.stopped.set()
        leader.store.close()
        node = f"n{n // 3:05d}"
        admin.call(lambda cl: cl.revoke_lease(leases[node]), "revoke")  # an event while no one leads
        at = _wait_plan(seen, latest, plan.generation + 1, ttl + 120)
        took = at - killed
        deadline = time.monotonic() + 10
        while not stimings and time.monotonic() < deadline:  # (its on_plan runs just after the write)
            time.sleep(0.05)
        return {"n": n, "ttl_s": ttl, "seconds": took, "beyond_ttl_s": took - ttl,
                "standby_step_s": stimings[0] if stimings else float("nan")}
    finally:
        watch.cancel()
        standby.stop()
        sthread.join(30)
        admin.close()


# -- results, tables, plots -------------------------------------------------------------------------------
def migrate(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry of any version of the results file with every key field present.

    A field the entry did not record is None ("not recorded"), the TTL included: an old entry's TTL is not
    taken for the default. The number of etcd members follows from its recorded etcd.
    """
    out = dict(entry)
    for name in KEY_FIELDS:
        out.setdefault(name, None)
    if out["etcd_members"] is None:
        out["etcd_members"] = ETCD_MEMBERS.get(out.get("etcd"))
    return out


def run_key(entry: dict[str, Any]) -> tuple:
    """The values of :data:`KEY_FIELDS` of an entry: equal only for runs of the same design, size and setup."""
    entry = migrate(entry)
    return tuple(entry[name] for name in KEY_FIELDS)


def _load() -> dict[str, Any]:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": []}
    return {**data, "runs": [migrate(r) for r in data["runs"]]}


def _save(entry: dict[str, Any]) -> None:
    """Append ``entry``, replacing a run of the same key only (:func:`run_key`); the file keeps the order."""
    data = _load()
    key = run_key(entry)
    data["runs"] = [r for r in data["runs"] if run_key(r) != key] + [migrate(entry)]
    RESULTS.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def _commit() -> str:
    """The short commit of the tree measured, ``-dirty`` when tracked files differ from it; ``?`` without git."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("diff", "--quiet", "HEAD", "--")
    except OSError:
        return "?"
    if head.returncode != 0:
        return "?"
    return head.stdout.strip() + ("-dirty" if dirty.returncode != 0 else "")


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    """What every entry of this invocation records besides its result (the key fields among them)."""
    now = datetime.now(timezone.utc)
    return {"label": args.label, "etcd": args.etcd, "etcd_members": ETCD_MEMBERS[args.etcd],
            "date": now.strftime("%Y-%m-%d"), "recorded": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "ttl": args.ttl, "monitor_interval": args.monitor_interval, "supervise_s": args.supervise,
            "step_time": args.step_time, "task_nodes": args.task_nodes, "seconds": args.seconds,
            "events": args.events, "commit": _commit(),
            "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
            "command": " ".join(["python", "benchmarks/scale.py", *sys.argv[1:]])}


def run(args: argparse.Namespace) -> int:
    """Measure each scenario at each N, record each run, print the report; returns the report's exit code."""
    from unicron_elastic.node import daemon

    settings = emu.Settings(ttl=args.ttl, step_time=args.step_time, monitor_interval=args.monitor_interval)
    daemon.SUPERVISE_S = args.supervise  # (the daemon's look at its launcher: no etcd request)
    scenarios = args.only.split(",")
    meta = _meta(args)
    for n in [int(x) for x in args.nodes.split(",") if x]:
        for scenario in scenarios:
            server = _etcd(args.etcd)
            began = time.monotonic()
            try:
                if scenario == "steady":
                    result = steady_and_loss(server, n, args.seconds, settings, args.task_nodes)
                elif scenario == "join":
                    result = join_storm(server, n, settings)
                elif scenario == "plan":
                    result = event_to_plan(server, n, args.events)
                elif scenario == "failover":
                    result = failover(server, n)
                else:
                    raise SystemExit(f"unknown scenario {scenario!r}")
            except Exception as exc:  # noqa: BLE001 - one N failing is a result too (the emulation's limit)
                result = {"n": n, "error": f"{type(exc).__name__}: {exc}"[:500]}
            finally:
                server.stop()
            result["wall_s"] = time.monotonic() - began
            print(json.dumps({"scenario": scenario, **result}, default=str)[:2000], flush=True)
            _save({**meta, "scenario": scenario, "n": n, "result": result})
    import _scale_report

    return _scale_report.report(_load())


def main() -> int:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="16,64,256", help="comma-separated N")
    parser.add_argument("--etcd", choices=("one", "three"), default="one")
    parser.add_argument("--only", default="steady,join,plan,failover")
    parser.add_argument("--seconds", type=float, default=20.0, help="steady-state window")
    parser.add_argument("--events", type=int, default=20, help="events of the plan scenario")
    parser.add_argument("--ttl", type=int, default=2)
    parser.add_argument("--task-nodes", type=int, default=64,
                        help="nodes per run in the steady scenario (N nodes make ceil(N / this) runs)")
    parser.add_argument("--step-time", type=float, default=1.0)
    parser.add_argument("--monitor-interval", type=float, default=0.1,
                        help="torchrun's --monitor-interval of the emulated agents (how often they ask num_nodes_waiting)")
    parser.add_argument("--supervise", type=float, default=0.2,
                        help="seconds between the daemons' looks at their launchers (no etcd request)")
    parser.add_argument("--label", default="after", help="the design measured (before/after a change)")
    parser.add_argument("--report", action="store_true", help="print the tables and write the plots, run nothing")
    args = parser.parse_args()
    if args.report:
        import _scale_report

        return _scale_report.report(_load())
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
