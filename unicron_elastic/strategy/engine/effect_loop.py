"""The one loop that executes the protocol's effects, for the real engine and the in-process fake alike.

:class:`~unicron_elastic.strategy.engine.protocol.Protocol` is a generator of
effects (:mod:`~unicron_elastic.strategy.engine.effects`). :func:`execute`
looks each effect up in a table of handlers, sends the handler's result
back, and throws any ``Exception`` the handler raised into the protocol,
which decides what a failure means (a failed collective is a ``RuntimeError``).

A handler may return a generator: :func:`execute` then delegates to it
(``yield from``), so a scheduler that interleaves simulated ranks
(``tests/fake_dp.py``) can let a handler wait without a thread. The real
engine's handlers return values, and :func:`run` drives the loop to its end.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from types import GeneratorType
from typing import Any

__all__ = ["Handlers", "Suspended", "execute", "run"]

#: ``effect type -> handler(effect)``.
Handlers = Mapping[type, Callable[[Any], Any]]


@dataclass(frozen=True)
class Suspended:
    """The loop stopped before executing ``effect`` (one of the types it was told to stop at).

    Resume it with ``pending=effect`` and the same generator.
    """

    effect: Any


def execute(effects: Generator[Any, Any, Any], handlers: Handlers, pending: Any = None,
            until: tuple[type, ...] = ()) -> Generator[None, None, Any]:
    """Execute the effects ``effects`` yields until it returns, and return what it returned.

    Args:
        effects: The protocol's generator.
        handlers: The handler of each effect type.
        pending: An effect it yielded already, to execute first (a suspended run).
        until: Effect types to stop at before executing them: the loop then returns :class:`Suspended`.

    Raises:
        KeyError: An effect has no handler.
        BaseException: What the protocol raised (an exception a handler raised and the protocol did not handle),
            or a ``BaseException`` that is not an ``Exception``, which a handler raised.
    """
    result: Any = None
    error: BaseException | None = None
    effect = pending
    while True:
        if effect is None:
            try:
                effect = effects.send(result) if error is None else effects.throw(error)
            except StopIteration as stop:
                return stop.value
        if isinstance(effect, until):
            return Suspended(effect)
        result, error = None, None
        handler = handlers[type(effect)]
        try:
            result = handler(effect)
            if isinstance(result, GeneratorType):
                result = yield from result
        except Exception as exc:  # noqa: BLE001 - the protocol decides what a failure means
            error = exc
        effect = None


def run(effects: Generator[Any, Any, Any], handlers: Handlers, pending: Any = None,
        until: tuple[type, ...] = ()) -> Any:
    """:func:`execute` to its end, with handlers that never wait (the real engine's).

    Raises:
        RuntimeError: A handler returned a generator that waited (only a scheduler can run that).
        BaseException: See :func:`execute`.
    """
    loop = execute(effects, handlers, pending, until)
    try:
        next(loop)
    except StopIteration as done:
        return done.value
    loop.close()
    raise RuntimeError("an effect handler waited outside a scheduler")
