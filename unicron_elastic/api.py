"""Public types of unicron_elastic: typed errors and frozen configuration records.

Everything that crosses a module boundary is defined here so that callers can
catch one family of errors (:class:`UnicronError`) and build configuration
without importing the modules that do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

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


class PlaceTakenError(UnicronError):
    """A node's place in a rendezvous round was claimed by another node while the node's lease had lapsed."""


class EtcdBinaryNotFoundError(UnicronError, FileNotFoundError):
    """No etcd server binary was found (install ``unicron-elastic[etcd]``)."""


class EtcdStartError(UnicronError, RuntimeError):
    """A private etcd server did not become healthy."""


class NonFiniteError(UnicronError, FloatingPointError):
    """A step's loss or gradients hold a NaN or Inf and no loss scaler skips it: training stops (never NaN weights).

    Attributes:
        step: The step.
        ranks: The launch ranks whose own loss or gradient sums were not finite (the first is the lowest).
    """

    def __init__(self, step: int, ranks: list[int]) -> None:
        who = f"rank {ranks[0]}" if ranks else "a rank"
        more = f" (and ranks {', '.join(map(str, ranks[1:]))})" if len(ranks) > 1 else ""
        super().__init__(f"non-finite loss or gradients in step {step}, first produced by {who}{more}: training "
                         "stops before the optimizer step (parameters are those of the steps before). With a loss "
                         "scaler (precision='16-mixed') such a step is skipped instead")
        self.step, self.ranks = step, list(ranks)


class ShardLostError(UnicronError, LookupError):
    """Every copy of part of a sharded optimizer's state was lost with the ranks that held it.

    With one optimizer instance each share is held by one rank only; with more, this needs every instance's
    holder of the same elements lost at once. Training cannot go on from memory: the run goes back to its newest
    snapshot or checkpoint (restarted workers resume from it, as when no replica is left).

    Attributes:
        start: The first element of the flat range no rank holds.
        end: Where the ranks' holdings resume (the range's end if none does).
    """

    def __init__(self, start: int, end: int) -> None:
        super().__init__(f"optimizer state elements [{start}, {end}) were held only by lost ranks (no other "
                         "optimizer instance keeps a copy): training goes back to the newest snapshot or checkpoint")
        self.start, self.end = start, end


class StateEncodingError(UnicronError, TypeError):
    """A training state holds a value the safe state format cannot carry; the message names its path."""


class StateDecodingError(UnicronError, ValueError):
    """Bytes offered as a training state are not a safe state document (e.g. a pickle); nothing in them ran."""


def lookup(catalogue: Mapping[str, V], kind: str, name: str) -> V:
    """``catalogue[name]``, or a :class:`ConfigError` that lists the known names.

    Raises:
        ConfigError: ``name`` is not in the catalogue.
    """
    try:
        return catalogue[name]
    except KeyError:
        raise ConfigError(f"unknown {kind} {name!r}; known: {', '.join(catalogue)}") from None


#: Largest timeout, in seconds, that any unicron setting accepts: one year (365
#: days). Far beyond any real use and far below where ``timedelta`` (~1e14 s),
#: ``threading`` (``TIMEOUT_MAX``, ~9e9 s) and gRPC deadlines overflow.
MAX_TIMEOUT_S = 365 * 86400.0


def _parse_number(value: object, integer: bool) -> float | int:
    """``value`` (a number or its text) as int/float; ValueError/TypeError if it is none."""
    if isinstance(value, bool):
        raise TypeError("a boolean is not a number")
    if integer and isinstance(value, float):
        if value.is_integer():
            return int(value)
        if math.isfinite(value):
            raise ValueError("not an integer")
        return value  # nan/inf: the range check names the problem
    if integer:
        return int(value)  # type: ignore[call-overload]
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond float range
        return math.inf


def finite_positive(
    name: str, value: object, maximum: float = MAX_TIMEOUT_S, *, allow_zero: bool = False, integer: bool = False
) -> float | int:
    """``value`` as a finite number in ``(0, maximum]`` (``[0, maximum]`` with ``allow_zero``).

    Text is parsed (``"2.5"``), so command-line and ``--rdzv-conf`` values can
    be checked as they come.

    Args:
        name: What the value is, for the message (e.g. ``--rdzv-conf join_timeout``);
            empty for argparse, which names the flag itself.
        value: The number or its text.
        maximum: Largest accepted value (default :data:`MAX_TIMEOUT_S`).
        allow_zero: Accept 0.
        integer: Require an integer; the result is an ``int``.

    Returns:
        The number, ``int`` when ``integer`` else ``float``.

    Raises:
        ConfigError: Not a number, NaN, infinite, too small or above ``maximum``;
            the message names ``name``.
    """
    subject = f"{name}={value!r}" if name else repr(value)
    try:
        number = _parse_number(value, integer)
    except (TypeError, ValueError):
        raise ConfigError(f"{subject} is not {'an integer' if integer else 'a number'}") from None
    low_ok = number >= 0 if allow_zero else number > 0
    if not (low_ok and number <= maximum):  # also false for NaN
        limit = int(maximum) if float(maximum).is_integer() and maximum < 1e15 else f"{maximum:g}"
        raise ConfigError(f"{subject} must be {'>= 0' if allow_zero else '> 0'}, finite and at most {limit}")
    return number


_DEFAULT_HOST, _DEFAULT_PORT = "127.0.0.1", 2379


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach the etcd cluster that holds unicron's shared state.

    Attributes:
        host: Host name or address of the first etcd member.
        port: Client port of that member.
        members: Every member's ``(host, port)``, in the order they are tried
            (empty: the one member ``host``/``port``; else ``host``/``port``
            are its first). A client that loses its member moves on to the next.
        cluster: Name of the unicron cluster; every key lives under
            ``/unicron/<cluster>/``.
        request_timeout: Seconds one gRPC request may take (> 0, at most
            :data:`MAX_TIMEOUT_S`).
        reconnect_timeout: Seconds the store keeps retrying (with a fresh
            client) while etcd is unreachable before it raises
            :class:`StoreUnavailableError` (>= 0, at most :data:`MAX_TIMEOUT_S`).
        ca_cert: Path of the CA certificate; enables TLS.
        cert_key: Path of the client key (with ``cert_cert``) for mutual TLS.
        cert_cert: Path of the client certificate.
        user: User name for etcd authentication.
        password: Password for etcd authentication.

    Raises:
        ConfigError: A field is invalid (non-finite or out-of-range numbers
            included); the message names it.
    """

    host: str = _DEFAULT_HOST
    port: int = _DEFAULT_PORT
    cluster: str = "default"
    request_timeout: float = 5.0
    reconnect_timeout: float = 30.0
    ca_cert: str | None = None
    cert_key: str | None = None
    cert_cert: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    members: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        members = tuple(self.members) or ((self.host, self.port),)
        if self.members and (self.host, self.port) not in ((_DEFAULT_HOST, _DEFAULT_PORT), tuple(members[0])):
            raise ConfigError(f"etcd host:port {member_endpoint(self.host, self.port)} is not the first of "
                              f"the members {_join(members)}: give the members alone")
        checked = []
        for host, port in members:  # (a list of lists when it was read back from JSON)
            if not host:
                raise ConfigError("etcd host must not be empty")
            checked.append((str(host), finite_positive(f"etcd port of {host}", port, 65535, integer=True)))
        if len(set(checked)) != len(checked):
            raise ConfigError(f"etcd members {_join(checked)} name a member twice")
        object.__setattr__(self, "members", tuple(checked))
        object.__setattr__(self, "host", checked[0][0])
        object.__setattr__(self, "port", checked[0][1])
        if not self.cluster or "/" in self.cluster:
            raise ConfigError(f"cluster name {self.cluster!r} must be non-empty and contain no '/'")
        request = finite_positive("request_timeout", self.request_timeout)
        reconnect = finite_positive("reconnect_timeout", self.reconnect_timeout, allow_zero=True)
        object.__setattr__(self, "request_timeout", request)
        object.__setattr__(self, "reconnect_timeout", reconnect)
        if (self.cert_key is None) != (self.cert_cert is None):
            raise ConfigError("cert_key and cert_cert must be given together")
        if (self.user is None) != (self.password is None):
            raise ConfigError("user and password must be given together")

    @property
    def endpoint(self) -> str:
        """The members as ``etcdctl --endpoints`` writes them: ``host:port[,host:port...]``."""
        return _join(self.members)


def member_endpoint(host: str, port: int) -> str:
    """``host:port`` (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _join(members: Any) -> str:
    return ",".join(member_endpoint(host, port) for host, port in members)
