"""The ``unicron`` command: cluster tools (``unicron etcd`` ...)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

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


def build_parser() -> argparse.ArgumentParser:
    """The ``unicron`` argument parser with all sub-commands."""
    parser = argparse.ArgumentParser(prog="unicron", description=__doc__)
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    sub = parser.add_subparsers(dest="command", required=True)
    etcd = sub.add_parser("etcd", help="run a private etcd on a free loopback port until Ctrl-C")
    etcd.add_argument("--cluster", default="default")
    etcd.set_defaults(func=_cmd_etcd)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``unicron``."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
