"""Public types of unicron_elastic: typed errors and frozen configuration records.

Everything that crosses a module boundary is defined here so that callers can
catch one family of errors (:class:`UnicronError`) and build configuration
without importing the modules that do I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

V = TypeVar("V")


class UnicronError(Exception):
    """Base class of every error raised by unicron_elastic."""


class ConfigError(UnicronError, ValueError):
    """A configuration key or value is invalid; the message names it."""


class StoreError(UnicronError):
    """The status store (etcd) could not carry out a request."""


class StoreUnavailableError(StoreError):
    """etcd stayed unreachable for longer than the configured reconnect timeout."""


class MalformedValueError(StoreError):
    """A value read from the store is not the JSON document its key promises."""


class NotLeaderError(StoreError):
    """A write guarded by a fencing token was refused: the caller lost leadership."""


class EtcdBinaryNotFoundError(UnicronError, FileNotFoundError):
    """No etcd server binary was found (install ``unicron-elastic[etcd]``)."""


class EtcdStartError(UnicronError, RuntimeError):
    """A private etcd server did not become healthy."""


def lookup(catalogue: Mapping[str, V], kind: str, name: str) -> V:
    """``catalogue[name]``, or a :class:`ConfigError` that lists the known names.

    Raises:
        ConfigError: ``name`` is not in the catalogue.
    """
    try:
        return catalogue[name]
    except KeyError:
        raise ConfigError(f"unknown {kind} {name!r}; known: {', '.join(catalogue)}") from None


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach the etcd cluster that holds unicron's shared state.

    Attributes:
        host: Host name or address of one etcd member.
        port: Client port of that member.
        cluster: Name of the unicron cluster; every key lives under
            ``/unicron/<cluster>/``.
        request_timeout: Seconds one gRPC request may take.
        reconnect_timeout: Seconds the store keeps retrying (with a fresh
            client) while etcd is unreachable before it raises
            :class:`StoreUnavailableError`.
        ca_cert: Path of the CA certificate; enables TLS.
        cert_key: Path of the client key (with ``cert_cert``) for mutual TLS.
        cert_cert: Path of the client certificate.
        user: User name for etcd authentication.
        password: Password for etcd authentication.
    """

    host: str = "127.0.0.1"
    port: int = 2379
    cluster: str = "default"
    request_timeout: float = 5.0
    reconnect_timeout: float = 30.0
    ca_cert: str | None = None
    cert_key: str | None = None
    cert_cert: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("etcd host must not be empty")
        if not 0 < int(self.port) < 65536:
            raise ConfigError(f"etcd port {self.port!r} is not in 1..65535")
        if not self.cluster or "/" in self.cluster:
            raise ConfigError(f"cluster name {self.cluster!r} must be non-empty and contain no '/'")
        if self.request_timeout <= 0:
            raise ConfigError(f"request_timeout={self.request_timeout!r} must be > 0")
        if self.reconnect_timeout < 0:
            raise ConfigError(f"reconnect_timeout={self.reconnect_timeout!r} must be >= 0")
        if (self.cert_key is None) != (self.cert_cert is None):
            raise ConfigError("cert_key and cert_cert must be given together")
        if (self.user is None) != (self.password is None):
            raise ConfigError("user and password must be given together")

    @property
    def endpoint(self) -> str:
        """The ``host:port`` string of the configured member."""
        return f"{self.host}:{self.port}"
