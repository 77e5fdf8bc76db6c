"""Command-line options the ``unicron`` commands share: how to reach etcd, and argparse types for numbers."""

from __future__ import annotations

import argparse

from unicron_elastic.api import MAX_TIMEOUT_S, ConfigError, EtcdConfig, finite_positive
from unicron_elastic.env import ETCD_PASSWORD
from unicron_elastic.store.endpoints import etcd_password, parse_endpoints

_PASSWORD_FLAGS = {
    "user": "--user",
    "password": "--password",
    "password_file": "--password-file",
    "file_hint": "--password-file PATH",
}

def add_etcd_options(parser: argparse.ArgumentParser, timeout: float = 5.0) -> None:
    """The flags that say how to reach etcd: endpoint, cluster, TLS, user and password, timeout.

    Args:
        parser: The (sub-)command's parser.
        timeout: Default of ``--timeout``: 5 s for one-shot commands, longer for daemons,
            which must ride out an etcd restart.
    """
    parser.add_argument("--endpoint", required=True, help="etcd members, HOST:PORT[,HOST:PORT...] (the --rdzv-endpoint)")
    parser.add_argument("--cluster", default="default")
    parser.add_argument("--ca-cert", default=None, help="CA certificate file; enables TLS")
    parser.add_argument("--cert", default=None, help="client certificate file for mutual TLS (with --key)")
    parser.add_argument("--key", default=None, help="client key file for mutual TLS (with --cert)")
    parser.add_argument("--user", default=None,
                        help=f"etcd user; the password comes from --password-file or ${ETCD_PASSWORD.name}")
    parser.add_argument("--password-file", default=None, help="file holding the etcd password of --user")
    parser.add_argument("--timeout", type=bounded(MAX_TIMEOUT_S), default=timeout,
                        help=f"seconds to keep retrying while etcd is unreachable (> 0, at most one year; "
                             f"default {timeout:g})")


def etcd_config(args: argparse.Namespace) -> EtcdConfig:
    """The :class:`~unicron_elastic.api.EtcdConfig` of :func:`add_etcd_options`' flags.

    Raises:
        ConfigError: --cert without --key (or the reverse), a bad endpoint, a password problem.
    """
    if (args.cert is None) != (args.key is None):
        raise ConfigError("--cert and --key must be given together")
    members = parse_endpoints(args.endpoint, flag="--endpoint")
    password = etcd_password(args.user, None, args.password_file, names=_PASSWORD_FLAGS)
    return EtcdConfig(members=members, cluster=args.cluster, reconnect_timeout=args.timeout,
                      ca_cert=args.ca_cert, cert_cert=args.cert, cert_key=args.key, user=args.user, password=password)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return value


def bounded(maximum: float, *, allow_zero: bool = False, integer: bool = False):
    """argparse type: a finite number > 0 (>= 0 with ``allow_zero``) and at most ``maximum``.

    argparse prints the refusal as ``unicron: error: argument --FLAG: ...`` and exits 2.
    """

    def parse(text: str) -> float | int:
        try:
            return finite_positive("", text, maximum, allow_zero=allow_zero, integer=integer)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse
