"""Parsing and validation of ``--rdzv-conf`` for the ``unicron`` backend (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from unicron_elastic.api import ConfigError, EtcdConfig

#: Every key ``--rdzv-conf`` may carry for this backend, with its meaning.
KNOWN_KEYS: dict[str, str] = {
    "cluster": "unicron cluster name (key prefix /unicron/<cluster>/); default 'default'",
    "task": "name of the task this node trains (used by the coordinator's plan); default: the run id",
    "request_timeout": "seconds one etcd request may take; default 5",
    "reconnect_timeout": "seconds to keep retrying while etcd is unreachable; default 30",
    "store_timeout": "seconds a blocking c10d store read waits; default 300",
    "ca_cert": "CA certificate file; enables TLS",
    "cert_key": "client key file for mutual TLS (with cert_cert)",
    "cert_cert": "client certificate file for mutual TLS (with cert_key)",
    "user": "etcd user name (with password)",
    "password": "etcd password (with user)",
    "join_timeout": "seconds within which the rendezvous must complete; default: torchrun's timeout",
    "last_call_timeout": "extra seconds to wait for more nodes once min is reached; default 30",
    "close_timeout": "seconds within which the rendezvous must close; default 30",
    "heartbeat_timeout": "seconds within which a keep-alive heartbeat must complete; default 5",
    "keep_alive_interval": "seconds between keep-alive heartbeats; default 5",
    "keep_alive_max_attempt": "missed heartbeats before a node is considered dead; default 3",
    "timeout": "torchrun's rendezvous timeout; the join timeout when join_timeout is not set",
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


def _number(key: str, raw: Any, kind: type) -> Any:
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(
            f"--rdzv-conf {key}={raw!r} is not a{'n integer' if kind is int else ' number'}"
        ) from None
    if value <= 0:
        raise ConfigError(f"--rdzv-conf {key}={raw!r} must be > 0")
    return value


def _seconds(values: dict[str, Any], key: str) -> timedelta | None:
    return timedelta(seconds=values[key]) if key in values else None


def parse_endpoint(endpoint: str, default_port: int = 2379) -> tuple[str, int]:
    """Split ``HOST[:PORT]`` (IPv6 in brackets) into host and port.

    Raises:
        ConfigError: The endpoint is empty or its port is not a number.
    """
    endpoint = (endpoint or "").strip()
    if not endpoint:
        raise ConfigError("--rdzv-endpoint must name the etcd server as HOST:PORT")
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        port_text = rest.lstrip(":")
    elif endpoint.count(":") == 1:
        host, port_text = endpoint.split(":")
    else:
        host, port_text = endpoint, ""
    if not port_text:
        return host, default_port
    try:
        return host, int(port_text)
    except ValueError:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: port {port_text!r} is not a number") from None


def parse_options(endpoint: str, run_id: str, config: dict[str, Any]) -> BackendOptions:
    """Validate the rendezvous parameters of the unicron backend.

    Args:
        endpoint: ``--rdzv-endpoint`` (etcd ``HOST[:PORT]``).
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
    host, port = parse_endpoint(endpoint)
    etcd = EtcdConfig(
        host=host,
        port=port,
        cluster=str(config.get("cluster", "default")),
        request_timeout=values.get("request_timeout", 5.0),
        reconnect_timeout=values.get("reconnect_timeout", 30.0),
        ca_cert=config.get("ca_cert"),
        cert_key=config.get("cert_key"),
        cert_cert=config.get("cert_cert"),
        user=config.get("user"),
        password=config.get("password"),
    )
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
