"""Parsing and validation of ``--rdzv-conf`` for the ``unicron`` backend (pure)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from unicron_elastic.api import MAX_TIMEOUT_S, ConfigError, EtcdConfig, finite_positive
from unicron_elastic.env import ETCD_PASSWORD
from unicron_elastic.store.endpoints import etcd_password, parse_endpoint, parse_endpoints  # noqa: F401 - parse_endpoint(s) named here too

#: Every key ``--rdzv-conf`` may carry for this backend, with its meaning.
KNOWN_KEYS: dict[str, str] = {
    "cluster": "unicron cluster name (key prefix /unicron/<cluster>/); default 'default'",
    "task": "name of the task this node trains (used by the coordinator's plan); default: the run id",
    "request_timeout": "seconds one etcd request may take (at most one year); default 5",
    "reconnect_timeout": "seconds to keep retrying while etcd is unreachable (at most one year); default 30",
    "store_timeout": "seconds a blocking c10d store read waits (at most one year); default 300",
    "ca_cert": "CA certificate file; enables TLS",
    "cert_key": "client key file for mutual TLS (with cert_cert)",
    "cert_cert": "client certificate file for mutual TLS (with cert_key)",
    "user": f"etcd user name; its password comes from password_file or ${ETCD_PASSWORD.name}",
    "password_file": "file holding the etcd password of user (one trailing newline is dropped)",
    "password": "etcd password (with user); visible in ps and logs: prefer password_file or the environment",
    "join_timeout": "seconds within which the rendezvous must complete (at most one year); default: torchrun's timeout",
    "last_call_timeout": "extra seconds to wait for more nodes once min is reached (at most one year); default 30",
    "close_timeout": "seconds within which the rendezvous must close (at most one year); default 30",
    "heartbeat_timeout": "seconds within which a keep-alive heartbeat must complete (at most one year); default 5",
    "keep_alive_interval": "seconds between keep-alive heartbeats (at most one year); default 5",
    "keep_alive_max_attempt": "missed heartbeats before a node is considered dead (at most 1000); default 3",
    "timeout": "torchrun's rendezvous timeout (at most one year); the join timeout when join_timeout is not set",
    "rank": "set by torchrun for the static backend only; ignored",
}

_FLOAT_KEYS = ("request_timeout", "reconnect_timeout", "store_timeout")
_INT_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "timeout",
)


@dataclass(frozen=True)
class BackendOptions:
    """The validated ``--rdzv-conf`` of the unicron backend.

    Attributes:
        etcd: How to reach etcd.
        task: Task name of this node.
        store_timeout: Timeout of blocking c10d store reads.
        join_timeout: Rendezvous join timeout (None: torch's default).
        last_call_timeout: Rendezvous last-call timeout.
        close_timeout: Rendezvous close timeout.
        heartbeat_timeout: Rendezvous heartbeat timeout.
        keep_alive_interval: Seconds between keep-alive heartbeats.
        keep_alive_max_attempt: Missed heartbeats before a node is dead.
    """

    etcd: EtcdConfig
    task: str
    store_timeout: timedelta
    join_timeout: timedelta | None
    last_call_timeout: timedelta | None
    close_timeout: timedelta | None
    heartbeat_timeout: timedelta | None
    keep_alive_interval: int
    keep_alive_max_attempt: int


#: How ``--rdzv-conf`` names the password settings in messages (the ``unicron`` CLI passes its flags).
RDZV_PASSWORD_NAMES = {
    "user": "--rdzv-conf user",
    "password": "--rdzv-conf password",
    "password_file": "--rdzv-conf password_file",
    "file_hint": "password_file=PATH",
}


#: Largest ``keep_alive_max_attempt``: even with the largest interval (one year) a
#: dead node's expiry stays inside ``datetime``'s range.
MAX_KEEP_ALIVE_ATTEMPTS = 1000


def _number(key: str, raw: Any, kind: type) -> Any:
    """``raw`` as a finite ``kind`` > 0, at most the key's maximum (one year of seconds, or 1000 attempts).

    Raises:
        ConfigError: Not a number, NaN, infinite, <= 0 or too large; the message names the key.
    """
    maximum = MAX_KEEP_ALIVE_ATTEMPTS if key == "keep_alive_max_attempt" else MAX_TIMEOUT_S
    return finite_positive(f"--rdzv-conf {key}", raw, maximum, integer=kind is int)


def _seconds(values: dict[str, Any], key: str) -> timedelta | None:
    return timedelta(seconds=values[key]) if key in values else None


_TLS_FILE_KEYS = ("ca_cert", "cert_key", "cert_cert")


def _check_tls_files(config: dict[str, Any]) -> None:
    """Refuse a TLS file that cannot be read now, not after the reconnect timeout.

    Raises:
        ConfigError: ``ca_cert``, ``cert_key`` or ``cert_cert`` names no readable file.
    """
    for key in _TLS_FILE_KEYS:
        path = config.get(key)
        if path is None:
            continue
        if not os.path.isfile(path):
            raise ConfigError(f"--rdzv-conf {key}={path!r}: no such file")
        if not os.access(path, os.R_OK):
            raise ConfigError(f"--rdzv-conf {key}={path!r}: not readable")


def parse_options(endpoint: str, run_id: str, config: dict[str, Any]) -> BackendOptions:
    """Validate the rendezvous parameters of the unicron backend.

    Args:
        endpoint: ``--rdzv-endpoint`` (etcd members, ``HOST[:PORT][,HOST[:PORT]...]``).
        run_id: ``--rdzv-id``.
        config: ``RendezvousParameters.config`` (``--rdzv-conf`` plus keys
            torchrun adds itself).

    Returns:
        The options.

    Raises:
        ConfigError: A key is unknown or a value is invalid; the message names it.
    """
    unknown = sorted(set(config) - set(KNOWN_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown --rdzv-conf key(s) {', '.join(unknown)} for backend 'unicron'; "
            f"known keys: {', '.join(sorted(KNOWN_KEYS))}"
        )
    values: dict[str, Any] = {}
    for key in _FLOAT_KEYS:
        if key in config:
            values[key] = _number(key, config[key], float)
    for key in _INT_KEYS:
        if key in config:
            values[key] = _number(key, config[key], int)
    etcd = EtcdConfig(
        members=parse_endpoints(endpoint),
        cluster=str(config.get("cluster", "default")),
        request_timeout=values.get("request_timeout", 5.0),
        reconnect_timeout=values.get("reconnect_timeout", 30.0),
        ca_cert=config.get("ca_cert"),
        cert_key=config.get("cert_key"),
        cert_cert=config.get("cert_cert"),
        user=config.get("user"),
        password=etcd_password(config.get("user"), config.get("password"), config.get("password_file"),
                               names=RDZV_PASSWORD_NAMES),
    )
    _check_tls_files(config)  # after EtcdConfig: a key without its certificate is named as such first
    if "join_timeout" not in values and "timeout" in values:
        values["join_timeout"] = values["timeout"]
    return BackendOptions(
        etcd=etcd,
        task=str(config.get("task") or run_id),
        store_timeout=timedelta(seconds=values.get("store_timeout", 300.0)),
        join_timeout=_seconds(values, "join_timeout"),
        last_call_timeout=_seconds(values, "last_call_timeout"),
        close_timeout=_seconds(values, "close_timeout"),
        heartbeat_timeout=_seconds(values, "heartbeat_timeout"),
        keep_alive_interval=values.get("keep_alive_interval", 5),
        keep_alive_max_attempt=values.get("keep_alive_max_attempt", 3),
    )
