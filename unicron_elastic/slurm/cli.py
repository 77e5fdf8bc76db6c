"""``unicron slurm layout``, ``etcd`` and ``endpoint``: the store inside a SLURM allocation; ``requeue``.

Bad input, a process outside a SLURM job and a failing ``scontrol`` are one
``unicron: error: ...`` line and exit code 2 (``unicron``'s ``main``).
"""

from __future__ import annotations

import argparse
import sys

from unicron_elastic.cli_options import bounded

#: Default members of the allocation's etcd (survives losing one node).
DEFAULT_MEMBERS = 3


def _members_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--members", type=int, default=DEFAULT_MEMBERS,
                        help=f"members on the job's first N nodes (odd, 1-5; default {DEFAULT_MEMBERS}: "
                             "losing any one node keeps the store)")
    parser.add_argument("--port-base", type=int, default=None,
                        help="first port of the members (clients PORT+i, peers PORT+5+i; default: derived from "
                             "the job id, 20000-32759)")


def _layout_option(parser: argparse.ArgumentParser) -> None:
    from unicron_elastic import env

    parser.add_argument("--layout", default=env.etcd_layout(),
                        help=f"the members as `unicron slurm layout` printed them (default: "
                             f"${env.ETCD_LAYOUT.name}, which the batch script exports once for every step)")


def _cmd_layout(args: argparse.Namespace) -> int:
    from unicron_elastic.slurm.api import layout_to_json
    from unicron_elastic.slurm.etcd import layout_of
    from unicron_elastic.slurm.job import current_job

    print(layout_to_json(layout_of(current_job(), args.members, args.port_base)), flush=True)
    return 0


def _cmd_etcd(args: argparse.Namespace) -> int:
    from unicron_elastic.slurm.etcd import given_layout, serve
    from unicron_elastic.slurm.job import current_job

    layout = given_layout(args.layout)
    return serve(current_job(), layout, grace=args.grace)


def _cmd_endpoint(args: argparse.Namespace) -> int:
    from unicron_elastic.slurm.api import endpoint_list
    from unicron_elastic.slurm.etcd import given_layout, wait_for_cluster

    layout = given_layout(args.layout)
    if args.wait is not None and not wait_for_cluster(layout, args.wait):
        print(f"unicron: error: the etcd members {endpoint_list(layout)} did not answer within {args.wait:g}s "
              "(is `unicron slurm etcd` running as a step of this job?)", file=sys.stderr)
        return 1
    print(endpoint_list(layout), flush=True)
    return 0


def _cmd_requeue(args: argparse.Namespace) -> int:
    from unicron_elastic.slurm.job import current_job, requeue_unless_cancelled

    job = current_job()
    if requeue_unless_cancelled(job, only_if_preempted=args.only_if_preempted):
        print(f"requeued job {job.requeue_id}", flush=True)
        return 0
    return 1


def add_slurm_commands(sub) -> None:
    """Add ``slurm`` (``layout``, ``etcd``, ``endpoint``, ``requeue``) to ``unicron``'s sub-commands."""
    from unicron_elastic.env import ETCD_LAYOUT

    slurm = sub.add_parser("slurm", help="run inside a SLURM allocation (docs/slurm.md)")
    verbs = slurm.add_subparsers(dest="verb", required=True)
    layout = verbs.add_parser(
        "layout", help="decide the etcd members once for the job (names, addresses from SLURM's NodeAddr, ports) "
                       f"and print them: export {ETCD_LAYOUT.name}=$(unicron slurm layout)")
    _members_option(layout)
    layout.set_defaults(func=_cmd_layout)
    etcd = verbs.add_parser(
        "etcd", help="one etcd member on each node of the layout (run it as a step: "
                     "srun --ntasks-per-node=1 --overlap --no-kill --kill-on-bad-exit=0 unicron slurm etcd &)")
    _layout_option(etcd)
    etcd.add_argument("--grace", type=bounded(86400, allow_zero=True), default=60.0,
                      help="seconds a member outlives SLURM's SIGTERM (the launchers stop meanwhile; default 60)")
    etcd.set_defaults(func=_cmd_etcd)
    endpoint = verbs.add_parser("endpoint", help="print the members of the layout as one --rdzv-endpoint list")
    _layout_option(endpoint)
    endpoint.add_argument("--wait", type=bounded(86400), default=None, metavar="SECONDS",
                          help="first wait until a majority of the members answers (exit 1 if not within SECONDS)")
    endpoint.set_defaults(func=_cmd_endpoint)
    requeue = verbs.add_parser("requeue", help="requeue this job (an array task by its own id) unless it was "
                                               "cancelled; exit 1 if it was")
    requeue.add_argument("--only-if-preempted", action="store_true",
                         help="requeue only if SLURM preempted the job (its steps got SIGTERM, not the batch shell)")
    requeue.set_defaults(func=_cmd_requeue)
